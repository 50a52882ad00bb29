//! The store suite, written once and run on SQLite (a temp file) and on a
//! real PostgreSQL (a throwaway cluster started by sessiond-testkit, or
//! `DATABASE_URL`), one fresh database per test.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};

use chrono::{Duration, Utc};
use sessiond_domain::{
    AgentProfile, AgentProfileId, EventKind, EventPayload, ExecutorId, ExecutorRecord,
    ExecutorStatus, Message, MessageId, MessageKind, MessageRole, Runtime, Session, SessionId,
    SessionState, Task, TaskEvent, TaskId, TaskState, TitleSource, Worktree,
};
use sessiond_store::{Backend, Changeset, Error, Heartbeat, Store, StoreOptions};

/// A store on a fresh database, and what keeps that database alive.
struct Db {
    store: Store,
    _guard: Guard,
}

#[allow(dead_code)] // the guards are held for their Drop
enum Guard {
    Sqlite(tempfile::TempDir),
    Postgres(sessiond_testkit::postgres::TestDatabase),
}

mod open {
    use super::*;

    pub async fn sqlite() -> Db {
        let dir = tempfile::tempdir().unwrap();
        // A missing parent directory is created by the store.
        let path = dir.path().join("data").join("sessiond.db");
        let url = format!("sqlite://{}", path.display());
        let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
        assert_eq!(store.backend(), Backend::Sqlite);
        assert!(path.exists());
        Db {
            store,
            _guard: Guard::Sqlite(dir),
        }
    }

    pub async fn postgres() -> Db {
        let db = tokio::task::spawn_blocking(sessiond_testkit::postgres::test_database)
            .await
            .unwrap();
        let store = Store::connect(db.url(), StoreOptions::default())
            .await
            .unwrap();
        assert_eq!(store.backend(), Backend::Postgres);
        Db {
            store,
            _guard: Guard::Postgres(db),
        }
    }
}

// ------------------------------------------------------------------ fixtures

fn task(title: &str) -> Task {
    let now = Utc::now();
    Task {
        id: TaskId::new(),
        title: title.into(),
        state: TaskState::Todo,
        created_at: now,
        updated_at: now,
    }
}

fn profile(name: &str) -> AgentProfile {
    let now = Utc::now();
    AgentProfile {
        id: AgentProfileId::new(),
        name: name.into(),
        command: "acp-demo-agent".into(),
        args: vec!["--state-dir".into(), "/tmp/x y".into()],
        env: BTreeMap::from([("RUST_LOG".into(), "info".into())]),
        supports_session_resume: true,
        container: None,
        auth_method: None,
        permission_policy: sessiond_domain::PermissionPolicy::Allow,
        permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
        config_defaults: Default::default(),
        mcp_servers: Vec::new(),
        created_at: now,
        updated_at: now,
    }
}

fn session(task: &Task, profile: &AgentProfile) -> Session {
    let now = Utc::now();
    Session {
        id: SessionId::new(),
        task_id: task.id,
        state: SessionState::Created,
        agent_profile_id: profile.id,
        agent_execution_id: None,
        runtime: Runtime::LocalStandalone,
        executor_id: None,
        worktree: Worktree {
            id: "wt-1".into(),
            path: "/work/wt-1".into(),
            branch: "sessiond/wt-1".into(),
            repository: "/work/repo".into(),
            base: "main".into(),
        },
        title: String::new(),
        resume_token: Some("acp-session-1".into()),
        metadata: BTreeMap::from([("note".into(), "ünïcode \"quoted\"".into())]),
        error_message: None,
        version: 1,
        created_at: now,
        updated_at: now,
    }
}

fn executor(s: &Session, status: ExecutorStatus) -> ExecutorRecord {
    let now = Utc::now();
    ExecutorRecord {
        id: ExecutorId::new(),
        session_id: s.id,
        task_id: s.task_id,
        runtime: Runtime::LocalStandalone,
        status,
        agentctl_url: Some("http://127.0.0.1:7001".into()),
        agentctl_port: Some(7001),
        container_id: None,
        pid: Some(4242),
        pid_start_time: Some(u64::from(u32::MAX) + 17),
        auth_secret: "s3cret".into(),
        generation: 1,
        supports_session_resume: true,
        supports_workspace_only: true,
        resume_token: Some("acp-session-1".into()),
        workspace_path: "/work/wt-1".into(),
        worktree: s.worktree.clone(),
        last_seen_at: Some(now),
        error_message: None,
        owner_id: Some("replica-a".into()),
        lease_expires_at: Some(now + Duration::seconds(30)),
        lease_epoch: 0,
        version: 1,
        created_at: now,
        updated_at: now,
    }
}

fn message(s: &Session, role: MessageRole, content: &str) -> Message {
    let now = Utc::now();
    Message {
        id: MessageId::new(),
        session_id: s.id,
        task_id: s.task_id,
        role,
        content: content.into(),
        kind: MessageKind::Text,
        data: String::new(),
        seq: 0,
        complete: role != MessageRole::Agent,
        created_at: now,
        updated_at: now,
    }
}

fn state_changed(from: SessionState, to: SessionState) -> EventPayload {
    EventPayload::StateChanged {
        from,
        to,
        error_message: None,
    }
}

/// A task, a profile and a session on it.
async fn seed(store: &Store) -> (Task, AgentProfile, Session) {
    let t = store.create_task(&task("fix the bug")).await.unwrap();
    let p = store
        .upsert_agent_profile(&profile(&format!("demo-{}", TaskId::new())))
        .await
        .unwrap();
    let (s, _) = store
        .create_session(&session(&t, &p), vec![])
        .await
        .unwrap();
    (t, p, s)
}

/// Commits `change` and returns the executor record it wrote.
async fn committed_executor(store: &Store, change: Changeset) -> ExecutorRecord {
    store.commit(change).await.unwrap().executor.unwrap()
}

fn assert_gap_free(seqs: impl IntoIterator<Item = i64>, n: usize, what: &str) {
    let seqs: Vec<i64> = seqs.into_iter().collect();
    let unique: BTreeSet<i64> = seqs.iter().copied().collect();
    assert_eq!(
        unique.len(),
        seqs.len(),
        "{what}: duplicate seqs in {seqs:?}"
    );
    let expected: BTreeSet<i64> = (1..=n as i64).collect();
    assert_eq!(unique, expected, "{what}: not 1..={n}");
}

// ------------------------------------------------------------------ the suite

mod suite {
    use super::*;

    /// Titles: the prompt's names an unnamed session only, the agent's
    /// replaces the prompt's, the user's replaces any and is replaced by
    /// none but the user's; an empty user title hands naming back. A title
    /// write moves no version (a holder of the session still updates it),
    /// and no session update writes the title.
    pub async fn session_titles_by_source(store: &Store) {
        let (_, _, s) = seed(store).await;
        let set = |title: &str, source| store.set_session_title(s.id, title.to_owned(), source);
        assert_eq!(store.get_session(s.id).await.unwrap().title, "");
        let (after, written) = set("from the prompt", TitleSource::Prompt).await.unwrap();
        assert!(written);
        assert_eq!(after.title, "from the prompt");
        assert_eq!(after.version, s.version, "a title is not a state change");
        assert!(!set("a later prompt", TitleSource::Prompt).await.unwrap().1);
        // In a changeset, with the rest of the write.
        store
            .commit(Changeset::new().set_title(s.id, "the agent's".into(), TitleSource::Agent))
            .await
            .unwrap();
        assert_eq!(store.get_session(s.id).await.unwrap().title, "the agent's");
        assert!(set("mine", TitleSource::User).await.unwrap().1);
        assert!(
            !set("the agent's again", TitleSource::Agent)
                .await
                .unwrap()
                .1
        );
        assert!(!set("a prompt", TitleSource::Prompt).await.unwrap().1);
        // A session update from a holder of the old copy keeps the title.
        let mut held = s.clone();
        held.state = SessionState::Starting;
        let c = store
            .commit(Changeset::new().update_session(held))
            .await
            .unwrap();
        assert_eq!(c.session.unwrap().title, "mine");
        assert!(set("", TitleSource::User).await.unwrap().1);
        assert!(set("named again", TitleSource::Prompt).await.unwrap().1);
        assert_eq!(store.get_session(s.id).await.unwrap().title, "named again");
        assert_eq!(
            store.list_sessions(s.task_id).await.unwrap()[0].title,
            "named again"
        );
        // Unknown and deleted sessions are not found.
        let err = store
            .set_session_title(SessionId::new(), "x".into(), TitleSource::User)
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
        store.mark_session_deleted(s.id).await.unwrap();
        let err = set("x", TitleSource::User).await.unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    /// The session a commit hands back (the row its update returned) is the
    /// stored row, field by field: every text column holds a different
    /// value, so two columns read in each other's place would show.
    pub async fn a_committed_session_is_the_stored_row(store: &Store) {
        let t = store.create_task(&task("returned")).await.unwrap();
        let p = store
            .upsert_agent_profile(&profile(&format!("demo-{}", TaskId::new())))
            .await
            .unwrap();
        let (created, _) = store
            .create_session(&session(&t, &p), Vec::new())
            .await
            .unwrap();
        store
            .set_session_title(created.id, "a title".into(), TitleSource::User)
            .await
            .unwrap();
        let mut changed = store.get_session(created.id).await.unwrap();
        changed.state = SessionState::Error;
        changed.agent_execution_id = Some("execution-x".into());
        changed.runtime = Runtime::Remote;
        changed.executor_id = Some(ExecutorId::new());
        changed.worktree = Worktree {
            id: "wt-id".into(),
            path: "/wt/path".into(),
            branch: "wt-branch".into(),
            repository: "/wt/repository".into(),
            base: "wt-base".into(),
        };
        changed.resume_token = Some("token-x".into());
        changed.metadata.insert("k".into(), "v".into());
        changed.error_message = Some("an error".into());
        let committed = store
            .commit(Changeset::new().update_session(changed).event(
                created.id,
                state_changed(SessionState::Created, SessionState::Error),
            ))
            .await
            .unwrap();
        let stored = store.get_session(created.id).await.unwrap();
        assert_eq!(committed.session, Some(stored.clone()));
        assert_eq!(stored.title, "a title");
        assert_eq!(stored.worktree.branch, "wt-branch");
        assert_eq!(stored.error_message.as_deref(), Some("an error"));
        // With its title written in the same changeset: the title is there.
        let committed = store
            .commit(Changeset::new().update_session(stored).set_title(
                created.id,
                "renamed".into(),
                TitleSource::User,
            ))
            .await
            .unwrap();
        assert_eq!(committed.session.unwrap().title, "renamed");
    }

    /// A session created with its intent is stored with it or not at all.
    pub async fn session_created_with_its_intent_or_not_at_all(store: &Store) {
        let t = store.create_task(&task("atomic")).await.unwrap();
        let p = store
            .upsert_agent_profile(&profile(&format!("demo-{}", TaskId::new())))
            .await
            .unwrap();
        let new = session(&t, &p);
        let mut starting = new.clone();
        starting.state = SessionState::Starting;
        let committed = store
            .create_session_with(
                &new,
                Changeset::new()
                    .update_session(starting)
                    .insert_executor(executor(&new, ExecutorStatus::Starting))
                    .event(
                        new.id,
                        state_changed(SessionState::Created, SessionState::Starting),
                    ),
            )
            .await
            .unwrap();
        let stored = store.get_session(new.id).await.unwrap();
        assert_eq!(stored.state, SessionState::Starting);
        assert_eq!(stored.version, 2);
        assert_eq!(committed.session, Some(stored));
        assert_eq!(committed.events.len(), 1);
        assert_eq!(committed.events[0].seq, 1);
        let r = store
            .get_executor_for_session(new.id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.status, ExecutorStatus::Starting);

        // The second write fails (a stale version): no session is left.
        let doomed = session(&t, &p);
        let mut stale = doomed.clone();
        stale.version = 7;
        let err = store
            .create_session_with(
                &doomed,
                Changeset::new()
                    .update_session(stale)
                    .insert_executor(executor(&doomed, ExecutorStatus::Starting)),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Conflict { .. }), "{err}");
        assert!(
            store
                .get_session(doomed.id)
                .await
                .unwrap_err()
                .is_not_found()
        );
        assert_eq!(
            store.get_executor_for_session(doomed.id).await.unwrap(),
            None
        );
    }

