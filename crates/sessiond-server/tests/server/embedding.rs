//! The embedding API, in process: a [`Sessiond`] built by the library with
//! a third-party executor driver (`examples/custom_executor/wrapper.rs`)
//! registered under a runtime of its own name, `wrapper`, its services
//! mounted in the test's own tonic server and driven over gRPC, restarted,
//! recovered and resumed — with real agentctl and demo-agent processes, as
//! the built-in drivers are tested.

use std::{sync::Arc, time::Duration};

use sessiond_domain::{ExecutorStatus, Runtime, SessionId};
use sessiond_executor::ClientConfig;
use sessiond_proto::sessiond::v1 as pb;
use sessiond_server::{Sessiond, config::FileConfig};

use crate::support::{Sessions, bin, code, create_task, prompt, sessions_at};

#[path = "../../examples/custom_executor/wrapper.rs"]
mod wrapper;

use wrapper::{WrapperConfig, WrapperExecutor};

/// The custom runtime's name.
const WRAPPER: &str = "wrapper";

fn wrapper_runtime() -> Runtime {
    Runtime::parse(WRAPPER).unwrap()
}

/// The configuration of one embedded sessiond in `dir`, with the demo
/// agent; `default_runtime` as given.
fn config_with(dir: &std::path::Path, default_runtime: &str) -> sessiond_server::config::Config {
    let mut file = FileConfig::parse(&format!(
        r#"
        data_dir = "{data}"
        default_agent = "demo"
        [recovery]
        mode = "on_demand"
        [executors]
        default_runtime = "{default_runtime}"
        worktree_roots = ["{data}"]
        [[agents]]
        name = "demo"
        command = "{agent}"
        args = ["--state-dir", "{data}/agent-state"]
        "#,
        data = dir.display(),
        agent = bin("acp-demo-agent").display(),
    ))
    .unwrap();
    file.executors.standalone.agentctl_path = Some(bin("agentctl"));
    file.validate_for_embedding().unwrap()
}

fn config(dir: &std::path::Path) -> sessiond_server::config::Config {
    config_with(dir, "local_standalone")
}

/// The third-party driver: agentctl through a wrapper script that logs
/// each launch, so the test sees that this driver (not the built-in one)
/// started every agentctl.
fn driver(dir: &std::path::Path) -> Arc<WrapperExecutor> {
    let script = dir.join("wrap.sh");
    std::fs::write(
        &script,
        format!(
            "echo \"$@\" >> {}\nexec \"$@\"\n",
            dir.join("launches.log").display()
        ),
    )
    .unwrap();
    Arc::new(WrapperExecutor::new(WrapperConfig {
        runtime: wrapper_runtime(),
        // Through `sh`: the temporary directory may be mounted noexec.
        wrapper: vec!["/bin/sh".into(), script.display().to_string()],
        agentctl: bin("agentctl"),
        run_dir: dir.join("run"),
        env: vec![("PATH".into(), std::env::var("PATH").unwrap_or_default())],
        client: ClientConfig {
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(10),
            ..ClientConfig::default()
        },
        startup_timeout: Duration::from_secs(20),
    }))
}

