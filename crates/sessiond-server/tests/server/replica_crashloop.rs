//! The crash loop across replicas: three `sessiond` child processes on one
//! real PostgreSQL, sessions spread over them (real agentctl and agent
//! processes), prompts flowing to every session all along, and round after
//! round one replica killed with SIGKILL and started again (same id, same
//! data directory).
//!
//! - Each kill is aimed at a condition, not a time: the victim is drawn
//!   (seeded) among the replicas that own a session whose turn is in flight
//!   (RUNNING in the database) when the round starts.
//! - The victim comes back either at once (it takes its own executors back
//!   before their leases expire) or only once the survivors adopted all of
//!   them (seeded coin).
//! - A round ends when every session answered at least one more prompt
//!   after the kill: nothing stays stuck with a dead owner.
//! - Prompts go to the session's owner (read from the database) or, while
//!   the owner is dead, to any live replica; UNAVAILABLE (`ownership_moving`
//!   while the lease has not run out, or a replica that went away) is retried
//!   with a new prompt. A call cut by the kill of its replica has an
//!   unknown outcome. Every prompt has a text of its own, so the checks
//!   tell them apart.
//!
//! At the end, against the world and the outbox: exactly one agentctl
//! running one agent per session (/proc); every prompt that got OK stored
//! once, run by the agent once (its side-effect file) and answered once at
//! the right turn (the agent numbers turns from its own transcript); a
//! prompt without OK at most once, and never answered without being
//! stored; no interrupted turn (agentctl never died); gap-free seqs of
//! every session's events and messages and of the task's events; every
//! executor owned by exactly one live replica; and one more turn on every
//! session.
//!
//! `SESSIOND_REPLICA_CRASHLOOP_ROUNDS` (default 6) sets the number of
//! kills, `SESSIOND_REPLICA_CRASHLOOP_SEED` replays a run (the seed is
//! printed).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use sessiond_domain::{MessageKind, MessageRole, SessionId, SessionState, TaskId};
use sessiond_proto::sessiond::v1 as pb;
use sessiond_store::{Store, StoreOptions};
use tonic::Code;

use crate::{
    replicas::{
        Replica, assert_one_each, bounded, replicas, send, start_replica_with, until, worktree,
        world,
    },
    restart::wait_serving,
    support::*,
};

const SESSIONS: usize = 12;
const REPLICAS: [&str; 3] = ["replica-a", "replica-b", "replica-c"];
const TTL: &str = "2s";
/// The agent's side-effect log, in each session's worktree.
const SIDE_EFFECTS: &str = "side-effects.txt";

/// SplitMix64: a small seeded generator, enough for a kill schedule.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn pick<'a, T>(&mut self, from: &'a [T]) -> &'a T {
        &from[(self.next() % from.len() as u64) as usize]
    }
}

/// The replicas serving now (id → address), and how many times each was
/// killed: a replica leaves `live` and its generation moves before it is
/// killed, so a call sees whether its replica died under it.
#[derive(Default)]
struct Fleet {
    live: BTreeMap<String, String>,
    generation: HashMap<String, u64>,
}

type SharedFleet = Arc<Mutex<Fleet>>;

fn generation(fleet: &SharedFleet, id: &str) -> u64 {
    fleet
        .lock()
        .unwrap()
        .generation
        .get(id)
        .copied()
        .unwrap_or(0)
}

/// What one session's prompter sent: `ok` got OK; `unknown` were cut by
/// the kill of their replica or refused (UNAVAILABLE).
#[derive(Default, Debug)]
struct Sent {
    ok: Vec<String>,
    unknown: Vec<String>,
    refused: u32,
}

