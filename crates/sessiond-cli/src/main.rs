//! `sessionctl`: a command-line client of the sessiond API.
//!
//! Server address and token come from `--addr`/`--token` or `SESSIOND_ADDR`/
//! `SESSIOND_TOKEN`; `--task` from `SESSIOND_TASK` as well, so a shell can set
//! it once. Every command prints readable text, or one JSON document per
//! result (per event for `watch`) with `--json`.

#![allow(clippy::print_stdout)]

/// `println!` for this binary: see `stdout`.
macro_rules! println {
    () => {
        $crate::stdout::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::stdout::line(format_args!($($arg)*))
    };
}

/// `print!` for this binary: see `stdout`.
macro_rules! print {
    ($($arg:tt)*) => {
        $crate::stdout::text(format_args!($($arg)*))
    };
}

mod output;
mod stdout;

use std::{io::Write, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use sessiond_proto::sessiond::v1::{
    self as pb, session_service_client::SessionServiceClient,
    workspace_service_client::WorkspaceServiceClient,
};
use tokio_stream::StreamExt;
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::Channel,
};

use crate::output::Out;

#[derive(Debug, Parser)]
#[command(
    name = "sessionctl",
    version,
    about = "Command-line client of sessiond: tasks, agent sessions, messages, events, workspaces"
)]
struct Cli {
    /// Server address.
    #[arg(
        long,
        global = true,
        env = "SESSIOND_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    addr: String,
    /// API bearer token.
    #[arg(long, global = true, env = "SESSIOND_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// With an `https://` address: the certificate authority to trust (PEM;
    /// for a self-signed server certificate, that certificate, made with
    /// basicConstraints CA:FALSE as the README shows).
    #[arg(long, global = true, env = "SESSIOND_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// For create commands: print only the new id.
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Tasks: units of work that have sessions.
    #[command(subcommand)]
    Task(TaskCmd),
    /// Agent sessions of a task.
    #[command(subcommand)]
    Session(SessionCmd),
    /// Send a prompt to a session's agent and print its reply as it streams.
    Send(SendArgs),
    /// Run again the session's last turn if it ended interrupted (a crash
    /// left it unknown whether the agent ran it; sessiond never re-sends
    /// such a turn by itself), and print the reply as it streams.
    Retry(RetryArgs),
    /// Cancel the session's turn in progress; the reply so far is kept.
    Cancel(SessionRef),
    /// Take a queued message off the session's queue before it is sent
    /// (`session status` lists the queue).
    Unqueue {
        #[command(flatten)]
        session: SessionRef,
        message_id: String,
    },
    /// Answer a permission request of the agent (profile policy `ask`;
    /// `session status` lists the pending ones) with one of its options.
    Permission {
        #[command(flatten)]
        session: SessionRef,
        request_id: String,
        /// An option's id, or a kind: `allow`, `allow-always`, `reject`,
        /// `reject-always` (the agent's option of that kind). A question
        /// (elicitation) takes `accept`, `decline` or `cancel`.
        option_id: String,
        /// A question answered `accept`: the form's values as a JSON object,
        /// e.g. '{"name": "Ada"}'.
        #[arg(long, value_name = "JSON")]
        values: Option<String>,
    },
    /// Rename a session (an empty title clears it: the next prompt or
    /// the agent names it again).
    Title {
        #[command(flatten)]
        session: SessionRef,
        title: String,
    },
    /// Switch the agent's session mode (`session status` lists the modes).
    Mode {
        #[command(flatten)]
        session: SessionRef,
        mode_id: String,
    },
    /// Set one of the agent's config options, e.g. its model (`session
    /// status` lists them with the values each takes).
    Config {
        #[command(flatten)]
        session: SessionRef,
        /// The option's id (`model`, ...).
        config_id: String,
        /// One of the values it offers (`true` / `false` for a switch).
        value: String,
    },
    /// List a session's messages.
    Messages(MessagesArgs),
    /// Follow a session's (or a task's) events live; reconnects after a
    /// disconnect from the last event seen, so nothing is missed or repeated.
    Watch(WatchArgs),
    /// Shell, files and git of a session's workspace.
    #[command(subcommand)]
    Workspace(WorkspaceCmd),
    /// List the agent profiles the server knows.
    Profiles,
    /// The sessiond replicas sharing the server's database: id, address,
    /// heartbeat age, and load (executors each owns).
    Replicas,
    /// The server's health: NOT_SERVING until startup recovery has every workspace back.
    Health {
        /// Wait (up to --timeout-secs) until the server is SERVING; retries
        /// while it is not reachable yet.
        #[arg(long)]
        wait: bool,
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
    },
}

#[derive(Debug, Subcommand)]
enum TaskCmd {
    /// Create a task; sessions belong to one.
    Create { title: String },
    /// List every task.
    List,
    /// Show one task.
    Get { task_id: String },
}

#[derive(Debug, Args)]
struct TaskArg {
    /// The task the session belongs to.
    #[arg(long, env = "SESSIOND_TASK")]
    task: String,
}

#[derive(Debug, Args)]
struct SessionRef {
    #[command(flatten)]
    task: TaskArg,
    session_id: String,
}

// Parsed once per run: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum SessionCmd {
    /// Launch an executor and an agent; returns once the agent waits for input.
    Create {
        #[command(flatten)]
        task: TaskArg,
        /// Agent profile name or id; the server's default when omitted.
        #[arg(long)]
        agent: Option<String>,
        /// local_standalone | local_docker | remote, or the name of a runtime
        /// the server registered (an embedding service's own); the server's
        /// default when omitted.
        #[arg(long)]
        runtime: Option<String>,
        /// Working tree for the agent (must exist on the executor's host).
        #[arg(long, default_value = ".", conflicts_with = "repo")]
        worktree: String,
        /// Create an isolated git worktree of this repository on a branch
        /// of the session's own (`--repo` alone: the repository of the
        /// current directory).
        #[arg(long, num_args = 0..=1, default_missing_value = ".")]
        repo: Option<String>,
        /// With --repo: the branch, tag or commit to start from. Default:
        /// the repository's current branch.
        #[arg(long, requires = "repo")]
        base: Option<String>,
        /// The branch: with --repo, the new branch's name (default
        /// `<prefix>/<short id>-<slug of the task title>`); without, a label.
        #[arg(long, default_value = "")]
        branch: String,
        /// agentctl URL for the remote runtime.
        #[arg(long)]
        remote_url: Option<String>,
        /// Secret the remote agentctl was started with.
        #[arg(long, env = "SESSIOND_REMOTE_SECRET", hide_env_values = true)]
        remote_secret: Option<String>,
        /// Executor id the remote agentctl was started with.
        #[arg(long)]
        remote_executor_id: Option<String>,
        /// An MCP server for this session's agent besides its profile's:
        /// `NAME=COMMAND ARG...` (stdio) or `NAME=http(s)://URL` (http);
        /// repeatable. Values needing secrets go in a profile instead.
        #[arg(long = "mcp", value_name = "NAME=SERVER")]
        mcp: Vec<String>,
    },
    /// List the task's sessions with their state and runtime.
    List {
        #[command(flatten)]
        task: TaskArg,
    },
    /// Show one session.
    Get(SessionRef),
    /// Session-specific status: executor, agent, resumability.
    Status(SessionRef),
    /// Resume the agent conversation from the session's resume token.
    Resume(SessionRef),
    /// End the agent and its executor.
    Stop {
        #[command(flatten)]
        session: SessionRef,
        /// Mark the session COMPLETED instead of CANCELLED.
        #[arg(long)]
        completed: bool,
    },
    /// Stop if needed and remove the session's executor, and the worktree
    /// sessiond created for it when nothing in it would be lost.
    Delete {
        #[command(flatten)]
        session: SessionRef,
        /// Remove the worktree even with uncommitted changes or commits only
        /// its branch has (they are lost).
        #[arg(long, conflicts_with = "keep_worktree")]
        discard: bool,
        /// Leave the worktree and its branch where they are.
        #[arg(long)]
        keep_worktree: bool,
        /// Delete the branch even when it is not merged into the base.
        #[arg(long)]
        delete_branch: bool,
    },
}

