//! The `agentctl` binary: configuration, listener, signals, idle exit.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentctl::agent::{AgentManager, PermissionPolicy};
use agentctl::auth::{Activity, Authenticator, Secret};
use agentctl::fence::EpochFence;
use agentctl::journal::Journal;
use agentctl::service::AgentCtl;
use agentctl::tree;
use agentctl::updates::UpdateLog;
use agentctl::workspace::{Workspace, WorkspaceSlot};
use anyhow::{Context, bail};
use clap::Parser;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::TcpIncoming;

/// The sidecar next to one agent: gRPC server, ACP client, workspace access.
///
/// The secret comes from --secret-file (removed after reading with
/// --remove-secret-file) or from the AGENTCTL_SECRET environment variable;
/// every call must carry `authorization: Bearer <secret>`.
#[derive(Debug, Parser)]
#[command(name = "agentctl", version)]
struct Cli {
    /// Identity reported by Health, so the backend can prove who it talks to.
    #[arg(long)]
    executor_id: String,
    /// Workspace root; every file, exec and git call is confined to it.
    /// Without it (`--worktree-root` only), the workspace is the worktree
    /// sessiond has this agentctl create or restore (a remote host's).
    #[arg(long, required_unless_present = "worktree_root")]
    workspace: Option<PathBuf>,
    /// A directory repositories and the worktrees made from them may lie
    /// in (repeatable): enables the `Worktree` call, confined to these.
    #[arg(long)]
    worktree_root: Vec<PathBuf>,
    /// Where to listen: `unix:<path>` for a Unix-domain socket (local
    /// executors: no network needed, socket mode 0600), or `host:port` for
    /// TCP (remote executors; port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0", value_parser = parse_listen)]
    listen: Listen,
    /// PEM certificate (chain) to serve TLS with on a TCP listener (remote
    /// executors: the secret and all workspace traffic cross the network).
    #[arg(long, env = "AGENTCTL_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "AGENTCTL_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM CA: clients must present a certificate it signed (mutual TLS).
    #[arg(long, env = "AGENTCTL_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// File to write the bound TCP port to (atomically, via rename).
    #[arg(long)]
    port_file: Option<PathBuf>,
    /// File holding the secret (instead of AGENTCTL_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Unlink --secret-file once it is read, so the agent (same user) cannot
    /// read it later.
    #[arg(long, requires = "secret_file")]
    remove_secret_file: bool,
    /// Exit after this long without an authenticated call (and no open update
    /// stream), e.g. `90s`, `15m`, `500ms`; `0` never exits.
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    idle_timeout: Duration,
    /// Updates kept for replay by StreamUpdates.
    #[arg(long, default_value_t = 4096)]
    update_buffer: usize,
    /// How the agent's permission requests are answered.
    #[arg(long, value_enum, default_value_t = PermissionPolicy::AllowOnce)]
    permission_policy: PermissionPolicy,
    /// The durable turn journal (created if missing), normally in the
    /// executor's run directory, shared by every agentctl process of one
    /// executor: what earlier processes did with each turn, and the agent
    /// process trees they started (ended at start, before anything else).
    /// Without it, a relaunched agentctl knows nothing of earlier turns.
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Where the newest sessiond lease epoch seen is kept (fsynced), so a
    /// relaunched agentctl still refuses a superseded replica. Default:
    /// the --journal path with `.epoch` appended; without either, memory only.
    #[arg(long)]
    epoch_file: Option<PathBuf>,
    /// Grace between TERM and KILL when agentctl itself is terminated.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    stop_grace: Duration,
    /// OpenTelemetry collector to export traces to over OTLP/gRPC
    /// (`http://127.0.0.1:4317`); none by default. sessiond passes its own.
    #[arg(long, env = "AGENTCTL_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Fraction of new traces exported, 0 to 1; a caller's sampled
    /// `traceparent` (sessiond's) is always followed.
    #[arg(long, env = "AGENTCTL_TRACE_SAMPLE_RATIO", default_value_t = 1.0,
          value_parser = parse_ratio)]
    trace_sample_ratio: f64,
    /// Log as JSON lines (with trace and span ids) instead of text.
    #[arg(long, env = "AGENTCTL_LOG_JSON", value_parser = clap::builder::BoolishValueParser::new(),
          num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    log_json: bool,
    /// End every agent process tree recorded in --journal (with everything
    /// its processes started, `setsid` included) and exit without serving:
    /// how a backend stops an executor whose agentctl is dead. Prints how
    /// many processes it ended.
    #[arg(long, requires = "journal")]
    reap: bool,
    /// A Unix datagram socket of the backend's: when the agent exits,
    /// agentctl sends it one datagram holding the executor id, so the
    /// backend looks at once instead of at its next liveness check (an idle
    /// session has no update stream open to report it).
    #[arg(long, env = "AGENTCTL_DOORBELL")]
    doorbell: Option<PathBuf>,
}

