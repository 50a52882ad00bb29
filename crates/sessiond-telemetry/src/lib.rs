#![deny(missing_docs)]
//! Logs and traces of the sessiond binaries (`sessiond`, `agentctl`), on
//! the ecosystem's libraries: `tracing` for both, `tracing-opentelemetry`
//! to turn spans into OpenTelemetry spans, the OTLP/gRPC exporter of
//! `opentelemetry-otlp` to ship them to a collector.
//!
//! - [`init`] installs the subscriber: log lines on stderr (text, coloured
//!   only when stderr is a terminal, or JSON lines carrying the `trace_id`
//!   and `span_id` of the current span), and the OpenTelemetry layer. Spans
//!   are exported only when an OTLP endpoint is configured; without one the
//!   layer still gives every span W3C ids (nothing is recorded), so logs
//!   and the context passed on to agentctl keep the caller's trace id.
//! - [`GrpcTraceLayer`] opens one server span per incoming gRPC call whose
//!   parent is the W3C `traceparent` of the call's metadata, so a client's
//!   trace continues through sessiond and from there through agentctl (the
//!   agentctl client injects the current span's context into its calls:
//!   `sessiond_executor::client`). When nobody reads spans (no export, log
//!   filter above DEBUG) only calls that bring a `traceparent` get one.
//!
//! The propagator is OpenTelemetry's global text-map propagator (W3C trace
//! context), set by [`init`]: that is where the OpenTelemetry API looks for
//! it, so library crates inject without depending on this one.

use std::time::Duration;

use opentelemetry::{
    propagation::Extractor,
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{Sampler, SdkTracerProvider},
};
use tracing::{Event, Instrument, Subscriber, instrument::Instrumented};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    EnvFilter, Layer as _,
    filter::{FilterExt as _, LevelFilter},
    fmt::{FmtContext, FormatEvent, FormatFields, format::Writer},
    layer::SubscriberExt,
    registry::LookupSpan,
    util::SubscriberInitExt,
};

/// What the binary configured (from its files, environment and flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// `service.name` of the exported spans (`sessiond`, `agentctl`).
    pub service_name: &'static str,
    /// `EnvFilter` directives for the log lines (`info`, `sessiond=debug`).
    pub log_filter: String,
    /// JSON lines instead of text.
    pub log_json: bool,
    /// OTLP/gRPC collector (`http://127.0.0.1:4317`); `None`: no export.
    pub otlp_endpoint: Option<String>,
    /// Fraction of new traces recorded, 0 to 1. A caller's decision (the
    /// `sampled` flag of its `traceparent`) wins.
    pub sample_ratio: f64,
}

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The log filter does not parse.
    #[error("log filter {filter:?}: {message}")]
    Filter {
        /// The filter as given.
        filter: String,
        /// What is wrong with it.
        message: String,
    },
    /// The OTLP exporter cannot be built for this endpoint.
    #[error("OTLP endpoint {endpoint:?}: {message}")]
    Exporter {
        /// The endpoint as given.
        endpoint: String,
        /// Why the exporter refused it.
        message: String,
    },
    /// The process already has a global subscriber (telemetry is set up
    /// once per process).
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInstalled(String),
}

/// How long the exporter may take for one batch; a collector that does not
/// answer costs spans, never a stuck process.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The installed telemetry; [`Telemetry::shutdown`] flushes spans not yet
/// exported.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    exporting: bool,
}

impl Telemetry {
    /// Exports what is still buffered and stops the exporter (on exit).
    pub fn shutdown(&self) {
        if self.exporting
            && let Err(err) = self.provider.shutdown()
        {
            tracing::warn!(%err, "traces: final export failed");
        }
    }

    /// Spans are shipped to a collector.
    pub fn is_exporting(&self) -> bool {
        self.exporting
    }
}

