// Test harness of the browser suite: real sessiond, agentctl and demo agent
// binaries (SESSIOND_BIN_DIR), Debian's Chromium through playwright-core.
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const root = new URL("../..", import.meta.url).pathname;
export const binDir = process.env.SESSIOND_BIN_DIR ?? join(root, "target/debug");
export const outDir = process.env.SESSIOND_E2E_OUT ?? join(root, "target/web-e2e");
mkdirSync(outDir, { recursive: true });

export function bin(name) {
  return join(binDir, name);
}

/** A scratch directory with a git worktree holding README.md. */
export function scratch(name) {
  const dir = mkdtempSync(join(tmpdir(), `sessiond-e2e-${name}-`));
  const work = join(dir, "work");
  mkdirSync(work);
  writeFileSync(join(work, "README.md"), "hello from the worktree\n");
  const git = (...args) => execFileSync("git", args, { cwd: work, stdio: "pipe" });
  git("init", "-q", "-b", "main");
  git("-c", "user.name=e2e", "-c", "user.email=e2e@localhost", "add", ".");
  git("-c", "user.name=e2e", "-c", "user.email=e2e@localhost", "commit", "-q", "-m", "init");
  return { dir, work, data: join(dir, "data") };
}

function serverEnv(extra) {
  // Scratch worktrees live under the temp dir, outside the default root ($HOME).
  const env = { ...process.env, SESSIOND_LOG: "info", SESSIOND_WORKTREE_ROOTS: tmpdir(), ...extra };
  // The server's own settings come from its arguments only.
  for (const k of ["SESSIOND_CONFIG", "SESSIOND_DATABASE_URL", "DATABASE_URL", "SESSIOND_API_TOKENS", "SESSIOND_LISTEN"]) if (!(k in extra)) delete env[k];
  return env;
}

/** `sessiond serve` on `listen` (port 0 the first time), resolved once it prints its address. */
export class Sessiond {
  constructor({ data, args = [], env = {} }) {
    this.data = data;
    this.args = args;
    this.env = env;
    this.addr = "127.0.0.1:0";
  }
  async start() {
    const child = spawn(
      bin("sessiond"),
      ["serve", "--listen", this.addr, "--metrics-listen", "off", "--data-dir", this.data, ...this.args],
      {
        env: serverEnv(this.env),
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    this.child = child;
    this.exited = new Promise((r) => child.on("exit", (code, signal) => r({ code, signal })));
    let log = "";
    child.stderr.on("data", (d) => {
      log += d;
      if (log.length > 200_000) log = log.slice(-100_000);
    });
    this.log = () => log;
    const lines = createInterface({ input: child.stdout });
    this.addr = await new Promise((resolve, reject) => {
      lines.once("line", (l) => {
        const m = /^sessiond listening on (.+)$/.exec(l.trim());
        m ? resolve(m[1]) : reject(new Error(`unexpected first line ${l}`));
      });
      this.exited.then((e) => reject(new Error(`sessiond exited ${JSON.stringify(e)}: ${log}`)));
    });
    this.url = `http://${this.addr}/`;
    return this;
  }
  async terminate() {
    this.child.kill("SIGTERM");
    const e = await this.exited;
    if (e.code !== 0) throw new Error(`sessiond exited ${JSON.stringify(e)} on SIGTERM: ${this.log()}`);
  }
  async kill() {
    this.child.kill("SIGKILL");
    await this.exited;
  }
  /** Pids of the agentctl processes this server's data directory launched. */
  agentctlPids() {
    const pids = [];
    for (const name of readdirSync("/proc")) {
      if (!/^\d+$/.test(name)) continue;
      let cmdline, stat;
      try {
        cmdline = readFileSync(`/proc/${name}/cmdline`, "utf8").replaceAll("\0", " ");
        stat = readFileSync(`/proc/${name}/stat`, "utf8");
      } catch {
        continue;
      }
      if (cmdline.includes("agentctl") && cmdline.includes(this.data) && !stat.includes(") Z ")) pids.push(Number(name));
    }
    return pids;
  }
  /** kill -9 of every agentctl (and with it its agent). */
  killAgentctls() {
    const pids = this.agentctlPids();
    for (const pid of pids) process.kill(pid, "SIGKILL");
    return pids;
  }
  async stop() {
    if (this.child && this.child.exitCode === null && this.child.signalCode === null) await this.kill();
    this.killAgentctls();
  }
}

const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];

/** Chromium with a fresh profile, and a page that records console errors. */
export async function browser(name, { width = 1280, height = 800 } = {}) {
  const profile = mkdtempSync(join(tmpdir(), "sessiond-e2e-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: FLAGS,
    viewport: { width, height },
  });
  const page = context.pages()[0] ?? (await context.newPage());
  const errors = [];
  // Fetches refused while sessiond is down are expected in restart tests;
  // Chromium reports them as console errors of their own. Which code it
  // reports depends on where the connection was when the process died
  // (refused, reset, closed, or ENOTCONN for a socket still connecting).
  let allowNetworkErrors = false;
  page.on("console", (m) => {
    if (m.type() !== "error") return;
    const text = m.text();
    if (allowNetworkErrors && /net::ERR_(CONNECTION_REFUSED|CONNECTION_RESET|CONNECTION_CLOSED|CONNECTION_ABORTED|SOCKET_NOT_CONNECTED|EMPTY_RESPONSE|INCOMPLETE_CHUNKED_ENCODING)/.test(text)) return;
    errors.push(text);
  });
  page.on("pageerror", (e) => errors.push(`pageerror: ${e.message}`));
  let shot = 0;
  return {
    page,
    context,
    errors,
    /** Turning it off first takes a round trip through the page, so the
     * console messages of requests that failed while it was on arrive
     * (CDP delivers events in order) before the errors count again. */
    async expectNetworkErrors(on) {
      if (!on) await page.evaluate(() => null);
      allowNetworkErrors = on;
    },
    async screenshot(step) {
      shot++;
      await page.screenshot({ path: join(outDir, `${name}-${String(shot).padStart(2, "0")}-${step}.png`) });
    },
    async close() {
      await context.close();
    },
  };
}
