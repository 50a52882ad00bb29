//! Configuration, loaded once here and passed down as typed values.
//!
//! Precedence, lowest first: built-in defaults, the TOML file (`--config`,
//! `SESSIOND_CONFIG`), `SESSIOND_*` environment variables, flags. The file is
//! parsed into [`FileConfig`] (serde, unknown keys rejected), flags and
//! environment variables are overlaid on it, and [`FileConfig::validate`]
//! turns the result into [`Config`], reporting every problem with the dotted
//! key it concerns (`executors.docker.image: must not be empty`).
//!
//! `sessiond.example.toml` at the repository root documents every key.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use clap::{Args, builder::BoolishValueParser};
use serde::Deserialize;
use sessiond_domain::{ContainerAgent, PermissionPolicy, ResumePolicy, Runtime};

/// The built-in agent profile: the demo ACP agent shipped with sessiond.
pub const DEMO_PROFILE: &str = "demo";

/// The flags of `sessiond serve` (and `migrate`), each with its
/// `SESSIOND_*` environment variable; every one overrides the file key it
/// names. `None`: not given, the file's value (or the default) stands.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// TOML configuration file (see sessiond.example.toml). Flags and
    /// SESSIOND_* variables override what it says.
    #[arg(long, env = "SESSIOND_CONFIG")]
    pub config: Option<PathBuf>,

    /// Directory for the embedded SQLite database and other state.
    /// Default: $XDG_DATA_HOME/sessiond, or ~/.local/share/sessiond.
    #[arg(long, env = "SESSIOND_DATA_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Database URL: `postgres://...` for production; default is the
    /// SQLite file `sessiond.sqlite3` in the data directory.
    #[arg(long, env = "SESSIOND_DATABASE_URL")]
    pub database_url: Option<String>,

    /// Address to serve gRPC (and gRPC-web) on. Port 0 picks a free port
    /// (printed at start). Default 127.0.0.1:50051.
    #[arg(long, env = "SESSIOND_LISTEN")]
    pub listen: Option<String>,

    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "SESSIOND_LOG_JSON", value_parser = BoolishValueParser::new(),
          num_args = 0..=1, default_missing_value = "true")]
    pub log_json: Option<bool>,

    /// API bearer tokens, comma-separated (replace `auth.tokens`).
    #[arg(
        long,
        env = "SESSIOND_API_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_tokens: Option<Vec<String>>,

    /// Serve without authentication. Only allowed on a loopback address.
    #[arg(long, env = "SESSIOND_INSECURE_NO_AUTH", value_parser = BoolishValueParser::new(),
          num_args = 0..=1, default_missing_value = "true")]
    pub insecure_no_auth: Option<bool>,

    /// Prometheus metrics address (`GET /metrics`), or `off`. Default 127.0.0.1:9464.
    #[arg(long, env = "SESSIOND_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,

    /// OpenTelemetry collector to export traces to over OTLP/gRPC
    /// (`http://127.0.0.1:4317`), or `off` (the default).
    #[arg(long, env = "SESSIOND_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Fraction of new traces exported, 0 to 1 (a caller's sampled
    /// `traceparent` is always followed). Default 1.
    #[arg(long, env = "SESSIOND_TRACE_SAMPLE_RATIO")]
    pub trace_sample_ratio: Option<f64>,

    /// Largest message content `SendMessage` accepts, in bytes.
    #[arg(long, env = "SESSIOND_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: Option<u64>,

    /// Browser origins allowed by CORS, comma-separated; `*` for any (refused
    /// with --insecure-no-auth). Default: none.
    #[arg(long, env = "SESSIOND_CORS_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub cors_allowed_origins: Option<Vec<String>>,

    /// Runtime of sessions that do not ask for one:
    /// local_standalone | local_docker | remote, or a runtime an embedding
    /// service registers (the `sessiond` binary registers none).
    #[arg(long, env = "SESSIOND_DEFAULT_RUNTIME")]
    pub default_runtime: Option<String>,

    /// Agent profile of sessions that do not name one.
    #[arg(long, env = "SESSIOND_DEFAULT_AGENT")]
    pub default_agent: Option<String>,

    /// Directories local worktrees must lie in, comma-separated
    /// (replace `executors.worktree_roots`). Default: the serving user's home.
    #[arg(long, env = "SESSIOND_WORKTREE_ROOTS", value_delimiter = ',')]
    pub worktree_roots: Option<Vec<PathBuf>>,

    /// Repositories offered for new sessions, comma-separated (replace
    /// `executors.repositories`); inside the worktree roots.
    #[arg(long, env = "SESSIOND_REPOSITORIES", value_delimiter = ',')]
    pub repositories: Option<Vec<PathBuf>>,

    /// Where standalone sessions created from a repository get their git
    /// worktree (replace `executors.worktrees_dir`); inside a worktree root.
    #[arg(long, env = "SESSIOND_WORKTREES_DIR")]
    pub worktrees_dir: Option<PathBuf>,

    /// First part of the branch of every worktree sessiond creates
    /// (replace `executors.worktree_branch_prefix`). Default: `sessiond`.
    #[arg(long, env = "SESSIOND_WORKTREE_BRANCH_PREFIX")]
    pub worktree_branch_prefix: Option<String>,

    /// The agentctl binary for standalone executors.
    /// Default: next to the sessiond executable, then PATH.
    #[arg(long, env = "SESSIOND_AGENTCTL_PATH")]
    pub agentctl_path: Option<PathBuf>,

    /// Enable the Docker runtime.
    #[arg(long, env = "SESSIOND_DOCKER_ENABLED", value_parser = BoolishValueParser::new(),
          num_args = 0..=1, default_missing_value = "true")]
    pub docker_enabled: Option<bool>,

    /// Docker engine address (unix:///... or tcp://...).
    #[arg(long, env = "SESSIOND_DOCKER_HOST")]
    pub docker_host: Option<String>,

    /// Image holding agentctl and the agents.
    #[arg(long, env = "SESSIOND_DOCKER_IMAGE")]
    pub docker_image: Option<String>,

    /// When to resume sessions after a restart: startup | on_demand.
    #[arg(long, env = "SESSIOND_RECOVERY_MODE")]
    pub recovery_mode: Option<String>,

    /// How many executors startup recovery handles at once.
    #[arg(long, env = "SESSIOND_RECOVERY_CONCURRENCY")]
    pub recovery_concurrency: Option<u32>,

    /// Silence limit of recovery, e.g. `5s`: a step that does not answer,
    /// or an agent that shows no sign of life, for this long is cut (and
    /// retried).
    #[arg(long, env = "SESSIOND_RECOVERY_EXECUTOR_DEADLINE")]
    pub recovery_executor_deadline: Option<String>,

    /// Agent launches admitted at once per host at first (0: the core
    /// count); adapts to measured launch times.
    #[arg(long, env = "SESSIOND_RECOVERY_LAUNCH_CONCURRENCY")]
    pub recovery_launch_concurrency: Option<u32>,

    /// Attempts at bringing a session back before it goes ERROR for a
    /// cause that can pass by itself.
    #[arg(long, env = "SESSIOND_RECOVERY_MAX_ATTEMPTS")]
    pub recovery_max_attempts: Option<u32>,

    /// PEM certificate (chain) to serve the API port with TLS (`tls.cert_file`).
    #[arg(long, env = "SESSIOND_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert (`tls.key_file`).
    #[arg(long, env = "SESSIOND_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// Close an API connection that has not sent its first bytes, or not
    /// finished its TLS handshake, within this (`handshake_timeout`, e.g. `10s`).
    #[arg(long, env = "SESSIOND_HANDSHAKE_TIMEOUT")]
    pub handshake_timeout: Option<String>,

    /// End a request whose body sends no data for this long
    /// (`request_body_timeout`, e.g. `30s`).
    #[arg(long, env = "SESSIOND_REQUEST_BODY_TIMEOUT")]
    pub request_body_timeout: Option<String>,

    /// PEM CA that signed remote agentctls' certificates
    /// (`executors.remote.tls_ca_file`).
    #[arg(long, env = "SESSIOND_REMOTE_TLS_CA_FILE")]
    pub remote_tls_ca_file: Option<PathBuf>,

    /// Hosts remote agentctl URLs may name, comma-separated: names,
    /// `*.domain`, addresses, networks (replace `executors.remote.allowed_hosts`).
    #[arg(long, env = "SESSIOND_REMOTE_ALLOWED_HOSTS", value_delimiter = ',')]
    pub remote_allowed_hosts: Option<Vec<String>>,

    /// Most sessions with a live executor at once (`limits.max_live_sessions`).
    #[arg(long, env = "SESSIOND_MAX_LIVE_SESSIONS")]
    pub max_live_sessions: Option<u32>,

    /// Most open watch streams (`limits.max_watch_streams`).
    #[arg(long, env = "SESSIOND_MAX_WATCH_STREAMS")]
    pub max_watch_streams: Option<u32>,

    /// Most open watch streams per API token (`limits.max_watch_streams_per_token`).
    #[arg(long, env = "SESSIOND_MAX_WATCH_STREAMS_PER_TOKEN")]
    pub max_watch_streams_per_token: Option<u32>,

    /// This replica's id among those sharing the database (`replica.id`).
    /// Default: generated once and kept in the data directory.
    #[arg(long, env = "SESSIOND_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// Where other replicas and clients reach this one (`replica.advertise_address`,
    /// host:port or https://host:port). Default: the listen address.
    #[arg(long, env = "SESSIOND_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,

    /// PEM CA that signed the other replicas' API certificates, to forward
    /// calls to replicas serving TLS (`replica.peer_tls_ca_file`).
    #[arg(long, env = "SESSIOND_PEER_TLS_CA_FILE")]
    pub peer_tls_ca_file: Option<PathBuf>,

    /// Name the other replicas' certificates are verified against, when it
    /// is not the host of their advertised address (`replica.peer_tls_domain_name`).
    #[arg(long, env = "SESSIOND_PEER_TLS_DOMAIN_NAME")]
    pub peer_tls_domain_name: Option<String>,

    /// Executor lease TTL (`replica.lease_ttl`), e.g. `15s`.
    #[arg(long, env = "SESSIOND_LEASE_TTL")]
    pub lease_ttl: Option<String>,
}

/// The TOML file's shape, with every default filled in. Durations are
/// strings such as `250ms`, `5s`, `2m`, `1h`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileConfig {
    /// `data_dir`: the SQLite database, agentctl run files and logs.
    /// Default: `$XDG_DATA_HOME/sessiond`, else `~/.local/share/sessiond`.
    pub data_dir: Option<PathBuf>,
    /// `database_url`: `postgres://...`, `sqlite://PATH` or a file path. Default: the
    /// SQLite file `<data_dir>/sessiond.sqlite3`.
    pub database_url: Option<String>,
    /// `listen`: address of the API (gRPC and gRPC-web). Default
    /// `127.0.0.1:50051`; port 0 picks a free one.
    pub listen: String,
    /// `max_message_bytes`: largest SendMessage content, in bytes (default 1 MiB).
    pub max_message_bytes: u64,
    /// `log_json`: JSON log lines instead of text (default false).
    pub log_json: bool,
    /// `shutdown_grace`: time in-flight calls get to finish after SIGTERM
    /// (default `10s`).
    pub shutdown_grace: String,
    /// `handshake_timeout`: an API connection that sends nothing, or does
    /// not finish its TLS handshake, within this is closed (default `10s`).
    pub handshake_timeout: String,
    /// `request_body_timeout`: a request whose body stalls this long
    /// between two pieces (or before the first) is ended (default `30s`).
    pub request_body_timeout: String,
    /// `default_agent`: profile of sessions that name none (default `demo`).
    pub default_agent: String,
    /// `[auth]`.
    pub auth: AuthSection,
    /// `[cors]`.
    pub cors: CorsSection,
    /// `[metrics]`.
    pub metrics: MetricsSection,
    /// `[traces]`.
    pub traces: TracesSection,
    /// `[executors]` and its subsections.
    pub executors: ExecutorsSection,
    /// `[recovery]`.
    pub recovery: RecoverySection,
    /// `[limits]`.
    pub limits: LimitsSection,
    /// `[tls]`.
    pub tls: TlsSection,
    /// `[replica]`.
    pub replica: ReplicaSection,
    /// `[[agents]]`: the agent profiles (the built-in `demo` is added unless
    /// one here has its name).
    pub agents: Vec<AgentSection>,
}

/// `[replica]`: this process as one of several on one PostgreSQL.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaSection {
    /// Unique per replica, stable across its restarts. Default: generated
    /// once and kept in `<data_dir>/replica-id`.
    pub id: Option<String>,
    /// host:port (or https://host:port) others reach this replica's API
    /// at. Default: `listen`; https when `[tls]` is set.
    pub advertise_address: Option<String>,
    /// A replica that has not renewed its leases for this long is gone;
    /// the others adopt its executors.
    pub lease_ttl: String,
    /// PEM CA the other replicas' API certificates are verified with when
    /// a call is forwarded to one serving TLS. Unset: calls for sessions
    /// of replicas serving TLS are not forwarded (answered `not_owner`).
    pub peer_tls_ca_file: Option<PathBuf>,
    /// The name the other replicas' certificates are verified against, when
    /// not the host of their advertised address.
    pub peer_tls_domain_name: Option<String>,
}

