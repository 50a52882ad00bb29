//! `kill -9` of the backend, per runtime. The backend runs in a child
//! process (this test binary re-executed, see [`backend_process`]) driven
//! by line commands on its stdin; the test kills it with SIGKILL, changes
//! the world, and starts a backend again (in-process), then checks the
//! store, a subscriber's view of the events, and the world itself: the
//! process table (agentctl processes by `--executor-id`) and the engine's
//! containers (by the `sessiond.session_id` label).

use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use futures::StreamExt;
use sessiond_domain::{
    ExecutorId, ExecutorStatus, OutcomeLabel, ResumeReason, Runtime, SessionId, SessionState,
    TaskState,
};
use sessiond_engine::{NewSession, RemoteAgentctl, SessionManager};
use sessiond_executor::{Executor, ExecutorHandle};
use sessiond_store::{Store, StoreOptions};
use tokio::sync::mpsc;

use crate::{
    docker_support::{DockerKit, docker_driver, drivers_with},
    remote::{RemoteHost, RemoteSpot},
    support::{Db, World, drivers_in, expected_reply, kill_tree, kill9},
};

const CHILD_ENV: &str = "SESSIOND_RECOVERY_TEST_BACKEND";

/// The child backend. Spec (env): `<db url>|<world dir>|<task id>|<docker
/// host or empty>|<image>`. Commands on stdin, one per line:
/// - `recover` → `RECOVERED <total>`
/// - `create <runtime> <profile> <worktree> [<executor id> <url> <secret>]` → `SESSION <id>`
/// - `watch <session>` → one `EVENT <seq> <kind>` line per event, replayed then live
/// - `prompt <session> <text>` → `REPLY <content>` once the turn ended
// Not a test: `--ignored --exact` runs it in the child process only.
#[ignore = "child-process entry point, not a test"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        panic!(
            "a child-process entry point, not a test: started by the kill -9 tests of this file with {CHILD_ENV} set"
        );
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let (url, dir, task) = (parts[0], Path::new(parts[1]), parts[2]);
    let task: sessiond_domain::TaskId = task.parse().unwrap();
    crate::support::init_tracing();
    let store = Store::connect(url, StoreOptions::default()).await.unwrap();
    let drivers = if parts[3].is_empty() {
        drivers_in(dir)
    } else {
        let env = crate::docker_support::DockerEnv {
            host: parts[3].into(),
            image: parts[4].into(),
        };
        drivers_with(dir, &docker_driver(&env, dir).await)
    };
    let config = sessiond_engine::ManagerConfig {
        executor_deadline: Duration::from_secs(10),
        agent_initialize_timeout: Duration::from_secs(10),
        agent_stop_grace: Duration::from_secs(2),
        ..sessiond_engine::ManagerConfig::default()
    };
    let mgr = SessionManager::new(store.clone(), drivers, config);
    say("READY");
    let (tx, mut lines) = mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split(' ').collect();
        match words.as_slice() {
            ["recover"] => {
                let s = mgr.recovery().recover_all().await.unwrap();
                say(&format!("RECOVERED {}", s.total));
            }
            ["create", runtime, profile, worktree, remote @ ..] => {
                let runtime: Runtime = runtime.parse().unwrap();
                let remote = match remote {
                    [id, url, secret] => Some(RemoteAgentctl {
                        executor_id: id.parse().unwrap(),
                        url: (*url).into(),
                        auth_secret: (*secret).into(),
                    }),
                    _ => None,
                };
                let s = mgr
                    .create_session(NewSession {
                        task_id: task,
                        agent_profile_id: profile.parse().unwrap(),
                        runtime,
                        worktree: sessiond_domain::Worktree {
                            id: "kill9".into(),
                            path: (*worktree).into(),
                            branch: "kill9".into(),
                            ..Default::default()
                        },
                        remote,
                        metadata: Default::default(),
                        mcp_servers: Vec::new(),
                    })
                    .await
                    .unwrap();
                assert_eq!(
                    s.state,
                    SessionState::WaitingForInput,
                    "{:?}",
                    s.error_message
                );
                say(&format!("SESSION {}", s.id));
            }
            ["watch", session] => {
                let mut stream = mgr
                    .watch_session(session.parse().unwrap(), 0)
                    .await
                    .unwrap();
                tokio::spawn(async move {
                    while let Some(Ok(e)) = stream.next().await {
                        say(&format!("EVENT {} {}", e.seq, e.kind().as_str()));
                    }
                });
            }
            ["prompt", session, text @ ..] => {
                let sid: SessionId = session.parse().unwrap();
                let text = text.join(" ");
                mgr.send_message(task, sid, &text).await.unwrap();
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let st = mgr.session_status(task, sid).await.unwrap();
                    if st.state == SessionState::WaitingForInput {
                        break;
                    }
                    assert!(
                        st.state != SessionState::Error && Instant::now() < deadline,
                        "child: the turn did not end: {st:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let msgs = store.list_messages(sid, 0, 10_000).await.unwrap();
                say(&format!("REPLY {}", msgs.last().unwrap().content));
            }
            other => panic!("child: unknown command {other:?}"),
        }
    }
}

