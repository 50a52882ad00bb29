// The console end to end: real sessiond + agentctl + acp-demo-agent, real
// headless Chromium. Screenshots of each step go to target/web-e2e/.
import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { execFileSync, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { join } from "node:path";
import { Sessiond, bin, browser, scratch } from "./harness.mjs";

const T = 60_000;

async function visible(page, selector, timeout = T) {
  await page.locator(selector).first().waitFor({ state: "visible", timeout });
}
async function hidden(page, selector, timeout = T) {
  await page.locator(selector).first().waitFor({ state: "hidden", timeout });
}
/** Waits until the conversation has a message containing `text`. */
async function message(page, text) {
  await page.waitForFunction(
    (t) => [...document.querySelectorAll("[data-testid=messages] .msg")].some((m) => m.textContent.includes(t) && !m.classList.contains("streaming")),
    text,
    { timeout: T },
  );
}
/** The conversation as rendered: [seq, role, text] per message. */
async function conversation(page) {
  return page.$$eval("[data-testid=messages] .msg", (ms) =>
    ms.map((m) => [Number(m.dataset.seq), m.querySelector(".who").textContent, m.querySelector(".text").textContent]),
  );
}
function assertNoGapNoDuplicate(msgs) {
  const seqs = msgs.map(([s]) => s);
  assert.deepEqual(seqs, seqs.map((_, i) => i + 1), `messages are 1..n in order: ${JSON.stringify(msgs)}`);
}
/** The element is in the window and not under the composer pinned to its bottom. */
async function unobscured(page, selector) {
  await page.waitForFunction(
    (sel) => {
      const el = document.querySelector(sel);
      const composer = document.querySelector(".composer");
      if (!el || !composer) return false;
      const r = el.getBoundingClientRect();
      return r.top >= 0 && r.bottom <= composer.getBoundingClientRect().top;
    },
    selector,
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
async function createTaskAndSession(page, { title, work, profile }) {
  await page.fill("input[name=title]", title);
  await page.click("text=Create task");
  await visible(page, "[data-testid=new-session]");
  if (profile) {
    await page.waitForFunction((p) => [...document.querySelectorAll("select[name=profile] option")].some((o) => o.value === p), profile, { timeout: T });
    await page.selectOption("select[name=profile]", profile);
  }
  // These sessions work in the scratch directory itself.
  await page.check("input[name=where][value=directory]");
  await page.fill("input[name=worktree]", work);
  await page.click("text=Start session");
  await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
  await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
}

test("chat streams live, survives SIGTERM and kill -9 of sessiond without gap or duplicate; workspace panel", async () => {
  const { work, data } = scratch("chat");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("chat");
  try {
    const { page } = b;
    await page.goto(server.url);
    await visible(page, "input[name=title]");
    await b.screenshot("tasks-empty");
    await createTaskAndSession(page, { title: "Console e2e", work });
    await b.screenshot("session-ready");

    await send(page, "hello");
    await message(page, 'turn 1 of session');
    await b.screenshot("first-reply");

    // SIGTERM: the page says it is reconnecting, then carries on.
    await b.expectNetworkErrors(true);
    await server.terminate();
    await visible(page, "[data-testid=reconnecting]");
    await b.screenshot("reconnecting-after-sigterm");
    await server.start();
    await hidden(page, "[data-testid=reconnecting]");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await send(page, "second");
    await message(page, 'turn 2 of session');
    assertNoGapNoDuplicate(await conversation(page));

    // kill -9: the same, with the agent left running beside its agentctl.
    await server.kill();
    await visible(page, "[data-testid=reconnecting]");
    await server.start();
    await hidden(page, "[data-testid=reconnecting]");
    await b.expectNetworkErrors(false);
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await send(page, "third");
    await message(page, 'turn 3 of session');
    const msgs = await conversation(page);
    assertNoGapNoDuplicate(msgs);
    assert.deepEqual(
      msgs.map(([, who]) => who),
      ["you", "agent", "you", "agent", "you", "agent"],
      JSON.stringify(msgs),
    );
    assert.equal(msgs.filter(([, , t]) => t.includes("turn 2 of session")).length, 1);
    await b.screenshot("continued-after-kill9");

    // Workspace: read a file, change it with a command, see the git diff.
    await page.click("button.file:has-text('README.md')");
    await page.waitForSelector("[data-testid=file-viewer]:has-text('hello from the worktree')", { timeout: T });
    await b.screenshot("workspace-file");
    await page.click("role=tab[name='Run']");
    await page.fill("input[name=command]", "echo changed by the console >> README.md && echo done");
    await page.click(".run form button[type=submit]");
    await page.waitForSelector("[data-testid=exec-result]:has-text('exit 0')", { timeout: T });
    assert.match(await page.textContent("[data-testid=exec-result] .stdout"), /done/);
    await b.screenshot("workspace-run");
    // A second command: the first one's output goes while it runs (helper-36 #8).
    await page.fill("input[name=command]", "sleep 2 && echo second");
    await page.click(".run form button[type=submit]");
    await page.waitForSelector("[data-testid=exec-running]:has-text('sleep 2 && echo second')", { timeout: T });
    assert.equal(await page.locator("[data-testid=exec-result]").count(), 0, "no stale output while the next command runs");
    await page.waitForSelector("[data-testid=exec-result] .stdout:has-text('second')", { timeout: T });
    assert.doesNotMatch(await page.textContent("[data-testid=exec-result] .stdout"), /done/);
    // Output past the limit says it was cut (helper-47 5).
    await page.fill("input[name=command]", "seq 1 300000");
    await page.click(".run form button[type=submit]");
    await page.waitForSelector("[data-testid=exec-truncated]:has-text('cut at')", { timeout: T });
    await page.click("role=tab[name='Git']");
    await page.waitForSelector("[data-testid=git-diff] .add:has-text('+changed by the console')", { timeout: T });
    await page.waitForSelector("[data-testid=git-status]:has-text('README.md')", { timeout: T });
    await b.screenshot("workspace-git");

    // The task view: live badges from one WatchTask stream.
    await page.click("nav a:text-is('Task')");
    await page.waitForSelector("[data-testid=sessions] [data-testid=state]:has-text('waiting for input')", { timeout: T });
    await page.waitForSelector("[data-testid=sessions] [data-testid=executor]:has-text('executor ready')", { timeout: T });
    await b.screenshot("task-view");
    await page.setViewportSize({ width: 390, height: 844 });
    await b.screenshot("task-view-phone");

    // Stop from the session view.
    await page.setViewportSize({ width: 1280, height: 800 });
    await page.click("[data-testid=sessions] a");
    await page.click("[data-testid=stop]");
    await page.click("[data-testid=confirm-stop]");
    await page.waitForSelector("[data-testid=state]:has-text('cancelled')", { timeout: T });
    await b.screenshot("stopped");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("new-session form: an isolated worktree of a repository and base branch; the diff against the base", async () => {
  const { work, data } = scratch("worktree");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"], env: { SESSIOND_REPOSITORIES: work } }).start();
  const b = await browser("worktree");
  try {
    const { page } = b;
    await page.goto(server.url);
    await visible(page, "input[name=title]");
    await page.fill("input[name=title]", "Isolated work");
    await page.click("text=Create task");
    await visible(page, "[data-testid=new-session]");
    // A worktree of a repository is what the form offers first.
    assert.equal(await page.isChecked("input[name=where][value=repository]"), true);
    assert.equal(await page.locator("input[name=worktree]").count(), 0, "no absolute path to type");
    // The configured repository is offered.
    await page.waitForSelector(`datalist#repositories option[value='${work}']`, { state: "attached", timeout: T });
    // Its branches are offered as the base, the checkout's own first.
    execFileSync("git", ["branch", "feature/other"], { cwd: work });
    await page.fill("input[name=repository]", work);
    await page.waitForSelector("select[name=base] option:text-is('feature/other')", { state: "attached", timeout: T });
    assert.deepEqual(await page.locator("select[name=base] option").allTextContents(), ["feature/other", "main"]);
    assert.equal(await page.inputValue("select[name=base]"), "main");
    await b.screenshot("new-session-repository");
    await page.click("text=Start session");
    await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });

    await send(page, "/edit README.md edited in the worktree");
    await message(page, "edit: written");
    assert.equal(readFileSync(join(work, "README.md"), "utf8"), "hello from the worktree\n", "the repository's checkout is untouched");

    await page.click("role=tab[name='Git']");
    await page.waitForSelector(".git strong:text-matches('branch sessiond/[0-9a-f]{8}-isolated-work')", { timeout: T });
    await page.check("input[name=against-base]");
    await page.waitForSelector("[data-testid=git-diff] .add:has-text('+edited in the worktree')", { timeout: T });
    await page.waitForSelector("[data-testid=git-diff] .del:has-text('-hello from the worktree')", { timeout: T });
    await page.waitForSelector("[data-testid=branch-commits]:has-text('no commits since main')", { timeout: T });
    // Committed work is still "since the base", and listed as a commit.
    await page.click("role=tab[name='Run']");
    await page.fill("input[name=command]", "git -c user.name=e2e -c user.email=e2e@localhost commit -qam 'edit the readme' && echo committed");
    await page.click(".run form button[type=submit]");
    await page.waitForSelector("[data-testid=exec-result]:has-text('exit 0')", { timeout: T });
    // A command a signal ended says which (it said "exit none").
    await page.fill("input[name=command]", "kill -TERM $$");
    await page.click(".run form button[type=submit]");
    await page.waitForSelector("[data-testid=exec-result]:has-text('killed by signal 15')", { timeout: T });
    await page.click("role=tab[name='Git']");
    await page.check("input[name=against-base]");
    await page.waitForSelector("[data-testid=branch-commits]:has-text('edit the readme')", { timeout: T });
    await page.waitForSelector("[data-testid=git-diff] .add:has-text('+edited in the worktree')", { timeout: T });
    await b.screenshot("diff-against-base");

    // The next session of the task is offered the same repository; the
    // list shows each session's branch.
    await page.click("nav a:text-is('Task')");
    await page.waitForSelector("[data-testid=sessions] [data-testid=branch]:text-matches('sessiond/[0-9a-f]{8}-isolated-work')", { timeout: T });
    await page.waitForSelector(`datalist#repositories option[value='${work}']`, { state: "attached", timeout: T });
    // Its branch has a commit nothing else has: a delete is refused for
    // that work, and the console offers what to do with it (it used to
    // end at the error); "keep the worktree" deletes the session and
    // leaves the branch.
    const row = page.locator("[data-testid=sessions] li").first();
    await row.locator("[data-testid=delete]").click();
    await row.locator("[data-testid=confirm-delete]").click();
    await row.locator("[data-testid=delete-keep-worktree]").click();
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=sessions] li").length === 0, null, { timeout: T });
    assert.match(execFileSync("git", ["branch", "--list", "sessiond/*"], { cwd: work }).toString(), /sessiond\/[0-9a-f]{8}-isolated-work/);
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("new-session form on a remote host: its repository's branches, listed by the host's agentctl", async () => {
  const { dir, work, data } = scratch("remote-branches");
  execFileSync("git", ["branch", "feature/remote"], { cwd: work });
  // The "remote host": an agentctl as its operator starts it, no workspace,
  // repositories and worktrees allowed under its directory.
  const executorId = randomUUID();
  const secret = "remote-secret";
  const portFile = join(dir, "agentctl.port");
  const host = spawn(bin("agentctl"), ["--executor-id", executorId, "--listen", "127.0.0.1:0", "--worktree-root", dir, "--port-file", portFile, "--idle-timeout", "120s"], {
    env: { PATH: process.env.PATH, AGENTCTL_SECRET: secret, AGENTCTL_LOG: "warn" },
    stdio: "ignore",
  });
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("remote-branches");
  try {
    for (let i = 0; !existsSync(portFile); i++) {
      assert.ok(i < 200, "the host's agentctl wrote no port file");
      await new Promise((r) => setTimeout(r, 50));
    }
    const url = `http://127.0.0.1:${readFileSync(portFile, "utf8").trim()}`;
    const { page } = b;
    await page.goto(server.url);
    await visible(page, "input[name=title]");
    await page.fill("input[name=title]", "Remote work");
    await page.click("text=Create task");
    await visible(page, "[data-testid=new-session]");
    await page.selectOption("select[name=runtime]", { label: "remote host" });
    await page.fill("input[name=repository]", work);
    // Until the host's agentctl is named the base is typed.
    await visible(page, "input[name=base]");
    await page.fill("input[name=remote-url]", url);
    await page.fill("input[name=remote-secret]", "not the secret");
    await page.fill("input[name=remote-executor]", executorId);
    await page.waitForTimeout(1000);
    assert.equal(await page.locator("select[name=base]").count(), 0, "a refused agentctl lists nothing");
    await page.fill("input[name=remote-secret]", secret);
    await page.waitForSelector("select[name=base] option:text-is('feature/remote')", { state: "attached", timeout: T });
    assert.deepEqual(await page.locator("select[name=base] option").allTextContents(), ["feature/remote", "main"]);
    assert.equal(await page.inputValue("select[name=base]"), "main");
    await b.screenshot("remote-branches");
    assert.deepEqual(b.errors, []);
  } finally {
    host.kill("SIGKILL");
    await b.close();
    await server.stop();
  }
});

test("cancel a running turn: the reply so far stays and the turn shows as cancelled", async () => {
  const { work, data } = scratch("cancel");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("cancel");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Cancel e2e", work });
    // `/long`: the demo agent streams 600 chunks 100 ms apart and honours
    // session/cancel between them.
    await send(page, "/long story");
    await visible(page, "[data-testid=cancel-turn]");
    // Some of the reply has streamed in (its third numbered chunk).
    await page.waitForFunction(
      () => [...document.querySelectorAll("[data-testid=messages] .msg.streaming")].some((m) => m.textContent.includes(" [3]")),
      null,
      { timeout: T },
    );
    await b.screenshot("long-turn-running");
    // At phone width the composer's buttons stay on screen.
    await page.setViewportSize({ width: 390, height: 844 });
    const box = await page.locator("[data-testid=cancel-turn]").boundingBox();
    assert.ok(box && box.x >= 0 && box.x + box.width <= 390, `cancel button within the phone's width: ${JSON.stringify(box)}`);
    await b.screenshot("long-turn-running-phone");
    await page.setViewportSize({ width: 1280, height: 800 });
    await page.click("[data-testid=cancel-turn]");
    await message(page, "the turn was cancelled on request");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await hidden(page, "[data-testid=cancel-turn]");
    const msgs = await conversation(page);
    assertNoGapNoDuplicate(msgs);
    assert.deepEqual(msgs.map(([, who]) => who.split(" ")[0]), ["you", "agent", "system"], JSON.stringify(msgs));
    // The reply so far is kept, and it is not the whole minute-long reply.
    const reply = msgs[1][2];
    assert.match(reply, /^turn 1 of session .*you said "\/long story" \[1\] \[2\] \[3\]/);
    assert.doesNotMatch(reply, /\[600\]/);
    assert.equal(await page.locator("[data-testid=messages] .msg.streaming").count(), 0, "no message is still streaming");
    assert.equal(await page.textContent("[data-testid=messages] .msg.role-1 [data-testid=turn-stop]"), " · turn cancelled");
    await b.screenshot("turn-cancelled");

    // Esc in the composer cancels too; the session takes the next turn.
    await send(page, "/long again");
    await page.waitForFunction(
      () => [...document.querySelectorAll("[data-testid=messages] .msg.streaming")].some((m) => m.textContent.includes(" [1]")),
      null,
      { timeout: T },
    );
    await visible(page, "[data-testid=cancel-turn]");
    await page.focus("textarea[name=message]");
    await page.keyboard.press("Escape");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=turn-stop]").length === 2, null, { timeout: T });
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    // A turn cancelled with a message queued behind it: the queued one
    // starts, and the button cancels it in turn (helper-47 4: it stayed
    // "Cancelling…" and did nothing).
    await send(page, "/long first");
    await page.waitForFunction(
      () => [...document.querySelectorAll("[data-testid=messages] .msg.streaming")].some((m) => m.textContent.includes(" [1]")),
      null,
      { timeout: T },
    );
    await page.fill("textarea[name=message]", "/long second");
    await page.click("[data-testid=send]:has-text('Queue')");
    await visible(page, "[data-testid=queued]");
    await page.click("[data-testid=cancel-turn]");
    await page.waitForFunction(
      () => [...document.querySelectorAll("[data-testid=messages] .msg.streaming")].some((m) => m.textContent.includes('you said "/long second" [1]')),
      null,
      { timeout: T },
    );
    await page.waitForSelector("[data-testid=cancel-turn]:has-text('Cancel turn')", { timeout: T });
    await page.click("[data-testid=cancel-turn]");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=turn-stop]").length === 4, null, { timeout: T });
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await send(page, "after the cancels");
    await message(page, 'you said "after the cancels"');
    assertNoGapNoDuplicate(await conversation(page));
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("ten tabs over HTTP/1.1 (six connections per host) all load and all see a reply; closing the leading tab hands its streams on", async () => {
  const { work, data } = scratch("tabs");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("tabs");
  try {
    const { page, context } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Tabs e2e", work });
    const url = page.url();
    const tabs = [page];
    for (let i = 1; i < 10; i++) {
      const p = await context.newPage();
      p.on("pageerror", (e) => b.errors.push(`tab ${i}: ${e.message}`));
      await p.goto(url);
      tabs.push(p);
    }
    for (const p of tabs) await p.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    // Each tab holding its own stream, the seventh would wait forever for a
    // connection; they share one per session instead.
    await send(tabs[9], "hello from the tenth tab");
    for (const p of tabs) await message(p, 'you said "hello from the tenth tab"');
    await b.screenshot("ten-tabs");
    // The first tab leads (it asked first); closed, another takes over.
    await tabs[0].close();
    await send(tabs[5], "after the leader left");
    for (const p of tabs.slice(1)) await message(p, 'you said "after the leader left"');
    for (const p of tabs.slice(1)) assertNoGapNoDuplicate(await conversation(p));
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("eight tabs on eight sessions over HTTP/1.1 share one stream call: every tab loads, streams a reply, and its calls answer", async () => {
  const { work, data } = scratch("many-sessions");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("many-sessions");
  try {
    const { page, context } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Many sessions e2e", work });
    const [, task, first] = /#\/tasks\/([^/]+)\/sessions\/([^/]+)$/.exec(page.url());
    const ids = [first];
    for (let i = 1; i < 8; i++) {
      const out = execFileSync(bin("sessionctl"), ["session", "create", "--task", task, "--worktree", work, "-q"], {
        env: { ...process.env, SESSIOND_ADDR: `http://${server.addr}`, SESSIOND_TOKEN: "" },
      });
      ids.push(out.toString().trim());
    }
    const tabs = [page];
    for (let i = 1; i < 8; i++) {
      const p = await context.newPage();
      p.on("pageerror", (e) => b.errors.push(`tab ${i}: ${e.message}`));
      await p.goto(`${server.url}#/tasks/${task}/sessions/${ids[i]}`);
      tabs.push(p);
    }
    // With a stream call per session, the six connections per host would
    // all hold streams and the tabs' other calls would wait forever.
    for (const p of tabs) await p.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    for (let i = 0; i < 8; i++) await send(tabs[i], `hello to session ${i}`);
    for (let i = 0; i < 8; i++) await message(tabs[i], `you said "hello to session ${i}"`);
    // A plain call answers in every tab: the workspace's file list.
    for (const p of tabs) await p.waitForSelector("button.file:has-text('README.md')", { timeout: T });
    await b.screenshot("eight-sessions");
    for (const p of tabs) assertNoGapNoDuplicate(await conversation(p));
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("honest states: unknown and malformed ids are not-found pages; Send queues while a turn runs and waits while sessiond is down", async () => {
  const { work, data } = scratch("honest");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("honest");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Honest e2e", work });
    const sessionUrl = page.url();
    const taskUrl = sessionUrl.replace(/\/sessions\/[^/]+$/, "");

    // Docker is not configured here: the form does not offer it.
    await page.goto(taskUrl);
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=new-session] select[name=runtime] option").length === 3, null, { timeout: T });
    assert.deepEqual(
      await page.$$eval("[data-testid=new-session] select[name=runtime] option", (os) => os.map((o) => o.textContent)),
      ["server default", "local process", "remote host"],
    );

    // A session id that does not exist, and a task id that is no id at all.
    await page.goto(`${taskUrl}/sessions/01234567-89ab-7def-8123-456789abcdef`);
    await visible(page, "[data-testid=not-found]:has-text('Session not found')");
    assert.equal(await page.locator("[data-testid=reconnecting]").count(), 0);
    await page.click("text=Back to the task");
    await page.waitForURL(taskUrl, { timeout: T });
    await page.goto(`${server.url}#/tasks/not-a-task-id`);
    await visible(page, "[data-testid=not-found]:has-text('Task not found')");
    await b.screenshot("not-found");

    // While a turn runs, Send queues (Esc cancels the turn): the queue is
    // shown, a queued message can be taken back, and the rest goes to the
    // agent after the turn, in order.
    await page.goto(sessionUrl);
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await send(page, "/long story");
    await visible(page, "[data-testid=cancel-turn]");
    await page.waitForFunction(() => document.querySelector("[data-testid=send]").textContent.trim() === "Queue", null, { timeout: T });
    assert.match(await page.getAttribute("textarea[name=message]", "placeholder"), /queues/);
    await send(page, "queued first");
    await send(page, "queued then taken back");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=queued] li").length === 2, null, { timeout: T });
    await page.click("[data-testid=queued] li:has-text('taken back') button");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=queued] li").length === 1, null, { timeout: T });
    await page.click("[data-testid=cancel-turn]");
    await message(page, "the turn was cancelled on request");
    await message(page, 'you said "queued first"');
    await hidden(page, "[data-testid=queued]");
    await page.waitForFunction(() => document.querySelector("[data-testid=send]").textContent.trim() === "Send", null, { timeout: T });
    assert.equal((await conversation(page)).filter(([, , t]) => t.includes("taken back")).length, 0);

    // sessiond down: Send is off and says why; back, it sends again.
    const others = [await page.context().newPage(), await page.context().newPage()];
    for (const p of others) {
      await p.goto(sessionUrl);
      await p.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    }
    await b.expectNetworkErrors(true);
    await server.kill();
    await visible(page, "[data-testid=banner-unreachable]");
    // A task page and the task list opened while it is down fill in once
    // it is back, with no reload.
    await others[0].evaluate((h) => (location.hash = h), new URL(taskUrl).hash);
    await others[1].evaluate(() => (location.hash = "#/"));
    // One banner, and the badges say they are as last seen.
    await page.waitForSelector("[data-testid=session-badges].stale", { timeout: T });
    assert.equal(await page.locator("[data-testid=reconnecting]").count(), 0);
    assert.equal(await page.locator(".composer button[type=submit]").isDisabled(), true);
    assert.match(await page.getAttribute("textarea[name=message]", "placeholder"), /unreachable/);
    await server.start();
    await hidden(page, "[data-testid=banner-unreachable]");
    await others[0].waitForSelector("[data-testid=sessions] [data-testid=state]", { timeout: T });
    await others[1].waitForSelector("[data-testid=tasks] a", { timeout: T });
    for (const p of others) await p.close();
    await b.expectNetworkErrors(false);
    await send(page, "after the outage");
    await message(page, 'you said "after the outage"');
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("access: focus moves to each page's heading, the conversation scrolls from the keyboard, muted text keeps 4.5:1, permission prompts are announced", async () => {
  const { work, data } = scratch("access");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("access", { width: 1280, height: 480 });
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Access e2e", work });
    await page.waitForFunction(() => document.activeElement?.tagName === "H1", null, { timeout: T });
    assert.match(await page.evaluate(() => document.activeElement.textContent), /^Session /);
    for (let i = 1; i <= 6; i++) {
      await send(page, `line ${i} ` + "words ".repeat(40));
      await message(page, `you said "line ${i} `);
    }
    const list = page.locator("[data-testid=messages]");
    assert.equal(await list.getAttribute("tabindex"), "0");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await list.focus();
    // A key until the list is there (a late update may scroll it once more).
    const scrollBy = async (key, done) => {
      for (let i = 0; i < 50; i++) {
        await page.keyboard.press(key);
        try {
          await page.waitForFunction(done, null, { timeout: 1000 });
          return;
        } catch {}
      }
      assert.fail(`${key} never scrolled the conversation`);
    };
    await scrollBy("Home", () => document.querySelector("[data-testid=messages]").scrollTop === 0);
    await scrollBy("End", () => {
      const l = document.querySelector("[data-testid=messages]");
      return l.scrollTop > 0 && l.scrollTop + l.clientHeight >= l.scrollHeight - 2;
    });
    // WCAG AA for the secondary text: the message labels and muted notes.
    const ratios = await page.evaluate(() => {
      const rgb = (c) => c.match(/[\d.]+/g).slice(0, 4).map(Number);
      const lum = ([r, g, bl]) => {
        const f = (v) => ((v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
        return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(bl);
      };
      const background = (el) => {
        for (let e = el; e; e = e.parentElement) {
          const c = rgb(getComputedStyle(e).backgroundColor);
          if (c.length < 4 || c[3] > 0) return c;
        }
        return [255, 255, 255];
      };
      return [...document.querySelectorAll(".msg .who, .muted")].map((el) => {
        const [a, z] = [lum(rgb(getComputedStyle(el).color)), lum(background(el))].sort((x, y) => y - x);
        return [el.className, (a + 0.05) / (z + 0.05)];
      });
    });
    assert.ok(ratios.length > 0);
    for (const [what, ratio] of ratios) assert.ok(ratio >= 4.5, `${what}: ${ratio.toFixed(2)}:1`);
    assert.equal(await page.getAttribute("[data-testid=permissions-live]", "aria-live"), "assertive");
    // Back to the task: focus on its heading.
    await page.goto(page.url().replace(/\/sessions\/[^/]+$/, ""));
    await page.waitForFunction(() => document.activeElement?.tagName === "H1" && document.activeElement.textContent === "Access e2e", null, { timeout: T });
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("rich conversation: replies as Markdown (no HTML from text), thoughts folded, the plan as a checklist, session metadata not shown", async () => {
  const { work, data } = scratch("rich");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("rich");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Rich e2e", work });
    // The demo agent echoes the prompt in its reply.
    await send(page, "**bold** and `code` <img src=x onerror=window.__xss=1>");
    await message(page, "and code");
    const reply = page.locator("[data-testid=messages] .msg.role-2").last();
    assert.equal(await reply.locator(".md strong").textContent(), "bold");
    assert.equal(await reply.locator(".md code").textContent(), "code");
    assert.equal(await page.locator("[data-testid=messages] img").count(), 0);
    assert.match(await reply.textContent(), /<img src=x onerror=window.__xss=1>/);
    assert.equal(await page.evaluate(() => window.__xss), undefined);

    // `/activity`: a thought, a plan, a tool call, commands, a mode change
    // and the agent's session metadata.
    await send(page, "/activity");
    await message(page, "activity: sent");
    const thought = page.locator("[data-testid=thought]").last();
    assert.equal(await thought.getAttribute("open"), null, "folded");
    assert.equal(await thought.locator("summary").textContent(), "Thinking");
    await thought.locator("summary").click();
    assert.equal(await thought.locator("p").textContent(), "thinking about it");
    const plan = page.locator("[data-testid=plan]").last();
    assert.deepEqual(await plan.locator("li").evaluateAll((ls) => ls.map((l) => l.dataset.status)), ["completed", "in_progress"]);
    assert.match(await plan.textContent(), /read the file.*edit the file/);
    assert.equal(await page.locator("[data-testid=messages] .msg", { hasText: "session_info_update" }).count(), 0);
    await b.screenshot("rich-conversation");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a task's sessions: age shown, found by search and state, deleted after a confirmation", async () => {
  const { work, data } = scratch("list");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("list");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "List e2e", work });
    const taskUrl = page.url().replace(/\/sessions\/[^/]+$/, "");
    const ids = [page.url().split("/").pop()];
    for (let i = 0; i < 2; i++) {
      await page.goto(taskUrl);
      await visible(page, "[data-testid=new-session]");
      await page.check("input[name=where][value=directory]");
      await page.fill("input[name=worktree]", work);
      await page.click("text=Start session");
      await page.waitForURL(/#\/tasks\/[^/]+\/sessions\/[^/]+$/, { timeout: T });
      await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
      ids.push(page.url().split("/").pop());
    }
    await page.goto(taskUrl);
    const rows = "[data-testid=sessions] li";
    await page.waitForFunction((sel) => document.querySelectorAll(sel).length === 3, rows, { timeout: T });
    assert.deepEqual(await page.locator(`${rows} [data-testid=age]`).allTextContents(), ["just now", "just now", "just now"]);
    // Search by (a piece of) an id; filter by state.
    await page.fill("input[name=search]", ids[1].slice(-8));
    assert.deepEqual(await page.locator(rows).evaluateAll((ls) => ls.map((l) => l.dataset.session)), [ids[1]]);
    await page.fill("input[name=search]", "no such session");
    await visible(page, "[data-testid=no-match]");
    await page.fill("input[name=search]", "");
    await page.selectOption("select[name=state-filter]", "7"); // ERROR
    await visible(page, "[data-testid=no-match]");
    await page.selectOption("select[name=state-filter]", "all");
    // Delete asks first; "Keep" keeps it, "Delete for good" deletes it.
    const row = page.locator(`${rows}[data-session="${ids[2]}"]`);
    await row.locator("[data-testid=delete]").click();
    await row.locator("text=Keep").click();
    assert.equal(await page.locator(rows).count(), 3);
    await row.locator("[data-testid=delete]").click();
    await row.locator("[data-testid=confirm-delete]").click();
    await page.waitForFunction((sel) => document.querySelectorAll(sel).length === 2, rows, { timeout: T });
    await page.goto(`${taskUrl}/sessions/${ids[2]}`);
    await visible(page, "[data-testid=not-found]:has-text('Session not found')");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a command the agent runs in a terminal shows in its tool call card: command, output, exit", async () => {
  const { work, data } = scratch("terminal");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("terminal");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Terminal e2e", work });
    // `/terminal CMD`: the demo agent runs `sh -c CMD` through agentctl's
    // ACP terminal, in a tool call whose content is the terminal.
    await send(page, "/terminal echo from-the-terminal; echo to-stderr >&2; exit 4");
    await message(page, "terminal: exit 4");
    const card = page.locator("[data-testid=messages] .msg", { hasText: "tool execute: run echo from-the-terminal" });
    await card.locator("[data-testid=terminal-state]:has-text('exit 4')").waitFor({ timeout: T });
    const output = await card.locator("[data-testid=terminal-output]").textContent();
    assert.match(output, /from-the-terminal/);
    assert.match(output, /to-stderr/);
    assert.match(await card.locator(".terminal-head").textContent(), /^\$ sh -c echo from-the-terminal/);
    // Shown once: inside its tool call, not again on its own.
    assert.equal(await page.locator("[data-testid=terminal]").count(), 1);
    await b.screenshot("terminal-in-tool-call");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a question the agent asks (ACP elicitation): its form, filled and submitted; the agent gets the values", async () => {
  const { work, data } = scratch("question");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("question");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Question e2e", work });
    await send(page, "/ask name city");
    await visible(page, "[data-testid=question]");
    assert.match(await page.textContent("[data-testid=question]"), /The demo agent asks/);
    await page.fill("[data-testid=question] input[name=name]", "Ada");
    await page.fill("[data-testid=question] input[name=city]", "Paris");
    await b.screenshot("question");
    await page.click("[data-testid=question] button[data-option=accept]");
    await message(page, 'answer: accept {"city":"Paris","name":"Ada"}');
    await hidden(page, "[data-testid=question]");
    await send(page, "/ask name");
    await visible(page, "[data-testid=question]");
    await page.click("[data-testid=question] button[data-option=decline]");
    await message(page, "answer: decline");
    // A page to visit: linked only when it is a web address.
    await send(page, "/ask-url javascript:alert(document.domain)");
    await visible(page, "[data-testid=question] [data-testid=unlinked-url]");
    assert.equal(await page.locator("[data-testid=question] a").count(), 0);
    assert.match(await page.textContent("[data-testid=unlinked-url]"), /javascript:alert\(document\.domain\)/);
    await page.click("[data-testid=question] button[data-option=decline]");
    await hidden(page, "[data-testid=question]");
    await send(page, "/ask-url https://example.com/login");
    await visible(page, "[data-testid=question] a");
    assert.equal(await page.getAttribute("[data-testid=question] a", "href"), "https://example.com/login");
    await page.click("[data-testid=question] button[data-option=decline]");
    await hidden(page, "[data-testid=question]");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("permission policy ask: a prompt with a button per option, kept over a reload and a restart, answered from the keyboard", async () => {
  const { dir, work, data } = scratch("permission");
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "careful"\ncommand = "${bin("acp-demo-agent")}"\npermission_policy = "ask"\n` +
      `env = { ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}" }\n`,
  );
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
  const b = await browser("permission");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Permission e2e", work, profile: "careful" });
    // `/permission`: the demo agent asks with options allow / reject and
    // waits for the answer.
    await send(page, "/permission");
    const prompt = "[data-testid=permissions] [role=group]";
    await visible(page, `${prompt} button[data-option=allow]`);
    await visible(page, `${prompt} button[data-option=reject]`);
    // Brought into view, not left below the fold under the composer.
    await unobscured(page, `${prompt} button[data-option=allow]`);
    assert.match(await page.textContent(prompt), /demo permission/);
    // Announced: the always-present live region says what is asked.
    assert.equal(await page.textContent("[data-testid=permissions-live]"), "The agent asks permission: demo permission.");
    // The profile's timeout (default 5 min) rejects it unless answered; the prompt says when.
    assert.match(await page.textContent(`${prompt} [data-testid=permission-expires]`), /rejected automatically at \S.* unless you answer/);
    await b.screenshot("permission-asked");

    // Still waiting after a reload (GetSessionStatus lists it) ...
    await page.reload();
    await visible(page, `${prompt} button[data-option=allow]`);
    // ... and after sessiond restarts while agentctl holds the request.
    await b.expectNetworkErrors(true);
    await server.terminate();
    await visible(page, "[data-testid=reconnecting]");
    await server.start();
    await hidden(page, "[data-testid=reconnecting]");
    await b.expectNetworkErrors(false);
    await page.reload();
    await visible(page, `${prompt} button[data-option=allow]`);
    assert.equal(await page.locator(prompt).count(), 1, "one prompt for one request");
    await b.screenshot("permission-after-restart");

    // Keyboard: from the composer, Shift+Tab reaches the prompt's buttons.
    await page.focus("textarea[name=message]");
    await page.keyboard.press("Shift+Tab");
    await page.keyboard.press("Shift+Tab");
    assert.equal(await page.evaluate(() => document.activeElement?.dataset.option), "allow");
    await page.keyboard.press("Enter");
    await hidden(page, "[data-testid=permissions]");
    await message(page, "permission: allow");
    await message(page, "permission asked for demo permission (selected: Allow)");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    assertNoGapNoDuplicate(await conversation(page));
    await b.screenshot("permission-answered");

    // Answered, it stays answered: not shown again after a reload.
    await page.reload();
    await message(page, "permission: allow");
    assert.equal(await page.locator(prompt).count(), 0);

    // Answered elsewhere (another tab rejects): this tab's prompt goes away
    // with no action of its own (permission.resolved, and the status of the
    // turn's end no longer lists it).
    await send(page, "/permission");
    await visible(page, `${prompt} button[data-option=reject]`);
    const other = await page.context().newPage();
    await other.goto(page.url());
    await other.locator(`${prompt} button[data-option=reject]`).click({ timeout: T });
    await hidden(page, "[data-testid=permissions]");
    await message(page, "permission: reject");
    await other.close();

    // A prompt shows what it approves: `/edit` asks before writing a file,
    // and the request carries the change.
    writeFileSync(join(work, "notes.txt"), "keep\nold line\n");
    await send(page, "/edit notes.txt keep\nnew line\n");
    await visible(page, `${prompt} [data-testid=permission-diff]`);
    const diff = await page.locator(`${prompt} [data-testid=permission-diff] div`).allTextContents();
    assert.ok(diff.includes("+ new line"), JSON.stringify(diff));
    assert.match(await page.textContent(`${prompt} figcaption`), /notes\.txt/);
    await b.screenshot("permission-with-diff");
    await page.click(`${prompt} button[data-option=allow]`);
    await message(page, "edit: written");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("on_demand: after kill -9 of everything, Resume → spinner → the conversation continues", async () => {
  const { work, data } = scratch("resume");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--recovery-mode", "on_demand"] }).start();
  const b = await browser("resume");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Resume e2e", work });
    await send(page, "remember me");
    await message(page, "turn 1 of session");
    const url = page.url();

    await b.expectNetworkErrors(true);
    await server.kill();
    assert.ok(server.killAgentctls().length >= 1, "an agentctl ran for the session");
    await server.start();
    await page.goto(url);
    await b.expectNetworkErrors(false);
    await visible(page, "[data-testid=needs-resume] button:has-text('Resume')");
    await visible(page, "[data-testid=workspace-only]");
    await b.screenshot("needs-resume");
    await page.click("[data-testid=needs-resume] button:has-text('Resume')");
    await hidden(page, "[data-testid=needs-resume]");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await hidden(page, "[data-testid=workspace-only]");
    await b.screenshot("resumed");
    await send(page, "again");
    await message(page, "turn 2 of session");
    assertNoGapNoDuplicate(await conversation(page));
    await b.screenshot("continued-after-resume");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("an agent that cannot load sessions: not-resumable banner, then a new session that works", async () => {
  const { dir, work, data } = scratch("forgetful");
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "forgetful"\ncommand = "${bin("acp-demo-agent")}"\nargs = ["--no-load-session"]\n` +
      `supports_session_resume = false\nenv = { ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}" }\n`,
  );
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
  const b = await browser("forgetful");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Forgetful e2e", work, profile: "forgetful" });
    await send(page, "remember me");
    await message(page, "turn 1 of session");
    const url = page.url();

    await b.expectNetworkErrors(true);
    await server.kill();
    server.killAgentctls();
    await server.start();
    await page.goto(url);
    await b.expectNetworkErrors(false);
    await visible(page, "[data-testid=not-resumable]");
    assert.match(await page.textContent("[data-testid=not-resumable]"), /not_resumable|cannot resume/);
    await visible(page, "[data-testid=workspace-only]");
    await b.screenshot("not-resumable");
    // The workspace stays usable without the agent.
    await page.click("button.file:has-text('README.md')");
    await page.waitForSelector("[data-testid=file-viewer]:has-text('hello from the worktree')", { timeout: T });

    await page.click("[data-testid=not-resumable] button:has-text('Start a new session')");
    await page.waitForFunction((old) => location.href !== old, url, { timeout: T });
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await send(page, "fresh start");
    await message(page, "turn 1 of session");
    await b.screenshot("new-session");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("while sessiond brings an agent back: where it stands, not errors; then the conversation continues", async () => {
  const { dir, work, data } = scratch("recovering");
  // The agent waits at its start while this file exists: the restarted
  // backend's recovery of the session stays open until the test opens it.
  const gate = join(dir, "start-gate");
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "gated"\ncommand = "${bin("acp-demo-agent")}"\n` +
      `env = { ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}", ACP_DEMO_START_GATE_FILE = "${gate}" }\n`,
  );
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
  // A short window (400 px): the banners must leave the composer in view.
  const b = await browser("recovering", { height: 400 });
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Recovering e2e", work, profile: "gated" });
    await send(page, "before the restart");
    await message(page, "turn 1 of session");

    // kill -9 of sessiond and of the agentctls: recovery relaunches the
    // agent, which holds at its start gate. sessiond serves as soon as the
    // workspace is back; the session says its agent is being brought back.
    await b.expectNetworkErrors(true);
    await server.kill();
    server.killAgentctls();
    writeFileSync(gate, "");
    await server.start();
    await visible(page, "[data-testid=agent-recovery]");
    await b.screenshot("agent-recovery-banner");
    // The banners leave the composer in view (helper-36 #7).
    await page.evaluate(() => window.scrollTo(0, 0));
    const box = await page.locator(".composer textarea").boundingBox();
    assert.ok(box && box.y >= 0 && box.y + box.height <= 400, `the composer is in view: ${JSON.stringify(box)}`);
    assert.equal(await page.locator("p.error, [data-testid=not-resumable]").count(), 0, "a banner, not errors");
    // Recovery resumes the agent by itself: no Resume call to action meanwhile.
    assert.equal(await page.locator("[data-testid=needs-resume]").count(), 0);
    // Nothing streams while the agent is down (a cut reply waits to be settled).
    assert.equal(await page.locator("[data-testid=messages].agent-down").count(), 1);
    // A message sent meanwhile is queued at once, to be sent once the
    // agent is back.
    await page.waitForFunction(() => document.querySelector("[data-testid=send]").textContent.trim() === "Queue", null, { timeout: T });
    await page.fill(".composer textarea", "queued while away");
    await page.click("[data-testid=send]:has-text('Queue')");
    await page.waitForSelector("[data-testid=queued]:has-text('queued while away')", { timeout: T });
    assert.match(await page.textContent("[data-testid=queued]"), /once the agent is back/);
    // The task's list says so as well (it showed the recorded state only),
    // and stops saying it once the agent is back.
    await page.click("nav a:text-is('Task')");
    await visible(page, "[data-testid=sessions] [data-testid=recovering]");

    rmSync(gate);
    await hidden(page, "[data-testid=sessions] [data-testid=recovering]");
    await page.click("[data-testid=sessions] a");
    await hidden(page, "[data-testid=agent-recovery]");
    await hidden(page, "[data-testid=banner-recovering]");
    await page.waitForSelector("[data-testid=state]:has-text('waiting for input')", { timeout: T });
    await b.expectNetworkErrors(false);
    // The message queued while the agent was away went first, once.
    await message(page, "turn 2 of session");
    assert.match(await page.textContent("[data-testid=messages]"), /you said "queued while away"/);
    await hidden(page, "[data-testid=queued]");
    await send(page, "after the restart");
    await message(page, "turn 3 of session");
    assertNoGapNoDuplicate(await conversation(page));
    await b.screenshot("recovered");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a token-protected server: sign-in, a wrong token is rejected clearly, the right one works", async () => {
  const { data } = scratch("token");
  const token = "e2e-token-0123456789abcdef";
  const server = await new Sessiond({ data, env: { SESSIOND_API_TOKENS: token } }).start();
  const b = await browser("token");
  try {
    const { page } = b;
    await page.goto(server.url);
    await page.waitForSelector("[data-testid=signin-message]:has-text('needs an API token')", { timeout: T });
    await b.screenshot("signin");
    await page.fill("input[name=token]", "wrong-token-0123456789");
    await page.click("form.signin button[type=submit]");
    await page.waitForSelector("[data-testid=signin-message]:has-text('rejected this API token')", { timeout: T });
    await b.screenshot("wrong-token");
    await page.fill("input[name=token]", token);
    await page.click("form.signin button[type=submit]");
    await visible(page, "input[name=title]");
    await page.fill("input[name=title]", "With a token");
    await page.click("text=Create task");
    await visible(page, "[data-testid=new-session]");
    await b.screenshot("signed-in");
    // Kept for the tab only.
    assert.equal(await page.evaluate(() => sessionStorage.getItem("sessiond.token")), token);
    assert.equal(await page.evaluate(() => localStorage.length), 0);
    // Chromium logs the 16 of a refused call? It must not: gRPC errors are
    // HTTP 200 with grpc-status in the body or headers.
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a turn interrupted by a crash is not re-run by itself; Retry runs it again on request", async () => {
  const { dir, work, data } = scratch("retry");
  const side = join(dir, "side-effects.txt");
  const gate = join(dir, "gate");
  const config = join(dir, "sessiond.toml");
  writeFileSync(
    config,
    `[[agents]]\nname = "tools"\ncommand = "${bin("acp-demo-agent")}"\n` +
      `env = { ACP_DEMO_STATE_DIR = "${join(dir, "demo-state")}", ACP_DEMO_SIDE_EFFECT_FILE = "${side}", ACP_DEMO_GATE_FILE = "${gate}" }\n`,
  );
  const lines = () => (existsSync(side) ? readFileSync(side, "utf8").split("\n").filter(Boolean) : []);
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--config", config] }).start();
  const b = await browser("retry");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Retry e2e", work, profile: "tools" });
    // The agent runs its tool call, then holds at the gate: sessiond and
    // agentctl die in the middle of the turn.
    writeFileSync(gate, "");
    await send(page, "edit the file");
    const deadline = Date.now() + T;
    while (lines().length < 1) {
      assert.ok(Date.now() < deadline, "the agent never ran its tool call");
      await new Promise((r) => setTimeout(r, 20));
    }
    const url = page.url();
    await b.expectNetworkErrors(true);
    await server.kill();
    assert.ok(server.killAgentctls().length >= 1, "an agentctl ran for the session");
    rmSync(gate);
    await server.start();
    await page.goto(url);
    // Refused fetches of the page before the restart may be reported late.
    await visible(page, "[data-testid=interrupted] button:has-text('Retry it')");
    await unobscured(page, "[data-testid=interrupted] button");
    await b.expectNetworkErrors(false);
    await message(page, "the turn was interrupted");
    assert.deepEqual(lines(), ["edit the file"], "not run again by itself");
    await b.screenshot("interrupted");
    await page.click("[data-testid=interrupted] button:has-text('Retry it')");
    await message(page, 'you said "edit the file"');
    await hidden(page, "[data-testid=interrupted]");
    assert.deepEqual(lines(), ["edit the file", "edit the file"], "run again once, on request");
    assertNoGapNoDuplicate(await conversation(page));
    await b.screenshot("retried");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});

test("a send whose answer is lost: sending the same text again repeats that request, and the agent runs it once", async () => {
  const { work, data } = scratch("lost-answer");
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("lost-answer");
  try {
    const { page } = b;
    await page.goto(server.url);
    await createTaskAndSession(page, { title: "Lost answer e2e", work });

    // The first SendMessage reaches sessiond; its answer never reaches the page.
    let calls = 0;
    await page.route("**/SendMessage", async (route) => {
      calls++;
      if (calls > 1) return route.continue();
      await route.fetch();
      await route.abort("connectionreset");
    });
    await b.expectNetworkErrors(true);
    await page.waitForFunction(() => !document.querySelector(".composer button[type=submit]").disabled, null, { timeout: T });
    await page.fill("textarea[name=message]", "only once");
    await page.keyboard.press("Enter");
    await message(page, 'you said "only once"');
    await visible(page, ".error[role=alert]");
    assert.equal(await page.inputValue("textarea[name=message]"), "only once", "the text stays, to be sent again");
    await b.screenshot("answer-lost");

    // Sent again: sessiond answers with the message it has, the box empties.
    await page.waitForFunction(() => !document.querySelector(".composer button[type=submit]").disabled, null, { timeout: T });
    await page.click(".composer button[type=submit]");
    await page.waitForFunction(() => document.querySelector("textarea[name=message]").value === "", null, { timeout: T });
    assert.equal(calls, 2);
    await b.expectNetworkErrors(false);

    // The next message is the agent's second turn: the first ran once.
    await send(page, "and then this");
    await message(page, 'you said "and then this"');
    const msgs = await conversation(page);
    assertNoGapNoDuplicate(msgs);
    assert.equal(msgs.filter(([, who, t]) => who === "you" && t.includes("only once")).length, 1, JSON.stringify(msgs));
    assert.equal(msgs.filter(([, , t]) => t.includes('you said "only once"')).length, 1, JSON.stringify(msgs));
    assert.ok(msgs.some(([, , t]) => t.includes("turn 2 of session") && t.includes('you said "and then this"')), JSON.stringify(msgs));
    await b.screenshot("answered-once");
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
  }
});
