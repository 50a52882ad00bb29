//! Several `sessiond` replicas on one real PostgreSQL (child processes of
//! the real binary, real agentctl and demo agent processes): membership,
//! ownership by lease, adoption after kill -9, the SIGTERM handoff, calls
//! to a replica that does not own the session; and SQLite refusing a
//! second sessiond.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use futures::StreamExt;
use sessiond_proto::sessiond::v1 as pb;
use sessiond_store::{Store, StoreOptions};
use tonic::Code;

use crate::{restart::wait_serving, support::*};

/// A replica's process, its data directory and its id.
pub(crate) struct Replica {
    pub server: Server,
    pub id: String,
}

pub(crate) fn start_replica(root: &Path, id: &str, db: &str, ttl: &str) -> Replica {
    start_replica_with(root, id, db, ttl, &[])
}

/// As [`start_replica`], with more `sessiond serve` arguments.
pub(crate) fn start_replica_with(
    root: &Path,
    id: &str,
    db: &str,
    ttl: &str,
    extra: &[&str],
) -> Replica {
    let mut args = vec!["--database-url", db, "--replica-id", id, "--lease-ttl", ttl];
    args.extend_from_slice(extra);
    let server = start(&root.join(id), &args);
    Replica {
        server,
        id: id.to_owned(),
    }
}

pub(crate) async fn replicas(c: &mut Sessions) -> pb::ListReplicasResponse {
    c.list_replicas(pb::ListReplicasRequest {})
        .await
        .unwrap()
        .into_inner()
}

pub(crate) async fn owner(store: &Store, session: &str) -> Option<String> {
    let id = sessiond_domain::SessionId::parse(session).unwrap();
    store
        .get_executor_for_session(id)
        .await
        .unwrap()
        .and_then(|r| r.owner_id)
}

/// Polls (bounded) until `f` holds.
pub(crate) async fn until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One process of the world: its parent and its command line.
struct Proc {
    ppid: u32,
    args: Vec<String>,
}

/// Every live (not zombie) process, by pid, from /proc.
fn processes() -> HashMap<u32, Proc> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmdline), Ok(stat)) = (
            std::fs::read(entry.path().join("cmdline")),
            std::fs::read_to_string(entry.path().join("stat")),
        ) else {
            continue;
        };
        // After the command's ")": state, then the parent's pid.
        let mut fields = stat.rsplit(')').next().unwrap_or("").split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let Some(ppid) = fields.next().and_then(|p| p.parse().ok()) else {
            continue;
        };
        if state == "Z" || state == "X" {
            continue;
        }
        let args = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        out.insert(pid, Proc { ppid, args });
    }
    out
}

/// The processes of one executor: its agentctls (exactly one when all is
/// well) and the agents those run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct ExecutorProcs {
    pub agentctls: Vec<u32>,
    pub agents: Vec<u32>,
}

/// agentctl processes per executor id (from their command lines) of the
/// replicas under `root`, every data directory together, with the agent
/// processes each runs: the world, not the database.
pub(crate) fn world(root: &Path) -> BTreeMap<String, ExecutorProcs> {
    let root = root.display().to_string();
    let procs = processes();
    let mut out: BTreeMap<String, ExecutorProcs> = BTreeMap::new();
    for (pid, p) in &procs {
        if !p.args.first().is_some_and(|a| a.ends_with("agentctl"))
            || !p.args.iter().any(|a| a.contains(&root))
        {
            continue;
        }
        let Some(i) = p.args.iter().position(|a| a == "--executor-id") else {
            continue;
        };
        let e = out.entry(p.args[i + 1].clone()).or_default();
        e.agentctls.push(*pid);
        e.agents.extend(procs.iter().filter_map(|(child, c)| {
            (c.ppid == *pid && c.args.iter().any(|a| a.contains("acp-demo-agent")))
                .then_some(*child)
        }));
    }
    for e in out.values_mut() {
        e.agentctls.sort_unstable();
        e.agents.sort_unstable();
    }
    out
}

/// Asserts one agentctl and one agent per executor in `w`.
pub(crate) fn assert_one_each(w: &BTreeMap<String, ExecutorProcs>) {
    for (executor, p) in w {
        assert!(
            p.agentctls.len() == 1 && p.agents.len() == 1,
            "executor {executor}: not exactly one agentctl running one agent: {p:?}"
        );
    }
}

pub(crate) fn not_owner(status: &tonic::Status) -> (String, String) {
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let md = status.metadata();
    assert_eq!(
        md.get("sessiond-error").unwrap().to_str().unwrap(),
        "not_owner"
    );
    (
        md.get("sessiond-owner")
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned(),
        md.get("sessiond-owner-address")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default(),
    )
}