fn say(line: &str) {
    #[allow(clippy::print_stdout)]
    {
        println!("{line}");
    }
}

/// A backend in a child process.
struct Backend {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
    /// Seqs of the events the child's subscriber printed.
    seen: Vec<i64>,
}

impl Backend {
    async fn start(w: &World, docker: Option<&DockerKit>) -> Backend {
        let url = format!("sqlite://{}", w.path("sessiond.db").display());
        let (host, image) = docker
            .map(|k| (k.env.host.clone(), k.env.image.clone()))
            .unwrap_or_default();
        let spec = format!(
            "{url}|{}|{}|{host}|{image}",
            w.dir.path().display(),
            w.task.id
        );
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "kill9::backend_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, spec)
            .env("RUST_LOG", "sessiond_engine=warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut b = Backend {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        };
        b.expect("READY").await;
        b
    }

    fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The rest of the next line starting with `prefix`; EVENT lines seen
    /// meanwhile are recorded.
    async fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let line = match tokio::time::timeout(remaining, self.lines.recv()).await {
                Ok(Some(l)) => l,
                _ => {
                    kill9(self.child.id());
                    panic!("the child backend never said {prefix:?} (see its stderr above)");
                }
            };
            // libtest may print "test ... " in front of the first line.
            let after = |p: &str| line.find(p).map(|i| line[i + p.len()..].to_owned());
            if let Some(rest) = after("EVENT ") {
                let seq = rest.split(' ').next().unwrap().parse().unwrap();
                self.seen.push(seq);
            }
            if let Some(rest) = after(prefix) {
                return rest.trim_start().to_owned();
            }
        }
    }

    /// Waits until the subscriber printed every event up to `seq`.
    async fn seen_up_to(&mut self, seq: i64) {
        while self.seen.last().copied().unwrap_or(0) < seq {
            self.expect("EVENT ").await;
        }
    }

    async fn kill9(mut self) {
        kill9(self.child.id());
        let _ = self.child.wait();
    }
}

/// Running agentctl processes whose command line names `executor_id`.
pub fn agentctls_of(executor_id: ExecutorId) -> usize {
    let id = executor_id.to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(crate::support::is_running)
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            args.first().is_some_and(|a| a.ends_with(b"agentctl"))
                && args
                    .windows(2)
                    .any(|w| w[0] == b"--executor-id" && w[1] == id.as_bytes())
        })
        .count()
}

/// Exactly one agentctl for the session, in the world.
async fn assert_one_agentctl(
    w: &World,
    kit: Option<&DockerKit>,
    session: SessionId,
    runtime: Runtime,
) {
    let record = w.record(session).await;
    if runtime == Runtime::LocalDocker {
        kit.unwrap().one_running(session).await;
    }
    // The container's agentctl shows in the host's process table too.
    assert_eq!(agentctls_of(record.id), 1, "one agentctl process");
}