impl Default for ReplicaSection {
    fn default() -> Self {
        Self {
            id: None,
            advertise_address: None,
            lease_ttl: "15s".into(),
            peer_tls_ca_file: None,
            peer_tls_domain_name: None,
        }
    }
}

/// Validated `[replica]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// `None`: generated once into the data directory (by `serve`).
    pub id: Option<String>,
    /// host:port or https://host:port others reach this replica's API at;
    /// `None`: `listen` (see [`ReplicaConfig::advertised`]).
    pub advertise_address: Option<String>,
    /// How long a lease lasts without renewal (renewed every third of it).
    pub lease_ttl: Duration,
    /// PEM CA file trusted for the other replicas' API certificates.
    pub peer_tls_ca_file: Option<PathBuf>,
    /// The name their certificates are verified against, when not the
    /// host of their advertised address.
    pub peer_tls_domain_name: Option<String>,
}

impl ReplicaConfig {
    /// The address this replica registers for the others: the configured
    /// one, else `listen_address`; `https://` in front when this replica
    /// serves TLS (`serves_tls`), so a forwarding replica knows to verify
    /// it.
    pub fn advertised(&self, listen_address: &str, serves_tls: bool) -> String {
        let address = self
            .advertise_address
            .clone()
            .unwrap_or_else(|| listen_address.to_owned());
        if serves_tls && !address.starts_with("https://") {
            format!("https://{address}")
        } else {
            address
        }
    }
}

/// `[tls]`: TLS on the API port (gRPC, gRPC-web, the console; HTTP/2 for
/// browsers through ALPN).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// `tls.cert_file`: PEM certificate (chain); flag `--tls-cert`.
    pub cert_file: Option<PathBuf>,
    /// `tls.key_file`: its PEM private key (both or neither); flag `--tls-key`.
    pub key_file: Option<PathBuf>,
}

/// `[limits]`: what callers may hold at once.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSection {
    /// Sessions with a live executor (`starting` or `ready`).
    pub max_live_sessions: u32,
    /// Open WatchSession / WatchTask streams, all callers together.
    pub max_watch_streams: u32,
    /// Open watch streams per API token.
    pub max_watch_streams_per_token: u32,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self {
            max_live_sessions: 64,
            max_watch_streams: 1024,
            max_watch_streams_per_token: 256,
        }
    }
}

/// Validated `[limits]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsConfig {
    /// Sessions with a live executor at once; a create past it is
    /// RESOURCE_EXHAUSTED.
    pub max_live_sessions: usize,
    /// Open watch streams, all callers together.
    pub max_watch_streams: usize,
    /// Open watch streams per API token.
    pub max_watch_streams_per_token: usize,
}

/// `[auth]`: who may call the API served by [`crate::serve`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// Bearer tokens accepted (at least 16 printable characters each);
    /// flag `--api-tokens`, env `SESSIOND_API_TOKENS` (comma-separated).
    pub tokens: Vec<String>,
    /// A file with one token per line (blank lines and `#` comments ignored).
    pub tokens_file: Option<PathBuf>,
    /// Serve without any token: only on a loopback `listen`, never with
    /// tokens; flag `--insecure-no-auth`.
    pub insecure_no_auth: bool,
}

/// `[cors]`: browser origins allowed to call the API through gRPC-web.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CorsSection {
    /// Origins such as `https://console.example.com`; `*` for any; empty
    /// (default): no cross-origin access. Flag `--cors-allowed-origins`.
    pub allowed_origins: Vec<String>,
    /// How long browsers may cache a preflight answer (default `1h`).
    pub max_age: String,
}

/// `[metrics]`: the Prometheus endpoint and the `/livez`, `/readyz` probes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// Address of the endpoint (default `127.0.0.1:9464`); `off` (or
    /// empty) disables it. Flag `--metrics-listen`.
    pub listen: String,
    /// Connections the endpoint serves at once (default 1024).
    pub max_connections: u32,
    /// A connection that sends no request for this long is closed (default `10s`).
    pub idle_timeout: String,
}

/// `[traces]`: OpenTelemetry spans over OTLP/gRPC.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracesSection {
    /// OTLP/gRPC collector (`http://host:4317`); `off` (the default, or
    /// empty) exports nothing. Flag `--otlp-endpoint`.
    pub otlp_endpoint: String,
    /// Fraction of new traces exported, 0 to 1 (default 1). Flag
    /// `--trace-sample-ratio`.
    pub sample_ratio: f64,
}

impl Default for TracesSection {
    fn default() -> Self {
        Self {
            otlp_endpoint: "off".into(),
            sample_ratio: 1.0,
        }
    }
}

/// `[executors]`: where and how agentctls run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExecutorsSection {
    /// Runtime of sessions that ask for none: `local_standalone` (default),
    /// `local_docker`, `remote`, or the name of a runtime whose driver an
    /// embedding service registers ([`crate::SessiondBuilder::executor`];
    /// checked when it builds). Env `SESSIOND_DEFAULT_RUNTIME`.
    pub default_runtime: String,
    /// Limit of connecting to an agentctl (default `2s`).
    pub connect_timeout: String,
    /// Limit of one agentctl call (default `5s`).
    pub call_timeout: String,
    /// agentctl exits on its own after this long without backend contact; `0s` never.
    pub idle_timeout: String,
    /// Local (standalone, Docker) worktrees must lie in one of these
    /// directories. Default: the serving user's home. `/` is refused.
    pub worktree_roots: Option<Vec<PathBuf>>,
    /// Where a standalone session created from a repository gets its git
    /// worktree (`<dir>/<short id>-<slug>`), and a Docker one unless
    /// `executors.docker.worktrees_dir` says otherwise; inside
    /// `worktree_roots`. Default: `<data_dir>/worktrees` when that is
    /// inside them.
    pub worktrees_dir: Option<PathBuf>,
    /// First part of the branch of every worktree sessiond creates
    /// (`<prefix>/<short id>-<slug of the task title>`). Default `sessiond`.
    pub worktree_branch_prefix: String,
    /// Git repositories offered to clients for new sessions (the console's
    /// new-session form); inside `worktree_roots`. Others may be named too.
    pub repositories: Vec<PathBuf>,
    /// `[executors.standalone]`.
    pub standalone: StandaloneSection,
    /// `[executors.docker]`.
    pub docker: DockerSection,
    /// `[executors.remote]`.
    pub remote: RemoteSection,
}

/// `[executors.standalone]`: agentctl as a child process group.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StandaloneSection {
    /// The agentctl binary. Default: `agentctl` next to the sessiond
    /// executable, else on PATH. Flag `--agentctl-path`.
    pub agentctl_path: Option<PathBuf>,
    /// agentctl sockets and one-shot secrets (default `<data_dir>/run`;
    /// keep it short: a socket path has at most 107 bytes).
    pub run_dir: Option<PathBuf>,
    /// One log per executor (default `<data_dir>/logs`).
    pub log_dir: Option<PathBuf>,
    /// How long a new agentctl may take to answer (default `10s`).
    pub startup_timeout: String,
}

/// `[executors.docker]`: agentctl in a container of a Docker engine.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DockerSection {
    /// Enable the `local_docker` runtime (default false). Flag `--docker-enabled`.
    pub enabled: bool,
    /// Engine address (default `unix:///var/run/docker.sock`). Flag `--docker-host`.
    pub host: String,
    /// Image holding agentctl and the agents (default
    /// `sessiond-agentctl:dev`). Flag `--docker-image`.
    pub image: String,
    /// agentctl inside the image (default `/usr/local/bin/agentctl`).
    pub agentctl_path: String,
    /// The containers' network: `none` (default), `bridge` or a network
    /// name; `host` is refused.
    pub network_mode: String,
    /// `uid[:gid]` to run as; default: the owner of the worktree. Never root.
    pub user: Option<String>,
    /// Memory limit in bytes; unset: the engine's default.
    pub memory_bytes: Option<i64>,
    /// CPU limit in CPUs (e.g. `2.0`); unset: the engine's default.
    pub cpus: Option<f64>,
    /// Most processes in a container (default 1024).
    pub pids_limit: Option<i64>,
    /// How long a new container's agentctl may take to answer (default `15s`).
    pub startup_timeout: String,
    /// Where a Docker session created from a repository gets its git
    /// worktree, on this host (mounted into its container with the
    /// repository's git directory); inside `worktree_roots`. Default:
    /// `executors.worktrees_dir`.
    pub worktrees_dir: Option<PathBuf>,
}

/// `[executors.remote]`: agentctls someone else runs, reached by URL.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteSection {
    /// PEM CA for `https://` agentctl URLs. Flag `--remote-tls-ca-file`.
    pub tls_ca_file: Option<PathBuf>,
    /// Name to verify the certificate against when it differs from the URL host.
    pub tls_domain_name: Option<String>,
    /// PEM certificate sessiond presents to agentctls that require client
    /// certificates (both or neither with the key; needs `tls_ca_file`).
    pub tls_client_cert_file: Option<PathBuf>,
    /// The PEM key of `tls_client_cert_file`.
    pub tls_client_key_file: Option<PathBuf>,
    /// Hosts remote agentctl URLs may name: host names, `*.domain`,
    /// addresses and networks (`10.0.0.0/8`). Default: loopback only.
    pub allowed_hosts: Option<Vec<String>>,
    /// The directory on remote hosts where a remote session created from a
    /// repository gets its worktree, made by the host's agentctl (started
    /// with `--worktree-root` holding it and the repository). Unset: remote
    /// sessions name a directory.
    pub worktrees_dir: Option<PathBuf>,
}

/// `[recovery]`: what a restart does with the sessions it finds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecoverySection {
    /// `startup` (default: resume live sessions before reporting SERVING)
    /// or `on_demand` (resume agents only on ResumeSession). Flag
    /// `--recovery-mode`.
    pub mode: String,
    /// Executors recovered at once (default 64).
    pub concurrency: u32,
    /// The silence limit (default `5s`): a recovery step (a call to agentctl
    /// or the runtime) that does not answer for this long is cut; an agent's
    /// launch and resume are cut only when the agent shows no sign of life
    /// (a line written, CPU used, history replayed) for this long. A cut
    /// attempt is retried.
    pub executor_deadline: String,
    /// One agent launch and resume is cut after this long even while it
    /// shows signs of life (default `15m`).
    pub resume_cap: String,
    /// Attempts at bringing a session back (its executor and agent) before
    /// it goes ERROR for a cause that can pass by itself (default 5).
    pub max_attempts: u32,
    /// First delay before another attempt (default `1s`), doubling, with jitter.
    pub retry_backoff_initial: String,
    /// Longest delay between attempts (default `60s`).
    pub retry_backoff_max: String,
    /// Restarts of an agent that exits by itself while its agentctl lives
    /// (its conversation resumed), per session within ten minutes, under
    /// `mode = "startup"` (default 3; 0: an exit leaves the session ERROR).
    pub agent_restarts: u32,
    /// How long a cancelled turn may go on before its agent, which ignores
    /// the cancel, is stopped and restarted (default `15s`).
    pub cancel_grace: String,
    /// Agent launches admitted at once per host at first (default 0: the
    /// host's core count); adapts to measured launch times.
    pub launch_concurrency: u32,
    /// The most agent launches at once per host (default 0: four times
    /// `launch_concurrency`).
    pub launch_concurrency_max: u32,
    /// First retry delay of a remote host that did not answer (default `250ms`).
    pub remote_backoff_initial: String,
    /// Longest retry delay, doubling from the initial one (default `30s`).
    pub remote_backoff_max: String,
    /// How long a remote host is retried (default `10m`).
    pub remote_backoff_window: String,
    /// Docker: untracked sessiond containers are removed this long after
    /// the first recovery pass (default `2m`).
    pub orphan_sweep_grace: String,
    /// Docker: then every this long (default `15m`).
    pub orphan_sweep_interval: String,
}

/// `[[agents]]`: one agent profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// What sessions name it by (unique).
    pub name: String,
    /// The agent's program, looked up on agentctl's PATH when not absolute.
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Its environment (API keys go here), added to agentctl's few passed-on variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The profile's claim that the agent can resume a conversation
    /// (default true); the agent's own answer can only lower it.
    #[serde(default = "yes")]
    pub supports_session_resume: bool,
    /// ACP auth method to `authenticate` with (e.g. `openai-api-key`).
    #[serde(default)]
    pub auth_method: Option<String>,
    /// `allow` (default), `deny` or `ask`: how permission requests are answered.
    #[serde(default)]
    pub permission_policy: Option<String>,
    /// Policy `ask`: how long a request waits for an answer (default `5m`),
    /// then it is rejected.
    #[serde(default)]
    pub permission_timeout: Option<String>,
    /// Values of the agent's config options set when a session starts, by
    /// option id (`config = { model = "..." }`); each must be one the agent
    /// offers, or the session does not start.
    #[serde(default)]
    pub config: BTreeMap<String, String>,
    /// `[[agents.mcp_servers]]`: MCP servers given to the agent.
    #[serde(default)]
    pub mcp_servers: Vec<McpSection>,
    /// How the agent runs in a Docker container, when not as on the host.
    #[serde(default)]
    pub container: Option<ContainerSection>,
}