fn launches(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("launches.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// An embedded sessiond whose services the test's own tonic server
/// serves on a loopback port.
struct Embedded {
    sessiond: Sessiond,
    client: Sessions,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<()>,
}

impl Embedded {
    /// Built with the `wrapper` driver registered or not, serving, and
    /// through its first recovery pass.
    async fn start(dir: &std::path::Path, with_driver: bool) -> Self {
        let mut builder = Sessiond::builder(config(dir));
        if with_driver {
            builder = builder.executor(driver(dir));
        }
        let sessiond = builder.build().await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let routes = sessiond.services().into_routes();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        sessiond.start(&addr).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !sessiond.is_ready() {
            assert!(
                std::time::Instant::now() < deadline,
                "first recovery pass not done"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let client = sessions_at(&addr).await;
        Self {
            sessiond,
            client,
            stop,
            server,
        }
    }

    /// The backend stops; the executors keep running.
    async fn stop(self) {
        self.sessiond.shutdown().await;
        let _ = self.stop.send(());
        let _ = self.server.await;
        self.sessiond.release().await;
    }

    async fn record(&self, session: &str) -> sessiond_domain::ExecutorRecord {
        self.sessiond
            .store()
            .get_executor_for_session(SessionId::parse(session).unwrap())
            .await
            .unwrap()
            .unwrap()
    }

    async fn status(&mut self, task: &str, session: &str) -> pb::GetSessionStatusResponse {
        self.client
            .get_session_status(pb::GetSessionStatusRequest {
                task_id: task.into(),
                session_id: session.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// ResumeSession, then the status it left.
    async fn resume(&mut self, task: &str, session: &str) -> pb::GetSessionStatusResponse {
        let resumed = self
            .client
            .resume_session(pb::ResumeSessionRequest {
                task_id: task.into(),
                session_id: session.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .session
            .unwrap();
        assert_eq!(
            resumed.state,
            pb::SessionState::WaitingForInput as i32,
            "{resumed:?}"
        );
        self.status(task, session).await
    }

    /// StopSession as COMPLETED.
    async fn complete(&mut self, task: &str, session: &str) {
        self.client
            .stop_session(pb::StopSessionRequest {
                task_id: task.into(),
                session_id: session.into(),
                outcome: pb::StopOutcome::Completed as i32,
            })
            .await
            .unwrap();
    }
}

/// CreateSession on the `wrapper` runtime, by name.
fn on_wrapper(task: &str, worktree: &std::path::Path) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        task_id: task.into(),
        runtime: pb::Runtime::Custom as i32,
        runtime_name: WRAPPER.into(),
        worktree: Some(pb::Worktree {
            id: "wt".into(),
            path: worktree.display().to_string(),
            branch: "main".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A session on the `wrapper` runtime, created over gRPC and prompted
/// once; returns its task, id and resume token.
async fn session_with_one_turn(
    e: &mut Embedded,
    worktree: &std::path::Path,
) -> (String, String, String) {
    let task = create_task(&mut e.client, "custom runtime").await;
    let session = e
        .client
        .create_session(on_wrapper(&task.id, worktree))
        .await
        .unwrap()
        .into_inner()
        .session
        .unwrap();
    assert_eq!(
        session.state,
        pb::SessionState::WaitingForInput as i32,
        "{session:?}"
    );
    assert_eq!(session.runtime, pb::Runtime::Custom as i32);
    assert_eq!(session.runtime_name, WRAPPER);
    let token = session.resume_token.clone();
    assert!(!token.is_empty(), "a resume token: {session:?}");
    let status = e.status(&task.id, &session.id).await;
    assert_eq!(status.runtime, pb::Runtime::Custom as i32);
    assert_eq!(status.runtime_name, WRAPPER);
    let reply = prompt(&mut e.client, &task.id, &session.id, "one").await;
    assert_eq!(
        reply,
        format!("turn 1 of session {token}: you said \"one\"")
    );
    (task.id, session.id, token)
}

/// Kills agentctl and its agent, as a crash of the machine would.
async fn kill_tree(pid: u32) {
    let mut pids = vec![pid];
    pids.extend(children_of(pid));
    for p in &pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pids
        .iter()
        .any(|p| sessiond_executor::process::stat(*p).is_some_and(|s| s.is_running()))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{pids:?} survived kill -9"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// create (gRPC, runtime `wrapper`) → prompt → backend restart with
/// agentctl and agent killed → recovery relaunches through the custom
/// driver (generation 2) → ResumeSession loads the conversation → the next
/// reply is the agent's turn 2 → completing stops agentctl through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_runtime_is_driven_like_the_built_in_ones() {
    let dir = tempfile::tempdir().unwrap();
    let worktree = dir.path().join("wt");
    std::fs::create_dir_all(&worktree).unwrap();

    let mut e = Embedded::start(dir.path(), true).await;
    let (task, session, token) = session_with_one_turn(&mut e, &worktree).await;
    assert_eq!(
        launches(dir.path()).len(),
        1,
        "launched through the wrapper"
    );
    let first = e.record(&session).await;
    assert_eq!(first.runtime, wrapper_runtime());
    assert_eq!(first.generation, 1);

    // Restart: the backend stops (executors keep running), then agentctl
    // and its agent die as in a reboot.
    e.stop().await;
    kill_tree(first.pid.unwrap()).await;

    let mut e = Embedded::start(dir.path(), true).await;
    let record = e.record(&session).await;
    assert_eq!(record.generation, 2, "relaunched by recovery: {record:?}");
    assert_eq!(record.status, ExecutorStatus::Ready);
    assert_ne!(record.pid, first.pid);
    assert_eq!(
        launches(dir.path()).len(),
        2,
        "relaunched through the wrapper"
    );
    let status = e.status(&task, &session).await;
    assert!(
        status.needs_resume,
        "on_demand: the agent waits for a resume: {status:?}"
    );

    let status = e.resume(&task, &session).await;
    assert!(status.is_agent_running, "{status:?}");
    assert_eq!(status.runtime_name, WRAPPER);
    let reply = prompt(&mut e.client, &task, &session, "two").await;
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"two\"")
    );

    // Ending the session stops agentctl through the driver.
    let pid = e.record(&session).await.pid.unwrap();
    e.complete(&task, &session).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sessiond_executor::process::stat(pid).is_some_and(|s| s.is_running()) {
        assert!(
            std::time::Instant::now() < deadline,
            "agentctl {pid} still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.stop().await;
}

/// A runtime no driver is registered for is refused before anything is
/// stored, naming the registered runtimes; so are invalid names and
/// RUNTIME_CUSTOM without a name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_runtimes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let worktree = dir.path().join("wt");
    std::fs::create_dir_all(&worktree).unwrap();
    let mut e = Embedded::start(dir.path(), true).await;
    let task = create_task(&mut e.client, "refused").await;
    let mut vm = on_wrapper(&task.id, &worktree);
    vm.runtime_name = "vm".into();
    let err = e.client.create_session(vm).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("vm")
            && err
                .message()
                .contains("registered runtimes: local_standalone, remote, wrapper"),
        "{}",
        err.message()
    );
    for (runtime, name) in [
        (pb::Runtime::Custom, ""),
        (pb::Runtime::Custom, "Not A Name"),
        (pb::Runtime::Remote, WRAPPER),
    ] {
        let mut req = on_wrapper(&task.id, &worktree);
        req.runtime = runtime as i32;
        req.runtime_name = name.into();
        assert_eq!(
            code(e.client.create_session(req).await),
            tonic::Code::InvalidArgument,
            "{runtime:?} {name:?}"
        );
    }
    let sessions = e
        .client
        .list_sessions(pb::ListSessionsRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert!(sessions.is_empty(), "nothing stored: {sessions:?}");
    assert!(launches(dir.path()).is_empty());
    e.stop().await;
}

/// The driver of a custom runtime is missing at a restart: recovery marks
/// the executor ERROR (`runtime_not_registered: wrapper`) and leaves the
/// session as it was; the next start with the driver registered recovers
/// it through the driver (generation 2) and the conversation resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_driver_parks_its_sessions_until_it_is_back() {
    let dir = tempfile::tempdir().unwrap();
    let worktree = dir.path().join("wt");
    std::fs::create_dir_all(&worktree).unwrap();

    let mut e = Embedded::start(dir.path(), true).await;
    let (task, session, token) = session_with_one_turn(&mut e, &worktree).await;
    let first = e.record(&session).await;
    e.stop().await;
    kill_tree(first.pid.unwrap()).await;

    // Without the driver: nothing is launched, nothing panics.
    let mut e = Embedded::start(dir.path(), false).await;
    let record = e.record(&session).await;
    assert_eq!(record.status, ExecutorStatus::Error, "{record:?}");
    let why = record.error_message.clone().unwrap_or_default();
    assert!(why.starts_with("runtime_not_registered: wrapper"), "{why}");
    assert_eq!(record.generation, 1);
    let status = e.status(&task, &session).await;
    assert_eq!(
        status.state,
        pb::SessionState::WaitingForInput as i32,
        "{status:?}"
    );
    assert_eq!(status.runtime_name, WRAPPER);
    assert!(!status.is_agent_running);
    assert_eq!(
        launches(dir.path()).len(),
        1,
        "nothing launched without the driver"
    );
    // New sessions on it are refused meanwhile.
    assert_eq!(
        code(e.client.create_session(on_wrapper(&task, &worktree)).await),
        tonic::Code::InvalidArgument
    );
    e.stop().await;

    // The driver is back: startup recovery takes the executor up again.
    let mut e = Embedded::start(dir.path(), true).await;
    let record = e.record(&session).await;
    assert_eq!(record.status, ExecutorStatus::Ready, "{record:?}");
    assert_eq!(
        record.generation, 2,
        "relaunched through the driver: {record:?}"
    );
    assert_eq!(record.error_message, None);
    assert_eq!(launches(dir.path()).len(), 2);
    let status = e.resume(&task, &session).await;
    assert!(status.is_agent_running, "{status:?}");
    let reply = prompt(&mut e.client, &task, &session, "two").await;
    assert_eq!(
        reply,
        format!("turn 2 of session {token}: you said \"two\"")
    );
    e.complete(&task, &session).await;
    e.stop().await;
}

/// The builder refuses a default runtime nothing drives and two drivers
/// for one runtime, before it opens anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builder_checks_the_registered_runtimes() {
    let dir = tempfile::tempdir().unwrap();
    let err = Sessiond::builder(config_with(dir.path(), WRAPPER))
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no executor driver is registered for wrapper")
            && err.contains("registered runtimes: local_standalone, remote"),
        "{err}"
    );
    let err = Sessiond::builder(config(dir.path()))
        .executor(driver(dir.path()))
        .executor(driver(dir.path()))
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("two executor drivers are registered for runtime wrapper"),
        "{err}"
    );
    assert!(
        !dir.path().join("sessiond.sqlite3").exists(),
        "nothing opened: {:?}",
        std::fs::read_dir(dir.path()).unwrap().collect::<Vec<_>>()
    );
    // With its driver, the custom runtime is a valid default.
    let sessiond = Sessiond::builder(config_with(dir.path(), WRAPPER))
        .executor(driver(dir.path()))
        .build()
        .await
        .unwrap();
    sessiond.release().await;
}

/// Direct children of `pid` (from /proc/*/stat field 4).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}
