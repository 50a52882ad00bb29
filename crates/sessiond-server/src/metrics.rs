//! Prometheus metrics, hand-rolled in the text exposition format (0.0.4).
//!
//! A handful of counters, gauges and one histogram family do not justify a
//! metrics framework: this module is ~250 lines with no dependency, while
//! `prometheus-client` would add a crate and a derive macro for the same
//! output. Served on its own address (`metrics.listen`) by a minimal HTTP/1.1
//! responder, so the API port never exposes operational data.
//!
//! Families:
//! - `sessiond_rpc_duration_seconds{method,code}` histogram: time from
//!   request to response headers (for streams: until the stream starts).
//! - `sessiond_recovery_duration_seconds` gauge: the last startup recovery pass.
//! - `sessiond_recovery_executors_total{outcome}` counter: executors handled by
//!   recovery, by outcome.
//! - `sessiond_recovery_done` gauge: 1 once the first pass finished.
//! - `sessiond_sessions{state}`, `sessiond_executors{status}` gauges: counted
//!   from the store at scrape time.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::future::{BoxFuture, FutureExt};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};
use tower::{Layer, Service};

const BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (i, bound) in BUCKETS.iter().enumerate() {
            if seconds <= *bound {
                self.counts[i] += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }
}

/// Gauges computed at scrape time (from the store).
pub type Snapshot = BoxFuture<'static, Vec<(String, Vec<(String, String, f64)>)>>;

#[derive(Default)]
struct Inner {
    /// By method, then status code: a call looks its method up by `&str`
    /// and allocates only the first time a method is seen.
    rpc: HashMap<String, BTreeMap<&'static str, Histogram>>,
    recovery_seconds: Option<f64>,
    recovery_outcomes: BTreeMap<String, u64>,
    recovery_done: bool,
}

/// The registry; cheap to clone.
#[derive(Clone, Default)]
pub struct Metrics {
    inner: Arc<Mutex<Inner>>,
    snapshot: Option<Arc<dyn Fn() -> Snapshot + Send + Sync>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// `snapshot` yields gauge families `(name, [(label, value, number)])`
    /// at scrape time.
    pub fn new(snapshot: impl Fn() -> Snapshot + Send + Sync + 'static) -> Self {
        Self {
            inner: Arc::default(),
            snapshot: Some(Arc::new(snapshot)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn observe_rpc(&self, method: &str, code: &'static str, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let mut inner = self.lock();
        let by_code = match inner.rpc.get_mut(method) {
            Some(m) => m,
            None => inner.rpc.entry(method.to_owned()).or_default(),
        };
        by_code.entry(code).or_default().observe(seconds);
    }

    pub fn record_recovery(&self, elapsed: Duration, outcomes: &[(String, u64)]) {
        let mut inner = self.lock();
        inner.recovery_seconds = Some(elapsed.as_secs_f64());
        for (outcome, n) in outcomes {
            *inner.recovery_outcomes.entry(outcome.clone()).or_default() += n;
        }
        inner.recovery_done = true;
    }

    /// The exposition text.
    pub async fn render(&self) -> String {
        let gauges = match &self.snapshot {
            Some(f) => f().await,
            None => Vec::new(),
        };
        let mut out = String::new();
        {
            let inner = self.lock();
            out.push_str(
                "# HELP sessiond_rpc_duration_seconds Time from request to response headers, by gRPC method and status code.\n\
                 # TYPE sessiond_rpc_duration_seconds histogram\n",
            );
            let mut rpc: Vec<(&str, &str, &Histogram)> = inner
                .rpc
                .iter()
                .flat_map(|(m, by_code)| by_code.iter().map(move |(c, h)| (m.as_str(), *c, h)))
                .collect();
            rpc.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
            for (method, code, h) in rpc {
                let labels = format!("method=\"{}\",code=\"{}\"", escape(method), escape(code));
                for (i, bound) in BUCKETS.iter().enumerate() {
                    let n = h.counts.get(i).copied().unwrap_or(0);
                    let _ = writeln!(
                        out,
                        "sessiond_rpc_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {n}"
                    );
                }
                let _ = writeln!(
                    out,
                    "sessiond_rpc_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                    h.count
                );
                let _ = writeln!(
                    out,
                    "sessiond_rpc_duration_seconds_sum{{{labels}}} {}",
                    h.sum
                );
                let _ = writeln!(
                    out,
                    "sessiond_rpc_duration_seconds_count{{{labels}}} {}",
                    h.count
                );
            }
            out.push_str(
                "# HELP sessiond_recovery_done 1 once startup recovery finished its first pass.\n\
                 # TYPE sessiond_recovery_done gauge\n",
            );
            let _ = writeln!(
                out,
                "sessiond_recovery_done {}",
                u8::from(inner.recovery_done)
            );
            out.push_str(
                "# HELP sessiond_recovery_duration_seconds Duration of the last startup recovery pass.\n\
                 # TYPE sessiond_recovery_duration_seconds gauge\n",
            );
            if let Some(s) = inner.recovery_seconds {
                let _ = writeln!(out, "sessiond_recovery_duration_seconds {s}");
            }
            out.push_str(
                "# HELP sessiond_recovery_executors_total Executors handled by startup recovery, by outcome.\n\
                 # TYPE sessiond_recovery_executors_total counter\n",
            );
            for (outcome, n) in &inner.recovery_outcomes {
                let _ = writeln!(
                    out,
                    "sessiond_recovery_executors_total{{outcome=\"{}\"}} {n}",
                    escape(outcome)
                );
            }
        }
        for (name, samples) in gauges {
            let _ = writeln!(out, "# TYPE {name} gauge");
            for (label, value, n) in samples {
                let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {n}", escape(&value));
            }
        }
        out
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    tokio::pin!(shutdown);
    loop {
        let (mut stream, _) = tokio::select! {
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
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            let head_done = tokio::time::timeout(Duration::from_secs(5), async {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(head_done, Ok(true)) {
                return;
            }
            let line = buf.split(|b| *b == b'\r').next().unwrap_or_default();
            let line = String::from_utf8_lossy(line);
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let path = path.split('?').next().unwrap_or("");
            let response = if method == "GET" && (path == "/metrics" || path == "/") {
                let body = metrics.render().await;
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()
            };
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
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
        self.inner
            .call(request)
            .map(move |result| {
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
    use super::*;

    #[tokio::test]
    async fn renders_histogram_and_recovery_families() {
        let m = Metrics::new(|| {
            async {
                vec![(
                    "sessiond_sessions".to_owned(),
                    vec![("state".to_owned(), "RUNNING".to_owned(), 2.0)],
                )]
            }
            .boxed()
        });
        m.observe_rpc(
            "/sessiond.v1.SessionService/ListTasks",
            "OK",
            Duration::from_millis(3),
        );
        m.record_recovery(Duration::from_millis(1500), &[("resumed".into(), 2)]);
        let text = m.render().await;
        assert!(text.contains(
            "sessiond_rpc_duration_seconds_bucket{method=\"/sessiond.v1.SessionService/ListTasks\",code=\"OK\",le=\"0.005\"} 1"
        ), "{text}");
        assert!(
            text.contains("sessiond_recovery_duration_seconds 1.5"),
            "{text}"
        );
        assert!(text.contains("sessiond_recovery_executors_total{outcome=\"resumed\"} 2"));
        assert!(text.contains("sessiond_sessions{state=\"RUNNING\"} 2"));
        assert!(text.contains("sessiond_recovery_done 1"));
    }
}
