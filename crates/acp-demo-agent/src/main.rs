//! `acp-demo-agent`: a small, deterministic ACP agent over stdio.
//!
//! It answers every prompt with `turn N of session ID: you said "PROMPT"`,
//! streamed as at least three `agent_message_chunk` updates, and keeps each
//! session's transcript in a state directory so `session/load` in a new
//! process restores the conversation (replaying it as session updates, as ACP
//! specifies), and `session/resume` reopens it without replaying anything.
//! Switches (flags or `ACP_DEMO_*` environment variables) make it
//! misbehave on purpose for tests: no `loadSession` capability, no
//! `sessionCapabilities.resume`, a slow start, a failing load, a crash after
//! N prompts or in the middle of a turn, and a delay between chunks so a turn
//! can be cancelled.
//!
//! A heavy mode behaves like a real agent (a Node runtime starting, a long
//! history parsed): `--rss-mb` holds memory, `--busy-ms` computes before it
//! reads stdin, `--startup-ms` sleeps before it reads stdin, and
//! `--load-ms-per-message` makes `session/load` and `session/resume`
//! compute for each stored message.
//!
//! Every `initialize`, `session/new`, `session/load` and `session/resume` is
//! logged as one JSON line to `<state-dir>/calls.log` (`pid`, `method`,
//! `session_id`, and `replayed`: the updates a load or resume replayed), so
//! a test can tell what a process was sent.
//!
//! Prompts starting with a slash exercise client features:
//! `/tool` reports a tool call, `/activity` one update of every kind a
//! client shows (thought, plan, tool call and update with a diff, commands,
//! mode, an untyped kind), `/permission` asks for permission (`/permission-none`: with no option
//! to choose), `/edit PATH
//! TEXT` asks permission before a tool call that writes PATH (`/edit-codex`:
//! the same with Codex's option ids, `approved` / `approved-for-session` /
//! `abort`), `/run` reports a command with its raw input and output (as
//! Codex does), `/read PATH`
//! and `/write PATH TEXT` use the client's file system, `/terminal CMD`
//! runs `sh -c CMD` in a client terminal (ACP `terminal/*`) shown by a tool
//! call, `/long` streams for
//! a minute (to be cancelled), `/fail` fails the turn, `/ask [FIELD...]` asks the user to fill a form
//! (ACP `elicitation/create`) and replies with the answer, `/ask-url URL`
//! sends the user to a page (an elicitation of mode url), `/big N` replies
//! with one chunk of N bytes, `/mode ID` switches
//! the agent's own mode (`current_mode_update`), `/unparsed` sends a
//! `session/update` no ACP schema parses (a tool call with a numeric id).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    AgentCapabilities, AuthMethod, AuthMethodAgent, AuthenticateRequest, AuthenticateResponse,
    CancelNotification, ContentBlock, ContentChunk, CreateElicitationRequest, CurrentModeUpdate,
    ElicitationAction, ElicitationFormMode, ElicitationSchema, ElicitationSessionScope,
    ElicitationUrlMode, Implementation, InitializeRequest, InitializeResponse, LoadSessionRequest,
    LoadSessionResponse, NewSessionRequest, NewSessionResponse, PermissionOption,
    PermissionOptionKind, PromptCapabilities, PromptRequest, PromptResponse, ReadTextFileRequest,
    RequestPermissionOutcome, RequestPermissionRequest, ResumeSessionRequest,
    ResumeSessionResponse, SessionCapabilities, SessionMode, SessionModeState, SessionNotification,
    SessionResumeCapabilities, SessionUpdate, SetSessionModeRequest, SetSessionModeResponse,
    StopReason, TextContent, ToolCall, ToolCallStatus, ToolCallUpdate, ToolCallUpdateFields,
    WriteTextFileRequest,
};
use agent_client_protocol::{Client, Error, ErrorCode, Stdio};
use clap::Parser;
use clap::builder::BoolishValueParser;

