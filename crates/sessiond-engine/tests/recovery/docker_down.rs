//! The Docker engine down when the backend starts. The backend reaches the
//! engine through a Unix-socket relay of this test (`EngineRelay`) in front
//! of the real engine: closing the relay is an engine that does not answer
//! (connection refused), opening it again is the engine back.

use std::{path::PathBuf, sync::Arc, time::Duration};

use sessiond_domain::{ExecutorStatus, OutcomeLabel, Runtime, SessionState};
use sessiond_engine::SessionManager;
use sessiond_executor::{
    ClientConfig, Executor, ExecutorHandle,
    docker::{DockerConfig, DockerExecutor},
};
use tokio::{net::UnixListener, task::JoinHandle};

use crate::{
    docker_support::{
        DockerEnv, DockerKit, demo_profile_in_docker, docker_driver, docker_env, drivers_with,
    },
    private_engine::PrivateEngine,
    support::{Db, World, drivers_in, expected_reply},
};

/// Relays connections from `path` to the engine's socket while open.
struct EngineRelay {
    path: PathBuf,
    engine: PathBuf,
    task: Option<JoinHandle<()>>,
}

impl EngineRelay {
    fn new(path: PathBuf, engine_host: &str) -> Self {
        let engine = PathBuf::from(
            engine_host
                .strip_prefix("unix://")
                .unwrap_or_else(|| panic!("the test engine must be a unix socket: {engine_host}")),
        );
        Self {
            path,
            engine,
            task: None,
        }
    }

    fn open(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let listener = UnixListener::bind(&self.path).unwrap();
        let engine = self.engine.clone();
        self.task = Some(tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                let engine = engine.clone();
                tokio::spawn(async move {
                    if let Ok(mut upstream) = tokio::net::UnixStream::connect(&engine).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
            }
        }));
    }

    /// Nothing listens any more: connecting is refused, as with no engine.
    fn close(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for EngineRelay {
    fn drop(&mut self) {
        self.close();
    }
}

/// A backend started while the engine does not answer: it starts (a lazy
/// driver, `DockerExecutor::new`), recovers the standalone session, and puts
/// the Docker executor in `error` with `docker_unavailable` while its
/// session keeps its state. When the engine answers again, the background
/// retry starts the container and resumes the agent with no user call; the
/// conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_down_at_start_recovers_when_the_engine_is_back() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let mgr = kit.manager(&w);
    let d = w
        .create_rt(&mgr, "docker", &kit.profile, Runtime::LocalDocker, None)
        .await;
    let token = d.resume_token.clone().unwrap();
    w.prompt(&mgr, d.id, "one").await;
    let local = w.create(&mgr, "local").await;
    mgr.shutdown();
    drop(mgr);
    // An engine restart stops the containers.
    let before = w.record(d.id).await;
    kit.driver
        .stop(&ExecutorHandle::from_record(&before))
        .await
        .unwrap();

    let mut relay = EngineRelay::new(w.path("engine.sock"), &kit.env.host);
    let mut config = DockerConfig::new(
        format!("unix://{}", relay.path.display()),
        kit.env.image.clone(),
        w.dir.path().join("docker-run"),
    );
    config.client = ClientConfig {
        connect_timeout: Duration::from_secs(1),
        call_timeout: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    config.stop_grace = Duration::from_secs(2);
    config.idle_timeout = Some(Duration::from_secs(300));
    let lazy = DockerExecutor::new(config).unwrap();
    assert!(lazy.engine().await.is_err(), "no engine answers yet");
    let mut drivers = drivers_in(w.dir.path());
    drivers.push(Arc::new(lazy));
    let mgr = SessionManager::new(w.store.clone(), drivers, w.config());
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    let st = w.status(&mgr, d.id).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Error));
    assert_eq!(
        st.state,
        SessionState::WaitingForInput,
        "session left as it was"
    );
    let rec = w.record(d.id).await;
    assert!(
        rec.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("docker_unavailable:")),
        "{rec:?}"
    );
    let st = w.status(&mgr, local.id).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));

    // The engine answers again.
    relay.open();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, d.id).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.state, SessionState::WaitingForInput);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the Docker executor never came back: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = w.record(d.id).await;
    assert_eq!(
        after.generation,
        before.generation + 1,
        "the container was started"
    );
    assert_eq!(
        after.container_id, before.container_id,
        "the same container"
    );
    let reply = w.prompt(&mgr, d.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[d.id, local.id]).await;
    drop(relay);
}

