//! The orphan sweep: removes sessiond-labelled Docker containers that no
//! executor record tracks any more (a session deleted while the engine was
//! unreachable, a crash between a remove and its record update).
//!
//! Removing a container someone still needs loses a conversation's runtime,
//! so the sweep acts only on positive evidence, never on absence of
//! knowledge:
//! - it runs only after the first startup recovery pass of this manager has
//!   finished, plus a grace period (a launch or recovery in flight has then
//!   written its intent record);
//! - a container without a `sessiond.executor_id` label is never listed,
//!   let alone touched;
//! - a labelled container is an orphan only when the session its
//!   `sessiond.session_id` label names exists in this store (so the
//!   container is ours, not another installation's on the same engine),
//!   and either the executor its `sessiond.executor_id` label names has no
//!   record, or that record is `stopped`/`error` and records a *different*
//!   container id;
//! - the decision is taken again under the session's lock, with the record
//!   re-read, right before the container is removed, and skipped while an
//!   operation (recovery, resume) on that session is in flight.
//!
//! See [`RecoveryControl::sweep_orphan_containers`](crate::RecoveryControl::sweep_orphan_containers) (one pass) and
//! [`RecoveryControl::start_orphan_sweep`](crate::RecoveryControl::start_orphan_sweep) (the background schedule).

use std::sync::Arc;

use sessiond_domain::{ExecutorId, ExecutorRecord, ExecutorStatus, SessionId};
use sessiond_executor::docker::{DockerExecutor, LabelledContainer};

use crate::error::Result;
use crate::recovery::Pass;

/// What one sweep pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Labelled containers looked at.
    pub examined: usize,
    /// Ids of the containers removed.
    pub removed: Vec<String>,
    /// Containers left alone because nothing proves they are orphans
    /// (tracked, unknown session, malformed labels, operation in flight).
    pub kept: usize,
}

/// Why a container is an orphan, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// Tracked, or no positive evidence that it is not.
    Keep(&'static str),
    Orphan(String),
}

/// The decision for one container, given the record its executor label
/// names (`None`: no such record) and whether its session is ours.
fn verdict(
    container: &LabelledContainer,
    session_known: bool,
    record: Option<&ExecutorRecord>,
) -> Verdict {
    if !session_known {
        return Verdict::Keep("its session is not in this store");
    }
    match record {
        None => Verdict::Orphan("its executor has no record".into()),
        Some(r) => match &r.container_id {
            Some(tracked)
                if tracked != &container.id
                    && matches!(r.status, ExecutorStatus::Stopped | ExecutorStatus::Error) =>
            {
                Verdict::Orphan(format!(
                    "its executor is {} and tracks container {tracked}",
                    r.status
                ))
            }
            _ => Verdict::Keep("tracked by its executor record"),
        },
    }
}

