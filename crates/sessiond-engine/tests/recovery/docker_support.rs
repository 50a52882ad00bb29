//! The Docker runtime for recovery tests. The tests using it are
//! `#[ignore = "needs Docker: run by cargo xtask ci"]`; `cargo xtask ci` and
//! `cargo xtask docker-tests` run them with the `DOCKER_HOST` of the engine
//! they provide. An engine or image that is not there FAILS the test.

use std::{path::Path, sync::Arc, time::Duration};

use sessiond_domain::{AgentProfile, SessionId, TaskId};
use sessiond_engine::SessionManager;
use sessiond_executor::{
    ClientConfig, Executor,
    docker::{DockerConfig, DockerExecutor, LABEL_SESSION_ID, LABEL_TASK_ID, LabelledContainer},
};

use crate::support::{World, drivers_in};

/// Where the engine is and which image to use, when Docker tests are asked for.
#[derive(Debug, Clone)]
pub struct DockerEnv {
    pub host: String,
    pub image: String,
}

/// The engine at `DOCKER_HOST` (else the default socket) and the image.
pub fn docker_env() -> DockerEnv {
    DockerEnv {
        host: std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into()),
        image: std::env::var("SESSIOND_DOCKER_IMAGE")
            .unwrap_or_else(|_| "sessiond-agentctl:dev".into()),
    }
}

/// The Docker driver of a world whose directory is `dir` (the same config in
/// the test and in a child backend). Panics when the engine is unusable.
pub async fn docker_driver(env: &DockerEnv, dir: &Path) -> Arc<DockerExecutor> {
    docker_driver_with(env, dir, &[]).await
}

/// [`docker_driver`] whose containers' agentctl gets `agentctl_env` too (test hooks).
pub async fn docker_driver_with(
    env: &DockerEnv,
    dir: &Path,
    agentctl_env: &[(&str, &str)],
) -> Arc<DockerExecutor> {
    docker_driver_from(env, docker_config(env, dir, agentctl_env)).await
}

/// The test drivers' configuration (see [`docker_driver_with`]).
pub fn docker_config(env: &DockerEnv, dir: &Path, agentctl_env: &[(&str, &str)]) -> DockerConfig {
    let mut config = DockerConfig::new(env.host.clone(), env.image.clone(), dir.join("docker-run"));
    config.env = agentctl_env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    config.client = ClientConfig {
        connect_timeout: Duration::from_secs(1),
        call_timeout: Duration::from_secs(5),
        ..ClientConfig::default()
    };
    config.stop_grace = Duration::from_secs(2);
    config.idle_timeout = Some(Duration::from_secs(300));
    config
}

/// A driver of `config`. Panics when the engine or the image is unusable.
pub async fn docker_driver_from(env: &DockerEnv, config: DockerConfig) -> Arc<DockerExecutor> {
    let driver = DockerExecutor::connect(config).await.unwrap_or_else(|e| {
        panic!(
            "no usable Docker engine at {} ({e}): set DOCKER_HOST to a running dockerd, \
             or run `cargo xtask ci` / `cargo xtask docker-tests`, which start one",
            env.host
        )
    });
    driver
        .docker()
        .expect("connected")
        .inspect_image(&env.image)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "image {} missing ({e}); build it with `cargo xtask docker-image`",
                env.image
            )
        });
    Arc::new(driver)
}

/// The demo agent inside the image, its state in the mounted worktree (so a
/// restarted container's agent can `session/load`), with `env`.
pub async fn demo_profile_in_docker(w: &World, name: &str, env: &[(&str, &str)]) -> AgentProfile {
    let args = [
        "--state-dir".to_owned(),
        format!("{CONTAINER_WORKSPACE}/.agent-state"),
    ];
    w.upsert_profile(name, "/usr/local/bin/acp-demo-agent", &args, env, true)
        .await
}

/// Where the driver mounts the worktree (its default).
pub const CONTAINER_WORKSPACE: &str = "/workspace";

/// Standalone, remote and Docker drivers for `dir`.
pub fn drivers_with(dir: &Path, docker: &Arc<DockerExecutor>) -> Vec<Arc<dyn Executor>> {
    let mut d = drivers_in(dir);
    d.push(docker.clone());
    d
}

/// The world's Docker test kit; removes the world's containers on drop.
pub struct DockerKit {
    pub env: DockerEnv,
    pub driver: Arc<DockerExecutor>,
    /// The demo agent inside the image, its state in the mounted worktree,
    /// so a restarted container's agent can `session/load`.
    pub profile: AgentProfile,
    task: TaskId,
}

impl DockerKit {
    /// Panics naming what is missing when the engine or image is not there.
    pub async fn new(w: &World) -> DockerKit {
        DockerKit::with_agentctl_env(w, &[]).await
    }

    /// A kit whose containers' agentctl gets `agentctl_env` too (test hooks).
    pub async fn with_agentctl_env(w: &World, agentctl_env: &[(&str, &str)]) -> DockerKit {
        let env = docker_env();
        let driver = docker_driver_with(&env, w.dir.path(), agentctl_env).await;
        let profile = demo_profile_in_docker(w, "demo-in-docker", &[]).await;
        DockerKit {
            env,
            driver,
            profile,
            task: w.task.id,
        }
    }

    pub fn manager(&self, w: &World) -> SessionManager {
        SessionManager::new(
            w.store.clone(),
            drivers_with(w.dir.path(), &self.driver),
            w.config(),
        )
    }

    /// Containers labelled with the session.
    pub async fn containers_of_session(&self, session: SessionId) -> Vec<LabelledContainer> {
        self.driver
            .labelled_containers()
            .await
            .unwrap()
            .into_iter()
            .filter(|c| c.labels.get(LABEL_SESSION_ID) == Some(&session.to_string()))
            .collect()
    }

    /// The one running container of the session (asserts there is exactly one).
    pub async fn one_running(&self, session: SessionId) -> LabelledContainer {
        let cs = self.containers_of_session(session).await;
        assert_eq!(cs.len(), 1, "exactly one container for {session}: {cs:?}");
        assert_eq!(cs[0].state, "running", "{cs:?}");
        cs[0].clone()
    }
}

impl Drop for DockerKit {
    /// Removes every container labelled with this world's task, also while
    /// a failing test unwinds (on a thread with a runtime of its own).
    fn drop(&mut self) {
        let env = self.env.clone();
        let task = self.task.to_string();
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            rt.block_on(async move {
                let config = DockerConfig::new(env.host.clone(), "unused", std::env::temp_dir());
                let driver = DockerExecutor::connect(config).await?;
                for c in driver.labelled_containers().await? {
                    if c.labels.get(LABEL_TASK_ID) == Some(&task) {
                        driver.remove_container(&c.id).await?;
                    }
                }
                Ok::<_, sessiond_executor::Error>(())
            })
        });
        match cleanup.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("removing test containers failed: {e}"),
            Err(_) => eprintln!("removing test containers panicked"),
        }
    }
}

/// `docker` CLI against the test engine (to make containers the driver
/// never would: unlabelled, or labelled for records that do not exist).
pub fn docker_cli(env: &DockerEnv, args: &[&str]) -> String {
    let out = std::process::Command::new("docker")
        .args(args)
        .env("DOCKER_HOST", &env.host)
        .output()
        .expect("docker CLI");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