#[derive(Debug, Args)]
struct SendArgs {
    #[command(flatten)]
    session: SessionRef,
    /// The prompt; `-` reads it from standard input (a prompt longer than
    /// a command line can hold).
    text: String,
    /// Return once the message is stored (or queued) instead of waiting for
    /// the reply. While sessiond brings the session's agent back (after a
    /// restart, seconds for a real agent), the message is queued at once
    /// and sent once the agent is back (with `--no-queue`, this waits for
    /// the agent).
    #[arg(long)]
    no_wait: bool,
    /// Give up after this many seconds: the call itself (which waits while
    /// the session's agent is brought back) and the wait for the reply.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Fail while a turn runs instead of queueing the message behind it.
    #[arg(long)]
    no_queue: bool,
    /// An idempotency key: the same command run again with the same key
    /// (after a lost answer or UNAVAILABLE) answers with the first send's
    /// message instead of sending it twice.
    #[arg(long, value_name = "KEY")]
    request_id: Option<String>,
    /// Send this image file (PNG, JPEG, GIF or WebP, read here) with the
    /// text; repeatable. A message with attachments is never queued.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    /// Embed this file of the session's worktree (relative to its root)
    /// in the prompt; repeatable.
    #[arg(long = "attach", value_name = "PATH")]
    files: Vec<String>,
    /// Send a link the agent may follow; repeatable.
    #[arg(long = "link", value_name = "URI")]
    links: Vec<String>,
    #[command(flatten)]
    answer: AnswerArgs,
}

/// How `send` and `retry` answer the agent's permission requests (profile
/// policy `ask`). Without either flag they ask on the terminal; with no
/// terminal they stop with an error instead of waiting.
#[derive(Debug, Args)]
struct AnswerArgs {
    /// Allow every permission request of the turn (the agent's allow option).
    #[arg(long, conflicts_with = "deny")]
    approve: bool,
    /// Reject every permission request of the turn (the agent's reject option).
    #[arg(long)]
    deny: bool,
}

#[derive(Debug, Args)]
struct RetryArgs {
    #[command(flatten)]
    session: SessionRef,
    /// The interrupted turn's user message (from `messages`); the last turn
    /// when omitted. Naming it makes a repeated call fail instead of
    /// running the turn again.
    #[arg(long)]
    message_id: Option<String>,
    /// Return once the message is stored instead of waiting for the reply.
    #[arg(long)]
    no_wait: bool,
    /// Give up after this many seconds: the call itself (which waits while
    /// the session's agent is brought back) and the wait for the reply.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    #[command(flatten)]
    answer: AnswerArgs,
}

#[derive(Debug, Args)]
struct MessagesArgs {
    #[command(flatten)]
    session: SessionRef,
    /// Only messages after this seq.
    #[arg(long, default_value_t = 0)]
    after_seq: i64,
}

#[derive(Debug, Args)]
struct WatchArgs {
    /// The session to follow.
    #[arg(long, conflicts_with = "task", required_unless_present = "task")]
    session: Option<String>,
    /// Follow every session of this task instead.
    #[arg(long)]
    task: Option<String>,
    /// Start after this seq (task_seq with --task); 0 replays everything.
    #[arg(long, default_value_t = 0)]
    after_seq: i64,
    /// Exit after this many events (for scripts).
    #[arg(long)]
    count: Option<usize>,
}

#[derive(Debug, Subcommand)]
enum WorkspaceCmd {
    /// Run a command in the workspace; exits with its exit code.
    Exec {
        #[command(flatten)]
        session: SessionRef,
        /// Working directory relative to the worktree.
        #[arg(long, default_value = "")]
        cwd: String,
        #[arg(long, default_value_t = 60_000)]
        timeout_ms: u64,
        /// Output kept per stream, in bytes (at most 16 MiB); 0: 1 MiB.
        /// More is dropped, said on stderr, and the exit code is 3.
        #[arg(long, default_value_t = 0)]
        max_output_bytes: u64,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Print a file of the workspace.
    Cat {
        #[command(flatten)]
        session: SessionRef,
        path: String,
    },
    /// List a directory of the workspace.
    Ls {
        #[command(flatten)]
        session: SessionRef,
        #[arg(default_value = "")]
        path: String,
    },
    /// `git status` of the workspace.
    GitStatus(SessionRef),
    /// `git diff` of the workspace.
    GitDiff {
        #[command(flatten)]
        session: SessionRef,
        #[arg(long)]
        staged: bool,
        /// Everything the session changed since its base (committed or
        /// not), for a worktree sessiond created.
        #[arg(long, conflicts_with = "staged")]
        base: bool,
    },
    /// The commits of the session's branch since its base, newest first.
    Commits(SessionRef),
}

#[derive(Debug, Clone)]
struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

type Sessions = SessionServiceClient<InterceptedService<Channel, Bearer>>;
type Workspaces = WorkspaceServiceClient<InterceptedService<Channel, Bearer>>;

struct Clients {
    sessions: Sessions,
    workspaces: Workspaces,
    addr: String,
    bearer: Bearer,
}

impl Clients {
    async fn connect(addr: &str, token: Option<&str>) -> anyhow::Result<Self> {
        let addr = if addr.contains("://") {
            addr.to_owned()
        } else {
            format!("http://{addr}")
        };
        let bearer = Bearer(
            token
                .filter(|t| !t.is_empty())
                .map(|t| format!("Bearer {t}").parse())
                .transpose()
                .context("SESSIOND_TOKEN is not a valid header value")?,
        );
        let channel = channel(&addr).await?;
        Ok(Self {
            sessions: SessionServiceClient::with_interceptor(channel.clone(), bearer.clone())
                .max_decoding_message_size(64 * 1024 * 1024),
            workspaces: WorkspaceServiceClient::with_interceptor(channel, bearer.clone())
                .max_decoding_message_size(64 * 1024 * 1024),
            addr,
            bearer,
        })
    }

    /// A fresh connection (after the server went away).
    async fn reconnect(&mut self) -> anyhow::Result<()> {
        let channel = channel(&self.addr).await?;
        self.sessions =
            SessionServiceClient::with_interceptor(channel.clone(), self.bearer.clone());
        self.workspaces = WorkspaceServiceClient::with_interceptor(channel, self.bearer.clone());
        Ok(())
    }
}

/// `--ca-file`, read once: what an `https://` address is verified against.
static TRUSTED_CA: std::sync::OnceLock<Option<tonic::transport::Certificate>> =
    std::sync::OnceLock::new();

async fn channel(addr: &str) -> anyhow::Result<Channel> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .with_context(|| format!("--addr {addr:?} is not a URL"))?
        .connect_timeout(Duration::from_secs(5));
    if addr.starts_with("https://") {
        let Some(ca) = TRUSTED_CA.get().cloned().flatten() else {
            bail!(
                "--addr {addr} is https: pass the certificate authority to trust with --ca-file \
                 PEM (or SESSIOND_CA_FILE; for a self-signed server certificate, that certificate)"
            );
        };
        endpoint = endpoint
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(ca)
                    .assume_http2(true),
            )
            .context("TLS configuration")?;
    }
    endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to sessiond at {addr}"))
}

