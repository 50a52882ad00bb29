// The console as a product, end to end (real sessiond + agentctl +
// acp-demo-agent, real headless Chromium): session titles, costs, tool-call
// cards with their diff, slash-command completion, the Files tree following
// the agent's writes. Screenshots go to target/web-e2e/.
import { test } from "node:test";
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sessiond, bin, browser, scratch } from "./harness.mjs";

const T = 60_000;

async function visible(page, selector, timeout = T) {
  await page.locator(selector).first().waitFor({ state: "visible", timeout });
}
/** Waits until the conversation has a complete message containing `text`. */
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
async function waitText(page, selector, text) {
  await page.waitForFunction(([sel, t]) => document.querySelector(sel)?.textContent.includes(t), [selector, text], { timeout: T });
}
async function newSession(page, { work, profile }) {
  await visible(page, "[data-testid=new-session]");
  if (profile) {
    await page.waitForFunction((p) => [...document.querySelectorAll("select[name=profile] option")].some((o) => o.value === p), profile, { timeout: T });
    await page.selectOption("select[name=profile]", profile);
  }
  await page.check("input[name=where][value=directory]");
  await page.fill("input[name=worktree]", work);
  await page.click("text=Start session");
  await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
  await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
  return page.url().split("/").pop();
}
async function createTask(page, title) {
  await page.fill("input[name=title]", title);
  await page.click("text=Create task");
  await visible(page, "[data-testid=new-session]");
  return page.url();
}
/** A profile of the demo agent that reports usage (0.25 USD a turn). */
function meteredConfig(dir) {
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "metered"\ncommand = "${bin("acp-demo-agent")}"\n` +
      `env = { ACP_DEMO_USAGE = "1", ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}" }\n`,
  );
  return config;
}

