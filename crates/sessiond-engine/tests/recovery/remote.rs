use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use sessiond_domain::{
    AgentProfile, ExecutorId, ExecutorStatus, OutcomeLabel, Session, SessionId, SessionState,
    SessionStatus,
};
use sessiond_engine::{ErrorKind, ManagerConfig, RemoteAgentctl, SessionManager};
use sessiond_executor::process;

use crate::support::{Db, World, bin, children_of, expected_reply, kill_tree};

/// An agentctl started by the test, standing for one a remote host runs.
pub struct RemoteHost {
    pub child: Child,
}

/// Where a remote executor lives: its id, secret, loopback port and
/// workspace, so its host's agentctl can be stopped and started again as
/// the same one.
#[derive(Clone)]
pub struct RemoteSpot {
    pub id: ExecutorId,
    pub secret: String,
    pub port: u16,
    pub workspace: PathBuf,
}

impl RemoteSpot {
    /// A new executor identity on a free port, working in `workspace`.
    pub fn at(workspace: &str) -> Self {
        Self {
            id: ExecutorId::new(),
            secret: sessiond_executor::fresh_secret(),
            port: free_port(),
            workspace: PathBuf::from(workspace),
        }
    }

    /// What the backend is told about the executor.
    pub fn agentctl(&self) -> RemoteAgentctl {
        RemoteAgentctl {
            executor_id: self.id,
            url: format!("http://127.0.0.1:{}", self.port),
            auth_secret: self.secret.clone(),
        }
    }

    /// Creates a session named "remote" with `profile` on this executor,
    /// whose host runs (`host`): waiting for input, its agent tracked.
    pub async fn create(
        &self,
        w: &World,
        mgr: &SessionManager,
        profile: &AgentProfile,
        host: &RemoteHost,
    ) -> Session {
        let s = w
            .create_with(mgr, "remote", profile, Some(self.agentctl()))
            .await;
        assert_eq!(
            s.state,
            SessionState::WaitingForInput,
            "{:?}",
            s.error_message
        );
        host.track_agent(w);
        s
    }
}

impl RemoteHost {
    /// Starts the host's agentctl for `spot` (again, after a kill).
    pub async fn start(w: &World, spot: &RemoteSpot) -> Self {
        Self::start_with(w, spot, None, &[]).await
    }