    pub async fn tasks_crud_and_not_found(store: &Store) {
        let a = store.create_task(&task("a")).await.unwrap();
        let b = store.create_task(&task("b")).await.unwrap();
        let c = store.create_task(&task("c")).await.unwrap();
        assert_eq!(store.get_task(a.id).await.unwrap(), a);

        let all = store.list_tasks(None, 10).await.unwrap();
        assert_eq!(all, vec![a.clone(), b.clone(), c.clone()]);
        let page = store.list_tasks(Some(a.id), 1).await.unwrap();
        assert_eq!(page, vec![b.clone()]);

        let dup = store.create_task(&a).await.unwrap_err();
        assert!(
            matches!(dup, Error::AlreadyExists { entity: "task", .. }),
            "{dup}"
        );

        let missing = TaskId::new();
        let err = store.get_task(missing).await.unwrap_err();
        match err {
            Error::NotFound { entity, id } => {
                assert_eq!(entity, "task");
                assert_eq!(id, missing.to_string());
            }
            other => panic!("expected NotFound, got {other}"),
        }

        let done = store
            .commit(Changeset::new().set_task_state(b.id, TaskState::InProgress))
            .await
            .unwrap();
        assert!(done.events.is_empty());
        let b2 = store.get_task(b.id).await.unwrap();
        assert_eq!(b2.state, TaskState::InProgress);
        assert!(b2.updated_at >= b.updated_at);
        let err = store
            .commit(Changeset::new().set_task_state(missing, TaskState::Review))
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    pub async fn profiles_upsert_by_name(store: &Store) {
        let first = store.upsert_agent_profile(&profile("demo")).await.unwrap();
        let mut again = profile("demo");
        again.command = "other-agent".into();
        again.supports_session_resume = false;
        again.args = vec![];
        again.config_defaults = BTreeMap::from([("model".into(), "large".into())]);
        again.mcp_servers = vec![
            sessiond_domain::McpServer {
                name: "files".into(),
                transport: sessiond_domain::McpTransport::Stdio {
                    command: "mcp-files".into(),
                    args: vec!["--ro".into()],
                    env: BTreeMap::from([
                        (
                            "MODE".into(),
                            sessiond_domain::SecretValue::Plain("ro".into()),
                        ),
                        (
                            "TOKEN".into(),
                            sessiond_domain::SecretValue::Env("FILES_TOKEN".into()),
                        ),
                    ]),
                },
            },
            sessiond_domain::McpServer {
                name: "docs".into(),
                transport: sessiond_domain::McpTransport::Http {
                    url: "https://mcp.example/docs".into(),
                    headers: BTreeMap::from([(
                        "Authorization".into(),
                        sessiond_domain::SecretValue::File("/run/secrets/docs".into()),
                    )]),
                },
            },
        ];
        let second = store.upsert_agent_profile(&again).await.unwrap();
        assert_eq!(second.id, first.id, "the existing id is kept");
        assert_eq!(second.created_at, first.created_at);
        assert_eq!(second.command, "other-agent");
        assert!(!second.supports_session_resume);
        assert!(second.args.is_empty());
        assert_eq!(second.config_defaults["model"], "large");
        assert_eq!(second.mcp_servers, again.mcp_servers);

        assert_eq!(store.get_agent_profile(first.id).await.unwrap(), second);
        assert_eq!(
            store.get_agent_profile_by_name("demo").await.unwrap(),
            second
        );
        let other = store
            .upsert_agent_profile(&profile("claude"))
            .await
            .unwrap();
        let names: Vec<String> = store
            .list_agent_profiles()
            .await
            .unwrap()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["claude", "demo"]);
        assert_eq!(other.env.get("RUST_LOG").map(String::as_str), Some("info"));

        // A container command (and image) is stored, and cleared again.
        let mut boxed = profile("claude");
        boxed.container = Some(sessiond_domain::ContainerAgent {
            image: Some("agents:1".into()),
            command: "/usr/bin/claude-code-acp".into(),
            args: vec!["--in-container".into()],
            env: BTreeMap::from([("STATE".to_owned(), "/run/state".to_owned())]),
        });
        let stored = store.upsert_agent_profile(&boxed).await.unwrap();
        assert_eq!(stored.container, boxed.container);
        assert_eq!(
            store.get_agent_profile(other.id).await.unwrap().container,
            boxed.container
        );
        let cleared = store
            .upsert_agent_profile(&profile("claude"))
            .await
            .unwrap();
        assert_eq!(cleared.container, None);

        assert!(
            store
                .get_agent_profile(AgentProfileId::new())
                .await
                .unwrap_err()
                .is_not_found()
        );
        assert!(
            store
                .get_agent_profile_by_name("nope")
                .await
                .unwrap_err()
                .is_not_found()
        );
    }