/// Prompts `session` whenever it waits for input, until `stop`.
async fn prompter(
    store: Store,
    fleet: SharedFleet,
    task: String,
    session: String,
    name: String,
    mut rng: Rng,
    stop: Arc<AtomicBool>,
) -> Sent {
    let sid = SessionId::parse(&session).unwrap();
    let mut sent = Sent::default();
    let mut clients: HashMap<String, (u64, Sessions)> = HashMap::new();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let s = store.get_session(sid).await.unwrap();
        match s.state {
            SessionState::WaitingForInput => {}
            SessionState::Running | SessionState::Starting => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            other => panic!("{name}: session {session} went {other:?}: {s:?}"),
        }
        let owner = store
            .get_executor_for_session(sid)
            .await
            .unwrap()
            .and_then(|r| r.owner_id);
        // The owner when it runs, else any live replica (which claims the
        // lease once it ran out, or answers ownership_moving).
        let target = {
            let f = fleet.lock().unwrap();
            let live: Vec<(&String, &String)> = f.live.iter().collect();
            match owner.as_ref().and_then(|o| f.live.get_key_value(o)) {
                Some((id, addr)) => Some((id.clone(), addr.clone())),
                None if live.is_empty() => None,
                None => {
                    let (id, addr) = *rng.pick(&live);
                    Some((id.clone(), addr.clone()))
                }
            }
        };
        let Some((target, addr)) = target else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let generation_before = generation(&fleet, &target);
        let client = match clients.get(&target) {
            Some((g, c)) if *g == generation_before => Some(c.clone()),
            _ => match try_sessions_at(&addr).await {
                Ok(c) => {
                    clients.insert(target.clone(), (generation_before, c.clone()));
                    Some(c)
                }
                Err(e) => {
                    assert_ne!(
                        generation(&fleet, &target),
                        generation_before,
                        "{name}: cannot connect to live {target} at {addr}: {e}"
                    );
                    None
                }
            },
        };
        let Some(mut client) = client else {
            continue;
        };
        n += 1;
        let text = format!("{name} prompt {n}");
        let result = tokio::time::timeout(
            Duration::from_secs(60),
            send(&mut client, &task, &session, &text),
        )
        .await;
        let killed_meanwhile = generation(&fleet, &target) != generation_before;
        match result {
            Ok(Ok(())) => sent.ok.push(text),
            Ok(Err(_)) | Err(_) if killed_meanwhile => sent.unknown.push(text),
            Ok(Err(status)) if status.code() == Code::Unavailable => {
                // Ownership is moving: retry (a new prompt) in a moment.
                sent.unknown.push(text);
                sent.refused += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(status)) => {
                panic!("{name}: {text:?} to {target} (live all along): {status:?}")
            }
            Err(_) => panic!("{name}: {text:?} to {target} (live all along): no answer in 60 s"),
        }
    }
    sent
}

/// Complete agent replies per session (the progress of a round).
async fn replies(store: &Store, sessions: &[String]) -> Vec<usize> {
    let mut out = Vec::with_capacity(sessions.len());
    for s in sessions {
        let msgs = store
            .list_messages(SessionId::parse(s).unwrap(), 0, u32::MAX)
            .await
            .unwrap();
        out.push(
            msgs.iter()
                .filter(|m| m.role == MessageRole::Agent && m.kind == MessageKind::Text)
                .filter(|m| m.complete)
                .count(),
        );
    }
    out
}

/// Live replicas owning a session whose turn is in flight.
async fn owners_of_running_turns(store: &Store, task: TaskId, fleet: &SharedFleet) -> Vec<String> {
    let live: Vec<String> = fleet.lock().unwrap().live.keys().cloned().collect();
    let mut out = Vec::new();
    for s in store.list_sessions(task).await.unwrap() {
        if s.state != SessionState::Running {
            continue;
        }
        if let Some(o) = store
            .get_executor_for_session(s.id)
            .await
            .unwrap()
            .and_then(|r| r.owner_id)
            && live.contains(&o)
            && !out.contains(&o)
        {
            out.push(o);
        }
    }
    out.sort();
    out
}

