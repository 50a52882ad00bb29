"""An ACP agent written on the Python `agent-client-protocol` SDK (PyPI).

sessiond's own tests otherwise speak ACP only with agents built on the Rust
SDK; this one is a second implementation, for the interop test
(`crates/sessiond-server/tests/server/interop.rs`). It runs in the
virtualenv `cargo xtask ci` makes under `target/` from `requirements.txt`.

What it does, deterministically:
- `initialize`: protocol version 1 (`--protocol-version N` answers N instead,
  to test the client's check), `loadSession: true`, no auth methods.
- `session/new`: a new session with modes `default` and `plan`, stored at
  once as `<state-dir>/<session id>.json` (cwd, mode, history).
- `session/load`: replays the stored history (user chunks, tool calls,
  agent chunks) as ACP specifies, then answers with the stored modes, so a
  new process restores the conversation; unknown ids are -32002.
- `session/prompt`: a tool call (`tool_call`, pending) that asks
  `session/request_permission` before it runs; allowed, it appends the
  prompt as one line to `interop.txt` in the session's cwd and reports
  `tool_call_update` completed with text content; rejected or cancelled, it
  reports the update `failed`. Then the reply, streamed in chunks:
  `turn N: you said "PROMPT"` (N counts the stored turns, so it proves a
  load), plus ` (tool: allowed|rejected|cancelled)`.
  `/mode ID` instead switches the agent's own mode (ACP
  `current_mode_update`, stored) without a tool call.
- Terminals (ACP `terminal/*`, the client's), each in a tool call of kind
  `execute` whose content is the terminal, and no permission asked:
  `/terminal CMD` runs `sh -c CMD` to its end (create, wait_for_exit,
  output, release) and replies `exit CODE|signal SIG: OUTPUT`;
  `/terminal-start CMD` only creates it (kept in memory, by session);
  `/terminal-output`, `/terminal-wait`, `/terminal-kill` and
  `/terminal-release` act on the last one started and reply what the
  client answered (or `error: ...`); `/terminal-foreign CMD` asks for a
  terminal of another conversation (refused by agentctl).
  `--terminal-output-limit N` passes `outputByteLimit` N.
- `session/set_mode`, `session/cancel`.
- `--resume-only`: `initialize` advertises `sessionCapabilities.resume` and
  `loadSession: false`; `session/resume` reopens a stored session without
  replaying anything (answering the stored modes; unknown ids are -32002),
  and `session/load` is refused as an unknown method. This SDK version
  routes `session/resume` only with its unstable protocol switched on
  (`run_agent(..., use_unstable_protocol=True)`), which this switch does.
- `--config`: sessions offer two config options, `model` (category
  `model`: `small`, `large`) and `effort` (category `thought_level`: `low`,
  `high`), in the session/new, load and resume answers; the values are
  stored with the session, so a new process answers them as set;
  `session/set_config_option` checks and stores one (-32602 otherwise) and
  answers them all; the prompt `/config ID VALUE` makes the agent change
  one itself (ACP `config_option_update`); replies end ` [model: M]`.
- MCP servers given on session/new, load and resume are logged with the
  call (`mcp`: name, type, and the env or header values it got, so a test
  sees what arrived); `--mcp-http` advertises `mcpCapabilities.http`.
- `--close`: `initialize` also advertises `sessionCapabilities.close`;
  `session/close` is logged (with whether a turn was in progress) and
  forgets the session's in-memory state (its stored file stays, as a
  closed conversation can be loaded again). Routed with the SDK's unstable
  protocol, as `session/resume` is.
Every call is logged as one JSON line to `<state-dir>/calls.log` with the
pid, so a test can tell which process did what.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

from acp import (
    PROTOCOL_VERSION,
    RequestError,
    run_agent,
    start_tool_call,
    text_block,
    tool_content,
    tool_terminal_ref,
    update_agent_message_text,
    update_tool_call,
    update_user_message_text,
)
from acp.helpers import update_current_mode
from acp.interfaces import Client
from acp.schema import (
    AgentCapabilities,
    McpCapabilities,
    CloseSessionResponse,
    Implementation,
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PermissionOption,
    PromptResponse,
    ResumeSessionResponse,
    SessionCapabilities,
    SessionCloseCapabilities,
    SessionConfigOptionSelect,
    SessionConfigSelectOption,
    SetSessionConfigOptionResponse,
    ConfigOptionUpdate,
    SessionMode,
    SessionModeState,
    SessionResumeCapabilities,
    SetSessionModeResponse,
    ToolCallLocation,
    ToolCallUpdate,
)

MODES = [
    SessionMode(id="default", name="Default", description="asks before each tool call"),
    SessionMode(id="plan", name="Plan", description="the same, and says so"),
]
SIDE_EFFECT_FILE = "interop.txt"
# --config: (id, name, category, values); the first value is the default.
CONFIG_OPTIONS = [
    ("model", "Model", "model", ["small", "large"]),
    ("effort", "Reasoning effort", "thought_level", ["low", "high"]),
]
CONFIG_DEFAULTS = {c[0]: c[3][0] for c in CONFIG_OPTIONS}


class Store:
    """One JSON file per session: {"cwd", "mode", "history": [...]}."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, session_id: str) -> Path:
        return self.root / f"{session_id}.json"

    def load(self, session_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.path(session_id).read_text())
        except FileNotFoundError:
            return None

    def save(self, session_id: str, state: dict[str, Any]) -> None:
        # Written whole and renamed: a kill -9 leaves the old or the new file.
        tmp = self.path(session_id).with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(session_id))

    def log(self, method: str, **fields: Any) -> None:
        with open(self.root / "calls.log", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "method": method, **fields}) + "\n")


