use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::{
    AgentProfile, AgentProfileId, Event, EventPayload, ExecutorRecord, Message, MessageRole,
    Runtime, Session, SessionId, SessionState, SessionStatus, Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{ManagerConfig, NewSession, RemoteAgentctl, SessionManager};
use sessiond_executor::{Backoff, Executor, process};
use sessiond_store::{Store, StoreOptions};

pub use crate::common::{bin, children_of, is_running, kill9};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Db {
    Sqlite,
    Postgres,
}

#[allow(dead_code)] // held for Drop
enum DbGuard {
    None,
    Postgres(sessiond_testkit::postgres::TestDatabase),
}

/// Everything one test owns: a store, directories, a task, profiles, and
/// the processes it must leave behind none of.
pub struct World {
    pub store: Store,
    pub dir: tempfile::TempDir,
    pub task: Task,
    pub profile: AgentProfile,
    pub procs: Procs,
    _db: DbGuard,
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "sessiond_engine=info".into()),
        )
        .with_test_writer()
        .try_init();
}

impl World {
    /// A world on a PostgreSQL database reached through `proxy` (started
    /// here), so the test can take the database away and give it back.
    pub async fn postgres_through_proxy() -> (World, DbProxy) {
        init_tracing();
        let dir = tempfile::tempdir().unwrap();
        let tdb = tokio::task::spawn_blocking(sessiond_testkit::postgres::test_database)
            .await
            .unwrap();
        let (host, rest) = tdb
            .url()
            .split_once('@')
            .and_then(|(user, at)| at.split_once('/').map(|(hp, db)| ((user, hp), db)))
            .map(|((user, hp), db)| (hp.to_owned(), format!("{user}@{{}}/{db}")))
            .expect("a postgres://user@host:port/db URL");
        let proxy = DbProxy::start(host).await;
        let url = rest.replace("{}", &format!("127.0.0.1:{}", proxy.port));
        let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
        (
            World::with_store(store, DbGuard::Postgres(tdb), dir).await,
            proxy,
        )
    }

    pub async fn new(db: Db) -> World {
        init_tracing();
        let dir = tempfile::tempdir().unwrap();
        let (store, guard) = match db {
            Db::Sqlite => {
                let url = format!("sqlite://{}", dir.path().join("sessiond.db").display());
                (
                    Store::connect(&url, StoreOptions::default()).await.unwrap(),
                    DbGuard::None,
                )
            }
            Db::Postgres => {
                let tdb = tokio::task::spawn_blocking(sessiond_testkit::postgres::test_database)
                    .await
                    .unwrap();
                (
                    Store::connect(tdb.url(), StoreOptions::default())
                        .await
                        .unwrap(),
                    DbGuard::Postgres(tdb),
                )
            }
        };
        World::with_store(store, guard, dir).await
    }

