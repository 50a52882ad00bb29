// The console's budgets, measured in real Chromium against a real sessiond:
// the bundle's gzipped size (from the built files sessiond embeds), a task
// with 200 sessions, a session with 2,000 messages, and scrolling it with
// no long task over 100 ms. The store is seeded directly (`sessiond-bench
// console-seed`: ended sessions with the events real ones leave, titled, and
// the messages), so the figures are the console's and sessiond's serving.
// Times are the browser's own clock (performance.now(), from the
// navigation's start) when the page shows everything. The machine may be
// shared and loaded: each figure is the best of three runs, and every run's
// figure goes to target/web-e2e/budgets.json.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readdirSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Sessiond, bin, browser, outDir, scratch } from "./harness.mjs";

const SESSIONS = 200;
const MESSAGES = 2000;
const console_ = new URL("../../crates/sessiond-server/console/", import.meta.url).pathname;

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    return statSync(path).isDirectory() ? walk(path) : [path];
  });
}

test("budgets: bundle ≤ 120 kB gzipped (asserted); 200-session task, 2,000-message session and long tasks while scrolling measured", async () => {
  const figures = {};
  // Everything the page loads, as sent to a browser that accepts gzip.
  const files = walk(console_).filter((f) => /\.(html|js|css)$/.test(f));
  const gz = files.map((f) => {
    try {
      return statSync(`${f}.gz`).size;
    } catch {
      return statSync(f).size;
    }
  });
  figures.bundleGzipBytes = gz.reduce((a, b) => a + b, 0);
  assert.ok(files.some((f) => f.endsWith(".js")), `a built console in ${console_}`);

  const { data } = scratch("budgets");
  const seeded = JSON.parse(execFileSync(bin("sessiond-bench"), ["console-seed", data, String(SESSIONS), String(MESSAGES)], { encoding: "utf8" }));
  const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();
  const b = await browser("budgets");
  try {
    const { page } = b;
    // The task view: every row with its state and executor badges (the
    // list, then the replay of the sessions' 1,000 events).
    figures.taskViewMs = [];
    for (let run = 0; run < 3; run++) {
      await page.goto("about:blank");
      await page.goto(`${server.url}#/tasks/${seeded.many}`);
      const shown = await page.waitForFunction(
        (n) => {
          const rows = document.querySelectorAll("[data-testid=sessions] li");
          return rows.length === n && ![...rows].some((r) => r.textContent.includes("no executor")) && performance.now();
        },
        SESSIONS,
        { timeout: 120_000, polling: "raf" },
      );
      figures.taskViewMs.push(Math.round(await shown.jsonValue()));
    }
    // Found by search: one title among 200.
    await page.fill("input[name=search]", "(#137)");
    await page.waitForFunction(() => document.querySelectorAll("[data-testid=sessions] li").length === 1, null, { timeout: 60_000 });
    assert.match(await page.textContent("[data-testid=sessions] [data-testid=title]"), /module \(#137\)$/);

    figures.sessionViewMs = [];
    for (let run = 0; run < 3; run++) {
      await page.goto("about:blank");
      await page.goto(`${server.url}#/tasks/${seeded.chat}/sessions/${seeded.session}`);
      const shown = await page.waitForFunction((n) => document.querySelectorAll("[data-testid=messages] .msg").length === n && performance.now(), MESSAGES, {
        timeout: 120_000,
        polling: "raf",
      });
      figures.sessionViewMs.push(Math.round(await shown.jsonValue()));
    }
    // Scroll the conversation top to bottom, a step a frame, recording
    // long tasks (main-thread tasks over 50 ms).
    figures.scrollLongestTaskMs = [];
    for (let run = 0; run < 3; run++) {
      const longest = await page.evaluate(async () => {
        const el = document.querySelector("[data-testid=messages]");
        el.scrollTop = 0;
        await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
        const long = [];
        const obs = new PerformanceObserver((l) => long.push(...l.getEntries().map((e) => e.duration)));
        obs.observe({ type: "longtask" });
        for (let i = 1; i <= 120; i++) {
          el.scrollTop = (el.scrollHeight - el.clientHeight) * (i / 120);
          await new Promise((r) => requestAnimationFrame(r));
        }
        // Entries are delivered after the task: let the last one arrive.
        await new Promise((r) => setTimeout(r, 100));
        long.push(...obs.takeRecords().map((e) => e.duration));
        obs.disconnect();
        return Math.max(0, ...long);
      });
      figures.scrollLongestTaskMs.push(Math.round(longest));
    }
    assert.deepEqual(b.errors, []);
  } finally {
    await b.close();
    await server.stop();
    writeFileSync(join(outDir, "budgets.json"), JSON.stringify(figures, null, 2));
    console.log(`budgets: ${JSON.stringify(figures)}`);
  }
  const best = (xs) => Math.min(...xs);
  assert.ok(figures.bundleGzipBytes <= 120_000, `bundle ${figures.bundleGzipBytes} B gzipped > 120 kB`);
  // Times are measured and recorded (budgets.json, the log), not asserted:
  // these machines are shared and noisy, and a test must not fail on load.
  // Each is compared with its budget in the log line below.
  console.log(
    `budgets vs figures: 200-session task ${best(figures.taskViewMs)} ms (budget 500), ` +
      `2,000-message session ${best(figures.sessionViewMs)} ms (budget 1000), ` +
      `longest task while scrolling ${best(figures.scrollLongestTaskMs)} ms (budget 100)`,
  );
});
