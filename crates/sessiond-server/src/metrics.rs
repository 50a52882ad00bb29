//! Prometheus metrics and the HTTP probes, on their own address
//! (`metrics.listen`) so the API port never exposes operational data.
//!
//! Metrics use `prometheus-client`, the official Rust client of the
//! Prometheus project: typed families with derived label sets (so a label
//! set is a closed struct, never a session id), an OpenMetrics text encoder
//! that Prometheus and `promtool` parse, and no global registry: the one
//! registry is built here and families from other crates
//! (`sessiond_engine::ManagerMetrics`) register into it. The `prometheus`
//! crate was the alternative; it keeps a process-global default registry and
//! a protobuf dependency we do not need.
//!
//! HTTP is hyper's HTTP/1.1 server (hyper is already under tonic): `GET
//! /metrics`, `GET /livez` (the process answers), `GET /readyz` (200 once
//! the first startup recovery pass is done — the same moment gRPC health
//! turns SERVING — and 503 again on shutdown). Connections are bounded:
//! at most `max_connections` at once (the accept loop waits for a free slot,
//! so extra clients queue in the kernel's backlog instead of costing a task
//! each), and a connection that sends no request head for `idle_timeout`
//! (new or kept alive) is closed.
//!
//! Families registered here (the recovery crate adds the per-turn,
//! per-agent and per-stream ones):
//! - `sessiond_rpc_duration_seconds{method,code}` histogram: time from
//!   request to response headers (for streams: until the stream starts).
//! - `sessiond_recovery_duration_seconds` gauge: the last startup recovery pass.
//! - `sessiond_recovery_executors_total{outcome}` counter: executors handled by
//!   startup recovery, by outcome.
//! - `sessiond_recovery_done` gauge: 1 once the first pass finished.
//! - `sessiond_sessions{state}`, `sessiond_executors{runtime,status}` gauges:
//!   counted from the store at scrape time.
//! - `sessiond_permission_requests_pending` gauge: permission requests
//!   (policy `ask`) waiting for an answer, counted from the store at scrape
//!   time (so it is right after a restart too).

