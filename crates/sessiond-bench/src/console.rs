//! `sessiond-bench console-seed DATA_DIR SESSIONS MESSAGES`: the store behind
//! the console's performance figures (`web/perf/console.mjs`), seeded
//! directly (not timed): one task with SESSIONS sessions, each with the event
//! history a real one leaves (starting, agentctl starting and ready, waiting,
//! stopped), and one task whose session holds MESSAGES messages. Every
//! session has ended, so the sessiond started on DATA_DIR recovers nothing
//! and the figures are the console's own. Prints the ids as JSON.

use std::{collections::BTreeMap, path::Path};

use chrono::Utc;
use sessiond_domain::{
    EventPayload, ExecutorId, Message, MessageId, MessageRole, Runtime, Session, SessionId,
    SessionState, Task, TaskId, TaskState, Worktree,
};
use sessiond_store::{Changeset, Store, StoreOptions};

pub async fn seed(args: &[String]) -> anyhow::Result<()> {
    let [dir, sessions, messages] = args else {
        anyhow::bail!("usage: sessiond-bench console-seed DATA_DIR SESSIONS MESSAGES");
    };
    let (sessions, messages): (usize, usize) = (sessions.parse()?, messages.parse()?);
    std::fs::create_dir_all(dir)?;
    let db = Path::new(dir).join("sessiond.sqlite3");
    let store = Store::connect(
        &format!("sqlite://{}", db.display()),
        StoreOptions::default(),
    )
    .await?;
    let profile = crate::seed::profile(&store).await?;

    let many = task(&store, &format!("{sessions} sessions")).await?;
    for i in 0..sessions {
        ended_session(&store, many, profile.id, i).await?;
    }
    let chat = task(&store, &format!("{messages} messages")).await?;
    let session = ended_session(&store, chat, profile.id, sessions).await?;
    let now = Utc::now();
    let batch = (0..messages)
        .map(|i| {
            let (role, content) = if i % 2 == 0 {
                (
                    MessageRole::User,
                    format!("message {}: {}", i / 2 + 1, "lorem ipsum ".repeat(8)),
                )
            } else {
                (
                    MessageRole::Agent,
                    format!(
                        "turn {} of the conversation: {}",
                        i / 2 + 1,
                        "dolor sit amet ".repeat(12)
                    ),
                )
            };
            let m = Message {
                id: MessageId::new(),
                session_id: session,
                task_id: chat,
                role,
                content,
                kind: sessiond_domain::MessageKind::Text,
                data: String::new(),
                seq: 0,
                complete: true,
                created_at: now,
                updated_at: now,
            };
            Changeset::new()
                .add_message(m.clone())
                .event(session, EventPayload::MessageAdded(m))
        })
        .collect::<Vec<_>>();
    for chunk in batch.chunks(500) {
        for r in store.commit_batch(chunk.to_vec()).await? {
            r?;
        }
    }
    // Ids are UUIDs: no JSON escaping needed. The caller reads this line.
    #[allow(clippy::print_stdout)]
    {
        println!(r#"{{"many":"{many}","chat":"{chat}","session":"{session}"}}"#);
    }
    Ok(())
}

async fn task(store: &Store, title: &str) -> anyhow::Result<TaskId> {
    let now = Utc::now();
    Ok(store
        .create_task(&Task {
            id: TaskId::new(),
            title: title.into(),
            state: TaskState::InProgress,
            created_at: now,
            updated_at: now,
        })
        .await?
        .id)
}

const VERBS: [&str; 5] = ["fix", "refactor", "document", "test", "speed up"];
const NOUNS: [&str; 7] = [
    "billing",
    "search",
    "login",
    "export",
    "cache",
    "parser",
    "scheduler",
];

/// A session that ran and was stopped, with the events that left.
async fn ended_session(
    store: &Store,
    task: TaskId,
    profile: sessiond_domain::AgentProfileId,
    i: usize,
) -> anyhow::Result<SessionId> {
    let now = Utc::now();
    let executor_id = ExecutorId::new();
    let worktree = Worktree {
        id: format!("wt-{i}"),
        path: format!("/srv/work/wt-{i}"),
        branch: format!("sessiond/wt-{i}"),
        ..Default::default()
    };
    let session = Session {
        id: SessionId::new(),
        task_id: task,
        state: SessionState::Cancelled,
        agent_profile_id: profile,
        agent_execution_id: Some(format!("{executor_id}/1")),
        runtime: Runtime::LocalStandalone,
        executor_id: None,
        worktree,
        // Titled as people title them, so a search has something to find.
        title: format!(
            "{} the {} module (#{i})",
            VERBS[i % VERBS.len()],
            NOUNS[i % NOUNS.len()]
        ),
        resume_token: Some(format!("conv-{executor_id}")),
        metadata: BTreeMap::new(),
        error_message: None,
        version: 1,
        created_at: now,
        updated_at: now,
    };
    let changed = |from, to| EventPayload::StateChanged {
        from,
        to,
        error_message: None,
    };
    let events = vec![
        changed(SessionState::Created, SessionState::Starting),
        EventPayload::AgentctlStarting {
            executor_id,
            runtime: Runtime::LocalStandalone,
            generation: 1,
        },
        EventPayload::AgentctlReady {
            executor_id,
            runtime: Runtime::LocalStandalone,
            supports_session_resume: Some(true),
        },
        changed(SessionState::Starting, SessionState::WaitingForInput),
        changed(SessionState::WaitingForInput, SessionState::Cancelled),
    ];
    Ok(store.create_session(&session, events).await?.0.id)
}