/// Installs the global subscriber and the W3C propagator. Call once, early,
/// inside the Tokio runtime (the OTLP exporter's channel lives on it).
pub fn init(settings: Settings) -> Result<Telemetry, Error> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let resource = Resource::builder()
        .with_service_name(settings.service_name)
        .build();
    let mut provider = SdkTracerProvider::builder().with_resource(resource);
    let exporting = match &settings.otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .build()
                .map_err(|e| Error::Exporter {
                    endpoint: endpoint.clone(),
                    message: e.to_string(),
                })?;
            provider = provider
                .with_batch_exporter(exporter)
                .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                    settings.sample_ratio.clamp(0.0, 1.0),
                ))));
            true
        }
        // Ids for log correlation and propagation; nothing recorded.
        None => {
            provider = provider.with_sampler(Sampler::AlwaysOff);
            false
        }
    };
    let provider = provider.build();
    let tracer = provider.tracer(settings.service_name);
    // Spans at INFO and above whatever the log filter says: a quieter log
    // must not cut traces apart.
    let otel = tracing_opentelemetry::layer().with_tracer(tracer);
    let otel = if exporting {
        otel
    } else {
        // Nothing is recorded, only ids are handed on: the attributes and
        // timings a recorded span carries are not gathered (per call, they
        // were a tenth of a GetSessionStatus's CPU with the fields below).
        otel.with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_target(false)
            .with_context_activation(false)
    };
    let otel = otel.with_filter(LevelFilter::INFO);
    let filter = EnvFilter::try_new(&settings.log_filter).map_err(|e| Error::Filter {
        filter: settings.log_filter.clone(),
        message: e.to_string(),
    })?;
    // Each call's server span is part of the log lines' context only at
    // DEBUG: formatting its fields for every call is work the default
    // level's lines rarely use (a JSON line inside a call still carries its
    // trace and span ids: `WithTraceIds`).
    let with_call_spans = filter
        .max_level_hint()
        .is_none_or(|level| level >= LevelFilter::DEBUG);
    CALL_SPANS_READ.store(
        exporting || with_call_spans,
        std::sync::atomic::Ordering::Relaxed,
    );
    let filter = filter.and(tracing_subscriber::filter::filter_fn(move |meta| {
        with_call_spans || !is_call_span(meta)
    }));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = if settings.log_json {
        // JSON fields too: the JSON event format parses the spans' fields.
        fmt.json()
            .with_ansi(false)
            .event_format(WithTraceIds(tracing_subscriber::fmt::format().json()))
            .with_filter(filter)
            .boxed()
    } else {
        // Colour codes only for a person at a terminal, never in a log file.
        fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter)
            .boxed()
    };
    tracing_subscriber::registry()
        .with(otel)
        .with(logs)
        .try_init()
        .map_err(|e| Error::AlreadyInstalled(e.to_string()))?;
    Ok(Telemetry {
        provider,
        exporting,
    })
}

/// The JSON line of `F` with the current span's `trace_id` and `span_id`
/// (W3C hex) added, so a log line leads to its trace.
struct WithTraceIds<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        // The span's id only; its extensions are locked again below. The
        // dispatcher's current span, not this layer's: a call's server span
        // is not in the log lines' context at INFO (see `init`).
        let current = tracing::Span::current().id();
        let ids = current
            .and_then(|id| {
                tracing::dispatcher::get_default(|d| {
                    tracing_opentelemetry::get_otel_context(&id, d)
                })
            })
            .map(|cx| cx.span().span_context().clone())
            .filter(|sc| sc.is_valid());
        match (ids, line.strip_suffix("}\n")) {
            (Some(sc), Some(head)) => writeln!(
                writer,
                "{head},\"trace_id\":\"{}\",\"span_id\":\"{}\"}}",
                sc.trace_id(),
                sc.span_id()
            ),
            _ => writer.write_str(&line),
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The trace context (`traceparent`, `tracestate`) the caller sent.
pub fn extract(headers: &http::HeaderMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)))
}

/// The current span's trace context, as `set(key, value)` calls
/// (`traceparent`, `tracestate`): for carriers other than gRPC metadata,
/// such as ACP's `_meta` (where the agent finds it under those root keys).
pub fn inject_current(set: impl FnMut(&str, String)) {
    struct Setter<F>(F);
    impl<F: FnMut(&str, String)> opentelemetry::propagation::Injector for Setter<F> {
        fn set(&mut self, key: &str, value: String) {
            (self.0)(key, value);
        }
    }
    let cx = tracing::Span::current().context();
    let mut setter = Setter(set);
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut setter));
}