/// The orphan-container sweep.
pub(crate) struct Sweep<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Sweep<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Sweep<'_> {
    /// One pass of the orphan sweep over the containers of `docker`'s
    /// engine. Refuses to run (returns an empty report) until the first
    /// startup recovery pass of this manager has finished.
    pub(crate) async fn sweep_orphan_containers(
        &self,
        docker: &DockerExecutor,
    ) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        if !Pass(self).first_recovery_done() {
            tracing::debug!("orphan sweep skipped: startup recovery has not finished");
            return Ok(report);
        }
        let containers = docker.labelled_containers().await?;
        report.examined = containers.len();
        for c in containers {
            match self.sweep_one(docker, &c).await {
                Ok(true) => report.removed.push(c.id),
                Ok(false) => report.kept += 1,
                Err(e) => {
                    report.kept += 1;
                    tracing::warn!(container_id = %c.id, error = %e, "orphan sweep: container left alone");
                }
            }
        }
        if !report.removed.is_empty() {
            tracing::info!(
                examined = report.examined,
                removed = report.removed.len(),
                "orphan sweep removed containers no executor tracks"
            );
        }
        Ok(report)
    }

    /// Decides on one container and removes it when it is an orphan, with
    /// the decision re-taken under the session's lock right before.
    async fn sweep_one(&self, docker: &DockerExecutor, c: &LabelledContainer) -> Result<bool> {
        let (Some(executor_id), Some(session_id)) = (
            c.executor_id().and_then(|v| v.parse::<ExecutorId>().ok()),
            c.session_id().and_then(|v| v.parse::<SessionId>().ok()),
        ) else {
            tracing::debug!(container_id = %c.id, "orphan sweep: labels do not parse; leaving it");
            return Ok(false);
        };
        let Verdict::Orphan(_) = self.decide(c, executor_id, session_id).await? else {
            return Ok(false);
        };
        // Re-check under the lock every state change of the session takes.
        let _guard = self.inner.sessions.lock(session_id).await;
        if self.inner.sessions.inflight(session_id).is_some() {
            return Ok(false);
        }
        let Verdict::Orphan(why) = self.decide(c, executor_id, session_id).await? else {
            return Ok(false);
        };
        tracing::warn!(container_id = %c.id, %executor_id, session = %session_id, %why,
            "orphan sweep: removing container");
        docker.remove_container(&c.id).await?;
        Ok(true)
    }

    async fn decide(
        &self,
        c: &LabelledContainer,
        executor_id: ExecutorId,
        session_id: SessionId,
    ) -> Result<Verdict> {
        let store = &self.inner.store;
        let session_known = match store.get_session(session_id).await {
            Ok(_) => true,
            Err(e) if e.is_not_found() => false,
            Err(e) => return Err(e.into()),
        };
        let record = match store.get_executor(executor_id).await {
            Ok(r) => Some(r),
            Err(e) if e.is_not_found() => None,
            Err(e) => return Err(e.into()),
        };
        // A record of another session under this executor id: not ours to judge.
        if record.as_ref().is_some_and(|r| r.session_id != session_id) {
            return Ok(Verdict::Keep(
                "its labels disagree with the executor record",
            ));
        }
        Ok(verdict(c, session_known, record.as_ref()))
    }

    /// Runs the orphan sweep in the background: first
    /// [`ManagerConfig::orphan_sweep_grace`](crate::ManagerConfig) after the
    /// first startup recovery pass has finished, then every
    /// `orphan_sweep_interval` (if set). [`SessionManager::shutdown`](crate::SessionManager::shutdown) ends it.
    pub(crate) fn start_orphan_sweep(&self, docker: Arc<DockerExecutor>) {
        let grace = self.inner.config.orphan_sweep_grace;
        let interval = self.inner.config.orphan_sweep_interval;
        let me = self.0.clone();
        self.spawn_background(async move {
            Pass(&me).wait_first_recovery().await;
            tokio::time::sleep(grace).await;
            loop {
                if let Err(e) = Sweep(&me).sweep_orphan_containers(&docker).await {
                    tracing::warn!(error = %e, "orphan sweep failed");
                }
                match interval {
                    Some(every) => tokio::time::sleep(every).await,
                    None => return,
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use chrono::Utc;
    use sessiond_domain::{Runtime, TaskId, Worktree};

    use super::*;

    fn container(id: &str) -> LabelledContainer {
        LabelledContainer {
            id: id.into(),
            state: "exited".into(),
            labels: HashMap::new(),
        }
    }

    fn record(status: ExecutorStatus, container_id: Option<&str>) -> ExecutorRecord {
        let now = Utc::now();
        ExecutorRecord {
            id: ExecutorId::new(),
            session_id: SessionId::new(),
            task_id: TaskId::new(),
            runtime: Runtime::LocalDocker,
            status,
            agentctl_url: None,
            agentctl_port: None,
            container_id: container_id.map(str::to_owned),
            pid: None,
            pid_start_time: None,
            auth_secret: String::new(),
            generation: 1,
            supports_session_resume: true,
            supports_workspace_only: true,
            resume_token: None,
            workspace_path: "/w".into(),
            worktree: Worktree {
                id: "w".into(),
                path: "/w".into(),
                branch: "b".into(),
                ..Default::default()
            },
            last_seen_at: None,
            error_message: None,
            owner_id: None,
            lease_expires_at: None,
            lease_epoch: 0,
            version: 1,
            created_at: now,
            updated_at: now,
        }
    }

    fn is_orphan(v: Verdict) -> bool {
        matches!(v, Verdict::Orphan(_))
    }

    #[test]
    fn only_positive_evidence_makes_an_orphan() {
        let c = container("c1");
        // Session not in this store: never, whatever the record says.
        assert!(!is_orphan(verdict(&c, false, None)));
        // No record for its executor: orphan.
        assert!(is_orphan(verdict(&c, true, None)));
        // Record tracks this very container: kept in every status.
        for s in [
            ExecutorStatus::Starting,
            ExecutorStatus::Ready,
            ExecutorStatus::Error,
            ExecutorStatus::Stopped,
        ] {
            assert!(!is_orphan(verdict(&c, true, Some(&record(s, Some("c1"))))));
            // No container recorded (a crash between create and persist):
            // recovery adopts it by label, so it is kept.
            assert!(!is_orphan(verdict(&c, true, Some(&record(s, None)))));
        }
        // Record tracks another container: orphan only when stopped/error.
        assert!(is_orphan(verdict(
            &c,
            true,
            Some(&record(ExecutorStatus::Stopped, Some("c2")))
        )));
        assert!(is_orphan(verdict(
            &c,
            true,
            Some(&record(ExecutorStatus::Error, Some("c2")))
        )));
        assert!(!is_orphan(verdict(
            &c,
            true,
            Some(&record(ExecutorStatus::Ready, Some("c2")))
        )));
        assert!(!is_orphan(verdict(
            &c,
            true,
            Some(&record(ExecutorStatus::Starting, Some("c2")))
        )));
    }
}
