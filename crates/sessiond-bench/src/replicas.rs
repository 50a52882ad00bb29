//! Several replicas on one PostgreSQL (issue 15): adoption of a dead
//! replica's sessions, and event latency across replicas.
//!
//! - **Adoption**: N remote sessions (the fleet answers for them) seeded in
//!   a fresh PostgreSQL database. Replica A (`sessiond serve`, child
//!   process) starts alone and recovers all N (its startup pass, from its
//!   log line: the same-run single-replica recovery of N); B and C start
//!   (nothing left for them to claim). Then A is killed with SIGKILL; the
//!   clock runs from just before the kill until B's and C's logs together
//!   hold N `adopted` lines (one per session, written after its recovery
//!   ended: reattached and resumed). Compared with the lease TTL plus A's
//!   pass. Then the database is checked: every executor owned by B or C,
//!   none by A.
//! - **Event latency across replicas**: in process, two `SessionManager`s
//!   (replicas A and B, each its own store pool, event relay started) on
//!   one database. State changes of one session are committed on A the way
//!   the manager does it (`Store::commit`, which `NOTIFY`s, then A's
//!   `EventBus::publish`); the clock starts when the commit returned and
//!   stops when a `watch_session` stream yields the event: one subscriber
//!   on A (same replica) and one on B (across replicas: `LISTEN` wake-up,
//!   a read of the outbox, B's bus), on the same events.