    pub async fn profiles_upsert_concurrently(store: &Store) {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { store.upsert_agent_profile(&profile("racy")).await })
            })
            .collect();
        let mut ids = BTreeSet::new();
        for h in handles {
            ids.insert(h.await.unwrap().unwrap().id);
        }
        assert_eq!(ids.len(), 1, "one profile per name: {ids:?}");
        assert_eq!(store.list_agent_profiles().await.unwrap().len(), 1);
    }

    pub async fn sessions_crud(store: &Store) {
        let t = store.create_task(&task("t")).await.unwrap();
        let p = store.upsert_agent_profile(&profile("demo")).await.unwrap();
        let mut new = session(&t, &p);
        new.version = 99; // ignored: a new session starts at version 1
        let (s, events) = store
            .create_session(
                &new,
                vec![state_changed(SessionState::Created, SessionState::Created)],
            )
            .await
            .unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(s.resume_token.as_deref(), Some("acp-session-1"));
        assert_eq!(
            s.metadata.get("note").map(String::as_str),
            Some("ünïcode \"quoted\"")
        );
        assert!(!s.metadata.contains_key("resume_token"));
        assert_eq!(events.len(), 1);
        assert_eq!((events[0].seq, events[0].task_seq), (1, 1));
        assert_eq!(store.get_session(s.id).await.unwrap(), s);
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), 1);

        let (s2, none) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        assert!(none.is_empty());
        assert_eq!(store.last_event_seq(s2.id).await.unwrap(), 0);
        let listed = store.list_sessions(t.id).await.unwrap();
        assert_eq!(
            listed.iter().map(|s| s.id).collect::<Vec<_>>(),
            vec![s.id, s2.id]
        );
        assert!(store.list_sessions(TaskId::new()).await.unwrap().is_empty());

        // Update: every field but id, task and created_at.
        let mut changed = s.clone();
        changed.state = SessionState::Running;
        changed.agent_execution_id = Some("exec/1".into());
        changed.runtime = Runtime::LocalDocker;
        changed.executor_id = Some(ExecutorId::new());
        changed.resume_token = None;
        changed.error_message = Some("transient".into());
        changed.metadata.insert("k".into(), "v".into());
        let done = store
            .commit(Changeset::new().update_session(changed.clone()).event(
                s.id,
                state_changed(SessionState::Created, SessionState::Running),
            ))
            .await
            .unwrap();
        let stored = done.session.unwrap();
        assert_eq!(stored.version, 2);
        assert_eq!(stored.state, SessionState::Running);
        assert_eq!(stored.resume_token, None);
        assert_eq!(stored.executor_id, changed.executor_id);
        assert_eq!(stored.created_at, s.created_at);
        assert_eq!(store.get_session(s.id).await.unwrap(), stored);
        assert_eq!(done.events[0].seq, 2);
        assert_eq!(done.events[0].task_seq, 2);

        // NotFound: unknown session, unknown task, unknown profile.
        assert!(
            store
                .get_session(SessionId::new())
                .await
                .unwrap_err()
                .is_not_found()
        );
        let orphan = session(&task("never stored"), &p);
        let err = store.create_session(&orphan, vec![]).await.unwrap_err();
        assert!(
            matches!(err, Error::NotFound { entity: "task", .. }),
            "{err}"
        );
        let no_profile = session(&t, &profile("never stored"));
        let err = store.create_session(&no_profile, vec![]).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotFound {
                    entity: "agent profile",
                    ..
                }
            ),
            "{err}"
        );
        let err = store.create_session(&s, vec![]).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::AlreadyExists {
                    entity: "session",
                    ..
                }
            ),
            "{err}"
        );
        let mut ghost = s.clone();
        ghost.id = SessionId::new();
        let err = store
            .commit(Changeset::new().update_session(ghost))
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
        let err = store.last_event_seq(SessionId::new()).await.unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    /// A runtime of a third party's own name is stored and read back (the
    /// `runtime` columns have no CHECK on the built-in names since the
    /// custom-runtimes migration), in sessions, executors and events.
    pub async fn custom_runtimes_round_trip(store: &Store) {
        let vm = Runtime::parse("vm").unwrap();
        let t = store.create_task(&task("custom")).await.unwrap();
        let p = store
            .upsert_agent_profile(&profile(&format!("demo-{}", TaskId::new())))
            .await
            .unwrap();
        let mut new = session(&t, &p);
        new.runtime = vm;
        let (s, _) = store.create_session(&new, vec![]).await.unwrap();
        assert_eq!(s.runtime, vm);
        assert_eq!(store.get_session(s.id).await.unwrap().runtime, vm);
        let mut rec = executor(&s, ExecutorStatus::Starting);
        rec.runtime = vm;
        store
            .commit(Changeset::new().insert_executor(rec.clone()).event(
                s.id,
                EventPayload::AgentctlStarting {
                    executor_id: rec.id,
                    runtime: vm,
                    generation: 1,
                },
            ))
            .await
            .unwrap();
        assert_eq!(store.get_executor(rec.id).await.unwrap().runtime, vm);
        let recoverable = store.load_recoverable_executors().await.unwrap();
        assert!(
            recoverable
                .iter()
                .any(|r| r.id == rec.id && r.runtime == vm)
        );
        let events = store.events_after(s.id, 0, 10).await.unwrap();
        assert!(
            events.iter().any(|e| matches!(e.payload,
                EventPayload::AgentctlStarting { runtime, .. } if runtime == vm)),
            "{events:?}"
        );
        let counts = store.count_executors_by_runtime_and_status().await.unwrap();
        assert!(
            counts.contains(&(vm, ExecutorStatus::Starting, 1)),
            "{counts:?}"
        );
    }

    /// `commit_batch` writes each changeset or reports it alone: one that
    /// fails (here a stale executor version) leaves nothing of itself and
    /// costs the others nothing, in any position of the batch.
    pub async fn a_batch_writes_each_changeset_or_reports_it_alone(store: &Store) {
        let mut executors = Vec::new();
        for _ in 0..3 {
            let (_, _, s) = seed(store).await;
            let rec = executor(&s, ExecutorStatus::Starting);
            let stored = committed_executor(store, Changeset::new().insert_executor(rec)).await;
            executors.push((s, stored));
        }
        let ready = |rec: &ExecutorRecord, generation: i64| {
            let mut next = rec.clone();
            next.status = ExecutorStatus::Ready;
            next.generation = generation;
            Changeset::new().update_executor(next).event(
                rec.session_id,
                state_changed(SessionState::Starting, SessionState::WaitingForInput),
            )
        };
        for stale_at in 0..3 {
            let generation = 10 + stale_at as i64;
            let mut batch = vec![Changeset::new()];
            for (i, (_, rec)) in executors.iter().enumerate() {
                let mut rec = rec.clone();
                if i == stale_at {
                    rec.version += 100;
                }
                batch.push(ready(&rec, generation));
            }
            let before: Vec<i64> = {
                let mut seqs = Vec::new();
                for (s, _) in &executors {
                    seqs.push(store.last_event_seq(s.id).await.unwrap());
                }
                seqs
            };
            let results = store.commit_batch(batch).await.unwrap();
            assert_eq!(results.len(), 4);
            assert!(results[0].as_ref().unwrap().events.is_empty());
            for (i, (s, rec)) in executors.iter_mut().enumerate() {
                let stored = store.get_executor(rec.id).await.unwrap();
                let seq = store.last_event_seq(s.id).await.unwrap();
                match &results[i + 1] {
                    Err(e) => {
                        assert_eq!(i, stale_at, "changeset {i} failed: {e}");
                        assert!(matches!(e, Error::Conflict { .. }), "{e}");
                        assert_eq!(&stored, rec, "the failed changeset wrote nothing");
                        assert_eq!(seq, before[i], "nor its event");
                    }
                    Ok(done) => {
                        assert_ne!(i, stale_at, "the stale changeset was written");
                        let written = done.executor.clone().unwrap();
                        assert_eq!(written.generation, generation);
                        assert_eq!(written, stored);
                        assert_eq!(done.events.len(), 1);
                        assert_eq!(done.events[0].seq, before[i] + 1);
                        assert_eq!(seq, before[i] + 1);
                        *rec = written;
                    }
                }
            }
        }
        // All of them current: every one written.
        let batch = executors.iter().map(|(_, rec)| ready(rec, 20)).collect();
        let results = store.commit_batch(batch).await.unwrap();
        for ((s, rec), result) in executors.iter().zip(results) {
            let done = result.unwrap();
            assert_eq!(done.executor.unwrap().generation, 20);
            assert_eq!(store.get_executor(rec.id).await.unwrap().generation, 20);
            assert_eq!(
                store.last_event_seq(s.id).await.unwrap(),
                done.events[0].seq,
                "its event is stored"
            );
        }
    }

    pub async fn executors_crud(store: &Store) {
        let (_, _, s) = seed(store).await;
        let rec = executor(&s, ExecutorStatus::Starting);
        let done = store
            .commit(Changeset::new().insert_executor(rec.clone()).event(
                s.id,
                EventPayload::AgentctlStarting {
                    executor_id: rec.id,
                    runtime: rec.runtime,
                    generation: rec.generation,
                },
            ))
            .await
            .unwrap();
        let stored = done.executor.unwrap();
        assert_eq!(stored.version, 1);
        assert_eq!(stored.pid_start_time, rec.pid_start_time);
        assert_eq!(stored.auth_secret, "s3cret");
        assert_eq!(stored.owner_id.as_deref(), Some("replica-a"));
        assert_eq!(
            stored.lease_expires_at.map(|t| t.timestamp_micros()),
            rec.lease_expires_at.map(|t| t.timestamp_micros())
        );
        assert_eq!(store.get_executor(rec.id).await.unwrap(), stored);
        assert_eq!(
            store.get_executor_for_session(s.id).await.unwrap(),
            Some(stored.clone())
        );
        assert_eq!(store.list_executors().await.unwrap(), vec![stored.clone()]);

        // One executor per session.
        let err = store
            .commit(Changeset::new().insert_executor(executor(&s, ExecutorStatus::Starting)))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::AlreadyExists {
                    entity: "executor",
                    ..
                }
            ),
            "{err}"
        );

        // Versioned update.
        let mut ready = stored.clone();
        ready.status = ExecutorStatus::Ready;
        ready.generation = 2;
        ready.pid = None;
        ready.pid_start_time = None;
        ready.container_id = Some("c0ffee".into());
        let updated =
            committed_executor(store, Changeset::new().update_executor(ready.clone())).await;
        assert_eq!(updated.version, 2);
        assert_eq!(updated.status, ExecutorStatus::Ready);
        assert_eq!(updated.pid, None);
        assert_eq!(updated.container_id.as_deref(), Some("c0ffee"));
        assert_eq!(updated.created_at, stored.created_at);

        // Stale: `ready` still says version 1.
        let err = store
            .commit(Changeset::new().update_executor(ready))
            .await
            .unwrap_err();
        match err {
            Error::Conflict {
                entity,
                expected_version,
                actual_version,
                ..
            } => {
                assert_eq!(entity, "executor");
                assert_eq!((expected_version, actual_version), (1, 2));
            }
            other => panic!("expected Conflict, got {other}"),
        }

        assert!(store.delete_executor(rec.id, None).await.unwrap());
        assert!(!store.delete_executor(rec.id, None).await.unwrap());
        assert!(store.get_executor(rec.id).await.unwrap_err().is_not_found());
        assert_eq!(store.get_executor_for_session(s.id).await.unwrap(), None);
        let err = store
            .commit(Changeset::new().update_executor(updated))
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    /// The recovery pass's grouped re-read answers each id as the single
    /// read does, in the order asked: a missing executor or a deleted
    /// session fails only its own answer. And an executor update leaves
    /// the lease columns as stored, whatever the writer's copy says.
    pub async fn grouped_rereads_match_single_reads(store: &Store) {
        let (t, p, first) = seed(store).await;
        let mut sessions = vec![first];
        for _ in 0..2 {
            let (s, _) = store
                .create_session(&session(&t, &p), vec![])
                .await
                .unwrap();
            sessions.push(s);
        }
        let mut ids = Vec::new();
        for s in &sessions {
            let rec = executor(s, ExecutorStatus::Ready);
            ids.push(rec.id);
            store
                .commit(Changeset::new().insert_executor(rec))
                .await
                .unwrap();
        }
        store.mark_session_deleted(sessions[2].id).await.unwrap();
        let missing = ExecutorId::new();
        let asked = vec![ids[1], missing, ids[0], ids[2]];
        let answers = store
            .get_executors_and_sessions(asked.clone())
            .await
            .unwrap();
        assert_eq!(answers.len(), asked.len());
        for (id, answer) in asked.iter().zip(&answers) {
            let single = store.get_executor_and_session(*id).await;
            match (answer, single) {
                (Ok(grouped), Ok(single)) => assert_eq!(grouped, &single),
                (Err(grouped), Err(single)) => {
                    assert!(grouped.is_not_found(), "{grouped}");
                    assert_eq!(grouped.to_string(), single.to_string());
                }
                (grouped, single) => panic!("{id}: grouped {grouped:?}, single {single:?}"),
            }
        }
        assert!(answers[0].is_ok() && answers[2].is_ok());
        assert!(
            answers[1]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("executor")
        );
        assert!(
            answers[3]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("session")
        );
        assert!(
            store
                .get_executors_and_sessions(Vec::new())
                .await
                .unwrap()
                .is_empty()
        );
    }

    pub async fn recoverable_executors_filter_by_status(store: &Store) {
        let t = store.create_task(&task("t")).await.unwrap();
        let p = store.upsert_agent_profile(&profile("demo")).await.unwrap();
        let mut wanted = Vec::new();
        for status in ExecutorStatus::ALL {
            let (s, _) = store
                .create_session(&session(&t, &p), vec![])
                .await
                .unwrap();
            let rec = committed_executor(
                store,
                Changeset::new().insert_executor(executor(&s, *status)),
            )
            .await;
            if ExecutorStatus::RECOVERABLE.contains(status) {
                wanted.push(rec.id);
            }
        }
        let got: Vec<ExecutorId> = store
            .load_recoverable_executors()
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(got, wanted);
        // Read page by page (startup recovery's load), the same list in the
        // same order, whatever the page size; none created after `until`.
        let until = Utc::now();
        for limit in [1, 2, 1_000] {
            let mut paged: Vec<ExecutorId> = Vec::new();
            let mut after = None;
            loop {
                let page = store
                    .load_recoverable_executors_page(until, after, limit)
                    .await
                    .unwrap();
                assert!(page.len() <= limit as usize);
                after = page.last().map(|e| (e.created_at, e.id));
                let last = page.len() < limit as usize;
                paged.extend(page.into_iter().map(|e| e.id));
                if last {
                    break;
                }
            }
            assert_eq!(paged, wanted, "pages of {limit}");
        }
        let before = until - Duration::hours(1);
        assert!(
            store
                .load_recoverable_executors_page(before, None, 10)
                .await
                .unwrap()
                .is_empty()
        );
        let failed = store
            .list_executors_with_status(vec![ExecutorStatus::Error])
            .await
            .unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].status, ExecutorStatus::Error);
        assert_eq!(
            store.list_executors().await.unwrap().len(),
            ExecutorStatus::ALL.len()
        );

        // The metrics gauges count by runtime, status and state in the database.
        let mut by_status = std::collections::BTreeMap::new();
        for (_, status, n) in store.count_executors_by_runtime_and_status().await.unwrap() {
            *by_status.entry(status).or_insert(0) += n;
        }
        let by_status: Vec<_> = by_status.into_iter().collect();
        let one_each: Vec<_> = ExecutorStatus::ALL.iter().map(|s| (*s, 1)).collect();
        assert_eq!(by_status, one_each);
        let by_state = store.count_sessions_by_state().await.unwrap();
        let total: i64 = by_state.iter().map(|(_, n)| n).sum();
        assert_eq!(total, ExecutorStatus::ALL.len() as i64);
        assert_eq!(
            by_state.len(),
            1,
            "every session was created in one state: {by_state:?}"
        );
        // A deleted session is no longer counted.
        store
            .mark_session_deleted(failed[0].session_id)
            .await
            .unwrap();
        let by_state = store.count_sessions_by_state().await.unwrap();
        let after: i64 = by_state.iter().map(|(_, n)| n).sum();
        assert_eq!(after, total - 1, "{by_state:?}");
    }

    /// Sessions in a state whose metadata holds a key: the key itself, not
    /// a value or another key that looks like it (`_` is no wildcard).
    pub async fn sessions_with_a_metadata_key(store: &Store) {
        let t = store.create_task(&task("keys")).await.unwrap();
        let p = store.upsert_agent_profile(&profile("keys")).await.unwrap();
        let mut want = Vec::new();
        for (state, meta) in [
            (SessionState::Error, vec![("turn_id", "m1")]),
            (SessionState::Error, vec![("turn_id", "m2"), ("x", "y")]),
            (SessionState::Error, vec![("turnXid", "m3")]),
            (SessionState::Error, vec![("other", "\"turn_id\":")]),
            (SessionState::Error, vec![]),
            (SessionState::Running, vec![("turn_id", "m4")]),
        ] {
            let mut s = session(&t, &p);
            s.state = state;
            s.metadata = meta
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let (s, _) = store.create_session(&s, vec![]).await.unwrap();
            if state == SessionState::Error && s.metadata.contains_key("turn_id") {
                want.push(s.id);
            }
        }
        let found: Vec<SessionId> = store
            .list_sessions_with_metadata_key(SessionState::Error, "turn_id".into())
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(found, want);
    }

    /// The sessions working in a directory or below it: exactly (not a
    /// sibling with the same prefix, not another case, `_` and `%` no
    /// wildcards), deleted ones left out.
    pub async fn sessions_in_a_directory(store: &Store) {
        let t = store.create_task(&task("dirs")).await.unwrap();
        let p = store.upsert_agent_profile(&profile("dirs")).await.unwrap();
        let mut ids = std::collections::HashMap::new();
        for path in [
            "/w/a_b",
            "/w/a_b/sub",
            "/w/a_bc",
            "/w/axb",
            "/w/A_B",
            "/w/a_b/gone",
        ] {
            let mut s = session(&t, &p);
            s.worktree.path = path.into();
            let (s, _) = store.create_session(&s, vec![]).await.unwrap();
            ids.insert(path, s.id);
        }
        store
            .mark_session_deleted(ids["/w/a_b/gone"])
            .await
            .unwrap();
        let found: Vec<SessionId> = store
            .list_sessions_in_directory("/w/a_b".into())
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(found, vec![ids["/w/a_b"], ids["/w/a_b/sub"]]);
    }

    pub async fn changeset_is_all_or_nothing(store: &Store) {
        let (t, _, s) = seed(store).await;
        let m = message(&s, MessageRole::User, "hello");
        let mut running = s.clone();
        running.state = SessionState::Running;

        // The last part fails (the message to update does not exist).
        let err = store
            .commit(
                Changeset::new()
                    .update_session(running.clone())
                    .insert_executor(executor(&s, ExecutorStatus::Starting))
                    .set_task_state(t.id, TaskState::InProgress)
                    .add_message(m.clone())
                    .event(
                        s.id,
                        state_changed(SessionState::Created, SessionState::Running),
                    )
                    .update_message(MessageId::new(), "x", true),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::NotFound {
                    entity: "message",
                    ..
                }
            ),
            "{err}"
        );
        assert_nothing_written(store, &t, &s).await;

        // A constraint fails after everything else was written.
        let first = committed_executor(
            store,
            Changeset::new().insert_executor(executor(&s, ExecutorStatus::Starting)),
        )
        .await;
        let err = store
            .commit(
                Changeset::new()
                    .update_session(running)
                    .set_task_state(t.id, TaskState::InProgress)
                    .add_message(m)
                    .event(
                        s.id,
                        state_changed(SessionState::Created, SessionState::Running),
                    )
                    .insert_executor(executor(&s, ExecutorStatus::Starting)),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
        assert_nothing_written(store, &t, &s).await;
        assert_eq!(
            store.get_executor_for_session(s.id).await.unwrap(),
            Some(first)
        );

        // The numbers a failed commit would have used are handed out again.
        let ok = store
            .commit(Changeset::new().event(
                s.id,
                state_changed(SessionState::Created, SessionState::Starting),
            ))
            .await
            .unwrap();
        assert_eq!((ok.events[0].seq, ok.events[0].task_seq), (1, 1));
    }

    /// A message added again under its id (with its event: on PostgreSQL
    /// one statement inserts both) is ALREADY_EXISTS for the message, and
    /// the commit writes nothing: no event, no counter advanced.
    pub async fn a_message_added_twice_is_refused_whole(store: &Store) {
        let (t, _, s) = seed(store).await;
        let m = message(&s, MessageRole::User, "once");
        let add = |m: &Message| {
            Changeset::new()
                .add_message(m.clone())
                .event(s.id, EventPayload::MessageAdded(m.clone()))
        };
        store.commit(add(&m)).await.unwrap();
        let events = store.last_event_seq(s.id).await.unwrap();
        let task_events = store.last_task_event_seq(t.id).await.unwrap();
        let err = store.commit(add(&m)).await.unwrap_err();
        assert!(
            matches!(err, Error::AlreadyExists { entity: "message", ref id } if *id == m.id.to_string()),
            "{err}"
        );
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), events);
        assert_eq!(store.last_task_event_seq(t.id).await.unwrap(), task_events);
        assert_eq!(store.list_messages(s.id, 0, 100).await.unwrap().len(), 1);
        // The numbers the refused commit would have used go to the next one.
        let next = message(&s, MessageRole::User, "twice");
        let c = store.commit(add(&next)).await.unwrap();
        assert_eq!(c.events[0].seq, events + 1);
        assert_eq!(c.messages[0].seq, 2);
    }

    async fn assert_nothing_written(store: &Store, t: &Task, s: &Session) {
        assert_eq!(store.get_session(s.id).await.unwrap(), *s);
        assert_eq!(store.get_task(t.id).await.unwrap(), *t);
        assert!(store.events_after(s.id, 0, 100).await.unwrap().is_empty());
        assert!(store.list_messages(s.id, 0, 100).await.unwrap().is_empty());
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), 0);
        assert_eq!(store.last_task_event_seq(t.id).await.unwrap(), 0);
    }

    pub async fn two_writers_same_version_one_wins(store: &Store) {
        let (_, _, s) = seed(store).await;
        let write = |to: SessionState| {
            let store = store.clone();
            let mut next = s.clone();
            next.state = to;
            tokio::spawn(async move {
                store
                    .commit(
                        Changeset::new()
                            .update_session(next)
                            .event(s.id, state_changed(SessionState::Created, to)),
                    )
                    .await
            })
        };
        let (a, b) = tokio::join!(write(SessionState::Running), write(SessionState::Cancelled));
        let results = [a.unwrap(), b.unwrap()];
        let wins = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "exactly one writer wins: {results:?}");
        let loser = results.iter().find_map(|r| r.as_ref().err()).unwrap();
        match loser {
            Error::Conflict {
                entity,
                id,
                expected_version,
                actual_version,
            } => {
                assert_eq!(*entity, "session");
                assert_eq!(*id, s.id.to_string());
                assert_eq!((*expected_version, *actual_version), (1, 2));
            }
            other => panic!("expected Conflict, got {other}"),
        }
        let winner = results.iter().find_map(|r| r.as_ref().ok()).unwrap();
        let stored = store.get_session(s.id).await.unwrap();
        assert_eq!(Some(&stored), winner.session.as_ref());
        assert_eq!(stored.version, 2);
        // Only the winner's event exists.
        assert_eq!(store.events_after(s.id, 0, 10).await.unwrap().len(), 1);
    }

    pub async fn concurrent_appenders_get_gap_free_seqs(store: &Store) {
        const WRITERS: usize = 8;
        const COMMITS: usize = 12;
        let (t, p, s) = seed(store).await;
        // A second session of the same task shares the task_seq counter.
        let (other, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();

        let mut handles = Vec::new();
        for w in 0..WRITERS {
            let store = store.clone();
            handles.push(tokio::spawn(async move {
                let mut seqs = Vec::new();
                for i in 0..COMMITS {
                    let mut change = Changeset::new().event(
                        s.id,
                        state_changed(SessionState::Running, SessionState::WaitingForInput),
                    );
                    if i % 2 == 0 {
                        change = change.event(
                            s.id,
                            state_changed(SessionState::WaitingForInput, SessionState::Running),
                        );
                    }
                    if w % 2 == 0 {
                        change = change.event(
                            other.id,
                            state_changed(SessionState::Created, SessionState::Starting),
                        );
                    }
                    let done = store.commit(change).await.unwrap();
                    seqs.extend(
                        done.events
                            .into_iter()
                            .map(|e| (e.session_id, e.seq, e.task_seq)),
                    );
                }
                seqs
            }));
        }
        let mut returned = Vec::new();
        for h in handles {
            returned.extend(h.await.unwrap());
        }

        let per_writer_s = COMMITS + COMMITS.div_ceil(2);
        let n_s = WRITERS * per_writer_s;
        let n_other = WRITERS.div_ceil(2) * COMMITS;
        let stored_s = store.events_after(s.id, 0, 10_000).await.unwrap();
        let stored_other = store.events_after(other.id, 0, 10_000).await.unwrap();
        assert_gap_free(stored_s.iter().map(|e| e.seq), n_s, "session seq");
        assert_gap_free(
            stored_other.iter().map(|e| e.seq),
            n_other,
            "other session seq",
        );
        let by_task = store.task_events_after(t.id, 0, 10_000).await.unwrap();
        assert_gap_free(
            by_task.iter().map(|e| e.task_seq),
            n_s + n_other,
            "task_seq",
        );
        assert!(by_task.windows(2).all(|w| w[0].task_seq < w[1].task_seq));

        // What commit returned is what was stored.
        let mut stored: Vec<_> = by_task
            .iter()
            .map(|e| (e.session_id, e.seq, e.task_seq))
            .collect();
        stored.sort();
        returned.sort();
        assert_eq!(returned, stored);
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), n_s as i64);
        assert_eq!(
            store.last_task_event_seq(t.id).await.unwrap(),
            (n_s + n_other) as i64
        );
    }

    /// A reply's first chunk (one message and its `MessageAdded`, written
    /// in one statement on PostgreSQL) from many writers at once, beside
    /// turn starts on the same rows: every seq gap-free, and what each
    /// commit returned (the message's seq in its event's payload too) is
    /// what was stored.
    pub async fn lone_messages_from_many_writers_are_numbered_like_any_commit(store: &Store) {
        const WRITERS: usize = 6;
        const COMMITS: usize = 10;
        let (t, p, s) = seed(store).await;
        let (other, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        let mut handles = Vec::new();
        for w in 0..WRITERS {
            let store = store.clone();
            let on = if w % 2 == 0 { s.clone() } else { other.clone() };
            handles.push(tokio::spawn(async move {
                let mut returned = Vec::new();
                for i in 0..COMMITS {
                    let chunk = message(&on, MessageRole::Agent, &format!("\"seq\":1 {w}/{i}"));
                    let mut change = Changeset::new()
                        .add_message(chunk.clone())
                        .event(on.id, EventPayload::MessageAdded(chunk));
                    if i % 3 == 0 {
                        // A turn start's shape: the task's row too, and two events.
                        change = change
                            .event(
                                on.id,
                                state_changed(SessionState::WaitingForInput, SessionState::Running),
                            )
                            .task_event(on.task_id, TaskEvent::WorkStarted);
                    }
                    let done = store.commit(change).await.unwrap();
                    returned.extend(done.events);
                    assert_eq!(done.messages.len(), 1);
                }
                returned
            }));
        }
        let mut returned = Vec::new();
        for h in handles {
            returned.extend(h.await.unwrap());
        }
        let per_writer = COMMITS + COMMITS.div_ceil(3);
        let mut stored = Vec::new();
        for sid in [s.id, other.id] {
            let events = store.events_after(sid, 0, 10_000).await.unwrap();
            assert_gap_free(
                events.iter().map(|e| e.seq),
                WRITERS / 2 * per_writer,
                "seq",
            );
            let messages = store.list_messages(sid, 0, 10_000).await.unwrap();
            assert_gap_free(
                messages.iter().map(|m| m.seq),
                WRITERS / 2 * COMMITS,
                "message seq",
            );
            for e in &events {
                if let EventPayload::MessageAdded(m) = &e.payload {
                    let kept = messages.iter().find(|k| k.id == m.id).unwrap();
                    assert_eq!(m, kept, "the event's message is the stored one");
                }
            }
            stored.extend(events);
        }
        assert_gap_free(
            stored.iter().map(|e| e.task_seq),
            WRITERS * per_writer,
            "task_seq",
        );
        let key = |e: &sessiond_domain::Event| (e.session_id, e.seq);
        stored.sort_by_key(key);
        returned.sort_by_key(key);
        assert_eq!(returned, stored);
    }

    /// An activity part keeps its kind and state through a commit, an
    /// update, a read and the event log.
    pub async fn activity_parts_round_trip(store: &Store) {
        let (_, _, s) = seed(store).await;
        let mut part = message(&s, MessageRole::Agent, "Read file");
        part.kind = MessageKind::ToolCall;
        part.data = r#"{"rev":1,"update":{"toolCallId":"t1","status":"pending"}}"#.into();
        let done = store
            .commit(
                Changeset::new()
                    .add_message(part.clone())
                    .event(s.id, EventPayload::MessageAdded(part.clone())),
            )
            .await
            .unwrap();
        assert_eq!(done.messages[0].kind, MessageKind::ToolCall);
        assert_eq!(done.messages[0].data, part.data);
        let data2 = r#"{"rev":2,"update":{"toolCallId":"t1","status":"completed"}}"#;
        let done2 = store
            .commit(
                Changeset::new()
                    .update_part(part.id, "Read file (done)", data2, true)
                    .event(s.id, EventPayload::MessageUpdated(part.clone())),
            )
            .await
            .unwrap();
        let updated = &done2.messages[0];
        assert_eq!(
            (
                updated.kind,
                updated.data.as_str(),
                updated.content.as_str()
            ),
            (MessageKind::ToolCall, data2, "Read file (done)")
        );
        // A plain text update keeps the part's data.
        store
            .commit(Changeset::new().update_message(part.id, "Read file (done)", true))
            .await
            .unwrap();
        let all = store.list_messages(s.id, 0, 10).await.unwrap();
        assert_eq!(all[0].data, data2);
        let events = store.events_after(s.id, 0, 10).await.unwrap();
        assert_eq!(
            events
                .iter()
                .map(|e| match &e.payload {
                    EventPayload::MessageAdded(m) | EventPayload::MessageUpdated(m) =>
                        (m.kind, m.data.clone()),
                    other => panic!("unexpected payload {other:?}"),
                })
                .collect::<Vec<_>>(),
            [
                (MessageKind::ToolCall, part.data.clone()),
                (MessageKind::ToolCall, data2.to_owned())
            ]
        );
    }

    pub async fn messages_append_and_update(store: &Store) {
        let (_, _, s) = seed(store).await;
        let user = message(&s, MessageRole::User, "do it");
        let agent = message(&s, MessageRole::Agent, "on it");
        let done = store
            .commit(
                Changeset::new()
                    .add_message(user.clone())
                    .event(s.id, EventPayload::MessageAdded(user.clone()))
                    .add_message(agent.clone())
                    .event(s.id, EventPayload::MessageAdded(agent.clone())),
            )
            .await
            .unwrap();
        assert_eq!(
            done.messages.iter().map(|m| m.seq).collect::<Vec<_>>(),
            [1, 2]
        );
        // The event carries the message as stored, seq included.
        match &done.events[1].payload {
            EventPayload::MessageAdded(m) => assert_eq!(m, &done.messages[1]),
            other => panic!("unexpected payload {other:?}"),
        }

        let done2 = store
            .commit(
                Changeset::new()
                    .update_message(agent.id, "on it: done", true)
                    .event(s.id, EventPayload::MessageUpdated(agent.clone())),
            )
            .await
            .unwrap();
        let updated = &done2.messages[0];
        assert_eq!((updated.seq, updated.complete), (2, true));
        assert_eq!(updated.content, "on it: done");
        assert_eq!(updated.created_at, done.messages[1].created_at);
        let events = store.events_after(s.id, 2, 10).await.unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind(), EventKind::MessageUpdated);
        assert_eq!(
            events[0].payload,
            EventPayload::MessageUpdated(updated.clone())
        );

        let third = store
            .commit(Changeset::new().add_message(message(&s, MessageRole::System, "note")))
            .await
            .unwrap();
        assert_eq!(third.messages[0].seq, 3);

        let all = store.list_messages(s.id, 0, 10).await.unwrap();
        assert_eq!(all.iter().map(|m| m.seq).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(all[1], *updated);
        let page = store.list_messages(s.id, 1, 1).await.unwrap();
        assert_eq!(page.iter().map(|m| m.seq).collect::<Vec<_>>(), [2]);

        let err = store
            .commit(Changeset::new().update_message(MessageId::new(), "x", true))
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
        let mut foreign = message(&s, MessageRole::User, "x");
        foreign.task_id = TaskId::new();
        let err = store
            .commit(Changeset::new().add_message(foreign))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{err}");
    }

    pub async fn events_after_and_task_events_after(store: &Store) {
        let (t, p, a) = seed(store).await;
        let (b, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        let eid = ExecutorId::new();
        let payloads = [
            (
                a.id,
                state_changed(SessionState::Created, SessionState::Starting),
            ),
            (
                b.id,
                state_changed(SessionState::Created, SessionState::Starting),
            ),
            (
                a.id,
                EventPayload::AgentctlStarting {
                    executor_id: eid,
                    runtime: Runtime::Remote,
                    generation: 3,
                },
            ),
            (
                a.id,
                EventPayload::AgentctlReady {
                    executor_id: eid,
                    runtime: Runtime::Remote,
                    supports_session_resume: Some(false),
                },
            ),
            (
                b.id,
                EventPayload::AgentctlError {
                    executor_id: eid,
                    error_message: "host unreachable".into(),
                },
            ),
        ];
        for (sid, payload) in payloads.clone() {
            store
                .commit(Changeset::new().event(sid, payload))
                .await
                .unwrap();
        }

        let a_events = store.events_after(a.id, 0, 100).await.unwrap();
        assert_eq!(
            a_events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(
            a_events.iter().map(|e| e.task_seq).collect::<Vec<_>>(),
            [1, 3, 4]
        );
        assert!(
            a_events
                .iter()
                .all(|e| e.task_id == t.id && e.session_id == a.id)
        );
        assert_eq!(a_events[1].payload, payloads[2].1);
        assert_eq!(a_events[2].kind(), EventKind::AgentctlReady);
        let after = store.events_after(a.id, 1, 1).await.unwrap();
        assert_eq!(after.iter().map(|e| e.seq).collect::<Vec<_>>(), [2]);
        assert!(store.events_after(a.id, 3, 100).await.unwrap().is_empty());

        // Replay pages: bounded by count and by payload size (at least one
        // event), saying whether more may follow.
        let seqs = |page: &(Vec<sessiond_domain::Event>, bool)| {
            (page.0.iter().map(|e| e.seq).collect::<Vec<_>>(), page.1)
        };
        let page = store
            .events_page_after(a.id, 0, 100, 1 << 20)
            .await
            .unwrap();
        assert_eq!(seqs(&page), (vec![1, 2, 3], false));
        let page = store.events_page_after(a.id, 0, 2, 1 << 20).await.unwrap();
        assert_eq!(seqs(&page), (vec![1, 2], true));
        let page = store.events_page_after(a.id, 0, 100, 1).await.unwrap();
        assert_eq!(
            seqs(&page),
            (vec![1], true),
            "one event over the bound still comes"
        );
        let page = store.events_page_after(a.id, 2, 100, 1).await.unwrap();
        assert_eq!(seqs(&page), (vec![3], false));
        let page = store.task_events_page_after(t.id, 0, 100, 1).await.unwrap();
        assert_eq!(
            (
                page.0.iter().map(|e| e.task_seq).collect::<Vec<_>>(),
                page.1
            ),
            (vec![1], true)
        );

        let all = store.task_events_after(t.id, 0, 100).await.unwrap();
        let got: Vec<_> = all
            .iter()
            .map(|e| (e.session_id, e.payload.clone()))
            .collect();
        assert_eq!(got, payloads.to_vec());
        let tail = store.task_events_after(t.id, 3, 100).await.unwrap();
        assert_eq!(tail.iter().map(|e| e.task_seq).collect::<Vec<_>>(), [4, 5]);
        assert!(
            store
                .task_events_after(TaskId::new(), 0, 100)
                .await
                .unwrap()
                .is_empty()
        );

        let err = store
            .commit(Changeset::new().event(SessionId::new(), payloads[0].1.clone()))
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    /// `Changeset::task_event` applies the task machine to the stored state
    /// inside the transaction: a legal event moves it, one that does not
    /// apply changes nothing and is no error, a missing task is NOT_FOUND
    /// and writes nothing of the changeset.
    pub async fn task_event_applies_the_machine_in_the_transaction(store: &Store) {
        let (t, _, s) = seed(store).await;
        let state = |store: &Store| {
            let store = store.clone();
            async move { store.get_task(t.id).await.unwrap().state }
        };
        // TODO has had no work to review: no change, and the event is stored.
        let c = store
            .commit(
                Changeset::new()
                    .event(
                        s.id,
                        state_changed(SessionState::Created, SessionState::Starting),
                    )
                    .task_event(t.id, TaskEvent::ReadyForReview),
            )
            .await
            .unwrap();
        assert_eq!(c.events.len(), 1);
        assert_eq!(state(store).await, TaskState::Todo);
        store
            .commit(Changeset::new().task_event(t.id, TaskEvent::WorkStarted))
            .await
            .unwrap();
        assert_eq!(state(store).await, TaskState::InProgress);
        store
            .commit(Changeset::new().task_event(t.id, TaskEvent::ReadyForReview))
            .await
            .unwrap();
        assert_eq!(state(store).await, TaskState::Review);

        // With events to number, the event rides on the counter's update
        // (the stored state is not read first): the same machine.
        let with_events = |event| {
            Changeset::new()
                .event(
                    s.id,
                    state_changed(SessionState::Starting, SessionState::WaitingForInput),
                )
                .task_event(t.id, event)
        };
        store
            .commit(with_events(TaskEvent::WorkStarted))
            .await
            .unwrap();
        assert_eq!(state(store).await, TaskState::InProgress);
        let moved_at = store.get_task(t.id).await.unwrap().updated_at;
        let c = store
            .commit(with_events(TaskEvent::WorkStarted))
            .await
            .unwrap();
        assert_eq!(c.events.len(), 1);
        let unmoved = store.get_task(t.id).await.unwrap();
        assert_eq!(unmoved.state, TaskState::InProgress);
        assert_eq!(
            unmoved.updated_at, moved_at,
            "a task left as it is keeps its time"
        );
        store
            .commit(with_events(TaskEvent::Completed))
            .await
            .unwrap();
        assert_eq!(state(store).await, TaskState::Completed);
        store
            .commit(with_events(TaskEvent::WorkStarted))
            .await
            .unwrap();
        assert_eq!(
            state(store).await,
            TaskState::Completed,
            "an ended task stays ended"
        );

        let before = store.last_event_seq(s.id).await.unwrap();
        let err = store
            .commit(
                Changeset::new()
                    .event(
                        s.id,
                        state_changed(SessionState::Starting, SessionState::WaitingForInput),
                    )
                    .task_event(TaskId::new(), TaskEvent::WorkStarted),
            )
            .await
            .unwrap_err();
        assert!(err.is_not_found(), "{err}");
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), before);

        // The only task named is missing (on PostgreSQL its update goes in
        // with the session's): NOT_FOUND for the task, the session unwritten.
        let stored = store.get_session(s.id).await.unwrap();
        let mut next = stored.clone();
        next.title = "never written".into();
        let err = store
            .commit(
                Changeset::new()
                    .update_session(next)
                    .set_task_state(TaskId::new(), TaskState::InProgress),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::NotFound { entity: "task", .. }),
            "{err}"
        );
        assert_eq!(store.get_session(s.id).await.unwrap(), stored);
    }

    /// The batched reads recovery and the status snapshot use agree with the
    /// one-row reads, and list only sessions with a live executor record (not
    /// one without a record, not an ended one whose record is `stopped`).
    pub async fn managed_reads_match_single_reads(store: &Store) {
        let (t, p, s) = seed(store).await;
        let (other, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        let (ended, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        store
            .commit(Changeset::new().insert_executor(executor(&ended, ExecutorStatus::Stopped)))
            .await
            .unwrap();
        let rec = committed_executor(
            store,
            Changeset::new().insert_executor(executor(&s, ExecutorStatus::Ready)),
        )
        .await;
        let (r, got) = store.get_executor_and_session(rec.id).await.unwrap();
        assert_eq!(r, rec);
        let rec = r;
        assert_eq!(got, store.get_session(s.id).await.unwrap());
        assert!(
            store
                .get_executor_and_session(ExecutorId::new())
                .await
                .unwrap_err()
                .is_not_found()
        );

        // The liveness heartbeat: only at the recorded generation, while
        // `ready`; no version bump.
        let at = Utc::now() + Duration::seconds(5);
        let beat = |generation| Heartbeat {
            executor: rec.id,
            generation,
            fence: None,
        };
        let touched = store
            .touch_executors(vec![beat(rec.generation + 1)], at)
            .await
            .unwrap();
        assert_eq!((touched.touched, touched.lost.len()), (0, 0));
        let touched = store
            .touch_executors(vec![beat(rec.generation)], at)
            .await
            .unwrap();
        assert_eq!((touched.touched, touched.lost.len()), (1, 0));
        let touched = store.get_executor(rec.id).await.unwrap();
        assert_eq!(
            touched.last_seen_at.map(|t| t.timestamp_micros()),
            Some(at.timestamp_micros())
        );
        assert_eq!(touched.version, rec.version);

        let all = store.managed_session_status_inputs().await.unwrap();
        assert_eq!(
            all.len(),
            1,
            "only the session with a live executor: {all:?}"
        );
        let one = store.session_status_inputs(s.id).await.unwrap();
        assert_eq!(all[0], one);
        assert!(all[0].0.id != other.id && all[0].0.id != ended.id);
    }

    /// Leases: a claim takes a free, own or expired lease (epoch + 1,
    /// version + 1) and never a live one of another replica; renewal keeps
    /// what is still owned; a changeset never writes the lease back; a
    /// release lets another replica adopt at once; the listing counts
    /// unexpired leases per replica.
    pub async fn leases_claim_renew_release_and_adopt(store: &Store) {
        use sessiond_store::ReplicaInfo;
        let ttl = std::time::Duration::from_secs(30);
        let now = Utc::now();
        for id in ["replica-a", "replica-b"] {
            store
                .register_replica(ReplicaInfo {
                    id: id.into(),
                    address: format!("{id}:50051"),
                    hostname: "h".into(),
                    pid: 1,
                    started_at: now,
                    heartbeat_at: now,
                    lease_ttl: ttl,
                    owned_executors: 0,
                })
                .await
                .unwrap();
        }
        let (_, _, s) = seed(store).await;
        let mut rec = executor(&s, ExecutorStatus::Ready);
        rec.owner_id = None;
        rec.lease_expires_at = None;
        store
            .commit(Changeset::new().insert_executor(rec.clone()))
            .await
            .unwrap();

        // A free executor: A gets it, B does not.
        let got = store
            .claim_executors("replica-a", vec![rec.id], now, ttl, false)
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].epoch, 1);
        assert_eq!(got[0].record.version, 2, "a claim fences older copies");
        assert_eq!(got[0].record.owner_id.as_deref(), Some("replica-a"));
        let none = store
            .claim_executors("replica-b", vec![rec.id], now, ttl, false)
            .await
            .unwrap();
        assert!(
            none.is_empty(),
            "a live lease of another replica is not taken"
        );
        assert!(
            store
                .claim_expired("replica-b", now, ttl, 10)
                .await
                .unwrap()
                .is_empty()
        );

        // A writer holding the pre-claim copy is refused; a current one
        // cannot put an old lease back.
        let err = store
            .commit(Changeset::new().update_executor(rec.clone()))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Conflict { .. }), "{err}");
        // The lease columns are not in an executor update's `SET`: the
        // row as written, returned to the writer, keeps the stored lease.
        let mut current = got[0].record.clone();
        let lease = (
            current.owner_id.clone(),
            current.lease_expires_at.map(|t| t.timestamp_micros()),
            current.lease_epoch,
        );
        current.owner_id = None;
        current.lease_expires_at = None;
        current.lease_epoch += 7;
        current.error_message = Some("x".into());
        let written = committed_executor(store, Changeset::new().update_executor(current)).await;
        assert_eq!(written, store.get_executor(written.id).await.unwrap());
        assert_eq!(written.error_message.as_deref(), Some("x"));
        assert_eq!(written.owner_id.as_deref(), Some("replica-a"));
        assert_eq!(
            (
                written.owner_id.clone(),
                written.lease_expires_at.map(|t| t.timestamp_micros()),
                written.lease_epoch
            ),
            lease
        );

        // Renewal keeps it A's; the listing counts it for A.
        let owned = store
            .heartbeat_replica("replica-a", now, ttl)
            .await
            .unwrap();
        assert_eq!(owned, vec![s.id]);
        let listed = store.list_replicas(now).await.unwrap();
        let loads: Vec<(String, i64)> = listed
            .iter()
            .map(|r| (r.id.clone(), r.owned_executors))
            .collect();
        assert_eq!(
            loads,
            [("replica-a".to_owned(), 1), ("replica-b".to_owned(), 0)]
        );
        assert!(listed[0].is_live(now));
        assert!(!listed[0].is_live(now + Duration::seconds(31)));

        // Expired: B adopts it (epoch 2), and A's next heartbeat no longer
        // lists it.
        let later = now + Duration::seconds(31);
        let adopted = store
            .claim_expired("replica-b", later, ttl, 10)
            .await
            .unwrap();
        assert_eq!(adopted.len(), 1);
        assert_eq!(adopted[0].epoch, 2);
        assert_eq!(adopted[0].record.owner_id.as_deref(), Some("replica-b"));
        assert!(
            store
                .heartbeat_replica("replica-a", later, ttl)
                .await
                .unwrap()
                .is_empty()
        );

        // Released: A may take it back at once, without waiting for a TTL.
        assert_eq!(store.release_leases("replica-b", later).await.unwrap(), 1);
        let back = store
            .claim_expired("replica-a", later + Duration::milliseconds(1), ttl, 10)
            .await
            .unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].epoch, 3);
        assert!(matches!(
            store.heartbeat_replica("nobody", now, ttl).await,
            Err(Error::NotFound { .. })
        ));
    }

    /// Fencing: a changeset fenced with the lease the writer holds commits
    /// while the row still names that owner and epoch; after another
    /// replica's claim (epoch + 1) the same write fails with `LeaseLost`
    /// (both epochs named) and writes nothing: no message, no event, no
    /// session change. A create (fence + executor insert) passes.
    pub async fn fenced_writes_fail_after_the_lease_moved(store: &Store) {
        use sessiond_store::Fence;
        let ttl = std::time::Duration::from_secs(30);
        let now = Utc::now();
        let (t, _, s) = seed(store).await;
        let mut rec = executor(&s, ExecutorStatus::Ready);
        rec.owner_id = Some("replica-a".into());
        let fence = |owner: &str, epoch: i64| Fence {
            session: s.id,
            owner: owner.into(),
            epoch,
        };
        // The create: no executor row yet, the changeset inserts it.
        store
            .commit(
                Changeset::new()
                    .insert_executor(rec.clone())
                    .event(
                        s.id,
                        state_changed(SessionState::Created, SessionState::Starting),
                    )
                    .fenced(fence("replica-a", 0)),
            )
            .await
            .unwrap();
        // A's writes at epoch 0 go through.
        let m = message(&s, MessageRole::User, "one");
        store
            .commit(
                Changeset::new()
                    .add_message(m.clone())
                    .event(s.id, EventPayload::MessageAdded(m))
                    .fenced(fence("replica-a", 0)),
            )
            .await
            .unwrap();
        let before_events = store.last_event_seq(s.id).await.unwrap();
        let before_task = store.last_task_event_seq(t.id).await.unwrap();
        let session = store.get_session(s.id).await.unwrap();

        // B adopts (expired lease): epoch 1.
        let later = now + Duration::seconds(31);
        let adopted = store
            .claim_expired("replica-b", later, ttl, 10)
            .await
            .unwrap();
        assert_eq!(adopted.len(), 1);
        assert_eq!(adopted[0].epoch, 1);
        assert_eq!(adopted[0].record.lease_epoch, 1);

        // A, paused past its lease, tries to write as before: refused, all of it.
        let m2 = message(&s, MessageRole::User, "two");
        let mut next = session.clone();
        next.state = SessionState::Running;
        let err = store
            .commit(
                Changeset::new()
                    .update_session(next.clone())
                    .add_message(m2.clone())
                    .event(s.id, EventPayload::MessageAdded(m2.clone()))
                    .fenced(fence("replica-a", 0)),
            )
            .await
            .unwrap_err();
        match &err {
            Error::LeaseLost {
                owner,
                epoch,
                current_owner,
                current_epoch,
                ..
            } => {
                assert_eq!(
                    (
                        owner.as_str(),
                        *epoch,
                        current_owner.as_str(),
                        *current_epoch
                    ),
                    ("replica-a", 0, "replica-b", 1)
                );
                let text = err.to_string();
                assert!(
                    text.contains("epoch 0") && text.contains("epoch 1"),
                    "{text}"
                );
            }
            other => panic!("expected LeaseLost, got {other}"),
        }
        assert!(err.is_lease_lost());
        // A reply's first chunk alone (one statement on PostgreSQL) is
        // refused the same way, nothing of it kept.
        let chunk = message(&s, MessageRole::Agent, "a's reply");
        let err = store
            .commit(
                Changeset::new()
                    .add_message(chunk.clone())
                    .event(s.id, EventPayload::MessageAdded(chunk))
                    .fenced(fence("replica-a", 0)),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::LeaseLost { current_owner, current_epoch: 1, .. } if current_owner == "replica-b"),
            "{err}"
        );
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), before_events);
        assert_eq!(store.last_task_event_seq(t.id).await.unwrap(), before_task);
        let msgs = store.list_messages(s.id, 0, 10).await.unwrap();
        assert_eq!(msgs.len(), 1, "{msgs:?}");
        assert_eq!(store.get_session(s.id).await.unwrap(), session);
        // The right owner at the wrong epoch is refused too (A's own older
        // claim); B at its epoch writes.
        assert!(
            store
                .commit(
                    Changeset::new()
                        .event(
                            s.id,
                            state_changed(SessionState::Starting, SessionState::Running)
                        )
                        .fenced(fence("replica-b", 0)),
                )
                .await
                .unwrap_err()
                .is_lease_lost()
        );
        store
            .commit(
                Changeset::new()
                    .update_session(next)
                    .add_message(m2.clone())
                    .event(s.id, EventPayload::MessageAdded(m2))
                    .fenced(fence("replica-b", 1)),
            )
            .await
            .unwrap();
        assert_eq!(store.last_event_seq(s.id).await.unwrap(), before_events + 1);
        // A changeset update keeps the stored epoch (never writes it back).
        let mut copy = store.get_executor(rec.id).await.unwrap();
        assert_eq!(copy.lease_epoch, 1);
        copy.lease_epoch = 0;
        copy.error_message = Some("x".into());
        let written = store
            .commit(
                Changeset::new()
                    .update_executor(copy)
                    .fenced(fence("replica-b", 1)),
            )
            .await
            .unwrap()
            .executor
            .unwrap();
        assert_eq!(written.lease_epoch, 1);

        // The liveness heartbeat is fenced too: A's (epoch 0) touches
        // nothing and comes back lost, naming B; B's is written; one of B
        // at an older generation is neither written nor lost.
        let seen_at = Utc::now() + Duration::seconds(60);
        let beat = |owner: &str, epoch: i64, generation: i64| Heartbeat {
            executor: rec.id,
            generation,
            fence: Some(fence(owner, epoch)),
        };
        let before = store.get_executor(rec.id).await.unwrap();
        let touched = store
            .touch_executors(
                vec![
                    beat("replica-a", 0, before.generation),
                    beat("replica-b", 1, before.generation - 1),
                ],
                seen_at,
            )
            .await
            .unwrap();
        assert_eq!(touched.touched, 0);
        assert_eq!(touched.lost.len(), 1, "{:?}", touched.lost);
        let (lost, err) = &touched.lost[0];
        assert_eq!(lost, &fence("replica-a", 0));
        match err {
            Error::LeaseLost {
                current_owner,
                current_epoch,
                ..
            } => assert_eq!((current_owner.as_str(), *current_epoch), ("replica-b", 1)),
            other => panic!("expected LeaseLost, got {other}"),
        }
        assert_eq!(store.get_executor(rec.id).await.unwrap(), before);
        let touched = store
            .touch_executors(vec![beat("replica-b", 1, before.generation)], seen_at)
            .await
            .unwrap();
        assert_eq!((touched.touched, touched.lost.len()), (1, 0));
        assert_eq!(
            store
                .get_executor(rec.id)
                .await
                .unwrap()
                .last_seen_at
                .map(|t| t.timestamp_micros()),
            Some(seen_at.timestamp_micros())
        );

        // Removing the executor: A's lease check and delete are refused,
        // nothing deleted; B's go through.
        assert!(
            store
                .check_lease(fence("replica-a", 0))
                .await
                .unwrap_err()
                .is_lease_lost()
        );
        assert!(
            store
                .delete_executor(rec.id, Some(fence("replica-a", 0)))
                .await
                .unwrap_err()
                .is_lease_lost()
        );
        assert!(store.get_executor(rec.id).await.is_ok());
        store.check_lease(fence("replica-b", 1)).await.unwrap();
        assert!(
            store
                .delete_executor(rec.id, Some(fence("replica-b", 1)))
                .await
                .unwrap()
        );
        assert!(
            !store
                .delete_executor(rec.id, Some(fence("replica-b", 1)))
                .await
                .unwrap(),
            "already gone"
        );
        // Gone executor: a fenced write that does not create it is refused.
        assert!(
            store
                .commit(
                    Changeset::new()
                        .event(
                            s.id,
                            state_changed(SessionState::Running, SessionState::Starting)
                        )
                        .fenced(fence("replica-b", 1)),
                )
                .await
                .unwrap_err()
                .is_lease_lost()
        );
    }

    /// Adoption is spread: each claim of expired leases takes at most its
    /// fair share (what is up for adoption over the live replicas), so two
    /// survivors of a crash split a dead replica's executors.
    pub async fn expired_leases_are_split_among_live_replicas(store: &Store) {
        use sessiond_store::ReplicaInfo;
        let ttl = std::time::Duration::from_secs(30);
        let now = Utc::now();
        let dead_beat = now - Duration::seconds(60);
        for (id, beat) in [("dead", dead_beat), ("alive-1", now), ("alive-2", now)] {
            store
                .register_replica(ReplicaInfo {
                    id: id.into(),
                    address: format!("{id}:50051"),
                    hostname: "h".into(),
                    pid: 1,
                    started_at: beat,
                    heartbeat_at: beat,
                    lease_ttl: ttl,
                    owned_executors: 0,
                })
                .await
                .unwrap();
        }
        let (t, p, _) = seed(store).await;
        for _ in 0..10 {
            let (s, _) = store
                .create_session(&session(&t, &p), vec![])
                .await
                .unwrap();
            let mut rec = executor(&s, ExecutorStatus::Ready);
            rec.owner_id = Some("dead".into());
            rec.lease_expires_at = Some(dead_beat + Duration::seconds(30));
            store
                .commit(Changeset::new().insert_executor(rec))
                .await
                .unwrap();
        }
        let first = store.claim_expired("alive-1", now, ttl, 64).await.unwrap();
        assert_eq!(first.len(), 5, "half of 10 for one of two live replicas");
        let second = store.claim_expired("alive-2", now, ttl, 64).await.unwrap();
        assert_eq!(second.len(), 3, "half of the 5 left, rounded up");
        let limited = store.claim_expired("alive-2", now, ttl, 1).await.unwrap();
        assert_eq!(limited.len(), 1, "never more than the limit");
        let rest = store.claim_expired("alive-1", now, ttl, 64).await.unwrap();
        assert_eq!(rest.len(), 1);
        assert!(
            store
                .claim_expired("alive-2", now, ttl, 64)
                .await
                .unwrap()
                .is_empty(),
            "nothing left"
        );
        let loads: Vec<(String, i64)> = store
            .list_replicas(now)
            .await
            .unwrap()
            .into_iter()
            .map(|r| (r.id, r.owned_executors))
            .collect();
        assert_eq!(
            loads,
            [
                ("alive-1".to_owned(), 6),
                ("alive-2".to_owned(), 4),
                ("dead".to_owned(), 0)
            ]
        );
    }

    /// A deleted session is not found by any read, leaves its task's list,
    /// cannot be deleted twice, and a writer still holding it loses.
    pub async fn deleted_sessions_are_not_found(store: &Store) {
        let (t, p, s) = seed(store).await;
        let (other, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        store.mark_session_deleted(s.id).await.unwrap();
        assert!(store.get_session(s.id).await.unwrap_err().is_not_found());
        assert!(
            store
                .session_status_inputs(s.id)
                .await
                .unwrap_err()
                .is_not_found()
        );
        let listed: Vec<_> = store
            .list_sessions(t.id)
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(listed, [other.id]);
        assert!(
            store
                .mark_session_deleted(s.id)
                .await
                .unwrap_err()
                .is_not_found()
        );
        let mut stale = s.clone();
        stale.state = SessionState::Starting;
        let err = store
            .commit(Changeset::new().update_session(stale))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Conflict { .. }), "{err}");
    }

    pub async fn migrations_round_trip(store: &Store) {
        seed(store).await;
        let reverted = store.revert_all_migrations().await.unwrap();
        // Every migration directory (init, profile container, profile auth +
        // permission policy, message parts, permission timeout, replicas,
        // custom runtimes, deleted sessions, profile config defaults, MCP
        // servers, worktree origin, session title).
        assert_eq!(reverted.len(), 12, "{reverted:?}");
        let err = store.list_tasks(None, 10).await.unwrap_err();
        assert!(matches!(err, Error::Database(_)), "tables are gone: {err}");
        let applied = store.run_pending_migrations().await.unwrap();
        // Reverted newest first, applied oldest first.
        assert_eq!(applied, reverted.iter().rev().cloned().collect::<Vec<_>>());
        assert!(store.run_pending_migrations().await.unwrap().is_empty());
        assert!(store.list_tasks(None, 10).await.unwrap().is_empty());
        let (t, _, s) = seed(store).await;
        store
            .commit(Changeset::new().event(
                s.id,
                state_changed(SessionState::Created, SessionState::Starting),
            ))
            .await
            .unwrap();
        assert_eq!(store.last_task_event_seq(t.id).await.unwrap(), 1);
        store.ping().await.unwrap();
    }
}