/// `[[agents.mcp_servers]]`: one MCP server of a profile.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpSection {
    /// Its name, as the agent shows it.
    pub name: String,
    /// `stdio` (default), `http` or `sse`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// stdio: the program.
    #[serde(default)]
    pub command: Option<String>,
    /// stdio: its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// stdio: its environment; each value a string, `{ env = "VAR" }` or
    /// `{ file = "PATH" }`.
    #[serde(default)]
    pub env: BTreeMap<String, SecretSection>,
    /// http, sse: the endpoint.
    #[serde(default)]
    pub url: Option<String>,
    /// http, sse: headers; values as for `env`.
    #[serde(default)]
    pub headers: BTreeMap<String, SecretSection>,
}

/// A value of an MCP server's `env` or `headers`: as is (stored with the
/// profile), or a secret read at startup from sessiond's environment or a
/// file (only the reference is stored).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum SecretSection {
    /// The value itself.
    Plain(String),
    /// `{ env = "VAR" }` or `{ file = "PATH" }`.
    Ref {
        /// An environment variable of sessiond.
        #[serde(default)]
        env: Option<String>,
        /// A file.
        #[serde(default)]
        file: Option<String>,
    },
}

/// `[agents.container]`: the agent inside an image.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerSection {
    /// The image; `executors.docker.image` when unset.
    pub image: Option<String>,
    /// The agent's program inside the image.
    pub command: String,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Added to the profile's `env`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
}

impl Default for FileConfig {
    fn default() -> Self {
        Self {
            data_dir: None,
            database_url: None,
            listen: "127.0.0.1:50051".into(),
            max_message_bytes: 1024 * 1024,
            log_json: false,
            shutdown_grace: "10s".into(),
            handshake_timeout: "10s".into(),
            request_body_timeout: "30s".into(),
            default_agent: DEMO_PROFILE.into(),
            auth: AuthSection::default(),
            cors: CorsSection::default(),
            metrics: MetricsSection::default(),
            traces: TracesSection::default(),
            executors: ExecutorsSection::default(),
            recovery: RecoverySection::default(),
            limits: LimitsSection::default(),
            tls: TlsSection::default(),
            replica: ReplicaSection::default(),
            agents: Vec::new(),
        }
    }
}

impl Default for CorsSection {
    fn default() -> Self {
        Self {
            allowed_origins: Vec::new(),
            max_age: "1h".into(),
        }
    }
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            max_connections: 1024,
            idle_timeout: "10s".into(),
        }
    }
}

impl Default for ExecutorsSection {
    fn default() -> Self {
        Self {
            default_runtime: Runtime::LocalStandalone.as_str().into(),
            connect_timeout: "2s".into(),
            call_timeout: "5s".into(),
            idle_timeout: "0s".into(),
            worktree_roots: None,
            worktrees_dir: None,
            worktree_branch_prefix: "sessiond".into(),
            repositories: Vec::new(),
            standalone: StandaloneSection::default(),
            docker: DockerSection::default(),
            remote: RemoteSection::default(),
        }
    }
}

impl Default for StandaloneSection {
    fn default() -> Self {
        Self {
            agentctl_path: None,
            run_dir: None,
            log_dir: None,
            startup_timeout: "10s".into(),
        }
    }
}

impl Default for DockerSection {
    fn default() -> Self {
        Self {
            enabled: false,
            host: "unix:///var/run/docker.sock".into(),
            image: "sessiond-agentctl:dev".into(),
            agentctl_path: "/usr/local/bin/agentctl".into(),
            network_mode: "none".into(),
            user: None,
            memory_bytes: None,
            cpus: None,
            pids_limit: Some(1024),
            startup_timeout: "15s".into(),
            worktrees_dir: None,
        }
    }
}

impl Default for RecoverySection {
    fn default() -> Self {
        Self {
            mode: "startup".into(),
            concurrency: 64,
            executor_deadline: "5s".into(),
            resume_cap: "15m".into(),
            max_attempts: 5,
            retry_backoff_initial: "1s".into(),
            retry_backoff_max: "60s".into(),
            agent_restarts: 3,
            cancel_grace: "15s".into(),
            launch_concurrency: 0,
            launch_concurrency_max: 0,
            remote_backoff_initial: "250ms".into(),
            remote_backoff_max: "30s".into(),
            remote_backoff_window: "10m".into(),
            orphan_sweep_grace: "2m".into(),
            orphan_sweep_interval: "15m".into(),
        }
    }
}

/// The validated configuration `serve` and `migrate` run with.
#[derive(Debug, Clone)]
/// Every field is the validated form of the [`FileConfig`] key it names.
pub struct Config {
    /// `data_dir`, the default filled in.
    pub data_dir: PathBuf,
    /// `database_url`, resolved (the SQLite default filled in).
    pub database_url: String,
    /// `listen`.
    pub listen: SocketAddr,
    /// `max_message_bytes`.
    pub max_message_bytes: usize,
    /// `log_json`.
    pub log_json: bool,
    /// `shutdown_grace`.
    pub shutdown_grace: Duration,
    /// `[auth]`.
    pub auth: AuthConfig,
    /// `[cors]`.
    pub cors: CorsConfig,
    /// `None`: no metrics endpoint.
    pub metrics_listen: Option<SocketAddr>,
    /// `metrics.max_connections`.
    pub metrics_max_connections: usize,
    /// `metrics.idle_timeout`.
    pub metrics_idle_timeout: Duration,
    /// `None`: spans are not exported.
    pub otlp_endpoint: Option<String>,
    /// `traces.sample_ratio`, 0 to 1.
    pub trace_sample_ratio: f64,
    /// `[executors]`.
    pub executors: ExecutorsConfig,
    /// `[recovery]`.
    pub recovery: RecoveryConfig,
    /// `[limits]`.
    pub limits: LimitsConfig,
    /// `(cert, key)` PEM files: the API port serves TLS.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// `handshake_timeout`: an API connection silent or mid-TLS-handshake
    /// this long after it was accepted is closed.
    pub handshake_timeout: Duration,
    /// `request_body_timeout`: a request body that sends nothing for this
    /// long is ended.
    pub request_body_timeout: Duration,
    /// `[replica]`.
    pub replica: ReplicaConfig,
    /// `[[agents]]`, the built-in `demo` profile included.
    pub agents: Vec<AgentConfig>,
    /// `default_agent`: names one of `agents`.
    pub default_agent: String,
    /// What the profiles' MCP secret references stand for, read at startup.
    pub mcp_secrets: sessiond_domain::Secrets,
    /// Problems that do not stop the server, logged once logging is up.
    pub warnings: Vec<String>,
}

/// Who may call the API.
#[derive(Clone)]
pub enum AuthConfig {
    /// Any of these bearer tokens.
    Tokens(Vec<String>),
    /// Nobody is asked (loopback only; asked for explicitly).
    Disabled,
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AuthConfig::Tokens(t) => write!(f, "Tokens({} redacted)", t.len()),
            AuthConfig::Disabled => f.write_str("Disabled"),
        }
    }
}

/// Validated `[cors]`.
#[derive(Debug, Clone)]
pub struct CorsConfig {
    /// `cors.allowed_origins`.
    pub allowed_origins: AllowedOrigins,
    /// `cors.max_age`.
    pub max_age: Duration,
}

/// Which browser origins may call the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedOrigins {
    /// No cross-origin access: requests carrying an `Origin` are refused.
    None,
    /// Any origin (`"*"`; never together with `insecure_no_auth`).
    Any,
    /// Exactly these origins.
    List(Vec<String>),
}

/// Validated `[executors]` and its subsections.
#[derive(Debug, Clone)]
pub struct ExecutorsConfig {
    /// `executors.default_runtime`.
    pub default_runtime: Runtime,
    /// `executors.connect_timeout`.
    pub connect_timeout: Duration,
    /// `executors.call_timeout`.
    pub call_timeout: Duration,
    /// `executors.idle_timeout`; `None` (`0s`): agentctl never exits on its own.
    pub idle_timeout: Option<Duration>,
    /// Absolute, normalised, never `/`.
    pub worktree_roots: Vec<PathBuf>,
    /// `executors.worktrees_dir`, inside `worktree_roots`; `None`: the
    /// default was outside them, so no runtime creates worktrees.
    pub worktrees_dir: Option<PathBuf>,
    /// `executors.worktree_branch_prefix`.
    pub worktree_branch_prefix: String,
    /// `executors.repositories`, each inside `worktree_roots`.
    pub repositories: Vec<PathBuf>,
    /// `executors.standalone.agentctl_path`, resolved.
    pub agentctl_path: PathBuf,
    /// `executors.standalone.run_dir`, resolved.
    pub run_dir: PathBuf,
    /// `executors.standalone.log_dir`, resolved.
    pub log_dir: PathBuf,
    /// `executors.standalone.startup_timeout`.
    pub standalone_startup_timeout: Duration,
    /// `[executors.docker]`; `None` when not enabled.
    pub docker: Option<DockerConfig>,
    /// `executors.remote.tls_ca_file`.
    pub remote_tls_ca_file: Option<PathBuf>,
    /// `executors.remote.tls_domain_name`.
    pub remote_tls_domain_name: Option<String>,
    /// `executors.remote.tls_client_cert_file` and `tls_client_key_file`.
    pub remote_tls_client_identity: Option<(PathBuf, PathBuf)>,
    /// `executors.remote.allowed_hosts`.
    pub remote_allowed_hosts: crate::limits::AllowedHosts,
    /// `executors.remote.worktrees_dir` (a path on remote hosts).
    pub remote_worktrees_dir: Option<PathBuf>,
}

/// Validated `[executors.docker]` (present only when enabled).
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// `host`.
    pub host: String,
    /// `image`.
    pub image: String,
    /// `agentctl_path` inside the image.
    pub agentctl_path: String,
    /// `network_mode`.
    pub network_mode: String,
    /// `user`; `None`: the worktree's owner.
    pub user: Option<String>,
    /// `memory_bytes`.
    pub memory_bytes: Option<i64>,
    /// `cpus`, in billionths of a CPU (the engine's unit).
    pub nano_cpus: Option<i64>,
    /// `pids_limit`.
    pub pids_limit: Option<i64>,
    /// `startup_timeout`.
    pub startup_timeout: Duration,
    /// `worktrees_dir`, else `executors.worktrees_dir`: where Docker
    /// sessions created from a repository get their worktree (on this
    /// host, mounted into the container).
    pub worktrees_dir: Option<PathBuf>,
}

/// Validated `[recovery]`.
#[derive(Debug, Clone)]
pub struct RecoveryConfig {
    /// `recovery.mode`.
    pub policy: ResumePolicy,
    /// `recovery.concurrency`.
    pub concurrency: usize,
    /// `recovery.executor_deadline`: the silence limit.
    pub executor_deadline: Duration,
    /// `recovery.resume_cap`.
    pub resume_cap: Duration,
    /// `recovery.max_attempts`.
    pub max_attempts: u32,
    /// `recovery.retry_backoff_initial`.
    pub retry_backoff_initial: Duration,
    /// `recovery.retry_backoff_max`.
    pub retry_backoff_max: Duration,
    /// `recovery.agent_restarts`.
    pub agent_restarts: u32,
    /// `recovery.cancel_grace`.
    pub cancel_grace: Duration,
    /// `recovery.launch_concurrency` (0: the core count).
    pub launch_concurrency: usize,
    /// `recovery.launch_concurrency_max` (0: four times the start).
    pub launch_concurrency_max: usize,
    /// `recovery.remote_backoff_initial`.
    pub remote_backoff_initial: Duration,
    /// `recovery.remote_backoff_max`.
    pub remote_backoff_max: Duration,
    /// `recovery.remote_backoff_window`.
    pub remote_backoff_window: Duration,
    /// Docker only: sessiond-labelled containers no record tracks are removed
    /// this long after the first recovery pass, then every interval.
    pub orphan_sweep_grace: Duration,
    /// `recovery.orphan_sweep_interval`.
    pub orphan_sweep_interval: Duration,
}

/// A validated agent profile (`[[agents]]`, or the built-in `demo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// `name`.
    pub name: String,
    /// `command`.
    pub command: String,
    /// `args`.
    pub args: Vec<String>,
    /// `env`.
    pub env: BTreeMap<String, String>,
    /// `supports_session_resume`.
    pub supports_session_resume: bool,
    /// `[agents.container]`.
    pub container: Option<ContainerAgent>,
    /// `auth_method`.
    pub auth_method: Option<String>,
    /// `permission_policy`.
    pub permission_policy: PermissionPolicy,
    /// `permission_timeout`.
    pub permission_timeout: Duration,
    /// `config`: default values of the agent's config options.
    pub config_defaults: BTreeMap<String, String>,
    /// `[[agents.mcp_servers]]`, secrets as references.
    pub mcp_servers: Vec<sessiond_domain::McpServer>,
}