    async fn with_store(store: Store, guard: DbGuard, dir: tempfile::TempDir) -> World {
        let now = Utc::now();
        let task = store
            .create_task(&Task {
                id: TaskId::new(),
                title: "recovery test".into(),
                state: TaskState::Todo,
                created_at: now,
                updated_at: now,
            })
            .await
            .unwrap();
        let mut w = World {
            store,
            task,
            profile: placeholder_profile(),
            procs: Procs::default(),
            dir,
            _db: guard,
        };
        w.profile = w.demo_profile("demo", &[]).await;
        w
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// A demo-agent profile with `ACP_DEMO_*` switches.
    pub async fn demo_profile(&self, name: &str, env: &[(&str, &str)]) -> AgentProfile {
        self.profile_with(name, env, true).await
    }

    /// A demo-agent profile whose agents wait at start while the file it
    /// returns exists (`ACP_DEMO_START_GATE_FILE`; the file is not made).
    pub async fn gated_profile(&self, name: &str) -> (AgentProfile, PathBuf) {
        let gate = self.path(&format!("{name}.gate"));
        let text = gate.display().to_string();
        let profile = self
            .demo_profile(name, &[("ACP_DEMO_START_GATE_FILE", text.as_str())])
            .await;
        (profile, gate)
    }

    pub async fn profile_with(
        &self,
        name: &str,
        env: &[(&str, &str)],
        claims_resume: bool,
    ) -> AgentProfile {
        let args = [
            "--state-dir".to_owned(),
            self.path("agent-state").display().to_string(),
        ];
        let command = bin("acp-demo-agent").display().to_string();
        self.upsert_profile(name, &command, &args, env, claims_resume)
            .await
    }

    /// Stores a profile running `command args` with `env` (policy allow).
    pub async fn upsert_profile(
        &self,
        name: &str,
        command: &str,
        args: &[String],
        env: &[(&str, &str)],
        claims_resume: bool,
    ) -> AgentProfile {
        let now = Utc::now();
        self.store
            .upsert_agent_profile(&AgentProfile {
                id: AgentProfileId::new(),
                name: name.into(),
                command: command.into(),
                args: args.to_vec(),
                env: env
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                supports_session_resume: claims_resume,
                container: None,
                auth_method: None,
                permission_policy: sessiond_domain::PermissionPolicy::Allow,
                permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
                config_defaults: Default::default(),
                mcp_servers: Vec::new(),
                created_at: now,
                updated_at: now,
            })
            .await
            .unwrap()
    }

    pub fn worktree(&self, name: &str) -> Worktree {
        let path = self.path(&format!("wt-{name}"));
        std::fs::create_dir_all(&path).unwrap();
        // Docker containers run as the worktree's owner, never as root.
        std::os::unix::fs::chown(&path, Some(1000), Some(1000)).unwrap();
        Worktree {
            id: name.into(),
            path: path.display().to_string(),
            branch: format!("sessiond/{name}"),
            ..Default::default()
        }
    }

    pub fn config(&self) -> ManagerConfig {
        ManagerConfig {
            executor_deadline: Duration::from_secs(10),
            remote_retry_window: Duration::from_secs(120),
            remote_backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_millis(800),
            },
            agent_initialize_timeout: Duration::from_secs(10),
            agent_stop_grace: Duration::from_secs(2),
            ..ManagerConfig::default()
        }
    }

    pub fn drivers(&self) -> Vec<Arc<dyn Executor>> {
        drivers_in(self.dir.path())
    }
}

/// The drivers of a world whose directory is `dir` (also for a child backend).
pub fn drivers_in(dir: &Path) -> Vec<Arc<dyn Executor>> {
    crate::common::local_drivers(dir)
}

impl World {
    pub fn manager(&self) -> SessionManager {
        self.manager_with(self.config())
    }

    pub fn manager_with(&self, config: ManagerConfig) -> SessionManager {
        SessionManager::new(self.store.clone(), self.drivers(), config)
    }

    pub async fn create(&self, mgr: &SessionManager, name: &str) -> Session {
        self.create_with(mgr, name, &self.profile, None).await
    }

    pub async fn create_with(
        &self,
        mgr: &SessionManager,
        name: &str,
        profile: &AgentProfile,
        remote: Option<RemoteAgentctl>,
    ) -> Session {
        let runtime = if remote.is_some() {
            Runtime::Remote
        } else {
            Runtime::LocalStandalone
        };
        self.create_rt(mgr, name, profile, runtime, remote).await
    }

    /// A local standalone session's request: `name`'s worktree, `profile`.
    pub fn new_session(&self, name: &str, profile: &AgentProfile) -> NewSession {
        NewSession {
            task_id: self.task.id,
            agent_profile_id: profile.id,
            runtime: Runtime::LocalStandalone,
            worktree: self.worktree(name),
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        }
    }

    pub async fn create_rt(
        &self,
        mgr: &SessionManager,
        name: &str,
        profile: &AgentProfile,
        runtime: Runtime,
        remote: Option<RemoteAgentctl>,
    ) -> Session {
        let s = mgr
            .create_session(NewSession {
                task_id: self.task.id,
                agent_profile_id: profile.id,
                runtime,
                worktree: self.worktree(name),
                remote,
                metadata: BTreeMap::new(),
                mcp_servers: Vec::new(),
            })
            .await
            .unwrap();
        self.track(s.id).await;
        s
    }