/// `--reap`: reads the journal without writing it (the next agentctl on it
/// finds the trees gone and forgets them) and ends each recorded tree.
fn reap(journal: &std::path::Path) -> anyhow::Result<()> {
    let text = match std::fs::read(journal) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", journal.display())),
    };
    let loaded = agentctl::journal::parse(&text, agentctl::agent::REMEMBERED_TURNS);
    let ended: usize = loaded.agents.iter().map(tree::end).sum();
    if ended > 0 {
        tracing::warn!(ended, journal = %journal.display(), "reaped agent processes");
    }
    // The count is the output the backend reads (stdout, not the log).
    use std::io::Write;
    writeln!(std::io::stdout(), "{ended}").context("writing the count")?;
    Ok(())
}

/// `agentctl worktree OP ...`: one worktree operation on this host (see
/// `agentctl::worktree`), answered as one JSON object on stdout:
/// `{"ok": ...}` or `{"error": {"code": "invalid_argument", "message": ...}}`.
/// It runs before the session's agentctl can serve (its workspace is the
/// worktree), which is why it is a command and not a call.
#[derive(Debug, Parser)]
#[command(name = "agentctl worktree")]
struct WorktreeCli {
    /// What to do.
    #[arg(value_enum)]
    op: WorktreeOp,
    /// The repository (a directory holding `.git`, or a bare repository).
    #[arg(long)]
    repository: PathBuf,
    /// The ref the branch starts from.
    #[arg(long, default_value = "")]
    base: String,
    /// The session's branch (not for `branches`).
    #[arg(long, default_value = "")]
    branch: String,
    /// The worktree directory (not for `branches`).
    #[arg(long, default_value = "")]
    path: String,
    /// `restore`: the create was cut short, so a missing branch is created
    /// from the base instead of being an error.
    #[arg(long)]
    never_created: bool,
    /// `remove`: delete the branch too.
    #[arg(long)]
    delete_branch: bool,
    /// `commits`: at most this many.
    #[arg(long, default_value_t = 200)]
    limit: u32,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum WorktreeOp {
    Check,
    Create,
    Restore,
    State,
    Remove,
    Commits,
    Branches,
}

async fn worktree_main() -> anyhow::Result<()> {
    use agentctl::worktree;
    use std::io::Write;
    let cli = WorktreeCli::parse_from(std::env::args_os().skip(1));
    let spec = worktree::Spec {
        repository: cli.repository,
        base: cli.base,
        branch: cli.branch,
        path: PathBuf::from(cli.path),
    };
    let op = match cli.op {
        WorktreeOp::Check => "check",
        WorktreeOp::Create => "create",
        WorktreeOp::Restore => "restore",
        WorktreeOp::State => "state",
        WorktreeOp::Remove => "remove",
        WorktreeOp::Commits => "commits",
        WorktreeOp::Branches => "branches",
    };
    // On stderr, which the caller shows only when the command fails: a
    // wait that ends in a failure tells what it waited for.
    let waiting = || {
        eprintln!(
            "agentctl worktree: waiting for another operation on {} to finish",
            spec.path.display()
        );
    };
    let answer = worktree::run(
        op,
        &spec,
        cli.never_created,
        cli.delete_branch,
        cli.limit,
        &waiting,
    )
    .await;
    let line = match answer {
        Ok(value) => serde_json::json!({ "ok": value }),
        Err(e) => {
            let message = e.detail();
            let code = tonic::Status::from(e).code();
            serde_json::json!({ "error": { "code": i32::from(code), "message": message } })
        }
    };
    writeln!(std::io::stdout(), "{line}").context("writing the answer")?;
    Ok(())
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a fraction between 0 and 1")),
    }
}

fn parse_endpoint(s: &str) -> Result<Option<String>, String> {
    match s.trim() {
        "" | "off" | "none" => Ok(None),
        url if url.starts_with("http://") && url.len() > "http://".len() => {
            Ok(Some(url.to_owned()))
        }
        url => Err(format!(
            "--otlp-endpoint {url:?} is not an OTLP/gRPC address such as http://127.0.0.1:4317 \
             (TLS to the collector is not built in)"
        )),
    }
}

/// Where agentctl listens.
#[derive(Debug, Clone)]
enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

fn parse_listen(s: &str) -> Result<Listen, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        if path.is_empty() {
            return Err("unix: needs a socket path, e.g. unix:/run/sessiond/agentctl.sock".into());
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    s.parse::<SocketAddr>().map(Listen::Tcp).map_err(|e| {
        format!("invalid listen address {s:?}: {e} (expected host:port or unix:<path>)")
    })
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (examples: 500ms, 30s, 15m, 2h)"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("invalid duration unit in {s:?} (ms, s, m, h)")),
    }
}