impl ServeArgs {
    /// Defaults, then the file, then environment and flags; validated.
    pub fn resolve(&self) -> anyhow::Result<Config> {
        let mut file = match &self.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        self.overlay(&mut file);
        file.validate()
    }

    /// As [`ServeArgs::resolve`], for commands that serve no API (`migrate`):
    /// no API token is required.
    pub fn resolve_for_migrate(&self) -> anyhow::Result<Config> {
        let mut file = match &self.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        self.overlay(&mut file);
        file.validate_inner(false)
    }

    /// Environment variables and flags win over the file (clap already
    /// prefers a flag to its variable).
    fn overlay(&self, f: &mut FileConfig) {
        fn set<T: Clone>(target: &mut T, value: &Option<T>) {
            if let Some(v) = value {
                *target = v.clone();
            }
        }
        if self.data_dir.is_some() {
            f.data_dir.clone_from(&self.data_dir);
        }
        if self.database_url.is_some() {
            f.database_url.clone_from(&self.database_url);
        }
        set(&mut f.listen, &self.listen);
        set(&mut f.log_json, &self.log_json);
        set(&mut f.auth.tokens, &self.api_tokens);
        set(&mut f.auth.insecure_no_auth, &self.insecure_no_auth);
        set(&mut f.metrics.listen, &self.metrics_listen);
        set(&mut f.traces.otlp_endpoint, &self.otlp_endpoint);
        set(&mut f.traces.sample_ratio, &self.trace_sample_ratio);
        set(&mut f.max_message_bytes, &self.max_message_bytes);
        set(&mut f.cors.allowed_origins, &self.cors_allowed_origins);
        set(&mut f.executors.default_runtime, &self.default_runtime);
        set(&mut f.default_agent, &self.default_agent);
        if self.worktree_roots.is_some() {
            f.executors.worktree_roots.clone_from(&self.worktree_roots);
        }
        if self.worktrees_dir.is_some() {
            f.executors.worktrees_dir.clone_from(&self.worktrees_dir);
        }
        if let Some(r) = &self.repositories {
            f.executors.repositories.clone_from(r);
        }
        set(
            &mut f.executors.worktree_branch_prefix,
            &self.worktree_branch_prefix,
        );
        if self.agentctl_path.is_some() {
            f.executors
                .standalone
                .agentctl_path
                .clone_from(&self.agentctl_path);
        }
        set(&mut f.executors.docker.enabled, &self.docker_enabled);
        set(&mut f.executors.docker.host, &self.docker_host);
        set(&mut f.executors.docker.image, &self.docker_image);
        set(&mut f.recovery.mode, &self.recovery_mode);
        set(&mut f.recovery.concurrency, &self.recovery_concurrency);
        set(
            &mut f.recovery.executor_deadline,
            &self.recovery_executor_deadline,
        );
        set(
            &mut f.recovery.launch_concurrency,
            &self.recovery_launch_concurrency,
        );
        set(&mut f.recovery.max_attempts, &self.recovery_max_attempts);
        if self.replica_id.is_some() {
            f.replica.id.clone_from(&self.replica_id);
        }
        if self.advertise_address.is_some() {
            f.replica
                .advertise_address
                .clone_from(&self.advertise_address);
        }
        set(&mut f.replica.lease_ttl, &self.lease_ttl);
        if self.peer_tls_ca_file.is_some() {
            f.replica
                .peer_tls_ca_file
                .clone_from(&self.peer_tls_ca_file);
        }
        if self.peer_tls_domain_name.is_some() {
            f.replica
                .peer_tls_domain_name
                .clone_from(&self.peer_tls_domain_name);
        }
        if self.tls_cert.is_some() {
            f.tls.cert_file.clone_from(&self.tls_cert);
        }
        if self.tls_key.is_some() {
            f.tls.key_file.clone_from(&self.tls_key);
        }
        if let Some(t) = &self.handshake_timeout {
            f.handshake_timeout.clone_from(t);
        }
        if let Some(t) = &self.request_body_timeout {
            f.request_body_timeout.clone_from(t);
        }
        if self.remote_tls_ca_file.is_some() {
            f.executors
                .remote
                .tls_ca_file
                .clone_from(&self.remote_tls_ca_file);
        }
        if self.remote_allowed_hosts.is_some() {
            f.executors
                .remote
                .allowed_hosts
                .clone_from(&self.remote_allowed_hosts);
        }
        set(&mut f.limits.max_live_sessions, &self.max_live_sessions);
        set(&mut f.limits.max_watch_streams, &self.max_watch_streams);
        set(
            &mut f.limits.max_watch_streams_per_token,
            &self.max_watch_streams_per_token,
        );
    }
}

/// A certificate and its key: both or neither, each a readable file.
fn pem_pair(
    p: &mut Problems,
    (cert_key, cert): (&str, &Option<PathBuf>),
    (key_key, key): (&str, &Option<PathBuf>),
) -> Option<(PathBuf, PathBuf)> {
    match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => {
            let mut ok = true;
            for (k, path) in [(cert_key, cert), (key_key, key)] {
                if !path.is_file() {
                    p.add(k, format!("{} is not a readable file", path.display()));
                    ok = false;
                }
            }
            ok.then(|| (cert.clone(), key.clone()))
        }
        (Some(_), None) => {
            p.add(key_key, format!("is required with {cert_key}"));
            None
        }
        (None, Some(_)) => {
            p.add(cert_key, format!("is required with {key_key}"));
            None
        }
    }
}

/// What the configuration exposes that an operator may not mean to: a
/// metrics endpoint reachable from other hosts (it has no authentication),
/// and a TLS private key other local users can read. Warnings, not errors:
/// both have legitimate uses (a scraper on another host behind a firewall;
/// a key shared with a group on purpose).
fn exposure_warnings(
    metrics_listen: Option<SocketAddr>,
    tls: Option<&(PathBuf, PathBuf)>,
) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    if let Some(addr) = metrics_listen.filter(|a| !a.ip().is_loopback()) {
        out.push(format!(
            "metrics.listen {addr} is not a loopback address: /metrics, /livez and /readyz \
             answer anyone who reaches it, without authentication (counts of sessions, \
             executors, turns and calls); bind it to 127.0.0.1 or keep it behind a firewall \
             that admits only the scraper"
        ));
    }
    if let Some((_, key)) = tls
        && let Ok(meta) = std::fs::metadata(key)
    {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            out.push(format!(
                "tls.key_file {} has mode {mode:03o}: other local users can read the API's \
                 private key; chmod 600 it (owned by the user sessiond runs as)",
                key.display()
            ));
        }
    }
    out
}

/// Collects validation problems so the user sees all of them at once.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn add(&mut self, key: &str, message: impl std::fmt::Display) {
        self.0.push(format!("{key}: {message}"));
    }

    fn duration(&mut self, key: &str, value: &str) -> Duration {
        match parse_duration(value) {
            Ok(d) => d,
            Err(e) => {
                self.add(key, e);
                Duration::ZERO
            }
        }
    }

    /// `path` made absolute against this process's working directory:
    /// agentctl runs in a session's worktree, where a relative run
    /// directory or program path would name something else.
    fn absolute(&mut self, key: &str, path: PathBuf) -> PathBuf {
        if path.is_absolute() || path.as_os_str().is_empty() {
            return path;
        }
        match std::path::absolute(&path) {
            Ok(absolute) => sessiond_executor::worktree::normalise(&absolute),
            Err(e) => {
                self.add(key, format!("cannot resolve {}: {e}", path.display()));
                path
            }
        }
    }

    fn positive_duration(&mut self, key: &str, value: &str) -> Duration {
        let d = self.duration(key, value);
        if d.is_zero() && parse_duration(value).is_ok() {
            self.add(key, "must be greater than zero");
        }
        d
    }

    fn addr(&mut self, key: &str, value: &str) -> Option<SocketAddr> {
        match value.trim().parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                self.add(
                    key,
                    format!("{value:?} is not an address such as 127.0.0.1:50051"),
                );
                None
            }
        }
    }

    fn non_empty(&mut self, key: &str, value: &str) {
        if value.trim().is_empty() {
            self.add(key, "must not be empty");
        }
    }
}

/// The dotted key whose `key = value` line holds byte `at` of `text` (or,
/// inside a value spread over lines, the nearest such line above it),
/// under the last `[table]` or `[[array]]` header before it.
fn key_at(text: &str, at: usize) -> Option<String> {
    let before = text.get(..at)?;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    let lines = text[..line_end].lines().rev();
    let mut key = None;
    for line in lines {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[') {
            let table = header.trim_start_matches('[').split(']').next()?.trim();
            return key.map(|k: String| format!("{table}.{k}"));
        }
        if key.is_none()
            && let Some((k, _)) = line.split_once('=')
        {
            let k = k.trim().replace('"', "");
            if !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-. ".contains(c))
            {
                key = Some(k.replace(' ', ""));
            }
        }
    }
    key
}

impl FileConfig {
    /// Reads and parses a TOML file ([`FileConfig::parse`]); errors name the file.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("config: cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Parses TOML text; every missing key takes its default, an unknown
    /// key is an error naming it.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        toml::from_str(text).map_err(|e| {
            // toml shows the line; a value of the wrong type is also named
            // by its dotted key, as `validate`'s errors are.
            match e.span().and_then(|at| key_at(text, at.start)) {
                Some(key) => anyhow::anyhow!("{key}: {e}"),
                None => anyhow::anyhow!("{e}"),
            }
        })
    }

    /// Checks every key and resolves defaults that depend on the machine
    /// (data directory, agentctl path); the error lists every problem, each
    /// with its dotted key. Requires `auth.tokens` (or `insecure_no_auth`),
    /// as [`crate::serve`] does.
    pub fn validate(self) -> anyhow::Result<Config> {
        self.validate_inner(true)
    }

    /// As [`FileConfig::validate`], for an embedder that puts its own
    /// authentication around [`crate::Services`]: `auth.tokens` may be
    /// empty (they are used only by [`crate::serve`]).
    pub fn validate_for_embedding(self) -> anyhow::Result<Config> {
        self.validate_inner(false)
    }

    fn validate_inner(self, serves_api: bool) -> anyhow::Result<Config> {
        let mut p = Problems::default();

        let data_dir = match self.data_dir {
            Some(dir) if dir.as_os_str().is_empty() => {
                p.add("data_dir", "must not be empty");
                PathBuf::new()
            }
            Some(dir) => dir,
            None => default_data_dir().unwrap_or_else(|| {
                p.add(
                    "data_dir",
                    "cannot derive a default (neither XDG_DATA_HOME nor HOME is set); \
                     pass --data-dir or set SESSIOND_DATA_DIR",
                );
                PathBuf::new()
            }),
        };
        let data_dir = p.absolute("data_dir", data_dir);
        let database_url = match self.database_url {
            Some(url) if url.trim().is_empty() => {
                p.add(
                    "database_url",
                    "must not be empty; unset it to use the embedded SQLite default",
                );
                String::new()
            }
            Some(url) => {
                // Refused here, before a lock file or a SQLite file is made
                // from a mistyped URL (helper-50 3: `postgres//host/db`
                // served on a new, empty SQLite file of that name).
                match sessiond_store::parse_database_url(&url) {
                    Err(e) => p.add("database_url", e.to_string()),
                    Ok((sessiond_store::Backend::Sqlite, target))
                        if ["postgres:", "postgresql:", "postgres//", "postgresql//"]
                            .iter()
                            .any(|start| target.to_ascii_lowercase().starts_with(start)) =>
                    {
                        p.add(
                            "database_url",
                            format!(
                                "{target:?} is neither a PostgreSQL URL \
                                 (postgres://USER@HOST:PORT/DATABASE) nor a SQLite path"
                            ),
                        );
                    }
                    Ok(_) => {}
                }
                url
            }
            None => data_dir.join("sessiond.sqlite3").display().to_string(),
        };
        let listen = p.addr("listen", &self.listen);
        if self.max_message_bytes == 0 {
            p.add("max_message_bytes", "must be greater than zero");
        }
        let shutdown_grace = p.duration("shutdown_grace", &self.shutdown_grace);

        let auth = auth_config(&self.auth, listen, serves_api, &mut p);

        let cors = cors_config(&self.cors, self.auth.insecure_no_auth, &mut p);

        let metrics_listen = match self.metrics.listen.trim() {
            "" | "off" | "none" | "disabled" => None,
            other => p.addr("metrics.listen", other),
        };
        if self.metrics.max_connections == 0 {
            p.add("metrics.max_connections", "must be at least 1");
        }
        let metrics_idle_timeout = p.duration("metrics.idle_timeout", &self.metrics.idle_timeout);
        if metrics_idle_timeout.is_zero() {
            p.add("metrics.idle_timeout", "must be longer than 0s");
        }

        let (otlp_endpoint, trace_sample_ratio) = traces_config(&self.traces, &mut p);

        let executors = executors_config(&self.executors, &data_dir, &mut p);

        let recovery = recovery_config(&self.recovery, &mut p);

        let limits = limits_config(&self.limits, &mut p);

        let tls = pem_pair(
            &mut p,
            ("tls.cert_file", &self.tls.cert_file),
            ("tls.key_file", &self.tls.key_file),
        );
        let handshake_timeout = p.positive_duration("handshake_timeout", &self.handshake_timeout);
        let request_body_timeout =
            p.positive_duration("request_body_timeout", &self.request_body_timeout);

        let replica = replica_config(&self.replica, &mut p);
        let agents = agent_profiles(&self.agents, &data_dir, &mut p);
        let mcp_secrets = read_mcp_secrets(&agents, &mut p);
        if !agents.iter().any(|a| a.name == self.default_agent) {
            p.add(
                "default_agent",
                format!(
                    "{:?} names no agent profile (have: {})",
                    self.default_agent,
                    agents
                        .iter()
                        .map(|a| a.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }

        if !p.0.is_empty() {
            bail!("invalid configuration:\n  {}", p.0.join("\n  "));
        }
        let warnings = exposure_warnings(metrics_listen, tls.as_ref());
        Ok(Config {
            data_dir,
            database_url,
            listen: listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 50051))),
            max_message_bytes: usize::try_from(self.max_message_bytes).unwrap_or(usize::MAX),
            log_json: self.log_json,
            shutdown_grace,
            auth,
            cors,
            metrics_listen,
            metrics_max_connections: self.metrics.max_connections as usize,
            metrics_idle_timeout,
            otlp_endpoint,
            trace_sample_ratio,
            executors,
            recovery,
            limits,
            tls,
            handshake_timeout,
            request_body_timeout,
            replica,
            agents,
            mcp_secrets,
            default_agent: self.default_agent,
            warnings,
        })
    }
}