/// A plain-HTTP call answered with garbage: most likely a TLS port.
fn tls_hint(addr: &str, error: &str) -> Option<&'static str> {
    // A TLS listener closes a plain-HTTP connection: the client sees
    // garbage (an h2 protocol error) or its next write fail.
    let garbled = ["h2 protocol error", "broken pipe", "connection reset"]
        .iter()
        .any(|says| error.contains(says));
    // A broken pipe or a reset is also what a sessiond that stopped
    // mid-call leaves: then nothing listens any more, and no TLS hint is
    // given (helper-40 5).
    (!addr.starts_with("https://") && garbled && still_listening(addr)).then_some(
        "hint: if this sessiond serves TLS (--tls-cert), use an https:// address with --ca-file",
    )
}

/// A server certificate that is itself a CA (`openssl req -x509` makes
/// one unless told otherwise): TLS refuses it as the server's own
/// (helper-59 6).
fn ca_as_server_hint(error: &str) -> Option<&'static str> {
    error.contains("CaUsedAsEndEntity").then_some(
        "hint: the server's certificate is a CA certificate (basicConstraints CA:TRUE, what \
         `openssl req -x509` makes by default); make it with \
         `-addext basicConstraints=critical,CA:FALSE` (see the README) and pass that certificate \
         with --ca-file",
    )
}