pub(crate) async fn send(
    c: &mut Sessions,
    task: &str,
    session: &str,
    text: &str,
) -> Result<(), tonic::Status> {
    c.send_message(pb::SendMessageRequest {
        task_id: task.into(),
        session_id: session.into(),
        content: text.into(),
        ..Default::default()
    })
    .await
    .map(|_| ())
}

/// Watches a session from the start on the replica at `addr` until an
/// agent reply containing `until` is complete; returns the seqs it saw.
pub(crate) async fn watch_until_turn(
    addr: &str,
    task: &str,
    session: &str,
    until: &str,
) -> Vec<i64> {
    let _ = task;
    let mut c = sessions_at(addr).await;
    let mut stream = c
        .watch_session(pb::WatchSessionRequest {
            session_id: session.into(),
            after_seq: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut seqs = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        seqs.push(event.seq);
        if let Some(
            pb::event::Payload::MessageUpdated(pb::MessageUpdated { message: Some(m) })
            | pb::event::Payload::MessageAdded(pb::MessageAdded { message: Some(m) }),
        ) = event.payload
            && m.role == pb::MessageRole::Agent as i32
            && m.complete
            && m.content.contains(until)
        {
            return seqs;
        }
    }
    panic!("the watch on {addr} ended before {until:?}: {seqs:?}");
}

pub(crate) fn worktree(root: &Path, name: &str) -> PathBuf {
    let w = root.join("work").join(name);
    std::fs::create_dir_all(&w).unwrap();
    w
}

/// Sessions each replica of the kill test creates.
const PER_REPLICA: usize = 10;

/// Runs `f` over `items`, at most `n` at once; the results in input order.
pub(crate) async fn bounded<T, R, F, Fut>(n: usize, items: Vec<T>, f: F) -> Vec<R>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = R>,
{
    futures::stream::iter(items.into_iter().map(f))
        .buffered(n)
        .collect()
        .await
}

#[tokio::test]
async fn three_replicas_adopt_the_sessions_of_one_killed_with_sigkill() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    // A TTL a loaded machine's heartbeats (every third of it) keep up with.
    let mut a = start_replica(root, "replica-a", db.url(), "3s");
    let b = start_replica(root, "replica-b", db.url(), "3s");
    let c = start_replica(root, "replica-c", db.url(), "3s");
    for r in [&a, &b, &c] {
        wait_serving(&r.server).await;
    }
    let ca = sessions(&a.server).await;
    let mut cb = sessions(&b.server).await;
    let mut cc = sessions(&c.server).await;

    // 30 sessions across the replicas, each owned by the one that created
    // it; a few creates and first turns at once (each launches an agentctl
    // and its agent).
    let task = create_task(&mut ca.clone(), "replicas").await;
    let plan: Vec<(Sessions, String, PathBuf)> = [(&ca, &a), (&cb, &b), (&cc, &c)]
        .into_iter()
        .flat_map(|(client, r)| {
            (0..PER_REPLICA).map(move |j| {
                (
                    client.clone(),
                    r.id.clone(),
                    worktree(root, &format!("{}-{j:02}", r.id)),
                )
            })
        })
        .collect();
    let task_id = task.id.clone();
    let created: Vec<(String, String)> = bounded(6, plan, |(mut client, r, w)| {
        let task = task_id.clone();
        async move {
            let s = create_session(&mut client, &task, &w, "").await;
            assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
            let reply = prompt(&mut client, &task, &s.id, "hello").await;
            assert!(reply.contains("turn 1"), "{reply}");
            (s.id, r)
        }
    })
    .await; // (session, owner)
    for (s, r) in &created {
        assert_eq!(owner(&store, s).await.as_ref(), Some(r));
    }
    let listed = replicas(&mut cc).await;
    assert_eq!(listed.self_id, "replica-c");
    let ids: Vec<&str> = listed.replicas.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["replica-a", "replica-b", "replica-c"]);
    for r in &listed.replicas {
        assert!(r.live, "{r:?}");
        assert_eq!(r.owned_executors, PER_REPLICA as i64, "{r:?}");
    }
    assert_eq!(
        listed.replicas[0].address, a.server.addr,
        "the advertised address defaults to the listen address"
    );

    // A command that another replica already forwarded, landing on one
    // that does not own the session, is not forwarded again: a clean
    // retryable error naming the owner and where it is (forwarding itself:
    // forwarding.rs).
    let (s_a, _) = created[0].clone();
    let mut hop = tonic::Request::new(pb::SendMessageRequest {
        task_id: task.id.clone(),
        session_id: s_a.clone(),
        content: "wrong replica".into(),
        ..Default::default()
    });
    hop.metadata_mut()
        .insert("sessiond-forwarded-by", "replica-c".parse().unwrap());
    let err = cb.send_message(hop).await.unwrap_err();
    let (named, address) = not_owner(&err);
    assert_eq!(named, "replica-a");
    assert_eq!(address, a.server.addr);
    // Reads answer on any replica.
    let st = cb
        .get_session_status(pb::GetSessionStatusRequest {
            task_id: task.id.clone(),
            session_id: s_a.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.is_agent_running, "{st:?}");

    let a_sessions: Vec<String> = created
        .iter()
        .filter(|(_, o)| o == "replica-a")
        .map(|(s, _)| s.clone())
        .collect();
    assert_eq!(a_sessions.len(), PER_REPLICA);
    // Watchers of every session of A, on B and on C: whichever adopts one,
    // the other sees the new owner's commits from another replica.
    let watchers: Vec<_> = a_sessions
        .iter()
        .flat_map(|s| [(s.clone(), &b), (s.clone(), &c)])
        .map(|(session, r)| {
            let addr = r.server.addr.clone();
            let task = task.id.clone();
            tokio::spawn(async move {
                let seqs = watch_until_turn(&addr, &task, &session, "turn 2").await;
                (session, addr, seqs)
            })
        })
        .collect();

    let before = world(root);
    assert_eq!(
        before.len(),
        3 * PER_REPLICA,
        "one agentctl per session: {before:?}"
    );
    assert_one_each(&before);

    // kill -9 replica A: its sessions go to B and C within the TTL plus
    // their recovery (a reattach: the agentctls outlive A).
    a.server.kill();
    let killed = Instant::now();
    until("A's sessions adopted", Duration::from_secs(90), || {
        let store = store.clone();
        let a_sessions = a_sessions.clone();
        async move {
            for s in &a_sessions {
                match owner(&store, s).await.as_deref() {
                    Some("replica-b" | "replica-c") => {}
                    _ => return false,
                }
            }
            true
        }
    })
    .await;
    let adopted_in = killed.elapsed();
    let listed = replicas(&mut cb).await;
    let gone = listed
        .replicas
        .iter()
        .find(|r| r.id == "replica-a")
        .unwrap();
    assert!(!gone.live, "{gone:?}");
    assert_eq!(gone.owned_executors, 0, "{gone:?}");
    assert_eq!(
        listed
            .replicas
            .iter()
            .map(|r| r.owned_executors)
            .sum::<i64>(),
        3 * PER_REPLICA as i64,
        "every session owned exactly once: {listed:?}"
    );
    let mut by_adopter: BTreeMap<String, usize> = BTreeMap::new();
    for s in &a_sessions {
        *by_adopter
            .entry(owner(&store, s).await.unwrap())
            .or_default() += 1;
    }
    println!(
        "kill test: {} sessions of replica-a adopted {:.1} s after its kill -9 (lease TTL 3 s): {by_adopter:?}",
        a_sessions.len(),
        adopted_in.as_secs_f64()
    );

    // The world: still exactly one agentctl running one agent per
    // executor, the same processes.
    assert_eq!(
        world(root),
        before,
        "adoption reattached, nothing launched twice"
    );

    // The conversations continue, every one on its owner now (A's on
    // whichever replica took each).
    let task_id = task.id.clone();
    let store2 = store.clone();
    let (cb2, cc2) = (cb.clone(), cc.clone());
    bounded(6, created.clone(), |(s, _)| {
        let (task, store) = (task_id.clone(), store2.clone());
        let (cb, cc) = (cb2.clone(), cc2.clone());
        async move {
            let mut client = match owner(&store, &s).await.as_deref() {
                Some("replica-b") => cb,
                Some("replica-c") => cc,
                other => panic!("session {s} owned by {other:?}"),
            };
            let reply = prompt(&mut client, &task, &s, "again").await;
            assert!(reply.contains("turn 2"), "{s}: {reply}");
        }
    })
    .await;
    // Every event of A's sessions, committed by A and then by its adopter,
    // reached both watchers in seq order: no gap, no duplicate.
    for w in watchers {
        let (session, addr, seqs) = tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("the watcher saw turn 2")
            .unwrap();
        let expected: Vec<i64> = (1..=*seqs.last().unwrap()).collect();
        assert_eq!(seqs, expected, "session {session} watched on {addr}");
    }
    // And B's and C's own sessions were never touched by the adoption.
    for (s, o) in created.iter().filter(|(_, o)| o != "replica-a") {
        assert_eq!(owner(&store, s).await.as_ref(), Some(o));
    }
    assert_eq!(world(root), before);
    drop(b);
    drop(c);
}

