//! `remote`: an agentctl that another host runs; this driver starts nothing.
//!
//! **Launch**, **probe** and **recover** connect to the agentctl URL (plain `http://`, or
//! `https://` verified against a CA) and call `Health` until it answers with
//! the executor id, retrying with exponential backoff and jitter until the
//! configured deadline; then the executor is ready. A host that stays
//! unreachable, or a listener that accepts and never answers, ends in an error
//! once the deadline passes ([`Error::NotReady`] carrying the last failure).
//! **Stop** asks agentctl to stop its agent; agentctl itself belongs to the
//! remote host. **Remove** is the same as stop.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use sessiond_domain::{ExecutorId, Runtime};

use sessiond_proto::agentctl::v1 as pb;

use crate::{
    AgentctlClient, Backoff, ClientConfig, Executor, ExecutorHandle, Health, LaunchSpec, Probe,
    Recovered, RecoveryAction, WorktreeAnswer, WorktreeOp, WorktreeTarget,
    error::{Error, Result},
};

/// Configuration of the remote driver.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// Connection timeouts and TLS trust (for `https://` URLs).
    pub client: ClientConfig,
    /// Delays between attempts.
    pub backoff: Backoff,
    /// How long launch and recover keep trying before giving up.
    pub ready_deadline: Duration,
    /// Grace passed to agentctl's `StopAgent` on stop.
    pub stop_grace: Duration,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            client: ClientConfig::default(),
            backoff: Backoff::default(),
            ready_deadline: Duration::from_secs(60),
            stop_grace: Duration::from_secs(3),
        }
    }
}

/// The remote driver ([`Runtime::Remote`]): connects to an agentctl that
/// another host runs and started itself; it never spawns or kills anything.
#[derive(Debug, Clone)]
pub struct RemoteExecutor {
    config: RemoteConfig,
}

impl RemoteExecutor {
    /// The driver; it connects to nothing until the first call.
    pub fn new(config: RemoteConfig) -> Self {
        Self { config }
    }

    /// `Health` with identity check, retried with backoff until
    /// `ready_deadline`. Fails at once on errors waiting cannot fix (wrong
    /// secret, wrong executor, bad URL).
    ///
    /// # Errors
    ///
    /// [`Error::NotReady`] with the last failure once the deadline passed;
    /// at once, any error for which [`Error::is_unavailable`] is false
    /// ([`Error::Unauthenticated`], [`Error::IdentityMismatch`], [`Error::Tls`], ...).
    pub async fn wait_ready(
        &self,
        client: &AgentctlClient,
        executor_id: ExecutorId,
    ) -> Result<Health> {
        let started = Instant::now();
        let deadline = started + self.config.ready_deadline;
        let mut attempt = 0u32;
        let mut last_error = String::from("no answer");
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::NotReady {
                    executor_id,
                    timeout: self.config.ready_deadline,
                    last_error,
                });
            }
            match tokio::time::timeout(remaining, client.verify_identity(executor_id)).await {
                Ok(Ok(health)) => {
                    tracing::info!(%executor_id, url = client.url(), attempts = attempt + 1,
                        elapsed_ms = started.elapsed().as_millis() as u64, "remote agentctl ready");
                    return Ok(health);
                }
                Ok(Err(e)) if !e.is_unavailable() => return Err(e),
                Ok(Err(e)) => last_error = e.to_string(),
                // The deadline cut the attempt short; keep what the previous one said.
                Err(_) => {}
            }
            let delay = self.config.backoff.delay(attempt);
            attempt += 1;
            tracing::debug!(%executor_id, url = client.url(), attempt, ?delay, %last_error,
                "remote agentctl not ready, retrying");
            let remaining = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(delay.min(remaining)).await;
        }
    }
}

impl RemoteExecutor {
    /// Brings the executor of a stored handle back in one call: `probe`,
    /// then `start` or `launch` with generation + 1 as the probe says.
    /// Writes no intent: the session manager, which records one, uses the
    /// two phases itself; this is for a driver used on its own.
    pub async fn recover(&self, handle: &ExecutorHandle) -> Result<Recovered> {
        let health = self
            .wait_ready(&self.client(handle)?, handle.executor_id)
            .await?;
        Ok(Recovered {
            handle: handle.clone(),
            action: RecoveryAction::Reattached,
            health,
        })
    }
}