/// The `auth` section: tokens from the file, the environment and flags,
/// or none on loopback only.
fn auth_config(
    a: &AuthSection,
    listen: Option<SocketAddr>,
    serves_api: bool,
    p: &mut Problems,
) -> AuthConfig {
    let mut tokens: Vec<String> = a.tokens.iter().map(|t| t.trim().to_owned()).collect();
    if let Some(path) = &a.tokens_file {
        match std::fs::read_to_string(path) {
            Ok(text) => tokens.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_owned),
            ),
            Err(e) => p.add(
                "auth.tokens_file",
                format!("cannot read {}: {e}", path.display()),
            ),
        }
    }
    tokens.retain(|t| !t.is_empty());
    for (i, token) in tokens.iter().enumerate() {
        if token.len() < 16 {
            p.add(
                &format!("auth.tokens[{i}]"),
                "must be at least 16 characters",
            );
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            p.add(
                &format!("auth.tokens[{i}]"),
                "must be printable ASCII without spaces",
            );
        }
    }
    if a.insecure_no_auth {
        if !tokens.is_empty() {
            p.add(
                "auth.insecure_no_auth",
                format!(
                    "conflicts with auth.tokens ({} configured, from auth.tokens, \
                     auth.tokens_file, --api-tokens or SESSIOND_API_TOKENS): \
                     remove the tokens to serve without authentication, or drop \
                     insecure_no_auth",
                    tokens.len()
                ),
            );
        }
        if let Some(addr) = listen
            && !addr.ip().is_loopback()
        {
            p.add(
                "auth.insecure_no_auth",
                format!(
                    "refuses to serve without authentication on the non-loopback \
                     address {addr}; configure auth.tokens or listen on 127.0.0.1"
                ),
            );
        }
        AuthConfig::Disabled
    } else {
        if tokens.is_empty() && serves_api {
            p.add(
                "auth.tokens",
                "no API token configured: set SESSIOND_API_TOKENS (or auth.tokens), \
                 or pass --insecure-no-auth to serve on loopback without authentication",
            );
        }
        AuthConfig::Tokens(tokens)
    }
}

/// The `cors` section.
fn cors_config(c: &CorsSection, insecure_no_auth: bool, p: &mut Problems) -> CorsConfig {
    let mut origins = Vec::new();
    let mut any_origin = false;
    for (i, origin) in c.allowed_origins.iter().enumerate() {
        let origin = origin.trim();
        if origin == "*" {
            any_origin = true;
        } else if http::HeaderValue::from_str(origin).is_err()
            || !(origin.starts_with("http://") || origin.starts_with("https://"))
            || origin.trim_end_matches('/') != origin
        {
            p.add(
                &format!("cors.allowed_origins[{i}]"),
                format!(
                    "{origin:?} is not an origin such as https://app.example.com \
                     (scheme and host, no path)"
                ),
            );
        } else {
            origins.push(origin.to_owned());
        }
    }
    if any_origin && insecure_no_auth {
        p.add(
            "cors.allowed_origins",
            "\"*\" is refused together with auth.insecure_no_auth: any web page the \
             user visits could drive the API; list the origins of your web console",
        );
    }
    CorsConfig {
        allowed_origins: if any_origin {
            AllowedOrigins::Any
        } else if origins.is_empty() {
            AllowedOrigins::None
        } else {
            AllowedOrigins::List(origins)
        },
        max_age: p.duration("cors.max_age", &c.max_age),
    }
}

/// The `traces` section: the OTLP endpoint (none when off) and the
/// sample ratio.
fn traces_config(t: &TracesSection, p: &mut Problems) -> (Option<String>, f64) {
    let otlp_endpoint = match t.otlp_endpoint.trim() {
        "" | "off" | "none" | "disabled" => None,
        url if url.starts_with("http://")
            && url.len() > "http://".len()
            && http::Uri::try_from(url).is_ok() =>
        {
            Some(url.to_owned())
        }
        url if url.starts_with("https://") => {
            p.add(
                "traces.otlp_endpoint",
                format!(
                    "{url:?}: TLS to the collector is not built in; export to a collector \
                     (or agent) on a trusted network with http://host:4317"
                ),
            );
            None
        }
        url => {
            p.add(
                "traces.otlp_endpoint",
                format!(
                    "{url:?} is not an OTLP/gRPC address such as http://127.0.0.1:4317 \
                     (or off)"
                ),
            );
            None
        }
    };
    let trace_sample_ratio = t.sample_ratio;
    if !(0.0..=1.0).contains(&trace_sample_ratio) {
        p.add(
            "traces.sample_ratio",
            format!("{trace_sample_ratio} is not a fraction between 0 and 1"),
        );
    }
    (otlp_endpoint, trace_sample_ratio)
}

