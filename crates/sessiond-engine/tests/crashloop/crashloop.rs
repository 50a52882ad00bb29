//! The crash loop: 20 sessions across the runtimes, each in a worktree
//! sessiond makes from a repository, a child backend that
//! recovers, creates the missing sessions and keeps every session busy
//! (prompts, resumes of ERROR sessions), SIGKILLed at random intervals, then
//! a clean start and the checks against the world.
//!
//! - `SESSIOND_CRASHLOOP_SECS`: how long backends are killed (`cargo xtask
//!   ci` sets 45). Unset: a 15 s smoke run of the same test. Sessions
//!   still missing then (every backend died in its recovery, as on a
//!   loaded machine) are created by one more backend, killed once they
//!   exist.
//! - `SESSIOND_CRASHLOOP_SEED`: the seed of the kill schedule (printed;
//!   set it to replay a failing run's schedule).
//! - `SESSIOND_CRASHLOOP_KEEP`: set, the world's directory (store,
//!   children's logs, remote hosts' logs) is kept and its path printed.
//! - `SESSIOND_CRASHLOOP_HEAVY`: set, the agents are heavy (1.5 s to
//!   start, CPU to start and to load), as real ones are.
//! - `SESSIOND_CRASHLOOP_RUNTIMES`: a comma list of `standalone`, `remote`,
//!   `docker` to focus the 20 sessions on (default: all available).
//! - `SESSIOND_CRASHLOOP_STORE`: `postgres` keeps the world's records on
//!   PostgreSQL (`DATABASE_URL`'s server, else a throwaway cluster) instead
//!   of a SQLite file; it applies to every crash test of this binary.
//!
//! Each backend lives 1.5-7.5 s (uniform, seeded). Every third backend (the 2nd, 5th, ...) is
//! instead killed 0-150 ms after it printed `RECOVERING`, so kills land in
//! the middle of startup recovery too; the test counts the kills that came
//! before the backend finished recovering and requires at least one. An
//! aimed kill that came too late (recovery of 20 mostly idle sessions can
//! take less than 150 ms) halves the window of the next one, and until one
//! has landed every backend is aimed at.
//!
//! Agentctls die too: in half of the unaimed rounds the agentctl of a
//! session running a turn (standalone: SIGKILL; remote: its host restarts
//! it on the same journal) is killed while the backend runs, and after a
//! third of the backend kills one more while it is down. Turns cut so end
//! interrupted (at most once), never re-run by themselves.
//!
//! Messages: a turn the agent ran must be stored exactly once (prompt and
//! complete reply), nothing the agent did not say may be stored, every
//! stored user message must have reached the agent exactly once (a backend
//! killed between storing a message and its Prompt included: recovery
//! re-delivers it), and every reply must be stored before the next user
//! message (recovery keeps a session RUNNING until the reply agentctl
//! buffered while the backend was down is stored), unless the turn ended
//! with an explicit interrupted message; every tool-call side effect ran
//! at most once per prompt, exactly once for a turn the agent finished.
//! Any of these fails the test.

use std::time::{Duration, Instant};

use crate::world::{Mode, Rt, World, fail};

const SESSIONS: usize = 20;

