// Console performance in headless Chromium against a real sessiond (run by
// hand: `node web/perf/console.mjs` after `cargo build --bins`; figures go to
// docs/PERFORMANCE.md). Not a test: nothing here is asserted.
//   - a task view with 200 sessions: time from navigation to every row shown
//     with its state and executor badges (ListSessions + one WatchTask replay
//     of the sessions' 1,000 events);
//   - a session with 2,000 messages: time to render them all, then a scroll
//     from top to bottom, frame by frame (frame times, long tasks).
// The store is seeded directly (`sessiond-bench console-seed`: ended
// sessions with the events real ones leave, and the messages), so the
// figures are the console's and sessiond's serving, not agents' turns.
import { execFileSync } from "node:child_process";
import { Sessiond, bin, browser, scratch } from "../e2e/harness.mjs";

const SESSIONS = Number(process.env.PERF_SESSIONS ?? 200);
const MESSAGES = Number(process.env.PERF_MESSAGES ?? 2000);

const { data } = scratch("perf");
const seeded = JSON.parse(execFileSync(bin("sessiond-bench"), ["console-seed", data, String(SESSIONS), String(MESSAGES)], { encoding: "utf8" }));
const { many, chat, session } = seeded;
const server = await new Sessiond({ data, args: ["--insecure-no-auth"] }).start();

try {
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
    await page.waitForFunction((n) => document.querySelectorAll("[data-testid=messages] .msg").length === n, MESSAGES, {
      timeout: 120_000,
      polling: "raf",
    });
    (results.sessionRender ??= []).push(Date.now() - start);
  }
  // Scroll top to bottom in 120 steps, one per frame; record every frame.
  const scrollFrames = (selector) =>
    page.evaluate(async (sel) => {
      const el = document.querySelector(sel);
      el.scrollTop = 0;
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
      const longTasks = [];
      const obs = new PerformanceObserver((l) => longTasks.push(...l.getEntries().map((e) => e.duration)));
      obs.observe({ entryTypes: ["longtask"] });
      let mutations = 0;
      const mo = new MutationObserver((l) => (mutations += l.length));
      mo.observe(document.body, { subtree: true, childList: true, attributes: true, characterData: true });
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
      mo.disconnect();
      frames.sort((a, b) => a - b);
      return {
        mutations,
        frames: frames.length,
        medianMs: frames[Math.floor(frames.length / 2)],
        p95Ms: frames[Math.floor(frames.length * 0.95)],
        maxMs: frames[frames.length - 1],
        over50ms: frames.filter((f) => f > 50).length,
        longTasks: longTasks.length,
      };
    }, selector);
  // The scroll's CPU time, from a Chromium trace: busy time of the
  // renderer's main thread (style, layout, paint, script) and of the
  // compositor threads. Frame times depend on the machine's load of the
  // moment; the CPU a scroll costs much less.
  const traced = async (what) => {
    const cdpT = await page.context().newCDPSession(page);
    const events = [];
    cdpT.on("Tracing.dataCollected", (d) => events.push(...d.value));
    await cdpT.send("Tracing.start", { categories: "toplevel,devtools.timeline,__metadata", transferMode: "ReportEvents" });
    const result = await what();
    const done = new Promise((r) => cdpT.once("Tracing.tracingComplete", r));
    await cdpT.send("Tracing.end");
    await done;
    await cdpT.detach();
    const threads = new Map();
    for (const e of events) if (e.ph === "M" && e.name === "thread_name") threads.set(`${e.pid}:${e.tid}`, e.args.name);
    const busy = {};
    const main = {};
    for (const e of events) {
      if (e.ph !== "X" || !e.dur) continue;
      const thread = threads.get(`${e.pid}:${e.tid}`) ?? "other";
      if (e.name === "ThreadControllerImpl::RunTask") busy[thread] = (busy[thread] ?? 0) + e.dur / 1000;
      if (thread === "CrRendererMain" && ["UpdateLayoutTree", "Layout", "PrePaint", "Paint", "Layerize", "Commit", "FunctionCall"].includes(e.name))
        main[e.name] = (main[e.name] ?? 0) + e.dur / 1000;
    }
    const round = (o) => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, Math.round(v)]));
    return { ...result, cpuMs: { rendererMain: Math.round(busy.CrRendererMain ?? 0), compositor: Math.round(busy.Compositor ?? 0), viz: Math.round(busy.VizCompositorThread ?? 0) }, rendererMainMs: round(main) };
  };
  // PERF_PROFILE=1: the top functions by self time during the scroll.
  let cdp;
  if (process.env.PERF_PROFILE) {
    cdp = await page.context().newCDPSession(page);
    await cdp.send("Profiler.enable");
    await cdp.send("Profiler.setSamplingInterval", { interval: 200 });
    await cdp.send("Profiler.start");
  }
  const scroll = await traced(() => scrollFrames("[data-testid=messages]"));
  if (cdp) {
    const { profile } = await cdp.send("Profiler.stop");
    const self = new Map();
    const dt = profile.timeDeltas;
    const byId = new Map(profile.nodes.map((n) => [n.id, n]));
    profile.samples.forEach((id, i) => {
      const n = byId.get(id);
      const key = `${n.callFrame.functionName || "(anon)"} ${n.callFrame.url.split("/").pop()}:${n.callFrame.lineNumber}`;
      self.set(key, (self.get(key) ?? 0) + (dt[i] ?? 0) / 1000);
    });
    console.error([...self].sort((a, b) => b[1] - a[1]).slice(0, 15).map(([k, v]) => `${v.toFixed(0)} ms ${k}`).join("\n"));
  }
  // The baseline, in the same browser and the same run: the same 2,000
  // texts as a static list (no app, no framework), rendered and scrolled
  // the same way. The machine is shared: read the console's figures as
  // ratios to these.
  const texts = await page.$$eval("[data-testid=messages] .msg .text", (ts) => ts.map((t) => t.textContent));
  const html =
    `<style>#list{height:600px;overflow:auto;font:14px sans-serif}.msg{padding:8px;white-space:pre-wrap}</style>` +
    `<div id="list">${texts.map((t) => `<div class="msg">${t.replace(/[&<>]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;" })[c])}</div>`).join("")}</div>`;
  for (let run = 0; run < 3; run++) {
    await page.goto("about:blank");
    const start = Date.now();
    await page.setContent(html);
    await page.waitForFunction((n) => document.querySelectorAll("#list .msg").length === n, MESSAGES, { polling: "raf" });
    (results.baselineRender ??= []).push(Date.now() - start);
  }
  results.baselineScroll = await traced(() => scrollFrames("#list"));
  results.scroll = scroll;
  console.log(JSON.stringify(results, null, 2));
  await b.close();
} finally {
  await server.stop();
}
