//! Seeding a store with N resumable remote sessions (not timed).

use std::collections::BTreeMap;

use chrono::Utc;
use futures::{StreamExt, TryStreamExt};
use sessiond_domain::{
    AgentProfile, AgentProfileId, ExecutorId, ExecutorRecord, ExecutorStatus, Runtime, Session,
    SessionId, SessionState, Task, TaskId, TaskState, Worktree,
};
use sessiond_store::{Changeset, Store};

use crate::fleet::secret_for;

/// The profile every seeded session uses: it claims session resume.
pub async fn profile(store: &Store) -> anyhow::Result<AgentProfile> {
    let now = Utc::now();
    Ok(store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: "bench".into(),
            command: "fleet-agent".into(),
            args: Vec::new(),
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
        .await?)
}

/// One seeded session: its task and ids.
#[derive(Debug, Clone, Copy)]
pub struct Seeded {
    pub task: TaskId,
    pub session: SessionId,
}

/// N tasks, each with one WAITING_FOR_INPUT remote session (resume token
/// set) and a `ready` executor record pointing at one of the fleet's `urls`.
pub async fn remote_sessions(
    store: &Store,
    profile: &AgentProfile,
    urls: &[String],
    n: usize,
) -> anyhow::Result<Vec<Seeded>> {
    let sessions: Vec<(Seeded, ExecutorRecord)> = futures::stream::iter(0..n)
        .map(|i| {
            let store = store.clone();
            let profile = profile.id;
            let url = urls[i % urls.len()].clone();
            async move { one(&store, profile, url, i).await }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let mut out = Vec::with_capacity(n);
    let mut records = Vec::with_capacity(n);
    for (s, r) in sessions {
        out.push(s);
        records.push(r);
    }
    for chunk in records.chunks(500) {
        let batch = chunk
            .iter()
            .map(|r| Changeset::new().insert_executor(r.clone()))
            .collect();
        for r in store.commit_batch(batch).await? {
            r?;
        }
    }
    Ok(out)
}

async fn one(
    store: &Store,
    profile: AgentProfileId,
    url: String,
    i: usize,
) -> anyhow::Result<(Seeded, ExecutorRecord)> {
    let now = Utc::now();
    let task = store
        .create_task(&Task {
            id: TaskId::new(),
            title: format!("bench task {i}"),
            state: TaskState::InProgress,
            created_at: now,
            updated_at: now,
        })
        .await?;
    let executor_id = ExecutorId::new();
    let token = format!("conv-{executor_id}");
    let worktree = Worktree {
        id: format!("wt-{i}"),
        path: format!("/srv/remote/wt-{i}"),
        branch: format!("sessiond/wt-{i}"),
        ..Default::default()
    };
    let session = Session {
        id: SessionId::new(),
        task_id: task.id,
        state: SessionState::WaitingForInput,
        agent_profile_id: profile,
        agent_execution_id: Some(format!("{executor_id}/1")),
        runtime: Runtime::Remote,
        executor_id: Some(executor_id),
        worktree: worktree.clone(),
        title: String::new(),
        resume_token: Some(token.clone()),
        metadata: BTreeMap::new(),
        error_message: None,
        version: 1,
        created_at: now,
        updated_at: now,
    };
    let (session, _) = store.create_session(&session, Vec::new()).await?;
    let port = url.rsplit_once(':').and_then(|(_, p)| p.parse().ok());
    let record = ExecutorRecord {
        id: executor_id,
        session_id: session.id,
        task_id: task.id,
        runtime: Runtime::Remote,
        status: ExecutorStatus::Ready,
        agentctl_url: Some(url),
        agentctl_port: port,
        container_id: None,
        pid: None,
        pid_start_time: None,
        auth_secret: secret_for(&executor_id.to_string()),
        generation: 1,
        supports_session_resume: true,
        supports_workspace_only: true,
        resume_token: Some(token),
        workspace_path: worktree.path.clone(),
        worktree,
        last_seen_at: Some(now),
        error_message: None,
        owner_id: None,
        lease_expires_at: None,
        lease_epoch: 0,
        version: 1,
        created_at: now,
        updated_at: now,
    };
    Ok((
        Seeded {
            task: task.id,
            session: session.id,
        },
        record,
    ))
}