def modes(current: str) -> SessionModeState:
    return SessionModeState(current_mode_id=current, available_modes=MODES)


class InteropAgent:
    def __init__(self, store: Store, protocol_version: int, resume_only: bool = False, terminal_output_limit: int | None = None, close: bool = False, config: bool = False, mcp_http: bool = False) -> None:
        self.store = store
        self.mcp_http = mcp_http
        self.config = config
        self.close = close
        self.protocol_version = protocol_version
        self.resume_only = resume_only
        self.terminal_output_limit = terminal_output_limit
        self.conn: Client | None = None
        self.cancelled: set[str] = set()
        # The last terminal started, by session (lives with this process).
        self.terminals: dict[str, str] = {}

    def on_connect(self, conn: Client) -> None:
        self.conn = conn

    async def initialize(self, protocol_version: int, client_capabilities=None, client_info=None, **kwargs: Any) -> InitializeResponse:
        self.store.log("initialize", protocol_version=protocol_version)
        close = SessionCloseCapabilities() if self.close else None
        if self.resume_only:
            capabilities = AgentCapabilities(
                load_session=False,
                session_capabilities=SessionCapabilities(resume=SessionResumeCapabilities(), close=close),
            )
        else:
            capabilities = AgentCapabilities(load_session=True, session_capabilities=SessionCapabilities(close=close))
        if self.mcp_http:
            capabilities.mcp_capabilities = McpCapabilities(http=True)
        return InitializeResponse(
            protocol_version=self.protocol_version,
            agent_capabilities=capabilities,
            agent_info=Implementation(name="python-interop-agent", version="1"),
            auth_methods=[],
        )

    async def authenticate(self, method_id: str, **kwargs: Any) -> None:
        raise RequestError.invalid_params({"method_id": method_id, "reason": "no auth methods"})

    async def new_session(self, cwd: str, mcp_servers=None, **kwargs: Any) -> NewSessionResponse:
        session_id = uuid.uuid4().hex
        self.store.save(session_id, {"cwd": cwd, "mode": "default", "history": [], "config": dict(CONFIG_DEFAULTS)})
        self.store.log("session/new", session_id=session_id, mcp=mcp_log(mcp_servers))
        return NewSessionResponse(session_id=session_id, modes=modes("default"), config_options=self.config_options(session_id))

    async def load_session(self, cwd: str, session_id: str, mcp_servers=None, **kwargs: Any) -> LoadSessionResponse:
        if self.resume_only:
            raise RequestError.method_not_found("session/load")
        state = self.store.load(session_id)
        if state is None:
            raise RequestError.resource_not_found(session_id)
        # Replay the conversation before answering, as ACP specifies.
        for item in state["history"]:
            if item["kind"] == "user":
                update = update_user_message_text(item["text"])
            elif item["kind"] == "agent":
                update = update_agent_message_text(item["text"])
            else:
                update = start_tool_call(item["id"], item["title"], kind="edit", status=item["status"])
            await self.conn.session_update(session_id=session_id, update=update)
        self.store.log("session/load", session_id=session_id, replayed=len(state["history"]), mcp=mcp_log(mcp_servers))
        return LoadSessionResponse(modes=modes(state["mode"]), config_options=self.config_options(session_id))

    async def resume_session(self, cwd: str, session_id: str, mcp_servers=None, **kwargs: Any) -> ResumeSessionResponse:
        if not self.resume_only:
            raise RequestError.method_not_found("session/resume")
        # Reopened as stored; nothing is replayed (that is session/load).
        state = self.must_load(session_id)
        self.store.log("session/resume", session_id=session_id, replayed=0, mcp=mcp_log(mcp_servers))
        return ResumeSessionResponse(modes=modes(state["mode"]), config_options=self.config_options(session_id))

    async def close_session(self, session_id: str, **kwargs: Any) -> CloseSessionResponse:
        self.store.log("session/close", session_id=session_id, known=self.store.load(session_id) is not None)
        self.cancelled.add(session_id)
        self.terminals.pop(session_id, None)
        return CloseSessionResponse()

    def config_options(self, session_id: str) -> list[SessionConfigOptionSelect] | None:
        if not self.config:
            return None
        values = self.must_load(session_id).get("config", CONFIG_DEFAULTS)
        return [
            SessionConfigOptionSelect(
                type="select",
                id=config_id,
                name=name,
                category=category,
                current_value=values.get(config_id, CONFIG_DEFAULTS[config_id]),
                options=[SessionConfigSelectOption(value=v, name=v.capitalize()) for v in choices],
            )
            for config_id, name, category, choices in CONFIG_OPTIONS
        ]

    async def set_config_option(self, config_id: str, session_id: str, value: str | bool, **kwargs: Any) -> SetSessionConfigOptionResponse:
        await self.change_config(session_id, config_id, value)
        self.store.log("session/set_config_option", session_id=session_id, config_id=config_id, value=value)
        return SetSessionConfigOptionResponse(config_options=self.config_options(session_id))

    async def change_config(self, session_id: str, config_id: str, value: Any) -> None:
        choices = {c[0]: c[3] for c in CONFIG_OPTIONS}
        if not self.config or config_id not in choices or value not in choices[config_id]:
            raise RequestError.invalid_params({"config_id": config_id, "value": value})
        state = self.must_load(session_id)
        state.setdefault("config", dict(CONFIG_DEFAULTS))[config_id] = value
        self.store.save(session_id, state)

    async def set_session_mode(self, session_id: str, mode_id: str, **kwargs: Any) -> SetSessionModeResponse:
        await self.switch_mode(session_id, mode_id)
        self.store.log("session/set_mode", session_id=session_id, mode_id=mode_id)
        return SetSessionModeResponse()

    async def switch_mode(self, session_id: str, mode_id: str) -> None:
        if mode_id not in [m.id for m in MODES]:
            raise RequestError.invalid_params({"mode_id": mode_id, "modes": [m.id for m in MODES]})
        state = self.must_load(session_id)
        state["mode"] = mode_id
        self.store.save(session_id, state)
        await self.conn.session_update(session_id=session_id, update=update_current_mode(mode_id))

    def must_load(self, session_id: str) -> dict[str, Any]:
        state = self.store.load(session_id)
        if state is None:
            raise RequestError.resource_not_found(session_id)
        return state

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self.store.log("session/cancel", session_id=session_id)
        self.cancelled.add(session_id)

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = "".join(getattr(block, "text", "") for block in prompt)
        self.store.log("session/prompt", session_id=session_id, text=text)
        self.cancelled.discard(session_id)
        state = self.must_load(session_id)
        turn = sum(1 for item in state["history"] if item["kind"] == "user") + 1
        history = state["history"]
        history.append({"kind": "user", "text": text})

        words = text.split()
        if len(words) == 2 and words[0] == "/mode":
            # The agent changes its own mode (ACP `current_mode_update`).
            await self.switch_mode(session_id, words[1])
            state = self.must_load(session_id)
            state["history"] = history
            note = f"mode: {words[1]}"
        elif len(words) == 3 and words[0] == "/config":
            # The agent changes an option itself (ACP `config_option_update`).
            await self.change_config(session_id, words[1], words[2])
            await self.conn.session_update(
                session_id=session_id,
                update=ConfigOptionUpdate(session_update="config_option_update", config_options=self.config_options(session_id)),
            )
            state = self.must_load(session_id)
            state["history"] = history
            note = f"config: {words[1]}={words[2]}"
        elif words and words[0].startswith("/terminal"):
            note = await self.terminal(session_id, turn, words[0], text[len(words[0]):].strip())
        else:
            note = await self.tool(session_id, turn, text, state["cwd"], history)
        if session_id in self.cancelled:
            return PromptResponse(stop_reason="cancelled")
        reply = [f"turn {turn}: ", f'you said "{text}"', f" ({note})"]
        if state["mode"] == "plan":
            reply.append(" [plan mode]")
        if self.config:
            reply.append(f" [model: {state.get('config', CONFIG_DEFAULTS)['model']}]")
        for chunk in reply:
            await self.conn.session_update(session_id=session_id, update=update_agent_message_text(chunk))
        history.append({"kind": "agent", "text": "".join(reply)})
        state["history"] = history
        self.store.save(session_id, state)
        return PromptResponse(stop_reason="end_turn")

    async def terminal(self, session_id: str, turn: int, verb: str, command: str) -> str:
        """The client's terminals; returns what it answered."""
        try:
            if verb == "/terminal-foreign":
                # A conversation that is not this one: agentctl must refuse.
                created = await self.conn.create_terminal(
                    session_id=f"not-{session_id}", command="sh", args=["-c", command]
                )
                return f"terminal started {created.terminal_id}"
            if verb in ("/terminal", "/terminal-start"):
                created = await self.conn.create_terminal(
                    session_id=session_id,
                    command="sh",
                    args=["-c", command],
                    output_byte_limit=self.terminal_output_limit,
                )
                terminal_id = created.terminal_id
                self.terminals[session_id] = terminal_id
                await self.conn.session_update(
                    session_id=session_id,
                    update=start_tool_call(
                        f"py-term-{turn}",
                        f"run {command}",
                        kind="execute",
                        status="in_progress",
                        content=[tool_terminal_ref(terminal_id)],
                    ),
                )
                if verb == "/terminal-start":
                    return f"terminal started {terminal_id}"
                exited = await self.conn.wait_for_terminal_exit(session_id=session_id, terminal_id=terminal_id)
                out = await self.conn.terminal_output(session_id=session_id, terminal_id=terminal_id)
                await self.conn.release_terminal(session_id=session_id, terminal_id=terminal_id)
                await self.conn.session_update(
                    session_id=session_id,
                    update=update_tool_call(f"py-term-{turn}", status="completed"),
                )
                return f"{describe_exit(exited)}: {out.output}"
            terminal_id = self.terminals.get(session_id, "none")
            if verb == "/terminal-output":
                out = await self.conn.terminal_output(session_id=session_id, terminal_id=terminal_id)
                ended = describe_exit(out.exit_status) if out.exit_status else "running"
                return f"{ended}{' truncated' if out.truncated else ''}: {out.output}"
            if verb == "/terminal-wait":
                return describe_exit(await self.conn.wait_for_terminal_exit(session_id=session_id, terminal_id=terminal_id))
            if verb == "/terminal-kill":
                await self.conn.kill_terminal(session_id=session_id, terminal_id=terminal_id)
                return "killed"
            if verb == "/terminal-release":
                await self.conn.release_terminal(session_id=session_id, terminal_id=terminal_id)
                return "released"
            return f"error: unknown terminal verb {verb}"
        except RequestError as e:
            return f"error: {e}"

    async def tool(self, session_id: str, turn: int, text: str, cwd: str, history: list[Any]) -> str:
        """A tool call that asks permission first; returns what happened."""
        tool_id = f"py-tool-{turn}"
        title = f"append to {SIDE_EFFECT_FILE}"
        target = str(Path(cwd) / SIDE_EFFECT_FILE)
        await self.conn.session_update(
            session_id=session_id,
            update=start_tool_call(
                tool_id,
                title,
                kind="edit",
                status="pending",
                locations=[ToolCallLocation(path=target)],
                raw_input={"line": text},
            ),
        )
        answer = await self.conn.request_permission(
            session_id=session_id,
            tool_call=ToolCallUpdate(tool_call_id=tool_id, title=title, kind="edit", status="pending"),
            options=[
                PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
            ],
        )
        outcome = answer.outcome
        if outcome.outcome == "selected" and outcome.option_id == "allow":
            with open(target, "a") as f:
                f.write(text.replace("\n", " ") + "\n")
            status, result, note = "completed", "appended 1 line", "tool: allowed"
        elif outcome.outcome == "selected":
            status, result, note = "failed", "permission rejected", "tool: rejected"
        else:
            status, result, note = "failed", "permission cancelled", "tool: cancelled"
        await self.conn.session_update(
            session_id=session_id,
            update=update_tool_call(tool_id, status=status, content=[tool_content(text_block(result))]),
        )
        history.append({"kind": "tool", "id": tool_id, "title": title, "status": status})
        return note


