//! Availability while recovering (issue 16): `sessiond serve` over N
//! remote sessions answers from the moment it listens, and a call on a
//! session the startup pass has not reached recovers that one first.
//!
//! Measured in one run, against the fleet:
//! - one executor's recovery: `recover_all` of a 1-session store (median of 5);
//! - the whole pass in process, with the recovery queue (calls may claim)
//!   and without it (`set_recovery_priority(false)`), alternating on fresh
//!   stores after one uncounted warm-up pass: what the queue costs the pass;
//! - `sessiond serve` (child process) over a fresh N-session store, three
//!   times (`SERVES`): from spawn to the first answered `GetSessionStatus`
//!   on a random session, to a `SendMessage` answered on another random
//!   session not yet recovered (checked: its status said `recovering` just
//!   before), and to SERVING. The rows compare medians: one call per serve
//!   moved by a millisecond or two from run to run.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::Context;
use sessiond_domain::OutcomeLabel;
use sessiond_proto::sessiond::v1::{self as pb, session_service_client::SessionServiceClient};

use crate::{
    Db, new_db, recovery,
    report::{machine, ms, verdict},
    say, seed, spawn_with_addrs,
};

pub const BEGIN: &str = "<!-- bench:availability:begin -->";
pub const END: &str = "<!-- bench:availability:end -->";

/// How many times `sessiond serve` starts over a fresh store.
const SERVES: usize = 3;

#[derive(Debug, Clone)]
pub struct AvailabilityRow {
    pub n: usize,
    /// Median `recover_all` of one executor.
    pub one_executor: Duration,
    /// Passes over N in process, with the queue and without it.
    pub pass_queue: Vec<Duration>,
    pub pass_plain: Vec<Duration>,
    /// One per start of `sessiond serve`.
    pub serves: Vec<Serve>,
}

/// One start of `sessiond serve` over a fresh N-session store.
#[derive(Debug, Clone)]
pub struct Serve {
    /// From spawning `sessiond serve`:
    pub first_status: Duration,
    pub first_status_recovering: bool,
    pub send_sent: Duration,
    pub send_answered: Duration,
    pub serving: Duration,
    /// The `SendMessage` call alone (sent -> answered).
    pub send_call: Duration,
    /// The serve's own pass (its log line), for context.
    pub serve_pass: Option<Duration>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    match v.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2,
    }
}

impl AvailabilityRow {
    pub fn pass_ratio(&self) -> f64 {
        median(&self.pass_queue).as_secs_f64() / median(&self.pass_plain).as_secs_f64().max(1e-9)
    }

    /// The median `SendMessage` call against one executor's recovery.
    pub fn send_ratio(&self) -> f64 {
        self.median_of(|s| s.send_call).as_secs_f64() / self.one_executor.as_secs_f64().max(1e-9)
    }

    /// The median over the serves of one of their times.
    pub fn median_of(&self, time: impl Fn(&Serve) -> Duration) -> Duration {
        median(&self.serves.iter().map(time).collect::<Vec<_>>())
    }

    /// Whether every serve's first status said `recovering`.
    fn first_status_recovering(&self) -> bool {
        self.serves.iter().all(|s| s.first_status_recovering)
    }
}

/// A pseudo-random index below `n` (no RNG dependency for one pick).
fn pick(n: usize, salt: u64) -> usize {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    let x = (nanos ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x >> 17) as usize % n.max(1)
}

async fn seeded_db(
    dir: &Path,
    fleet_urls: &[String],
    n: usize,
) -> anyhow::Result<(Db, Vec<seed::Seeded>)> {
    let db = new_db("sqlite", dir, None)?;
    let store = recovery::open(&db.url()).await?;
    let profile = seed::profile(&store).await?;
    let seeded = seed::remote_sessions(&store, &profile, fleet_urls, n).await?;
    store.load_recoverable_executors().await?;
    Ok((db, seeded))
}

/// One startup pass in process over a freshly seeded N-session store,
/// with the recovery queue or without it.
async fn pass_over_fresh_store(
    dir: &Path,
    fleet_urls: &[String],
    n: usize,
    queue: bool,
) -> anyhow::Result<Duration> {
    let (db, _) = seeded_db(dir, fleet_urls, n).await?;
    let (took, _) = recovery::recover_with(
        &db.url(),
        recovery::remote_drivers(),
        OutcomeLabel::Resumed,
        n,
        queue,
    )
    .await?;
    Ok(took)
}