#[derive(Debug, Clone, Parser)]
#[command(name = "acp-demo-agent", version, about)]
struct Cli {
    /// Directory holding one transcript file per session.
    #[arg(long, env = "ACP_DEMO_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Take images and embedded resources in prompts (promptCapabilities
    /// `image` and `embeddedContext`); each such block (and each resource
    /// link) is logged to calls.log as method `prompt_block`.
    #[arg(long, env = "ACP_DEMO_PROMPT_ATTACHMENTS", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    prompt_attachments: bool,
    /// Advertise `loadSession: false` (and refuse `session/load`). Alone,
    /// the agent can only resume (`session/resume`).
    #[arg(long, env = "ACP_DEMO_NO_LOAD_SESSION", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    no_load_session: bool,
    /// Do not advertise `sessionCapabilities.resume` (and refuse
    /// `session/resume` as an unknown method). Alone, the agent can only
    /// load (`session/load`).
    #[arg(long, env = "ACP_DEMO_NO_RESUME_SESSION", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    no_resume_session: bool,
    /// Advertise `sessionCapabilities.resume` but answer `session/resume`
    /// with "method not found" anyway (a capability ahead of the code).
    #[arg(long, env = "ACP_DEMO_REFUSE_RESUME", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    refuse_resume: bool,
    /// Sleep this long before reading stdin (a slow start that does
    /// nothing: no output, no CPU time). `ACP_DEMO_START_DELAY_MS` is read
    /// too, as the older name.
    #[arg(
        long,
        alias = "start-delay-ms",
        env = "ACP_DEMO_STARTUP_MS",
        default_value_t = 0
    )]
    startup_ms: u64,
    /// Compute (spin) until this process has used this much CPU time,
    /// before reading stdin (a slow start that works: a runtime starting).
    /// One line on stderr when it starts and one when it is done, nothing
    /// in between.
    #[arg(long, env = "ACP_DEMO_BUSY_MS", default_value_t = 0)]
    busy_ms: u64,
    /// Allocate this many MiB at start, write every page, and hold them
    /// until the process ends (a real agent's resident memory).
    #[arg(long, env = "ACP_DEMO_RSS_MB", default_value_t = 0)]
    rss_mb: u64,
    /// `session/load` and `session/resume` compute (spin) this much CPU
    /// time per stored history message (a prompt or a reply), as parsing a
    /// long history does; a load sends each message after its share.
    #[arg(long, env = "ACP_DEMO_LOAD_MS_PER_MESSAGE", default_value_t = 0)]
    load_ms_per_message: u64,
    /// Before reading stdin, wait while this file exists (a gate a test
    /// holds closed to keep a backend's recovery of this agent open).
    #[arg(long, env = "ACP_DEMO_START_GATE_FILE")]
    start_gate_file: Option<PathBuf>,
    /// Reject every `session/load` and `session/resume`.
    #[arg(long, env = "ACP_DEMO_FAIL_LOAD", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    fail_load: bool,
    /// While this file exists, every prompt fails as the Claude Code
    /// adapter's do once the CLI under it died (the adapter lives on):
    /// JSON-RPC internal error, `{"details":"Session not found"}`.
    #[arg(long, env = "ACP_DEMO_LOST_SESSION_FILE")]
    lost_session_file: Option<PathBuf>,
    /// Do not announce a mode the client set (`current_mode_update`), as
    /// most agents do not.
    #[arg(long, env = "ACP_DEMO_QUIET_MODE_SET", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    quiet_mode_set: bool,
    /// With `--lost-session-file`: fail the prompts as the adapter 0.101
    /// does once it dropped the conversation of a CLI that died while idle:
    /// ACP's -32002 "Resource not found" with `{"sessionId": ID}`.
    #[arg(long, env = "ACP_DEMO_LOST_SESSION_NOT_FOUND", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    lost_session_not_found: bool,
    /// After a cancelled prompt, answer the next one at once with
    /// `end_turn` and nothing else, as the Claude Code adapter (0.23) does
    /// with the stop its cancelled turn left behind (claude-agent-acp #551).
    #[arg(long, env = "ACP_DEMO_STALE_STOP_AFTER_CANCEL", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    stale_stop_after_cancel: bool,
    /// Exit with status 43 right after answering the Nth prompt of this process.
    #[arg(long, env = "ACP_DEMO_CRASH_AFTER_PROMPTS")]
    crash_after_prompts: Option<u32>,
    /// Exit with status 42 in the middle of the Nth prompt of this process,
    /// after its first chunk.
    #[arg(long, env = "ACP_DEMO_CRASH_MID_TURN")]
    crash_mid_turn: Option<u32>,
    /// Delay between reply chunks (a slow turn, for cancel tests).
    #[arg(long, env = "ACP_DEMO_CHUNK_DELAY_MS", default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Ignore `session/cancel` (an agent stuck in a tool that never looks
    /// at it): a turn goes on until it ends by itself or the agent is
    /// stopped.
    #[arg(long, env = "ACP_DEMO_IGNORE_CANCEL", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    ignore_cancel: bool,
    /// Require ACP `authenticate` before any session call (answered with
    /// -32000 "Authentication required" until then), as codex-acp does. The
    /// method `demo-token` succeeds when `ACP_DEMO_TOKEN` is set and not
    /// empty; `demo-login` is offered but always fails.
    #[arg(long, env = "ACP_DEMO_REQUIRE_AUTH", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    require_auth: bool,
    /// Report usage as Claude Code does: a `usage_update` per turn (the
    /// context, and the cost so far of this process: 0.25 USD a turn) and
    /// the turn's tokens in the prompt's answer (100 in, 50 out).
    #[arg(long, env = "ACP_DEMO_USAGE", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    usage: bool,
    /// With `--usage`: the cost is the session's, as ACP defines it (0.25
    /// USD per stored turn, across processes), and `session/load` replays
    /// it as a `usage_update` after the history.
    #[arg(long, env = "ACP_DEMO_USAGE_PER_SESSION", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    usage_per_session: bool,
    /// A tool call with a side effect before the reply: every prompt first
    /// appends one line (the prompt) to this file (relative to the working
    /// directory, i.e. the worktree) and reports a tool call.
    #[arg(long, env = "ACP_DEMO_SIDE_EFFECT_FILE")]
    side_effect_file: Option<PathBuf>,
    /// After the side effect, wait while this file exists (a gate a test
    /// holds closed to crash things at that exact point of a turn).
    #[arg(long, env = "ACP_DEMO_GATE_FILE")]
    gate_file: Option<PathBuf>,
    /// After the reply's first chunk(s), wait while this file exists (a
    /// gate that holds the turn in the middle of its reply).
    #[arg(long, env = "ACP_DEMO_MID_GATE_FILE")]
    mid_gate_file: Option<PathBuf>,
    /// How many reply chunks go out before the mid-reply gate holds.
    #[arg(long, env = "ACP_DEMO_MID_GATE_AFTER", default_value_t = 1)]
    mid_gate_after: usize,
    /// Split the reply into this many extra chunks (a long, multi-chunk
    /// reply; with --chunk-delay-ms a slow one).
    #[arg(long, env = "ACP_DEMO_EXTRA_CHUNKS", default_value_t = 0)]
    extra_chunks: u32,
    /// At start, run a child that starts a grandchild (`sleep`), like npm
    /// wrappers around a native agent; the grandchild's pid goes to this file.
    #[arg(long, env = "ACP_DEMO_GRANDCHILD_PID_FILE")]
    grandchild_pid_file: Option<PathBuf>,
    /// Appends the W3C `traceparent` each prompt carries in its `_meta`
    /// (`-` when none) to this file, as an agent continuing the trace would.
    #[arg(long, env = "ACP_DEMO_TRACEPARENT_FILE")]
    traceparent_file: Option<PathBuf>,
    /// Store nothing of a session before its first prompt (as
    /// claude-code-acp and codex-acp do): `session/load` of a session that
    /// was never prompted fails with "Resource not found" after a restart.
    #[arg(long, env = "ACP_DEMO_LAZY_PERSIST", value_parser = BoolishValueParser::new(), default_value_t = false, num_args = 0..=1, default_missing_value = "true")]
    lazy_persist: bool,
}

#[derive(Debug)]
struct Demo {
    cli: Cli,
    state_dir: PathBuf,
    prompts: Mutex<u32>,
    cancelled: Mutex<HashSet<String>>,
    /// `--stale-stop-after-cancel`: sessions whose last prompt was cancelled.
    stale_stop: Mutex<HashSet<String>>,
    authenticated: Mutex<bool>,
    /// `--lazy-persist`: sessions of this process not written yet, with their cwd.
    unsaved: Mutex<std::collections::HashMap<String, PathBuf>>,
    /// The session mode of each session of this process (`default` when absent).
    modes: Mutex<std::collections::HashMap<String, String>>,
}