use std::{
    collections::HashSet,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::future::{BoxFuture, FutureExt};
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use tokio::{net::TcpListener, sync::Semaphore};
use tower::{Layer, Service};

const RPC_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The OpenMetrics text format `prometheus-client` writes; what Prometheus
/// asks for first.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The classic Prometheus text format, for clients that do not ask for
/// OpenMetrics (curl, `promtool check metrics`).
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExecutorLabels {
    // A built-in runtime's name or a registered one's.
    runtime: String,
    status: &'static str,
}

/// What the store says at scrape time.
#[derive(Debug, Default)]
pub struct StoreCounts {
    pub sessions: Vec<(&'static str, i64)>,
    pub executors: Vec<(String, &'static str, i64)>,
    pub permission_requests_pending: i64,
}

/// Counts read from the store at scrape time.
pub type Snapshot = BoxFuture<'static, StoreCounts>;

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

struct Inner {
    registry: Registry,
    rpc: HistogramFamily<RpcLabels>,
    recovery_done: Gauge,
    recovery_seconds: Gauge<f64, AtomicU64>,
    recovery_outcomes: Family<OutcomeLabels, Counter>,
    sessions: Family<StateLabels, Gauge>,
    executors: Family<ExecutorLabels, Gauge>,
    permissions_pending: Gauge,
    snapshot: Option<Box<dyn Fn() -> Snapshot + Send + Sync>>,
    /// `/readyz`: set with gRPC health's SERVING, cleared on shutdown.
    ready: AtomicBool,
    /// The `method` labels there may be (see [`served_methods`]).
    methods: HashSet<String>,
}

/// The `method` label of every call to a path the server does not serve.
const UNKNOWN_METHOD: &str = "unknown";

/// The services a sessiond server mounts (reflection lists exactly these).
pub(crate) const SERVED_SERVICES: &[&str] = &[
    "sessiond.v1.SessionService",
    "sessiond.v1.WorkspaceService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
];

/// `/package.Service/Method` of every method of [`SERVED_SERVICES`], from
/// the descriptor sets compiled into the binary, so a method added to a
/// proto is labelled by its path without a list to keep in step.
fn served_methods() -> HashSet<String> {
    use prost::Message as _;
    let mut out = HashSet::new();
    for set in [
        sessiond_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
    ] {
        // Compiled in: a set that does not decode is a build fault, which
        // the unit test below catches; at run time it only costs labels.
        let Ok(set) = prost_types::FileDescriptorSet::decode(set) else {
            continue;
        };
        for file in set.file {
            for service in &file.service {
                let name = format!("{}.{}", file.package(), service.name());
                if !SERVED_SERVICES.contains(&name.as_str()) {
                    continue;
                }
                for method in &service.method {
                    out.insert(format!("/{name}/{}", method.name()));
                }
            }
        }
    }
    out
}

/// The registry and the server's own families; cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// `snapshot` yields the store's counts at scrape time; `more` registers
    /// other crates' families in the same registry.
    pub fn new(
        snapshot: Option<Box<dyn Fn() -> Snapshot + Send + Sync>>,
        more: impl FnOnce(&mut Registry),
    ) -> Self {
        let mut registry = Registry::default();
        let rpc: HistogramFamily<RpcLabels> =
            Family::new_with_constructor(|| Histogram::new(RPC_BUCKETS.iter().copied()));
        registry.register(
            "sessiond_rpc_duration_seconds",
            "Time from request to response headers, by gRPC method and status code",
            rpc.clone(),
        );
        let recovery_done = Gauge::default();
        registry.register(
            "sessiond_recovery_done",
            "1 once startup recovery finished its first pass",
            recovery_done.clone(),
        );
        let recovery_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "sessiond_recovery_duration_seconds",
            "Duration of the last startup recovery pass",
            recovery_seconds.clone(),
        );
        let recovery_outcomes: Family<OutcomeLabels, Counter> = Family::default();
        // Every outcome at 0 from the start, so alerts' increase() sees it.
        use sessiond_domain::OutcomeLabel as O;
        for label in [
            O::Resumed,
            O::Reattached,
            O::ExecutorOnly,
            O::NotResumable,
            O::MissingResumeToken,
            O::ResumeFailed,
            O::ExecutorError,
            O::Retrying,
            O::Stopped,
        ] {
            drop(recovery_outcomes.get_or_create(&OutcomeLabels {
                outcome: label.as_str().to_owned(),
            }));
        }
        drop(recovery_outcomes.get_or_create(&OutcomeLabels {
            outcome: "failed".to_owned(),
        }));
        registry.register(
            // The encoder appends `_total` to counters.
            "sessiond_recovery_executors",
            "Executors handled by startup recovery, by outcome",
            recovery_outcomes.clone(),
        );
        let sessions = Family::default();
        registry.register(
            "sessiond_sessions",
            "Sessions by state (from the store at scrape time)",
            sessions.clone(),
        );
        let executors = Family::default();
        registry.register(
            "sessiond_executors",
            "Executor records by runtime and status (from the store at scrape time)",
            executors.clone(),
        );
        let permissions_pending = Gauge::default();
        registry.register(
            "sessiond_permission_requests_pending",
            "Permission requests (profile policy ask) waiting for an answer (from the store at scrape time)",
            permissions_pending.clone(),
        );
        more(&mut registry);
        Self {
            inner: Arc::new(Inner {
                registry,
                rpc,
                recovery_done,
                recovery_seconds,
                recovery_outcomes,
                sessions,
                executors,
                permissions_pending,
                snapshot,
                ready: AtomicBool::new(false),
                methods: served_methods(),
            }),
        }
    }

    /// `method` is the request's path: a method the server serves is its
    /// own label, anything else `unknown`, so the label set stays closed
    /// whatever paths callers (authenticated or not) send.
    pub fn observe_rpc(&self, method: &str, code: &'static str, elapsed: Duration) {
        let method = if self.inner.methods.contains(method) {
            method
        } else {
            UNKNOWN_METHOD
        };
        self.inner
            .rpc
            .get_or_create(&RpcLabels {
                method: method.to_owned(),
                code,
            })
            .observe(elapsed.as_secs_f64());
    }

    pub fn record_recovery(&self, elapsed: Duration, outcomes: &[(String, u64)]) {
        self.inner.recovery_seconds.set(elapsed.as_secs_f64());
        for (outcome, n) in outcomes {
            self.inner
                .recovery_outcomes
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.clone(),
                })
                .inc_by(*n);
        }
        self.inner.recovery_done.set(1);
    }

    /// `/readyz` answers 200 while set.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }

    /// The exposition text (OpenMetrics).
    pub async fn render(&self) -> String {
        if let Some(snapshot) = &self.inner.snapshot {
            let counts = snapshot().await;
            for (state, n) in counts.sessions {
                self.inner
                    .sessions
                    .get_or_create(&StateLabels { state })
                    .set(n);
            }
            for (runtime, status, n) in counts.executors {
                self.inner
                    .executors
                    .get_or_create(&ExecutorLabels { runtime, status })
                    .set(n);
            }
            self.inner
                .permissions_pending
                .set(counts.permission_requests_pending);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.inner.registry);
        out
    }

    async fn respond(&self, request: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
        let reply = |status: StatusCode, content_type: &str, body: Bytes| {
            let mut r = Response::new(Full::new(body));
            *r.status_mut() = status;
            if let Ok(v) = http::HeaderValue::from_str(content_type) {
                r.headers_mut().insert(http::header::CONTENT_TYPE, v);
            }
            r
        };
        let text = "text/plain; charset=utf-8";
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return reply(
                StatusCode::METHOD_NOT_ALLOWED,
                text,
                Bytes::from_static(b"only GET\n"),
            );
        }
        let openmetrics = request
            .headers()
            .get_all(http::header::ACCEPT)
            .iter()
            .any(|v| {
                v.to_str()
                    .is_ok_and(|v| v.contains("application/openmetrics-text"))
            });
        match request.uri().path() {
            "/metrics" | "/" if openmetrics => {
                reply(StatusCode::OK, OPENMETRICS, self.render().await.into())
            }
            "/metrics" | "/" => reply(
                StatusCode::OK,
                PROMETHEUS_TEXT,
                prometheus_text(&self.render().await).into(),
            ),
            "/livez" => reply(StatusCode::OK, text, Bytes::from_static(b"ok\n")),
            "/readyz" if self.is_ready() => {
                reply(StatusCode::OK, text, Bytes::from_static(b"ok\n"))
            }
            "/readyz" => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                Bytes::from_static(b"not ready: startup recovery has not finished\n"),
            ),
            _ => reply(
                StatusCode::NOT_FOUND,
                text,
                Bytes::from_static(b"not found: try /metrics, /livez or /readyz\n"),
            ),
        }
    }
}