/// SplitMix64: a small seeded generator, enough for a kill schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// Kills the agentctl of a session running a turn (any live session when
/// none is); returns its runtime's name.
async fn kill_an_agentctl(w: &World, rng: &mut Rng) -> Option<&'static str> {
    let sessions = w.sessions().await;
    let running: Vec<_> = sessions
        .iter()
        .filter(|s| s.state == sessiond_domain::SessionState::Running)
        .collect();
    let pool = if running.is_empty() {
        sessions
            .iter()
            .filter(|s| s.state == sessiond_domain::SessionState::WaitingForInput)
            .collect()
    } else {
        running
    };
    if pool.is_empty() {
        return None;
    }
    let s = pool[(rng.next() % pool.len() as u64) as usize];
    let name = match s.runtime {
        sessiond_domain::Runtime::Remote => "remote",
        sessiond_domain::Runtime::LocalStandalone => "standalone",
        sessiond_domain::Runtime::LocalDocker => "docker",
        sessiond_domain::Runtime::Custom(_) => panic!("the crash loop makes no custom runtime"),
    };
    w.kill_agentctl(s).await.then_some(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_loop_converges() {
    let secs: u64 = std::env::var("SESSIOND_CRASHLOOP_SECS")
        .ok()
        .map(|s| s.parse().expect("SESSIOND_CRASHLOOP_SECS: seconds"))
        .unwrap_or(15);
    let seed: u64 = std::env::var("SESSIOND_CRASHLOOP_SEED")
        .ok()
        .map(|s| s.parse().expect("SESSIOND_CRASHLOOP_SEED: a u64"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!(
        "crash loop: seed {seed} (replay with SESSIOND_CRASHLOOP_SEED={seed}), {secs} s of kills"
    );
    let mut rng = Rng(seed);

    let w = World::new().await;
    let runtimes = w.runtimes();
    let runtimes: Vec<Rt> = match std::env::var("SESSIOND_CRASHLOOP_RUNTIMES") {
        Ok(list) => list
            .split(',')
            .map(|name| {
                let rt = match name.trim() {
                    "standalone" => Rt::Standalone,
                    "remote" => Rt::Remote,
                    "docker" => Rt::Docker,
                    other => panic!("SESSIOND_CRASHLOOP_RUNTIMES: unknown runtime {other:?}"),
                };
                assert!(
                    runtimes.contains(&rt),
                    "SESSIOND_CRASHLOOP_RUNTIMES names {rt:?}, which this run does not have"
                );
                rt
            })
            .collect(),
        Err(_) => runtimes,
    };
    let mut plans = Vec::new();
    for i in 0..SESSIONS {
        let rt = runtimes[i % runtimes.len()];
        let name = format!(
            "{}-{i:02}",
            match rt {
                Rt::Standalone => "sa",
                Rt::Docker => "dk",
                Rt::Remote => "rm",
            }
        );
        plans.push(w.plan(&name, rt).await);
    }
    let mix: Vec<String> = runtimes
        .iter()
        .map(|rt| {
            format!(
                "{rt:?}={}",
                plans.iter().filter(|p| p.runtime == *rt).count()
            )
        })
        .collect();
    println!("crash loop: {SESSIONS} sessions: {}", mix.join(" "));

    let started = Instant::now();
    let (mut rounds, mut in_recovery, mut before_recovery) = (0u32, 0u32, 0u32);
    let mut aim_ms = 150;
    let mut lifetimes = Vec::new();
    let mut agentctl_kills: std::collections::BTreeMap<String, u32> = Default::default();
    while started.elapsed() < Duration::from_secs(secs) {
        rounds += 1;
        let mut c = w.spawn_child(
            &format!("round-{rounds:03}"),
            Mode::Loop {
                plans: plans.clone(),
            },
            None,
        );
        let born = Instant::now();
        let aimed = rounds % 3 == 2 || (rounds > 2 && in_recovery == 0);
        if aimed {
            // A kill aimed at recovery.
            assert!(
                c.wait_for("RECOVERING", Duration::from_secs(30)).await,
                "backend {rounds} never started recovering\n{}",
                c.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(rng.between(0, aim_ms))).await;
        } else {
            let life = rng.between(1500, 7500);
            if rng.next().is_multiple_of(2) {
                // An agentctl (or a remote host's agentctl) dies while the
                // backend runs, preferably in the middle of a turn.
                let at = rng.between(300, life - 200);
                tokio::time::sleep(Duration::from_millis(at)).await;
                if let Some(k) = kill_an_agentctl(&w, &mut rng).await {
                    *agentctl_kills.entry(format!("{k} live")).or_default() += 1;
                }
                tokio::time::sleep(Duration::from_millis(life - at)).await;
            } else {
                tokio::time::sleep(Duration::from_millis(life)).await;
            }
        }
        if !c.has("RECOVERING") {
            before_recovery += 1;
        } else if !c.has("RECOVERED") {
            in_recovery += 1;
        } else if aimed {
            aim_ms /= 2;
        }
        c.kill9();
        lifetimes.push(born.elapsed());
        if rng.next().is_multiple_of(3) {
            // ... or while the backend is down (a turn it left running).
            if let Some(k) = kill_an_agentctl(&w, &mut rng).await {
                *agentctl_kills.entry(format!("{k} down")).or_default() += 1;
            }
        }
    }
    // On a loaded machine a recovery can outlast a backend's life, so that
    // every backend died before it created the sessions still missing: one
    // more backend, killed once they all exist (or when it made none for a
    // minute).
    let mut made = w.sessions().await.len();
    if made < SESSIONS {
        rounds += 1;
        let mut c = w.spawn_child(
            &format!("round-{rounds:03}"),
            Mode::Loop {
                plans: plans.clone(),
            },
            None,
        );
        let born = Instant::now();
        let mut progress = Instant::now();
        while made < SESSIONS && progress.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = w.sessions().await.len();
            if now > made {
                made = now;
                progress = Instant::now();
            }
        }
        println!(
            "crash loop: a last backend created the missing sessions ({made} of {SESSIONS}) in {:.1} s",
            born.elapsed().as_secs_f64()
        );
        c.kill9();
        lifetimes.push(born.elapsed());
    }
    let kills = rounds;
    println!("crash loop: agentctl kills {agentctl_kills:?}");
    println!(
        "crash loop: {rounds} backends, {kills} SIGKILLs in {:.1} s ({in_recovery} during recovery, {before_recovery} before it began), lifetimes {:.1}-{:.1} s",
        started.elapsed().as_secs_f64(),
        lifetimes.iter().min().unwrap().as_secs_f64(),
        lifetimes.iter().max().unwrap().as_secs_f64(),
    );
    assert!(
        in_recovery >= 1,
        "no kill landed during recovery; seed {seed}"
    );

    // Uncaptured, so that a live log's tail has it beside the checks' output.
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "crash loop: {rounds} backends killed (seed {seed}); the clean start and the checks follow"
        );
    }

    // The clean start.
    let mgr = w.manager().await;
    let t = Instant::now();
    let summary = mgr.recovery().recover_all().await.unwrap();
    println!(
        "crash loop: clean start recovered {} executors in {:.1} s: {:?}, {} failed",
        summary.total,
        t.elapsed().as_secs_f64(),
        summary.counts,
        summary.failed
    );
    if summary.failed > 0 {
        let failed: Vec<String> = summary
            .outcomes
            .iter()
            .filter_map(|(id, r)| r.as_ref().err().map(|e| format!("session {id}: {e}")))
            .collect();
        fail(&crate::world::summary(
            &format!("the clean start failed to recover (seed {seed})"),
            &failed,
            &w.states_line().await,
        ));
    }
    let sessions = w.sessions().await;
    let mut starting = Vec::new();
    for s in &sessions {
        if s.state == sessiond_domain::SessionState::Starting {
            starting.push(w.who(s).await);
        }
    }
    if !starting.is_empty() {
        fail(&crate::world::summary(
            &format!("sessions left STARTING after the clean start (seed {seed})"),
            &starting,
            &w.states_line().await,
        ));
    }
    w.settle(Duration::from_secs(60)).await;
    let line = w.assert_converged(&mgr).await;
    println!("crash loop: {} sessions converged: {line}", sessions.len());
    // Why each session that ended in ERROR did, for the run's reader.
    for s in w.sessions().await {
        if s.state == sessiond_domain::SessionState::Error {
            println!(
                "crash loop: session {} ERROR: {}",
                s.id,
                s.error_message.as_deref().unwrap_or("(no message)")
            );
        }
    }
    // Agents really ran on every runtime: a session cut off in its create
    // may end in ERROR (the verdict on a launch no backend finished), but
    // never because its agent cannot start there.
    let after = w.sessions().await;
    for rt in &runtimes {
        let of_rt: Vec<_> = after.iter().filter(|s| s.runtime == rt.runtime()).collect();
        let live = of_rt
            .iter()
            .filter(|s| s.state == sessiond_domain::SessionState::WaitingForInput)
            .count();
        println!(
            "crash loop: {rt:?}: {live} of {} sessions waiting for input",
            of_rt.len()
        );
        for s in of_rt {
            let why = s.error_message.as_deref().unwrap_or_default();
            if why.contains("could not start") {
                fail(&format!(
                    "an agent could not start on {rt:?} (seed {seed}): {}",
                    w.who(s).await
                ));
            }
        }
    }
    let prompted = w.prompt_all(&mgr).await;
    w.assert_converged(&mgr).await;
    println!("crash loop: {prompted} conversations continued at the right turn");
    if sessions.len() != SESSIONS {
        fail(&format!(
            "only {} of {SESSIONS} sessions were created in {secs} s and by a last backend (seed {seed}); {}",
            sessions.len(),
            w.states_line().await
        ));
    }
    w.cleanup(&mgr).await;
}
