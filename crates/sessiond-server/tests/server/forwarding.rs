//! Any replica answers any call: commands sent to a replica that does not
//! own the session are forwarded to the owner (real PostgreSQL, `sessiond`
//! replicas as child processes, real agentctl and demo agent processes).
//! Each forwarded command runs once, on the owner (the world: one agentctl,
//! one turn in the transcript, one line written by a shell call, the
//! owner's RPC metrics); the owner checks the caller's own credentials; a
//! forwarded call is not forwarded twice; while ownership moves (owner
//! killed, lease not run out) the call is UNAVAILABLE with a retry hint, and
//! after adoption it works.

use std::{path::Path, time::Duration};

use sessiond_proto::sessiond::v1 as pb;
use sessiond_store::{Store, StoreOptions};
use tonic::{Code, Request};

use crate::{
    replicas::{assert_one_each, owner, worktree, world},
    restart::wait_serving,
    support::*,
};

/// A second API token that only some replicas accept.
const OTHER_TOKEN: &str = "other-token-0123456789abcdef";

/// A config with one demo-agent profile `asker` (permission policy `ask`).
fn config(dir: &Path) -> String {
    let path = dir.join("sessiond.toml");
    std::fs::write(
        &path,
        format!(
            "[[agents]]\nname = \"asker\"\ncommand = \"{}\"\npermission_policy = \"ask\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\" }}\n",
            bin("acp-demo-agent").display(),
            dir.join("demo-state").display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// Replica `id` on `db` with `tokens` (comma-separated).
fn replica(root: &Path, id: &str, db: &str, ttl: &str, tokens: &str) -> Server {
    let config = config(root);
    start_env(
        &root.join(id),
        &[
            "--database-url",
            db,
            "--replica-id",
            id,
            "--lease-ttl",
            ttl,
            "--config",
            &config,
        ],
        Some(tokens),
        None,
        &[],
    )
}

async fn with_token(server: &Server, token: &str) -> Sessions {
    sessions_with(server, Some(token)).await
}

fn send_request(task: &str, session: &str, text: &str) -> pb::SendMessageRequest {
    pb::SendMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        content: text.into(),
        ..Default::default()
    }
}

/// (user messages, complete agent text replies) of the transcript.
async fn transcript(c: &mut Sessions, task: &str, session: &str) -> (Vec<String>, Vec<String>) {
    let msgs = messages(c, task, session).await;
    let of = |role: pb::MessageRole| -> Vec<String> {
        msgs.iter()
            .filter(|m| {
                m.role == role as i32 && m.kind == pb::MessageKind::Text as i32 && m.complete
            })
            .map(|m| m.content.clone())
            .collect()
    };
    (of(pb::MessageRole::User), of(pb::MessageRole::Agent))
}

fn metadata<'a>(status: &'a tonic::Status, key: &str) -> &'a str {
    status
        .metadata()
        .get(key)
        .unwrap_or_else(|| panic!("{key} missing: {status:?}"))
        .to_str()
        .unwrap()
}

