//! The turn path: `SendMessage` (the journaled turn: user message and
//! RUNNING committed, Prompt, agentctl's journal fsynced before it answers
//! and before the agent sees the prompt) to the reply's first chunk at a
//! `watch_session` subscriber, against the same prompt sent straight to an
//! agentctl (its Prompt, the first chunk on its own `StreamUpdates`) in the
//! same run. Both agentctls are real processes with the demo agent, each
//! with its journal; rounds alternate which goes first. On PostgreSQL the
//! manager runs as `sessiond serve` runs it there: a replica, whose commits
//! are fenced and announce their events with a `NOTIFY`.

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::{
    AgentProfile, AgentProfileId, EventPayload, MessageRole, Runtime, SessionId, SessionState,
    Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{NewSession, SessionManager};
use sessiond_executor::ExecutorHandle;
use sessiond_proto::agentctl::v1::{self as pb, agent_update::Kind};
use sessiond_store::Store;

use crate::{load::quantile, recovery::manager_config, standalone::drivers};

#[derive(Debug, Clone, Copy)]
pub struct TurnRow {
    pub turns: usize,
    pub sessiond_p50: Duration,
    pub sessiond_p99: Duration,
    pub direct_p50: Duration,
    pub direct_p99: Duration,
}

impl TurnRow {
    pub fn ratio(&self) -> f64 {
        self.sessiond_p50.as_secs_f64() / self.direct_p50.as_secs_f64().max(1e-9)
    }

    pub fn ratio_p99(&self) -> f64 {
        self.sessiond_p99.as_secs_f64() / self.direct_p99.as_secs_f64().max(1e-9)
    }
}

async fn session(
    manager: &SessionManager,
    task: TaskId,
    profile: AgentProfileId,
    dir: &Path,
    name: &str,
) -> anyhow::Result<SessionId> {
    let path = dir.join(name);
    std::fs::create_dir_all(&path)?;
    let s = manager
        .create_session(NewSession {
            task_id: task,
            agent_profile_id: profile,
            runtime: Runtime::LocalStandalone,
            worktree: Worktree {
                id: name.into(),
                path: path.display().to_string(),
                branch: format!("sessiond/{name}"),
                ..Default::default()
            },
            remote: None,
            metadata: BTreeMap::new(),
            mcp_servers: Vec::new(),
        })
        .await?;
    anyhow::ensure!(
        s.state == SessionState::WaitingForInput,
        "bench session {name} is {} ({:?})",
        s.state,
        s.error_message
    );
    Ok(s.id)
}

pub async fn measure(
    store: Store,
    bin_dir: std::path::PathBuf,
    dir: std::path::PathBuf,
    turns: usize,
) -> anyhow::Result<TurnRow> {
    let (store, bin_dir, dir) = (&store, bin_dir.as_path(), dir.as_path());
    let now = Utc::now();
    let profile = store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: "demo-turns".into(),
            command: bin_dir.join("acp-demo-agent").display().to_string(),
            args: vec![
                "--state-dir".into(),
                dir.join("agent-state").display().to_string(),
            ],
            env: BTreeMap::new(),
            supports_session_resume: true,
            container: None,
            auth_method: None,
            permission_policy: sessiond_domain::PermissionPolicy::Allow,
            permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
            config_defaults: Default::default(),
            mcp_servers: Vec::new(),
            created_at: now,
            updated_at: now,
        })
        .await?;
    let task = store
        .create_task(&Task {
            id: TaskId::new(),
            title: "turn bench".into(),
            state: TaskState::InProgress,
            created_at: now,
            updated_at: now,
        })
        .await?;
    // The direct session's agentctl is made by a manager that then stops,
    // so no pump of this process reads its updates but the bench's own.
    let maker = as_served(store, bin_dir, dir, "turn-bench-maker").await?;
    let direct_session = session(&maker, task.id, profile.id, dir, "direct").await?;
    maker.shutdown();
    let manager = as_served(store, bin_dir, dir, "turn-bench").await?;
    let measured = session(&manager, task.id, profile.id, dir, "sessiond").await?;
    let result = rounds(
        store,
        &manager,
        task.id,
        measured,
        direct_session,
        bin_dir,
        dir,
        turns,
    )
    .await;
    let _ = manager.cancel_session(task.id, measured).await;
    manager.shutdown();
    // The direct session's agentctl: its manager is gone (on PostgreSQL
    // another replica owns it), so it is stopped through its driver.
    if let Some(record) = store.get_executor_for_session(direct_session).await? {
        let standalone = drivers(bin_dir, dir)
            .into_iter()
            .find(|d| d.runtime() == Runtime::LocalStandalone);
        if let Some(driver) = standalone {
            driver.stop(&ExecutorHandle::from_record(&record)).await?;
        }
    }
    result
}