/// The `executors` section: runtimes, worktree roots and directories,
/// Docker and remote hosts.
fn executors_config(e: &ExecutorsSection, data_dir: &Path, p: &mut Problems) -> ExecutorsConfig {
    let default_runtime = match Runtime::parse(e.default_runtime.trim()) {
        Ok(r) => r,
        Err(err) => {
            p.add("executors.default_runtime", err);
            Runtime::LocalStandalone
        }
    };
    if default_runtime == Runtime::LocalDocker && !e.docker.enabled {
        p.add(
            "executors.default_runtime",
            "is local_docker but executors.docker.enabled is false",
        );
    }
    let agentctl_path = match &e.standalone.agentctl_path {
        Some(path) if path.as_os_str().is_empty() => {
            p.add("executors.standalone.agentctl_path", "must not be empty");
            PathBuf::new()
        }
        // A bare name is looked up on PATH; anything else is a path.
        Some(path) if path.components().count() > 1 => {
            p.absolute("executors.standalone.agentctl_path", path.clone())
        }
        Some(path) => path.clone(),
        None => sessiond_executor::standalone::default_agentctl_path()
            .unwrap_or_else(|| PathBuf::from("agentctl")),
    };
    let idle = p.duration("executors.idle_timeout", &e.idle_timeout);
    let worktree_roots = match &e.worktree_roots {
        Some(roots) => roots.clone(),
        None => match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            Some(home) => vec![PathBuf::from(home)],
            None => {
                p.add(
                    "executors.worktree_roots",
                    "cannot default to the home directory (HOME is not set); \
                     set SESSIOND_WORKTREE_ROOTS",
                );
                Vec::new()
            }
        },
    };
    for (i, root) in worktree_roots.iter().enumerate() {
        let key = format!("executors.worktree_roots[{i}]");
        if !root.is_absolute() {
            p.add(&key, format!("{} is not an absolute path", root.display()));
        } else if root.parent().is_none() {
            p.add(
                &key,
                "\"/\" is refused: it would let sessions use any directory, /etc included",
            );
        } else if root.components().any(|c| {
            !matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        }) {
            p.add(
                &key,
                format!("{} is not normalised (no . or ..)", root.display()),
            );
        }
    }
    let normal = |d: &Path| {
        d.is_absolute()
            && d.components().all(|c| {
                matches!(
                    c,
                    std::path::Component::RootDir | std::path::Component::Normal(_)
                )
            })
    };
    let listed_roots = || {
        worktree_roots
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let check_worktrees_dir = |p: &mut Problems, key: &str, dir: &Path| {
        let resolved = sessiond_executor::worktree::resolved_path(dir);
        let inside_roots = |d: &Path| {
            worktree_roots.iter().any(|r| {
                d.starts_with(r) || std::fs::canonicalize(r).is_ok_and(|c| d.starts_with(c))
            })
        };
        if !normal(dir) {
            p.add(
                key,
                format!("{} is not an absolute, normalised path", dir.display()),
            );
        } else if worktree_roots.iter().any(|r| dir.starts_with(r)) && !inside_roots(&resolved) {
            // A symlink on the way leads out of the roots (helper-38 2).
            p.add(
                key,
                format!(
                    "{} resolves to {} (through a symlink), outside executors.worktree_roots ({}); \
                     name a directory inside one",
                    dir.display(),
                    resolved.display(),
                    listed_roots()
                ),
            );
        } else if !worktree_roots.iter().any(|r| dir.starts_with(r)) {
            p.add(
                    key,
                    format!(
                        "{} is outside executors.worktree_roots ({}); move it inside one, or add a root",
                        dir.display(),
                        listed_roots()
                    ),
                );
        }
    };
    let worktrees_dir = match &e.worktrees_dir {
        Some(dir) => {
            check_worktrees_dir(p, "executors.worktrees_dir", dir);
            Some(dir.clone())
        }
        None => Some(data_dir.join("worktrees"))
            .filter(|d| normal(d) && worktree_roots.iter().any(|r| d.starts_with(r))),
    };
    for (i, repo) in e.repositories.iter().enumerate() {
        let key = format!("executors.repositories[{i}]");
        if !normal(repo) {
            p.add(
                &key,
                format!("{} is not an absolute, normalised path", repo.display()),
            );
        } else if !worktree_roots.iter().any(|r| repo.starts_with(r)) {
            p.add(
                &key,
                format!(
                    "{} is outside executors.worktree_roots; sessions could not be created from it",
                    repo.display()
                ),
            );
        }
    }
    let prefix = e.worktree_branch_prefix.trim_matches('/');
    if prefix.is_empty()
        || prefix.starts_with('-')
        || prefix.contains("..")
        || prefix.contains("//")
        || prefix
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\@{".contains(c))
    {
        p.add(
            "executors.worktree_branch_prefix",
            format!(
                "{:?} is not usable in a branch name (letters, digits, - _ . /)",
                e.worktree_branch_prefix
            ),
        );
    }
    let docker = if e.docker.enabled {
        let d = &e.docker;
        p.non_empty("executors.docker.host", &d.host);
        if !d.host.trim().is_empty()
            && !["unix://", "tcp://", "http://"]
                .iter()
                .any(|s| d.host.starts_with(s))
        {
            p.add(
                "executors.docker.host",
                "must start with unix://, tcp:// or http://",
            );
        }
        p.non_empty("executors.docker.image", &d.image);
        p.non_empty("executors.docker.agentctl_path", &d.agentctl_path);
        p.non_empty("executors.docker.network_mode", &d.network_mode);
        let mode = d.network_mode.trim();
        if mode == "host" || mode.starts_with("container:") {
            p.add(
                "executors.docker.network_mode",
                format!(
                    "{mode:?} would put agent containers in another network namespace (the host's \
                     sees every session's and sessiond's loopback traffic); use \"none\" (agentctl \
                     needs no network), \"bridge\" or a user-defined network"
                ),
            );
        }
        if let Some(user) = &d.user {
            let name = user.split(':').next().unwrap_or_default().trim();
            if name == "0" || name == "root" {
                p.add(
                    "executors.docker.user",
                    "containers never run as root; give a non-root uid:gid, or leave it unset \
                     to run as the worktree's owner",
                );
            }
        }
        if let Some(m) = d.memory_bytes
            && m < 4 * 1024 * 1024
        {
            p.add(
                "executors.docker.memory_bytes",
                "must be at least 4194304 (4 MiB)",
            );
        }
        if let Some(c) = d.cpus
            && !(c > 0.0 && c.is_finite())
        {
            p.add("executors.docker.cpus", "must be greater than zero");
        }
        if let Some(n) = d.pids_limit
            && n < 1
        {
            p.add("executors.docker.pids_limit", "must be at least 1");
        }
        if let Some(dir) = &d.worktrees_dir {
            check_worktrees_dir(p, "executors.docker.worktrees_dir", dir);
        }
        Some(DockerConfig {
            worktrees_dir: d.worktrees_dir.clone().or_else(|| worktrees_dir.clone()),
            host: d.host.clone(),
            image: d.image.clone(),
            agentctl_path: d.agentctl_path.clone(),
            network_mode: d.network_mode.clone(),
            user: d.user.clone().filter(|u| !u.is_empty()),
            memory_bytes: d.memory_bytes,
            nano_cpus: d.cpus.map(|c| (c * 1e9) as i64),
            pids_limit: d.pids_limit,
            startup_timeout: p
                .positive_duration("executors.docker.startup_timeout", &d.startup_timeout),
        })
    } else {
        None
    };
    if let Some(ca) = &e.remote.tls_ca_file
        && !ca.is_file()
    {
        p.add(
            "executors.remote.tls_ca_file",
            format!("{} is not a readable file", ca.display()),
        );
    }
    let remote_tls_client_identity = pem_pair(
        p,
        (
            "executors.remote.tls_client_cert_file",
            &e.remote.tls_client_cert_file,
        ),
        (
            "executors.remote.tls_client_key_file",
            &e.remote.tls_client_key_file,
        ),
    );
    if remote_tls_client_identity.is_some() && e.remote.tls_ca_file.is_none() {
        p.add(
            "executors.remote.tls_client_cert_file",
            "needs executors.remote.tls_ca_file (client certificates are sent over https only)",
        );
    }
    let allowed_hosts: Vec<String> = match &e.remote.allowed_hosts {
        Some(list) => list.clone(),
        None => crate::limits::DEFAULT_ALLOWED_HOSTS
            .iter()
            .map(|h| (*h).to_owned())
            .collect(),
    };
    let remote_allowed_hosts =
        crate::limits::AllowedHosts::parse(&allowed_hosts).unwrap_or_else(|(i, why)| {
            p.add(&format!("executors.remote.allowed_hosts[{i}]"), why);
            crate::limits::AllowedHosts::default()
        });
    // On the remote hosts: their agentctls confine it to their roots.
    if let Some(dir) = &e.remote.worktrees_dir
        && !normal(dir)
    {
        p.add(
            "executors.remote.worktrees_dir",
            format!("{} is not an absolute, normalised path", dir.display()),
        );
    }
    ExecutorsConfig {
        default_runtime,
        connect_timeout: p.positive_duration("executors.connect_timeout", &e.connect_timeout),
        call_timeout: p.positive_duration("executors.call_timeout", &e.call_timeout),
        // Passed to agentctl as is: `0s` must reach it as "never", not
        // fall back to agentctl's own default.
        idle_timeout: Some(idle),
        worktree_roots,
        worktrees_dir,
        worktree_branch_prefix: prefix.to_owned(),
        repositories: e.repositories.clone(),
        agentctl_path,
        run_dir: match &e.standalone.run_dir {
            Some(dir) => p.absolute("executors.standalone.run_dir", dir.clone()),
            None => data_dir.join("run"),
        },
        log_dir: match &e.standalone.log_dir {
            Some(dir) => p.absolute("executors.standalone.log_dir", dir.clone()),
            None => data_dir.join("logs"),
        },
        standalone_startup_timeout: p.positive_duration(
            "executors.standalone.startup_timeout",
            &e.standalone.startup_timeout,
        ),
        docker,
        remote_tls_ca_file: e.remote.tls_ca_file.clone(),
        remote_tls_domain_name: e.remote.tls_domain_name.clone(),
        remote_tls_client_identity,
        remote_allowed_hosts,
        remote_worktrees_dir: e.remote.worktrees_dir.clone(),
    }
}

/// The `recovery` section.
fn recovery_config(r: &RecoverySection, p: &mut Problems) -> RecoveryConfig {
    let policy = match ResumePolicy::parse(r.mode.trim()) {
        Ok(policy) => policy,
        Err(_) => {
            p.add(
                "recovery.mode",
                format!("{:?} is not one of: startup, on_demand", r.mode),
            );
            ResumePolicy::Startup
        }
    };
    if r.concurrency == 0 || r.concurrency > 1024 {
        p.add("recovery.concurrency", "must be between 1 and 1024");
    }
    if r.max_attempts == 0 || r.max_attempts > 100 {
        p.add("recovery.max_attempts", "must be between 1 and 100");
    }
    if r.agent_restarts > 100 {
        p.add("recovery.agent_restarts", "must be between 0 and 100");
    }
    if r.launch_concurrency > 1024 {
        p.add(
            "recovery.launch_concurrency",
            "must be between 0 (the core count) and 1024",
        );
    }
    if r.launch_concurrency_max > 4096 {
        p.add(
            "recovery.launch_concurrency_max",
            "must be between 0 and 4096",
        );
    } else if r.launch_concurrency_max != 0 && r.launch_concurrency_max < r.launch_concurrency {
        p.add(
            "recovery.launch_concurrency_max",
            "must not be less than recovery.launch_concurrency",
        );
    }
    let recovery = RecoveryConfig {
        policy,
        concurrency: r.concurrency.clamp(1, 1024) as usize,
        executor_deadline: p.positive_duration("recovery.executor_deadline", &r.executor_deadline),
        resume_cap: p.positive_duration("recovery.resume_cap", &r.resume_cap),
        max_attempts: r.max_attempts.clamp(1, 100),
        retry_backoff_initial: p
            .positive_duration("recovery.retry_backoff_initial", &r.retry_backoff_initial),
        retry_backoff_max: p.positive_duration("recovery.retry_backoff_max", &r.retry_backoff_max),
        agent_restarts: r.agent_restarts.min(100),
        cancel_grace: {
            let grace = p.positive_duration("recovery.cancel_grace", &r.cancel_grace);
            if grace < Duration::from_secs(1) && !grace.is_zero() {
                p.add(
                    "recovery.cancel_grace",
                    "must be at least 1s: an agent needs time to end a cancelled turn",
                );
            }
            grace
        },
        launch_concurrency: r.launch_concurrency.min(1024) as usize,
        launch_concurrency_max: r.launch_concurrency_max.min(4096) as usize,
        remote_backoff_initial: p
            .positive_duration("recovery.remote_backoff_initial", &r.remote_backoff_initial),
        remote_backoff_max: p
            .positive_duration("recovery.remote_backoff_max", &r.remote_backoff_max),
        remote_backoff_window: p
            .duration("recovery.remote_backoff_window", &r.remote_backoff_window),
        orphan_sweep_grace: p.duration("recovery.orphan_sweep_grace", &r.orphan_sweep_grace),
        orphan_sweep_interval: p
            .positive_duration("recovery.orphan_sweep_interval", &r.orphan_sweep_interval),
    };
    if recovery.remote_backoff_max < recovery.remote_backoff_initial {
        p.add(
            "recovery.remote_backoff_max",
            "must not be less than recovery.remote_backoff_initial",
        );
    }
    recovery
}

/// The `limits` section.
fn limits_config(l: &LimitsSection, p: &mut Problems) -> LimitsConfig {
    for (key, value) in [
        ("limits.max_live_sessions", l.max_live_sessions),
        ("limits.max_watch_streams", l.max_watch_streams),
        (
            "limits.max_watch_streams_per_token",
            l.max_watch_streams_per_token,
        ),
    ] {
        if value == 0 {
            p.add(key, "must be at least 1");
        }
    }
    if l.max_watch_streams_per_token > l.max_watch_streams {
        p.add(
            "limits.max_watch_streams_per_token",
            "must not be more than limits.max_watch_streams",
        );
    }
    LimitsConfig {
        max_live_sessions: l.max_live_sessions as usize,
        max_watch_streams: l.max_watch_streams as usize,
        max_watch_streams_per_token: l.max_watch_streams_per_token as usize,
    }
}

/// `[replica]`: an id others can tell apart and put in logs and
/// metadata, an address of the form host:port (https:// allowed in front),
/// a TTL of at least a second (heartbeats run every third of it), a peer
/// CA file holding a PEM certificate.
fn replica_config(r: &ReplicaSection, p: &mut Problems) -> ReplicaConfig {
    let id = r.id.as_ref().map(|id| id.trim().to_owned());
    if let Some(id) = &id
        && let Err(e) = check_replica_id(id)
    {
        p.add("replica.id", e);
    }
    let advertise_address = r
        .advertise_address
        .as_ref()
        .map(|a| a.trim().to_owned())
        .filter(|a| !a.is_empty());
    if let Some(a) = &advertise_address
        && a.strip_prefix("https://")
            .unwrap_or(a)
            .rsplit_once(':')
            .is_none_or(|(host, port)| {
                host.is_empty() || host.contains('/') || port.parse::<u16>().is_err()
            })
    {
        p.add(
            "replica.advertise_address",
            format!("{a:?} is not host:port or https://host:port"),
        );
    }
    if let Some(ca) = &r.peer_tls_ca_file {
        match std::fs::read(ca) {
            Err(e) => p.add(
                "replica.peer_tls_ca_file",
                format!("cannot read {}: {e}", ca.display()),
            ),
            Ok(pem) if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") => p.add(
                "replica.peer_tls_ca_file",
                format!("{} holds no PEM certificate", ca.display()),
            ),
            Ok(_) => {}
        }
    }
    let peer_tls_domain_name = r
        .peer_tls_domain_name
        .as_ref()
        .map(|d| d.trim().to_owned())
        .filter(|d| !d.is_empty());
    if peer_tls_domain_name.is_some() && r.peer_tls_ca_file.is_none() {
        p.add(
            "replica.peer_tls_domain_name",
            "needs replica.peer_tls_ca_file",
        );
    }
    let lease_ttl = p.duration("replica.lease_ttl", &r.lease_ttl);
    if lease_ttl < Duration::from_secs(1) {
        p.add("replica.lease_ttl", "must be at least 1s");
    }
    ReplicaConfig {
        id,
        advertise_address,
        lease_ttl,
        peer_tls_ca_file: r.peer_tls_ca_file.clone(),
        peer_tls_domain_name,
    }
}

/// A replica id: 1 to 64 of `A-Z a-z 0-9 . _ -`.
pub fn check_replica_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{c:?} is not allowed (letters, digits, '.', '_', '-')"
        ));
    }
    Ok(())
}

/// The built-in demo profile, then the file's profiles (one named `demo`
/// replaces the built-in one).
fn secret_of(key: &str, v: &SecretSection, p: &mut Problems) -> sessiond_domain::SecretValue {
    use sessiond_domain::SecretValue;
    match v {
        SecretSection::Plain(s) => SecretValue::Plain(s.clone()),
        SecretSection::Ref {
            env: Some(var),
            file: None,
        } if !var.trim().is_empty() => SecretValue::Env(var.clone()),
        SecretSection::Ref {
            env: None,
            file: Some(path),
        } if !path.trim().is_empty() => SecretValue::File(path.clone()),
        SecretSection::Ref { .. } => {
            p.add(
                key,
                "give a string, or exactly one of { env = \"VAR\" } and { file = \"PATH\" }",
            );
            SecretValue::Plain(String::new())
        }
    }
}

fn mcp_servers(
    profile: &str,
    sections: &[McpSection],
    p: &mut Problems,
) -> Vec<sessiond_domain::McpServer> {
    use sessiond_domain::{McpServer, McpTransport};
    let mut out = Vec::new();
    for (i, m) in sections.iter().enumerate() {
        let key = format!("{profile}.mcp_servers[{i}]");
        if m.name.trim().is_empty() {
            p.add(&format!("{key}.name"), "must not be empty");
        }
        if sections[..i].iter().any(|o| o.name == m.name) {
            p.add(
                &format!("{key}.name"),
                format!("{:?} is used by an earlier server", m.name),
            );
        }
        let map = |field: &str, values: &BTreeMap<String, SecretSection>, p: &mut Problems| {
            values
                .iter()
                .map(|(k, v)| (k.clone(), secret_of(&format!("{key}.{field}.{k}"), v, p)))
                .collect::<BTreeMap<_, _>>()
        };
        let kind = m.kind.as_deref().unwrap_or("stdio");
        let transport = match kind {
            "stdio" => {
                let command = m.command.clone().unwrap_or_default();
                if command.trim().is_empty() {
                    p.add(
                        &format!("{key}.command"),
                        "a stdio server needs its command",
                    );
                }
                if m.url.is_some() || !m.headers.is_empty() {
                    p.add(
                        &format!("{key}.url"),
                        "url and headers are for http and sse servers",
                    );
                }
                McpTransport::Stdio {
                    command,
                    args: m.args.clone(),
                    env: map("env", &m.env, p),
                }
            }
            "http" | "sse" => {
                let url = m.url.clone().unwrap_or_default();
                if let Some(problem) = sessiond_domain::http_url_problem(&url) {
                    p.add(
                        &format!("{key}.url"),
                        format!("{url:?}: {problem}; an http:// or https:// URL with a host"),
                    );
                }
                if m.command.is_some() || !m.args.is_empty() || !m.env.is_empty() {
                    p.add(
                        &format!("{key}.command"),
                        "command, args and env are for stdio servers",
                    );
                }
                let headers = map("headers", &m.headers, p);
                if kind == "http" {
                    McpTransport::Http { url, headers }
                } else {
                    McpTransport::Sse { url, headers }
                }
            }
            other => {
                p.add(
                    &format!("{key}.type"),
                    format!("{other:?}: stdio, http or sse"),
                );
                continue;
            }
        };
        out.push(McpServer {
            name: m.name.clone(),
            transport,
        });
    }
    out
}

