//! Usage and cost: what an agent reports for its turns (the demo agent with
//! `ACP_DEMO_USAGE`: 100 input and 50 output tokens a turn, a cumulative
//! cost of 0.25 USD a turn per process, as Claude Code reports it) is
//! stored per turn on the turn's user message, totalled per session
//! (GetSessionStatus, ListSessions) and per task (GetTask), and counted in
//! the metrics, once per turn whatever restarts happen around it.

use std::path::Path;
use std::time::Duration;

use sessiond_proto::sessiond::v1 as pb;

use crate::metrics::http_get;
use crate::support::*;

fn config(dir: &Path) -> String {
    let path = dir.join("sessiond.toml");
    std::fs::write(
        &path,
        format!(
            "[[agents]]\nname = \"metered\"\ncommand = \"{agent}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{state}\", ACP_DEMO_USAGE = \"1\", ACP_DEMO_MID_GATE_FILE = \"{}\" }}\n\
             [[agents]]\nname = \"session-metered\"\ncommand = \"{agent}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{state}\", ACP_DEMO_USAGE = \"1\", \
             ACP_DEMO_USAGE_PER_SESSION = \"1\", ACP_DEMO_NO_RESUME_SESSION = \"1\" }}\n",
            dir.join("gate").display(),
            agent = bin("acp-demo-agent").display(),
            state = dir.join("demo-state").display(),
        ),
    )
    .unwrap();
    path.display().to_string()
}