/// OpenMetrics text as the classic Prometheus text format (0.0.4): the
/// samples are the same; only a counter's `# HELP` / `# TYPE` name differs
/// (OpenMetrics names the family `x`, its sample `x_total`; 0.0.4 names
/// both `x_total`), and 0.0.4 has no `# UNIT` and no `# EOF`.
fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|rest| rest.strip_suffix(" counter"))
        {
            counters.insert(name.to_owned());
        }
    }
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(&l),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Bounds of the metrics endpoint.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections served at once; further clients wait in the backlog.
    pub max_connections: usize,
    /// A connection that sends no request head this long is closed.
    pub idle_timeout: Duration,
}

/// What the metrics endpoint serves: the server's [`Metrics`] once they
/// exist. Before (`serve` waiting for its database), `/livez` answers
/// 200 and the rest 503.
pub type MetricsSlot = Arc<std::sync::OnceLock<Metrics>>;

/// The answer while no [`Metrics`] exist yet: the process is alive, not
/// ready.
fn before_metrics(request: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (status, body): (StatusCode, &'static [u8]) = match request.uri().path() {
        "/livez" => (StatusCode::OK, b"ok\n"),
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            b"not ready: sessiond is starting and its database does not answer yet\n",
        ),
    };
    let mut r = Response::new(Full::new(Bytes::from_static(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Serves `/metrics`, `/livez` and `/readyz` on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: MetricsSlot,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            _ = &mut shutdown => return,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return, // never closed
            },
        };
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok(s) => s,
                Err(err) => {
                    tracing::warn!(%err, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let connection = http.serve_connection(
            TokioIo::new(stream),
            service_fn(move |request| {
                let metrics = metrics.get().cloned();
                async move {
                    Ok::<_, Infallible>(match metrics {
                        Some(metrics) => metrics.respond(request).await,
                        None => before_metrics(&request),
                    })
                }
            }),
        );
        tokio::spawn(async move {
            // Header timeouts and resets are the client's business.
            let _ = connection.await;
            drop(slot);
        });
    }
}

/// Times every call by gRPC method and status code.
#[derive(Debug, Clone)]
pub struct RpcMetricsLayer {
    metrics: Metrics,
}

impl RpcMetricsLayer {
    pub fn new(metrics: Metrics) -> Self {
        Self { metrics }
    }
}

impl<S> Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: Metrics,
}