macro_rules! store_test {
    ($backend:ident, $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let db = open::$backend().await;
            suite::$name(&db.store).await;
        }
    };
}

/// Instantiates the whole suite for one backend.
macro_rules! store_tests {
    ($backend:ident) => {
        mod $backend {
            use super::*;
            store_test!($backend, tasks_crud_and_not_found);
            store_test!($backend, profiles_upsert_by_name);
            store_test!($backend, profiles_upsert_concurrently);
            store_test!($backend, sessions_crud);
            store_test!($backend, session_titles_by_source);
            store_test!($backend, session_created_with_its_intent_or_not_at_all);
            store_test!($backend, a_committed_session_is_the_stored_row);
            store_test!($backend, executors_crud);
            store_test!($backend, a_batch_writes_each_changeset_or_reports_it_alone);
            store_test!($backend, grouped_rereads_match_single_reads);
            store_test!($backend, custom_runtimes_round_trip);
            store_test!($backend, recoverable_executors_filter_by_status);
            store_test!($backend, changeset_is_all_or_nothing);
            store_test!($backend, a_message_added_twice_is_refused_whole);
            store_test!($backend, sessions_with_a_metadata_key);
            store_test!($backend, sessions_in_a_directory);
            store_test!($backend, two_writers_same_version_one_wins);
            store_test!($backend, concurrent_appenders_get_gap_free_seqs);
            store_test!(
                $backend,
                lone_messages_from_many_writers_are_numbered_like_any_commit
            );
            store_test!($backend, messages_append_and_update);
            store_test!($backend, activity_parts_round_trip);
            store_test!($backend, events_after_and_task_events_after);
            store_test!($backend, task_event_applies_the_machine_in_the_transaction);
            store_test!($backend, managed_reads_match_single_reads);
            store_test!($backend, migrations_round_trip);
            store_test!($backend, deleted_sessions_are_not_found);
            store_test!($backend, leases_claim_renew_release_and_adopt);
            store_test!($backend, fenced_writes_fail_after_the_lease_moved);
            store_test!($backend, expired_leases_are_split_among_live_replicas);
        }
    };
}