async fn status(c: &mut Sessions, task: &str, session: &str) -> pb::GetSessionStatusResponse {
    c.get_session_status(pb::GetSessionStatusRequest {
        task_id: task.into(),
        session_id: session.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

/// The session's totals: turns, input, output, total tokens, USD.
async fn totals(c: &mut Sessions, task: &str, session: &str) -> (u64, u64, u64, u64, f64) {
    let u = status(c, task, session).await.usage.unwrap();
    let usd = u
        .costs
        .iter()
        .find(|c| c.currency == "USD")
        .map_or(0.0, |c| c.amount);
    (
        u.turns,
        u.input_tokens,
        u.output_tokens,
        u.total_tokens,
        usd,
    )
}

/// A metric's value (0 when the series does not exist yet).
async fn metric(server: &Server, series: &str) -> f64 {
    let text = http_get(server.metrics.as_ref().unwrap(), "/metrics")
        .await
        .1;
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

async fn wait_state(c: &mut Sessions, task: &str, session: &str, state: pb::SessionState) {
    for _ in 0..1200 {
        if status(c, task, session).await.state == state as i32 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("session {session} never reached {state:?}");
}

async fn user_message(c: &mut Sessions, task: &str, session: &str, id: &str) -> pb::Message {
    c.list_messages(pb::ListMessagesRequest {
        task_id: task.into(),
        session_id: session.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .messages
    .into_iter()
    .find(|m| m.id == id)
    .unwrap()
}

#[tokio::test]
async fn usage_is_stored_per_turn_totalled_and_counted_once_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path());
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "usage").await;
    let s = create_session(&mut c, &task.id, &work, "metered").await;
    assert_eq!(totals(&mut c, &task.id, &s.id).await, (0, 0, 0, 0, 0.0));

    // One turn: its usage on its user message, in the session's totals,
    // with the turn's end; in the metrics.
    let sent = send(&mut c, &task.id, &s.id, "one").await;
    turn_end(&mut c, &s.id, &sent.id).await;
    let u = user_message(&mut c, &task.id, &s.id, &sent.id)
        .await
        .usage
        .expect("the turn's usage on its user message");
    assert_eq!(
        (u.input_tokens, u.output_tokens, u.total_tokens),
        (Some(100), Some(50), Some(150))
    );
    assert_eq!(
        (u.context_used, u.context_size),
        (Some(1000), Some(200_000))
    );
    let cost = u.cost.unwrap();
    assert_eq!((cost.amount, cost.currency.as_str()), (0.25, "USD"));
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (1, 100, 50, 150, 0.25)
    );
    assert_eq!(
        metric(&server, "sessiond_agent_tokens_total{kind=\"input\"}").await,
        100.0
    );
    assert_eq!(
        metric(&server, "sessiond_agent_cost_total{currency=\"USD\"}").await,
        0.25
    );

    // A turn that ends while sessiond is down (held after its first chunk,
    // sessiond killed, then let go): recovery stores it, counted once.
    std::fs::write(dir.path().join("gate"), "").unwrap();
    let held = send(&mut c, &task.id, &s.id, "two").await;
    wait_for(&mut c, &s.id, |e| match &e.payload {
        Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            if m.role == pb::MessageRole::Agent as i32 && m.seq > held.seq =>
        {
            Some(())
        }
        _ => None,
    })
    .await;
    server.kill();
    std::fs::remove_file(dir.path().join("gate")).unwrap();
    let transcript = dir
        .path()
        .join("demo-state")
        .join(format!("{}.json", s.resume_token));
    for _ in 0..1200 {
        if std::fs::read_to_string(&transcript).is_ok_and(|t| t.contains("\"two\"")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    wait_state(&mut c, &task.id, &s.id, pb::SessionState::WaitingForInput).await;
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (2, 200, 100, 300, 0.5),
        "the second turn's cost is its share of the cumulative 0.5"
    );
    assert!(
        user_message(&mut c, &task.id, &s.id, &held.id)
            .await
            .usage
            .is_some()
    );
    assert_eq!(
        metric(&server, "sessiond_agent_tokens_total{kind=\"input\"}").await,
        100.0,
        "this process counted the second turn only"
    );

    // Again: nothing is counted twice by a restart.
    server.kill();
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (2, 200, 100, 300, 0.5)
    );
    let sent = send(&mut c, &task.id, &s.id, "three").await;
    turn_end(&mut c, &s.id, &sent.id).await;
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (3, 300, 150, 450, 0.75)
    );
    assert_eq!(
        metric(&server, "sessiond_agent_tokens_total{kind=\"input\"}").await,
        100.0
    );

    // Listed with the session; the task's totals are its sessions'.
    let s2 = create_session(&mut c, &task.id, &work, "metered").await;
    let sent = send(&mut c, &task.id, &s2.id, "other").await;
    turn_end(&mut c, &s2.id, &sent.id).await;
    let listed = list(&mut c, &task.id).await;
    let first = listed.iter().find(|x| x.id == s.id).unwrap();
    assert_eq!(first.usage.as_ref().unwrap().turns, 3);
    let t = c
        .get_task(pb::GetTaskRequest {
            task_id: task.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap()
        .usage
        .unwrap();
    assert_eq!((t.turns, t.total_tokens), (4, 600));
    assert_eq!(t.costs[0].amount, 1.0);
}

/// An agent whose cost is the session's (ACP's "cumulative session cost",
/// the demo agent with `ACP_DEMO_USAGE_PER_SESSION`) tells it again as it
/// replays the history on `session/load`: after everything was killed and
/// recovery relaunched and reloaded it, the next turn costs what it added,
/// not the session's whole cost again (helper-35: 0.75 counted for a 0.25
/// turn).
#[tokio::test]
async fn a_session_cost_replayed_on_load_is_where_the_next_turn_counts_from() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let config = config(dir.path());
    let mut server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let task = create_task(&mut c, "usage").await;
    let s = create_session(&mut c, &task.id, &work, "session-metered").await;
    for text in ["one", "two"] {
        let sent = send(&mut c, &task.id, &s.id, text).await;
        turn_end(&mut c, &s.id, &sent.id).await;
    }
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (2, 200, 100, 300, 0.5)
    );

    // sessiond and every agentctl (their agents die with them) gone: the
    // recovery relaunches the agent, which reloads the conversation.
    server.kill();
    kill_agentctls_and_wait(&data).await;
    let server = start(&data, &["--config", &config]);
    let mut c = sessions(&server).await;
    let sent = send(&mut c, &task.id, &s.id, "three").await;
    turn_end(&mut c, &s.id, &sent.id).await;
    let loads = std::fs::read_to_string(dir.path().join("demo-state").join("calls.log"))
        .unwrap_or_default();
    let cost = user_message(&mut c, &task.id, &s.id, &sent.id)
        .await
        .usage
        .and_then(|u| u.cost)
        .expect("the third turn's cost");
    assert!(loads.contains("\"session/load\""), "no load: {loads}");
    assert_eq!(cost.amount, 0.25, "the third turn's own cost ({loads})");
    assert_eq!(
        totals(&mut c, &task.id, &s.id).await,
        (3, 300, 150, 450, 0.75)
    );
    drop(server);
}
