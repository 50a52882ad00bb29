//! The child backend: this test binary re-executed with [`CHILD_ENV`] set,
//! running a `SessionManager` on the test's store until it is SIGKILLed (by
//! the parent, or by itself at a failpoint configured in `FAILPOINTS`).
//!
//! It prints marker lines on stdout for the parent: `CRASHLOOP RECOVERING`,
//! `CRASHLOOP RECOVERED`, `CRASHLOOP CREATED`, `CRASHLOOP RESUMED`,
//! `CRASHLOOP FAILPOINT <name>`.

use std::{
    collections::HashMap,
    io::Write,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use sessiond_domain::{MessageRole, Session, SessionState};
use sessiond_engine::{Outgoing, SessionManager};
use sessiond_store::{Store, StoreOptions};

use crate::world::{
    CHILD_ENV, ChildSpec, Mode, NAME_KEY, Plan, drivers, init_tracing, manager_config_in,
    new_session,
};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "CRASHLOOP {line}");
    let _ = out.flush();
}

/// `FAILPOINTS="name=kill;other=kill@3"`: SIGKILL this process at the
/// first (or Nth) hit of the point, as `kill -9` would; any other action is
/// handed to `fail::cfg` (e.g. `name=panic`, `name=sleep(100)`).
fn install_failpoints() {
    let Ok(spec) = std::env::var("FAILPOINTS") else {
        return;
    };
    for entry in spec.split(';').filter(|e| !e.trim().is_empty()) {
        let (name, action) = entry
            .split_once('=')
            .unwrap_or_else(|| panic!("FAILPOINTS entry {entry:?}: expected name=action"));
        let name = name.trim().to_owned();
        if let Some(rest) = action.trim().strip_prefix("kill") {
            let nth: usize = match rest.strip_prefix('@') {
                Some(n) => n.parse().unwrap(),
                None => 1,
            };
            let hits = Arc::new(AtomicUsize::new(0));
            let label = name.clone();
            fail::cfg_callback(name.clone(), move || {
                if hits.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                    say(&format!("FAILPOINT {label}"));
                    eprintln!("child backend: failpoint {label} hit, SIGKILLing myself");
                    let _ = rustix::process::kill_process(
                        rustix::process::getpid(),
                        rustix::process::Signal::KILL,
                    );
                    std::process::abort();
                }
            })
            .unwrap();
        } else {
            fail::cfg(name, action.trim()).unwrap();
        }
    }
}

// Not a test: `--ignored --exact` runs it in the child process only.
#[ignore = "child-process entry point, not a test"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_backend() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        panic!(
            "a child-process entry point, not a test: started by the crash tests (World::spawn_child) with {CHILD_ENV} set"
        );
    };
    let spec: ChildSpec = serde_json::from_str(&spec).unwrap();
    init_tracing();
    // A create-only backend recovers first like any backend, and arms its
    // failpoints after that: they are meant for the creates.
    let create_only = matches!(spec.mode, Mode::Create { .. });
    if !create_only {
        install_failpoints();
    }
    let store = Store::connect(&spec.db_url, StoreOptions::default())
        .await
        .unwrap();
    let mgr = SessionManager::new(
        store.clone(),
        drivers(&spec.dir, spec.docker_host.as_deref()).await,
        manager_config_in(&spec.dir),
    );
    let child = Child {
        task: spec.task.parse().unwrap(),
        local: spec.local_profile.parse().unwrap(),
        docker: spec.docker_profile.as_ref().map(|p| p.parse().unwrap()),
        spec,
        mgr,
        store,
    };
    match child.spec.mode.clone() {
        Mode::Create { plans, messages } => {
            child.mgr.recovery().recover_all().await.unwrap();
            install_failpoints();
            for plan in &plans {
                child.create(plan).await;
            }
            for plan in &plans {
                let s = child.by_name(&plan.name).await.unwrap();
                for _ in 0..messages {
                    child.turn(&s).await;
                }
            }
            say("CREATED");
        }
        Mode::Recover => {
            // As `sessiond serve` does: an idle agent's exit is pushed.
            child
                .mgr
                .recovery()
                .listen_doorbell(
                    &child
                        .spec
                        .dir
                        .join("run")
                        .join(sessiond_executor::standalone::DOORBELL_FILE),
                )
                .unwrap();
            say("RECOVERING");
            let summary = child.mgr.recovery().recover_all().await.unwrap();
            say(&format!("RECOVERED {:?}", summary.counts));
        }
        Mode::RecoverPrioritised => {
            child
                .mgr
                .recovery()
                .gate_recovery_pass(std::sync::Arc::new(|| Box::pin(std::future::pending())));
            // As `sessiond serve` does: announce the pass before it runs, so
            // a call waits for its queue instead of racing its lease claims.
            child.mgr.recovery().expect_startup_recovery();
            let pass = child.mgr.clone();
            tokio::spawn(async move { pass.recovery().recover_all().await });
            let sessions = child.store.list_sessions(child.task).await.unwrap();
            say("PRIORITISING");
            for s in &sessions {
                child.mgr.recovery().ensure_recovered(s.id).await.unwrap();
                assert!(
                    !child.mgr.recovery().is_recovering(s.id),
                    "{s:?} still recovering"
                );
            }
            say("PRIORITISED");
        }
        Mode::Resume => {
            let summary = child.mgr.recovery().recover_all().await.unwrap();
            say(&format!("RECOVERED {:?}", summary.counts));
            for s in child.store.list_sessions(child.task).await.unwrap() {
                let st = child.mgr.session_status(child.task, s.id).await.unwrap();
                if st.needs_resume {
                    say(&format!("RESUMING {}", s.id));
                    let r = child.mgr.resume_session(child.task, s.id).await;
                    eprintln!("child backend: resume of {}: {r:?}", s.id);
                }
            }
            say("RESUMED");
        }
        Mode::Loop { plans } => {
            say("RECOVERING");
            let summary = child.mgr.recovery().recover_all().await.unwrap();
            say(&format!("RECOVERED {:?}", summary.counts));
            child.work(&plans).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(3600)).await;
}