impl<S, B, RB> Service<http::Request<B>> for RpcMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    RB: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // `Uri` is `Bytes`-backed: this clone does not allocate.
        let uri = request.uri().clone();
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let mut unanswered = Unanswered {
            uri: Some(uri.clone()),
            deadline: request
                .headers()
                .get("grpc-timeout")
                .and_then(|v| v.to_str().ok())
                .and_then(crate::forward::parse_grpc_timeout),
            metrics: metrics.clone(),
            started,
        };
        self.inner
            .call(request)
            .map(move |mut result| {
                unanswered.answered();
                if let Ok(response) = &mut result {
                    undecodable_is_invalid_argument(response.headers_mut());
                }
                let code = match &result {
                    // Errors travel in the headers of a trailers-only response;
                    // successful calls put grpc-status 0 in the trailers.
                    Ok(response) => response
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .map(|c| tonic::Code::from_bytes(c.as_bytes()))
                        .unwrap_or(tonic::Code::Ok),
                    Err(_) => tonic::Code::Internal,
                };
                metrics.observe_rpc(uri.path(), code_name(code), started.elapsed());
                result
            })
            .boxed()
    }
}

/// A call dropped before its answer (its client went away, or its
/// `grpc-timeout` passed) is counted too: DEADLINE_EXCEEDED once its
/// deadline passed, else CANCELLED (helper-61 F5: such calls were not
/// counted at all).
struct Unanswered {
    /// `None` once answered.
    uri: Option<http::Uri>,
    deadline: Option<Duration>,
    metrics: Metrics,
    started: Instant,
}

impl Unanswered {
    fn answered(&mut self) {
        self.uri = None;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(uri) = self.uri.take() {
            let took = self.started.elapsed();
            let code = match self.deadline {
                Some(deadline) if took >= deadline => tonic::Code::DeadlineExceeded,
                _ => tonic::Code::Cancelled,
            };
            self.metrics.observe_rpc(uri.path(), code_name(code), took);
        }
    }
}

