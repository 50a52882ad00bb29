//! The agentctl client against a real agentctl: per-call deadlines, message
//! sizes, update cursors across agentctl processes.

use std::time::{Duration, Instant};

use sessiond_executor::{AgentctlClient, Error, with_deadline};
use sessiond_proto::agentctl::v1::{self as pb, agent_update::Kind};

use crate::support::{ManualAgentctl, client_config};

fn sleep_request(secs: u32, timeout_ms: u64) -> pb::ExecRequest {
    pb::ExecRequest {
        command: "sleep".into(),
        args: vec![secs.to_string()],
        timeout_ms,
        ..Default::default()
    }
}

/// `call_timeout` is 2 s here; calls with a longer budget of their own must
/// not be cut off at it, and every call still has a deadline.
#[tokio::test]
async fn long_calls_get_their_own_deadline() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let client =
        AgentctlClient::new(&agentctl.url(), &agentctl.secret, &client_config()).expect("client");
    assert_eq!(client.call_timeout(), Duration::from_secs(2));

    // Typed: the deadline is the request's timeout plus the margin.
    let out = client
        .exec(sleep_request(3, 10_000))
        .await
        .expect("a 3 s command with a 10 s timeout is not cut off at 2 s");
    assert_eq!(out.exit_code, Some(0));

    // agentctl's own timeout fires first and says so.
    let started = Instant::now();
    let out = client
        .exec(sleep_request(30, 500))
        .await
        .expect("timed out inside agentctl, not on the wire");
    assert!(out.timed_out);
    assert!(started.elapsed() < Duration::from_secs(5));

    // Raw: still authenticated, with the method's default deadline (Exec: 60 s
    // plus margin) ...
    let out = client
        .raw()
        .exec(sleep_request(3, 10_000))
        .await
        .expect("raw exec with the default deadline")
        .into_inner();
    assert_eq!(out.exit_code, Some(0));
    // ... or the caller's own, which agentctl sees as `grpc-timeout`.
    let started = Instant::now();
    let status = client
        .raw()
        .exec(with_deadline(
            sleep_request(10, 20_000),
            Duration::from_millis(700),
        ))
        .await
        .expect_err("the caller's deadline");
    // Whichever side's deadline fires first: agentctl's (DEADLINE_EXCEEDED)
    // or this channel's (CANCELLED, "Timeout expired").
    assert!(
        status.code() == tonic::Code::DeadlineExceeded
            || (status.code() == tonic::Code::Cancelled && status.message().contains("Timeout")),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    // Quick calls keep the short deadline.
    client.health().await.expect("health");
    agentctl.kill().await;
}

#[tokio::test]
async fn messages_above_4_mib_in_both_directions() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let client =
        AgentctlClient::new(&agentctl.url(), &agentctl.secret, &client_config()).expect("client");
    let content: Vec<u8> = (0..12u32 << 20).map(|i| (i % 253) as u8).collect();
    let written = client
        .write_file(pb::WriteFileRequest {
            path: "big.bin".into(),
            content: content.clone(),
            create_parents: false,
        })
        .await
        .expect("12 MiB write");
    assert_eq!(written, content.len() as u64);
    let read = client
        .read_file(pb::ReadFileRequest {
            path: "big.bin".into(),
            max_bytes: 0,
        })
        .await
        .expect("12 MiB read");
    assert!(read == content, "content differs");
    let raw = client
        .raw()
        .read_file(pb::ReadFileRequest {
            path: "big.bin".into(),
            max_bytes: 0,
        })
        .await
        .expect("12 MiB read through raw()")
        .into_inner();
    assert_eq!(raw.content.len(), content.len());
    agentctl.kill().await;
}

#[tokio::test]
async fn update_cursors_belong_to_an_agentctl_instance() {
    let workspace = tempfile::tempdir().expect("workspace");
    let agentctl = ManualAgentctl::start(workspace.path(), "127.0.0.1:0").await;
    let client =
        AgentctlClient::new(&agentctl.url(), &agentctl.secret, &client_config()).expect("client");
    let health = client.health().await.expect("health");
    assert_eq!(health.instance_id.len(), 32, "{health:?}");

    // A cursor of some earlier agentctl process: a gap first.
    let mut stream = client
        .stream_updates(7, "an-earlier-agentctl")
        .await
        .expect("stream");
    let first = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("an update in time")
        .expect("stream ok")
        .expect("not ended");
    assert_eq!(first.instance_id, health.instance_id);
    match first.kind {
        Some(Kind::Gap(g)) => {
            assert_eq!(g.requested_after, 7);
            assert_eq!(g.next_cursor, 1);
        }
        other => panic!("expected a gap, got {other:?}"),
    }
    drop(stream);

    // Its own instance: no gap (nothing happened yet, so nothing arrives).
    let mut stream = client
        .stream_updates(0, &health.instance_id)
        .await
        .expect("stream");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), stream.message())
            .await
            .is_err()
    );
    drop(stream);
    agentctl.kill().await;
}

/// The error of a never-answering peer still comes within the deadline.
#[tokio::test]
async fn a_silent_listener_times_out_each_call_kind() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let client = AgentctlClient::new(&url, "s", &client_config()).expect("client");
    let started = Instant::now();
    let err = client.health().await.expect_err("silent");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let err = client
        .stream_updates(0, "")
        .await
        .expect_err("silent stream open");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(4));
    drop(listener);
}
