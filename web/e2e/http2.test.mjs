// The README's local HTTP/2 setup, in real Chromium: a certificate made
// with the documented openssl command, sessiond serving TLS; the console
// and its gRPC-web calls go over h2 (one connection for every stream).
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";
import { Sessiond, scratch } from "./harness.mjs";

test("over TLS with a local certificate the console loads and calls sessiond over HTTP/2", async () => {
  const { dir, data } = scratch("http2");
  const [cert, key] = [join(dir, "cert.pem"), join(dir, "key.pem")];
  execFileSync(
    "openssl",
    ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "365",
      "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", cert],
    { stdio: "pipe" },
  );
  const server = await new Sessiond({ data, args: ["--insecure-no-auth", "--tls-cert", cert, "--tls-key", key] }).start();
  // The certificate is the user's own, accepted once (here: by the context).
  const context = await chromium.launchPersistentContext(mkdtempSync(join(tmpdir(), "sessiond-e2e-chromium-")), {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"],
    ignoreHTTPSErrors: true,
  });
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    const port = server.addr.split(":").pop();
    await page.goto(`https://localhost:${port}/`);
    await page.fill("input[name=title]", "HTTP/2 e2e");
    await page.click("text=Create task");
    await page.locator("[data-testid=new-session]").waitFor({ timeout: 60_000 });
    const protocols = await page.evaluate(() =>
      performance.getEntriesByType("navigation").concat(performance.getEntriesByType("resource")).map((e) => [e.name.split("/").pop(), e.nextHopProtocol]),
    );
    assert.ok(protocols.some(([name]) => name === "CreateTask"), JSON.stringify(protocols));
    assert.deepEqual(protocols.filter(([, p]) => p !== "h2"), [], JSON.stringify(protocols));
  } finally {
    await context.close();
    await server.stop();
  }
});
