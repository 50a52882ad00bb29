//! Traces as an operator's collector receives them: an in-test OTLP/gRPC
//! receiver (the collector's `TraceService`, served by tonic) gets the spans
//! of one SendMessage from the real sessiond and the real agentctl it
//! started, all in the trace the client opened with its `traceparent`.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::any_value::Value,
    trace::v1::{Span, span::SpanKind},
};
use sessiond_proto::sessiond::v1 as pb;

use crate::support::*;

/// Every span received, with the `service.name` of its resource.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn start_collector() -> (SocketAddr, Collector) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let service = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (addr, collector)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

/// The one span of `service` named `name` in `trace`, once it arrived.
fn find<'a>(
    spans: &'a [(String, Span)],
    service: &str,
    trace: &str,
    name: &str,
) -> Option<&'a Span> {
    spans
        .iter()
        .find(|(s, span)| s == service && hex(&span.trace_id) == trace && span.name == name)
        .map(|(_, span)| span)
}

/// A test's directories and a config whose `traced` agent (the demo
/// agent) writes down the traceparent each prompt brings it.
struct Traced {
    dir: tempfile::TempDir,
    data: std::path::PathBuf,
    work: std::path::PathBuf,
    log: std::path::PathBuf,
    traceparents: std::path::PathBuf,
    config: String,
}

fn traced() -> Traced {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let traceparents = dir.path().join("traceparents.txt");
    let config = dir.path().join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"traced\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_TRACEPARENT_FILE = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            dir.path().join("agent-state").display(),
            traceparents.display()
        ),
    )
    .unwrap();
    Traced {
        data: dir.path().join("data"),
        log: dir.path().join("sessiond.log"),
        config: config.display().to_string(),
        work,
        traceparents,
        dir,
    }
}

