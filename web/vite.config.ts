import { defineConfig } from "vite";

// Preact's JSX through esbuild's automatic runtime: no framework plugin.
// No inline scripts or styles (sessiond serves the page with a strict CSP),
// no module-preload polyfill (it is an inline script).
export default defineConfig({
  esbuild: { jsx: "automatic", jsxImportSource: "preact" },
  build: {
    // Into the crate that embeds it, so its package builds from its own files.
    outDir: "../crates/sessiond-server/console",
    emptyOutDir: true,
    assetsInlineLimit: 0,
    modulePreload: { polyfill: false },
    target: "es2022",
    reportCompressedSize: true,
  },
});
