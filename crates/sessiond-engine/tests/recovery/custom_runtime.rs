//! A custom runtime's driver, registered on a bare `SessionManager` (an
//! embedder's, with no remote or Docker driver beside it).

use std::{sync::Arc, time::Duration};

use sessiond_domain::{ExecutorStatus, Runtime, SessionState};
use sessiond_engine::SessionManager;
use sessiond_executor::{ClientConfig, Executor};

use crate::{
    common::{bin, local_drivers},
    support::{Db, World, expected_reply, kill_tree},
    wrapper::{WrapperConfig, WrapperExecutor},
};

fn runtime() -> Runtime {
    Runtime::parse("wrapper").unwrap()
}

/// The embedder's drivers: the built-in standalone one, and the custom
/// one when `with_custom`.
fn manager(w: &World, with_custom: bool) -> SessionManager {
    let standalone = local_drivers(w.path("").as_path())
        .into_iter()
        .find(|d| d.runtime() == Runtime::LocalStandalone)
        .unwrap();
    let mut drivers: Vec<Arc<dyn Executor>> = vec![standalone];
    if with_custom {
        drivers.push(Arc::new(WrapperExecutor::new(WrapperConfig {
            runtime: runtime(),
            wrapper: vec!["/usr/bin/env".into()],
            agentctl: bin("agentctl"),
            run_dir: w.path("wrapper-run"),
            env: vec![("PATH".into(), std::env::var("PATH").unwrap_or_default())],
            client: ClientConfig {
                connect_timeout: Duration::from_secs(2),
                call_timeout: Duration::from_secs(10),
                ..ClientConfig::default()
            },
            startup_timeout: Duration::from_secs(20),
        })));
    }
    SessionManager::new(w.store.clone(), drivers, w.config())
}

/// helper-44 1: a session of a custom runtime parked while its driver was
/// missing (`runtime_not_registered`) stayed parked for good under a
/// manager with no remote or Docker driver: startup recovery read failed
/// executors only when one of those was registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_custom_runtime_comes_back_without_other_drivers() {
    let w = World::new(Db::Sqlite).await;
    let mgr = manager(&w, true);
    let s = w
        .create_rt(&mgr, "custom", &w.profile, runtime(), None)
        .await;
    assert_eq!(s.state, SessionState::WaitingForInput, "{s:?}");
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    // Without its driver: parked.
    let mgr = manager(&w, false);
    mgr.recovery().recover_all().await.unwrap();
    let parked = w.record(s.id).await;
    assert_eq!(parked.status, ExecutorStatus::Error, "{parked:?}");
    assert!(
        parked
            .error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("runtime_not_registered")),
        "{parked:?}"
    );
    mgr.shutdown();
    drop(mgr);

    // The driver is back: taken up again, the conversation goes on.
    let mgr = manager(&w, true);
    mgr.recovery().recover_all().await.unwrap();
    let back = w.record(s.id).await;
    assert_eq!(back.status, ExecutorStatus::Ready, "{back:?}");
    assert_eq!(back.generation, parked.generation + 1, "{back:?}");
    w.track(s.id).await;
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}