store_tests!(sqlite);
store_tests!(postgres);

/// Every statement a commit runs for a session is kept prepared: the
/// connection's statement cache takes it the first time it runs (diesel's
/// `CacheQuery` event), so it is never parsed and planned again. A turn's
/// commits were found running their `INSERT`s unprepared (`Prepared`
/// through `execute`). Both backends, one after the other: the recorder is
/// process-wide, and it keeps only statements naming this test's session
/// or task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_of_a_commit_is_kept_prepared() {
    use diesel::connection::{Instrumentation, InstrumentationEvent};
    use std::sync::Mutex;

    /// SQL the caches took, and every statement run (SQL and binds).
    static CACHED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static RUN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    struct Recorder;
    impl Instrumentation for Recorder {
        fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
            match event {
                InstrumentationEvent::CacheQuery { sql, .. } => {
                    CACHED.lock().unwrap().push(sql.to_owned())
                }
                InstrumentationEvent::StartQuery { query, .. } => {
                    RUN.lock().unwrap().push(query.to_string())
                }
                _ => {}
            }
        }
    }
    diesel::connection::set_default_instrumentation(|| Some(Box::new(Recorder))).unwrap();

    for db in [open::sqlite().await, open::postgres().await] {
        let store = &db.store;
        let (t, _, s) = seed(store).await;
        let mut s = s;
        // A turn's shapes, each twice: the second run of each must find
        // its statements cached by the first.
        for round in 0..2 {
            let asked = message(&s, MessageRole::User, &format!("turn {round}"));
            let reply = message(&s, MessageRole::Agent, "");
            let mut next = s.clone();
            next.state = SessionState::Running;
            let committed = store
                .commit(
                    Changeset::new()
                        .update_session(next)
                        .add_message(asked)
                        .add_message(reply.clone())
                        .event(s.id, state_changed(s.state, SessionState::Running))
                        .task_event(t.id, TaskEvent::WorkStarted),
                )
                .await
                .unwrap();
            s = committed.session.unwrap();
            // A reply's first chunk: one message with its event (on
            // PostgreSQL one statement inserts both).
            let chunk = message(&s, MessageRole::Agent, "first chunk");
            store
                .commit(
                    Changeset::new()
                        .add_message(chunk.clone())
                        .event(s.id, EventPayload::MessageAdded(chunk)),
                )
                .await
                .unwrap();
            let mut next = s.clone();
            next.state = SessionState::WaitingForInput;
            let committed = store
                .commit(
                    Changeset::new()
                        .update_session(next)
                        .update_message(reply.id, "done", true)
                        .event(
                            s.id,
                            state_changed(SessionState::Running, SessionState::WaitingForInput),
                        )
                        .event(
                            s.id,
                            state_changed(SessionState::Running, SessionState::WaitingForInput),
                        ),
                )
                .await
                .unwrap();
            s = committed.session.unwrap();
            store
                .set_session_title(s.id, format!("title {round}"), TitleSource::User)
                .await
                .unwrap();
        }
        let cached = CACHED.lock().unwrap().clone();
        let ours: Vec<String> = RUN
            .lock()
            .unwrap()
            .iter()
            .filter(|q| q.contains(&s.id.to_string()) || q.contains(&t.id.to_string()))
            .filter(|q| {
                !q.starts_with("INSERT INTO \"tasks\"")
                    && !q.starts_with("INSERT INTO \"task_sessions\"")
            })
            .cloned()
            .collect();
        assert!(ours.len() > 10, "the recorder saw the commits: {ours:#?}");
        if store.backend() == sessiond_store::Backend::Postgres {
            // The first chunk's commit went as its one statement.
            assert!(
                ours.iter().any(|q| q.contains("added_event AS (INSERT")),
                "no one-statement append: {ours:#?}"
            );
        }
        for q in &ours {
            let sql = q.split(" -- binds:").next().unwrap_or(q);
            assert!(
                cached.iter().any(|c| c == sql),
                "{:?}: not kept prepared: {sql}",
                store.backend()
            );
        }
    }
}