    /// A client of the record's agentctl, made by its runtime's driver.
    pub fn agentctl(&self, record: &ExecutorRecord) -> sessiond_executor::AgentctlClient {
        self.drivers()
            .iter()
            .find(|d| d.runtime() == record.runtime)
            .unwrap()
            .client(&sessiond_executor::ExecutorHandle::from_record(record))
            .unwrap()
    }

    /// Changes the stored session behind every manager's back (as another
    /// writer, or a crash between two writes, would leave it).
    pub async fn write_session(&self, session: SessionId, change: impl FnOnce(&mut Session)) {
        let mut stored = self.store.get_session(session).await.unwrap();
        change(&mut stored);
        self.store
            .commit(sessiond_store::Changeset::new().update_session(stored))
            .await
            .unwrap();
    }

    pub async fn record(&self, session: SessionId) -> ExecutorRecord {
        self.store
            .get_executor_for_session(session)
            .await
            .unwrap()
            .unwrap()
    }

    /// Remembers the session's agentctl and its agent, to check at the end.
    pub async fn track(&self, session: SessionId) {
        if let Some(r) = self.store.get_executor_for_session(session).await.unwrap()
            && let (Some(pid), Some(st)) = (r.pid, r.pid_start_time)
        {
            self.procs.add(pid, st);
            for child in children_of(pid) {
                if let Some(cst) = process::start_time(child) {
                    self.procs.add(child, cst);
                }
            }
        }
    }

    /// Sends a message and waits for the turn to end; returns the reply.
    pub async fn prompt(&self, mgr: &SessionManager, session: SessionId, text: &str) -> String {
        let before = self.messages(session).await.len();
        mgr.send_message(self.task.id, session, text).await.unwrap();
        self.wait_state(mgr, session, SessionState::WaitingForInput)
            .await;
        let msgs = self.messages(session).await;
        assert_eq!(msgs.len(), before + 2, "one user and one agent message");
        let reply = msgs.last().unwrap();
        assert_eq!(reply.role, MessageRole::Agent);
        assert!(reply.complete, "reply complete after the turn");
        reply.content.clone()
    }

    /// The conversation's text (user messages, replies, system notes),
    /// without the agent's activity parts.
    pub async fn messages(&self, session: SessionId) -> Vec<Message> {
        let mut all = self.all_messages(session).await;
        all.retain(|m| m.kind == sessiond_domain::MessageKind::Text);
        all
    }

    /// Every stored message, activity parts included.
    pub async fn all_messages(&self, session: SessionId) -> Vec<Message> {
        self.store.list_messages(session, 0, 10_000).await.unwrap()
    }

    pub async fn status(&self, mgr: &SessionManager, session: SessionId) -> SessionStatus {
        mgr.session_status(self.task.id, session).await.unwrap()
    }