/// Whether something accepts a TCP connection at `addr` (`host:port`, or
/// with an `http://` scheme) within half a second.
fn still_listening(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    let hostport = addr
        .strip_prefix("http://")
        .unwrap_or(addr)
        .split('/')
        .next()
        .unwrap_or_default();
    hostport.to_socket_addrs().is_ok_and(|mut all| {
        all.any(|a| {
            std::net::TcpStream::connect_timeout(&a, std::time::Duration::from_millis(500)).is_ok()
        })
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let no_token = cli.token.as_deref().is_none_or(str::is_empty);
    let addr = cli.addr.clone();
    // A keyed send is the one call that is safe to repeat as it is.
    let keyed_send = matches!(&cli.command, Command::Send(a) if a.request_id.is_some());
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            match e.downcast_ref::<tonic::Status>() {
                Some(status) if lost_mid_call(status) => {
                    let repeat = if keyed_send {
                        "run the same `send` again (same --request-id): it answers with the \
                         message if it was sent, and sends it otherwise"
                    } else {
                        "check (e.g. `sessionctl session status`) before repeating it"
                    };
                    eprintln!(
                        "error: the connection to sessiond at {addr} was lost during the call \
                         ({}); sessiond may have stopped or restarted, so whether the call took \
                         effect is unknown: {repeat}",
                        source_chain(status)
                    );
                    if let Some(hint) = tls_hint(&addr, &source_chain(status)) {
                        eprintln!("{hint}");
                    }
                }
                Some(status) => {
                    eprintln!("error: {} ({:?})", status.message(), status.code());
                    // Only for this client's own transport failures: a
                    // status sessiond sent (it has headers) proves the
                    // connection works, whatever its message quotes
                    // (helper-39 7: agentctl's "broken pipe").
                    if status.metadata().is_empty()
                        && let Some(hint) = tls_hint(&addr, status.message())
                    {
                        eprintln!("{hint}");
                    }
                    if status.code() == tonic::Code::Unauthenticated && no_token {
                        eprintln!(
                            "hint: this sessiond wants an API token: pass --token or set \
                             SESSIOND_TOKEN (one of the server's SESSIOND_API_TOKENS)"
                        );
                    }
                }
                None => {
                    let text = error_text(&e);
                    eprintln!("error: {text}");
                    if let Some(hint) = tls_hint(&addr, &text).or_else(|| ca_as_server_hint(&text))
                    {
                        eprintln!("{hint}");
                    }
                }
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let ca = match &cli.ca_file {
        Some(path) => Some(tonic::transport::Certificate::from_pem(
            std::fs::read(path).with_context(|| format!("--ca-file {}", path.display()))?,
        )),
        None => None,
    };
    let _ = TRUSTED_CA.set(ca);
    let out = Out {
        json: cli.json,
        quiet: cli.quiet,
    };
    if let Command::Health { wait, timeout_secs } = cli.command {
        return health(&cli.addr, wait, Duration::from_secs(timeout_secs), &out).await;
    }
    let mut c = Clients::connect(&cli.addr, cli.token.as_deref()).await?;
    match cli.command {
        Command::Health { .. } => unreachable!("handled above"),
        Command::Task(cmd) => task(&mut c, &out, cmd).await?,
        Command::Session(cmd) => session(&mut c, &out, cmd).await?,
        Command::Send(args) => send(&mut c, &out, args).await?,
        Command::Retry(args) => retry(&mut c, &out, args).await?,
        Command::Cancel(s) => {
            let r = c
                .sessions
                .cancel_turn(pb::CancelTurnRequest {
                    task_id: s.task.task,
                    session_id: s.session_id.clone(),
                })
                .await?
                .into_inner();
            out.cancelled(&s.session_id, r.cancelled);
        }
        Command::Unqueue {
            session,
            message_id,
        } => {
            let r = c
                .sessions
                .cancel_queued_message(pb::CancelQueuedMessageRequest {
                    task_id: session.task.task,
                    session_id: session.session_id.clone(),
                    message_id,
                })
                .await?
                .into_inner();
            if let Some(q) = r.cancelled {
                out.unqueued(&q);
            }
        }
        Command::Permission {
            session,
            request_id,
            option_id,
            values,
        } => {
            let r = c
                .sessions
                .respond_to_permission(pb::RespondToPermissionRequest {
                    task_id: session.task.task,
                    session_id: session.session_id.clone(),
                    request_id,
                    option_id: option_id.clone(),
                    content_json: values.unwrap_or_default(),
                })
                .await?
                .into_inner();
            out.permission_answered(&r.request.unwrap_or_default(), &option_id);
        }
        Command::Title { session, title } => {
            let r = c
                .sessions
                .set_session_title(pb::SetSessionTitleRequest {
                    task_id: session.task.task,
                    session_id: session.session_id.clone(),
                    title,
                })
                .await?
                .into_inner();
            out.titled(r.session.as_ref());
        }
        Command::Mode { session, mode_id } => {
            let r = c
                .sessions
                .set_session_mode(pb::SetSessionModeRequest {
                    task_id: session.task.task,
                    session_id: session.session_id.clone(),
                    mode_id,
                })
                .await?
                .into_inner();
            out.modes(&session.session_id, &r.modes.unwrap_or_default());
        }
        Command::Config {
            session,
            config_id,
            value,
        } => {
            let r = c
                .sessions
                .set_session_config_option(pb::SetSessionConfigOptionRequest {
                    task_id: session.task.task,
                    session_id: session.session_id.clone(),
                    config_id,
                    value,
                })
                .await?
                .into_inner();
            out.config_options(&session.session_id, &r.config_options);
        }
        Command::Messages(args) => messages(&mut c, &out, args).await?,
        Command::Watch(args) => watch(&mut c, &out, args).await?,
        Command::Workspace(cmd) => return workspace(&mut c, &out, cmd).await,
        Command::Profiles => {
            let r = c
                .sessions
                .list_agent_profiles(pb::ListAgentProfilesRequest {})
                .await?
                .into_inner();
            out.profiles(&r.profiles);
        }
        Command::Replicas => {
            let r = c
                .sessions
                .list_replicas(pb::ListReplicasRequest {})
                .await?
                .into_inner();
            out.replicas(&r);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Health needs no token; with `wait`, connection failures are retried.
async fn health(addr: &str, wait: bool, timeout: Duration, out: &Out) -> anyhow::Result<ExitCode> {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let addr = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let status = match channel(&addr).await {
            Ok(ch) => HealthClient::new(ch)
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map(|r| r.into_inner().status)
                .map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        match status {
            Ok(s) if s == ServingStatus::Serving as i32 || !wait => {
                let name = ServingStatus::try_from(s)
                    .map_or("UNKNOWN", |s| s.as_str_name())
                    .to_owned();
                if out.json {
                    println!("{}", serde_json::json!({ "status": name }));
                } else {
                    println!("{name}");
                }
                return Ok(if s == ServingStatus::Serving as i32 {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                });
            }
            Err(e) if !wait => return Err(e),
            _ if tokio::time::Instant::now() >= deadline => {
                bail!("sessiond at {addr} was not SERVING within {timeout:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn task(c: &mut Clients, out: &Out, cmd: TaskCmd) -> anyhow::Result<()> {
    match cmd {
        TaskCmd::Create { title } => {
            let r = c
                .sessions
                .create_task(pb::CreateTaskRequest { title })
                .await?
                .into_inner();
            out.created_task(r.task.as_ref());
        }
        TaskCmd::Get { task_id } => {
            let r = c
                .sessions
                .get_task(pb::GetTaskRequest { task_id })
                .await?
                .into_inner();
            out.tasks(r.task.as_slice());
        }
        TaskCmd::List => {
            let mut all = Vec::new();
            let mut page_token = String::new();
            loop {
                let r = c
                    .sessions
                    .list_tasks(pb::ListTasksRequest {
                        page_size: 1000,
                        page_token,
                    })
                    .await?
                    .into_inner();
                all.extend(r.tasks);
                if r.next_page_token.is_empty() {
                    break;
                }
                page_token = r.next_page_token;
            }
            out.tasks(&all);
        }
    }
    Ok(())
}

/// The enum value and name of `--runtime`: a built-in runtime by its enum
/// (or short alias), any other name as a custom runtime's (the server
/// checks that it is valid and registered).
fn parse_runtime(value: &str) -> (pb::Runtime, String) {
    match value {
        "local_standalone" | "standalone" => (pb::Runtime::LocalStandalone, String::new()),
        "local_docker" | "docker" => (pb::Runtime::LocalDocker, String::new()),
        "remote" => (pb::Runtime::Remote, String::new()),
        other => (pb::Runtime::Custom, other.to_owned()),
    }
}

/// `--repo DIR` and `--base`: the repository's top directory (the main one
/// when DIR is in a linked worktree) and, without `--base`, the branch
/// checked out in DIR, read here with git (the local runtimes run
/// on this host). For a remote host both are passed as given.
fn local_repository(
    repo: &str,
    base: Option<String>,
    remote: bool,
) -> anyhow::Result<(String, String)> {
    if remote {
        let base = base.context("--base is required with --repo for a remote session")?;
        return Ok((repo.to_owned(), base));
    }
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(args)
            .output()
            .context("running git (is it installed?)")?;
        if !out.status.success() {
            bail!(
                "--repo {repo:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])?;
    let common_path = std::path::Path::new(&common);
    let top = match (common_path.file_name(), common_path.parent()) {
        // The repository whose `.git` this is: from inside a linked
        // worktree (another session's, say), its main repository, which
        // outlives the worktree; from inside `.git` itself, the repository
        // (helper-41 7).
        (Some(name), Some(main)) if name == ".git" => main.display().to_string(),
        // A bare repository has no work tree: it is its own top (helper-38 8).
        _ if git(&["rev-parse", "--is-bare-repository"])? == "true" => common,
        _ => git(&["rev-parse", "--show-toplevel"])?,
    };
    let base = match base {
        Some(b) => b,
        None => git(&["symbolic-ref", "--quiet", "--short", "HEAD"]).map_err(|_| {
            anyhow::anyhow!("--repo {repo:?} has no current branch (detached HEAD); pass --base")
        })?,
    };
    Ok((top, base))
}

/// The absolute path of directory `dir` on this host, without `.` or `..`
/// (which the server refuses): `../x` is the `x` beside the working
/// directory, as `ls ../x` finds it; a symlink named on the way stays one,
/// for the server to check where it leads.
fn directory_named(dir: &str) -> anyhow::Result<String> {
    use std::path::{Component, PathBuf};
    let absolute = std::path::absolute(dir).with_context(|| format!("--worktree {dir:?}"))?;
    let mut normal = PathBuf::new();
    for part in absolute.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    Ok(normal.display().to_string())
}

async fn session(c: &mut Clients, out: &Out, cmd: SessionCmd) -> anyhow::Result<()> {
    match cmd {
        SessionCmd::Create {
            task,
            agent,
            runtime,
            worktree,
            repo,
            base,
            branch,
            remote_url,
            remote_secret,
            remote_executor_id,
            mcp,
        } => {
            let mcp_servers = mcp
                .iter()
                .map(|m| {
                    let (name, server) = m
                        .split_once('=')
                        .with_context(|| format!("--mcp {m:?}: NAME=COMMAND ARG... or NAME=URL"))?;
                    Ok(
                        if server.starts_with("http://") || server.starts_with("https://") {
                            pb::McpServerSpec {
                                name: name.to_owned(),
                                r#type: "http".into(),
                                url: server.to_owned(),
                                ..Default::default()
                            }
                        } else {
                            let mut words = server.split_whitespace().map(str::to_owned);
                            pb::McpServerSpec {
                                name: name.to_owned(),
                                r#type: "stdio".into(),
                                command: words.next().unwrap_or_default(),
                                args: words.collect(),
                                ..Default::default()
                            }
                        },
                    )
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let (runtime, runtime_name) = runtime
                .as_deref()
                .map_or((pb::Runtime::Unspecified, String::new()), parse_runtime);
            // The server resolves paths on the executor's host; make the
            // default `.` mean this shell's directory.
            let (repository, base) = match repo {
                Some(repo) => local_repository(&repo, base, remote_url.is_some())?,
                None => (String::new(), String::new()),
            };
            let path = if !repository.is_empty() {
                String::new()
            } else if remote_url.is_none() {
                directory_named(&worktree)?
            } else {
                worktree
            };
            let r = c
                .sessions
                .create_session(pb::CreateSessionRequest {
                    task_id: task.task,
                    agent_profile: agent.unwrap_or_default(),
                    runtime: runtime as i32,
                    runtime_name,
                    worktree: Some(pb::Worktree {
                        id: String::new(),
                        path,
                        branch,
                        repository,
                        base,
                    }),
                    remote_url: remote_url.unwrap_or_default(),
                    remote_secret: remote_secret.unwrap_or_default(),
                    remote_executor_id: remote_executor_id.unwrap_or_default(),
                    mcp_servers,
                })
                .await?
                .into_inner();
            out.created_session(r.session.as_ref());
            // Created but not usable: a script must not go on as if it were.
            if let Some(s) = r.session.as_ref()
                && s.state == pb::SessionState::Error as i32
            {
                bail!(
                    "session {} was created but is ERROR: {}",
                    s.id,
                    s.error_message
                );
            }
        }
        SessionCmd::List { task } => {
            let r = c
                .sessions
                .list_sessions(pb::ListSessionsRequest { task_id: task.task })
                .await?
                .into_inner();
            out.sessions(&r.sessions);
        }
        SessionCmd::Get(s) => {
            let r = c
                .sessions
                .get_session(pb::GetSessionRequest {
                    task_id: s.task.task,
                    session_id: s.session_id,
                })
                .await?
                .into_inner();
            out.session(r.session.as_ref());
        }
        SessionCmd::Status(s) => {
            let r = c
                .sessions
                .get_session_status(pb::GetSessionStatusRequest {
                    task_id: s.task.task,
                    session_id: s.session_id,
                })
                .await?
                .into_inner();
            out.status(&r);
        }
        SessionCmd::Resume(s) => {
            let r = c
                .sessions
                .resume_session(pb::ResumeSessionRequest {
                    task_id: s.task.task,
                    session_id: s.session_id,
                })
                .await?
                .into_inner();
            out.session(r.session.as_ref());
        }
        SessionCmd::Stop { session, completed } => {
            let r = c
                .sessions
                .stop_session(pb::StopSessionRequest {
                    task_id: session.task.task,
                    session_id: session.session_id,
                    outcome: if completed {
                        pb::StopOutcome::Completed
                    } else {
                        pb::StopOutcome::Cancelled
                    } as i32,
                })
                .await?
                .into_inner();
            out.session(r.session.as_ref());
        }
        SessionCmd::Delete {
            session: s,
            discard,
            keep_worktree,
            delete_branch,
        } => {
            c.sessions
                .delete_session(pb::DeleteSessionRequest {
                    task_id: s.task.task,
                    session_id: s.session_id.clone(),
                    discard_worktree: discard,
                    keep_worktree,
                    delete_branch,
                })
                .await?;
            out.deleted(&s.session_id);
        }
    }
    Ok(())
}

/// Sends the prompt, then follows the session's events and prints the
/// agent's reply as it streams, until the turn ends.
async fn send(c: &mut Clients, out: &Out, mut args: SendArgs) -> anyhow::Result<()> {
    // `--timeout-secs` bounds the whole command, the call's own wait for
    // an agent being brought back included.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_secs);
    if args.text == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("reading the prompt from standard input")?;
        args.text = text;
    }
    let task_id = args.session.task.task;
    let session_id = args.session.session_id;
    let mut attachments = Vec::new();
    for path in &args.images {
        let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        attachments.push(pb::Attachment {
            kind: Some(pb::attachment::Kind::Image(pb::ImageAttachment {
                data,
                ..Default::default()
            })),
        });
    }
    for path in args.files {
        attachments.push(pb::Attachment {
            kind: Some(pb::attachment::Kind::File(pb::FileAttachment { path })),
        });
    }
    for uri in args.links {
        attachments.push(pb::Attachment {
            kind: Some(pb::attachment::Kind::Link(pb::LinkAttachment {
                uri,
                ..Default::default()
            })),
        });
    }
    let request_id = args.request_id.unwrap_or_default();
    let sent = c
        .sessions
        .send_message(until(
            deadline,
            pb::SendMessageRequest {
                task_id: task_id.clone(),
                session_id: session_id.clone(),
                content: args.text,
                no_queue: args.no_queue,
                attachments,
                request_id: request_id.clone(),
            },
        ))
        .await
        .map_err(|status| {
            unanswered(status, deadline, args.timeout_secs, || {
                match request_id.is_empty() {
                    true => "the message is sent if sessiond received it (`sessionctl messages` \
                         shows it); to send it at most once, give it a --request-id"
                        .to_owned(),
                    false => format!(
                        "the message is sent if sessiond received it; the same command with \
                     --request-id {request_id} sends it at most once"
                    ),
                }
            })
        })?
        .into_inner();
    if let Some(q) = &sent.queued {
        out.queued(q);
    }
    let turn = Turn {
        task_id,
        session_id,
        sent: sent.message,
        queued: sent.queued,
        no_wait: args.no_wait,
        timeout_secs: args.timeout_secs,
        deadline,
        answer: args.answer,
    };
    follow_turn(c, out, turn).await
}

/// `message` as a call that gives up at `deadline` (sessiond stops
/// waiting for it too).
fn until<T>(deadline: tokio::time::Instant, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()));
    request
}

/// A send or retry whose call itself ran out of `--timeout-secs` (its
/// agent being brought back, say) says so, and what became of it
/// (`what_now`); any other failure is returned as it is.
fn unanswered(
    status: tonic::Status,
    deadline: tokio::time::Instant,
    timeout_secs: u64,
    what_now: impl FnOnce() -> String,
) -> anyhow::Error {
    // The server's answer to the call's deadline, or this client's own
    // timer (tonic's "Timeout expired", CANCELLED), whichever came first.
    let timed_out = match status.code() {
        tonic::Code::DeadlineExceeded => true,
        tonic::Code::Cancelled => tokio::time::Instant::now() >= deadline,
        _ => false,
    };
    match timed_out {
        true => anyhow::anyhow!(
            "timed out after {timeout_secs} s before sessiond answered (it waits while the \
             session's agent is brought back); {}",
            what_now()
        ),
        false => status.into(),
    }
}

/// A queued message `id` left the queue: Ok when it was delivered (its
/// user message is stored after `after_seq`), else the error saying it
/// will not be sent, with the session's note on why when there is one.
async fn not_sent_unless_delivered(
    c: &mut Clients,
    task_id: &str,
    session_id: &str,
    id: &str,
    mut after_seq: i64,
) -> anyhow::Result<()> {
    let mut why = None;
    loop {
        let page = c
            .sessions
            .list_messages(pb::ListMessagesRequest {
                task_id: task_id.to_owned(),
                session_id: session_id.to_owned(),
                after_seq,
                page_size: 1000,
            })
            .await?
            .into_inner();
        for m in &page.messages {
            if m.id == id {
                return Ok(());
            }
            if m.role == pb::MessageRole::System as i32 && m.content.contains("not sent") {
                // "N queued message(s) were not sent: <why>": the why alone.
                let said = m
                    .content
                    .split_once("were not sent: ")
                    .map_or(m.content.as_str(), |(_, why)| why);
                why = Some(output::text(said));
            }
        }
        if page.next_after_seq == 0 {
            break;
        }
        after_seq = page.next_after_seq;
    }
    match why {
        Some(why) => bail!("your queued message {id} was not sent: {why}"),
        None => bail!("your queued message {id} was not sent: it was taken off the queue"),
    }
}

/// Retries the interrupted turn, then prints its reply as `send` does.
async fn retry(c: &mut Clients, out: &Out, args: RetryArgs) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_secs);
    let session_id = args.session.session_id;
    let task_id = args.session.task.task;
    let sent = c
        .sessions
        .retry_turn(until(
            deadline,
            pb::RetryTurnRequest {
                task_id: task_id.clone(),
                session_id: session_id.clone(),
                message_id: args.message_id.unwrap_or_default(),
            },
        ))
        .await
        .map_err(|status| {
            unanswered(status, deadline, args.timeout_secs, || {
                "the retry goes on if sessiond received it (`sessionctl messages` shows its \
                 turn once it starts); run it again with --message-id to retry at most once"
                    .to_owned()
            })
        })?
        .into_inner();
    if !out.json {
        eprintln!("retrying message {}", sent.retried_message_id);
    }
    let turn = Turn {
        task_id,
        session_id,
        sent: sent.message,
        queued: None,
        no_wait: args.no_wait,
        timeout_secs: args.timeout_secs,
        deadline,
        answer: args.answer,
    };
    follow_turn(c, out, turn).await
}

/// A turn `follow_turn` waits for.
struct Turn {
    task_id: String,
    session_id: String,
    /// The user message that started it.
    sent: Option<pb::Message>,
    /// Or the queued message that starts it once delivered (same id).
    queued: Option<pb::QueuedMessage>,
    no_wait: bool,
    timeout_secs: u64,
    /// When `timeout_secs` from the command's start runs out.
    deadline: tokio::time::Instant,
    answer: AnswerArgs,
}

/// The option to answer `req` with: by flag, else asked on the terminal;
/// with neither an error that says how to answer, so nothing hangs.
async fn choose_option(answer: &AnswerArgs, req: &pb::PermissionRequest) -> anyhow::Result<String> {
    use std::io::IsTerminal;
    let of_kinds = |kinds: &[&str]| {
        kinds.iter().find_map(|k| {
            req.options
                .iter()
                .find(|o| o.kind == *k)
                .map(|o| o.option_id.clone())
        })
    };
    let offered = req
        .options
        .iter()
        .map(|o| format!("{} ({})", o.option_id, o.kind))
        .collect::<Vec<_>>()
        .join(", ");
    let title = req
        .tool_call
        .as_ref()
        .map(|t| t.title.clone())
        .unwrap_or_default();
    if answer.approve {
        return of_kinds(&["allow_once", "allow_always"]).with_context(|| {
            format!(
                "--approve: permission request {} ({title}) offers no allow option: {offered}",
                req.request_id
            )
        });
    }
    if answer.deny {
        return of_kinds(&["reject_once", "reject_always"]).with_context(|| {
            format!(
                "--deny: permission request {} ({title}) offers no reject option: {offered}",
                req.request_id
            )
        });
    }
    if !std::io::stdin().is_terminal() {
        bail!(
            "the agent asks permission ({title}; request {}; options: {offered}) and stdin is not a terminal to ask on; \
             pass --approve or --deny, or answer with `sessionctl permission --task TASK SESSION {} OPTION` \
             (an option id, or allow / allow-always / reject) \
             (the request waits until the profile's permission timeout, then it is rejected)",
            req.request_id,
            req.request_id
        );
    }
    let options = req.options.clone();
    let prompt = {
        let mut p = format!("the agent asks permission: {title}\n");
        for (i, o) in options.iter().enumerate() {
            p.push_str(&format!("  {}) {} [{}]\n", i + 1, o.name, o.kind));
        }
        p.push_str("answer (number or option id): ");
        p
    };
    tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        loop {
            eprint!("{prompt}");
            let _ = std::io::stderr().flush();
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line)? == 0 {
                bail!("stdin closed before the permission request was answered");
            }
            let line = line.trim();
            let chosen = line
                .parse::<usize>()
                .ok()
                .and_then(|n| options.get(n.checked_sub(1)?))
                .or_else(|| options.iter().find(|o| o.option_id == line));
            match chosen {
                Some(o) => return Ok(o.option_id.clone()),
                None => eprintln!("{line:?} is not one of the options"),
            }
        }
    })
    .await?
}

/// Follows the session's events after user message `sent` and prints the
/// agent's reply as it streams, until the turn's `turn_ended`. A turn that
/// ends otherwise than `end_turn` (failed, interrupted, cancelled, ...) is
/// an error naming why, at once (a non-zero exit).
async fn follow_turn(c: &mut Clients, out: &Out, turn: Turn) -> anyhow::Result<()> {
    let Turn {
        task_id,
        session_id,
        sent,
        queued,
        no_wait,
        timeout_secs,
        deadline,
        answer,
    } = turn;
    if no_wait {
        if let Some(m) = &sent {
            out.messages(std::slice::from_ref(m));
        }
        return Ok(());
    }
    // A queued message's turn: nothing before its delivery is ours.
    let mut user_seq = sent.as_ref().map_or(i64::MAX, |m| m.seq);
    let user_id = sent
        .as_ref()
        .map(|m| m.id.clone())
        .or_else(|| queued.as_ref().map(|q| q.id.clone()))
        .unwrap_or_default();
    // Replays the session's events, then tails: everything after our own
    // message.added belongs to this turn. A lost stream (sessiond
    // restarting) is opened again after the last event seen.
    let mut cursor = 0i64;
    let mut attempt = 0u32;
    let mut events = watch_after(c, &session_id, cursor, &mut attempt).await?;
    // The reply may be several agent messages (text around tool calls):
    // each is printed as it grows.
    let mut printing: Option<(String, usize)> = None;
    // The reply's last line was ended (before the usage line).
    let mut line_ended = false;
    // Activity lines shown, by message id (printed again when they change).
    let mut shown: std::collections::HashMap<String, String> = Default::default();
    let mut reply: Option<pb::Message> = None;
    let mut note: Option<String> = None;
    let mut in_turn = false;
    // A queued message: seen in the queue (its enqueue replayed), and the
    // seq of the last message seen, from which its delivery is looked up.
    let mut in_queue = false;
    let mut last_message_seq = 0i64;
    let end = loop {
        let next = tokio::time::timeout_at(deadline, events.next())
            .await
            .with_context(|| match in_queue && !in_turn {
                true => format!(
                    "timed out after {timeout_secs} s with your message {user_id} still queued; \
                     it stays queued (`sessionctl unqueue {session_id} {user_id}` withdraws it, \
                     `sessionctl session status` shows the queue)"
                ),
                false => format!(
                    "timed out after {timeout_secs} s waiting for the end of the agent's turn; \
                     it goes on (`sessionctl cancel` cancels it, `sessionctl messages` shows it)"
                ),
            })?;
        let event = match next {
            Some(Ok(event)) => {
                attempt = 0;
                cursor = event.seq;
                event
            }
            Some(Err(status)) if retryable(&status) => {
                reconnect_after(c, &mut attempt, &status).await;
                events = rewatch(c, &session_id, cursor, &mut attempt, deadline).await?;
                continue;
            }
            Some(Err(status)) => return Err(status.into()),
            None => {
                let ended = tonic::Status::unavailable("the event stream ended");
                reconnect_after(c, &mut attempt, &ended).await;
                events = rewatch(c, &session_id, cursor, &mut attempt, deadline).await?;
                continue;
            }
        };
        if let Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) })) =
            &event.payload
        {
            last_message_seq = last_message_seq.max(m.seq);
        }
        match event.payload {
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                if m.id == user_id =>
            {
                in_turn = true;
                user_seq = m.seq;
            }
            Some(pb::event::Payload::QueueChanged(q)) if queued.is_some() && !in_turn => {
                let queued_now = q.queued.iter().any(|m| m.id == user_id);
                if in_queue && !queued_now {
                    // Delivered (its message is added in the same commit)
                    // or gone unsent: the stored messages tell which.
                    not_sent_unless_delivered(c, &task_id, &session_id, &user_id, last_message_seq)
                        .await?;
                }
                in_queue = queued_now;
            }
            // sessiond could not bring the agent back: the message waits
            // for a resume, not for this command. (ERROR on the way to a
            // restart sessiond does by itself passes: status says so.)
            Some(pb::event::Payload::StateChanged(sc))
                if in_queue && !in_turn && sc.to == pb::SessionState::Error as i32 =>
            {
                let st = c
                    .sessions
                    .get_session_status(pb::GetSessionStatusRequest {
                        task_id: task_id.clone(),
                        session_id: session_id.clone(),
                    })
                    .await?
                    .into_inner();
                if st.state == pb::SessionState::Error as i32
                    && st.agent_recovery.is_none()
                    && !st.recovering
                {
                    bail!(
                        "the session went ERROR before your queued message {user_id} was sent ({}): \
                         it stays queued and is sent once the session is resumed \
                         (`sessionctl session resume {session_id}`); `sessionctl unqueue` withdraws it",
                        output::text(&sc.error_message)
                    );
                }
            }
            Some(pb::event::Payload::TurnEnded(t))
                if in_queue && !in_turn && t.stop_reason == "interrupted" =>
            {
                bail!(
                    "the turn before your queued message {user_id} ended interrupted, so the queue \
                     waits for you: the message is sent once that turn is retried (`sessionctl retry`) \
                     or a new message is sent; `sessionctl unqueue` withdraws it"
                );
            }
            // The turn's usage, stored on the user message as the turn ends.
            Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
                if m.id == user_id =>
            {
                if let Some(u) = m.usage.as_ref().filter(|_| !out.json) {
                    // The reply's line ends first: with stdout and stderr in
                    // one file, the usage ran on after the reply's text.
                    if printing.is_some() && !line_ended {
                        println!();
                        line_ended = true;
                    }
                    eprintln!("{}", output::turn_usage_line(u));
                }
            }
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            | Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
                if m.role == pb::MessageRole::Agent as i32
                    && m.seq > user_seq
                    && !output::is_text(&m) =>
            {
                // The agent's activity, one line on stderr each time a
                // part changes what it shows (the reply keeps stdout).
                // Thoughts show once, whole.
                // A permission request shows when asked; its outcome
                // shows with its reason from `permission.resolved`.
                let shows = match pb::MessageKind::try_from(m.kind) {
                    Ok(pb::MessageKind::Thought) => m.complete,
                    Ok(pb::MessageKind::Permission) => !m.complete,
                    // Once, with its output and exit, not at every chunk.
                    Ok(pb::MessageKind::Terminal) => m.complete,
                    _ => true,
                };
                let line = output::activity_line(&m);
                if !out.json && shows && shown.get(&m.id) != Some(&line) {
                    eprintln!("{}", output::text(&line));
                    shown.insert(m.id.clone(), line);
                }
            }
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            | Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
                if m.role == pb::MessageRole::Agent as i32 && m.seq > user_seq =>
            {
                if !out.json {
                    let mut out_lock = std::io::stdout().lock();
                    let done = match &printing {
                        Some((id, n)) if *id == m.id => *n,
                        Some(_) => {
                            stdout::ended(out_lock.write_all(b"\n"));
                            0
                        }
                        None => 0,
                    };
                    if m.content.len() > done {
                        // The agent's text, never its terminal controls.
                        let new = String::from_utf8_lossy(&m.content.as_bytes()[done..]);
                        stdout::ended(out_lock.write_all(output::text(&new).as_bytes()));
                        stdout::ended(out_lock.flush());
                        line_ended = false;
                    }
                    printing = Some((m.id.clone(), m.content.len().max(done)));
                }
                reply = Some(m);
            }
            Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
                if in_turn && m.role == pb::MessageRole::System as i32 =>
            {
                note = Some(output::text(&m.content));
            }
            Some(pb::event::Payload::PermissionRequested(pb::PermissionRequested {
                request: Some(req),
            })) if in_turn && req.status == "pending" => {
                if let Some(q) = req.elicitation.as_ref().filter(|_| !answer.deny) {
                    // A question is answered by a person: said, and waited for.
                    eprintln!(
                        "[question] {} — answer with `sessionctl permission --task {task_id} \
                         {session_id} {} accept --values JSON` (form {}{}), or decline / cancel",
                        output::text(&q.message),
                        req.request_id,
                        output::printable(&q.requested_schema_json),
                        output::printable(&q.url)
                    );
                    continue;
                }
                let option_id = if req.elicitation.is_some() {
                    "decline".to_owned()
                } else {
                    choose_option(&answer, &req).await?
                };
                let answered = c
                    .sessions
                    .respond_to_permission(pb::RespondToPermissionRequest {
                        task_id: task_id.clone(),
                        session_id: session_id.clone(),
                        request_id: req.request_id.clone(),
                        option_id: option_id.clone(),
                        content_json: String::new(),
                    })
                    .await;
                match answered {
                    Ok(_) if !out.json => eprintln!("[permission] answered {option_id}"),
                    Ok(_) => {}
                    // Answered elsewhere, timed out or cancelled meanwhile:
                    // its resolution follows on the stream.
                    Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                        eprintln!("[permission] not answered: {}", s.message());
                    }
                    Err(s) => return Err(s.into()),
                }
            }
            Some(pb::event::Payload::PermissionResolved(r)) if in_turn && !out.json => {
                let how = match (r.outcome.as_str(), r.option_id.as_str()) {
                    (o, "") => o.to_owned(),
                    (o, opt) => format!("{o} {opt}"),
                };
                if r.reason.is_empty() {
                    eprintln!("[permission] {how}");
                } else {
                    eprintln!("[permission] {how} ({})", r.reason);
                }
            }
            Some(pb::event::Payload::TurnEnded(t)) if t.turn_id == user_id => break t,
            _ => {}
        }
    };
    if !out.json && printing.is_some() && !line_ended {
        println!();
    }
    if out.json {
        println!(
            "{}",
            serde_json::json!({
                "message": sent.as_ref().map(output::message_json),
                "reply": reply.as_ref().map(output::message_json),
                "stop_reason": end.stop_reason,
                "error_message": end.error_message,
            })
        );
    }
    match end.stop_reason.as_str() {
        "end_turn" => Ok(()),
        // The system message of a failed, interrupted or cancelled turn
        // says what happened and what can be done.
        reason => match note {
            Some(note) => bail!("the turn ended {reason}: {note}"),
            None if !end.error_message.is_empty() => {
                bail!("the turn ended {reason}: {}", end.error_message)
            }
            None => bail!("the turn ended {reason}"),
        },
    }
}

async fn messages(c: &mut Clients, out: &Out, args: MessagesArgs) -> anyhow::Result<()> {
    let mut after_seq = args.after_seq;
    let mut all = Vec::new();
    loop {
        let r = c
            .sessions
            .list_messages(pb::ListMessagesRequest {
                task_id: args.session.task.task.clone(),
                session_id: args.session.session_id.clone(),
                after_seq,
                page_size: 1000,
            })
            .await?
            .into_inner();
        all.extend(r.messages);
        if r.next_after_seq == 0 {
            break;
        }
        after_seq = r.next_after_seq;
    }
    out.messages(&all);
    Ok(())
}

async fn watch(c: &mut Clients, out: &Out, args: WatchArgs) -> anyhow::Result<()> {
    let mut cursor = args.after_seq;
    let mut seen = 0usize;
    let mut attempt = 0u32;
    loop {
        let opened = match (&args.session, &args.task) {
            (Some(session_id), _) => {
                c.sessions
                    .watch_session(pb::WatchSessionRequest {
                        session_id: session_id.clone(),
                        after_seq: cursor,
                    })
                    .await
            }
            (None, Some(task_id)) => {
                c.sessions
                    .watch_task(pb::WatchTaskRequest {
                        task_id: task_id.clone(),
                        after_task_seq: cursor,
                    })
                    .await
            }
            (None, None) => bail!("pass --session or --task"),
        };
        let mut stream = match opened {
            Ok(s) => {
                attempt = 0;
                s.into_inner()
            }
            Err(status) if retryable(&status) => {
                reconnect_after(c, &mut attempt, &status).await;
                continue;
            }
            Err(status) => return Err(status.into()),
        };
        loop {
            match stream.next().await {
                Some(Ok(event)) => {
                    cursor = if args.task.is_some() {
                        event.task_seq
                    } else {
                        event.seq
                    };
                    out.event(&event, args.task.is_some());
                    seen += 1;
                    if args.count.is_some_and(|n| seen >= n) {
                        return Ok(());
                    }
                }
                Some(Err(status)) if retryable(&status) => {
                    reconnect_after(c, &mut attempt, &status).await;
                    break;
                }
                Some(Err(status)) => return Err(status.into()),
                None => {
                    reconnect_after(c, &mut attempt, &tonic::Status::unavailable("stream ended"))
                        .await;
                    break;
                }
            }
        }
    }
}

/// [`watch_after`] until `deadline`: a turn followed through a restart of
/// sessiond, for as long as the caller waits for it.
async fn rewatch(
    c: &mut Clients,
    session_id: &str,
    cursor: i64,
    attempt: &mut u32,
    deadline: tokio::time::Instant,
) -> anyhow::Result<tonic::Streaming<pb::Event>> {
    tokio::time::timeout_at(deadline, watch_after(c, session_id, cursor, attempt))
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "timed out waiting for sessiond to answer again; the turn may go on \
                 (`sessionctl watch --session {session_id}` follows it)"
            )
        })?
}