/// SQLite: commits are checkpointed by the store's own thread, not by the
/// commit that fills the WAL (the pool's automatic checkpoint is only a
/// backstop, far above what these commits write): the pages reach the
/// main database file while the commits leave them in the WAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_commits_are_checkpointed_beside_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sessiond.db");
    let store = Store::connect(
        &format!("sqlite://{}", path.display()),
        StoreOptions::default(),
    )
    .await
    .unwrap();
    let (_, _, s) = seed(&store).await;
    let main_file = || std::fs::metadata(&path).unwrap().len();
    let before = main_file();
    // 2 MiB of messages, one commit each: well below the backstop (10,000
    // pages, ~40 MiB), so no commit checkpoints by itself.
    let content = "x".repeat(8 * 1024);
    for _ in 0..256 {
        store
            .commit(Changeset::new().add_message(message(&s, MessageRole::User, &content)))
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while main_file() < before + 2 * 1024 * 1024 {
        assert!(
            std::time::Instant::now() < deadline,
            "the database file did not grow past {before} + 2 MiB within 30 s (now {} bytes): no checkpoint ran",
            main_file()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        store.list_messages(s.id, 0, 1000).await.unwrap().len(),
        256,
        "every message is still read"
    );
}

/// PostgreSQL: an event committed by one replica wakes the listener of
/// another (after the commit, naming the event), never its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_events_wake_the_other_replicas() {
    use sessiond_store::EventWake;
    let db = open::postgres().await;
    let a = db.store.clone();
    a.announce_events_as("replica-a");
    let mut wakes = a.listen_events("replica-a").unwrap();
    let Guard::Postgres(pg) = &db._guard else {
        panic!("a postgres database")
    };
    let b = Store::connect(pg.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    b.announce_events_as("replica-b");
    let mut b_wakes = b.listen_events("replica-b").unwrap();

    let (_, _, s) = seed(&a).await;
    let committed = b
        .commit(Changeset::new().event(
            s.id,
            EventPayload::StateChanged {
                from: SessionState::Created,
                to: SessionState::Starting,
                error_message: None,
            },
        ))
        .await
        .unwrap();
    let e = &committed.events[0];
    let wake = tokio::time::timeout(std::time::Duration::from_secs(30), wakes.recv())
        .await
        .expect("a wake within 30 s")
        .unwrap();
    assert_eq!(
        wake,
        EventWake::Committed {
            session: s.id,
            seq: e.seq,
            task: s.task_id,
            task_seq: e.task_seq,
        }
    );
    // B's own commit did not wake B; A's commit does.
    a.commit(Changeset::new().event(
        s.id,
        EventPayload::StateChanged {
            from: SessionState::Starting,
            to: SessionState::WaitingForInput,
            error_message: None,
        },
    ))
    .await
    .unwrap();
    // (Seeding by A woke B too; the wake of this commit comes after those.)
    let want = EventWake::Committed {
        session: s.id,
        seq: e.seq + 1,
        task: s.task_id,
        task_seq: e.task_seq + 1,
    };
    loop {
        let wake = tokio::time::timeout(std::time::Duration::from_secs(30), b_wakes.recv())
            .await
            .expect("a wake within 30 s")
            .unwrap();
        assert_ne!(
            wake,
            EventWake::Committed {
                session: s.id,
                seq: e.seq,
                task: s.task_id,
                task_seq: e.task_seq,
            },
            "B was woken by its own commit"
        );
        if wake == want {
            break;
        }
    }
    // One commit of several events (their notifications sent in one
    // statement) wakes A once for each.
    let several = b
        .commit(
            Changeset::new()
                .event(s.id, EventPayload::QueueChanged(Vec::new()))
                .event(s.id, EventPayload::QueueChanged(Vec::new()))
                .event(s.id, EventPayload::QueueChanged(Vec::new())),
        )
        .await
        .unwrap();
    let mut want: std::collections::BTreeSet<i64> = several.events.iter().map(|e| e.seq).collect();
    assert_eq!(want.len(), 3);
    // A reply's first chunk (one statement, its NOTIFY in it) wakes A too.
    let chunk = message(&s, MessageRole::Agent, "first chunk");
    let alone = b
        .commit(
            Changeset::new()
                .add_message(chunk.clone())
                .event(s.id, EventPayload::MessageAdded(chunk)),
        )
        .await
        .unwrap();
    want.insert(alone.events[0].seq);
    while !want.is_empty() {
        let wake = tokio::time::timeout(std::time::Duration::from_secs(30), wakes.recv())
            .await
            .expect("a wake within 30 s")
            .unwrap();
        if let EventWake::Committed { seq, .. } = wake {
            want.remove(&seq);
        }
    }
}

/// PostgreSQL: two survivors claiming a dead replica's expired leases at
/// the same moment take disjoint rows, each its share. While one claim's
/// transaction holds its rows (here a raw transaction holding the first
/// four, as an in-flight claim does), the other skips them and takes its
/// fair share of the rest at once, instead of queueing behind those locks
/// and coming back empty (then idling while rows remained).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_claims_skip_each_others_rows() {
    use diesel::{Connection, RunQueryDsl};
    use sessiond_store::ReplicaInfo;
    let db = open::postgres().await;
    let store = &db.store;
    let Guard::Postgres(pg) = &db._guard else {
        panic!("a postgres database")
    };
    let ttl = std::time::Duration::from_secs(30);
    let now = Utc::now();
    let dead_beat = now - Duration::seconds(60);
    for (id, beat) in [("dead", dead_beat), ("alive-1", now), ("alive-2", now)] {
        store
            .register_replica(ReplicaInfo {
                id: id.into(),
                address: format!("{id}:50051"),
                hostname: "h".into(),
                pid: 1,
                started_at: beat,
                heartbeat_at: beat,
                lease_ttl: ttl,
                owned_executors: 0,
            })
            .await
            .unwrap();
    }
    let (t, p, _) = seed(store).await;
    let mut ids = Vec::new();
    for _ in 0..10 {
        let (s, _) = store
            .create_session(&session(&t, &p), vec![])
            .await
            .unwrap();
        let mut rec = executor(&s, ExecutorStatus::Ready);
        rec.owner_id = Some("dead".into());
        rec.lease_expires_at = Some(dead_beat + Duration::seconds(30));
        ids.push(rec.id.to_string());
        store
            .commit(Changeset::new().insert_executor(rec))
            .await
            .unwrap();
    }
    ids.sort();

    // Another claim in flight: the first four rows locked, uncommitted.
    let url = pg.url().to_owned();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let mut c = diesel::PgConnection::establish(&url).unwrap();
        c.transaction::<_, diesel::result::Error, _>(|c| {
            diesel::sql_query("SELECT id FROM executors_running ORDER BY id LIMIT 4 FOR UPDATE")
                .execute(c)?;
            locked_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            Ok(())
        })
        .unwrap();
    });
    locked_rx.recv().unwrap();
    let second = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        store.claim_expired("alive-2", now, ttl, 64),
    )
    .await
    .expect("a claim does not wait for rows another claim holds")
    .unwrap();
    let mut got: Vec<String> = second.iter().map(|c| c.record.id.to_string()).collect();
    got.sort();
    assert_eq!(
        got,
        ids[4..9],
        "half of the 10 (rounded up), the first rows not locked by the other claim"
    );
    release_tx.send(()).unwrap();
    holder.join().unwrap();

    let first = store.claim_expired("alive-1", now, ttl, 64).await.unwrap();
    let mut got1: Vec<String> = first.iter().map(|c| c.record.id.to_string()).collect();
    got1.sort();
    assert_eq!(
        got1,
        ids[..3],
        "half of the 5 left (rounded up), none twice"
    );
    for c in second.iter().chain(&first) {
        assert_eq!(c.epoch, c.record.lease_epoch, "the epoch the claim wrote");
        assert!(c.epoch >= 1);
    }
    let owners: BTreeMap<String, usize> =
        store
            .list_executors()
            .await
            .unwrap()
            .into_iter()
            .fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.owner_id.unwrap_or_default()).or_default() += 1;
                m
            });
    assert_eq!(
        owners,
        BTreeMap::from([
            ("alive-1".to_owned(), 3),
            ("alive-2".to_owned(), 5),
            ("dead".to_owned(), 2)
        ])
    );
}