/// The session modes every session offers (ACP session modes).
const MODES: &[(&str, &str, &str)] = &[
    ("default", "Default", "answers as usual"),
    ("plan", "Plan", "answers, then says it only planned"),
];

fn mode_state(current: &str) -> SessionModeState {
    SessionModeState::new(
        current.to_owned(),
        MODES
            .iter()
            .map(|(id, name, what)| SessionMode::new(*id, *name).description(what.to_string()))
            .collect(),
    )
}

impl Demo {
    /// The mode and stored turns of session `id`, for `session/load` and
    /// `session/resume`: none for a session of this process not stored yet
    /// (`--lazy-persist`); -32002 for an unknown one; an error when loads
    /// are configured to fail.
    fn reopen(&self, id: &str) -> Result<(String, Vec<Turn>), Error> {
        if self.cli.fail_load {
            return Err(Error::new(
                ErrorCode::INTERNAL_ERROR,
                "acp-demo-agent is configured to fail session/load and session/resume",
            ));
        }
        let mode = lock(&self.modes)
            .get(id)
            .cloned()
            .unwrap_or_else(|| "default".to_owned());
        if lock(&self.unsaved).contains_key(id) {
            return Ok((mode, Vec::new()));
        }
        let turns = load_transcript(&self.state_dir, id)
            .map_err(|msg| Error::new(ErrorCode::RESOURCE_NOT_FOUND, msg))?;
        Ok((mode, turns))
    }