/// The Docker engine restarts while the backend serves: a dockerd of this
/// test's own is stopped (TERM: it stops its containers, then exits) and
/// started again. The session's agentctl stops answering; that passes by
/// itself, so the session is never ERROR: the executor shows why it is
/// recovering, and once the engine answers again the background retry starts
/// the container and resumes the agent with no user call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn engine_restart_while_serving_recovers_by_itself() {
    let w = World::new(Db::Sqlite).await;
    let shared = docker_env();
    let mut engine = tokio::task::spawn_blocking(move || PrivateEngine::start(&shared))
        .await
        .unwrap();
    let env = DockerEnv {
        host: engine.host.clone(),
        image: docker_env().image,
    };
    let driver = docker_driver(&env, w.dir.path()).await;
    let profile = demo_profile_in_docker(&w, "demo-in-private-docker", &[]).await;
    let manager_config = sessiond_engine::ManagerConfig {
        liveness_interval: Some(Duration::from_millis(200)),
        ..w.config()
    };
    let mgr = SessionManager::new(
        w.store.clone(),
        drivers_with(w.dir.path(), &driver),
        manager_config,
    );
    mgr.recovery().recover_all().await.unwrap();
    let d = w
        .create_rt(&mgr, "docker", &profile, Runtime::LocalDocker, None)
        .await;
    let token = d.resume_token.clone().unwrap();
    w.prompt(&mgr, d.id, "one").await;
    let before = w.record(d.id).await;

    // The engine stops, and its containers with it.
    let mut engine = tokio::task::spawn_blocking(move || {
        engine.stop_daemon();
        engine
    })
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let st = w.status(&mgr, d.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        let rec = w.record(d.id).await;
        if rec.status == ExecutorStatus::Error {
            let why = rec.error_message.clone().unwrap_or_default();
            assert!(
                why.starts_with("recovering:") || why.starts_with("docker_unavailable:"),
                "{why}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the stopped engine was never noticed: {rec:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A while without the engine: retried, never ERROR.
    for _ in 0..20 {
        let st = w.status(&mgr, d.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The engine starts again: back by itself.
    let engine = tokio::task::spawn_blocking(move || {
        engine.run_daemon();
        engine
    })
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let st = w.status(&mgr, d.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.state, SessionState::WaitingForInput);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the Docker executor never came back: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = w.record(d.id).await;
    assert!(
        after.generation > before.generation,
        "the container was started"
    );
    assert_eq!(
        after.container_id, before.container_id,
        "the same container"
    );
    w.track(d.id).await;
    let reply = w.prompt(&mgr, d.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[d.id]).await;
    tokio::task::spawn_blocking(move || drop(engine))
        .await
        .unwrap();
}

/// helper-37 D2: a create whose container cannot start (a `user` the image
/// does not have) stored its ERROR and left the container `Created`, with
/// its run directory and secret, until the session was deleted. They go
/// with the failed create now; the session says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn a_container_that_cannot_start_leaves_nothing_behind() {
    let w = World::new(Db::Sqlite).await;
    let env = docker_env();
    let mut config = crate::docker_support::docker_config(&env, w.dir.path(), &[]);
    config.user = Some("sessiond-no-such-user".into());
    let driver = crate::docker_support::docker_driver_from(&env, config).await;
    let profile = demo_profile_in_docker(&w, "demo-in-docker", &[]).await;
    let mgr = SessionManager::new(
        w.store.clone(),
        drivers_with(w.dir.path(), &driver),
        w.config(),
    );
    let s = w
        .create_rt(&mgr, "no-user", &profile, Runtime::LocalDocker, None)
        .await;
    assert_eq!(s.state, SessionState::Error, "{s:?}");
    let why = s.error_message.clone().unwrap_or_default();
    assert!(why.contains("could not start agentctl"), "{why}");
    let label = s.id.to_string();
    let left: Vec<_> = driver
        .labelled_containers()
        .await
        .unwrap()
        .into_iter()
        .filter(|c| c.labels.get(sessiond_executor::docker::LABEL_SESSION_ID) == Some(&label))
        .collect();
    assert!(left.is_empty(), "containers left: {left:?}");
    let executor = w.record(s.id).await.id.to_string();
    let run: Vec<_> = std::fs::read_dir(w.dir.path().join("docker-run"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&executor))
                .collect()
        })
        .unwrap_or_default();
    assert!(run.is_empty(), "run directory entries left: {run:?}");
    mgr.shutdown();
}

/// helper-37 D3: a create while the Docker engine did not answer stored a
/// session that could only be ERROR. The engine's ping comes first now: the
/// create is UNAVAILABLE, naming the engine, and nothing is stored; once
/// the engine answers again a create works. Both an engine never reached
/// and one that stopped answering after the driver had negotiated with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn a_create_while_the_engine_is_down_stores_nothing() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let mut relay = EngineRelay::new(w.path("engine.sock"), &kit.env.host);
    let host = format!("unix://{}", relay.path.display());
    let mut config = DockerConfig::new(
        host.clone(),
        kit.env.image.clone(),
        w.dir.path().join("docker-run"),
    );
    config.stop_grace = Duration::from_secs(2);
    let lazy = DockerExecutor::new(config).unwrap();
    let mut drivers = drivers_in(w.dir.path());
    drivers.push(Arc::new(lazy));
    let mgr = SessionManager::new(w.store.clone(), drivers, w.config());
    mgr.recovery().recover_all().await.unwrap();
    let create = |name: &'static str| {
        mgr.create_session(sessiond_engine::NewSession {
            task_id: w.task.id,
            agent_profile_id: kit.profile.id,
            runtime: Runtime::LocalDocker,
            worktree: w.worktree(name),
            remote: None,
            metadata: Default::default(),
            mcp_servers: Vec::new(),
        })
    };
    let refused = |e: sessiond_engine::Error| {
        assert_eq!(e.kind(), sessiond_engine::ErrorKind::Unavailable, "{e}");
        let text = e.to_string();
        assert!(
            text.contains("does not answer") && text.contains(&host),
            "{text}"
        );
    };

    // Never reached.
    refused(create("never").await.unwrap_err());
    assert!(w.store.list_sessions(w.task.id).await.unwrap().is_empty());

    relay.open();
    let up = create("up").await.unwrap();
    w.track(up.id).await;
    assert_eq!(up.state, SessionState::WaitingForInput, "{up:?}");

    // Negotiated once, then gone.
    relay.close();
    refused(create("gone").await.unwrap_err());
    let stored = w.store.list_sessions(w.task.id).await.unwrap();
    assert_eq!(
        stored.iter().map(|s| s.id).collect::<Vec<_>>(),
        vec![up.id],
        "only the session created while the engine answered"
    );

    relay.open();
    let back = create("back").await.unwrap();
    w.track(back.id).await;
    assert_eq!(back.state, SessionState::WaitingForInput, "{back:?}");
    w.finish(&mgr, &[up.id, back.id]).await;
    drop(relay);
}