/// One SendMessage with a client `traceparent`: the collector receives
/// sessiond's server span (child of the client's span), sessiond's client
/// span for agentctl's Prompt (its child), agentctl's server span for that
/// Prompt (a child across the process boundary) and agentctl's span of the
/// agent's turn (its child, with the ACP stop reason), all in the client's
/// trace; and the JSON log lines of sessiond (inside the call) and of
/// agentctl (inside the turn) carry that trace id and their span's id; the
/// agent receives the turn span's context in ACP's `_meta.traceparent`.
/// Then, after a kill -9 of sessiond, startup recovery is one trace with a
/// span for the session's executor.
#[tokio::test]
async fn one_send_message_is_one_trace_across_sessiond_and_agentctl() {
    let (collector_addr, collector) = start_collector().await;
    let Traced {
        dir: _dir,
        data,
        work,
        log,
        traceparents,
        config,
    } = traced();
    let endpoint = format!("http://{collector_addr}");
    let server = start_with(
        &data,
        &[
            "--config",
            &config,
            "--otlp-endpoint",
            &endpoint,
            "--log-json",
        ],
        Some(TOKEN),
        Some(&log),
    );
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "traced").await;
    let session = create_session(&mut c, &task.id, &work, "traced").await;

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut request = tonic::Request::new(pb::SendMessageRequest {
        task_id: task.id.clone(),
        session_id: session.id.clone(),
        content: "hello".into(),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace}-{client_span}-01").parse().unwrap(),
    );
    c.send_message(request).await.unwrap();

    // Batches leave every few seconds; wait for all four spans.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let spans = loop {
        let spans = collector.spans.lock().unwrap().clone();
        let all = find(
            &spans,
            "sessiond",
            trace,
            "sessiond.v1.SessionService/SendMessage",
        )
        .is_some()
            && find(
                &spans,
                "sessiond",
                trace,
                "agentctl.v1.AgentCtlService/Prompt",
            )
            .is_some()
            && find(
                &spans,
                "agentctl",
                trace,
                "agentctl.v1.AgentCtlService/Prompt",
            )
            .is_some()
            && find(&spans, "agentctl", trace, "agent turn").is_some();
        if all {
            break spans;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every span of the trace arrived: {:#?}",
            spans
                .iter()
                .map(|(s, x)| (s, &x.name, hex(&x.trace_id)))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let send = find(
        &spans,
        "sessiond",
        trace,
        "sessiond.v1.SessionService/SendMessage",
    )
    .unwrap();
    assert_eq!(hex(&send.parent_span_id), client_span, "{send:#?}");
    assert_eq!(send.kind, SpanKind::Server as i32);
    assert_eq!(
        attribute(send, "rpc.method").as_deref(),
        Some("SendMessage")
    );

    let prompt_out = find(
        &spans,
        "sessiond",
        trace,
        "agentctl.v1.AgentCtlService/Prompt",
    )
    .unwrap();
    assert_eq!(prompt_out.kind, SpanKind::Client as i32);
    assert_eq!(hex(&prompt_out.parent_span_id), hex(&send.span_id));

    let prompt_in = find(
        &spans,
        "agentctl",
        trace,
        "agentctl.v1.AgentCtlService/Prompt",
    )
    .unwrap();
    assert_eq!(prompt_in.kind, SpanKind::Server as i32);
    assert_eq!(
        hex(&prompt_in.parent_span_id),
        hex(&prompt_out.span_id),
        "agentctl continues sessiond's trace"
    );

    let turn = find(&spans, "agentctl", trace, "agent turn").unwrap();
    assert_eq!(hex(&turn.parent_span_id), hex(&prompt_in.span_id));
    assert_eq!(
        attribute(turn, "acp.stop_reason").as_deref(),
        Some("end_turn"),
        "{turn:#?}"
    );
    assert!(turn.end_time_unix_nano >= turn.start_time_unix_nano);
    // The agent itself got the turn's context (ACP `_meta.traceparent`).
    assert_eq!(
        std::fs::read_to_string(&traceparents).unwrap(),
        format!("00-{trace}-{}-01\n", hex(&turn.span_id))
    );

    // sessiond's own log line of the call leads to the trace.
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("the agent's turn started"))
        .unwrap_or_else(|| panic!("no log line of the SendMessage in:\n{text}"));
    let json: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(json["trace_id"], trace, "{line}");
    assert_eq!(json["span_id"], hex(&send.span_id), "{line}");
    // So does agentctl's (JSON because sessiond logs JSON), from the turn.
    let agentctl_logs: String = std::fs::read_dir(data.join("logs"))
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    let line = agentctl_logs
        .lines()
        .find(|l| l.contains("turn ended"))
        .unwrap_or_else(|| panic!("no agentctl log line of the turn in:\n{agentctl_logs}"));
    let json: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(json["trace_id"], trace, "{line}");
    assert_eq!(json["span_id"], hex(&turn.span_id), "{line}");

    // kill -9 and start again: startup recovery is one trace with a span
    // per executor, naming it and its outcome.
    let mut server = server;
    server.kill();
    let server = start_with(
        &data,
        &["--config", &config, "--otlp-endpoint", &endpoint],
        Some(TOKEN),
        None,
    );
    let executor = {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let spans = collector.spans.lock().unwrap().clone();
            // The first start's pass had nothing to recover.
            let one = spans
                .iter()
                .filter(|(s, x)| s == "sessiond" && x.name == "startup_recovery")
                .find_map(|(_, pass)| {
                    spans
                        .iter()
                        .find(|(s, x)| {
                            s == "sessiond"
                                && x.name == "recover_executor"
                                && x.trace_id == pass.trace_id
                                && x.parent_span_id == pass.span_id
                        })
                        .map(|(_, x)| x.clone())
                });
            if let Some(one) = one {
                break one;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no recover_executor span under startup_recovery: {:#?}",
                spans.iter().map(|(s, x)| (s, &x.name)).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    assert_eq!(
        attribute(&executor, "session_id").as_deref(),
        Some(session.id.as_str()),
        "{executor:#?}"
    );
    assert_eq!(
        attribute(&executor, "runtime").as_deref(),
        Some("local_standalone")
    );
    // agentctl survived: reattached (or, if it answered too late on a
    // loaded machine, relaunched and resumed); never failed.
    assert!(
        matches!(
            attribute(&executor, "outcome").as_deref(),
            Some("reattached" | "resumed")
        ),
        "{executor:#?}"
    );
    drop(server);
}

/// Lines of `path` once it has `n` lines that contain `needle`.
async fn lines_with(path: &std::path::Path, needle: &str, n: usize) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} has {} of {n} lines with {needle:?}:\n{text}",
            path.display(),
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Without an OTLP endpoint (and logs at INFO) nobody reads spans, so a
/// call's span only carries a caller's trace: a SendMessage with a
/// `traceparent` still logs that trace id and hands the trace on to
/// agentctl and the agent; one without opens no call span, so its log line
/// carries no trace id (nothing to lead to).
#[tokio::test]
async fn without_an_exporter_a_call_keeps_only_a_callers_trace() {
    let Traced {
        dir: _dir,
        data,
        work,
        log,
        traceparents,
        config,
    } = traced();
    let server = start_env(
        &data,
        &["--config", &config, "--log-json"],
        Some(TOKEN),
        Some(&log),
        &[("SESSIOND_LOG", std::path::Path::new("info"))],
    );
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "traced").await;
    let session = create_session(&mut c, &task.id, &work, "traced").await;
    let send = |traceparent: Option<String>| {
        let mut request = tonic::Request::new(pb::SendMessageRequest {
            task_id: task.id.clone(),
            session_id: session.id.clone(),
            content: "hello".into(),
            ..Default::default()
        });
        if let Some(tp) = traceparent {
            request
                .metadata_mut()
                .insert("traceparent", tp.parse().unwrap());
        }
        request
    };

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let sent = c
        .send_message(send(Some(format!("00-{trace}-00f067aa0ba902b7-01"))))
        .await
        .unwrap()
        .into_inner()
        .message
        .expect("the turn started at once");
    let started = lines_with(&log, "the agent's turn started", 1).await;
    let json: serde_json::Value = serde_json::from_str(&started[0]).unwrap();
    assert_eq!(json["trace_id"], trace, "{}", started[0]);
    // agentctl's turn continued it, and handed it to the agent.
    let handed = lines_with(&traceparents, "00-", 1).await;
    assert!(handed[0].starts_with(&format!("00-{trace}-")), "{handed:?}");
    turn_end(&mut c, &session.id, &sent.id).await;

    c.send_message(send(None)).await.unwrap();
    let started = lines_with(&log, "the agent's turn started", 2).await;
    let json: serde_json::Value = serde_json::from_str(&started[1]).unwrap();
    assert!(json.get("trace_id").is_none(), "{}", started[1]);
    assert!(json.get("span_id").is_none(), "{}", started[1]);
    drop(server);
}