    /// As [`RemoteHost::start`], with a turn journal (the host operator's
    /// `--journal`, kept across restarts) and extra environment.
    pub async fn start_with(
        w: &World,
        spot: &RemoteSpot,
        journal: Option<&Path>,
        env: &[(&str, &str)],
    ) -> Self {
        let RemoteSpot {
            id,
            secret,
            port,
            workspace,
        } = spot;
        let port_file = w.path(&format!("remote-{port}.port"));
        let _ = std::fs::remove_file(&port_file);
        let mut cmd = Command::new(bin("agentctl"));
        cmd.args(["--executor-id", &id.to_string()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--workspace")
            .arg(workspace)
            .arg("--port-file")
            .arg(&port_file)
            .args(["--idle-timeout", "300s"])
            .env("AGENTCTL_SECRET", secret)
            .env("AGENTCTL_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(j) = journal {
            cmd.arg("--journal").arg(j);
        }
        let child = cmd.spawn().unwrap();
        w.procs
            .add(child.id(), process::start_time(child.id()).unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !port_file.exists() {
            assert!(
                Instant::now() < deadline,
                "remote agentctl wrote no port file"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        RemoteHost { child }
    }

    pub fn track_agent(&self, w: &World) {
        for k in children_of(self.child.id()) {
            if let Some(st) = process::start_time(k) {
                w.procs.add(k, st);
            }
        }
    }

    pub async fn kill(mut self) {
        kill_tree(self.child.id()).await;
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A remote host that is down when the backend restarts: the executor shows
/// `error` (reconnecting) while the session keeps its state; when the host
/// is back, the background reconnect makes the executor ready and resumes
/// the agent, without another restart. The conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_host_back_after_restart_resumes_in_background() {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;

    mgr.shutdown();
    drop(mgr);
    host.kill().await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Error));
    assert_eq!(
        st.state,
        SessionState::WaitingForInput,
        "session left as it was"
    );
    let rec = w.record(s.id).await;
    assert!(rec.error_message.unwrap().starts_with("reconnecting:"));

    // The host comes back: same executor id, secret and address.
    let host = RemoteHost::start(&w, &spot).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.state, SessionState::WaitingForInput);
            break;
        }
        assert!(Instant::now() < deadline, "remote never came back: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    host.track_agent(&w);
    assert_eq!(mgr.stats().agent_launches, 1);
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));

    // Remote: ending the session stops the agent only; the host's agentctl
    // is the host's.
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    assert!(crate::support::is_running(host.child.id()));
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// The backend was down longer than the reconnect window while the remote
/// host was down too: the window counts from the backend's start, so the
/// executor is retried in the background (not failed at once), and when the
/// host is back the session is reconnected and resumed without a user call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_window_counts_from_the_backend_start() {
    const WINDOW: Duration = Duration::from_secs(6);
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let config = ManagerConfig {
        remote_retry_window: WINDOW,
        ..w.config()
    };
    let mgr = w.manager_with(config.clone());
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    host.kill().await;
    // The backend stays down longer than the whole window.
    let last_seen = w.record(s.id).await.last_seen_at.unwrap();
    tokio::time::sleep(WINDOW + Duration::from_millis(500)).await;
    assert!(chrono::Utc::now() - last_seen > chrono::Duration::from_std(WINDOW).unwrap());

    let mgr = w.manager_with(config);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
    let st = w.status(&mgr, s.id).await;
    assert_eq!(
        st.state,
        SessionState::WaitingForInput,
        "session left as it was"
    );
    assert!(
        w.record(s.id)
            .await
            .error_message
            .unwrap()
            .starts_with("reconnecting:")
    );

    let host = RemoteHost::start(&w, &spot).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.state, SessionState::WaitingForInput);
            break;
        }
        assert!(Instant::now() < deadline, "remote never came back: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    host.track_agent(&w);
    // Resumed from its token in the host's new agentctl, without a user call.
    assert_eq!(mgr.stats().agent_launches, 1);
    let after = w.store.get_session(s.id).await.unwrap();
    assert_eq!(after.resume_token.as_deref(), Some(token.as_str()));
    assert_eq!(after.state, SessionState::WaitingForInput);
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// A remote session on a fresh host whose liveness is checked every
/// 200 ms, so a host that stops answering is noticed at once.
async fn live_remote_session() -> (World, RemoteSpot, RemoteHost, SessionManager, Session) {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager_with(ManagerConfig {
        liveness_interval: Some(Duration::from_millis(200)),
        ..w.config()
    });
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    (w, spot, host, mgr, s)
}

/// A host whose agentctl comes back with another secret (rotated by its
/// operator, sessiond not told): while the reconnect goes on, the status
/// says the host rejects the secret, not the "Connection refused" of the
/// first failure; started again with the right secret, the session comes
/// back by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_host_back_with_another_secret_says_so_while_reconnecting() {
    let (w, spot, host, mgr, s) = live_remote_session().await;
    w.prompt(&mgr, s.id, "one").await;
    host.kill().await;
    let says = |want: &'static str| {
        let (w, mgr) = (&w, &mgr);
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let st = w.status(mgr, s.id).await;
                if st
                    .error_message
                    .as_deref()
                    .is_some_and(|m| m.contains(want))
                {
                    return st;
                }
                assert!(Instant::now() < deadline, "never said {want:?}: {st:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    says("reconnecting:").await;
    let rotated = RemoteSpot {
        secret: sessiond_executor::fresh_secret(),
        ..spot.clone()
    };
    let host = RemoteHost::start(&w, &rotated).await;
    let st = says("rejected the executor secret").await;
    assert_eq!(st.executor_status, Some(ExecutorStatus::Error), "{st:?}");
    host.kill().await;
    let host = RemoteHost::start(&w, &spot).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.error_message, None, "{st:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never came back: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[s.id]).await;
}

/// A blip while the backend runs: the remote agentctl stops answering (it is
/// SIGSTOPped, so its connections hang as on a broken network) and the
/// liveness check notices. The executor shows `error` with a reconnecting
/// message, the session keeps its state and the status says it is
/// reconnecting; when the host answers again the background reconnect
/// reattaches the same agent without a user call, and the conversation
/// continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_blip_during_liveness_reconnects_by_itself() {
    let (w, spot, host, mgr, s) = live_remote_session().await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let agent = children_of(host.child.id());

    signal(host.child.id(), "-STOP");
    let deadline = Instant::now() + Duration::from_secs(60);
    let st = loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Error) {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the blip was never noticed: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        st.state,
        SessionState::WaitingForInput,
        "session left as it was: {st:?}"
    );
    assert!(!st.is_agent_running, "{st:?}");
    assert!(
        st.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:") && m.contains(&spot.port.to_string())),
        "the status says it is reconnecting: {st:?}"
    );
    // A message meanwhile is told that sessiond brings the agent back by
    // itself, as a resume would be; not to resume the session first.
    let refused = mgr
        .send_message(w.task.id, s.id, "during the blip")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("brings it back by itself") && !refused.contains("resume the session"),
        "{refused}"
    );

    signal(host.child.id(), "-CONT");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            assert_eq!(st.state, SessionState::WaitingForInput);
            assert_eq!(st.error_message, None, "{st:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never reconnected: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Reattached: the same agent process, no new launch.
    assert_eq!(children_of(host.child.id()), agent);
    assert_eq!(mgr.stats().agent_launches, 1);
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));

    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// `session stop` while the remote host does not answer (its agentctl
