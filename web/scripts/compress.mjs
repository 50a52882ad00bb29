// Precompresses the built console (gzip and brotli, best levels, Node's own
// zlib: no dependency) beside each text file, so sessiond serves the
// smallest encoding a browser accepts without compressing anything at run
// time. Only files the compression makes smaller get a compressed copy.
import { readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { brotliCompressSync, constants, gzipSync } from "node:zlib";

const dist = new URL("../../crates/sessiond-server/console/", import.meta.url).pathname;
const TEXT = /\.(html|js|mjs|css|svg|json|txt|map)$/;

function walk(dir) {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    return statSync(path).isDirectory() ? walk(path) : [path];
  });
}

for (const file of walk(dist).filter((f) => TEXT.test(f))) {
  const raw = readFileSync(file);
  const gz = gzipSync(raw, { level: 9 });
  const br = brotliCompressSync(raw, {
    params: {
      [constants.BROTLI_PARAM_QUALITY]: constants.BROTLI_MAX_QUALITY,
      [constants.BROTLI_PARAM_SIZE_HINT]: raw.length,
    },
  });
  if (gz.length < raw.length) writeFileSync(`${file}.gz`, gz);
  if (br.length < raw.length) writeFileSync(`${file}.br`, br);
}
