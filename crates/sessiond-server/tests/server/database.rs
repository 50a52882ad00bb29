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

/// PostgreSQL not answering yet when `sessiond serve` starts (the machine
/// booting, both restarted together): sessiond waits for it, saying so in
/// its log, and serves once it answers, instead of exiting. Meanwhile it
/// listens (helper-50 4b: connections were refused): health says
/// NOT_SERVING, a call is UNAVAILABLE `database_unavailable` with
/// `retry-after-ms` and the database's error, and auth still applies.
#[tokio::test]
async fn serve_waits_for_a_database_that_is_not_up_yet() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let cluster = tokio::task::spawn_blocking(sessiond_testkit::postgres::start_cluster)
        .await
        .unwrap();
    let db = cluster.create_database();
    // A port nothing listens on yet: the database "is not up".
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let real = format!("127.0.0.1:{}", cluster.port());
    let url = db.url().replacen(&real, &format!("127.0.0.1:{port}"), 1);
    assert_ne!(url, db.url(), "the test database's URL names {real}");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("sessiond.log");
    let server = {
        let (data, log, url) = (dir.path().join("data"), log.clone(), url.clone());
        tokio::task::spawn_blocking(move || {
            start_with(&data, &["--database-url", &url], Some(TOKEN), Some(&log))
        })
    };
    // It listens while it waits, and says it waits.
    let server = tokio::time::timeout(Duration::from_secs(120), server)
        .await
        .expect("sessiond does not listen while it waits for its database")
        .unwrap();
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.contains("waiting for it (sessiond serves once it answers"),
        "{logged}"
    );

    let mut health = HealthClient::new(channel(&server.addr).await);
    for service in ["", "sessiond.v1.SessionService"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::NotServing, "{service:?}");
    }
    // A health Watch opened now says NOT_SERVING, and ends once the real
    // server takes over (helper-59 3: it stayed open, NOT_SERVING).
    let (mut watch, first) = health_watch(&server.addr).await;
    assert_eq!(first, ServingStatus::NotServing);
    // The metrics endpoint: alive, not ready (helper-59 2: it answered
    // nothing until the database did).
    let metrics = server.metrics.clone().expect("a metrics address");
    let (status, _) = crate::metrics::http_get(&metrics, "/livez").await;
    assert!(status.contains(" 200 "), "{status}");
    let (status, body) = crate::metrics::http_get(&metrics, "/readyz").await;
    assert!(status.contains(" 503 "), "{status}");
    assert!(body.contains("database does not answer yet"), "{body}");
    let mut c = sessions(&server).await;
    let err = c
        .list_tasks(pb::ListTasksRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(
        err.metadata().get("sessiond-error").unwrap(),
        "database_unavailable",
        "{err:?}"
    );
    assert!(err.metadata().get("retry-after-ms").is_some(), "{err:?}");
    assert!(
        err.message().contains("database does not answer yet") && err.message().contains("retry"),
        "{}",
        err.message()
    );
    let mut anonymous = sessions_with(&server, None).await;
    let err = anonymous
        .list_tasks(pb::ListTasksRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // The database comes up on that port: a forwarder to the cluster.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let forward = tokio::spawn(async move {
        loop {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let real = real.clone();
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(real).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    // The same clients, on the same address, are served once it answers.
    let deadline = Instant::now() + Duration::from_secs(120);
    let task = loop {
        match c
            .create_task(pb::CreateTaskRequest {
                title: "after the wait".into(),
            })
            .await
        {
            Ok(task) => break task.into_inner(),
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                assert!(Instant::now() < deadline, "never served: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(!task.task.unwrap().id.is_empty());
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match watch.message().await {
                Ok(Some(m)) => assert_eq!(m.status(), ServingStatus::NotServing),
                other => break other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the Watch opened while waiting stayed open");
    drop(ended);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = health
            .check(HealthCheckRequest::default())
            .await
            .map(|r| r.into_inner().status());
        if matches!(status, Ok(ServingStatus::Serving)) {
            break;
        }
        assert!(Instant::now() < deadline, "never SERVING: {status:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = crate::metrics::http_get(&metrics, "/readyz").await;
        if status.contains(" 200 ") {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = crate::metrics::http_get(&metrics, "/metrics").await;
    assert!(
        status.contains(" 200 ") && body.contains("sessiond_"),
        "{status}"
    );
    forward.abort();
}

/// SIGTERM while `serve` waits for its database: it stops cleanly, saying
/// so (helper-59 4: the signal's default action ended it, with no word).
#[tokio::test]
async fn serve_stops_cleanly_on_sigterm_while_it_waits_for_its_database() {
    // A port nothing listens on: the database "is not up".
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/sessiond");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("sessiond.log");
    let mut server = {
        let (data, log) = (dir.path().join("data"), log.clone());
        tokio::task::spawn_blocking(move || {
            start_with(&data, &["--database-url", &url], Some(TOKEN), Some(&log))
        })
        .await
        .unwrap()
    };
    let status = tokio::task::spawn_blocking(move || server.terminate())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.contains("stopped while waiting for the database"),
        "{logged}"
    );
}

/// A database that waiting will not bring (it does not exist) fails the
/// start at once, naming it, rather than being waited for.
#[tokio::test]
async fn serve_does_not_wait_for_a_database_that_does_not_exist() {
    let cluster = tokio::task::spawn_blocking(sessiond_testkit::postgres::start_cluster)
        .await
        .unwrap();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/no_such_db",
        cluster.port()
    );
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (ok, stderr) = tokio::task::spawn_blocking(move || {
        run_sessiond(
            &[
                "serve",
                "--insecure-no-auth",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                data.to_str().unwrap(),
                "--database-url",
                &url,
            ],
            &[],
        )
    })
    .await
    .unwrap();
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("no_such_db"), "{stderr}");
    assert!(
        !stderr.contains("waiting for it (sessiond serves once it answers)"),
        "{stderr}"
    );
    // PostgreSQL's answer, at once: not the pool's retries, each warning,
    // until its 10 s timeout (helper-50 4).
    assert!(
        !stderr.contains("cannot connect to the database"),
        "{stderr}"
    );
}