/// A request body that is not the method's message (tonic answers
/// INTERNAL "failed to decode Protobuf message"), that holds no message, or
/// whose frame is cut short, is the caller's mistake: INVALID_ARGUMENT, as
/// for any other bad input (helper-52 14). A compressed-flag without an
/// encoding stays INTERNAL, as the gRPC spec says. Decoding fails before the
/// method runs, so the answer is trailers-only: the status is in the headers.
fn undecodable_is_invalid_argument(headers: &mut http::HeaderMap) {
    const UNDECODABLE: [&str; 3] = [
        "failed to decode Protobuf message",
        "Missing request message.",
        "Unexpected EOF decoding stream.",
    ];
    let internal = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == b"13");
    let undecodable = headers.get("grpc-message").is_some_and(|m| {
        let m = m.as_bytes();
        UNDECODABLE.iter().any(|text| {
            m.starts_with(text.as_bytes()) || m.starts_with(text.replace(' ', "%20").as_bytes())
        })
    });
    if internal && undecodable {
        headers.insert("grpc-status", http::HeaderValue::from_static("3"));
    }
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn every_served_service_has_its_methods_labelled() {
        let methods = served_methods();
        for service in SERVED_SERVICES {
            assert!(
                methods
                    .iter()
                    .any(|m| m.starts_with(&format!("/{service}/"))),
                "{service}: {methods:?}"
            );
        }
        for m in [
            "/sessiond.v1.SessionService/CreateTask",
            "/sessiond.v1.WorkspaceService/Exec",
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert!(methods.contains(m), "{m}");
        }
        // agentctl's protocol is in the same descriptor set but not served.
        assert!(
            !methods.iter().any(|m| m.contains("agentctl")),
            "{methods:?}"
        );
    }

    fn metrics() -> Metrics {
        Metrics::new(
            Some(Box::new(|| {
                async {
                    StoreCounts {
                        sessions: vec![("RUNNING", 2)],
                        executors: vec![("local_standalone".into(), "ready", 3)],
                        permission_requests_pending: 1,
                    }
                }
                .boxed()
            })),
            |_| {},
        )
    }

    #[tokio::test]
    async fn renders_histogram_and_recovery_families() {
        let m = metrics();
        m.observe_rpc(
            "/sessiond.v1.SessionService/ListTasks",
            "OK",
            Duration::from_millis(3),
        );
        m.record_recovery(Duration::from_millis(1500), &[("resumed".into(), 2)]);
        let text = m.render().await;
        assert!(text.contains(
            "sessiond_rpc_duration_seconds_bucket{le=\"0.005\",method=\"/sessiond.v1.SessionService/ListTasks\",code=\"OK\"} 1"
        ), "{text}");
        assert!(
            text.contains("sessiond_recovery_duration_seconds 1.5"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_recovery_executors_total{outcome=\"resumed\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_sessions{state=\"RUNNING\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_permission_requests_pending 1"),
            "{text}"
        );
        assert!(
            text.contains("sessiond_executors{runtime=\"local_standalone\",status=\"ready\"} 3"),
            "{text}"
        );
        assert!(text.contains("sessiond_recovery_done 1"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// A call dropped before its answer is counted: CANCELLED, or
    /// DEADLINE_EXCEEDED once its `grpc-timeout` passed (helper-61 F5).
    #[tokio::test]
    async fn a_call_dropped_before_its_answer_is_counted() {
        let m = metrics();
        let never = tower::service_fn(|_: http::Request<()>| {
            futures::future::pending::<Result<http::Response<()>, std::convert::Infallible>>()
        });
        let mut service = RpcMetricsLayer { metrics: m.clone() }.layer(never);
        let call = |timeout: Option<&'static str>| {
            let mut request =
                http::Request::builder().uri("http://x/sessiond.v1.SessionService/SendMessage");
            if let Some(t) = timeout {
                request = request.header("grpc-timeout", t);
            }
            request.body(()).unwrap()
        };
        for timeout in [None, Some("1n"), Some("1H"), Some("bogus")] {
            let mut answer = service.call(call(timeout));
            assert!(futures::poll!(&mut answer).is_pending());
            drop(answer);
        }
        let text = m.render().await;
        let count = |code: &str| {
            format!(
                "sessiond_rpc_duration_seconds_count{{method=\"/sessiond.v1.SessionService/SendMessage\",code=\"{code}\"}}"
            )
        };
        assert!(
            text.contains(&format!("{} 3", count("CANCELLED"))),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} 1", count("DEADLINE_EXCEEDED"))),
            "{text}"
        );
    }

    #[test]
    fn classic_text_names_counter_families_with_total() {
        let om = "# HELP x_seconds A gauge.\n# TYPE x_seconds gauge\n# UNIT x_seconds seconds\nx_seconds 1\n\
                  # HELP y Things.\n# TYPE y counter\ny_total{a=\"b\"} 2\n# EOF\n";
        assert_eq!(
            prometheus_text(om),
            "# HELP x_seconds A gauge.\n# TYPE x_seconds gauge\nx_seconds 1\n\
             # HELP y_total Things.\n# TYPE y_total counter\ny_total{a=\"b\"} 2\n"
        );
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// With every slot held by a silent client, the next request waits for
    /// the idle timeout to free one, then is served: the bound holds and
    /// idle connections do not pin it forever.
    #[tokio::test]
    async fn connections_are_bounded_and_idle_ones_closed() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let m = metrics();
        let idle_timeout = Duration::from_millis(500);
        tokio::spawn(serve(
            listener,
            Arc::new(std::sync::OnceLock::from(m.clone())),
            HttpLimits {
                max_connections: 4,
                idle_timeout,
            },
            futures::future::pending(),
        ));
        let mut idle = Vec::new();
        for _ in 0..4 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // Let the server accept all four before we measure.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let out = get(addr, "/livez").await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(
            started.elapsed() >= idle_timeout / 2,
            "served before an idle slot was freed: the bound did not hold"
        );
        // The silent clients were disconnected by the server.
        for mut s in idle {
            let mut buf = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("the server closes an idle connection")
                .unwrap_or(0);
            // hyper may answer 408 before closing; either way it closes.
            let rest = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("closed")
                .unwrap_or(0);
            assert!(n == 0 || rest == 0);
        }

        let out = get(addr, "/readyz").await;
        assert!(out.starts_with("HTTP/1.1 503"), "{out}");
        m.set_ready(true);
        let out = get(addr, "/readyz").await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        let out = get(addr, "/metrics").await;
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("text/plain; version=0.0.4"), "{out}");
        let out = get(addr, "/nope").await;
        assert!(out.starts_with("HTTP/1.1 404"), "{out}");
    }
}