/// SIGTERM of a replica hands its sessions over at once: it is no longer
/// listed live, and both survivors, told of the release, take a share
/// (the first to look used to take them all, its stopped peer counted live).
#[tokio::test]
async fn sigterm_hands_sessions_over_without_waiting_for_the_ttl() {
    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(2))
        .await
        .unwrap();
    // A TTL far longer than the handoff may take.
    let mut a = start_replica(root, "replica-a", db.url(), "60s");
    let b = start_replica(root, "replica-b", db.url(), "60s");
    let c = start_replica(root, "replica-c", db.url(), "60s");
    wait_serving(&a.server).await;
    wait_serving(&b.server).await;
    wait_serving(&c.server).await;
    let mut ca = sessions(&a.server).await;
    let task = create_task(&mut ca, "handoff").await;
    let mut created = Vec::new();
    for i in 0..6 {
        let s = create_session(&mut ca, &task.id, &worktree(root, &format!("w{i}")), "").await;
        assert_eq!(owner(&store, &s.id).await.as_deref(), Some("replica-a"));
        created.push(s);
    }
    let s = created[0].clone();
    assert!(
        prompt(&mut ca, &task.id, &s.id, "hi")
            .await
            .contains("turn 1")
    );
    let pids = world(root);

    let stopped = Instant::now();
    assert!(a.server.terminate().success());
    let gone = store.list_replicas(chrono::Utc::now()).await.unwrap();
    let a_row = gone.iter().find(|r| r.id == "replica-a").unwrap();
    assert!(!a_row.is_live(chrono::Utc::now()), "{a_row:?}");
    until(
        "B and C adopted A's sessions",
        Duration::from_secs(30),
        || {
            let store = store.clone();
            let ids: Vec<String> = created.iter().map(|s| s.id.clone()).collect();
            async move {
                for id in ids {
                    if owner(&store, &id)
                        .await
                        .as_deref()
                        .is_none_or(|o| o == "replica-a")
                    {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    assert!(
        stopped.elapsed() < Duration::from_secs(60),
        "handed over before the TTL could run out"
    );
    let mut owners = Vec::new();
    for s in &created {
        owners.push(owner(&store, &s.id).await.unwrap());
    }
    for survivor in ["replica-b", "replica-c"] {
        assert!(
            owners.iter().any(|o| o == survivor),
            "{survivor} took none: {owners:?}"
        );
    }
    let on = owner(&store, &s.id).await.unwrap();
    let mut cs = sessions(if on == "replica-b" {
        &b.server
    } else {
        &c.server
    })
    .await;
    assert!(
        prompt(&mut cs, &task.id, &s.id, "on a survivor")
            .await
            .contains("turn 2")
    );
    assert_eq!(world(root), pids, "the same agentctls, reattached");
    drop(b);
    drop(c);
}

/// A start right after `kill -9` of the last sessiond finds its lock still
/// held while the kernel tears the killed process down: it waits for it
/// (briefly) instead of refusing. Here a lock held for 0.5 s stands for it.
#[tokio::test]
async fn a_start_waits_for_the_lock_of_a_sessiond_still_dying() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let lock = std::fs::File::create(data.join("sessiond.sqlite3.lock")).unwrap();
    lock.lock().unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        drop(lock);
    });
    let server = start(&data, &[]);
    wait_serving(&server).await;
    release.join().unwrap();
}

#[tokio::test]
async fn a_second_sessiond_on_one_sqlite_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut first = start(&data, &[]);
    wait_serving(&first).await;
    let (ok, stderr) = run_sessiond(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[("SESSIOND_API_TOKENS", TOKEN)],
    );
    assert!(!ok, "a second sessiond on the same SQLite file started");
    assert!(
        stderr.contains("is in use by another sessiond")
            && stderr.contains("SQLite serves one sessiond at a time")
            && stderr.contains(&format!("pid {}", first.child.as_ref().unwrap().id())),
        "{stderr}"
    );
    // One replica, listed with what it runs.
    let mut c = sessions(&first).await;
    let work = worktree(dir.path(), "w");
    let task = create_task(&mut c, "sqlite").await;
    create_session(&mut c, &task.id, &work, "").await;
    let listed = replicas(&mut c).await;
    assert_eq!(listed.replicas.len(), 1, "{listed:?}");
    assert_eq!(listed.replicas[0].id, listed.self_id);
    assert_eq!(listed.replicas[0].owned_executors, 1);
    let out = Command::new(bin("sessionctl"))
        .args(["--addr", &format!("http://{}", first.addr), "replicas"])
        .env("SESSIOND_TOKEN", TOKEN)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&listed.self_id) && text.contains("yes"),
        "{text}"
    );
    // The lock dies with its process: kill -9, and a new one starts.
    first.kill();
    let second = start(&data, &[]);
    wait_serving(&second).await;
}