#[async_trait]
impl Executor for RemoteExecutor {
    fn runtime(&self) -> Runtime {
        Runtime::Remote
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<ExecutorHandle> {
        let target = spec.remote.as_ref().ok_or_else(|| {
            Error::Config(format!(
                "remote executor {} needs an agentctl URL and secret (LaunchSpec::remote)",
                spec.executor_id
            ))
        })?;
        let mut handle = ExecutorHandle::new(
            spec,
            Runtime::Remote,
            target.auth_secret.clone(),
            target.url.clone(),
        );
        handle.agentctl_port = port_of(&target.url);
        self.wait_ready(&self.client(&handle)?, spec.executor_id)
            .await?;
        Ok(handle)
    }

    /// Reattachable once the remote agentctl answers (retried with backoff
    /// until the deadline); an error otherwise. Never `NeedsLaunch`: the
    /// remote host runs agentctl itself.
    async fn probe(&self, handle: &ExecutorHandle) -> Result<Probe> {
        let health = self
            .wait_ready(&self.client(handle)?, handle.executor_id)
            .await?;
        Ok(Probe::Reattachable {
            handle: handle.clone(),
            health,
        })
    }

    async fn stop(&self, handle: &ExecutorHandle) -> Result<()> {
        self.client(handle)?
            .stop_agent(self.config.stop_grace)
            .await
    }

    async fn remove(&self, handle: &ExecutorHandle) -> Result<()> {
        self.stop(handle).await
    }

    fn client(&self, handle: &ExecutorHandle) -> Result<AgentctlClient> {
        Ok(AgentctlClient::new(
            &handle.agentctl_url,
            &handle.auth_secret,
            &self.config.client,
        )?
        .with_lease_epoch(handle.lease_epoch))
    }

    /// Through the host's agentctl (its `Worktree` call), which confines it
    /// to the worktree roots it was started with and serves the worktree
    /// it makes as its workspace.
    async fn worktree(&self, target: &WorktreeTarget, op: WorktreeOp) -> Result<WorktreeAnswer> {
        let Some((remote, epoch)) = &target.agentctl else {
            return Err(Error::Config(
                "a remote worktree operation needs the host's agentctl (WorktreeTarget::agentctl)"
                    .into(),
            ));
        };
        let client = AgentctlClient::new(&remote.url, &remote.auth_secret, &self.config.client)?
            .with_lease_epoch(*epoch);
        let request = pb::WorktreeRequest {
            op: crate::worktree::op_name(op).into(),
            repository: target.repository.clone(),
            base: target.base.clone(),
            branch: target.branch.clone(),
            path: target.path.clone(),
            never_created: matches!(
                op,
                WorktreeOp::Restore {
                    never_created: true
                }
            ),
            delete_branch: matches!(
                op,
                WorktreeOp::Remove {
                    delete_branch: true
                }
            ),
            limit: match op {
                WorktreeOp::Commits { limit } => limit,
                _ => 0,
            },
        };
        let json = client
            .worktree(request, crate::worktree::WORKTREE_TIMEOUT)
            .await?;
        serde_json::from_str::<serde_json::Value>(&json)
            .ok()
            .and_then(|ok| crate::worktree::parse_ok(&ok, op))
            .unwrap_or_else(|| {
                Err(Error::Worktree {
                    code: tonic::Code::Internal,
                    message: format!("agentctl at {} answered Worktree with {json:?}", remote.url),
                })
            })
    }
}

fn port_of(url: &str) -> Option<u16> {
    let authority = url.split("://").nth(1)?.split('/').next()?;
    authority.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_from_url() {
        assert_eq!(port_of("http://127.0.0.1:7001"), Some(7001));
        assert_eq!(port_of("https://[::1]:443/x"), Some(443));
        assert_eq!(port_of("https://agent.example"), None);
    }
}