/// SIGSTOPped, as behind a broken network): the session ends CANCELLED and
/// the call succeeds after one `StopAgent` deadline (it used to fail after
/// two, with the end already recorded); the status says the agent is
/// stopped once its host answers, and it is, without a user call; a
/// delete meanwhile says to try again then (at once, not after another
/// deadline), and then works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_stop_while_the_host_does_not_answer_ends_the_session_and_stops_the_agent_later() {
    let (w, _spot, host, mgr, s) = live_remote_session().await;
    w.prompt(&mgr, s.id, "one").await;
    let agent = children_of(host.child.id());
    assert_eq!(agent.len(), 1, "one agent runs on the host");

    signal(host.child.id(), "-STOP");
    let ended = mgr.cancel_session(w.task.id, s.id).await.unwrap();
    assert_eq!(ended.state, SessionState::Cancelled);
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Cancelled, "{st:?}");
    assert_eq!(st.executor_status, Some(ExecutorStatus::Error), "{st:?}");
    assert!(
        st.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:")),
        "{st:?}"
    );
    assert_eq!(
        children_of(host.child.id()),
        agent,
        "still running meanwhile"
    );
    // A delete cannot remove what it could not stop: it says so, and keeps
    // the record that lets sessiond stop the agent later.
    let err = mgr.delete_session(w.task.id, s.id).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string()
            .contains("delete the session again once the host answers"),
        "{err}"
    );
    assert!(
        w.store
            .get_executor_for_session(s.id)
            .await
            .unwrap()
            .is_some()
    );

    signal(host.child.id(), "-CONT");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        if st.executor_status == Some(ExecutorStatus::Stopped)
            && children_of(host.child.id()).is_empty()
        {
            assert_eq!(st.state, SessionState::Cancelled, "{st:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent was never stopped: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    mgr.delete_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// Waits until `f` holds (checked every 20 ms, up to 30 s).
async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the session's executor is ready with its agent running
/// again, without a user call; returns the status then.
async fn wait_back(
    w: &World,
    mgr: &sessiond_engine::SessionManager,
    s: SessionId,
) -> SessionStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(mgr, s).await;
        if st.executor_status == Some(ExecutorStatus::Ready) && st.is_agent_running {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "never reconnected and resumed by itself: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An explicit ResumeSession while the remote host is down (the restart
/// found it unreachable, the background reconnect runs): the host not
/// answering is no failed resume. The call answers UNAVAILABLE saying the
/// host is unreachable and reconnect continues; the executor keeps the
/// `reconnecting:` code (so the background reconnect and a restart still
/// take it up) and the session is not ERROR; when the host is back the
/// session is resumed without another call and the conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_explicit_resume_while_unreachable_keeps_reconnecting() {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    host.kill().await;

    let mgr = w.manager();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");

    let err = mgr
        .resume_session(w.task.id, s.id)
        .await
        .expect_err("the host is down: the resume cannot succeed now");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("unreachable") && msg.contains("reconnecting in the background"),
        "the answer says the host is unreachable and reconnect continues: {msg}"
    );
    let rec = w.record(s.id).await;
    assert_eq!(rec.status, ExecutorStatus::Error);
    assert!(
        rec.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:")),
        "the executor keeps the reconnecting code: {rec:?}"
    );
    let st = w.status(&mgr, s.id).await;
    assert_ne!(st.state, SessionState::Error, "not failed: {st:?}");
    assert!(
        st.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:")),
        "the status says it is reconnecting: {st:?}"
    );
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_ne!(stored.state, SessionState::Error, "{stored:?}");

    // The host comes back: resumed by the background reconnect.
    let host = RemoteHost::start(&w, &spot).await;
    let st = wait_back(&w, &mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    assert_eq!(st.error_message, None, "{st:?}");
    host.track_agent(&w);
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));

    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// A refused resume by a reachable remote agent (it answers `session/load`
/// with an error) stays a plain failure: session ERROR `resume_failed`,
/// executor `ready`, no reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_explicit_resume_refused_by_the_agent_is_a_plain_failure() {
    let w = World::new(Db::Sqlite).await;
    let profile = w
        .demo_profile("refuses", &[("ACP_DEMO_FAIL_LOAD", "1")])
        .await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    // The host restarts its agentctl (no agent any more; the agent refuses
    // every load); the backend restarts with resume on demand so the
    // explicit resume is the one that loads.
    host.kill().await;
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager_with(sessiond_engine::ManagerConfig {
        resume_policy: sessiond_domain::ResumePolicy::OnDemand,
        ..w.config()
    });
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorOnly), 1, "{summary:?}");
    let err = mgr
        .resume_session(w.task.id, s.id)
        .await
        .expect_err("the agent refuses the load");
    assert_ne!(err.kind(), ErrorKind::Unavailable, "{err}");
    let rec = w.record(s.id).await;
    assert_eq!(rec.status, ExecutorStatus::Ready, "{rec:?}");
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error, "{st:?}");
    assert!(
        !st.error_message
            .as_deref()
            .unwrap_or_default()
            .contains("reconnecting"),
        "{st:?}"
    );
    host.track_agent(&w);
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// Startup recovery reaches the remote host (Health answers) and the host
/// goes away while the agent's resume runs (aimed by the world: the agent
/// process the resume launched exists, held before its `initialize` by a
/// start gate, when the host is killed). That is the host's failure, not
/// the agent's: `retrying` with the executor `error` `reconnecting:` and
/// the session as it was, not `resume_failed` / ERROR; when the host is
/// back the background reconnect resumes the session without a user call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_host_gone_during_the_agents_resume_reconnects() {
    let w = World::new(Db::Sqlite).await;
    let (profile, gate) = w.gated_profile("gated").await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &profile, &host).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    // The host restarts its agentctl while the backend is down: recovery
    // finds it healthy with no agent and resumes one, which the gate holds.
    host.kill().await;
    std::fs::write(&gate, "").unwrap();
    let host = RemoteHost::start(&w, &spot).await;
    let host_pid = host.child.id();

    let mgr = w.manager();
    let pass = tokio::spawn({
        let mgr = mgr.clone();
        async move { mgr.recovery().recover_all().await }
    });
    wait_for("the resume to launch the agent on the host", || {
        !children_of(host_pid).is_empty()
    })
    .await;
    host.kill().await;
    let summary = pass.await.unwrap().unwrap();
    assert_eq!(
        summary.count(OutcomeLabel::Retrying),
        1,
        "the host's failure, not the agent's: {summary:?}"
    );
    assert_eq!(summary.count(OutcomeLabel::ResumeFailed), 0, "{summary:?}");
    let rec = w.record(s.id).await;
    assert_eq!(rec.status, ExecutorStatus::Error, "{rec:?}");
    assert!(
        rec.error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:")),
        "{rec:?}"
    );
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_eq!(stored.state, SessionState::WaitingForInput, "{stored:?}");

    // Back, gate open: resumed by the background reconnect.
    std::fs::remove_file(&gate).unwrap();
    let host = RemoteHost::start(&w, &spot).await;
    let st = wait_back(&w, &mgr, s.id).await;
    assert_eq!(st.state, SessionState::WaitingForInput, "{st:?}");
    host.track_agent(&w);
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// An explicit resume of a RUNNING remote session (its turn pending for the
/// reconnect) while the host is down: UNAVAILABLE, and the turn stays
/// pending (session STARTING, the turn kept) for the reconnect. When the
/// window closes with the host still down, the reconnect gives it up: the
/// session goes ERROR and the turn ends interrupted in that commit (the
/// system message, the turn cleared and kept for RetryTurn). Once the host
/// is back a resume continues the conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_explicit_resume_while_unreachable_keeps_the_turn_until_the_window_closes() {
    const WINDOW: Duration = Duration::from_secs(3);
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let host = RemoteHost::start(&w, &spot).await;
    let config = ManagerConfig {
        remote_retry_window: WINDOW,
        ..w.config()
    };
    let mgr = w.manager_with(config.clone());
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    host.kill().await;
    // The backend died with turn two stored and not sent.
    let two = crate::pending::commit_user_message(&w, &s, "two").await;

    let mgr = w.manager_with(config);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Retrying), 1, "{summary:?}");
    let err = mgr
        .resume_session(w.task.id, s.id)
        .await
        .expect_err("the host is down");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_eq!(stored.state, SessionState::Starting, "{stored:?}");
    assert_eq!(
        stored.metadata.get("turn_id"),
        Some(&two.id.to_string()),
        "the turn stays pending for the reconnect: {stored:?}"
    );

    // The window closes with the host still down: given up.
    let deadline = Instant::now() + WINDOW + Duration::from_secs(60);
    loop {
        let r = w.record(s.id).await;
        if !r
            .error_message
            .as_deref()
            .is_some_and(|m| m.starts_with("reconnecting:"))
        {
            assert_eq!(r.status, ExecutorStatus::Error, "{r:?}");
            break;
        }
        assert!(Instant::now() < deadline, "never given up: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = w.store.get_session(s.id).await.unwrap();
    assert_eq!(after.state, SessionState::Error, "{after:?}");
    assert!(!after.metadata.contains_key("turn_id"), "{after:?}");
    assert_eq!(
        after.metadata.get("interrupted_turn"),
        Some(&two.id.to_string())
    );
    let msgs = w.messages(s.id).await;
    let last = msgs.last().unwrap();
    assert_eq!(last.role, sessiond_domain::MessageRole::System, "{msgs:?}");
    assert!(
        last.content.starts_with("the turn was interrupted"),
        "{last:?}"
    );

    let host = RemoteHost::start(&w, &spot).await;
    let st = mgr.resume_session(w.task.id, s.id).await.unwrap();
    assert!(st.is_agent_running, "{st:?}");
    host.track_agent(&w);
    w.prompt(&mgr, s.id, "three").await;
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// A remote host's agentctl dies while the backend runs and nothing
/// notices (liveness off, the pump parked); the next message's Prompt finds
/// it gone. The message is stored and the call answers with it, the turn
/// pending; once the host is back (agentctl again, same address and
/// journal: without one the turn would end interrupted) the reconnect recovers the session and the turn, which reached
/// no agent, is delivered, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_message_that_finds_the_host_gone_is_delivered_once_it_is_back() {
    let (w, spot, journal, mgr, s) = parked_remote_session_whose_agentctl_died().await;
    let token = s.resume_token.clone().unwrap();

    let sent = mgr
        .send_message(w.task.id, s.id, "lost")
        .await
        .expect("stored, delivered once the host is back");
    let stored = w.store.get_session(s.id).await.unwrap();
    assert_eq!(stored.state, SessionState::Running, "{stored:?}");
    assert_eq!(
        stored.metadata.get("turn_id"),
        Some(&sent.id.to_string()),
        "the turn stays pending: {stored:?}"
    );

    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;
    wait_delivered(&w, &mgr, s.id, &expected_reply(2, &token, "lost")).await;
    goes_on_then_ends(w, &mgr, s.id, host, &token).await;
}

/// A remote session prompted once and parked, with the liveness checks off
/// (nothing but a call notices its host), whose agentctl (journal at the
/// returned path, kept for the next one on the same spot) is then killed.
async fn parked_remote_session_whose_agentctl_died()
-> (World, RemoteSpot, PathBuf, SessionManager, Session) {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let journal = w.path("remote-agentctl.journal");
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;
    let mgr = w.manager_with(ManagerConfig {
        liveness_interval: None,
        ..w.config()
    });
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    w.prompt(&mgr, s.id, "one").await;
    w.wait_parked(&mgr, s.id).await;
    host.kill().await;
    (w, spot, journal, mgr, s)
}

/// The conversation goes on where it was (turn 3), then the session ends
/// and its host stops.
async fn goes_on_then_ends(
    w: World,
    mgr: &SessionManager,
    session: SessionId,
    host: RemoteHost,
    token: &str,
) {
    host.track_agent(&w);
    assert_eq!(
        w.prompt(mgr, session, "two").await,
        expected_reply(3, token, "two")
    );
    mgr.cancel_session(w.task.id, session).await.unwrap();
    host.kill().await;
    w.finish(mgr, &[]).await;
}

/// Waits until `session` waits for input with the agent's reply `want`
/// stored, never passing through ERROR and with nothing interrupted (no
/// system message); returns its messages.
async fn wait_delivered(
    w: &World,
    mgr: &SessionManager,
    session: SessionId,
    want: &str,
) -> Vec<sessiond_domain::Message> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let msgs = w.messages(session).await;
        let st = w.status(mgr, session).await;
        assert_ne!(st.state, SessionState::Error, "{st:?} {msgs:?}");
        if st.state == SessionState::WaitingForInput
            && msgs
                .iter()
                .any(|m| m.role == sessiond_domain::MessageRole::Agent && m.content == want)
        {
            assert!(
                !msgs
                    .iter()
                    .any(|m| m.role == sessiond_domain::MessageRole::System),
                "nothing interrupted: {msgs:?}"
            );
            return msgs;
        }
        assert!(
            Instant::now() < deadline,
            "never delivered: {st:?} {msgs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A remote host's agentctl restarts while the session is idle (parked: no
/// stream notices, and with the liveness checks off nothing else does): the
/// next message's `Prompt` is refused, as no agent runs there. That turn
/// reached no agent, so sessiond relaunches the agent, resumes the
/// conversation and delivers the message once, by itself: the session is
/// never ERROR and nothing is interrupted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_message_to_a_restarted_agentctl_with_no_agent_is_delivered_once() {
    let (w, spot, journal, mgr, s) = parked_remote_session_whose_agentctl_died().await;
    let token = s.resume_token.clone().unwrap();
    let host = RemoteHost::start_with(&w, &spot, Some(&journal), &[]).await;

    let sent = mgr
        .send_message(w.task.id, s.id, "after the restart")
        .await
        .expect("stored, delivered once the agent is back");
    let want = expected_reply(2, &token, "after the restart");
    let msgs = wait_delivered(&w, &mgr, s.id, &want).await;
    let users: Vec<_> = msgs
        .iter()
        .filter(|m| m.role == sessiond_domain::MessageRole::User)
        .map(|m| m.id)
        .collect();
    assert_eq!(users.len(), 2, "sent once: {msgs:?}");
    assert_eq!(users[1], sent.id);
    goes_on_then_ends(w, &mgr, s.id, host, &token).await;
}

/// GetSessionStatus after a restart does not ask agentctl for the agent's
/// modes: recovery kept what answered it, whether it reattached the
/// running agent (its Health) or launched it again and loaded the
/// conversation (ResumeSession). agentctl is stopped (SIGSTOP) for the
/// call, so asking it would answer no modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_are_kept_from_recovery() {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let mut host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    let mut mgr = mgr;
    for (round, host_restarts) in [(1, false), (2, true)] {
        mgr.shutdown();
        drop(mgr);
        if host_restarts {
            host.kill().await;
            host = RemoteHost::start(&w, &spot).await;
        }
        mgr = w.manager();
        let summary = mgr.recovery().recover_all().await.unwrap();
        let expected = if host_restarts {
            OutcomeLabel::Resumed
        } else {
            OutcomeLabel::Reattached
        };
        assert_eq!(summary.count(expected), 1, "round {round}: {summary:?}");
        host.track_agent(&w);
        signal(host.child.id(), "-STOP");
        let modes = mgr.session_modes(w.task.id, s.id).await;
        signal(host.child.id(), "-CONT");
        let current = modes
            .unwrap()
            .unwrap_or_else(|| {
                panic!("round {round}: asked agentctl instead of keeping recovery's answer")
            })
            .current;
        assert_eq!(current, "default", "round {round}");
    }
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}

