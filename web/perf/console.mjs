// Console performance in headless Chromium against a real sessiond (run by
// hand: `node web/perf/console.mjs` after `cargo build --bins`; figures go to
// docs/PERFORMANCE.md). Not a test: nothing here is asserted.
//   - a task view with 200 sessions: time from navigation to every row shown
//     with its state and executor badges (ListSessions + one WatchTask replay);
//   - a session with 2,000 messages: time to render them all, then a scroll
//     from top to bottom, frame by frame (frame times, long tasks).
import { execFileSync } from "node:child_process";
import { Sessiond, bin, browser, scratch } from "../e2e/harness.mjs";

const SESSIONS = Number(process.env.PERF_SESSIONS ?? 200);
const TURNS = Number(process.env.PERF_TURNS ?? 1000); // two messages a turn

const { work, data } = scratch("perf");
const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
const sc = (sub, ...args) =>
  execFileSync(bin("sessionctl"), [...sub, ...args], {
    encoding: "utf8",
    env: { ...process.env, SESSIOND_ADDR: `http://${server.addr}` },
  }).trim();

try {
  const many = sc(["task", "create"], `${SESSIONS} sessions`, "-q");
  let t = Date.now();
  for (let i = 0; i < SESSIONS; i++) {
    const s = sc(["session", "create"], "--task", many, "--worktree", work, "-q");
    // Stopped right away: one agent at a time on this machine.
    if (i < SESSIONS - 1) sc(["session", "stop"], "--task", many, s);
  }
  console.error(`created ${SESSIONS} sessions in ${((Date.now() - t) / 1000).toFixed(1)} s`);

  const chat = sc(["task", "create"], "2000 messages", "-q");
  const session = sc(["session", "create"], "--task", chat, "--worktree", work, "-q");
  t = Date.now();
  for (let i = 0; i < TURNS; i++) sc(["send"], "--task", chat, session, `message ${i + 1}: ${"lorem ipsum ".repeat(8)}`);
  console.error(`sent ${TURNS} turns in ${((Date.now() - t) / 1000).toFixed(1)} s`);

  const b = await browser("perf");
  const { page } = b;
  const results = {};
  for (let run = 0; run < 3; run++) {
    await page.goto("about:blank");
    const start = Date.now();
    await page.goto(`${server.url}#/tasks/${many}`);
    await page.waitForFunction(
      (n) => {
        const rows = document.querySelectorAll("[data-testid=sessions] li");
        return rows.length === n && ![...rows].some((r) => r.textContent.includes("no executor"));
      },
      SESSIONS,
      { timeout: 120_000, polling: "raf" },
    );
    (results.taskView ??= []).push(Date.now() - start);
  }
  for (let run = 0; run < 3; run++) {
    await page.goto("about:blank");
    const start = Date.now();
    await page.goto(`${server.url}#/tasks/${chat}/sessions/${session}`);
    await page.waitForFunction((n) => document.querySelectorAll("[data-testid=messages] .msg").length === n, TURNS * 2, {
      timeout: 120_000,
      polling: "raf",
    });
    (results.sessionRender ??= []).push(Date.now() - start);
  }
  // Scroll top to bottom in 60 steps, one per frame; record every frame.
  const scroll = await page.evaluate(async () => {
    const el = document.querySelector("[data-testid=messages]");
    el.scrollTop = 0;
    await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
    const longTasks = [];
    const obs = new PerformanceObserver((l) => longTasks.push(...l.getEntries().map((e) => e.duration)));
    obs.observe({ entryTypes: ["longtask"] });
    const frames = [];
    let last = performance.now();
    const steps = 120;
    for (let i = 1; i <= steps; i++) {
      el.scrollTop = (el.scrollHeight - el.clientHeight) * (i / steps);
      await new Promise((r) => requestAnimationFrame(r));
      const now = performance.now();
      frames.push(now - last);
      last = now;
    }
    obs.disconnect();
    frames.sort((a, b) => a - b);
    return {
      frames: frames.length,
      medianMs: frames[Math.floor(frames.length / 2)],
      p95Ms: frames[Math.floor(frames.length * 0.95)],
      maxMs: frames[frames.length - 1],
      over50ms: frames.filter((f) => f > 50).length,
      longTasks: longTasks.length,
    };
  });
  results.scroll = scroll;
  console.log(JSON.stringify(results, null, 2));
  await b.close();
} finally {
  await server.stop();
}