fn load_secret(cli: &Cli) -> anyhow::Result<Secret> {
    let raw = match &cli.secret_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading secret file {}", path.display()))?,
        None => std::env::var("AGENTCTL_SECRET")
            .context("no secret: set AGENTCTL_SECRET or pass --secret-file")?,
    };
    if let (true, Some(path)) = (cli.remove_secret_file, &cli.secret_file) {
        std::fs::remove_file(path)
            .with_context(|| format!("removing secret file {}", path.display()))?;
    }
    Secret::new(&raw).context("the secret is empty")
}

/// Binds a Unix socket at `path` that only this user (and root) may connect
/// to. A socket file left by an earlier agentctl of this run directory is
/// replaced; anything else at that path is an error.
fn bind_unix(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?,
        Ok(_) => bail!("{} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding unix socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(listener)
}

fn write_port_file(path: &std::path::Path, port: u16) -> anyhow::Result<()> {
    let file_name = path
        .file_name()
        .with_context(|| format!("port file {} has no file name", path.display()))?;
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(format!("{port}\n").as_bytes())
            .with_context(|| format!("writing {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Accepted connections with Nagle's algorithm off. With it on, a reply
/// written in two parts (HTTP/2 headers, then data and trailers) can wait
/// for the peer's delayed ACK: a 40 ms stall, seen on the first call of a
/// recovery and on `Prompt` under load.
fn tcp_incoming(listener: tokio::net::TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

enum Incoming {
    Tcp(TcpIncoming),
    Unix(UnixListenerStream),
}

/// TLS for a TCP listener from the --tls-* files (read before serving, so
/// a bad file is a start error naming the flag).
fn server_tls(cli: &Cli) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let (Some(cert), Some(key)) = (&cli.tls_cert, &cli.tls_key) else {
        return Ok(None);
    };
    if matches!(cli.listen, Listen::Unix(_)) {
        anyhow::bail!("--tls-cert is for TCP listeners; a Unix socket is local (mode 0600)");
    }
    let read = |flag: &str, path: &PathBuf| {
        std::fs::read(path).with_context(|| format!("{flag}: cannot read {}", path.display()))
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read("--tls-cert", cert)?,
        read("--tls-key", key)?,
    ));
    if let Some(ca) = &cli.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read("--tls-client-ca", ca)?));
    }
    Ok(Some(tls))
}

