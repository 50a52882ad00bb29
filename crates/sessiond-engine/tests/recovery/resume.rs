use std::collections::BTreeMap;

use chrono::Utc;
use sessiond_domain::{
    OutcomeLabel, ResumePolicy, Runtime, Session, SessionId, SessionState, TaskId,
};
use sessiond_engine::{Error, ManagerConfig};

use crate::support::{Db, World, expected_reply, kill_tree};

/// A session row written directly (no processes), for validation cases.
async fn stored_session(
    w: &World,
    profile: sessiond_domain::AgentProfileId,
    state: SessionState,
    token: Option<&str>,
    worktree: &str,
) -> Session {
    let now = Utc::now();
    let s = Session {
        id: SessionId::new(),
        task_id: w.task.id,
        state,
        agent_profile_id: profile,
        agent_execution_id: None,
        runtime: Runtime::LocalStandalone,
        executor_id: None,
        worktree: w.worktree(worktree),
        title: String::new(),
        resume_token: token.map(str::to_owned),
        metadata: BTreeMap::new(),
        error_message: None,
        version: 1,
        created_at: now,
        updated_at: now,
    };
    w.store.create_session(&s, vec![]).await.unwrap().0
}

/// Every validation failure of ResumeSession has its own error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_validation_errors() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let task = w.task.id;

    let missing = mgr
        .resume_session(task, SessionId::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            missing,
            Error::NotFound {
                entity: "session",
                ..
            }
        ),
        "{missing}"
    );

    let s = stored_session(&w, w.profile.id, SessionState::Error, Some("t"), "v1").await;
    let wrong = mgr.resume_session(TaskId::new(), s.id).await.unwrap_err();
    assert!(matches!(wrong, Error::WrongTask { .. }), "{wrong}");

    let ended = stored_session(&w, w.profile.id, SessionState::Completed, Some("t"), "v2").await;
    let e = mgr.resume_session(task, ended.id).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::SessionEnded {
                state: SessionState::Completed,
                ..
            }
        ),
        "{e}"
    );

    let no_resume = w.profile_with("no-resume", &[], false).await;
    let nr = stored_session(&w, no_resume.id, SessionState::Error, Some("t"), "v3").await;
    let e = mgr.resume_session(task, nr.id).await.unwrap_err();
    assert!(matches!(e, Error::NotResumable { .. }), "{e}");
    assert_eq!(
        e.to_string().matches("create a new session").count(),
        1,
        "{e}"
    );

    let tokenless = stored_session(&w, w.profile.id, SessionState::Error, None, "v4").await;
    let e = mgr.resume_session(task, tokenless.id).await.unwrap_err();
    assert!(matches!(e, Error::MissingResumeToken { .. }), "{e}");

    let gone = stored_session(&w, w.profile.id, SessionState::Error, Some("t"), "v5").await;
    std::fs::remove_dir_all(&gone.worktree.path).unwrap();
    let e = mgr.resume_session(task, gone.id).await.unwrap_err();
    assert!(matches!(e, Error::WorktreeMissing { .. }), "{e}");

    for e in [missing, wrong, e] {
        assert!(!e.to_string().is_empty());
    }
    assert_eq!(mgr.stats().agentctl_launches, 0);
    w.finish(&mgr, &[]).await;
}

fn on_demand(w: &World) -> ManagerConfig {
    ManagerConfig {
        resume_policy: ResumePolicy::OnDemand,
        ..w.config()
    }
}

/// Ten concurrent ResumeSession calls: one agent launch, one resume, ten
/// identical answers; the conversation continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_resumes_share_one_attempt() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "c").await;
    let token = s.resume_token.clone().unwrap();
    w.prompt(&mgr, s.id, "one").await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    // on_demand: startup restores the workspace only.
    let mgr = w.manager_with(on_demand(&w));
    let summary = mgr.recovery().recover_all().await.unwrap();
    assert_eq!(summary.count(OutcomeLabel::ExecutorOnly), 1, "{summary:?}");
    w.track(s.id).await;
    let st = w.status(&mgr, s.id).await;
    assert!(st.needs_resume, "{st:?}");
    assert_eq!(mgr.stats().agent_launches, 0);

    let calls = (0..10).map(|_| {
        let mgr = mgr.clone();
        let task = w.task.id;
        tokio::spawn(async move { mgr.resume_session(task, s.id).await })
    });
    let answers: Vec<_> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    assert_eq!(mgr.stats().agent_launches, 1, "one agent launched");
    assert_eq!(mgr.stats().resume_attempts, 1, "one session/load");
    for a in &answers {
        assert_eq!(a, &answers[0]);
    }
    assert_eq!(answers[0].state, SessionState::WaitingForInput);
    assert!(answers[0].is_agent_running);
    assert_eq!(
        w.store.get_task(w.task.id).await.unwrap().state,
        sessiond_domain::TaskState::Review
    );
    let reply = w.prompt(&mgr, s.id, "two").await;
    assert_eq!(reply, expected_reply(2, &token, "two"));
    w.finish(&mgr, &[s.id]).await;
}

/// A ResumeSession racing startup recovery joins it: one agentctl launch,
/// one agent resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_racing_startup_recovery_joins_it() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "r").await;
    mgr.shutdown();
    drop(mgr);
    kill_tree(w.record(s.id).await.pid.unwrap()).await;

    let mgr = w.manager();
    let recovering = {
        let mgr = mgr.clone();
        tokio::spawn(async move { mgr.recovery().recover_all().await })
    };
    // Let recovery take the session first.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let resumed = mgr.resume_session(w.task.id, s.id).await.unwrap();
    let summary = recovering.await.unwrap().unwrap();
    assert_eq!(
        summary.count(OutcomeLabel::Resumed) + summary.count(OutcomeLabel::Reattached),
        1,
        "{summary:?}"
    );
    assert!(resumed.is_agent_running, "{resumed:?}");
    assert_eq!(mgr.stats().agentctl_launches, 1);
    assert_eq!(mgr.stats().agent_launches, 1);
    assert_eq!(mgr.stats().resume_attempts, 1);
    w.track(s.id).await;
    w.finish(&mgr, &[s.id]).await;
}
