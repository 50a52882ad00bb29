//! Fencing across replicas (real PostgreSQL, real `sessiond` replica child
//! processes, real agentctl and demo agent): a replica paused (SIGSTOP)
//! past its lease, whose session another replica adopted, is resumed
//! (SIGCONT) and must not act on it: its writes are refused by the store
//! (lease epoch checked in the write's transaction) or its agentctl calls by
//! agentctl (older epoch), nothing is prompted or launched twice.

use std::{path::Path, process::Command, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use sessiond_store::{Store, StoreOptions};
use tonic::Code;

use crate::{metrics::http_get, replicas::until, restart::wait_serving, support::*};

async fn owner_and_epoch(store: &Store, session: &str) -> (Option<String>, i64) {
    let id = sessiond_domain::SessionId::parse(session).unwrap();
    let r = store.get_executor_for_session(id).await.unwrap().unwrap();
    (r.owner_id, r.lease_epoch)
}

fn signal(server: &Server, sig: &str) {
    let pid = server.child.as_ref().unwrap().id();
    assert!(
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

/// Live (not zombie) processes whose executable is `name` and whose working
/// directory is `cwd` (the demo agent runs in the session's worktree).
fn processes_in(name: &str, cwd: &Path) -> Vec<u32> {
    let cwd = std::fs::canonicalize(cwd).unwrap();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(exe) = std::fs::read_link(entry.path().join("exe")) else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        if stat.contains(") Z ") || !exe.to_string_lossy().ends_with(name) {
            continue;
        }
        if std::fs::read_link(entry.path().join("cwd")).ok().as_deref() == Some(cwd.as_path()) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// The value of the counter `sessiond_fenced_actions{by="<by>"}`.
fn fenced(metrics: &str, by: &str) -> f64 {
    let key = format!("sessiond_fenced_actions_total{{by=\"{by}\"}}");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} not in the exposition"))
}

#[tokio::test]
async fn a_replica_resumed_after_sigstop_past_its_lease_is_fenced_off() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    let side = root.join("side-effects.txt");
    let config = root.join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"side\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_SIDE_EFFECT_FILE = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            root.join("demo-state").display(),
            side.display(),
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let prompts = || {
        std::fs::read_to_string(&side)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // Held while A resumes: its heartbeat (which would drop the session it
    // lost) waits, so A still believes it owns the session and acts on it.
    let heartbeat_gate = root.join("a-heartbeat-gate");
    let replica = |id: &str, envs: &[(&str, &Path)]| {
        start_env(
            &root.join(id),
            &[
                "--database-url",
                db.url(),
                "--replica-id",
                id,
                "--lease-ttl",
                "2s",
                "--config",
                &config,
            ],
            Some(TOKEN),
            None,
            envs,
        )
    };
    let a = replica(
        "replica-a",
        &[("SESSIOND_TEST_HEARTBEAT_GATE", heartbeat_gate.as_path())],
    );
    let b = replica("replica-b", &[]);
    wait_serving(&a).await;
    wait_serving(&b).await;
    let mut ca = sessions(&a).await;
    let mut cb = sessions(&b).await;

    // A session on A, one turn.
    let work = root.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let task = create_task(&mut ca, "fencing").await;
    let s = create_session(&mut ca, &task.id, &work, "side").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    let reply = prompt(&mut ca, &task.id, &s.id, "one").await;
    assert!(reply.contains("turn 1"), "{reply}");
    let (owner, epoch_a) = owner_and_epoch(&store, &s.id).await;
    assert_eq!(owner.as_deref(), Some("replica-a"));
    let agentctls = agentctl_pids(&a.data_dir);
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    let agents = processes_in("acp-demo-agent", &work);
    assert_eq!(agents.len(), 1, "{agents:?}");

    // A paused past its lease: B adopts the session (a claim: epoch + 1)
    // and serves it.
    let metrics_a = a.metrics.clone().expect("metrics address");
    let before = http_get(&metrics_a, "/metrics").await.1;
    let refused_before = fenced(&before, "store") + fenced(&before, "agentctl");
    assert_eq!(refused_before, 0.0, "nothing was refused before the pause");
    signal(&a, "-STOP");
    until("B owns the session", Duration::from_secs(60), || async {
        owner_and_epoch(&store, &s.id).await.0.as_deref() == Some("replica-b")
    })
    .await;
    let (_, epoch_b) = owner_and_epoch(&store, &s.id).await;
    assert!(epoch_b > epoch_a, "{epoch_b} > {epoch_a}");
    until(
        "B lists itself as the owner",
        Duration::from_secs(30),
        || {
            let mut cb = cb.clone();
            async move {
                let listed = cb
                    .list_replicas(pb::ListReplicasRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                listed
                    .replicas
                    .iter()
                    .any(|r| r.id == "replica-b" && r.owned_executors == 1)
            }
        },
    )
    .await;
    // B's adoption recovered it (a call recovers it first otherwise): B
    // prompts, the agent runs the turn once.
    let reply = prompt(&mut cb, &task.id, &s.id, "two").await;
    assert!(reply.contains("turn 2"), "{reply}");
    assert_eq!(prompts(), ["one", "two"]);

    // A resumes, its heartbeat held: it still believes it owns the session.
    std::fs::write(&heartbeat_gate, b"").unwrap();
    signal(&a, "-CONT");

    // A call to A acts on the session: A's write (fenced by epoch
    // `epoch_a`) is refused in its transaction, or was already refused on
    // A's update pump, which dropped the session; either way the answer
    // names B, and the message is not stored or prompted.
    // Marked as forwarded already, so that A answers itself: a replica
    // that knows it lost the session would otherwise (rightly) forward the
    // call to B, which would run it.
    let mut stale = tonic::Request::new(pb::SendMessageRequest {
        task_id: task.id.clone(),
        session_id: s.id.clone(),
        content: "stale".into(),
        ..Default::default()
    });
    stale
        .metadata_mut()
        .insert("sessiond-forwarded-by", "replica-c".parse().unwrap());
    let err = ca.send_message(stale).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let md = err.metadata();
    assert_eq!(
        md.get("sessiond-error").unwrap().to_str().unwrap(),
        "not_owner",
        "{err:?}"
    );
    assert_eq!(
        md.get("sessiond-owner").unwrap().to_str().unwrap(),
        "replica-b",
        "{err:?}"
    );
    // The refusal is visible: A's fencing counter (its writes refused by
    // the store, or its agentctl calls refused by agentctl).
    let after = http_get(&metrics_a, "/metrics").await.1;
    let (by_store, by_agentctl) = (fenced(&after, "store"), fenced(&after, "agentctl"));
    assert!(
        by_store + by_agentctl >= 1.0,
        "A acted without being refused: store {by_store}, agentctl {by_agentctl}"
    );

    // Nothing ran twice, nothing was launched: the agent saw "one" and
    // "two" only, the transcript has no "stale", the same agentctl and
    // agent processes run (B reattached to them; A started none).
    assert_eq!(prompts(), ["one", "two"]);
    assert_eq!(agentctl_pids(&a.data_dir), agentctls);
    assert!(agentctl_pids(&b.data_dir).is_empty());
    assert_eq!(processes_in("acp-demo-agent", &work), agents);
    let messages = cb
        .list_messages(pb::ListMessagesRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    let users: Vec<&str> = messages
        .iter()
        .filter(|m| m.role == pb::MessageRole::User as i32)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(users, ["one", "two"], "{messages:?}");
    assert_eq!(
        owner_and_epoch(&store, &s.id).await,
        (Some("replica-b".to_owned()), epoch_b)
    );

    // A's heartbeat runs again: it holds nothing; B goes on serving.
    std::fs::remove_file(&heartbeat_gate).unwrap();
    until(
        "A lists no executor of its own",
        Duration::from_secs(30),
        || {
            let mut ca = ca.clone();
            async move {
                let listed = ca
                    .list_replicas(pb::ListReplicasRequest {})
                    .await
                    .unwrap()
                    .into_inner();
                listed
                    .replicas
                    .iter()
                    .any(|r| r.id == "replica-a" && r.owned_executors == 0)
            }
        },
    )
    .await;
    let reply = prompt(&mut cb, &task.id, &s.id, "three").await;
    assert!(reply.contains("turn 3"), "{reply}");
    assert_eq!(prompts(), ["one", "two", "three"]);
    assert_eq!(agentctl_pids(&a.data_dir), agentctls);
    assert_eq!(processes_in("acp-demo-agent", &work), agents);
    drop(a);
    drop(b);
}