    pub async fn wait_state(&self, mgr: &SessionManager, session: SessionId, state: SessionState) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = self.status(mgr, session).await;
            if st.state == state {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "session {session} stayed {} ({:?}), expected {state}",
                st.state,
                st.error_message
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Has `mgr` listen on the doorbell of this world's agentctls (as
    /// `sessiond serve` does), then run its startup recovery (which starts
    /// the liveness checks, if configured).
    pub async fn listen_and_recover(&self, mgr: &SessionManager) {
        std::fs::create_dir_all(self.path("run")).unwrap();
        mgr.recovery()
            .listen_doorbell(
                &self
                    .path("run")
                    .join(sessiond_executor::standalone::DOORBELL_FILE),
            )
            .unwrap();
        mgr.recovery().recover_all().await.unwrap();
    }

    /// Waits until sessiond restarted the session's agent by itself after
    /// it exited (events after `after`: ERROR saying why the agent is gone
    /// and that it is restarted, then STARTING) and the agent is back, the session
    /// WAITING_FOR_INPUT; returns its status.
    pub async fn wait_agent_back(
        &self,
        mgr: &SessionManager,
        session: SessionId,
        after: i64,
    ) -> SessionStatus {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            // The events first, then the status: a status read before them
            // could be the one from before the exit was noticed (WAITING,
            // agent running), paired with a restart committed just after.
            let events = self
                .store
                .events_after(session, after, 10_000)
                .await
                .unwrap();
            let changes: Vec<_> = events
                .iter()
                .filter_map(|e| match &e.payload {
                    EventPayload::StateChanged {
                        to, error_message, ..
                    } => Some((*to, error_message.clone())),
                    _ => None,
                })
                .collect();
            let restarted = changes.windows(2).any(|w| {
                w[0].0 == SessionState::Error
                    && w[0]
                        .1
                        .as_deref()
                        .is_some_and(|m| m.contains("sessiond restarts it"))
                    && w[1].0 == SessionState::Starting
            });
            let back = changes
                .last()
                .is_some_and(|(to, _)| *to == SessionState::WaitingForInput);
            let st = self.status(mgr, session).await;
            if restarted && back && st.state == SessionState::WaitingForInput && st.is_agent_running
            {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "the agent was not restarted by itself: {st:?}, state changes {changes:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the session is back WAITING_FOR_INPUT with another
    /// agent process under `agentctl` than `before` (the agent restarted).
    pub async fn wait_new_agent(
        &self,
        mgr: &SessionManager,
        session: SessionId,
        agentctl: u32,
        before: &[u32],
    ) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = self.status(mgr, session).await;
            let now = demo_agents_under(agentctl);
            if st.state == SessionState::WaitingForInput
                && st.is_agent_running
                && !st.recovering
                && !now.is_empty()
                && now != before
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the agent was not restarted: {st:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the session's update pump is parked (it holds no
    /// stream, so nothing sees its agentctl go).
    pub async fn wait_parked(&self, mgr: &SessionManager, session: SessionId) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !mgr.is_parked(session) {
            assert!(Instant::now() < deadline, "the pump never parked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A manager with no liveness check (only a call finds a lost agentctl)
    /// and a session of a heavy demo agent (1.5 s to start, 300 ms busy per
    /// prompt) named `name`.
    pub async fn heavy_session(&self, name: &str) -> (SessionManager, Session) {
        let profile = self
            .demo_profile(
                "heavy",
                &[("ACP_DEMO_STARTUP_MS", "1500"), ("ACP_DEMO_BUSY_MS", "300")],
            )
            .await;
        let mgr = self.manager_with(ManagerConfig {
            liveness_interval: None,
            ..self.config()
        });
        let s = self.create_with(&mgr, name, &profile, None).await;
        (mgr, s)
    }

    pub async fn events(&self, session: SessionId) -> Vec<Event> {
        self.store.events_after(session, 0, 100_000).await.unwrap()
    }

    /// Ends the sessions, stops the manager and asserts that no process this
    /// test started is left.
    pub async fn finish(self, mgr: &SessionManager, sessions: &[SessionId]) {
        for s in sessions {
            let _ = mgr.cancel_session(self.task.id, *s).await;
        }
        mgr.shutdown();
        self.procs.assert_all_gone().await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.strays().is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let strays = self.strays();
        assert!(
            strays.is_empty(),
            "untracked processes of this test left: {strays:?}"
        );
    }
}

fn placeholder_profile() -> AgentProfile {
    let now = Utc::now();
    AgentProfile {
        id: AgentProfileId::new(),
        name: String::new(),
        command: String::new(),
        args: Vec::new(),
        env: BTreeMap::new(),
        supports_session_resume: false,
        container: None,
        auth_method: None,
        permission_policy: sessiond_domain::PermissionPolicy::Allow,
        permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
        config_defaults: Default::default(),
        mcp_servers: Vec::new(),
        created_at: now,
        updated_at: now,
    }
}

impl Drop for World {
    /// A failed test may not have tracked everything it started: end every
    /// agentctl and agent whose command line names this world's directory.
    fn drop(&mut self) {
        for pid in self.strays() {
            kill9(pid);
        }
    }
}

impl World {
    /// Running agentctl and agent processes whose command line names this
    /// world's directory (so: started for this test).
    pub fn strays(&self) -> Vec<u32> {
        let marker = self.dir.path().display().to_string();
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let text = String::from_utf8_lossy(&cmdline);
            if (text.contains("agentctl") || text.contains("acp-demo-agent"))
                && text.contains(&marker)
                && is_running(pid)
            {
                out.push(pid);
            }
        }
        out
    }
}

/// Processes a test started (pid, start time); killed on drop if still running.
#[derive(Default, Clone)]
pub struct Procs(Arc<Mutex<Vec<(u32, u64)>>>);

impl Procs {
    pub fn add(&self, pid: u32, start_time: u64) {
        let mut v = self.0.lock().unwrap();
        if !v.contains(&(pid, start_time)) {
            v.push((pid, start_time));
        }
    }

    pub fn running(&self) -> Vec<u32> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, st)| process::is_same_running(*p, *st))
            .map(|(p, _)| *p)
            .collect()
    }

    pub async fn assert_all_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self.running().is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = self.running();
        assert!(left.is_empty(), "processes left running: {left:?}");
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if Arc::strong_count(&self.0) > 1 {
            return;
        }
        for pid in self.running() {
            kill9(pid);
        }
    }
}

/// Kills an agentctl and its agent as a crash of the machine would, and
/// waits until they are gone.
pub async fn kill_tree(pid: u32) {
    let kids = children_of(pid);
    kill9(pid);
    for k in &kids {
        kill9(*k);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while (is_running(pid) || kids.iter().any(|k| is_running(*k))) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!is_running(pid), "agentctl {pid} survived kill -9");
}

/// Collects events from a watch stream until `done` holds for the last one
/// (or the time is up).
pub async fn collect_until(
    stream: &mut sessiond_engine::EventStream,
    mut done: impl FnMut(&Event) -> bool,
) -> Vec<Event> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let next = tokio::time::timeout(remaining, stream.next())
            .await
            .expect("watch stream stalled")
            .expect("watch stream ended")
            .unwrap();
        let stop = done(&next);
        out.push(std::sync::Arc::unwrap_or_clone(next));
        if stop {
            return out;
        }
    }
}