    /// `Err(-32000)` while authentication is required and was not done.
    fn check_auth(&self) -> Result<(), Error> {
        if self.cli.require_auth && !*lock(&self.authenticated) {
            return Err(Error::auth_required());
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Turn {
    prompt: String,
    reply: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut cli = Cli::parse();
    if cli.startup_ms == 0
        && let Some(ms) = std::env::var("ACP_DEMO_START_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
    {
        cli.startup_ms = ms;
    }
    let state_dir = cli
        .state_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("acp-demo-agent"));
    std::fs::create_dir_all(&state_dir)?;
    // Held until the process ends.
    let _ballast = hold_memory(cli.rss_mb);
    if cli.busy_ms > 0 {
        eprintln!(
            "acp-demo-agent: starting, busy for {} ms of CPU time",
            cli.busy_ms
        );
        let wall = std::time::Instant::now();
        burn_cpu(cli.busy_ms);
        eprintln!(
            "acp-demo-agent: started after {} ms",
            wall.elapsed().as_millis()
        );
    }
    if let Some(file) = &cli.grandchild_pid_file {
        // Not waited for: it lives as long as nothing kills it.
        let _child = std::process::Command::new("sh")
            .arg("-c")
            .arg("sleep 600 & echo $! > \"$1\"; wait")
            .arg("sh")
            .arg(file)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()?;
    }
    if cli.startup_ms > 0 {
        tokio::time::sleep(Duration::from_millis(cli.startup_ms)).await;
    }
    if let Some(gate) = &cli.start_gate_file {
        while gate.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let demo = Arc::new(Demo {
        cli,
        state_dir,
        prompts: Mutex::new(0),
        cancelled: Mutex::new(HashSet::new()),
        stale_stop: Mutex::new(HashSet::new()),
        authenticated: Mutex::new(false),
        unsaved: Mutex::new(std::collections::HashMap::new()),
        modes: Mutex::new(std::collections::HashMap::new()),
    });
    serve(demo).await?;
    Ok(())
}

async fn serve(demo: Arc<Demo>) -> Result<(), Error> {
    let d_init = demo.clone();
    let d_auth = demo.clone();
    let d_new = demo.clone();
    let d_load = demo.clone();
    let d_resume = demo.clone();
    let d_prompt = demo.clone();
    let d_mode = demo.clone();
    let d_cancel = demo;
    agent_client_protocol::Agent
        .v1()
        .name("acp-demo-agent")
        .on_receive_request(
            async move |init: InitializeRequest, responder, _cx| {
                let mut caps = AgentCapabilities::new().load_session(!d_init.cli.no_load_session);
                if d_init.cli.prompt_attachments {
                    caps = caps.prompt_capabilities(
                        PromptCapabilities::new().image(true).embedded_context(true),
                    );
                }
                if !d_init.cli.no_resume_session {
                    caps = caps.session_capabilities(
                        SessionCapabilities::new().resume(SessionResumeCapabilities::new()),
                    );
                }
                log_call(&d_init.state_dir, "initialize", None, None);
                let auth_methods = if d_init.cli.require_auth {
                    vec![
                        AuthMethod::Agent(
                            AuthMethodAgent::new("demo-token", "Demo token")
                                .description("uses ACP_DEMO_TOKEN from the environment"),
                        ),
                        AuthMethod::Agent(AuthMethodAgent::new("demo-login", "Demo login")),
                    ]
                } else {
                    Vec::new()
                };
                responder.respond(
                    InitializeResponse::new(init.protocol_version)
                        .agent_capabilities(caps)
                        .auth_methods(auth_methods)
                        .agent_info(Implementation::new(
                            "acp-demo-agent",
                            env!("CARGO_PKG_VERSION"),
                        )),
                )
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: AuthenticateRequest, responder, _cx| {
                let method = req.method_id.0.to_string();
                let ok = method == "demo-token"
                    && std::env::var("ACP_DEMO_TOKEN").is_ok_and(|t| !t.is_empty());
                if ok {
                    *lock(&d_auth.authenticated) = true;
                    return responder.respond(AuthenticateResponse::new());
                }
                responder.respond_with_error(Error::auth_required().data(format!(
                    "authentication with {method:?} failed: demo-token needs ACP_DEMO_TOKEN"
                )))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: NewSessionRequest, responder, _cx| {
                if let Err(e) = d_new.check_auth() {
                    return responder.respond_with_error(e);
                }
                let id = uuid::Uuid::new_v4().to_string();
                log_call(&d_new.state_dir, "session/new", Some(&id), None);
                if d_new.cli.lazy_persist {
                    lock(&d_new.unsaved).insert(id.clone(), req.cwd.clone());
                    return responder
                        .respond(NewSessionResponse::new(id).modes(mode_state("default")));
                }
                match save_transcript(&d_new.state_dir, &id, &req.cwd, &[]) {
                    Ok(()) => {
                        responder.respond(NewSessionResponse::new(id).modes(mode_state("default")))
                    }
                    Err(e) => responder.respond_with_error(Error::new(
                        ErrorCode::INTERNAL_ERROR,
                        format!("cannot persist session: {e}"),
                    )),
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: LoadSessionRequest, responder, cx: ConnectionTo<Client>| {
                if let Err(e) = d_load.check_auth() {
                    return responder.respond_with_error(e);
                }
                if d_load.cli.no_load_session {
                    return responder.respond_with_error(Error::method_not_found());
                }
                let id = req.session_id.0.to_string();
                let (mode, turns) = match d_load.reopen(&id) {
                    Ok(found) => found,
                    Err(e) => return responder.respond_with_error(e),
                };
                // Replay the conversation before answering, as ACP
                // specifies, each message after its share of the work.
                let mut replayed = 0;
                for turn in &turns {
                    for update in [
                        SessionUpdate::UserMessageChunk(text_chunk(&turn.prompt)),
                        SessionUpdate::AgentMessageChunk(text_chunk(&turn.reply)),
                    ] {
                        burn_cpu(d_load.cli.load_ms_per_message);
                        cx.send_notification(SessionNotification::new(
                            req.session_id.clone(),
                            update,
                        ))?;
                        replayed += 1;
                        // Let the message go out before the next one's work.
                        tokio::task::yield_now().await;
                    }
                }
                if d_load.cli.usage && d_load.cli.usage_per_session && !turns.is_empty() {
                    use agent_client_protocol::v1::schema::{Cost, UsageUpdate};
                    cx.send_notification(SessionNotification::new(
                        req.session_id.clone(),
                        SessionUpdate::UsageUpdate(
                            UsageUpdate::new(1000 * turns.len() as u64, 200_000)
                                .cost(Cost::new(0.25 * turns.len() as f64, "USD")),
                        ),
                    ))?;
                }
                log_call(&d_load.state_dir, "session/load", Some(&id), Some(replayed));
                responder.respond(LoadSessionResponse::new().modes(mode_state(&mode)))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: ResumeSessionRequest, responder, _cx| {
                if let Err(e) = d_resume.check_auth() {
                    return responder.respond_with_error(e);
                }
                if d_resume.cli.no_resume_session || d_resume.cli.refuse_resume {
                    return responder.respond_with_error(Error::method_not_found());
                }
                let id = req.session_id.0.to_string();
                let (mode, turns) = match d_resume.reopen(&id) {
                    Ok(found) => found,
                    Err(e) => return responder.respond_with_error(e),
                };
                // The same work as a load (reading the history), nothing
                // replayed.
                burn_cpu(d_resume.cli.load_ms_per_message * 2 * turns.len() as u64);
                log_call(&d_resume.state_dir, "session/resume", Some(&id), Some(0));
                responder.respond(ResumeSessionResponse::new().modes(mode_state(&mode)))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: PromptRequest, responder, cx: ConnectionTo<Client>| {
                let demo = d_prompt.clone();
                let conn = cx.clone();
                if demo
                    .cli
                    .lost_session_file
                    .as_ref()
                    .is_some_and(|f| f.exists())
                {
                    let lost = if demo.cli.lost_session_not_found {
                        Error::new(-32002, "Resource not found")
                            .data(serde_json::json!({"sessionId": req.session_id.0.to_string()}))
                    } else {
                        Error::internal_error()
                            .data(serde_json::json!({"details": "Session not found"}))
                    };
                    return responder.respond_with_error(lost);
                }
                cx.spawn(async move {
                    let result = run_turn(&demo, &conn, req).await;
                    let crash_after = demo.cli.crash_after_prompts;
                    let count = current_prompt_count(&demo);
                    responder.respond_with_result(result)?;
                    if crash_after == Some(count) {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        eprintln!("acp-demo-agent: crashing after prompt {count} as configured");
                        std::process::exit(43);
                    }
                    Ok(())
                })
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |req: SetSessionModeRequest, responder, cx: ConnectionTo<Client>| {
                let mode = req.mode_id.0.to_string();
                if !MODES.iter().any(|(id, _, _)| *id == mode) {
                    return responder.respond_with_error(Error::invalid_params().data(format!(
                        "unknown mode {mode:?}; the modes are default and plan"
                    )));
                }
                lock(&d_mode.modes).insert(req.session_id.0.to_string(), mode.clone());
                if !d_mode.cli.quiet_mode_set {
                    cx.send_notification(SessionNotification::new(
                        req.session_id.clone(),
                        SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(mode)),
                    ))?;
                }
                responder.respond(SetSessionModeResponse::new())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            async move |n: CancelNotification, _cx| {
                if !d_cancel.cli.ignore_cancel {
                    lock(&d_cancel.cancelled).insert(n.session_id.0.to_string());
                }
                Ok(())
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_to(Stdio::new())
        .await
}

/// A prompt block other than text, as logged: its type and what it holds
/// (bytes as the base64 ACP carries them).
fn block_summary(block: &ContentBlock) -> Option<serde_json::Value> {
    use agent_client_protocol::v1::schema::EmbeddedResourceResource as R;
    Some(match block {
        ContentBlock::Image(i) => serde_json::json!({
            "type": "image", "mime_type": i.mime_type, "data": i.data, "uri": i.uri,
        }),
        ContentBlock::ResourceLink(l) => serde_json::json!({
            "type": "resource_link", "uri": l.uri, "name": l.name,
        }),
        ContentBlock::Resource(r) => match &r.resource {
            R::TextResourceContents(t) => serde_json::json!({
                "type": "resource", "uri": t.uri, "text": t.text,
            }),
            R::BlobResourceContents(b) => serde_json::json!({
                "type": "resource", "uri": b.uri, "blob": b.blob,
            }),
            _ => serde_json::json!({"type": "resource"}),
        },
        _ => return None,
    })
}

/// Appends one JSON line about a call to `<state-dir>/calls.log`. Best
/// effort: a test that reads the log fails on a missing line.
fn log_call(state_dir: &Path, method: &str, session_id: Option<&str>, replayed: Option<u64>) {
    log_line(
        state_dir,
        &serde_json::json!({
            "pid": std::process::id(),
            "method": method,
            "session_id": session_id,
            "replayed": replayed,
        }),
    );
}

fn log_line(state_dir: &Path, line: &serde_json::Value) {
    use std::io::Write;
    let method = line["method"].as_str().unwrap_or_default();
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state_dir.join("calls.log"))
        // One write of the whole line: `writeln!` may split it into several,
        // and a test reading meanwhile would see half a line.
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        eprintln!("acp-demo-agent: cannot log {method} to calls.log: {e}");
    }
}

/// CPU time (user + system) this process has used, in milliseconds, from
/// `/proc/self/stat` (clock ticks of 10 ms, Linux's USER_HZ); `None`
/// where there is no such file.
fn own_cpu_ms() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    Some((f.get(11)? + f.get(12)?) * 10)
}

/// Spins until this process has used `ms` more milliseconds of CPU time
/// (wall-clock time where `/proc` cannot tell): real work, however slowly
/// a loaded machine lets it run.
fn burn_cpu(ms: u64) {
    if ms == 0 {
        return;
    }
    let wall = std::time::Instant::now();
    let start = own_cpu_ms();
    let mut x = 0u64;
    loop {
        for i in 0..100_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let done = match (start, own_cpu_ms()) {
            (Some(a), Some(b)) => b.saturating_sub(a) >= ms,
            _ => wall.elapsed() >= Duration::from_millis(ms),
        };
        if done {
            return;
        }
    }
}

/// `mb` MiB, every page written so that it is resident.
fn hold_memory(mb: u64) -> Vec<u8> {
    let len = usize::try_from(mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let mut ballast = vec![0u8; len];
    for page in ballast.chunks_mut(4096) {
        page[0] = 1;
    }
    if mb > 0 {
        eprintln!("acp-demo-agent: holding {mb} MiB");
    }
    std::hint::black_box(ballast)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn current_prompt_count(demo: &Demo) -> u32 {
    *lock(&demo.prompts)
}

fn text_chunk(text: &str) -> ContentChunk {
    ContentChunk::new(ContentBlock::Text(TextContent::new(text)))
}

/// The answer to a cancelled prompt (remembered for
/// `--stale-stop-after-cancel`).
fn cancelled_turn(demo: &Demo, session: &str) -> PromptResponse {
    if demo.cli.stale_stop_after_cancel {
        lock(&demo.stale_stop).insert(session.to_owned());
    }
    PromptResponse::new(StopReason::Cancelled)
}

async fn run_turn(
    demo: &Demo,
    cx: &ConnectionTo<Client>,
    req: PromptRequest,
) -> Result<PromptResponse, Error> {
    let id = req.session_id.0.to_string();
    for block in &req.prompt {
        if let Some(logged) = block_summary(block) {
            log_line(
                &demo.state_dir,
                &serde_json::json!({
                    "pid": std::process::id(),
                    "method": "prompt_block",
                    "session_id": id,
                    "block": logged,
                }),
            );
        }
    }
    let count = {
        let mut n = lock(&demo.prompts);
        *n += 1;
        *n
    };
    lock(&demo.cancelled).remove(&id);
    if lock(&demo.stale_stop).remove(&id) {
        return Ok(PromptResponse::new(StopReason::EndTurn));
    }
    if let Some(file) = &demo.cli.traceparent_file {
        let traceparent = req
            .meta
            .as_ref()
            .and_then(|m| m.get("traceparent"))
            .and_then(|v| v.as_str())
            .unwrap_or("-");
        let line = format!("{traceparent}\n");
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()))
            .map_err(|e| {
                Error::new(
                    ErrorCode::INTERNAL_ERROR,
                    format!("cannot write {}: {e}", file.display()),
                )
            })?;
    }
    let unsaved_cwd = lock(&demo.unsaved).get(&id).cloned();
    let mut turns = match unsaved_cwd {
        Some(_) => Vec::new(),
        None => load_transcript(&demo.state_dir, &id)
            .map_err(|msg| Error::new(ErrorCode::RESOURCE_NOT_FOUND, msg))?,
    };
    let prompt: String = req
        .prompt
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text(t) => Some(t.text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("");
    let n = turns.len() + 1;
    if let Some(file) = &demo.cli.side_effect_file {
        side_effect(cx, &req.session_id, file, &prompt, count)?;
        if let Some(gate) = &demo.cli.gate_file {
            while gate.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    let mut chunks = vec![
        format!("turn {n} "),
        format!("of session {id}: "),
        format!("you said \"{prompt}\""),
    ];
    // `/long`: a turn of 600 chunks 100 ms apart (a minute), which honours
    // `session/cancel` between chunks.
    let long = prompt.split_whitespace().next() == Some("/long");
    let extra = if long { 600 } else { demo.cli.extra_chunks };
    for i in 0..extra {
        chunks.push(format!(" [{}]", i + 1));
    }
    // `/mode ID`: the agent switches its own mode (ACP
    // `current_mode_update`), as agents do when a task calls for it.
    if let ["/mode", mode] = prompt.split_whitespace().collect::<Vec<_>>()[..] {
        if !MODES.iter().any(|(m, _, _)| *m == mode) {
            return Err(Error::invalid_params().data(format!(
                "unknown mode {mode:?}; the modes are default and plan"
            )));
        }
        lock(&demo.modes).insert(id.clone(), mode.to_owned());
        cx.send_notification(SessionNotification::new(
            req.session_id.clone(),
            SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(mode.to_owned())),
        ))?;
        chunks.push(format!("\nmode: {mode}"));
    }
    if let Some(extra) = slash_command(cx, &req.session_id, &prompt).await? {
        chunks.push(format!("\n{extra}"));
    }
    if lock(&demo.modes).get(&id).map(String::as_str) == Some("plan") {
        chunks.push(" (plan mode: nothing was done)".to_owned());
    }
    let delay = Duration::from_millis(if long { 100 } else { demo.cli.chunk_delay_ms });
    for (i, chunk) in chunks.iter().enumerate() {
        if i > 0 && !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if lock(&demo.cancelled).remove(&id) {
            return Ok(cancelled_turn(demo, &id));
        }
        cx.send_notification(SessionNotification::new(
            req.session_id.clone(),
            SessionUpdate::AgentMessageChunk(text_chunk(chunk)),
        ))?;
        if i + 1 == demo.cli.mid_gate_after.max(1)
            && let Some(gate) = &demo.cli.mid_gate_file
        {
            while gate.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if i == 0 && demo.cli.crash_mid_turn == Some(count) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            eprintln!("acp-demo-agent: crashing in the middle of prompt {count} as configured");
            std::process::exit(42);
        }
    }
    if lock(&demo.cancelled).remove(&id) {
        return Ok(cancelled_turn(demo, &id));
    }
    turns.push(Turn {
        prompt,
        reply: chunks.concat(),
    });
    let cwd = unsaved_cwd
        .or_else(|| load_cwd(&demo.state_dir, &id))
        .unwrap_or_default();
    save_transcript(&demo.state_dir, &id, &cwd, &turns).map_err(|e| {
        Error::new(
            ErrorCode::INTERNAL_ERROR,
            format!("cannot persist turn: {e}"),
        )
    })?;
    lock(&demo.unsaved).remove(&id);
    if demo.cli.usage {
        use agent_client_protocol::v1::schema::{Cost, Usage, UsageUpdate};
        cx.send_notification(SessionNotification::new(
            req.session_id.clone(),
            SessionUpdate::UsageUpdate(UsageUpdate::new(1000 * n as u64, 200_000).cost(Cost::new(
                if demo.cli.usage_per_session {
                    0.25 * n as f64
                } else {
                    0.25 * f64::from(count)
                },
                "USD",
            ))),
        ))?;
        return Ok(PromptResponse::new(StopReason::EndTurn).usage(Usage::new(150, 100, 50)));
    }
    Ok(PromptResponse::new(StopReason::EndTurn))
}

/// The tool call of `--side-effect-file`: appends the prompt as one line and
/// reports a completed tool call.
fn side_effect(
    cx: &ConnectionTo<Client>,
    session: &agent_client_protocol::v1::schema::SessionId,
    file: &Path,
    prompt: &str,
    count: u32,
) -> Result<(), Error> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .and_then(|mut f| {
            writeln!(f, "{}", prompt.replace('\n', " "))?;
            f.sync_data()
        })
        .map_err(|e| Error::new(ErrorCode::INTERNAL_ERROR, format!("side effect: {e}")))?;
    cx.send_notification(SessionNotification::new(
        session.clone(),
        SessionUpdate::ToolCall(
            ToolCall::new(format!("side-effect-{count}"), "append a line")
                .status(ToolCallStatus::Completed),
        ),
    ))?;
    Ok(())
}

/// Runs the client-facing feature a slash prompt asks for and describes the
/// outcome; `None` for an ordinary prompt.
async fn slash_command(
    cx: &ConnectionTo<Client>,
    session: &agent_client_protocol::v1::schema::SessionId,
    prompt: &str,
) -> Result<Option<String>, Error> {
    let mut words = prompt.splitn(3, ' ');
    let Some(cmd) = words.next() else {
        return Ok(None);
    };
    let out = match cmd {
        "/tool" => {
            cx.send_notification(SessionNotification::new(
                session.clone(),
                SessionUpdate::ToolCall(
                    ToolCall::new("demo-tool-1", "demo tool").status(ToolCallStatus::InProgress),
                ),
            ))?;
            cx.send_notification(SessionNotification::new(
                session.clone(),
                SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
                    "demo-tool-1",
                    ToolCallUpdateFields::new().status(ToolCallStatus::Completed),
                )),
            ))?;
            "tool: done".to_owned()
        }
        "/activity" => {
            activity(cx, session)?;
            "activity: sent".to_owned()
        }
        "/run" => {
            // A command as Codex reports one: only its raw input and
            // output say what ran, where, how it ended and what it
            // printed (here 2,000 lines, more than a client keeps).
            use agent_client_protocol::v1::schema::ToolKind;
            cx.send_notification(SessionNotification::new(
                session.clone(),
                SessionUpdate::ToolCall(
                    ToolCall::new("demo-run-1", "run the tests")
                        .kind(ToolKind::Execute)
                        .status(ToolCallStatus::InProgress)
                        .raw_input(serde_json::json!({
                            "command": ["sh", "-c", "make test"],
                            "cwd": "/demo/work",
                        })),
                ),
            ))?;
            let mut stdout: String = (1..=2000).map(|i| format!("test {i} ok\n")).collect();
            stdout.push_str("FAILED: 2 tests\n");
            cx.send_notification(SessionNotification::new(
                session.clone(),
                SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
                    "demo-run-1",
                    ToolCallUpdateFields::new()
                        .status(ToolCallStatus::Failed)
                        .raw_output(serde_json::json!({"exit_code": 3, "stdout": stdout})),
                )),
            ))?;
            "run: exit 3".to_owned()
        }
        "/unparsed" => {
            // A tool call whose id is a number: no ACP schema reads it, so
            // a client must keep it raw rather than lose it.
            cx.send_notification(agent_client_protocol::UntypedMessage::new(
                "session/update",
                serde_json::json!({
                    "sessionId": session,
                    "update": {"sessionUpdate": "tool_call", "toolCallId": 7, "title": "bad id"},
                }),
            )?)?;
            "unparsed: sent".to_owned()
        }
        "/edit" => {
            let path = words.next().unwrap_or_default();
            let content = words.next().unwrap_or_default();
            edit_with_permission(cx, session, path, content, false).await?
        }
        "/edit-codex" => {
            let path = words.next().unwrap_or_default();
            let content = words.next().unwrap_or_default();
            edit_with_permission(cx, session, path, content, true).await?
        }
        "/permission" | "/permission-none" => {
            // `/permission-none` offers nothing to choose (a malformed
            // request some agents send): the reply says what the client did.
            let options = if cmd == "/permission" {
                vec![
                    PermissionOption::new("allow", "Allow", PermissionOptionKind::AllowOnce),
                    PermissionOption::new("reject", "Reject", PermissionOptionKind::RejectOnce),
                ]
            } else {
                Vec::new()
            };
            let answer = cx
                .send_request(RequestPermissionRequest::new(
                    session.clone(),
                    ToolCallUpdate::new(
                        "demo-permission-1",
                        ToolCallUpdateFields::new().title("demo permission".to_owned()),
                    ),
                    options,
                ))
                .block_task()
                .await;
            match answer {
                Ok(answer) => match answer.outcome {
                    RequestPermissionOutcome::Selected(s) => {
                        format!("permission: {}", s.option_id.0)
                    }
                    _ => "permission: cancelled".to_owned(),
                },
                Err(e) => format!("permission: refused: {}", e.message),
            }
        }
        "/ask" => {
            // An ACP elicitation: a form with the fields named after /ask
            // (required strings; `name` when none), answered as the reply.
            let mut schema = ElicitationSchema::new();
            let fields: Vec<&str> = words.by_ref().collect();
            for f in if fields.is_empty() {
                vec!["name"]
            } else {
                fields
            } {
                schema = schema.string(f, true);
            }
            let answer = cx
                .send_request(CreateElicitationRequest::new(
                    ElicitationFormMode::new(ElicitationSessionScope::new(session.clone()), schema),
                    "The demo agent asks",
                ))
                .block_task()
                .await?;
            match answer.action {
                ElicitationAction::Accept(a) => format!(
                    "answer: accept {}",
                    serde_json::to_string(&a.content).unwrap_or_default()
                ),
                ElicitationAction::Decline => "answer: decline".to_owned(),
                _ => "answer: cancel".to_owned(),
            }
        }
        "/ask-url" => {
            // An ACP elicitation of mode url: the user is sent to a page.
            let url = words.next().unwrap_or_default();
            let answer = cx
                .send_request(CreateElicitationRequest::new(
                    ElicitationUrlMode::new(
                        ElicitationSessionScope::new(session.clone()),
                        "demo-url",
                        url,
                    ),
                    "The demo agent sends you to a page",
                ))
                .block_task()
                .await?;
            match answer.action {
                ElicitationAction::Accept(_) => "answer: accept".to_owned(),
                ElicitationAction::Decline => "answer: decline".to_owned(),
                _ => "answer: cancel".to_owned(),
            }
        }
        "/big" => {
            // One reply chunk of N bytes (an agent pasting a huge file).
            let n: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
            "x".repeat(n.min(256 << 20))
        }
        "/fail" => {
            return Err(Error::new(
                ErrorCode::INTERNAL_ERROR,
                "acp-demo-agent: this turn fails on purpose (/fail)",
            ));
        }
        "/read" => {
            let path = words.next().unwrap_or_default();
            match cx
                .send_request(ReadTextFileRequest::new(session.clone(), path))
                .block_task()
                .await
            {
                Ok(r) => format!("read: {}", r.content),
                Err(e) => format!("read failed: {}", e.message),
            }
        }
        "/terminal" => terminal(cx, session, prompt.trim_start_matches("/terminal").trim()).await?,
        "/write" => {
            let path = words.next().unwrap_or_default();
            let content = words.next().unwrap_or_default();
            match cx
                .send_request(WriteTextFileRequest::new(session.clone(), path, content))
                .block_task()
                .await
            {
                Ok(_) => "write: ok".to_owned(),
                Err(e) => format!("write failed: {}", e.message),
            }
        }
        _ => return Ok(None),
    };
    Ok(Some(out))
}

/// `/terminal CMD`: runs `sh -c CMD` in a client terminal shown by a tool
/// call (kind execute), to its end; describes the exit and the output.
async fn terminal(
    cx: &ConnectionTo<Client>,
    session: &agent_client_protocol::v1::schema::SessionId,
    command: &str,
) -> Result<String, Error> {
    use agent_client_protocol::v1::schema::{
        CreateTerminalRequest, ReleaseTerminalRequest, Terminal, TerminalOutputRequest,
        ToolCallContent, ToolKind, WaitForTerminalExitRequest,
    };
    let created = match cx
        .send_request(
            CreateTerminalRequest::new(session.clone(), "sh")
                .args(vec!["-c".into(), command.into()]),
        )
        .block_task()
        .await
    {
        Ok(c) => c,
        Err(e) => return Ok(format!("terminal failed: {}", e.message)),
    };
    let id = created.terminal_id;
    cx.send_notification(SessionNotification::new(
        session.clone(),
        SessionUpdate::ToolCall(
            ToolCall::new("demo-terminal-1", format!("run {command}"))
                .kind(ToolKind::Execute)
                .status(ToolCallStatus::InProgress)
                .content(vec![ToolCallContent::Terminal(Terminal::new(id.clone()))]),
        ),
    ))?;
    let exit = cx
        .send_request(WaitForTerminalExitRequest::new(session.clone(), id.clone()))
        .block_task()
        .await?;
    let out = cx
        .send_request(TerminalOutputRequest::new(session.clone(), id.clone()))
        .block_task()
        .await?;
    cx.send_request(ReleaseTerminalRequest::new(session.clone(), id))
        .block_task()
        .await?;
    cx.send_notification(SessionNotification::new(
        session.clone(),
        SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
            "demo-terminal-1",
            ToolCallUpdateFields::new().status(ToolCallStatus::Completed),
        )),
    ))?;
    let ended = match (exit.exit_status.exit_code, exit.exit_status.signal) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        (None, None) => "exited".to_owned(),
    };
    Ok(format!("terminal: {ended}: {}", out.output.trim_end()))
}

/// `/activity`: one update of every kind a client shows besides the reply:
/// a thought (two chunks), a plan, a tool call with locations and its update
/// (text content, a diff, status), the available commands, a mode change and
/// a kind the client does not type (`session_info_update`).
fn activity(
    cx: &ConnectionTo<Client>,
    session: &agent_client_protocol::v1::schema::SessionId,
) -> Result<(), Error> {
    use agent_client_protocol::v1::schema::{
        AvailableCommand, AvailableCommandsUpdate, Content, CurrentModeUpdate, Diff, Plan,
        PlanEntry, PlanEntryPriority, PlanEntryStatus, SessionInfoUpdate, ToolCallContent,
        ToolCallLocation, ToolKind,
    };
    let send =
        |u: SessionUpdate| cx.send_notification(SessionNotification::new(session.clone(), u));
    send(SessionUpdate::AgentThoughtChunk(text_chunk("thinking ")))?;
    send(SessionUpdate::AgentThoughtChunk(text_chunk("about it")))?;
    send(SessionUpdate::Plan(Plan::new(vec![
        PlanEntry::new(
            "read the file",
            PlanEntryPriority::High,
            PlanEntryStatus::Completed,
        ),
        PlanEntry::new(
            "edit the file",
            PlanEntryPriority::Medium,
            PlanEntryStatus::InProgress,
        ),
    ])))?;
    send(SessionUpdate::ToolCall(
        ToolCall::new("demo-edit-1", "edit notes.txt")
            .kind(ToolKind::Edit)
            .status(ToolCallStatus::InProgress)
            .locations(vec![ToolCallLocation::new("notes.txt").line(3)]),
    ))?;
    send(SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
        "demo-edit-1",
        ToolCallUpdateFields::new()
            .status(ToolCallStatus::Completed)
            .content(vec![
                ToolCallContent::Content(Content::new(ContentBlock::Text(TextContent::new(
                    "edited 1 line",
                )))),
                ToolCallContent::Diff(Diff::new("notes.txt", "new line").old_text("old line")),
            ]),
    )))?;
    send(SessionUpdate::AvailableCommandsUpdate(
        AvailableCommandsUpdate::new(vec![
            AvailableCommand::new("tool", "report a tool call"),
            AvailableCommand::new("activity", "report every kind of activity"),
        ]),
    ))?;
    send(SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(
        "plan",
    )))?;
    send(SessionUpdate::SessionInfoUpdate(
        SessionInfoUpdate::new().title("demo session".to_owned()),
    ))?;
    Ok(())
}

/// `/edit PATH TEXT`: a tool call that asks permission first (as coding
/// agents do before changing files), carrying the change as a diff (the
/// file's old text when it exists); writes PATH through the client only
/// when an allow option was chosen.
async fn edit_with_permission(
    cx: &ConnectionTo<Client>,
    session: &agent_client_protocol::v1::schema::SessionId,
    path: &str,
    content: &str,
    codex_ids: bool,
) -> Result<String, Error> {
    use agent_client_protocol::v1::schema::{Diff, ToolCallContent, ToolKind};
    let id = "demo-edit-permission";
    // The text before the change, read as coding agents read it (from
    // the working directory, the worktree): absent for a new file.
    let diff = Diff::new(path, content);
    let diff = match std::fs::read_to_string(path) {
        Ok(old) => diff.old_text(old),
        Err(_) => diff,
    };
    let diff = vec![ToolCallContent::Diff(diff)];
    cx.send_notification(SessionNotification::new(
        session.clone(),
        SessionUpdate::ToolCall(
            ToolCall::new(id, format!("write {path}"))
                .kind(ToolKind::Edit)
                .status(ToolCallStatus::Pending)
                .content(diff.clone()),
        ),
    ))?;
    // Codex names its options by what they do, not by their kind: a
    // client must map "allow" onto them by kind.
    let options = if codex_ids {
        vec![
            PermissionOption::new("approved", "Yes", PermissionOptionKind::AllowOnce),
            PermissionOption::new(
                "approved-for-session",
                "Always",
                PermissionOptionKind::AllowAlways,
            ),
            PermissionOption::new("abort", "No", PermissionOptionKind::RejectOnce),
        ]
    } else {
        vec![
            PermissionOption::new("allow", "Allow", PermissionOptionKind::AllowOnce),
            PermissionOption::new("reject", "Reject", PermissionOptionKind::RejectOnce),
        ]
    };
    let answer = cx
        .send_request(RequestPermissionRequest::new(
            session.clone(),
            ToolCallUpdate::new(
                id,
                ToolCallUpdateFields::new()
                    .title(format!("write {path}"))
                    .content(diff),
            ),
            options,
        ))
        .block_task()
        .await?;
    let allowed = matches!(&answer.outcome,
        RequestPermissionOutcome::Selected(s)
            if ["allow", "approved", "approved-for-session"].contains(&s.option_id.0.as_ref()));
    let (status, out) = if allowed {
        match cx
            .send_request(WriteTextFileRequest::new(session.clone(), path, content))
            .block_task()
            .await
        {
            Ok(_) => (ToolCallStatus::Completed, "edit: written".to_owned()),
            Err(e) => (
                ToolCallStatus::Failed,
                format!("edit failed: {}", e.message),
            ),
        }
    } else {
        let why = match answer.outcome {
            RequestPermissionOutcome::Selected(s) => s.option_id.0.to_string(),
            _ => "cancelled".to_owned(),
        };
        (ToolCallStatus::Failed, format!("edit: not allowed ({why})"))
    };
    cx.send_notification(SessionNotification::new(
        session.clone(),
        SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
            id,
            ToolCallUpdateFields::new().status(status),
        )),
    ))?;
    Ok(out)
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn transcript_path(dir: &Path, id: &str) -> Result<PathBuf, String> {
    if !valid_id(id) {
        return Err(format!("invalid session id {id:?}"));
    }
    Ok(dir.join(format!("{id}.json")))
}