test("session titles: from the first prompt, then the agent's, renamed by the user; shown, searched, live in the list; costs per turn, session and row", async () => {
  const { dir, work, data } = scratch("titles");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", meteredConfig(dir)] }).start();
  const b = await browser("titles");
  try {
    const { page, context } = b;
    await page.goto(server.url);
    const taskUrl = await createTask(page, "Titles e2e");
    const first = await newSession(page, { work, profile: "metered" });
    assert.match(await page.textContent("[data-testid=session-title]"), /^Session /, "untitled: its short id");

    // The first prompt's first line names it.
    await send(page, "fix the flaky build\nand say why it broke");
    await message(page, "turn 1 of session");
    await waitText(page, "[data-testid=session-title]", "fix the flaky build");
    // Cost per turn (under its prompt) and per session (a badge).
    await waitText(page, "[data-testid=turn-usage]", "cost 0.25 USD");
    await waitText(page, "[data-testid=usage]", "0.25 USD");

    // Renamed from the header; a bad title is refused with the server's reason.
    await page.click("[data-testid=rename]");
    // The box takes no more than the 200 characters a title may have.
    await page.fill("input[name=session-title]", "x".repeat(201));
    assert.equal((await page.inputValue("input[name=session-title]")).length, 200);
    await page.fill("input[name=session-title]", "right\u202eleft");
    await page.keyboard.press("Enter");
    await waitText(page, ".session [role=alert]", "U+202E");
    await page.fill("input[name=session-title]", "Release notes");
    await page.keyboard.press("Enter");
    await waitText(page, "[data-testid=session-title]", "Release notes");
    assert.equal(await page.locator("[data-testid=rename-form]").count(), 0);
    // The agent's title does not replace the user's.
    await send(page, "/activity");
    await message(page, "activity: sent");
    assert.equal(await page.textContent("[data-testid=session-title]"), "Release notes");
    await b.screenshot("titled-session");

    // A second session, watched from the task's list in another tab: the
    // prompt's title, then the agent's, arrive without a reload.
    await page.goto(taskUrl);
    const second = await newSession(page, { work, profile: "metered" });
    const list = await context.newPage();
    await list.goto(taskUrl);
    const row = (id) => list.locator(`[data-testid=sessions] li[data-session="${id}"]`);
    await row(first).locator("[data-testid=title]:has-text('Release notes')").waitFor({ timeout: T });
    await row(first).locator("[data-testid=cost]:has-text('0.5 USD')").waitFor({ timeout: T });
    assert.equal(await row(second).locator("[data-testid=title]").textContent(), "Untitled session");
    await send(page, "/activity");
    await message(page, "activity: sent");
    await row(second).locator("[data-testid=title]:has-text('demo session')").waitFor({ timeout: T });
    await row(second).locator("[data-testid=cost]:has-text('0.25 USD')").waitFor({ timeout: T });
    // Found by its title.
    await list.fill("input[name=search]", "release");
    await list.waitForFunction(() => document.querySelectorAll("[data-testid=sessions] li").length === 1, null, { timeout: T });
    assert.equal(await list.locator("[data-testid=sessions] li").getAttribute("data-session"), first);
    await list.fill("input[name=search]", "");
    await list.close();
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("tool-call cards: a write shows its unified diff (text, never markup) and status; the Files tree follows the agent's writes", async () => {
  const { work, data } = scratch("toolcards");
  writeFileSync(join(work, "notes.txt"), "one\ntwo\nthree\nfour\nfive\nsix\nseven\nold line");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("toolcards");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTask(page, "Tool cards e2e");
    await newSession(page, { work });
    // The Files tab lists the worktree before the agent writes.
    await page.waitForSelector(".files button.file:has-text('README.md')", { timeout: T });
    assert.equal(await page.locator(".files button.file:has-text('created.txt')").count(), 0);

    // `/edit PATH TEXT`: a tool call (kind edit) carrying the change, then
    // the write (the default policy allows it).
    await send(page, "/edit notes.txt one\ntwo\nthree\nfour\nfive\nsix\nseven\nnew line");
    await message(page, "edit: written");
    const card = page.locator("[data-testid=tool-call][data-kind=edit]").last();
    await card.locator(".tool-status:has-text('completed')").waitFor({ timeout: T });
    const rows = await card.locator("[data-testid=tool-diff] div").allTextContents();
    assert.ok(rows.includes("- old line") && rows.includes("+ new line"), JSON.stringify(rows));
    // Unchanged lines far from the change fold into a count.
    assert.ok(rows.some((r) => /⋯ 4 unchanged lines/.test(r)), JSON.stringify(rows));
    assert.match(await card.locator("figcaption").textContent(), /change of notes\.txt \+1 −1/);
    await b.screenshot("tool-card-diff");

    // A new file whose text is markup: shown as text; the tree shows the
    // file without a click (refreshed from the tool call).
    await send(page, "/edit created.txt <b id=injected>bold</b><img src=x onerror=window.__xss=1>");
    await message(page, "edit: written");
    const created = page.locator("[data-testid=tool-call][data-kind=edit]").last();
    await created.locator("figcaption:has-text('new file created.txt')").waitFor({ timeout: T });
    assert.match(await created.locator("[data-testid=tool-diff]").textContent(), /\+ <b id=injected>bold<\/b><img src=x/);
    assert.equal(await page.locator("#injected").count(), 0);
    assert.equal(await page.locator("[data-testid=messages] img").count(), 0);
    assert.equal(await page.evaluate(() => window.__xss), undefined);
    await page.waitForSelector(".files button.file:has-text('created.txt')", { timeout: T });
    // The open file is read again too.
    await page.click(".files button.file:has-text('notes.txt')");
    await page.waitForSelector("[data-testid=file-viewer]:has-text('new line')", { timeout: T });
    await send(page, "/edit notes.txt rewritten by the agent\n");
    await message(page, "edit: written");
    await page.waitForSelector("[data-testid=file-viewer]:has-text('rewritten by the agent')", { timeout: T });
    await b.screenshot("files-refreshed");

    // A failed tool call is marked failed; a terminal's output and exit stay in its card.
    await send(page, "/run");
    await message(page, "run: exit 3");
    const run = page.locator("[data-testid=tool-call][data-kind=execute]").last();
    assert.equal(await run.getAttribute("data-status"), "failed");
    assert.match(await run.locator("pre.command").textContent(), /\$ sh -c make test {2}\(in \/demo\/work\)\nexit 3\n\.\.\./);
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("slash commands: the agent's commands are offered as the message starts with /, picked by arrow keys and Tab or a click, and sent", async () => {
  const { work, data } = scratch("slash");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("slash");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTask(page, "Slash e2e");
    await newSession(page, { work });
    const box = "[data-testid=slash-commands]";
    // No commands from the agent yet: nothing offered.
    await page.fill("textarea[name=message]", "/");
    assert.equal(await page.locator(box).count(), 0);
    // `/activity` makes the demo agent announce `/tool` and `/activity`.
    await send(page, "/activity");
    await message(page, "activity: sent");
    await page.fill("textarea[name=message]", "/");
    await visible(page, box);
    assert.deepEqual(await page.locator(`${box} [role=option] code`).allTextContents(), ["/tool", "/activity"]);
    assert.equal(await page.getAttribute("textarea[name=message]", "aria-activedescendant"), "slash-tool");
    await page.keyboard.press("ArrowDown");
    assert.equal(await page.getAttribute(`${box} [aria-selected=true]`, "id"), "slash-activity");
    await b.screenshot("slash-commands");
    // Typing filters; Tab completes; Enter then sends.
    await page.fill("textarea[name=message]", "/to");
    assert.deepEqual(await page.locator(`${box} [role=option] code`).allTextContents(), ["/tool"]);
    await page.keyboard.press("Tab");
    assert.equal(await page.inputValue("textarea[name=message]"), "/tool ");
    assert.equal(await page.locator(box).count(), 0);
    await page.keyboard.press("Enter");
    await message(page, "tool: done");
    // Escape closes the list; a click picks.
    await page.fill("textarea[name=message]", "/");
    await visible(page, box);
    await page.keyboard.press("Escape");
    assert.equal(await page.locator(box).count(), 0);
    await page.keyboard.type("a");
    await page.click(`${box} [role=option]:has-text('/activity')`);
    assert.equal(await page.inputValue("textarea[name=message]"), "/activity ");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});