/// The session's events after `cursor`, opened again (with backoff) while
/// sessiond cannot answer.
async fn watch_after(
    c: &mut Clients,
    session_id: &str,
    cursor: i64,
    attempt: &mut u32,
) -> anyhow::Result<tonic::Streaming<pb::Event>> {
    loop {
        let opened = c
            .sessions
            .watch_session(pb::WatchSessionRequest {
                session_id: session_id.to_owned(),
                after_seq: cursor,
            })
            .await;
        match opened {
            Ok(stream) => return Ok(stream.into_inner()),
            Err(status) if retryable(&status) => reconnect_after(c, attempt, &status).await,
            Err(status) => return Err(status.into()),
        }
    }
}

/// A call whose connection broke after it was sent (tonic reports the
/// transport's failure as the status, with the cause as its source): no
/// answer from sessiond, so the outcome is unknown.
fn lost_mid_call(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unknown | tonic::Code::Unavailable | tonic::Code::Cancelled
    ) && std::error::Error::source(status).is_some()
        && status.metadata().is_empty()
}

/// The status's message and its sources, `: `-separated.
fn source_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_owned();
    let mut cause = std::error::Error::source(status);
    while let Some(e) = cause {
        let t = e.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        cause = e.source();
    }
    text
}

fn retryable(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    )
}