/// A fresh PostgreSQL database and a store on it with one pooled
/// connection, so the next call meets a connection terminated under it.
async fn one_connection_store() -> (sessiond_testkit::postgres::TestDatabase, Store) {
    let db = tokio::task::spawn_blocking(sessiond_testkit::postgres::test_database)
        .await
        .unwrap();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(1))
        .await
        .unwrap();
    (db, store)
}

/// Terminates the one connection the store holds, from another session;
/// returns once its backend has exited (the timeout argument waits).
fn terminate_the_stores_connection(url: &str) {
    let killed = sessiond_testkit::postgres::psql_command(
        url,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) \
         FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .unwrap();
    assert_eq!(killed.trim(), "1", "the store's one connection");
}

/// PostgreSQL: the server terminating a connection the pool holds
/// (`pg_terminate_backend` from another session, as an operator or a
/// failover does) fails the next call on it as `ConnectionLost`, which is
/// unavailable (retry), not a database error; the pool replaces the
/// connection and the call after succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_terminated_connection_is_unavailable() {
    let (db, store) = one_connection_store().await;
    store.list_tasks(None, 10).await.unwrap();
    terminate_the_stores_connection(db.url());
    let err = store.list_tasks(None, 10).await.unwrap_err();
    assert!(matches!(err, Error::ConnectionLost(_)), "{err:?}");
    assert!(err.is_unavailable());
    assert!(
        err.to_string().contains("terminating connection")
            || err.to_string().contains("server closed the connection"),
        "{err}"
    );
    store.list_tasks(None, 10).await.unwrap();
}

