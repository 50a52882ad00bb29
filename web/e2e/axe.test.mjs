// axe-core (the accessibility engine browsers' audits use), injected into
// the running console in real Chromium: the main views, light and dark, in
// the states that carry the most (a conversation with every kind of part, a
// permission prompt with its diff, the slash-command list open) have no
// serious or critical finding.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";
import { Sessiond, bin, browser, scratch } from "./harness.mjs";

const T = 60_000;
const axeSource = readFileSync(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");

/** The serious and critical violations on the page as it is now. */
async function audit(page) {
  // Evaluated through the DevTools protocol, which the page's CSP does not govern.
  if (!(await page.evaluate(() => typeof window.axe === "object"))) await page.evaluate(axeSource);
  return page.evaluate(async () => {
    const r = await window.axe.run(document, { resultTypes: ["violations"] });
    return r.violations
      .filter((v) => v.impact === "serious" || v.impact === "critical")
      .map((v) => ({ id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.slice(0, 5).map((n) => n.target.join(" ")) }));
  });
}

async function visible(page, selector) {
  await page.locator(selector).first().waitFor({ state: "visible", timeout: T });
}
async function message(page, text) {
  await page.waitForFunction(
    (t) => [...document.querySelectorAll("[data-testid=messages] .msg")].some((m) => m.textContent.includes(t) && !m.classList.contains("streaming")),
    text,
    { timeout: T },
  );
}
async function send(page, text) {
  await page.waitForFunction(() => !document.querySelector(".composer button[type=submit]").disabled, null, { timeout: T });
  await page.fill("textarea[name=message]", text);
  await page.keyboard.press("Enter");
  // Taken: sessiond accepted it (a user sees the box empty before typing on).
  await page.waitForFunction(() => document.querySelector("textarea[name=message]").value === "", null, { timeout: T });
}

test("axe-core: no serious or critical finding on the tasks, task and session views (light and dark)", async () => {
  const { dir, work, data } = scratch("axe");
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "careful"\ncommand = "${bin("acp-demo-agent")}"\npermission_policy = "ask"\n` +
      `env = { ACP_DEMO_USAGE = "1", ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}" }\n`,
  );
  writeFileSync(join(work, "notes.txt"), "keep\nold line");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
  const b = await browser("axe");
  const found = {};
  const check = async (view) => {
    for (const scheme of ["light", "dark"]) {
      await b.page.emulateMedia({ colorScheme: scheme });
      found[`${view} (${scheme})`] = await audit(b.page);
    }
    await b.page.emulateMedia({ colorScheme: "light" });
  };
  try {
    const { page } = b;
    await page.goto(server.url);
    await visible(page, "input[name=title]");
    await page.fill("input[name=title]", "Accessible e2e");
    await page.click("text=Create task");
    await visible(page, "[data-testid=new-session]");
    await check("new task");
    await page.waitForFunction(() => [...document.querySelectorAll("select[name=profile] option")].some((o) => o.value === "careful"), null, { timeout: T });
    await page.selectOption("select[name=profile]", "careful");
    await page.check("input[name=where][value=directory]");
    await page.fill("input[name=worktree]", work);
    await page.click("text=Start session");
    await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });

    // Every kind of part, Markdown, usage; then a permission prompt with its diff.
    await send(page, "**Hello**, see `notes.txt`\n\n- one\n- two");
    await message(page, "turn 1 of session");
    await send(page, "/activity");
    await message(page, "activity: sent");
    await send(page, "/terminal echo hi");
    await message(page, "terminal: exit 0");
    await send(page, "/edit notes.txt keep\nnew line");
    await visible(page, "[data-testid=permissions] [data-testid=permission-diff]");
    await check("session with a permission prompt");
    await page.click("[data-testid=permissions] button[data-option=allow]");
    await message(page, "edit: written");
    await page.locator("[data-testid=thought] summary").first().click();
    await page.fill("textarea[name=message]", "/");
    await visible(page, "[data-testid=slash-commands]");
    await page.click("[data-testid=rename]");
    await check("session with the rename form and the slash commands");
    await b.screenshot("session");

    await page.click("nav a:text-is('Task')");
    await page.waitForSelector("[data-testid=sessions] [data-testid=title]", { timeout: T });
    await check("task");
    await page.click("nav a:text-is('Tasks')");
    await visible(page, "[data-testid=tasks]");
    await check("tasks");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
  const findings = Object.entries(found).filter(([, v]) => v.length);
  assert.deepEqual(findings, [], JSON.stringify(findings, null, 2));
  assert.equal(Object.keys(found).length, 10, "every view audited");
});
