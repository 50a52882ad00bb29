//! The database going away under a running sessiond, as clients see it.

use std::time::{Duration, Instant};

use sessiond_proto::sessiond::v1 as pb;
use tonic::Code;

use crate::support::*;

/// PostgreSQL shut down under sessiond (fast shutdown: its connections
/// terminated with "terminating connection due to administrator command",
/// then connection refused): calls answer UNAVAILABLE
/// `database_unavailable` with `retry-after-ms`, which clients retry, not
/// INTERNAL; and they answer at once, not after the pool's 10 s connect
/// timeout each.
#[tokio::test]
async fn a_lost_database_is_unavailable_with_retry_advice() {
    let cluster = tokio::task::spawn_blocking(sessiond_testkit::postgres::start_cluster)
        .await
        .unwrap();
    let db = cluster.create_database();
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &["--database-url", db.url()]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "before the outage").await;

    let pid = cluster.pid();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while proc.exists() {
        assert!(Instant::now() < deadline, "postgres still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The pool's connections were terminated, then none can be opened:
    // every call says so the same way, promptly.
    for i in 0..6 {
        let asked = Instant::now();
        let err = c
            .get_task(pb::GetTaskRequest {
                task_id: task.id.clone(),
            })
            .await
            .unwrap_err();
        let took = asked.elapsed();
        assert_eq!(err.code(), Code::Unavailable, "call {i}: {err:?}");
        assert_eq!(
            err.metadata().get("sessiond-error").unwrap(),
            "database_unavailable",
            "call {i}: {err:?}"
        );
        assert!(err.metadata().get("retry-after-ms").is_some(), "{err:?}");
        assert!(err.message().contains("retry"), "{}", err.message());
        assert!(took < Duration::from_secs(5), "call {i} took {took:?}");
    }
}