struct Child {
    spec: ChildSpec,
    task: sessiond_domain::TaskId,
    local: sessiond_domain::AgentProfileId,
    docker: Option<sessiond_domain::AgentProfileId>,
    mgr: SessionManager,
    store: Store,
}

impl Child {
    async fn by_name(&self, name: &str) -> Option<Session> {
        self.store
            .list_sessions(self.task)
            .await
            .unwrap()
            .into_iter()
            .find(|s| s.metadata.get(NAME_KEY).map(String::as_str) == Some(name))
    }

    async fn create(&self, plan: &Plan) {
        let req = new_session(self.task, self.local, self.docker, &self.spec.dir, plan);
        match self.mgr.create_session(req).await {
            Ok(s) => eprintln!(
                "child backend: created {} ({}) {}",
                plan.name, s.id, s.state
            ),
            Err(e) => eprintln!("child backend: creating {} failed: {e}", plan.name),
        }
    }

    /// One user message (numbered after those stored) and the wait for the
    /// turn to end.
    async fn turn(&self, s: &Session) {
        let users = self
            .store
            .list_messages(s.id, 0, 100_000)
            .await
            .unwrap()
            .iter()
            .filter(|m| m.role == MessageRole::User)
            .count();
        let name = s.metadata.get(NAME_KEY).cloned().unwrap_or_default();
        let text = format!("{name} message {}", users + 1);
        // Keyed by its text (unique in its session), as a client that may
        // send it again after a crash would.
        let message = Outgoing {
            text: text.clone(),
            request_id: Some(text),
            ..Outgoing::default()
        };
        if let Err(e) = self.mgr.send_outgoing(self.task, s.id, message).await {
            eprintln!("child backend: {name}: send failed: {e}");
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match self.mgr.session_status(self.task, s.id).await {
                Ok(st) if st.state != SessionState::Running => return,
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        eprintln!("child backend: {name}: turn did not end within 30 s");
    }

    /// Keeps the planned sessions alive until killed: creates the missing
    /// ones, prompts the waiting ones, resumes (once per backend) the ones
    /// in ERROR.
    async fn work(&self, plans: &[Plan]) {
        let mut resumed: HashMap<String, ()> = HashMap::new();
        loop {
            let existing: Vec<String> = self
                .store
                .list_sessions(self.task)
                .await
                .unwrap()
                .iter()
                .filter_map(|s| s.metadata.get(NAME_KEY).cloned())
                .collect();
            let missing: Vec<&Plan> = plans
                .iter()
                .filter(|p| !existing.contains(&p.name))
                .collect();
            futures::future::join_all(missing.into_iter().map(|p| self.create(p))).await;
            let sessions = self.store.list_sessions(self.task).await.unwrap();
            let mut work = Vec::new();
            for s in sessions {
                let name = s.metadata.get(NAME_KEY).cloned().unwrap_or_default();
                match s.state {
                    SessionState::WaitingForInput => {
                        work.push(futures::future::Either::Left(async move {
                            self.turn(&s).await;
                        }))
                    }
                    SessionState::Error if !resumed.contains_key(&name) => {
                        resumed.insert(name.clone(), ());
                        work.push(futures::future::Either::Right(async move {
                            if let Err(e) = self.mgr.resume_session(self.task, s.id).await {
                                eprintln!("child backend: {name}: resume failed: {e}");
                            }
                        }));
                    }
                    _ => {}
                }
            }
            futures::future::join_all(work).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