fn env_or<T: std::str::FromStr>(name: &str, default: impl FnOnce() -> T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}: cannot parse {v:?}")),
        Err(_) => default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_after_a_crash_loop_of_kill_9() {
    let rounds: u32 = env_or("SESSIOND_REPLICA_CRASHLOOP_ROUNDS", || 6);
    let seed: u64 = env_or("SESSIOND_REPLICA_CRASHLOOP_SEED", || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    println!(
        "replica crash loop: seed {seed} (replay with SESSIOND_REPLICA_CRASHLOOP_SEED={seed}), {rounds} rounds"
    );
    let mut rng = Rng(seed);

    let db = sessiond_testkit::postgres::test_database();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = Store::connect(db.url(), StoreOptions::default().max_connections(4))
        .await
        .unwrap();
    // The demo agent appends every prompt to its worktree's side-effect log
    // before answering, and streams its reply slowly enough for a turn to be
    // in flight when a kill comes.
    let config = root.join("sessiond.toml");
    std::fs::write(
        &config,
        format!(
            "[[agents]]\nname = \"side\"\ncommand = \"{}\"\n\
             env = {{ ACP_DEMO_STATE_DIR = \"{}\", ACP_DEMO_SIDE_EFFECT_FILE = \"{SIDE_EFFECTS}\", \
             ACP_DEMO_CHUNK_DELAY_MS = \"100\" }}\n",
            bin("acp-demo-agent").display(),
            root.join("demo-state").display(),
        ),
    )
    .unwrap();
    let config = config.display().to_string();
    let launch = |id: &str| start_replica_with(root, id, db.url(), TTL, &["--config", &config]);

    let fleet: SharedFleet = Arc::default();
    let mut running: BTreeMap<String, Replica> = BTreeMap::new();
    for id in REPLICAS {
        let r = launch(id);
        wait_serving(&r.server).await;
        let mut f = fleet.lock().unwrap();
        f.live.insert(id.to_owned(), r.server.addr.clone());
        f.generation.insert(id.to_owned(), 0);
        running.insert(id.to_owned(), r);
    }
    let clients: Vec<Sessions> = {
        let mut v = Vec::new();
        for r in running.values() {
            v.push(sessions(&r.server).await);
        }
        v
    };
    let task = create_task(&mut clients[0].clone(), "replica crash loop").await;
    let task_id = TaskId::parse(&task.id).unwrap();
    let plan: Vec<(Sessions, String)> = (0..SESSIONS)
        .map(|i| (clients[i % clients.len()].clone(), format!("s{i:02}")))
        .collect();
    let t = task.id.clone();
    let created: Vec<(String, String)> = bounded(4, plan, |(mut c, name)| {
        let w = worktree(root, &name);
        let t = t.clone();
        async move {
            let s = create_session(&mut c, &t, &w, "side").await;
            assert_eq!(s.state, pb::SessionState::WaitingForInput as i32, "{s:?}");
            (s.id, name)
        }
    })
    .await;
    let session_ids: Vec<String> = created.iter().map(|(s, _)| s.clone()).collect();
    let first_world = world(root);
    assert_eq!(first_world.len(), SESSIONS, "{first_world:?}");
    assert_one_each(&first_world);

    let stop = Arc::new(AtomicBool::new(false));
    let prompters: Vec<_> = created
        .iter()
        .map(|(s, name)| {
            tokio::spawn(prompter(
                store.clone(),
                fleet.clone(),
                task.id.clone(),
                s.clone(),
                name.clone(),
                Rng(rng.next()),
                stop.clone(),
            ))
        })
        .collect();
    // A prompter that panicked fails the test at once, not at the end.
    let check_prompters = |prompters: &[tokio::task::JoinHandle<Sent>]| {
        assert!(
            !prompters.iter().any(|p| p.is_finished()),
            "a prompter stopped early (it panicked; see above)"
        );
    };

    let started = Instant::now();
    let (mut at_once, mut after_adoption) = (0, 0);
    let mut adoption_times = Vec::new();
    for round in 1..=rounds {
        // Aim: a replica owning a session with a turn in flight.
        let mut candidates = Vec::new();
        let aim = Instant::now();
        while candidates.is_empty() {
            check_prompters(&prompters);
            assert!(
                aim.elapsed() < Duration::from_secs(60),
                "round {round}: no turn in flight on any replica for 60 s (seed {seed})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
            candidates = owners_of_running_turns(&store, task_id, &fleet).await;
        }
        let victim = rng.pick(&candidates).clone();
        let owned_by_victim: Vec<String> = {
            let mut v = Vec::new();
            for s in &session_ids {
                if crate::replicas::owner(&store, s).await.as_deref() == Some(victim.as_str()) {
                    v.push(s.clone());
                }
            }
            v
        };
        let progress_at_kill = replies(&store, &session_ids).await;
        {
            let mut f = fleet.lock().unwrap();
            f.live.remove(&victim);
            *f.generation.get_mut(&victim).unwrap() += 1;
        }
        let mut dead = running.remove(&victim).unwrap();
        dead.server.kill();
        // Its agentctls live on; the next process of this replica (or an
        // adopter) reattaches them, so its drop must not kill them.
        dead.server.data_dir = root.join("no-such-replica");
        drop(dead);
        let killed = Instant::now();

        let restart_at_once = rng.next().is_multiple_of(2);
        if restart_at_once {
            at_once += 1;
        } else {
            after_adoption += 1;
            until(
                &format!("round {round}: {victim}'s sessions adopted (seed {seed})"),
                Duration::from_secs(60),
                || {
                    let (store, victim, sessions) =
                        (store.clone(), victim.clone(), owned_by_victim.clone());
                    async move {
                        for s in &sessions {
                            let o = crate::replicas::owner(&store, s).await;
                            if o.is_none() || o.as_deref() == Some(victim.as_str()) {
                                return false;
                            }
                        }
                        true
                    }
                },
            )
            .await;
            adoption_times.push(killed.elapsed());
        }
        let r = launch(&victim);
        wait_serving(&r.server).await;
        fleet
            .lock()
            .unwrap()
            .live
            .insert(victim.clone(), r.server.addr.clone());
        running.insert(victim.clone(), r);

        // Every conversation moves on after the kill.
        let t = Instant::now();
        loop {
            check_prompters(&prompters);
            let now = replies(&store, &session_ids).await;
            if now.iter().zip(&progress_at_kill).all(|(n, b)| n > b) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "round {round}: some session answered nothing for 120 s after {victim} was killed \
                 (seed {seed}): replies {progress_at_kill:?} -> {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "replica crash loop: round {round}: killed {victim} (owning {} sessions) with turns in flight, \
             restarted {}; every session answered again {:.1} s after the kill",
            owned_by_victim.len(),
            if restart_at_once {
                "at once"
            } else {
                "after adoption"
            },
            killed.elapsed().as_secs_f64()
        );
    }
    stop.store(true, Ordering::Relaxed);
    let mut sent = Vec::new();
    for p in prompters {
        sent.push(p.await.expect("prompter"));
    }
    let elapsed = started.elapsed();

    // Quiet: every session waits for input.
    until("every session idle", Duration::from_secs(60), || {
        let store = store.clone();
        async move {
            store
                .list_sessions(task_id)
                .await
                .unwrap()
                .iter()
                .all(|s| s.state == SessionState::WaitingForInput)
        }
    })
    .await;

    // The world: one agentctl running one agent per session, nothing twice.
    let last_world = world(root);
    assert_eq!(last_world.len(), SESSIONS, "{last_world:?}");
    assert_one_each(&last_world);
    let relaunched = last_world
        .iter()
        .filter(|(e, p)| first_world.get(*e) != Some(*p))
        .count();

    // Ownership: every executor held by exactly one live replica.
    let mut c = sessions(&running["replica-a"].server).await;
    let listed = replicas(&mut c).await;
    assert!(listed.replicas.iter().all(|r| r.live), "{listed:?}");
    assert_eq!(
        listed
            .replicas
            .iter()
            .map(|r| r.owned_executors)
            .sum::<i64>(),
        SESSIONS as i64,
        "{listed:?}"
    );

    // Messages and events, session by session.
    let (mut oks, mut unknown, mut refused, mut stored_unknown) = (0, 0, 0u32, 0);
    for ((session, name), sent) in created.iter().zip(&sent) {
        let sid = SessionId::parse(session).unwrap();
        let msgs = store.list_messages(sid, 0, u32::MAX).await.unwrap();
        let seqs: Vec<i64> = msgs.iter().map(|m| m.seq).collect();
        assert_eq!(
            seqs,
            (1..=msgs.len() as i64).collect::<Vec<_>>(),
            "{name}: message seqs"
        );
        // Turns: a user message, then exactly one complete reply.
        let mut turns: Vec<(String, Vec<String>)> = Vec::new();
        for m in &msgs {
            match (m.role, m.kind) {
                (MessageRole::User, MessageKind::Text) => turns.push((m.content.clone(), vec![])),
                (MessageRole::Agent, MessageKind::Text) => {
                    assert!(m.complete, "{name}: an incomplete reply: {m:?}");
                    turns
                        .last_mut()
                        .unwrap_or_else(|| panic!("{name}: a reply before any prompt: {m:?}"))
                        .1
                        .push(m.content.clone());
                }
                (MessageRole::System, _) => panic!("{name}: a system note: {:?}", m.content),
                _ => {}
            }
        }
        let stored: Vec<&String> = turns.iter().map(|(u, _)| u).collect();
        for (i, (user, answers)) in turns.iter().enumerate() {
            assert_eq!(
                answers.len(),
                1,
                "{name}: prompt {user:?} answered {} times: {answers:?}",
                answers.len()
            );
            let want = format!("turn {} of session", i + 1);
            assert!(
                answers[0].contains(&want) && answers[0].contains(&format!("you said \"{user}\"")),
                "{name}: prompt {user:?} (turn {}) answered {:?}",
                i + 1,
                answers[0]
            );
            assert!(
                sent.ok.contains(user) || sent.unknown.contains(user),
                "{name}: stored a prompt nobody sent: {user:?}"
            );
        }
        for text in &sent.ok {
            assert_eq!(
                stored.iter().filter(|u| **u == text).count(),
                1,
                "{name}: prompt {text:?} got OK: stored once"
            );
        }
        for text in &sent.unknown {
            let n = stored.iter().filter(|u| **u == text).count();
            assert!(n <= 1, "{name}: prompt {text:?} stored {n} times");
            stored_unknown += n;
        }
        // The agent ran each stored prompt once, in order: its side effects.
        let side = std::fs::read_to_string(root.join("work").join(name).join(SIDE_EFFECTS))
            .unwrap_or_default();
        let ran: Vec<&str> = side.lines().collect();
        assert_eq!(
            ran,
            stored.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
            "{name}: what the agent ran vs what was stored"
        );
        // The outbox: gap-free, no duplicate.
        let events = store.events_after(sid, 0, u32::MAX).await.unwrap();
        let eseqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(
            eseqs,
            (1..=events.len() as i64).collect::<Vec<_>>(),
            "{name}: event seqs"
        );
        assert_eq!(store.last_event_seq(sid).await.unwrap(), eseqs.len() as i64);
        oks += sent.ok.len();
        unknown += sent.unknown.len();
        refused += sent.refused;
    }
    let task_events = store.task_events_after(task_id, 0, u32::MAX).await.unwrap();
    let tseqs: Vec<i64> = task_events.iter().map(|e| e.task_seq).collect();
    assert_eq!(
        tseqs,
        (1..=task_events.len() as i64).collect::<Vec<_>>(),
        "task event seqs"
    );

    // And every conversation goes on, on its owner, at the right turn.
    let mut by_replica: HashMap<String, Sessions> = HashMap::new();
    for (id, r) in &running {
        by_replica.insert(id.clone(), sessions(&r.server).await);
    }
    for (session, name) in &created {
        let o = crate::replicas::owner(&store, session).await.unwrap();
        let turns = store
            .list_messages(SessionId::parse(session).unwrap(), 0, u32::MAX)
            .await
            .unwrap()
            .iter()
            .filter(|m| m.role == MessageRole::User)
            .count();
        let mut c = by_replica[&o].clone();
        let reply = prompt(&mut c, &task.id, session, "last").await;
        assert!(
            reply.contains(&format!("turn {} of session", turns + 1)),
            "{name}: {reply}"
        );
    }
    println!(
        "replica crash loop: {rounds} kills in {:.1} s ({at_once} restarted at once, {after_adoption} after adoption{}); \
         {oks} prompts answered OK, {unknown} without OK ({refused} refused UNAVAILABLE, {stored_unknown} of them stored and answered); \
         {relaunched} of {SESSIONS} executors relaunched, the others reattached (seed {seed})",
        elapsed.as_secs_f64(),
        if adoption_times.is_empty() {
            String::new()
        } else {
            format!(
                ", adopted in {:.1}-{:.1} s",
                adoption_times.iter().min().unwrap().as_secs_f64(),
                adoption_times.iter().max().unwrap().as_secs_f64()
            )
        }
    );
    assert!(oks > 0, "no prompt was answered");
}