/// Waits (250 ms doubling to 5 s) and reconnects; the caller resumes from
/// its cursor. Said at the first attempt and then about every 30 s, with
/// the last error: a server down for minutes made two lines per attempt.
async fn reconnect_after(c: &mut Clients, attempt: &mut u32, why: &tonic::Status) {
    let delay = Duration::from_millis(250) * 2u32.pow((*attempt).min(5));
    let delay = delay.min(Duration::from_secs(5));
    let n = *attempt;
    *attempt += 1;
    let report = reconnect_reported(n);
    if n == 0 {
        eprintln!("sessionctl: disconnected ({}); reconnecting", why.message());
    } else if report {
        eprintln!(
            "sessionctl: still reconnecting after {n} attempts ({}); every {delay:?}",
            why.message()
        );
    }
    tokio::time::sleep(delay).await;
    if let Err(e) = c.reconnect().await
        && report
    {
        eprintln!("sessionctl: {}", error_text(&e));
    }
}

/// Whether reconnect attempt `n` (0-based) is said: the first, then one in
/// six at the 5 s cap (about every 30 s).
fn reconnect_reported(n: u32) -> bool {
    const REPORT_EVERY: u32 = 6;
    n == 0 || (n >= 5 && (n - 5) % REPORT_EVERY == REPORT_EVERY - 1)
}