/// A server span for the gRPC call to `path` (`/pkg.Service/Method`), the
/// child of `parent` when that carries a valid remote span; with the RPC's
/// attributes when anyone reads them (`CALL_SPANS_READ`).
pub fn server_span(path: &str, parent: opentelemetry::Context) -> tracing::Span {
    let full = path.trim_start_matches('/');
    let (service, method) = full.split_once('/').unwrap_or(("", full));
    let span = if CALL_SPANS_READ.load(std::sync::atomic::Ordering::Relaxed) {
        tracing::info_span!(
            "grpc",
            otel.name = full,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = service,
            rpc.method = method,
        )
    } else {
        tracing::info_span!("grpc")
    };
    if parent.span().span_context().is_valid() {
        // Only fails without the OpenTelemetry layer (nothing to parent).
        let _ = span.set_parent(parent);
    }
    span
}

/// Whether anyone reads the call spans: spans are exported or log lines
/// show them (see [`init`]). Then every call gets its span, with the call's
/// fields. Otherwise a span would only carry trace ids, so only a call that
/// continues a caller's trace gets one (its logs and the calls it makes
/// keep that trace id), without fields: per call, opening and closing a
/// span of a trace nobody has was ~5% of a GetSessionStatus's CPU.
/// `true` until [`init`] says otherwise (an embedder's own subscriber may
/// export).
static CALL_SPANS_READ: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether [`GrpcTrace`] opens a span for a call to `path` with `headers`.
fn wants_call_span(path: &str, headers: &http::HeaderMap, spans_read: bool) -> bool {
    !is_probe(path) && (spans_read || headers.contains_key(TRACEPARENT))
}

/// The W3C trace context header a caller continues its trace with.
const TRACEPARENT: &str = "traceparent";

/// The span [`server_span`] opens.
fn is_call_span(meta: &tracing::Metadata<'_>) -> bool {
    meta.is_span() && meta.name() == "grpc" && meta.target() == module_path!()
}

/// Health checks: gRPC health and agentctl's `Health`, which sessiond's
/// liveness checks call every few seconds per executor; not worth a trace
/// each.
fn is_probe(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/") || path.ends_with("/Health")
}

/// Opens a [`server_span`] around every gRPC call but health checks; when
/// nobody reads spans, only around calls that continue a caller's trace
/// (see `CALL_SPANS_READ`).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcTraceLayer;

impl<S> tower::Layer<S> for GrpcTraceLayer {
    type Service = GrpcTrace<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcTrace { inner }
    }
}

/// The service [`GrpcTraceLayer`] wraps around `S`.
#[derive(Debug, Clone)]
pub struct GrpcTrace<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for GrpcTrace<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        let spans_read = CALL_SPANS_READ.load(std::sync::atomic::Ordering::Relaxed);
        let span = if wants_call_span(path, request.headers(), spans_read) {
            server_span(path, extract(request.headers()))
        } else {
            tracing::Span::none()
        };
        let future = span.in_scope(|| self.inner.call(request));
        future.instrument(span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_a_w3c_traceparent() {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        let cx = extract(&headers);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(
            !extract(&http::HeaderMap::new())
                .span()
                .span_context()
                .is_valid()
        );
    }

    #[test]
    fn a_call_gets_a_span_when_spans_are_read_or_it_continues_a_trace() {
        let method = "/sessiond.v1.SessionService/GetSessionStatus";
        let none = http::HeaderMap::new();
        let mut traced = http::HeaderMap::new();
        traced.insert(
            "traceparent",
            http::HeaderValue::from_static(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            ),
        );
        assert!(wants_call_span(method, &none, true));
        assert!(wants_call_span(method, &traced, true));
        assert!(wants_call_span(method, &traced, false));
        assert!(!wants_call_span(method, &none, false));
        // Health checks never get one.
        for probe in [
            "/grpc.health.v1.Health/Check",
            "/agentctl.v1.AgentCtlService/Health",
        ] {
            assert!(!wants_call_span(probe, &traced, true));
        }
    }
}