pub async fn measure(
    dir: &Path,
    bin_dir: &Path,
    fleet_urls: &[String],
    n: usize,
    pairs: usize,
) -> anyhow::Result<AvailabilityRow> {
    // One executor's recovery.
    let mut one = Vec::new();
    for _ in 0..5 {
        let (db, _) = seeded_db(dir, fleet_urls, 1).await?;
        let (took, _) = recovery::recover(
            &db.url(),
            recovery::remote_drivers(),
            OutcomeLabel::Resumed,
            1,
        )
        .await?;
        one.push(took);
    }
    let one_executor = median(&one);
    say(format!(
        "availability: one executor's recovery {}",
        ms(one_executor)
    ));

    // The pass with and without the queue, alternating which goes first
    // (ABBA), after one pass that is not counted: the first pass over a
    // fresh fleet ran faster than every later one (whichever mode it was),
    // which put a warm-up effect into the ratio.
    let (mut pass_queue, mut pass_plain) = (Vec::new(), Vec::new());
    {
        let took = pass_over_fresh_store(dir, fleet_urls, n, false).await?;
        say(format!(
            "availability: warm-up pass over {n} (not counted): {}",
            ms(took)
        ));
    }
    for round in 0..pairs * 2 {
        let queue = (round % 4 == 1) || (round % 4 == 2);
        let took = pass_over_fresh_store(dir, fleet_urls, n, queue).await?;
        say(format!(
            "availability: pass over {n} {} the queue: {}",
            if queue { "with" } else { "without" },
            ms(took)
        ));
        if queue {
            pass_queue.push(took);
        } else {
            pass_plain.push(took);
        }
    }

    let mut serves = Vec::new();
    for round in 0..SERVES {
        let serve = serve_once(dir, bin_dir, fleet_urls, n, round).await?;
        say(format!(
            "availability: serve {} of {SERVES}: SendMessage on a recovering session {}, SERVING after {}",
            round + 1,
            ms(serve.send_call),
            ms(serve.serving)
        ));
        serves.push(serve);
    }
    Ok(AvailabilityRow {
        n,
        one_executor,
        pass_queue,
        pass_plain,
        serves,
    })
}

