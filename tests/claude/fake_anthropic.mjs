#!/usr/bin/env node
// A fake Anthropic Messages API for the Claude Code ACP tests: the CLI
// (run by `@zed-industries/claude-agent-acp`) talks to it through
// ANTHROPIC_BASE_URL, offline and deterministically.
//
//   node fake_anthropic.mjs --log FILE
//
// Listens on 127.0.0.1 (a free port), prints `fake-anthropic listening on
// PORT` once it does, ends when its stdin closes. Answers:
//
// - POST /v1/messages with tools (the agent's own turn), streamed as
//   server-sent events in chunked transfer-encoding when `stream` is true:
//   * the newest user message holds a tool_result: a text reply
//     `claude-fake: tool TOOL_USE_ID done (RESULT)`;
//   * its prompt is `write FILE TEXT`: a `tool_use` of the CLI's `Bash` tool
//     running `printf '%s' 'TEXT' > 'FILE'` (in the session's directory);
//   * any other prompt: `claude-fake: you said "PROMPT" (N user messages)`,
//     N counting the conversation's user messages that carry a prompt, so a
//     resumed conversation shows its history.
// - POST /v1/messages without tools (the CLI's side calls: titles, topic
//   and quota checks): a short text, streamed or not as asked.
// - POST /v1/messages/count_tokens: a token count.
// - HEAD or GET of anything else: 200 with an empty JSON object.
//
// Every request is one JSON line in the log: method, path, and for
// messages the model, whether it streamed, the tool names, the prompt seen,
// the user prompts of the conversation and the answer given.

import fs from "node:fs";
import http from "node:http";

const args = process.argv.slice(2);
function flag(name) {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
}
const logPath = flag("--log");
if (!logPath) {
  console.error("usage: fake_anthropic.mjs --log FILE");
  process.exit(2);
}

let sequence = 0;

function log(entry) {
  fs.appendFileSync(logPath, JSON.stringify({ seq: ++sequence, ...entry }) + "\n");
}

// The user's own words in a content array: text blocks that are not the
// CLI's `<system-reminder>` or command wrappers.
function userTexts(content) {
  if (typeof content === "string") return [content];
  if (!Array.isArray(content)) return [];
  return content
    .filter((b) => b && b.type === "text" && typeof b.text === "string")
    .map((b) => b.text.trim())
    .filter((t) => t && !t.startsWith("<"));
}

function toolResults(content) {
  if (!Array.isArray(content)) return [];
  return content.filter((b) => b && b.type === "tool_result");
}

function resultText(result) {
  const c = result.content;
  if (typeof c === "string") return c;
  if (Array.isArray(c)) return c.map((b) => (b && b.text) || "").join("");
  return "";
}