/// A manager as `sessiond serve` runs one on this store: on PostgreSQL a
/// replica (leases, fenced commits, a `NOTIFY` with each), on SQLite the
/// only process.
async fn as_served(
    store: &Store,
    bin_dir: &Path,
    dir: &Path,
    id: &str,
) -> anyhow::Result<SessionManager> {
    let mut config = manager_config();
    let replica = store.backend() == sessiond_store::Backend::Postgres;
    if replica {
        config.replica.id = id.into();
        config.replica.exclusive = false;
    }
    let manager = SessionManager::new(store.clone(), drivers(bin_dir, dir), config);
    if replica {
        let now = Utc::now();
        manager
            .replica()
            .start(sessiond_store::ReplicaInfo {
                id: id.into(),
                address: "127.0.0.1:1".into(),
                hostname: "bench".into(),
                pid: i64::from(std::process::id()),
                started_at: now,
                heartbeat_at: now,
                lease_ttl: manager.config().replica.lease_ttl,
                owned_executors: 0,
            })
            .await?;
    }
    Ok(manager)
}

#[allow(clippy::too_many_arguments)]
async fn rounds(
    store: &Store,
    manager: &SessionManager,
    task: TaskId,
    measured: SessionId,
    direct_session: SessionId,
    bin_dir: &Path,
    dir: &Path,
    turns: usize,
) -> anyhow::Result<TurnRow> {
    let record = store
        .get_executor_for_session(direct_session)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no executor for the direct session"))?;
    let driver = drivers(bin_dir, dir)
        .into_iter()
        .find(|d| d.runtime() == Runtime::LocalStandalone)
        .ok_or_else(|| anyhow::anyhow!("no standalone driver"))?;
    let client = driver.client(&ExecutorHandle::from_record(&record))?;
    let health = client.health().await?;
    let mut updates = client
        .stream_updates(health.latest_cursor, &health.instance_id)
        .await?;
    let mut events = manager
        .watch_session(measured, store.last_event_seq(measured).await?)
        .await?;
    let limit = Duration::from_secs(30);
    let (mut via, mut direct) = (Vec::new(), Vec::new());
    // Two warm-up turns each (connections, the agent's first prompt).
    for i in 0..turns + 2 {
        let text = format!("bench turn {i}");
        for which in [i % 2, 1 - i % 2] {
            if which == 0 {
                let t = Instant::now();
                let sent = manager.send_message(task, measured, &text).await?;
                let mut first = None;
                loop {
                    let e = tokio::time::timeout(limit, events.next())
                        .await?
                        .ok_or_else(|| anyhow::anyhow!("watch stream ended"))??;
                    match &e.payload {
                        EventPayload::MessageAdded(m)
                            if m.role == MessageRole::Agent
                                && m.kind == sessiond_domain::MessageKind::Text
                                && first.is_none() =>
                        {
                            first = Some(t.elapsed());
                        }
                        EventPayload::StateChanged {
                            to: SessionState::WaitingForInput,
                            ..
                        } if first.is_some() => break,
                        EventPayload::StateChanged {
                            to: SessionState::Error,
                            error_message,
                            ..
                        } => anyhow::bail!("bench session failed: {error_message:?}"),
                        _ => {}
                    }
                }
                anyhow::ensure!(sent.content == text);
                if i >= 2 {
                    via.extend(first);
                }
            } else {
                let turn_id = TaskId::new().to_string();
                let t = Instant::now();
                client
                    .prompt(pb::PromptRequest {
                        text: text.clone(),
                        turn_id: turn_id.clone(),
                        ..Default::default()
                    })
                    .await?;
                let mut first = None;
                loop {
                    let u = tokio::time::timeout(limit, updates.next())
                        .await?
                        .ok_or_else(|| anyhow::anyhow!("update stream ended"))??;
                    match u.kind {
                        Some(Kind::MessageChunk(c)) if c.turn_id == turn_id && first.is_none() => {
                            first = Some(t.elapsed());
                        }
                        Some(Kind::TurnEnded(e)) if e.turn_id == turn_id => break,
                        _ => {}
                    }
                }
                if i >= 2 {
                    direct.extend(first);
                }
            }
        }
    }
    via.sort_unstable();
    direct.sort_unstable();
    anyhow::ensure!(
        via.len() == turns && direct.len() == turns,
        "missing first chunks"
    );
    Ok(TurnRow {
        turns,
        sessiond_p50: quantile(&via, 0.5),
        sessiond_p99: quantile(&via, 0.99),
        direct_p50: quantile(&direct, 0.5),
        direct_p99: quantile(&direct, 0.99),
    })
}