/// A remote host restarted while the backend was down (its agent gone):
/// recovery launches the agent and reopens the conversation inside the
/// health check's exchange (one `Recover`); from an agentctl without that
/// call (an older one: UNIMPLEMENTED) it makes one call per step. Either
/// way the agent is launched once and gets one `session/resume`, and the
/// conversation goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_resume_in_one_round_trip_and_from_an_older_agentctl() {
    let w = World::new(Db::Sqlite).await;
    let spot = RemoteSpot::at(&w.worktree("remote").path);
    let mut host = RemoteHost::start(&w, &spot).await;
    let mgr = w.manager();
    let s = spot.create(&w, &mgr, &w.profile, &host).await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let mut mgr = mgr;
    let older: &[(&str, &str)] = &[("AGENTCTL_TEST_WITHOUT_RECOVER", "1")];
    for (turn, env, by_recover) in [(2, &[][..], 1), (3, older, 0)] {
        mgr.shutdown();
        drop(mgr);
        host.kill().await;
        host = RemoteHost::start_with(&w, &spot, None, env).await;
        mgr = w.manager();
        let summary = mgr.recovery().recover_all().await.unwrap();
        assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
        host.track_agent(&w);
        let stats = mgr.stats();
        assert_eq!(
            (stats.agent_launches, stats.resume_attempts),
            (1, 1),
            "turn {turn}"
        );
        assert_eq!(stats.resumed_by_recover, by_recover, "turn {turn}");
        let agent = crate::support::agent_calls(&w);
        let last = agent.last().expect("the agent's calls");
        assert_eq!(last.0.as_str(), "session/resume", "turn {turn}: {agent:?}");
        let pid = last.1;
        let of_it: Vec<_> = agent
            .iter()
            .filter(|c| c.1 == pid)
            .map(|c| c.0.as_str())
            .collect();
        assert_eq!(of_it, ["initialize", "session/resume"], "turn {turn}");
        let reply = w.prompt(&mgr, s.id, &format!("turn {turn}")).await;
        assert_eq!(reply, expected_reply(turn, &token, &format!("turn {turn}")));
    }
    mgr.cancel_session(w.task.id, s.id).await.unwrap();
    host.kill().await;
    w.finish(&mgr, &[]).await;
}