function shellQuote(s) {
  return "'" + s.replace(/'/g, "'\\''") + "'";
}

// What to answer to the agent's turn: a list of content blocks and the
// stop reason.
function agentAnswer(body, note) {
  const messages = Array.isArray(body.messages) ? body.messages : [];
  const users = messages.filter((m) => m.role === "user");
  const prompts = users.flatMap((m) => userTexts(m.content));
  note.prompts = prompts;
  const last = users[users.length - 1];
  const results = last ? toolResults(last.content) : [];
  if (results.length > 0) {
    const r = results[results.length - 1];
    const text = `claude-fake: tool ${r.tool_use_id} done (${resultText(r).trim() || "no output"}${r.is_error ? ", error" : ""})`;
    note.answer = { text };
    return { blocks: [{ type: "text", text }], stop: "end_turn" };
  }
  const prompt = last ? userTexts(last.content).pop() || "" : "";
  note.prompt = prompt;
  const write = /^write\s+(\S+)\s+([\s\S]+)$/.exec(prompt);
  const tools = Array.isArray(body.tools) ? body.tools.map((t) => t.name) : [];
  if (write && tools.includes("Bash")) {
    const [, file, text] = write;
    const input = {
      command: `printf '%s' ${shellQuote(text)} > ${shellQuote(file)}`,
      description: `Write ${file}`,
    };
    const id = `toolu_fake_${String(sequence).padStart(6, "0")}`;
    note.answer = { tool_use: "Bash", id, input };
    return { blocks: [{ type: "tool_use", id, name: "Bash", input }], stop: "tool_use" };
  }
  const text = `claude-fake: you said "${prompt}" (${prompts.length} user messages)`;
  note.answer = { text };
  return { blocks: [{ type: "text", text }], stop: "end_turn" };
}

// Side calls without tools (title, topic, quota): a harmless text.
function sideAnswer(note) {
  const text = '{"isNewTopic": false, "title": "claude-fake"}';
  note.answer = { text };
  return { blocks: [{ type: "text", text }], stop: "end_turn" };
}

function usage(output) {
  return {
    input_tokens: 10,
    output_tokens: output,
    cache_creation_input_tokens: 0,
    cache_read_input_tokens: 0,
  };
}

function messageId() {
  return `msg_fake_${String(sequence).padStart(6, "0")}`;
}

function sendJson(res, status, value) {
  const body = JSON.stringify(value);
  res.writeHead(status, {
    "content-type": "application/json",
    "content-length": Buffer.byteLength(body),
  });
  res.end(body);
}

// Splits a string in about three pieces, so replies arrive as several deltas.
function pieces(s) {
  if (s.length < 3) return [s];
  const n = Math.ceil(s.length / 3);
  return [s.slice(0, n), s.slice(n, 2 * n), s.slice(2 * n)];
}

function stream(res, model, answer) {
  // No content-length: node sends `transfer-encoding: chunked`, and the
  // response ends with its zero-length chunk, not by closing the connection.
  res.writeHead(200, {
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "request-id": `req_fake_${sequence}`,
  });
  const event = (type, data) => res.write(`event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`);
  event("message_start", {
    message: {
      id: messageId(),
      type: "message",
      role: "assistant",
      model,
      content: [],
      stop_reason: null,
      stop_sequence: null,
      usage: usage(1),
    },
  });
  answer.blocks.forEach((block, index) => {
    if (block.type === "text") {
      event("content_block_start", { index, content_block: { type: "text", text: "" } });
      event("ping", {});
      for (const text of pieces(block.text)) {
        event("content_block_delta", { index, delta: { type: "text_delta", text } });
      }
    } else {
      event("content_block_start", {
        index,
        content_block: { type: "tool_use", id: block.id, name: block.name, input: {} },
      });
      for (const partial_json of pieces(JSON.stringify(block.input))) {
        event("content_block_delta", { index, delta: { type: "input_json_delta", partial_json } });
      }
    }
    event("content_block_stop", { index });
  });
  event("message_delta", {
    delta: { stop_reason: answer.stop, stop_sequence: null },
    usage: { output_tokens: 12 },
  });
  event("message_stop", {});
  res.end();
}

function messages(req, res, raw) {
  let body;
  try {
    body = JSON.parse(raw);
  } catch (e) {
    log({ method: req.method, path: req.url, error: `bad JSON: ${e.message}` });
    return sendJson(res, 400, {
      type: "error",
      error: { type: "invalid_request_error", message: "bad JSON" },
    });
  }
  const tools = Array.isArray(body.tools) ? body.tools.map((t) => t.name) : [];
  const note = {
    method: req.method,
    path: req.url,
    model: body.model,
    stream: body.stream === true,
    tools,
  };
  const answer = tools.length > 0 ? agentAnswer(body, note) : sideAnswer(note);
  if (process.env.FAKE_ANTHROPIC_DUMP) {
    note.body = body;
  }
  log(note);
  const model = body.model || "claude-fake";
  if (body.stream === true) return stream(res, model, answer);
  sendJson(res, 200, {
    id: messageId(),
    type: "message",
    role: "assistant",
    model,
    content: answer.blocks,
    stop_reason: answer.stop,
    stop_sequence: null,
    usage: usage(12),
  });
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    const raw = Buffer.concat(chunks).toString("utf8");
    const path = (req.url || "").split("?")[0];
    if (req.method === "POST" && path === "/v1/messages") return messages(req, res, raw);
    if (req.method === "POST" && path === "/v1/messages/count_tokens") {
      log({ method: req.method, path: req.url });
      return sendJson(res, 200, { input_tokens: 10 });
    }
    log({ method: req.method, path: req.url, unknown: path !== "/" });
    if (req.method === "HEAD") {
      res.writeHead(200, { "content-length": 0 });
      return res.end();
    }
    sendJson(res, 200, {});
  });
});

server.listen(0, "127.0.0.1", () => {
  const { port } = server.address();
  console.log(`fake-anthropic listening on ${port}`);
});

// Ends with its parent (the test) closing stdin or dying.
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