use std::{
    collections::HashMap,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context;
use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::{EventPayload, SessionState};
use sessiond_engine::SessionManager;
use sessiond_store::{Changeset, ReplicaInfo};

use crate::{
    ChildGuard, Db, load::quantile, new_db, recovery, report::ms, say, seed, spawn_with_addrs,
};

pub const BEGIN: &str = "<!-- bench:replicas:begin -->";
pub const END: &str = "<!-- bench:replicas:end -->";

#[derive(Debug, Clone)]
pub struct Adoption {
    pub n: usize,
    pub lease_ttl: Duration,
    /// Replica A's startup pass over the N sessions (its log line).
    pub single_pass: Duration,
    /// From the kill of A to the last `adopted` line.
    pub adopted: Duration,
    /// Of `adopted`: from the kill to the first claim of B or C (when A's
    /// leases ran out: 2/3 TTL to one TTL after the kill, by where the kill
    /// fell between two of A's heartbeats), from their logs.
    pub to_first_claim: Option<Duration>,
    /// Sessions each survivor adopted (B, C).
    pub split: (usize, usize),
    pub failed: usize,
}

impl Adoption {
    pub fn budget(&self) -> Duration {
        self.lease_ttl + self.single_pass
    }

    pub fn ratio(&self) -> f64 {
        self.adopted.as_secs_f64() / self.budget().as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct CrossLatency {
    pub events: usize,
    pub same_p50: Duration,
    pub same_p99: Duration,
    pub cross_p50: Duration,
    pub cross_p99: Duration,
    pub cross_max: Duration,
    pub commit_p50: Duration,
}

impl CrossLatency {
    pub fn ratio_p99(&self) -> f64 {
        self.cross_p99.as_secs_f64() / self.same_p99.as_secs_f64().max(1e-9)
    }

    /// What a watcher waits for an event from the moment the owner commits
    /// it (the commit, then delivery), on another replica / on the owner,
    /// at p50: the figure an event's path across replicas is judged by.
    pub fn ratio_p50_from_commit(&self) -> f64 {
        (self.commit_p50 + self.cross_p50).as_secs_f64()
            / (self.commit_p50 + self.same_p50).as_secs_f64().max(1e-9)
    }
}

fn serve(
    bin_dir: &Path,
    db: &Db,
    dir: &Path,
    id: &str,
    ttl: Duration,
) -> anyhow::Result<(ChildGuard, String, std::path::PathBuf)> {
    let log = dir.join(format!("replica-{id}.log"));
    let mut cmd = Command::new(bin_dir.join("sessiond"));
    cmd.args([
        "serve",
        "--database-url",
        &db.url(),
        "--listen",
        "127.0.0.1:0",
        "--insecure-no-auth",
        "--metrics-listen",
        "off",
        "--replica-id",
        id,
        "--lease-ttl",
        &format!("{}ms", ttl.as_millis()),
    ])
    .arg("--data-dir")
    .arg(dir.join(format!("data-{id}")))
    .env("SESSIOND_LOG", "info")
    .stderr(std::fs::File::create(&log)?);
    let (child, addrs) = spawn_with_addrs(cmd, "sessiond listening on", 1)?;
    Ok((child, addrs[0].clone(), log))
}

/// Lines of a replica's log that record one adopted session (`adopted`,
/// written after its recovery) and one failed adoption.
fn adopted_in(log: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let ok = text
        .lines()
        .filter(|l| l.contains(" adopted session="))
        .count();
    let failed = text
        .lines()
        .filter(|l| l.contains("adoption recovery failed"))
        .count();
    (ok, failed)
}

/// When the first claim of expired leases in a replica's log began (the
/// line's timestamp minus the claim's own time).
fn first_claim_in(log: &Path) -> Option<chrono::DateTime<Utc>> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text
        .lines()
        .find(|l| l.contains("claimed expired leases"))?;
    let at: chrono::DateTime<Utc> = line.split_whitespace().next()?.parse().ok()?;
    let claim_ms: f64 = line
        .split("claim_ms=")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(at - chrono::Duration::microseconds((claim_ms * 1e3) as i64))
}

fn pass_of(log: &Path) -> Option<Duration> {
    std::fs::read_to_string(log)
        .ok()?
        .lines()
        .find(|l| l.contains("startup recovery done"))
        .and_then(|l| l.split("duration_ms=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

pub async fn adoption(
    dir: &Path,
    bin_dir: &Path,
    pg: &str,
    fleet_urls: &[String],
    n: usize,
    lease_ttl: Duration,
) -> anyhow::Result<Adoption> {
    let dir = dir.join("replicas");
    std::fs::create_dir_all(&dir)?;
    let db = new_db("postgres", &dir, Some(pg))?;
    {
        let store = recovery::open(&db.url()).await?;
        let profile = seed::profile(&store).await?;
        seed::remote_sessions(&store, &profile, fleet_urls, n).await?;
    }
    let limit = Duration::from_secs(600);
    let (mut a, a_addr, a_log) = serve(bin_dir, &db, &dir, "bench-a", lease_ttl)?;
    crate::load::wait_serving(&a_addr, limit).await?;
    // SERVING comes once the workspaces are back; the pass's line may
    // follow a moment later (its agents are resumed after).
    let logged_by = Instant::now() + limit;
    let single_pass = loop {
        if let Some(pass) = pass_of(&a_log) {
            break pass;
        }
        anyhow::ensure!(
            Instant::now() < logged_by,
            "replica A logged no startup recovery"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    say(format!(
        "replicas: A recovered {n} sessions alone in {}",
        ms(single_pass)
    ));
    let (_b, b_addr, b_log) = serve(bin_dir, &db, &dir, "bench-b", lease_ttl)?;
    let (_c, c_addr, c_log) = serve(bin_dir, &db, &dir, "bench-c", lease_ttl)?;
    crate::load::wait_serving(&b_addr, limit).await?;
    crate::load::wait_serving(&c_addr, limit).await?;
    // Let B and C settle (their first adoption rounds find nothing).
    tokio::time::sleep(lease_ttl / 3 + Duration::from_millis(200)).await;
    anyhow::ensure!(
        adopted_in(&b_log).0 + adopted_in(&c_log).0 == 0,
        "B or C adopted sessions while A was alive"
    );

    let t0 = Instant::now();
    let killed_at = Utc::now();
    a.kill_now().context("kill -9 of replica A")?;
    let adopted = loop {
        let ((b_ok, b_fail), (c_ok, c_fail)) = (adopted_in(&b_log), adopted_in(&c_log));
        if b_ok + b_fail + c_ok + c_fail >= n {
            break (t0.elapsed(), (b_ok, c_ok), b_fail + c_fail);
        }
        anyhow::ensure!(
            t0.elapsed() < limit,
            "after {limit:?}: {} of {n} adopted",
            b_ok + c_ok
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (took, split, failed) = adopted;
    let to_first_claim = [first_claim_in(&b_log), first_claim_in(&c_log)]
        .into_iter()
        .flatten()
        .min()
        .and_then(|t| (t - killed_at).to_std().ok());
    // The database agrees: every executor owned by B or C.
    let store = recovery::open(&db.url()).await?;
    let owners: HashMap<String, usize> =
        store
            .list_executors()
            .await?
            .into_iter()
            .fold(HashMap::new(), |mut m, r| {
                *m.entry(r.owner_id.unwrap_or_default()).or_default() += 1;
                m
            });
    anyhow::ensure!(
        !owners.contains_key("bench-a")
            && owners.get("bench-b").copied().unwrap_or(0)
                + owners.get("bench-c").copied().unwrap_or(0)
                == n,
        "owners after adoption: {owners:?}"
    );
    Ok(Adoption {
        n,
        lease_ttl,
        single_pass,
        adopted: took,
        to_first_claim,
        split,
        failed,
    })
}

async fn replica(url: &str, id: &str) -> anyhow::Result<SessionManager> {
    let store = recovery::open(url).await?;
    let mut config = recovery::manager_config();
    config.replica.id = id.into();
    config.replica.exclusive = false;
    config.replica.lease_ttl = Duration::from_secs(15);
    let manager = SessionManager::new(store, recovery::remote_drivers(), config);
    manager
        .replica()
        .start(ReplicaInfo {
            id: id.into(),
            address: "127.0.0.1:1".into(),
            hostname: "bench".into(),
            pid: i64::from(std::process::id()),
            started_at: Utc::now(),
            heartbeat_at: Utc::now(),
            lease_ttl: Duration::from_secs(15),
            owned_executors: 0,
        })
        .await?;
    Ok(manager)
}

/// `events` state changes committed on replica A, one every `gap`; one
/// subscriber on A and one on B.
pub async fn cross_latency(
    dir: &Path,
    pg: &str,
    fleet_urls: &[String],
    events: usize,
    gap: Duration,
) -> anyhow::Result<CrossLatency> {
    let db = new_db("postgres", dir, Some(pg))?;
    let session = {
        let store = recovery::open(&db.url()).await?;
        let profile = seed::profile(&store).await?;
        seed::remote_sessions(&store, &profile, fleet_urls, 1).await?[0]
    };
    let a = replica(&db.url(), "bench-events-a").await?;
    let b = replica(&db.url(), "bench-events-b").await?;
    let store = a.store().clone();
    let start_seq = store.last_event_seq(session.session).await?;
    let mut receivers = Vec::new();
    for m in [&a, &b] {
        let mut stream = m.watch_session(session.session, start_seq).await?;
        receivers.push(tokio::spawn(async move {
            let mut got = Vec::with_capacity(events);
            while got.len() < events {
                match stream.next().await {
                    Some(Ok(e)) => got.push((e.seq, Instant::now())),
                    _ => break,
                }
            }
            got
        }));
    }
    // Both watchers have replayed (nothing) and B's listener is connected.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut sent: HashMap<i64, Instant> = HashMap::new();
    let mut commits = Vec::with_capacity(events);
    let mut current = store.get_session(session.session).await?;
    for _ in 0..events {
        let to = if current.state == SessionState::Running {
            SessionState::WaitingForInput
        } else {
            SessionState::Running
        };
        let mut next = current.clone();
        next.state = to;
        let change = Changeset::new().update_session(next).event(
            session.session,
            EventPayload::StateChanged {
                from: current.state,
                to,
                error_message: None,
            },
        );
        let before = Instant::now();
        let committed = store.commit(change).await?;
        let t = Instant::now();
        commits.push(t - before);
        a.events().publish(&committed.events);
        for e in &committed.events {
            sent.insert(e.seq, t);
        }
        current = committed
            .session
            .ok_or_else(|| anyhow::anyhow!("commit returned no session"))?;
        tokio::time::sleep(gap).await;
    }
    let mut lat = Vec::new();
    for (which, r) in ["same replica", "other replica"].iter().zip(receivers) {
        let got = tokio::time::timeout(Duration::from_secs(60), r).await??;
        anyhow::ensure!(
            got.len() == events,
            "the subscriber on the {which} got {} of {events} events",
            got.len()
        );
        let mut l = Vec::with_capacity(events);
        let mut last = 0;
        for (seq, at) in got {
            anyhow::ensure!(seq > last, "{which}: seq {seq} after {last}");
            last = seq;
            let t = sent
                .get(&seq)
                .ok_or_else(|| anyhow::anyhow!("{which}: unexpected seq {seq}"))?;
            l.push(at.saturating_duration_since(*t));
        }
        l.sort_unstable();
        lat.push(l);
    }
    a.shutdown();
    b.shutdown();
    commits.sort_unstable();
    Ok(CrossLatency {
        events,
        same_p50: quantile(&lat[0], 0.5),
        same_p99: quantile(&lat[0], 0.99),
        cross_p50: quantile(&lat[1], 0.5),
        cross_p99: quantile(&lat[1], 0.99),
        cross_max: lat[1].last().copied().unwrap_or_default(),
        commit_p50: quantile(&commits, 0.5),
    })
}

pub fn line(a: &Adoption, e: &CrossLatency) -> String {
    format!(
        "replicas: {} sessions of a killed replica adopted by two in {} (lease TTL {} + single-replica recovery {} = {}, {:.2}x; split {}/{}, failed {}); event p99 across replicas {} vs same replica {} ({:.2}x)",
        a.n,
        ms(a.adopted),
        ms(a.lease_ttl),
        ms(a.single_pass),
        ms(a.budget()),
        a.ratio(),
        a.split.0,
        a.split.1,
        a.failed,
        ms(e.cross_p99),
        ms(e.same_p99),
        e.ratio_p99()
    )
}

/// The section between [`BEGIN`] and [`END`].
pub fn render(a: &Adoption, e: &CrossLatency, command: &str, build: &str) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "- Machine: {}; {}; `{command}` ({build} build)",
        crate::report::machine(),
        Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "| adoption, {} remote sessions, PostgreSQL | time |\n|---|---:|\n\
         | replica A alone: its startup recovery of the {} (same run) | {} |\n\
         | lease TTL | {} |\n\
         | kill -9 of A -> all {} adopted by B and C (split {} / {}, failed {}) | {} |\n\
         | of which: kill -> first claim (A's leases run out, 2/3 to 1 TTL after the kill) | {} |\n\
         | of which: first claim -> all adopted (vs the single-replica recovery above) | {} |\n\
         | budget: lease TTL + single-replica recovery | {} |",
        a.n,
        a.n,
        ms(a.single_pass),
        ms(a.lease_ttl),
        a.n,
        a.split.0,
        a.split.1,
        a.failed,
        ms(a.adopted),
        a.to_first_claim.map_or("?".to_owned(), ms),
        a.to_first_claim
            .map_or("?".to_owned(), |w| ms(a.adopted.saturating_sub(w))),
        ms(a.budget()),
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "| committed on replica A -> `watch_session` subscriber ({} events, one every 5 ms) | p50 | p99 |\n|---|---:|---:|\n\
         | on A (same replica) | {} | {} |\n\
         | on B (other replica: NOTIFY, outbox read) | {} | {} (max {}) |\n\
         | the commit on A before it | {} | |",
        e.events,
        ms(e.same_p50),
        ms(e.same_p99),
        ms(e.cross_p50),
        ms(e.cross_p99),
        ms(e.cross_max),
        ms(e.commit_p50),
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "- adoption within lease TTL + single-replica recovery: {:.2}x of it ({})",
        a.ratio(),
        crate::report::verdict(a.ratio() <= 1.0)
    );
    let _ = writeln!(
        o,
        "- event p50 across replicas / same replica, from the commit's start: {:.2}x (target <= 2x: {})",
        e.ratio_p50_from_commit(),
        crate::report::verdict(e.ratio_p50_from_commit() <= 2.0)
    );
    let _ = writeln!(
        o,
        "- event p99 across replicas / same replica, after the commit: {:.2}x (reported, no target)",
        e.ratio_p99()
    );
    o
}