/// Create, prompt twice, `kill -9` the backend, start it again: executor
/// ready, session WAITING_FOR_INPUT, task REVIEW, turn 3 continues the
/// conversation, the events a subscriber saw before the crash plus what it
/// sees after (resuming from its last seq) are every event exactly once,
/// and the world holds exactly one agentctl for the session.
async fn kill9_then_restart(runtime: Runtime) {
    let w = World::new(Db::Sqlite).await;
    let kit = match runtime {
        Runtime::LocalDocker => Some(DockerKit::new(&w).await),
        _ => None,
    };
    let profile = kit.as_ref().map_or(&w.profile, |k| &k.profile).clone();
    let wt = w.worktree("k9");
    let mut host = None;
    let mut create = format!("create {runtime} {} {}", profile.id, wt.path);
    if runtime == Runtime::Remote {
        let spot = RemoteSpot::at(&wt.path);
        host = Some(RemoteHost::start(&w, &spot).await);
        let RemoteSpot {
            id, port, secret, ..
        } = &spot;
        create = format!("{create} {id} http://127.0.0.1:{port} {secret}");
    }

    let mut child = Backend::start(&w, kit.as_ref()).await;
    child.send("recover");
    child.expect("RECOVERED").await;
    child.send(&create);
    let sid: SessionId = child.expect("SESSION").await.parse().unwrap();
    child.send(&format!("watch {sid}"));
    for text in ["one", "two"] {
        child.send(&format!("prompt {sid} {text}"));
        child.expect("REPLY").await;
    }
    let last = w.store.last_event_seq(sid).await.unwrap();
    child.seen_up_to(last).await;
    w.track(sid).await;
    if let Some(h) = &host {
        h.track_agent(&w);
    }
    let before = w.record(sid).await;
    let seen_before = child.seen.clone();
    child.kill9().await;
    assert_eq!(
        seen_before,
        (1..=last).collect::<Vec<_>>(),
        "the subscriber before the crash saw every event once"
    );

    // The backend again; a subscriber resumes from the last seq it saw.
    let mgr = match &kit {
        Some(k) => k.manager(&w),
        None => w.manager(),
    };
    let mut stream = mgr.watch_session(sid, last).await.unwrap();
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::Reattached), 1, "{summary:?}");
    let after = w.record(sid).await;
    assert_eq!(after.status, ExecutorStatus::Ready);
    assert_eq!(after.generation, before.generation, "nothing relaunched");
    let st = w.status(&mgr, sid).await;
    assert_eq!(st.state, SessionState::WaitingForInput);
    assert!(st.is_agent_running);
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        TaskState::Review
    );
    assert_one_agentctl(&w, kit.as_ref(), sid, runtime).await;

    let token = w
        .store
        .get_session(sid)
        .await
        .unwrap()
        .resume_token
        .unwrap();
    let reply = w.prompt(&mgr, sid, "three").await;
    assert_eq!(reply, expected_reply(3, &token, "three"));
    let end = w.store.last_event_seq(sid).await.unwrap();
    assert!(end > last);
    let mut after_seqs = Vec::new();
    while after_seqs.last().copied().unwrap_or(last) < end {
        let e = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .expect("watch stalled")
            .expect("watch ended")
            .unwrap();
        after_seqs.push(e.seq);
    }
    let mut all = seen_before;
    all.extend(after_seqs);
    assert_eq!(
        all,
        (1..=end).collect::<Vec<_>>(),
        "every event exactly once"
    );
    assert_one_agentctl(&w, kit.as_ref(), sid, runtime).await;

    if let Some(h) = host {
        mgr.cancel_session(w.task.id, sid).await.unwrap();
        h.kill().await;
    }
    w.finish(&mgr, &[sid]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_standalone() {
    kill9_then_restart(Runtime::LocalStandalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_remote() {
    kill9_then_restart(Runtime::Remote).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn kill9_docker() {
    kill9_then_restart(Runtime::LocalDocker).await;
}

/// Docker, faults while the backend is down: a stopped container is
/// started (generation + 1, same container) and the agent resumed from its
/// state in the mounted worktree (turn 3); a removed container makes the
/// executor `error` and the session ERROR with the reason, and nothing is
/// created in its place.
async fn docker_fault_while_down(remove: bool) {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let wt = w.worktree("fault");
    let mut child = Backend::start(&w, Some(&kit)).await;
    child.send("recover");
    child.expect("RECOVERED").await;
    child.send(&format!(
        "create local_docker {} {}",
        kit.profile.id, wt.path
    ));
    let sid: SessionId = child.expect("SESSION").await.parse().unwrap();
    for text in ["one", "two"] {
        child.send(&format!("prompt {sid} {text}"));
        child.expect("REPLY").await;
    }
    child.kill9().await;
    let before = w.record(sid).await;
    let container = kit.one_running(sid).await;
    let run_dir = w.dir.path().join("docker-run").join(before.id.to_string());
    let secret = w
        .dir
        .path()
        .join("docker-run")
        .join(format!("{}.secret", before.id));
    assert!(
        run_dir.is_dir() && secret.is_file(),
        "the driver keeps both"
    );
    if remove {
        kit.driver.remove_container(&container.id).await.unwrap();
    } else {
        kit.driver
            .stop(&ExecutorHandle::from_record(&before))
            .await
            .unwrap();
    }

    let mgr = kit.manager(&w);
    let summary = mgr.recovery().recover_all().await.unwrap();
    let st = w.status(&mgr, sid).await;
    if remove {
        assert_eq!(summary.count(OutcomeLabel::ExecutorError), 1, "{summary:?}");
        assert_eq!(st.state, SessionState::Error);
        assert_eq!(st.executor_status, Some(ExecutorStatus::Error));
        let msg = st.error_message.clone().unwrap();
        assert!(
            msg.starts_with("container_missing:") && msg.contains("create a new session"),
            "{msg}"
        );
        // The fields agree with the message: nothing to resume.
        assert!(!st.is_resumable && !st.needs_resume, "{st:?}");
        assert_eq!(st.resume_reason, ResumeReason::ExecutorGone, "{st:?}");
        assert!(kit.containers_of_session(sid).await.is_empty());
        assert_eq!(agentctls_of(before.id), 0);
        assert!(
            !run_dir.exists(),
            "the removed container's run directory is left"
        );
        assert!(!secret.exists(), "its secret is left");
        // An explicit resume says why it cannot, and starts nothing either.
        let err = mgr.resume_session(w.task.id, sid).await.unwrap_err();
        assert!(
            err.to_string()
                .contains("the container of this session no longer exists; create a new session"),
            "{err}"
        );
        assert!(kit.containers_of_session(sid).await.is_empty());
        assert_eq!(w.status(&mgr, sid).await, st, "the refusal changed nothing");
    } else {
        assert_eq!(summary.count(OutcomeLabel::Resumed), 1, "{summary:?}");
        let after = w.record(sid).await;
        assert_eq!(after.generation, before.generation + 1);
        assert_eq!(after.container_id, before.container_id, "same container");
        assert_eq!(st.state, SessionState::WaitingForInput);
        assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
        assert_one_agentctl(&w, Some(&kit), sid, Runtime::LocalDocker).await;
        let token = w
            .store
            .get_session(sid)
            .await
            .unwrap()
            .resume_token
            .unwrap();
        let reply = w.prompt(&mgr, sid, "three").await;
        assert_eq!(reply, expected_reply(3, &token, "three"));
    }
    w.finish(&mgr, &[sid]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn kill9_docker_container_stopped_is_started_and_resumed() {
    docker_fault_while_down(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn kill9_docker_container_removed_is_error_with_reason() {
    docker_fault_while_down(true).await;
}

/// A Docker session whose container stopped while the backend ran (the
/// liveness check finds its agentctl silent): that can pass by itself, so
/// the session is never ERROR; the background retry probes (nothing
/// started), writes its intent (generation + 1), starts the same container
/// and resumes the agent, with no user call; the conversation continues.
/// An explicit resume racing it joins the same single-flight operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_stopped_container_is_started_by_itself() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let config = sessiond_engine::ManagerConfig {
        liveness_interval: Some(Duration::from_millis(200)),
        ..w.config()
    };
    let mgr = SessionManager::new(
        w.store.clone(),
        drivers_with(w.dir.path(), &kit.driver),
        config,
    );
    mgr.recovery().recover_all().await.unwrap();
    let s = w
        .create_rt(&mgr, "resume", &kit.profile, Runtime::LocalDocker, None)
        .await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    let before = w.record(s.id).await;
    kit.driver
        .stop(&ExecutorHandle::from_record(&before))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let st = w.status(&mgr, s.id).await;
        assert_ne!(st.state, SessionState::Error, "{st:?}");
        let r = w.record(s.id).await;
        if st.is_agent_running && r.generation > before.generation {
            assert_eq!(st.state, SessionState::WaitingForInput);
            assert_eq!(st.executor_status, Some(ExecutorStatus::Ready));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never came back by itself: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = w.record(s.id).await;
    assert_eq!(after.generation, before.generation + 1);
    assert_eq!(after.container_id, before.container_id, "same container");
    assert_one_agentctl(&w, Some(&kit), s.id, Runtime::LocalDocker).await;
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// A Docker session whose container was removed while the backend ran: the
/// liveness check finds it gone, so the status says not resumable with the
/// `container_missing` message and the run directory is removed; an explicit
/// resume is refused (FAILED_PRECONDITION) with the same words and starts
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn docker_explicit_resume_of_a_removed_container_is_refused_and_cleaned_up() {
    let w = World::new(Db::Sqlite).await;
    let kit = DockerKit::new(&w).await;
    let config = sessiond_engine::ManagerConfig {
        liveness_interval: Some(Duration::from_millis(200)),
        ..w.config()
    };
    let mgr = SessionManager::new(
        w.store.clone(),
        drivers_with(w.dir.path(), &kit.driver),
        config,
    );
    mgr.recovery().recover_all().await.unwrap();
    let s = w
        .create_rt(&mgr, "gone", &kit.profile, Runtime::LocalDocker, None)
        .await;
    w.prompt(&mgr, s.id, "one").await;
    let record = w.record(s.id).await;
    let run_dir = w.dir.path().join("docker-run").join(record.id.to_string());
    assert!(run_dir.is_dir());
    let container = kit.one_running(s.id).await;
    kit.driver.remove_container(&container.id).await.unwrap();
    w.wait_state(&mgr, s.id, SessionState::Error).await;
    let st = w.status(&mgr, s.id).await;
    assert!(!st.is_resumable && !st.needs_resume, "{st:?}");
    assert_eq!(st.resume_reason, ResumeReason::ExecutorGone);
    assert!(!run_dir.exists(), "the run directory is removed");

    let err = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert_eq!(
        err.kind(),
        sessiond_engine::ErrorKind::FailedPrecondition,
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("the container of this session no longer exists; create a new session"),
        "{err}"
    );
    assert!(
        kit.containers_of_session(s.id).await.is_empty(),
        "nothing started"
    );
    let st = w.status(&mgr, s.id).await;
    assert_eq!(st.state, SessionState::Error);
    assert!(!st.is_resumable && !st.needs_resume, "{st:?}");
    assert_eq!(st.resume_reason, ResumeReason::ExecutorGone);
    let msg = st.error_message.clone().unwrap();
    assert!(msg.starts_with("container_missing:"), "{msg}");
    assert!(!run_dir.exists(), "the run directory is removed");
    // Asked again: refused at once by the status, same answer.
    let again = mgr.resume_session(w.task.id, s.id).await.unwrap_err();
    assert_eq!(again.to_string(), err.to_string());
    w.finish(&mgr, &[s.id]).await;
}

/// Takes every session's agentctl away while the backend is down, so the
/// next recovery has work: processes killed (standalone), containers
/// stopped (docker).
async fn knock_out(w: &World, kit: Option<&DockerKit>, ids: &[SessionId]) {
    for id in ids {
        let r = w.record(*id).await;
        match kit {
            Some(k) => k
                .driver
                .stop(&ExecutorHandle::from_record(&r))
                .await
                .unwrap(),
            None => {
                if let Some(pid) = r.pid.filter(|p| crate::support::is_running(*p)) {
                    kill_tree(pid).await;
                }
            }
        }
    }
}

/// Like [`knock_out`], but also ends agentctls no record knows of (a
/// crashed recovery may have spawned one and died before recording it).
async fn knock_out_all(w: &World, kit: Option<&DockerKit>, ids: &[SessionId]) {
    match kit {
        Some(_) => knock_out(w, kit, ids).await,
        None => {
            let strays = w.strays();
            for pid in &strays {
                kill9(*pid);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while strays.iter().any(|p| crate::support::is_running(*p)) {
                assert!(Instant::now() < deadline, "strays survived kill -9");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Tells the child to recover and SIGKILLs it at a point proven to be inside
/// its recovery: at least `intents` of the sessions' executors have a launch
/// intent newer than before the start (generation bumped), `ready` of those
/// are `ready` again and one is still `starting`, checked again with the child frozen (SIGSTOP), so no
/// timing guess decides where the kill lands. `Err` when the recovery ended
/// before that point was seen (the caller tries again).
async fn kill_during_recovery(
    w: &World,
    mut child: Backend,
    ids: &[SessionId],
    intents: usize,
    ready: usize,
) -> Result<String, String> {
    let mut before = std::collections::HashMap::new();
    for id in ids {
        before.insert(*id, w.record(*id).await.generation);
    }
    let in_flight = || async {
        let mut bumped = 0;
        let (mut starting, mut up) = (0, 0);
        for id in ids {
            let r = w.record(*id).await;
            if r.generation > before[id] {
                bumped += 1;
                starting += usize::from(r.status == ExecutorStatus::Starting);
                up += usize::from(r.status == ExecutorStatus::Ready);
            }
        }
        (bumped >= intents && up >= ready && starting > 0)
            .then(|| format!("{bumped} intents, {up} ready, {starting} starting"))
    };
    child.send("recover");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        while let Ok(line) = child.lines.try_recv() {
            if line.contains("RECOVERED") {
                child.kill9().await;
                return Err("recovery finished first".into());
            }
        }
        assert!(
            Instant::now() < deadline,
            "the child's recovery never progressed"
        );
        if in_flight().await.is_some() {
            let pid = rustix::process::Pid::from_raw(child.child.id() as i32).unwrap();
            rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
            // Frozen: what the store says now is where the kill lands.
            if let Some(at) = in_flight().await {
                child.kill9().await;
                return Ok(at);
            }
            rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// What must be the same with and without crashes during recovery.
async fn snapshot(w: &World, mgr: &SessionManager, ids: &[SessionId]) -> Vec<String> {
    let mut out = vec![format!(
        "task {}",
        w.store.get_task(w.task.id).await.unwrap().state
    )];
    for id in ids {
        let st = w.status(mgr, *id).await;
        let s = w.store.get_session(*id).await.unwrap();
        out.push(format!(
            "{id}: {} executor={:?} agent={} token={:?} messages={} error={:?}",
            st.state,
            st.executor_status,
            st.is_agent_running,
            s.resume_token,
            w.messages(*id).await.len(),
            st.error_message
        ));
    }
    out
}

/// `kill -9` during recovery itself, 10 rounds at random points of the
/// recovery, with several sessions whose agentctls are gone (so
/// recovery relaunches and resumes, which takes a moment). A clean start
/// afterwards ends in the same state as a recovery without crashes, with
/// exactly one agentctl (and container) per session, and each conversation
/// continues.
async fn kill9_during_recovery(runtime: Runtime) {
    const SESSIONS: usize = 4;
    const ROUNDS: usize = 10;
    let w = World::new(Db::Sqlite).await;
    let kit = match runtime {
        Runtime::LocalDocker => Some(DockerKit::new(&w).await),
        _ => None,
    };
    let profile = kit.as_ref().map_or(&w.profile, |k| &k.profile).clone();
    let manager = |w: &World| match &kit {
        Some(k) => k.manager(w),
        None => w.manager(),
    };
    let mgr = manager(&w);
    let mut ids = Vec::new();
    for i in 0..SESSIONS {
        let s = w
            .create_rt(&mgr, &format!("r{i}"), &profile, runtime, None)
            .await;
        w.prompt(&mgr, s.id, "one").await;
        ids.push(s.id);
    }
    mgr.shutdown();
    drop(mgr);
    knock_out(&w, kit.as_ref(), &ids).await;

    // Without crashes.
    let mgr = manager(&w);
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(
        summary.count(OutcomeLabel::Resumed),
        SESSIONS,
        "{summary:?}"
    );
    let expected = snapshot(&w, &mgr, &ids).await;
    mgr.shutdown();
    drop(mgr);

    // Crashes at points of recovery picked at random but proven by the
    // world (see `kill_during_recovery`), so every round lands during
    // recovery whatever the machine's load. Every round starts with every
    // agentctl gone (so recovery has intents to write) from the store the
    // crashed recovery before it left (intents, half-recorded handles).
    let started = Instant::now();
    for round in 0..ROUNDS {
        let mut attempt = 0;
        loop {
            knock_out_all(&w, kit.as_ref(), &ids).await;
            // Where to land: after 1-4 intents, 0-2 of them already ready.
            let pick = uuid::Uuid::new_v4().as_u128();
            let intents = 1 + (pick % SESSIONS as u128) as usize;
            let ready = ((pick >> 8) % 3) as usize;
            let child = Backend::start(&w, kit.as_ref()).await;
            match kill_during_recovery(&w, child, &ids, intents, ready).await {
                Ok(at) => {
                    eprintln!("round {round}: kill -9 during recovery ({at})");
                    break;
                }
                Err(why) => {
                    attempt += 1;
                    eprintln!("round {round}: no kill ({why}), again");
                    assert!(
                        attempt < 8,
                        "round {round}: recovery never caught in flight: {why}"
                    );
                }
            }
        }
    }
    eprintln!(
        "{ROUNDS} crash rounds, each during recovery, in {:?}",
        started.elapsed()
    );

    let mgr = manager(&w);
    mgr.recovery().recover_all().await.unwrap();
    assert_eq!(snapshot(&w, &mgr, &ids).await, expected);
    for id in &ids {
        w.track(*id).await;
        assert_one_agentctl(&w, kit.as_ref(), *id, runtime).await;
    }
    if runtime == Runtime::LocalStandalone {
        let agents = w
            .strays()
            .into_iter()
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("acp-demo-agent"))
            })
            .count();
        assert_eq!(agents, SESSIONS, "one agent per session");
    }
    for id in &ids {
        let token = w
            .store
            .get_session(*id)
            .await
            .unwrap()
            .resume_token
            .unwrap();
        let reply = w.prompt(&mgr, *id, "two").await;
        assert_eq!(reply, expected_reply(2, &token, "two"));
    }
    w.finish(&mgr, &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_during_recovery_standalone() {
    kill9_during_recovery(Runtime::LocalStandalone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Docker: run by cargo xtask ci"]
async fn kill9_during_recovery_docker() {
    kill9_during_recovery(Runtime::LocalDocker).await;
}