/// `commit_batch` whose transaction fails as a whole (here its one pooled
/// connection was terminated, so its `BEGIN` fails and nothing of the lot
/// is written): each changeset is then written on its own, on a fresh
/// connection, and answered in its slot; none is lost, none written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_batch_whose_transaction_fails_is_written_one_by_one() {
    let (db, store) = one_connection_store().await;
    let mut executors = Vec::new();
    for _ in 0..3 {
        let (_, _, s) = seed(&store).await;
        let rec = executor(&s, ExecutorStatus::Starting);
        let stored = committed_executor(&store, Changeset::new().insert_executor(rec)).await;
        let seq = store.last_event_seq(s.id).await.unwrap();
        executors.push((s, stored, seq));
    }
    let batch = executors
        .iter()
        .map(|(s, rec, _)| {
            let mut next = rec.clone();
            next.status = ExecutorStatus::Ready;
            Changeset::new().update_executor(next).event(
                s.id,
                state_changed(SessionState::Starting, SessionState::WaitingForInput),
            )
        })
        .collect();
    terminate_the_stores_connection(db.url());
    let results = store.commit_batch(batch).await.unwrap();
    assert_eq!(results.len(), 3);
    for ((s, rec, seq), result) in executors.iter().zip(results) {
        let done = result.unwrap();
        let stored = store.get_executor(rec.id).await.unwrap();
        assert_eq!(stored.status, ExecutorStatus::Ready);
        assert_eq!(stored.version, rec.version + 1, "written once");
        assert_eq!(done.executor.unwrap(), stored);
        assert_eq!(done.events.len(), 1);
        assert_eq!(done.events[0].seq, seq + 1);
        assert_eq!(
            store.last_event_seq(s.id).await.unwrap(),
            seq + 1,
            "one event"
        );
    }
}

/// PostgreSQL shut down under a running store (fast shutdown: connections
/// terminated, then connection refused): the call on the lost connection is
/// `ConnectionLost`, and while the database stays down calls fail within
/// about a second (`Pool`, unavailable) instead of waiting the whole connect
/// timeout each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_fails_calls_fast() {
    let cluster = tokio::task::spawn_blocking(sessiond_testkit::postgres::start_cluster)
        .await
        .unwrap();
    let db = cluster.create_database();
    let connect_timeout = std::time::Duration::from_secs(30);
    let store = Store::connect(
        db.url(),
        StoreOptions::default()
            .max_connections(2)
            .connect_timeout(connect_timeout),
    )
    .await
    .unwrap();
    store.list_tasks(None, 10).await.unwrap();
    // SIGINT is PostgreSQL's fast shutdown; wait until the postmaster is gone.
    let pid = cluster.pid();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while proc.exists() {
        assert!(std::time::Instant::now() < deadline, "postgres still runs");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The pool's (up to 2) terminated connections fail as lost, then no
    // connection can be had: each call answers within the fail-fast bound,
    // not the 30 s connect timeout.
    let mut refused = 0;
    for _ in 0..5 {
        let asked = std::time::Instant::now();
        let err = store.list_tasks(None, 10).await.unwrap_err();
        let took = asked.elapsed();
        assert!(err.is_unavailable(), "{err:?}");
        assert!(took < connect_timeout / 3, "{took:?}: {err}");
        if matches!(err, Error::Pool(_)) {
            refused += 1;
        }
    }
    assert!(refused >= 3, "{refused} of 5 calls found no connection");
}