/// `sessiond serve` over a fresh N-session store: its first answers while
/// it recovers.
async fn serve_once(
    dir: &Path,
    bin_dir: &Path,
    fleet_urls: &[String],
    n: usize,
    round: usize,
) -> anyhow::Result<Serve> {
    let (db, seeded) = seeded_db(dir, fleet_urls, n).await?;
    let data = dir.join(format!("availability-data-{round}"));
    let log = dir.join(format!("availability-sessiond-{round}.log"));
    let mut cmd = Command::new(bin_dir.join("sessiond"));
    cmd.args([
        "serve",
        "--database-url",
        &db.url(),
        "--listen",
        "127.0.0.1:0",
    ])
    .args(["--insecure-no-auth", "--metrics-listen", "off"])
    .arg("--data-dir")
    .arg(&data)
    // SESSIOND_BENCH_SERVE_LOG: another filter for the serve's log (e.g.
    // `info,sessiond_engine=debug,sessiond_store=debug` to see what a
    // slow call waited on), each serve's log kept as
    // availability-sessiond-<round>.log in the current directory.
    .env(
        "SESSIOND_LOG",
        std::env::var("SESSIOND_BENCH_SERVE_LOG").unwrap_or_else(|_| "info".into()),
    )
    .stderr(std::fs::File::create(&log)?);
    let t0 = Instant::now();
    let (server, addrs) = spawn_with_addrs(cmd, "sessiond listening on", 1)?;
    let addr = addrs[0].clone();
    let mut client = loop {
        if let Ok(ch) = crate::load::channel(&addr).await {
            break SessionServiceClient::new(ch);
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(30),
            "cannot connect to {addr}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let status_req = |s: &seed::Seeded| pb::GetSessionStatusRequest {
        task_id: s.task.to_string(),
        session_id: s.session.to_string(),
    };
    let first = seeded[pick(seeded.len(), 1)];
    let (first_status, first_status_recovering) = loop {
        match client.get_session_status(status_req(&first)).await {
            Ok(r) => break (t0.elapsed(), r.into_inner().recovering),
            Err(e) => {
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "GetSessionStatus: {e}"
                );
            }
        }
    };
    // A random session the pass has not reached (its status says so).
    let mut target = None;
    for salt in 2..200 {
        let s = seeded[pick(seeded.len(), salt)];
        if client
            .get_session_status(status_req(&s))
            .await?
            .into_inner()
            .recovering
        {
            target = Some(s);
            break;
        }
    }
    let target = target.context("no session was still recovering to send a message to")?;
    let send_sent = t0.elapsed();
    client
        .send_message(pb::SendMessageRequest {
            task_id: target.task.to_string(),
            session_id: target.session.to_string(),
            content: "hello".into(),
            ..Default::default()
        })
        .await
        .context("SendMessage on a session being recovered")?;
    let send_answered = t0.elapsed();
    let serving = crate::load::wait_serving(&addr, Duration::from_secs(300)).await?;
    let serving = t0.elapsed().max(serving);
    drop(server);
    if std::env::var_os("SESSIOND_BENCH_SERVE_LOG").is_some() {
        let _ = std::fs::copy(&log, format!("availability-sessiond-{round}.log"));
    }
    let serve_pass = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .find(|l| l.contains("startup recovery done"))
        .and_then(|l| l.split("duration_ms=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);
    Ok(Serve {
        first_status,
        first_status_recovering,
        send_sent,
        send_answered,
        serving,
        send_call: send_answered - send_sent,
        serve_pass,
    })
}

pub fn line(r: &AvailabilityRow) -> String {
    format!(
        "availability, N={} (medians of {} serves): first GetSessionStatus {} after spawn (recovering: {}), SendMessage on a session being recovered answered in {} ({} after spawn; one executor's recovery {}, {:.2}x), SERVING after {}; pass with queue {} vs without {} = {:.3}x",
        r.n,
        r.serves.len(),
        ms(r.median_of(|s| s.first_status)),
        r.first_status_recovering(),
        ms(r.median_of(|s| s.send_call)),
        ms(r.median_of(|s| s.send_answered)),
        ms(r.one_executor),
        r.send_ratio(),
        ms(r.median_of(|s| s.serving)),
        ms(median(&r.pass_queue)),
        ms(median(&r.pass_plain)),
        r.pass_ratio()
    )
}

/// The section between [`BEGIN`] and [`END`].
pub fn render(r: &AvailabilityRow, command: &str) -> String {
    use std::fmt::Write;
    let list = |v: &[Duration]| v.iter().map(|d| ms(*d)).collect::<Vec<_>>().join(", ");
    let mut o = String::new();
    let _ = writeln!(
        o,
        "- Machine: {}; {}; `{command}` ({} build)",
        machine(),
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    let _ = writeln!(o);
    // Each serve's time, median first.
    let serves = |time: fn(&Serve) -> Duration| {
        let each: Vec<Duration> = r.serves.iter().map(time).collect();
        format!("{} ({})", ms(median(&each)), list(&each))
    };
    // The log line of each serve's pass; "-" when one has none.
    let serve_pass = match r
        .serves
        .iter()
        .map(|s| s.serve_pass)
        .collect::<Option<Vec<_>>>()
    {
        Some(each) => format!("{} ({})", ms(median(&each)), list(&each)),
        None => "-".into(),
    };
    let _ = writeln!(
        o,
        "| N = {} remote sessions, SQLite; `sessiond serve` started {} times: median (each) | time |\n|---|---:|\n\
         | spawn -> first answered `GetSessionStatus` (random session; `recovering` in every serve: {}) | {} |\n\
         | spawn -> `SendMessage` sent to a random session still `recovering` | {} |\n\
         | spawn -> that `SendMessage` answered | {} |\n\
         | the `SendMessage` call alone (recovers its session first) | {} |\n\
         | one executor's recovery (`recover_all` of 1, median of 5) | {} |\n\
         | spawn -> SERVING (the whole pass and the status snapshot) | {} |\n\
         | the serve's pass (its log line) | {} |\n\
         | pass in process with the recovery queue ({}) | {} |\n\
         | pass in process without it ({}) | {} |",
        r.n,
        r.serves.len(),
        r.first_status_recovering(),
        serves(|s| s.first_status),
        serves(|s| s.send_sent),
        serves(|s| s.send_answered),
        serves(|s| s.send_call),
        ms(r.one_executor),
        serves(|s| s.serving),
        serve_pass,
        list(&r.pass_queue),
        ms(median(&r.pass_queue)),
        list(&r.pass_plain),
        ms(median(&r.pass_plain)),
    );
    let _ = writeln!(o);
    // Every serve answers in time, not only the median one.
    let first = r
        .serves
        .iter()
        .map(|s| s.first_status)
        .max()
        .unwrap_or_default();
    let _ = writeln!(
        o,
        "- first answer within 0.2 s of start, in every serve: {} at most ({})",
        ms(first),
        verdict(first <= Duration::from_millis(200))
    );
    let _ = writeln!(
        o,
        "- the random session's reply within 3x one executor's recovery (median): {:.2}x ({})",
        r.send_ratio(),
        verdict(r.send_ratio() <= 3.0)
    );
    let _ = writeln!(
        o,
        "- total recovery with the queue <= 1.05x without it (medians): {:.3}x ({})",
        r.pass_ratio(),
        verdict(r.pass_ratio() <= 1.05)
    );
    o
}