/// An error and its causes, `: `-separated, each said once (a transport
/// error's text already holds its cause's).
fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

fn session_ref(s: SessionRef) -> pb::SessionRef {
    pb::SessionRef {
        task_id: s.task.task,
        session_id: s.session_id,
    }
}

async fn workspace(c: &mut Clients, out: &Out, cmd: WorkspaceCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        WorkspaceCmd::Exec {
            session,
            cwd,
            timeout_ms,
            max_output_bytes,
            mut argv,
        } => {
            let command = argv.remove(0);
            let answer = c
                .workspaces
                .exec(pb::ExecRequest {
                    session: Some(session_ref(session)),
                    command,
                    args: argv,
                    cwd,
                    timeout_ms,
                    max_output_bytes,
                })
                .await;
            let r = match answer {
                Ok(r) => r.into_inner(),
                // Past its timeout: the output so far rides in the details.
                Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
                    match <pb::ExecResponse as prost::Message>::decode(status.details()) {
                        Ok(r) if !status.details().is_empty() => {
                            out.exec(&r);
                            eprintln!("sessionctl: {}", status.message());
                            return Ok(ExitCode::from(124));
                        }
                        _ => return Err(status.into()),
                    }
                }
                Err(status) => return Err(status.into()),
            };
            out.exec(&r);
            // A command that succeeded but whose output was cut does not
            // look like a success to a script reading it.
            if r.exit_code == Some(0) && (r.stdout_truncated || r.stderr_truncated) {
                return Ok(ExitCode::from(3));
            }
            return Ok(match r.exit_code {
                Some(0) => ExitCode::SUCCESS,
                Some(n) => ExitCode::from(u8::try_from(n.clamp(1, 255)).unwrap_or(1)),
                // As a shell says it: 128 + the signal (137 for SIGKILL).
                None => match r.signal {
                    Some(signal) => {
                        ExitCode::from(u8::try_from(128 + signal.clamp(1, 127)).unwrap_or(255))
                    }
                    None => ExitCode::from(124),
                },
            });
        }
        WorkspaceCmd::Cat { session, path } => {
            let r = c
                .workspaces
                .read_file(pb::ReadFileRequest {
                    session: Some(session_ref(session)),
                    path: path.clone(),
                })
                .await?
                .into_inner();
            out.file(&path, &r.content);
        }
        WorkspaceCmd::Ls { session, path } => {
            let r = c
                .workspaces
                .list_dir(pb::ListDirRequest {
                    session: Some(session_ref(session)),
                    path,
                })
                .await?
                .into_inner();
            out.entries(&r.entries);
        }
        WorkspaceCmd::GitStatus(session) => {
            let r = c
                .workspaces
                .git_status(pb::GitStatusRequest {
                    session: Some(session_ref(session)),
                })
                .await?
                .into_inner();
            out.git_status(&r);
        }
        WorkspaceCmd::GitDiff {
            session,
            staged,
            base,
        } => {
            let r = c
                .workspaces
                .git_diff(pb::GitDiffRequest {
                    session: Some(session_ref(session)),
                    staged,
                    against_base: base,
                })
                .await?
                .into_inner();
            out.git_diff(&r.diff);
        }
        WorkspaceCmd::Commits(session) => {
            let r = c
                .workspaces
                .list_branch_commits(pb::ListBranchCommitsRequest {
                    session: Some(session_ref(session)),
                    limit: 0,
                })
                .await?
                .into_inner();
            out.commits(&r);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reconnects_are_said_at_first_then_about_every_30_seconds() {
        let said: Vec<u32> = (0..30).filter(|&n| super::reconnect_reported(n)).collect();
        // Waits 0.25, 0.5, 1, 2, 4 s, then 5 s each: 30 s between reports.
        assert_eq!(said, [0, 10, 16, 22, 28]);
    }
}
