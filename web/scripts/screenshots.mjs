// Regenerates the README's screenshots of the console (docs/console*.png)
// from a real sessiond, agentctl and demo agent in headless Chromium:
// `cargo build --bins && cd web && npm run screenshots` (binaries from
// SESSIOND_BIN_DIR, default target/debug; Chromium from CHROMIUM, default
// /usr/bin/chromium).
import { execFileSync } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sessiond, bin, browser, scratch } from "../e2e/harness.mjs";

const docs = new URL("../../docs/", import.meta.url).pathname;
const T = 60_000;

const { dir, work, data } = scratch("screenshots");
writeFileSync(join(work, "CHANGELOG.md"), "# Changelog\n\n## 1.3\n\n- Faster startup\n- Old wording\n");
for (const args of [["add", "."], ["commit", "-qm", "changelog"]])
  execFileSync("git", ["-c", "user.name=docs", "-c", "user.email=docs@localhost", ...args], { cwd: work });
const config = join(dir, "sessiond.toml");
const agent = (name, extra = "") =>
  `[[agents]]\nname = "${name}"\ncommand = "${bin("acp-demo-agent")}"\n${extra}` +
  `env = { ACP_DEMO_USAGE = "1", ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}" }\n`;
writeFileSync(config, agent("claude-code") + agent("careful", 'permission_policy = "ask"\n'));
const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
const b = await browser("screenshots", { width: 1280, height: 760 });
const { page } = b;

const message = (text) =>
  page.waitForFunction(
    (t) => [...document.querySelectorAll("[data-testid=messages] .msg")].some((m) => m.textContent.includes(t) && !m.classList.contains("streaming")),
    text,
    { timeout: T },
  );
async function send(text) {
  await page.waitForFunction(() => !document.querySelector(".composer button[type=submit]").disabled, null, { timeout: T });
  await page.fill("textarea[name=message]", text);
  await page.keyboard.press("Enter");
}
async function newSession(taskUrl, profile) {
  await page.goto(taskUrl);
  await page.waitForFunction((p) => [...document.querySelectorAll("select[name=profile] option")].some((o) => o.value === p), profile, { timeout: T });
  await page.selectOption("select[name=profile]", profile);
  await page.check("input[name=where][value=directory]");
  await page.fill("input[name=worktree]", work);
  await page.click("text=Start session");
  await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
  await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
}
const shot = async (name) => {
  await page.evaluate(() => document.activeElement?.blur());
  await page.screenshot({ path: join(docs, name) });
  console.log(`wrote docs/${name}`);
};

try {
  await page.goto(server.url);
  await page.fill("input[name=title]", "Prepare the 1.4 release");
  await page.click("text=Create task");
  await page.waitForSelector("[data-testid=new-session]", { timeout: T });
  const taskUrl = page.url();

  // A session that asks before it writes: the prompt shows the change.
  await newSession(taskUrl, "careful");
  await send("Review the **changelog** wording");
  await message("turn 1 of session");
  await send("/edit CHANGELOG.md # Changelog\n\n## 1.4\n\n- Session titles\n\n## 1.3\n\n- Faster startup\n- Clearer wording");
  await page.waitForSelector("[data-testid=permissions] [data-testid=permission-diff]", { timeout: T });
  await page.evaluate(() => window.scrollTo(0, document.body.scrollHeight));
  await shot("console-permission.png");
  await page.click("[data-testid=permissions] button[data-option=reject]");
  await message("edit: not allowed");

  // The main session: activity, a tool call with its diff, the git diff.
  await newSession(taskUrl, "claude-code");
  await send("Update the changelog for 1.4\nand list what changed");
  await message("turn 1 of session");
  await send("/activity");
  await message("activity: sent");
  await send("/edit CHANGELOG.md # Changelog\n\n## 1.4\n\n- Session titles\n- Tool-call diffs\n\n## 1.3\n\n- Faster startup\n- Old wording");
  await message("edit: written");
  await page.click("[data-testid=rename]");
  await page.fill("input[name=session-title]", "Changelog for 1.4");
  await page.keyboard.press("Enter");
  await page.waitForSelector("[data-testid=session-title]:has-text('Changelog for 1.4')", { timeout: T });
  await page.click("role=tab[name='Git']");
  await page.waitForSelector("[data-testid=git-diff] .add:has-text('Tool-call diffs')", { timeout: T });
  await page.fill("textarea[name=message]", "/");
  await page.waitForSelector("[data-testid=slash-commands]", { timeout: T });
  await page.evaluate(() => {
    const el = document.querySelector("[data-testid=messages]");
    const card = [...el.querySelectorAll("[data-testid=tool-call]")].pop();
    el.scrollTop = card.offsetTop - el.offsetTop - 8;
  });
  await shot("console.png");

  // The task's sessions: titles, states, agents, costs, ages.
  await newSession(taskUrl, "claude-code");
  await send("Bump the version numbers");
  await message("turn 1 of session");
  await page.goto(taskUrl);
  await page.waitForFunction(() => document.querySelectorAll("[data-testid=sessions] [data-testid=cost]").length === 3, null, { timeout: T });
  await shot("console-task.png");
} finally {
  await b.close();
  await server.stop();
}