/// Asserts seqs are consecutive from `first`.
pub fn assert_consecutive(events: &[Event], first: i64) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, first + i as i64, "event {i} of {events:?}");
    }
}

/// The demo agents among `agentctl`'s children.
pub fn demo_agents_under(agentctl: u32) -> Vec<u32> {
    children_of(agentctl)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("acp-demo-agent"))
        })
        .collect()
}

pub fn expected_reply(n: usize, token: &str, text: &str) -> String {
    format!("turn {n} of session {token}: you said \"{text}\"")
}

/// The demo agent's `calls.log` of this world: (method, pid) in order.
pub fn agent_calls(w: &World) -> Vec<(String, u64)> {
    std::fs::read_to_string(w.path("agent-state").join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["method"].as_str().unwrap_or_default().to_owned(),
                v["pid"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

/// A TCP proxy in front of a database: `cut` closes every connection through
/// it and refuses new ones (each refused one counted) until `restore`.
pub struct DbProxy {
    pub port: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl DbProxy {
    async fn start(target: String) -> DbProxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let accept = {
            let (up, refused, conns) = (up.clone(), refused.clone(), conns.clone());
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        refused.fetch_add(1, Ordering::SeqCst);
                        drop(client);
                        continue;
                    }
                    let target = target.clone();
                    let copy = tokio::spawn(async move {
                        if let Ok(mut server) = tokio::net::TcpStream::connect(&target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    conns.lock().unwrap().push(copy.abort_handle());
                }
            })
        };
        DbProxy {
            port,
            up,
            refused,
            conns,
            accept,
        }
    }

    /// The database goes away: open connections close, new ones are refused.
    pub fn cut(&self) {
        self.up.store(false, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// The database is back.
    pub fn restore(&self) {
        self.up.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Connections refused while cut, so far.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for DbProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}