def mcp_log(servers: Any) -> list[dict[str, Any]]:
    out = []
    for s in servers or []:
        entry = {"name": s.name, "type": getattr(s, "type", None) or "stdio"}
        if getattr(s, "env", None) is not None:
            entry["command"] = s.command
            entry["values"] = {e.name: e.value for e in s.env}
        else:
            entry["url"] = s.url
            entry["values"] = {h.name: h.value for h in s.headers}
        out.append(entry)
    return out


def describe_exit(status: Any) -> str:
    if status.signal:
        return f"signal {status.signal}"
    return f"exit {status.exit_code}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--protocol-version", type=int, default=PROTOCOL_VERSION)
    parser.add_argument("--resume-only", action="store_true", help="offer session/resume, not session/load")
    parser.add_argument("--terminal-output-limit", type=int, default=None, help="outputByteLimit of the terminals it creates")
    parser.add_argument("--close", action="store_true", help="offer session/close")
    parser.add_argument("--config", action="store_true", help="offer config options (model, effort)")
    parser.add_argument("--mcp-http", action="store_true", help="take MCP servers over http")
    args = parser.parse_args()
    agent = InteropAgent(Store(args.state_dir), args.protocol_version, args.resume_only, args.terminal_output_limit, args.close, args.config, args.mcp_http)
    asyncio.run(run_agent(agent, use_unstable_protocol=args.resume_only or args.close))


if __name__ == "__main__":
    main()