fn read_json(dir: &Path, id: &str) -> Result<serde_json::Value, String> {
    let path = transcript_path(dir, id)?;
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("session {id} not found: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("session {id} is corrupt: {e}"))
}

fn load_transcript(dir: &Path, id: &str) -> Result<Vec<Turn>, String> {
    let v = read_json(dir, id)?;
    let turns = v
        .get("turns")
        .and_then(|t| t.as_array())
        .cloned()
        .unwrap_or_default();
    Ok(turns
        .iter()
        .map(|t| Turn {
            prompt: t
                .get("prompt")
                .and_then(|p| p.as_str())
                .unwrap_or_default()
                .to_owned(),
            reply: t
                .get("reply")
                .and_then(|p| p.as_str())
                .unwrap_or_default()
                .to_owned(),
        })
        .collect())
}

fn load_cwd(dir: &Path, id: &str) -> Option<PathBuf> {
    read_json(dir, id)
        .ok()?
        .get("cwd")
        .and_then(|c| c.as_str())
        .map(PathBuf::from)
}

fn save_transcript(dir: &Path, id: &str, cwd: &Path, turns: &[Turn]) -> std::io::Result<()> {
    let path = transcript_path(dir, id).map_err(std::io::Error::other)?;
    let value = serde_json::json!({
        "session_id": id,
        "cwd": cwd.to_string_lossy(),
        "turns": turns
            .iter()
            .map(|t| serde_json::json!({"prompt": t.prompt, "reply": t.reply}))
            .collect::<Vec<_>>(),
    });
    let tmp = dir.join(format!(".{id}.json.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&value)?)?;
    std::fs::rename(&tmp, &path)
}