/// Reads every secret the profiles' MCP servers name (sessiond's
/// environment, files), so a missing one fails the start, naming it; the
/// values stay in memory.
fn read_mcp_secrets(agents: &[AgentConfig], p: &mut Problems) -> sessiond_domain::Secrets {
    use sessiond_domain::{McpTransport, SecretValue};
    let mut secrets = sessiond_domain::Secrets::default();
    for (i, a) in agents.iter().enumerate() {
        for s in &a.mcp_servers {
            let values = match &s.transport {
                McpTransport::Stdio { env, .. } => env,
                McpTransport::Http { headers, .. } | McpTransport::Sse { headers, .. } => headers,
            };
            for (k, v) in values {
                let key = format!("agent {:?} ({i}).mcp_servers {:?}.{k}", a.name, s.name);
                match v {
                    SecretValue::Plain(_) => {}
                    SecretValue::Env(var) => match std::env::var(var) {
                        Ok(value) => secrets.insert(v.clone(), value),
                        Err(_) => p.add(&key, format!("the environment variable {var} is not set")),
                    },
                    SecretValue::File(path) => match std::fs::read_to_string(path) {
                        Ok(text) => secrets.insert(
                            v.clone(),
                            text.strip_suffix('\n').unwrap_or(&text).to_owned(),
                        ),
                        Err(e) => p.add(&key, format!("cannot read {path}: {e}")),
                    },
                }
            }
        }
    }
    secrets
}

fn agent_profiles(
    sections: &[AgentSection],
    data_dir: &Path,
    p: &mut Problems,
) -> Vec<AgentConfig> {
    let mut agents = vec![demo_profile(data_dir)];
    for (i, a) in sections.iter().enumerate() {
        let key = format!("agents[{i}]");
        if a.name.trim().is_empty() {
            p.add(&format!("{key}.name"), "must not be empty");
        }
        if a.command.trim().is_empty() {
            p.add(&format!("{key}.command"), "must not be empty");
        }
        if sections[..i].iter().any(|b| b.name == a.name) {
            p.add(
                &format!("{key}.name"),
                format!("{:?} is used by an earlier profile", a.name),
            );
        } else if let Some(other) = std::iter::once(DEMO_PROFILE)
            .chain(sections[..i].iter().map(|b| b.name.as_str()))
            .find(|b| *b != a.name && b.eq_ignore_ascii_case(&a.name))
        {
            // `--agent x` picking `X`'s agent (or no agent) is a mistake
            // waiting to happen: names must differ in more than case.
            p.add(
                &format!("{key}.name"),
                format!(
                    "{:?} differs from profile {other:?} only in case; give it a name of its own",
                    a.name
                ),
            );
        }
        if let Some(c) = &a.container {
            if c.command.trim().is_empty() {
                p.add(&format!("{key}.container.command"), "must not be empty");
            }
            if c.image.as_deref().is_some_and(|i| i.trim().is_empty()) {
                p.add(
                    &format!("{key}.container.image"),
                    "must not be empty (leave it out for executors.docker.image)",
                );
            }
        }
        if let Some(m) = &a.auth_method
            && m.trim().is_empty()
        {
            p.add(
                &format!("{key}.auth_method"),
                "must not be empty (remove it for an agent that needs no authenticate)",
            );
        }
        let permission_policy = match a.permission_policy.as_deref().map(str::trim) {
            None => PermissionPolicy::Allow,
            Some(v) => PermissionPolicy::parse(v).unwrap_or_else(|e| {
                p.add(&format!("{key}.permission_policy"), e);
                PermissionPolicy::Allow
            }),
        };
        let permission_timeout = match a.permission_timeout.as_deref() {
            None => sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
            Some(v) => p.positive_duration(&format!("{key}.permission_timeout"), v),
        };
        for (id, value) in &a.config {
            if id.trim().is_empty() || value.trim().is_empty() {
                p.add(
                    &format!("{key}.config"),
                    "option ids and values must not be empty",
                );
            }
        }
        let profile = AgentConfig {
            name: a.name.clone(),
            command: a.command.clone(),
            args: a.args.clone(),
            env: a.env.clone(),
            supports_session_resume: a.supports_session_resume,
            container: a.container.as_ref().map(|c| ContainerAgent {
                image: c.image.clone(),
                command: c.command.clone(),
                args: c.args.clone(),
                env: c.env.clone(),
            }),
            auth_method: a.auth_method.clone().filter(|m| !m.trim().is_empty()),
            permission_policy,
            permission_timeout,
            config_defaults: a.config.clone(),
            mcp_servers: mcp_servers(&key, &a.mcp_servers, p),
        };
        match agents.iter_mut().find(|b| b.name == a.name) {
            Some(existing) => *existing = profile,
            None => agents.push(profile),
        }
    }
    agents
}

/// `acp-demo-agent` (next to this executable, else on PATH), keeping its
/// transcripts in the data directory so `session/load` works after restarts.
/// In a container it is the image's `/usr/local/bin/acp-demo-agent` (the
/// `Dockerfile` and `cargo xtask docker-image` put it there), keeping its
/// transcripts in the agent's `HOME` in the run directory, which outlives
/// container restarts.
pub fn demo_profile(data_dir: &Path) -> AgentConfig {
    let command = beside_current_exe("acp-demo-agent")
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "acp-demo-agent".into());
    AgentConfig {
        name: DEMO_PROFILE.into(),
        command,
        args: Vec::new(),
        env: BTreeMap::from([(
            "ACP_DEMO_STATE_DIR".to_owned(),
            data_dir.join("acp-demo-agent").display().to_string(),
        )]),
        supports_session_resume: true,
        container: Some(ContainerAgent {
            image: None,
            command: "/usr/local/bin/acp-demo-agent".into(),
            args: Vec::new(),
            env: BTreeMap::from([(
                "ACP_DEMO_STATE_DIR".to_owned(),
                format!(
                    "{}/acp-demo-agent",
                    sessiond_executor::docker::CONTAINER_HOME
                ),
            )]),
        }),
        auth_method: None,
        permission_policy: PermissionPolicy::Allow,
        permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
        config_defaults: BTreeMap::new(),
        mcp_servers: Vec::new(),
    }
}

fn beside_current_exe(name: &str) -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.parent()?.join(name);
    beside.is_file().then_some(beside)
}

fn default_data_dir() -> Option<PathBuf> {
    if let Some(xdg) = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(xdg).join("sessiond"));
    }
    let home = std::env::var_os("HOME").filter(|v| !v.is_empty())?;
    Some(PathBuf::from(home).join(".local/share/sessiond"))
}