/// How many calls of `method` the server's RPC metrics counted with `code`.
async fn rpc_count(server: &Server, method: &str, code: &str) -> u64 {
    let text = crate::metrics::http_get(server.metrics.as_ref().unwrap(), "/metrics")
        .await
        .1;
    let needle =
        format!("sessiond_rpc_duration_seconds_count{{method=\"{method}\",code=\"{code}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn commands_sent_to_a_non_owner_replica_run_once_on_the_owner() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    // B accepts a token A does not: the owner checks the caller's own
    // credentials, so a call B lets in can still be refused by A.
    let a = replica(root, "replica-a", db.url(), "30s", TOKEN);
    let b = replica(
        root,
        "replica-b",
        db.url(),
        "30s",
        &format!("{TOKEN},{OTHER_TOKEN}"),
    );
    wait_serving(&a).await;
    wait_serving(&b).await;
    let mut ca = sessions(&a).await;
    let mut cb = sessions(&b).await;
    let work = worktree(root, "w");
    let task = create_task(&mut ca, "forwarding").await;
    let s = create_session(&mut ca, &task.id, &work, "asker").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-a"));
    let agentctls = world(root);
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    assert_one_each(&agentctls);

    // SendMessage on B: forwarded, the turn runs on A once.
    let reply = prompt(&mut cb, &task.id, &s.id, "hello from b").await;
    assert!(reply.contains("turn 1"), "{reply}");
    let (users, agents) = transcript(&mut ca, &task.id, &s.id).await;
    assert_eq!(users, ["hello from b"]);
    assert_eq!(agents.len(), 1, "one turn: {agents:?}");
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/SendMessage", "OK").await,
        1,
        "A ran the forwarded SendMessage"
    );
    assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-a"));

    // The title cleared on B is written on A: A's next turn, started from
    // its own snapshot of the session, names the session by its prompt.
    assert_eq!(title(&mut cb, &task.id, &s.id).await, "hello from b");
    let cleared = cb
        .set_session_title(pb::SetSessionTitleRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            title: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cleared.session.unwrap().title, "");
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/SetSessionTitle", "OK").await,
        1,
        "A wrote the forwarded title"
    );
    assert!(
        prompt(&mut ca, &task.id, &s.id, "named again")
            .await
            .contains("turn 2")
    );
    assert_eq!(title(&mut cb, &task.id, &s.id).await, "named again");

    // A permission asked by the agent, answered on B: forwarded to A, the
    // tool runs once.
    let sent = cb
        .send_message(send_request(&task.id, &s.id, "/edit notes.txt hello"))
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    let asked = wait_for(&mut cb, &s.id, |e| match &e.payload {
        Some(pb::event::Payload::PermissionRequested(pb::PermissionRequested {
            request: Some(r),
        })) if r.turn_id == sent.id => Some(r.clone()),
        _ => None,
    })
    .await;
    assert!(!work.join("notes.txt").exists());
    let answered = cb
        .respond_to_permission(pb::RespondToPermissionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            request_id: asked.request_id.clone(),
            option_id: "allow".into(),
            content_json: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answered.request.unwrap().request_id, asked.request_id);
    let end = turn_end(&mut cb, &s.id, &sent.id).await;
    assert_eq!(end.stop_reason, "end_turn", "{end:?}");
    assert_eq!(
        std::fs::read_to_string(work.join("notes.txt")).unwrap(),
        "hello"
    );
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/RespondToPermission", "OK").await,
        1
    );
    // A bad answer forwarded: the owner's own status comes back unchanged.
    let err = cb
        .respond_to_permission(pb::RespondToPermissionRequest {
            task_id: task.id.clone(),
            session_id: s.id.clone(),
            request_id: asked.request_id.clone(),
            option_id: "allow".into(),
            content_json: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(metadata(&err, "sessiond-error"), "permission_resolved");

    // A shell call on B runs in A's workspace, once.
    let mut wb = workspaces(&b).await;
    let out = wb
        .exec(pb::ExecRequest {
            session: Some(pb::SessionRef {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
            }),
            command: "sh".into(),
            args: vec!["-c".into(), "echo ran >> exec-count; cat exec-count".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");
    assert_eq!(
        std::fs::read_to_string(work.join("exec-count")).unwrap(),
        "ran\n"
    );
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.WorkspaceService/Exec", "OK").await,
        1
    );
    let file = wb
        .read_file(pb::ReadFileRequest {
            session: Some(pb::SessionRef {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
            }),
            path: "notes.txt".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(file.content, b"hello");

    // A token B accepts and A does not: B lets the call in, A refuses it;
    // nothing ran.
    let mut other = with_token(&b, OTHER_TOKEN).await;
    let err = other
        .send_message(send_request(&task.id, &s.id, "not allowed on a"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert_eq!(
        metadata(&err, "sessiond-error"),
        "owner_refused_credentials"
    );
    assert!(err.message().contains("replica-a"), "{err:?}");
    // A client without any valid token never reaches the forwarding path.
    let mut nobody = with_token(&b, "not-a-token-0123456789abcdef").await;
    let err = nobody
        .send_message(send_request(&task.id, &s.id, "nobody"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // A call marked as forwarded that lands on a non-owner is not forwarded
    // again: UNAVAILABLE not_owner with a retry hint.
    let mut marked = Request::new(send_request(&task.id, &s.id, "second hop"));
    marked
        .metadata_mut()
        .insert("sessiond-forwarded-by", "replica-c".parse().unwrap());
    let err = cb.send_message(marked).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(metadata(&err, "sessiond-error"), "not_owner");
    assert_eq!(metadata(&err, "sessiond-owner"), "replica-a");
    assert_eq!(metadata(&err, "sessiond-owner-address"), a.addr);
    assert!(metadata(&err, "retry-after-ms").parse::<u64>().unwrap() > 0);

    // The world: the same single agentctl; the transcript holds exactly the
    // two turns sent through B and the one through A; A ran each
    // SendMessage once.
    assert_eq!(world(root), agentctls);
    let (users, agents) = transcript(&mut ca, &task.id, &s.id).await;
    assert_eq!(
        users,
        ["hello from b", "named again", "/edit notes.txt hello"]
    );
    assert_eq!(agents.len(), 3, "{agents:?}");
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/SendMessage", "OK").await,
        3
    );
    drop(b);
    drop(a);
}

#[tokio::test]
async fn while_ownership_moves_calls_are_retryable_then_work_after_adoption() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    // A TTL far longer than the test: A's lease cannot run out by itself
    // while the first call is in flight.
    let mut a = replica(root, "replica-a", db.url(), "120s", TOKEN);
    let b = replica(root, "replica-b", db.url(), "120s", TOKEN);
    wait_serving(&a).await;
    wait_serving(&b).await;
    let mut ca = sessions(&a).await;
    let mut cb = sessions(&b).await;
    let task = create_task(&mut ca, "moving").await;
    let s = create_session(&mut ca, &task.id, &worktree(root, "w"), "").await;
    assert!(
        prompt(&mut cb, &task.id, &s.id, "one")
            .await
            .contains("turn 1")
    );
    let agentctls = world(root);
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    assert_one_each(&agentctls);

    // The owner dies; its lease still runs.
    a.kill();
    let id = sessiond_domain::SessionId::parse(&s.id).unwrap();
    let lease = store
        .get_executor_for_session(id)
        .await
        .unwrap()
        .unwrap()
        .lease_expires_at
        .unwrap();
    assert!(lease > chrono::Utc::now(), "the lease still runs");
    let err = cb
        .send_message(send_request(&task.id, &s.id, "while moving"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(metadata(&err, "sessiond-error"), "ownership_moving");
    assert_eq!(metadata(&err, "sessiond-owner"), "replica-a");
    let hint: u64 = metadata(&err, "retry-after-ms").parse().unwrap();
    let left = (lease - chrono::Utc::now()).num_milliseconds().max(0) as u64;
    assert!(
        hint >= left && hint <= 121_000 + 1_000,
        "retry-after-ms {hint} is what is left of the lease ({left} ms) plus one round"
    );
    assert!(err.message().contains("ownership is moving"), "{err:?}");
    // A workspace call too.
    let mut wb = workspaces(&b).await;
    let err = wb
        .git_status(pb::GitStatusRequest {
            session: Some(pb::SessionRef {
                task_id: task.id.clone(),
                session_id: s.id.clone(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(metadata(&err, "sessiond-error"), "ownership_moving");
    // Nothing was stored for the refused message.
    let (users, _) = transcript(&mut cb, &task.id, &s.id).await;
    assert_eq!(users, ["one"]);

    // The lease runs out (set expired now, as the TTL would; waiting it out
    // would be a timed guess): the retries, spaced by the hint, work once a
    // replica adopted the session.
    store
        .release_leases("replica-a", chrono::Utc::now())
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    loop {
        match cb
            .send_message(send_request(&task.id, &s.id, "after"))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                assert!(t0.elapsed() < Duration::from_secs(60), "not adopted: {e:?}");
                let hint: u64 = metadata(&e, "retry-after-ms").parse().unwrap();
                tokio::time::sleep(Duration::from_millis(hint.min(500))).await;
            }
        }
    }
    assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-b"));
    let end = wait_for(&mut cb, &s.id, |e| match &e.payload {
        Some(pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) }))
        | Some(pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }))
            if m.role == pb::MessageRole::Agent as i32
                && m.complete
                && m.content.contains("turn 2") =>
        {
            Some(m.content.clone())
        }
        _ => None,
    })
    .await;
    assert!(end.contains("turn 2"), "{end}");
    let (users, agents) = transcript(&mut cb, &task.id, &s.id).await;
    assert_eq!(users, ["one", "after"], "the retried message stored once");
    assert_eq!(agents.len(), 2, "{agents:?}");
    assert_eq!(
        world(root),
        agentctls,
        "adopted by reattaching: the same agentctl"
    );
}

/// Replica `id` on `db` serving TLS with the test PKI's server certificate,
/// trusting `peer_ca` (a file of `pki`) for the other replicas.
fn tls_replica(
    root: &Path,
    id: &str,
    db: &str,
    pki: &crate::security::Pki,
    peer_ca: &str,
) -> Server {
    let config = config(root);
    start_env(
        &root.join(id),
        &[
            "--database-url",
            db,
            "--replica-id",
            id,
            "--lease-ttl",
            "30s",
            "--config",
            &config,
            "--tls-cert",
            &pki.path("server.pem"),
            "--tls-key",
            &pki.path("server.key"),
            "--peer-tls-ca-file",
            &pki.path(peer_ca),
        ],
        Some(TOKEN),
        None,
        &[],
    )
}

/// A channel to a replica serving TLS, trusting the test PKI's CA.
async fn tls_channel(server: &Server, pki: &crate::security::Pki) -> tonic::transport::Channel {
    let ca = std::fs::read(pki.path("ca.pem")).unwrap();
    tonic::transport::Channel::from_shared(format!("https://{}", server.addr))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
        )
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A client of a replica serving TLS, once its recovery pass is done
/// (health SERVING).
async fn tls_sessions(server: &Server, pki: &crate::security::Pki) -> Sessions {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let channel = tls_channel(server, pki).await;
    let health = HealthClient::new(channel.clone());
    crate::replicas::until("health SERVING", Duration::from_secs(60), || {
        let mut health = health.clone();
        async move {
            health
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
        }
    })
    .await;
    pb::session_service_client::SessionServiceClient::with_interceptor(channel, bearer(Some(TOKEN)))
}

#[tokio::test]
async fn replicas_serving_tls_forward_to_each_other_with_the_peer_ca() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let pki = crate::security::Pki::new(root);
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    // A and B trust the CA that signed every replica's certificate; C
    // trusts an unrelated one.
    let a = tls_replica(root, "replica-a", db.url(), &pki, "ca.pem");
    let b = tls_replica(root, "replica-b", db.url(), &pki, "ca.pem");
    let c = tls_replica(root, "replica-c", db.url(), &pki, "other-ca.pem");
    let mut ca = tls_sessions(&a, &pki).await;
    let mut cb = tls_sessions(&b, &pki).await;
    let mut cc = tls_sessions(&c, &pki).await;
    // Replicas serving TLS advertise https addresses.
    let listed = crate::replicas::replicas(&mut cb).await.replicas;
    for (server, id) in [(&a, "replica-a"), (&b, "replica-b"), (&c, "replica-c")] {
        let r = listed.iter().find(|r| r.id == id).unwrap();
        assert_eq!(r.address, format!("https://{}", server.addr), "{r:?}");
    }

    let work = worktree(root, "w");
    let task = create_task(&mut ca, "forwarding over tls").await;
    let s = create_session(&mut ca, &task.id, &work, "asker").await;
    assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
    assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-a"));

    // SendMessage on B: forwarded to A over TLS, the turn runs there once.
    let reply = prompt(&mut cb, &task.id, &s.id, "hello over tls").await;
    assert!(reply.contains("turn 1"), "{reply}");
    let (users, agents) = transcript(&mut ca, &task.id, &s.id).await;
    assert_eq!(users, ["hello over tls"]);
    assert_eq!(agents.len(), 1, "one turn: {agents:?}");
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/SendMessage", "OK").await,
        1,
        "A ran the forwarded SendMessage"
    );
    let agentctls = world(root);
    assert_eq!(agentctls.len(), 1, "{agentctls:?}");
    assert_one_each(&agentctls);

    // C does not trust A's certificate: a clean not_owner naming A and the
    // cause, at once (no hang, no retry loop), and nothing runs.
    let started = std::time::Instant::now();
    let err = cc
        .send_message(send_request(&task.id, &s.id, "from an untrusting replica"))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(metadata(&err, "sessiond-error"), "not_owner");
    assert_eq!(metadata(&err, "sessiond-owner"), "replica-a");
    assert_eq!(
        metadata(&err, "sessiond-owner-address"),
        format!("https://{}", a.addr)
    );
    assert!(
        err.message().contains("not trusted") && err.message().contains("certificate"),
        "{err:?}"
    );
    let (users, agents) = transcript(&mut ca, &task.id, &s.id).await;
    assert_eq!(users, ["hello over tls"]);
    assert_eq!(agents.len(), 1, "{agents:?}");
    assert_eq!(
        rpc_count(&a, "/sessiond.v1.SessionService/SendMessage", "OK").await,
        1,
        "nothing reached A from C"
    );
    assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-a"));
}