/// The one line on stdout, for whoever started us; a closed stdout is not an
/// error (the port file or the socket says the same).
fn announce(addr: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "agentctl listening on {addr}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    agentctl::sys::keep_inherited_descriptors_from_children();
    if std::env::args_os().nth(1).is_some_and(|a| a == "worktree") {
        return worktree_main().await;
    }
    let cli = Cli::parse();
    let otlp_endpoint = match cli.otlp_endpoint.as_deref() {
        Some(s) => parse_endpoint(s).map_err(anyhow::Error::msg)?,
        None => None,
    };
    let telemetry = sessiond_telemetry::init(sessiond_telemetry::Settings {
        service_name: "agentctl",
        log_filter: std::env::var("AGENTCTL_LOG")
            .ok()
            .filter(|f| !f.trim().is_empty())
            .unwrap_or_else(|| "info".into()),
        log_json: cli.log_json,
        otlp_endpoint,
        sample_ratio: cli.trace_sample_ratio,
    })?;
    if cli.reap {
        return reap(cli.journal.as_deref().context("--reap needs --journal")?);
    }
    let secret = load_secret(&cli)?;
    // Before any agent runs: the secret must not be readable through /proc.
    agentctl::sys::forbid_inspection().context("PR_SET_DUMPABLE")?;
    if cli.executor_id.is_empty() {
        bail!("--executor-id must not be empty");
    }
    let epoch_file = cli.epoch_file.clone().or_else(|| {
        cli.journal.as_ref().map(|j| {
            let mut p = j.clone().into_os_string();
            p.push(".epoch");
            PathBuf::from(p)
        })
    });
    let fence = Arc::new(match &epoch_file {
        Some(path) => EpochFence::open(path)?,
        None => EpochFence::in_memory(),
    });
    let workspace = Arc::new(match &cli.workspace {
        Some(root) => WorkspaceSlot::fixed(Workspace::open(root)?),
        None => WorkspaceSlot::unbound(),
    });
    let updates = Arc::new(UpdateLog::new(cli.update_buffer));
    let activity = Arc::new(Activity::default());
    let (journal, loaded) = match &cli.journal {
        Some(path) => {
            // Agent trees of earlier agentctl processes (a SIGKILLed one
            // cannot end its agent's grandchildren) end before we serve.
            let (journal, loaded) = Journal::open(
                path,
                updates.instance_id(),
                agentctl::agent::REMEMBERED_TURNS,
                |a| {
                    let ended = tree::end(a);
                    if ended > 0 {
                        tracing::warn!(ended, pid = a.pid, instance = %a.instance,
                            "ended the processes an earlier agentctl's agent left behind");
                    }
                    !tree::members(a).is_empty()
                },
            )?;
            tracing::info!(journal = %path.display(), turns = loaded.turns.len(), fresh = loaded.fresh, "turn journal opened");
            (journal, loaded)
        }
        None => (Journal::none(), Default::default()),
    };
    // Test hook for deterministic crash tests (see AgentManager::with_journal).
    let crash_at = std::env::var("AGENTCTL_TEST_CRASH_AT")
        .ok()
        .filter(|v| !v.is_empty())
        .map(|at| agentctl::agent::CrashHook {
            at,
            once: std::env::var_os("AGENTCTL_TEST_CRASH_ONCE").map(Into::into),
        });
    let agent = AgentManager::with_journal(
        workspace.clone(),
        updates.clone(),
        cli.permission_policy,
        journal,
        loaded,
        crash_at,
    )
    .with_doorbell(cli.doorbell.clone(), cli.executor_id.clone());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let service = AgentCtl::new(
        cli.executor_id.clone(),
        workspace.clone(),
        agent.clone(),
        updates,
        activity.clone(),
        shutdown_rx.clone(),
    )
    .with_worktree_roots(cli.worktree_root.clone());
    // Test hook: serve no `Recover`, as an agentctl older than the call, so
    // the backend's fallback to one call per step is tested against a real
    // process. Debug builds only: a release agentctl always serves it.
    let without_recover =
        cfg!(debug_assertions) && std::env::var_os("AGENTCTL_TEST_WITHOUT_RECOVER").is_some();

    let tls = server_tls(&cli)?;
    let incoming = match &cli.listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            let addr = listener.local_addr()?;
            if let Some(path) = &cli.port_file {
                write_port_file(path, addr.port())?;
            }
            announce(&addr.to_string());
            Incoming::Tcp(tcp_incoming(listener))
        }
        Listen::Unix(path) => {
            let listener = bind_unix(path)?;
            announce(&format!("unix:{}", path.display()));
            Incoming::Unix(UnixListenerStream::new(listener))
        }
    };
    tracing::info!(
        listen = ?cli.listen,
        executor_id = %cli.executor_id,
        workspace = ?workspace.root(),
        worktree_roots = ?cli.worktree_root,
        idle_timeout = ?cli.idle_timeout,
        "agentctl serving"
    );

    // Why we stop: SIGTERM/SIGINT, or no backend contact for too long.
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let idle_timeout = cli.idle_timeout;
    let idle_activity = activity.clone();
    let stop_reason = async move {
        let idle = async {
            if idle_timeout.is_zero() {
                return std::future::pending::<()>().await;
            }
            loop {
                let idle_for = idle_activity.idle_for();
                if idle_for >= idle_timeout {
                    return;
                }
                let left = idle_timeout - idle_for;
                tokio::time::sleep(left.min(Duration::from_millis(500))).await;
            }
        };
        tokio::select! {
            _ = sigterm.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
            () = idle => "idle timeout",
        }
    };
    // On the way out: end update streams, stop the agent, then let the server
    // drain; connections that do not close within a few seconds are dropped.
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let stop_grace = cli.stop_grace;
    let stopping_agent = agent.clone();
    let shutdown = async move {
        let reason = stop_reason.await;
        tracing::info!(reason, "agentctl shutting down; stopping the agent");
        let _ = shutdown_tx.send(true);
        let exit = stopping_agent.stop(stop_grace).await;
        tracing::info!(?exit, "agent stopped");
        let _ = stopped_tx.send(());
    };

    let auth = Authenticator::new(secret, activity, fence);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls)
            .context("--tls-cert / --tls-key / --tls-client-ca")?;
    }
    let router = builder
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(sessiond_telemetry::GrpcTraceLayer)
        .add_service(agentctl::service::server(service, auth, without_recover));
    let server = async move {
        match incoming {
            Incoming::Tcp(s) => router.serve_with_incoming_shutdown(s, shutdown).await,
            Incoming::Unix(s) => router.serve_with_incoming_shutdown(s, shutdown).await,
        }
    };
    let drain_deadline = async {
        if stopped_rx.await.is_ok() {
            tokio::time::sleep(Duration::from_secs(5)).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r.context("serving gRPC")?,
        () = drain_deadline => tracing::warn!("connections did not close within 5 s; exiting anyway"),
    }
    tracing::info!("agentctl exited cleanly");
    telemetry.shutdown();
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt as _;

    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let mut incoming = super::tcp_incoming(listener);
        let _client = tokio::net::TcpStream::connect(address).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY is not set");
    }
}