/// `250ms`, `5s`, `2m`, `1h`, or a bare number of seconds.
pub fn parse_duration(value: &str) -> Result<Duration, String> {
    let v = value.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{value:?} is not a duration such as 250ms, 5s, 2m or 1h"))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => {
            return Err(format!("{value:?} has an unknown unit; use ms, s, m or h"));
        }
    };
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(format!("{value:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn with_tokens() -> FileConfig {
        let mut f = FileConfig {
            data_dir: Some("/tmp/sessiond-test".into()),
            ..FileConfig::default()
        };
        f.auth.tokens = vec!["0123456789abcdef0123".into()];
        f
    }

    fn error_of(f: FileConfig) -> String {
        format!("{:#}", f.validate().unwrap_err())
    }

    #[test]
    fn defaults_validate_once_a_token_is_set() {
        let c = with_tokens().validate().unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:50051");
        assert_eq!(
            c.database_url,
            "/tmp/sessiond-test/sessiond.sqlite3".to_owned()
        );
        assert_eq!(c.metrics_listen.unwrap().port(), 9464);
        assert_eq!(c.recovery.concurrency, 64);
        assert_eq!(c.recovery.executor_deadline, Duration::from_secs(5));
        assert_eq!(c.agents[0].name, DEMO_PROFILE);
        assert!(c.executors.docker.is_none());
        assert_eq!(c.cors.allowed_origins, AllowedOrigins::None);
    }

    #[test]
    fn peer_tls_settings_are_checked_and_tls_replicas_advertise_https() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = with_tokens();
        f.replica.peer_tls_ca_file = Some(dir.path().join("missing.pem"));
        f.replica.advertise_address = Some("http://host:1".into());
        let e = error_of(f.clone());
        assert!(e.contains("replica.peer_tls_ca_file: cannot read"), "{e}");
        assert!(e.contains("replica.advertise_address"), "{e}");
        let not_pem = dir.path().join("not.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        f.replica.peer_tls_ca_file = Some(not_pem);
        f.replica.advertise_address = Some("https://host:1".into());
        let e = error_of(f.clone());
        assert!(e.contains("holds no PEM certificate"), "{e}");
        f.replica.peer_tls_ca_file = None;
        f.replica.peer_tls_domain_name = Some("peers".into());
        let e = error_of(f.clone());
        assert!(
            e.contains("replica.peer_tls_domain_name: needs replica.peer_tls_ca_file"),
            "{e}"
        );
        f.replica.peer_tls_domain_name = None;
        let c = f.validate().unwrap();
        assert_eq!(c.replica.advertised("1.2.3.4:5", false), "https://host:1");
        let c = with_tokens().validate().unwrap();
        assert_eq!(c.replica.advertised("1.2.3.4:5", false), "1.2.3.4:5");
        assert_eq!(c.replica.advertised("1.2.3.4:5", true), "https://1.2.3.4:5");
    }

    #[test]
    fn relative_paths_are_taken_from_the_working_directory() {
        let cwd = std::env::current_dir().unwrap();
        let mut f = with_tokens();
        f.data_dir = Some("data/../state".into());
        f.executors.standalone.agentctl_path = Some("./bin/agentctl".into());
        f.executors.standalone.log_dir = Some("logs".into());
        let c = f.validate().unwrap();
        assert_eq!(c.data_dir, cwd.join("state"));
        assert_eq!(
            c.database_url,
            cwd.join("state/sessiond.sqlite3").display().to_string()
        );
        assert_eq!(c.executors.run_dir, cwd.join("state/run"));
        assert_eq!(c.executors.log_dir, cwd.join("logs"));
        assert_eq!(c.executors.agentctl_path, cwd.join("bin/agentctl"));
        // A bare name stays a PATH lookup.
        let mut f = with_tokens();
        f.executors.standalone.agentctl_path = Some("agentctl".into());
        let c = f.validate().unwrap();
        assert_eq!(c.executors.agentctl_path, PathBuf::from("agentctl"));
    }

    #[test]
    fn no_token_and_no_explicit_insecure_mode_is_an_error() {
        let f = FileConfig {
            data_dir: Some("/tmp/x".into()),
            ..FileConfig::default()
        };
        assert!(error_of(f).contains("auth.tokens: no API token"));
    }

    #[test]
    fn insecure_mode_refuses_non_loopback_listen() {
        let mut f = with_tokens();
        f.auth.tokens.clear();
        f.auth.insecure_no_auth = true;
        f.listen = "0.0.0.0:50051".into();
        assert!(error_of(f.clone()).contains("auth.insecure_no_auth: refuses"));
        f.listen = "[::1]:0".into();
        assert!(matches!(f.validate().unwrap().auth, AuthConfig::Disabled));
    }

    #[test]
    fn docker_defaults_to_no_network_and_refuses_host_network_and_root() {
        let mut f = with_tokens();
        f.executors.docker.enabled = true;
        let docker = f.clone().validate().unwrap().executors.docker.unwrap();
        assert_eq!(docker.network_mode, "none");
        assert_eq!(docker.pids_limit, Some(1024));
        assert_eq!(docker.user, None, "the worktree owner's uid:gid");

        f.executors.docker.network_mode = "bridge".into();
        assert!(f.clone().validate().is_ok());
        for mode in ["host", "container:abc"] {
            let mut g = f.clone();
            g.executors.docker.network_mode = mode.into();
            let err = error_of(g);
            assert!(err.contains("executors.docker.network_mode"), "{err}");
        }
        for user in ["0", "0:0", "root", "root:root"] {
            let mut g = f.clone();
            g.executors.docker.user = Some(user.into());
            let err = error_of(g);
            assert!(
                err.contains("executors.docker.user: containers never run as root"),
                "{err}"
            );
        }
    }

    #[test]
    fn insecure_mode_conflicts_with_tokens_and_with_any_origin() {
        let mut f = with_tokens();
        f.auth.insecure_no_auth = true;
        f.cors.allowed_origins = vec!["*".into()];
        let err = error_of(f);
        assert!(
            err.contains("auth.insecure_no_auth: conflicts with auth.tokens"),
            "{err}"
        );
        assert!(
            err.contains(
                "cors.allowed_origins: \"*\" is refused together with auth.insecure_no_auth"
            ),
            "{err}"
        );
    }

    #[test]
    fn origins_none_any_or_a_list() {
        let mut f = with_tokens();
        f.cors.allowed_origins = vec!["*".into()];
        assert_eq!(
            f.clone().validate().unwrap().cors.allowed_origins,
            AllowedOrigins::Any
        );
        f.cors.allowed_origins = vec!["https://app.example".into()];
        assert_eq!(
            f.clone().validate().unwrap().cors.allowed_origins,
            AllowedOrigins::List(vec!["https://app.example".into()])
        );
        f.cors.allowed_origins = vec!["app.example/x".into()];
        assert!(error_of(f).contains("cors.allowed_origins[0]"));
    }

    #[test]
    fn errors_name_the_key_and_all_are_reported() {
        let text = r#"
            listen = "nowhere"
            [executors.docker]
            enabled = true
            image = ""
            [recovery]
            mode = "sometimes"
            executor_deadline = "5 parsecs"
            agent_restarts = 1000
            cancel_grace = "1ms"
        "#;
        let mut f = FileConfig::parse(text).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        let err = error_of(f);
        assert!(
            err.contains("listen: \"nowhere\" is not an address"),
            "{err}"
        );
        assert!(
            err.contains("executors.docker.image: must not be empty"),
            "{err}"
        );
        assert!(err.contains("recovery.mode:"), "{err}");
        assert!(err.contains("recovery.executor_deadline:"), "{err}");
        assert!(
            err.contains("recovery.agent_restarts: must be between 0 and 100"),
            "{err}"
        );
        assert!(
            err.contains("recovery.cancel_grace: must be at least 1s"),
            "{err}"
        );
    }

    #[test]
    fn values_of_the_wrong_type_are_named_by_their_key() {
        for (text, key) in [
            (
                "[recovery]\nagent_restarts = -1\n",
                "recovery.agent_restarts: ",
            ),
            ("listen = 5\n", "listen: "),
            ("[auth]\ntokens = [\n  \"a\",\n  7,\n]\n", "auth.tokens: "),
            (
                "[recovery]\nmode = \"x\"\n[[agents]]\nname = 3\n",
                "agents.name: ",
            ),
        ] {
            let err = FileConfig::parse(text).unwrap_err().to_string();
            assert!(err.starts_with(key), "{text:?}: {err}");
            assert!(err.contains("line"), "{err}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_name() {
        let err = FileConfig::parse("[recovery]\nconcurency = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("concurency"), "{err}");
    }

    #[test]
    fn file_profiles_add_to_and_override_the_demo_profile() {
        let text = r#"
            default_agent = "claude"
            [[agents]]
            name = "claude"
            command = "claude-code-acp"
            [[agents]]
            name = "demo"
            command = "/opt/demo"
            supports_session_resume = false
        "#;
        let mut f = FileConfig::parse(text).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        let c = f.validate().unwrap();
        assert_eq!(c.agents.len(), 2);
        assert_eq!(c.agents[0].command, "/opt/demo");
        assert!(!c.agents[0].supports_session_resume);
        assert!(c.agents[1].supports_session_resume);
        assert_eq!(c.default_agent, "claude");
    }

    #[test]
    fn profiles_name_a_command_and_image_for_containers() {
        let text = r#"
            [[agents]]
            name = "claude"
            command = "claude-code-acp"
            env = { KEY = "k" }
            [agents.container]
            image = "agents:1"
            command = "/usr/bin/claude-code-acp"
            args = ["--in-container"]
            env = { HOME_HINT = "/run/sessiond/home" }
            [[agents]]
            name = "bad"
            command = "x"
            [agents.container]
            command = " "
            image = ""
        "#;
        let mut f = FileConfig::parse(text).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        let err = f.clone().validate().unwrap_err().to_string();
        assert!(
            err.contains("agents[1].container.command: must not be empty"),
            "{err}"
        );
        assert!(
            err.contains("agents[1].container.image: must not be empty"),
            "{err}"
        );
        f.agents.pop();
        let c = f.validate().unwrap();
        // The built-in demo profile runs the image's own acp-demo-agent.
        let demo = c.agents[0].container.as_ref().unwrap();
        assert_eq!(c.agents[0].name, DEMO_PROFILE);
        assert_eq!(demo.command, "/usr/local/bin/acp-demo-agent");
        assert_eq!(demo.image, None, "the executor's image");
        assert_eq!(
            demo.env["ACP_DEMO_STATE_DIR"],
            "/run/sessiond/home/acp-demo-agent"
        );
        let claude = c.agents[1].container.as_ref().unwrap();
        assert_eq!(claude.image.as_deref(), Some("agents:1"));
        assert_eq!(claude.command, "/usr/bin/claude-code-acp");
        assert_eq!(claude.args, ["--in-container"]);
        assert_eq!(c.agents[1].env["KEY"], "k");
    }

    #[test]
    fn mcp_servers_are_checked_and_their_secrets_read_at_start() {
        let parse = |servers: &str| {
            let text = format!("[[agents]]\nname = \"a\"\ncommand = \"a\"\n{servers}");
            let mut f = FileConfig::parse(&text).unwrap();
            f.data_dir = Some("/tmp/x".into());
            f.auth.tokens = vec!["0123456789abcdef".into()];
            f.validate()
        };
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "s3cret\n").unwrap();
        let c = parse(&format!(
            "[[agents.mcp_servers]]\nname = \"d\"\ntype = \"sse\"\nurl = \"http://127.0.0.1:1/sse\"\n\
             headers = {{ X = {{ file = \"{}\" }}, Y = \"plain\" }}\n",
            file.display()
        ))
        .unwrap();
        let s = &c.agents[1].mcp_servers[0];
        assert_eq!(s.transport.kind(), "sse");
        let sessiond_domain::McpTransport::Sse { headers, .. } = &s.transport else {
            unreachable!()
        };
        assert_eq!(c.mcp_secrets.resolve(&headers["X"]), Some("s3cret"));
        assert_eq!(c.mcp_secrets.resolve(&headers["Y"]), Some("plain"));
        assert!(!format!("{:?}", c.mcp_secrets).contains("s3cret"));
        for (bad, key) in [
            (
                "[[agents.mcp_servers]]\nname = \"x\"\n",
                "mcp_servers[0].command",
            ),
            (
                "[[agents.mcp_servers]]\nname = \"x\"\ntype = \"ws\"\n",
                "mcp_servers[0].type",
            ),
            (
                "[[agents.mcp_servers]]\nname = \"x\"\ntype = \"http\"\nurl = \"ftp://h\"\n",
                "mcp_servers[0].url",
            ),
            (
                "[[agents.mcp_servers]]\nname = \"x\"\ncommand = \"c\"\nenv = { K = { env = \"A\", file = \"B\" } }\n",
                "mcp_servers[0].env.K",
            ),
            (
                "[[agents.mcp_servers]]\nname = \"x\"\ncommand = \"c\"\nenv = { K = { env = \"SESSIOND_SURELY_UNSET_VAR\" } }\n",
                "SESSIOND_SURELY_UNSET_VAR is not set",
            ),
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }

    #[test]
    fn profiles_carry_auth_method_and_permission_policy() {
        let text = r#"
            [executors]
            idle_timeout = "0s"
            [[agents]]
            name = "codex"
            command = "codex-acp"
            auth_method = "openai-api-key"
            permission_policy = "deny"
            config = { model = "gpt-5-codex", reasoning_effort = "high" }
            [[agents]]
            name = "careful"
            command = "claude-code-acp"
            permission_policy = "ask"
            permission_timeout = "90s"
        "#;
        let mut f = FileConfig::parse(text).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        let c = f.validate().unwrap();
        assert_eq!(c.agents[1].auth_method.as_deref(), Some("openai-api-key"));
        assert_eq!(c.agents[1].permission_policy, PermissionPolicy::Deny);
        assert_eq!(c.agents[0].permission_policy, PermissionPolicy::Allow);
        assert_eq!(c.agents[0].auth_method, None);
        assert_eq!(c.agents[2].permission_policy, PermissionPolicy::Ask);
        assert_eq!(c.agents[2].permission_timeout, Duration::from_secs(90));
        assert_eq!(c.agents[1].config_defaults["model"], "gpt-5-codex");
        assert_eq!(c.agents[1].config_defaults.len(), 2);
        assert!(c.agents[2].config_defaults.is_empty());
        assert_eq!(
            c.agents[1].permission_timeout,
            sessiond_domain::DEFAULT_PERMISSION_TIMEOUT
        );
        // "0s" reaches agentctl as "never", not as its own default.
        assert_eq!(c.executors.idle_timeout, Some(Duration::ZERO));

        let bad = r#"
            [[agents]]
            name = "x"
            command = "x"
            auth_method = " "
            permission_policy = "ask-me"
            permission_timeout = "0s"
        "#;
        let mut f = FileConfig::parse(bad).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        let err = f.validate().unwrap_err().to_string();
        assert!(err.contains("agents[0].auth_method"), "{err}");
        assert!(err.contains("agents[0].permission_policy"), "{err}");
        assert!(err.contains("agents[0].permission_timeout"), "{err}");
    }

    #[test]
    fn flags_and_env_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:1111\"\n[auth]\ntokens = [\"from-the-file-0123456\"]\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path),
            data_dir: Some(dir.path().into()),
            listen: Some("127.0.0.1:2222".into()),
            ..ServeArgs::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.listen.port(), 2222);
        let AuthConfig::Tokens(t) = c.auth else {
            panic!()
        };
        assert_eq!(t, vec!["from-the-file-0123456".to_owned()]);
    }

    #[test]
    fn example_config_in_the_repository_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sessiond.example.toml");
        let mut f = FileConfig::read(&path).unwrap();
        f.data_dir = Some("/tmp/x".into());
        f.auth.tokens = vec!["0123456789abcdef".into()];
        f.validate().unwrap();
    }

    /// helper-30: profiles `X` and `x` were both taken, and `--agent x`
    /// ran one where the user meant the other.
    #[test]
    fn profile_names_must_differ_in_more_than_case() {
        let parse = |text: &str| {
            let mut f = FileConfig::parse(text).unwrap();
            f.data_dir = Some("/tmp/x".into());
            f.auth.tokens = vec!["0123456789abcdef".into()];
            f.validate().map(drop).map_err(|e| e.to_string())
        };
        let e = parse(
            "[[agents]]\nname = \"claude\"\ncommand = \"a\"\n\
             [[agents]]\nname = \"Claude\"\ncommand = \"b\"\n",
        )
        .unwrap_err();
        assert!(
            e.contains("agents[1].name: \"Claude\" differs from profile \"claude\" only in case"),
            "{e}"
        );
        let e = parse("[[agents]]\nname = \"DEMO\"\ncommand = \"a\"\n").unwrap_err();
        assert!(
            e.contains("agents[0].name: \"DEMO\" differs from profile \"demo\""),
            "{e}"
        );
        // The built-in profile is replaced by its own name, as before.
        parse("[[agents]]\nname = \"demo\"\ncommand = \"a\"\n").unwrap();
    }

    #[test]
    fn traces_are_off_by_default_and_validated() {
        let parse = |text: &str| {
            let mut f = FileConfig::parse(text).unwrap();
            f.data_dir = Some("/tmp/x".into());
            f.auth.tokens = vec!["0123456789abcdef".into()];
            f.validate()
        };
        let c = parse("").unwrap();
        assert_eq!(c.otlp_endpoint, None);
        assert_eq!(c.trace_sample_ratio, 1.0);
        let c = parse("[traces]\notlp_endpoint = \"http://127.0.0.1:4317\"\nsample_ratio = 0.25\n")
            .unwrap();
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
        assert_eq!(c.trace_sample_ratio, 0.25);
        let e = parse("[traces]\notlp_endpoint = \"collector:4317\"\nsample_ratio = 2.0\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("traces.otlp_endpoint: \"collector:4317\""),
            "{e}"
        );
        assert!(
            e.contains("traces.sample_ratio: 2 is not a fraction"),
            "{e}"
        );
        let e = parse("[traces]\notlp_endpoint = \"https://c:4317\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("TLS to the collector is not built in"), "{e}");
        // A flag (or SESSIOND_OTLP_ENDPOINT) overrides the file.
        let args = ServeArgs {
            otlp_endpoint: Some("off".into()),
            ..ServeArgs::default()
        };
        let mut f = FileConfig::parse("[traces]\notlp_endpoint = \"http://c:4317\"\n").unwrap();
        args.overlay(&mut f);
        assert_eq!(f.traces.otlp_endpoint, "off");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }
}
