//! 100 standalone executors: real agentctl processes with the demo agent.

use std::{collections::BTreeMap, path::Path, sync::Arc, time::Duration};

use chrono::Utc;
use futures::{StreamExt, TryStreamExt};
use sessiond_domain::{
    AgentProfile, AgentProfileId, Runtime, SessionId, Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{NewSession, SessionManager};
use sessiond_executor::{
    Executor,
    standalone::{StandaloneConfig, StandaloneExecutor},
};
use sessiond_store::Store;

use crate::recovery::{client_config, manager_config, remote_driver};

pub fn drivers(bin_dir: &Path, dir: &Path) -> Vec<Arc<dyn Executor>> {
    let mut sc = StandaloneConfig::new(bin_dir.join("agentctl"), dir.join("run"));
    sc.log_dir = Some(dir.join("run"));
    // A safety net: should the bench die, its agentctls end themselves.
    sc.idle_timeout = Some(Duration::from_secs(120));
    sc.stop_grace = Duration::from_secs(2);
    sc.client = client_config();
    vec![Arc::new(StandaloneExecutor::new(sc)), remote_driver()]
}

/// Creates `n` standalone sessions (agentctl + demo agent each, session
/// WAITING_FOR_INPUT), then stops the manager leaving them running.
pub async fn create(
    store: &Store,
    bin_dir: &Path,
    dir: &Path,
    n: usize,
) -> anyhow::Result<Vec<(TaskId, SessionId)>> {
    let now = Utc::now();
    let profile = store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: "demo".into(),
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
            title: "standalone bench".into(),
            state: TaskState::InProgress,
            created_at: now,
            updated_at: now,
        })
        .await?;
    let manager = SessionManager::new(store.clone(), drivers(bin_dir, dir), manager_config());
    let made: Vec<(TaskId, SessionId)> = futures::stream::iter(0..n)
        .map(|i| {
            let manager = manager.clone();
            let path = dir.join(format!("wt-{i}"));
            async move {
                std::fs::create_dir_all(&path)?;
                let s = manager
                    .create_session(NewSession {
                        task_id: task.id,
                        agent_profile_id: profile.id,
                        runtime: Runtime::LocalStandalone,
                        worktree: Worktree {
                            id: format!("wt-{i}"),
                            path: path.display().to_string(),
                            branch: format!("sessiond/wt-{i}"),
                            ..Default::default()
                        },
                        remote: None,
                        metadata: BTreeMap::new(),
                        mcp_servers: Vec::new(),
                    })
                    .await?;
                anyhow::ensure!(
                    s.error_message.is_none(),
                    "standalone session {} failed: {:?}",
                    s.id,
                    s.error_message
                );
                Ok((task.id, s.id))
            }
        })
        .buffer_unordered(4)
        .try_collect()
        .await?;
    manager.shutdown();
    Ok(made)
}

/// Ends the sessions (agent, then agentctl), then ends any agentctl of this
/// run still alive, by the pid and start time its record names.
pub async fn cleanup(store: &Store, bin_dir: &Path, dir: &Path, sessions: &[(TaskId, SessionId)]) {
    let manager = SessionManager::new(store.clone(), drivers(bin_dir, dir), manager_config());
    futures::stream::iter(sessions.iter().copied())
        .for_each_concurrent(16, |(t, s)| {
            let manager = manager.clone();
            async move {
                if let Err(e) = manager.cancel_session(t, s).await {
                    tracing::warn!(%s, error = %e, "cancel failed");
                }
            }
        })
        .await;
    manager.shutdown();
    for (_, s) in sessions {
        if let Ok(Some(r)) = store.get_executor_for_session(*s).await
            && let (Some(pid), Some(st)) = (r.pid, r.pid_start_time)
            && let Some(p) = sessiond_executor::process::OwnedProcess::open(pid, st)
        {
            let _ = p.terminate(st, Duration::from_secs(2)).await;
        }
    }
}
