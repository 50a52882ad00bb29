//! `sessiond-bench`: the figures of `cargo xtask bench` (issue 7).
//!
//! - Startup recovery of N remote executors (a bench-only agentctl fleet, see
//!   `fleet.rs`) on SQLite and PostgreSQL, and of 100 standalone executors
//!   (real agentctl + demo agent processes), each beside a baseline measured
//!   in the same run (read the rows, one Health per executor at the same
//!   concurrency, write the results in batches).
//! - GetSessionStatus under concurrent clients against `sessiond serve`,
//!   beside a bare tonic unary server measured the same way.
//! - Event latency from commit to `watch_session` subscribers (1 and 1,000).
//! - Peak RSS of `sessiond serve` with 10,000 recovered sessions.
//! - The turn path: SendMessage -> first agent chunk at a `watch_session`
//!   subscriber vs the same prompt straight to agentctl (`turn.rs`;
//!   `--only-turns` runs just that).
//! - Availability while recovering (`availability.rs`; `--n`, default
//!   10,000; `--only-availability` runs just that): first answer and a
//!   SendMessage on a session not yet recovered, against one executor's
//!   recovery, and the pass with and without the recovery queue.
//! - Replicas on one PostgreSQL (`replicas.rs`; `--replicas N`, default
//!   1,000, 0 skips; `--lease-ttl S`, default 3; `--only-replicas` runs just
//!   that): adoption of a killed replica's sessions by two survivors against
//!   the lease TTL plus a single-replica recovery, and event latency across
//!   replicas against the same replica.
//!
//! - A burst of heavy relaunches (`burst.rs`; `--burst N`, default 32, 0
//!   skips; `--only-burst` runs just that): N standalone sessions whose
//!   agents take seconds to start, `kill -9` of every agentctl and agent,
//!   recovered by a fresh manager with the default settings, against the
//!   parallelism the host sustains without sessiond's launch scheduler.
//!
//! Prints a table and writes it into `docs/PERFORMANCE.md` between the
//! `<!-- bench:begin -->` / `<!-- bench:end -->` markers.
//!
//! Subcommands `fleet` and `echo` are the child processes it starts itself;
//! `console-seed` seeds the store behind `web/perf/console.mjs`.

mod availability;
mod burst;
mod console;
mod events;
mod fleet;
mod load;
mod recovery;
mod replicas;
mod report;
mod seed;
mod standalone;
mod turn;

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use sessiond_domain::OutcomeLabel;
use sessiond_engine::SessionManager;

use crate::{recovery::RecoveryRow, report::Report};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match args.first().map(String::as_str) {
        Some("fleet") => {
            let ports = args.get(1).and_then(|p| p.parse().ok()).unwrap_or(4);
            rt.block_on(fleet::serve(ports))
        }
        Some("echo") => rt.block_on(fleet::serve_echo()),
        Some("console-seed") => rt.block_on(console::seed(&args[1..])),
        _ => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "warn".into()),
                )
                .with_writer(std::io::stderr)
                .try_init();
            let opts = Opts::parse(&args)?;
            rt.block_on(run(opts))
        }
    }
}

#[derive(Debug, Clone)]
struct Opts {
    sizes: Vec<usize>,
    postgres: bool,
    standalone: usize,
    rss_sessions: usize,
    load_secs: u64,
    /// Turns measured on the turn path (0: skip it).
    turns: usize,
    /// Only the turn path.
    only_turns: bool,
    /// Measure the idle CPU over one liveness round (~40 s).
    idle_window: bool,
    /// Sessions of the availability measurement (0: skip it).
    availability_n: usize,
    /// Pairs of passes (with / without the recovery queue) it compares.
    availability_pairs: usize,
    /// Only the availability measurement.
    only_availability: bool,
    /// Sessions of a killed replica adopted by two others (0: skip the
    /// replicas measurements; they need PostgreSQL).
    replicas_n: usize,
    /// Lease TTL of the replicas in the adoption measurement.
    lease_ttl: Duration,
    /// Only the replicas measurements.
    only_replicas: bool,
    /// Heavy standalone sessions of the burst measurement (0: skip it).
    burst: usize,
    /// Only the burst measurement.
    only_burst: bool,
    out: Option<PathBuf>,
    bin_dir: PathBuf,
    command: String,
}

const USAGE: &str = "\
usage: sessiond-bench [OPTIONS]
       (or `cargo xtask bench [OPTIONS]`, which builds the release binaries first
        and writes docs/PERFORMANCE.md unless --out is given)

Runs every measurement unless an --only-* option picks one; prints the
figures and writes them between their markers in --out.

options:
  -h, --help             print this and exit
  --quick                smaller sizes (N = 100 and 1,000, 10 standalone, 8 burst)
  --sizes A,B,...        remote executors per startup-recovery row (100,1000,10000)
  --no-postgres          leave out PostgreSQL (and the replicas measurements)
  --standalone N         standalone executors reattached (100; 0 skips)
  --rss-sessions N       sessions of the `sessiond serve` memory row (10000)
  --load-secs S          GetSessionStatus load duration (5)
  --no-idle              leave out the idle-CPU window (~50 s)
  --turns N              turns on the turn path, per store (500; 0 skips)
  --only-turns           only the turn path
  --n N                  sessions of the availability measurement (10000; 0 skips)
  --pairs P              pass pairs with / without the recovery queue (2)
  --only-availability    only the availability measurement
  --replicas N           sessions adopted across replicas (1000; 0 skips)
  --lease-ttl S          lease TTL of the replicas (3)
  --only-replicas        only the replicas measurements (need PostgreSQL)
  --burst N              heavy standalone sessions relaunched at once (32; 0 skips)
  --only-burst           only the burst measurement
  --out FILE             write the figures into FILE (a new file gets every
                         section's markers); `-` writes no file
  --bin-dir DIR          where sessiond, agentctl and acp-demo-agent are
                         (beside this executable)

environment: DATABASE_URL (PostgreSQL to use instead of a throwaway cluster),
SESSIOND_BENCH_WRAP (a profiler to run `sessiond serve` under), RUST_LOG.";

impl Opts {
    fn parse(args: &[String]) -> anyhow::Result<Opts> {
        let exe = std::env::current_exe()?;
        let mut o = Opts {
            sizes: vec![100, 1_000, 10_000],
            postgres: true,
            standalone: 100,
            rss_sessions: 10_000,
            load_secs: 5,
            // A p99 over 500 turns is the fifth slowest; over 50 it was
            // the slowest but one, and moved 1.35x-2.5x between runs.
            turns: 500,
            only_turns: false,
            idle_window: true,
            availability_n: 10_000,
            availability_pairs: 2,
            only_availability: false,
            replicas_n: 1_000,
            lease_ttl: Duration::from_secs(3),
            only_replicas: false,
            burst: 32,
            only_burst: false,
            out: None,
            bin_dir: exe.parent().map(Path::to_path_buf).unwrap_or_default(),
            command: std::env::var("SESSIOND_BENCH_COMMAND")
                .unwrap_or_else(|_| format!("sessiond-bench {}", args.join(" "))),
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = || it.next().cloned().context("missing value");
            match a.as_str() {
                "--quick" => {
                    o.sizes = vec![100, 1_000];
                    o.rss_sessions = 1_000;
                    o.standalone = 10;
                    o.load_secs = 2;
                    o.turns = 20;
                    o.idle_window = false;
                    o.availability_n = 1_000;
                    o.burst = 8;
                }
                "--help" | "-h" => {
                    #[allow(clippy::print_stdout)]
                    {
                        println!("{USAGE}");
                    }
                    std::process::exit(0);
                }
                "--burst" => o.burst = val()?.replace('_', "").parse()?,
                "--only-burst" => o.only_burst = true,
                "--n" => o.availability_n = val()?.replace('_', "").parse()?,
                "--pairs" => o.availability_pairs = val()?.parse::<usize>()?,
                "--only-availability" => o.only_availability = true,
                "--replicas" => o.replicas_n = val()?.replace('_', "").parse()?,
                "--lease-ttl" => {
                    o.lease_ttl = Duration::from_secs_f64(val()?.trim_end_matches('s').parse()?);
                }
                "--only-replicas" => o.only_replicas = true,
                "--no-idle" => o.idle_window = false,
                "--turns" => o.turns = val()?.parse()?,
                "--only-turns" => o.only_turns = true,
                "--sizes" => {
                    o.sizes = val()?
                        .split(',')
                        .map(|s| s.trim().replace('_', "").parse())
                        .collect::<Result<_, _>>()?;
                }
                "--no-postgres" => o.postgres = false,
                "--standalone" => o.standalone = val()?.parse()?,
                "--rss-sessions" => o.rss_sessions = val()?.parse()?,
                "--load-secs" => o.load_secs = val()?.parse()?,
                "--out" => o.out = Some(PathBuf::from(val()?)).filter(|p| p != Path::new("-")),
                // Absolute: agentctl starts in a session's directory.
                "--bin-dir" => o.bin_dir = std::path::absolute(val()?)?,
                other => anyhow::bail!("unknown argument {other:?}\n\n{USAGE}"),
            }
        }
        Ok(o)
    }
}

/// A child process this bench started; killed (by its own pid) on drop.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl ChildGuard {
    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGKILL (kill -9), and reaped.
    fn kill_now(&mut self) -> std::io::Result<()> {
        self.0.kill()?;
        self.0.wait().map(drop)
    }
}

/// Starts `cmd` and reads `lines` lines of its stdout, each ending in an address.
fn spawn_with_addrs(
    mut cmd: Command,
    prefix: &str,
    lines: usize,
) -> anyhow::Result<(ChildGuard, Vec<String>)> {
    cmd.stdout(Stdio::piped()).stdin(Stdio::null());
    let mut child = ChildGuard(cmd.spawn().with_context(|| format!("starting {cmd:?}"))?);
    let stdout = child.0.stdout.take().context("no stdout")?;
    let mut reader = BufReader::new(stdout);
    let mut addrs = Vec::new();
    let mut line = String::new();
    while addrs.len() < lines {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            anyhow::bail!("{cmd:?} exited before printing its address");
        }
        if let Some(rest) = line.trim().strip_prefix(prefix) {
            addrs.push(rest.trim().to_owned());
        }
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while reader.read_line(&mut sink).unwrap_or(0) > 0 {
            sink.clear();
        }
    });
    Ok((child, addrs))
}

/// One database per measurement: a SQLite file, or a new Postgres database.
enum Db {
    Sqlite(PathBuf),
    Postgres { server: String, name: String },
}

impl Db {
    fn url(&self) -> String {
        match self {
            Db::Sqlite(p) => format!("sqlite://{}", p.display()),
            Db::Postgres { server, name } => {
                sessiond_testkit::postgres::with_database(server, name)
            }
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Db::Postgres { server, name } = self {
            let _ = sessiond_testkit::postgres::psql_command(
                server,
                &format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"),
            );
        }
    }
}

fn new_db(kind: &str, dir: &Path, pg: Option<&str>) -> anyhow::Result<Db> {
    let tag = uuid_tag();
    Ok(match (kind, pg) {
        ("postgres", Some(server)) => {
            let name = format!("bench_{tag}");
            sessiond_testkit::postgres::psql_command(
                server,
                &format!("CREATE DATABASE \"{name}\""),
            )
            .map_err(anyhow::Error::msg)?;
            Db::Postgres {
                server: server.to_owned(),
                name,
            }
        }
        _ => Db::Sqlite(dir.join(format!("bench-{tag}.sqlite3"))),
    })
}

fn uuid_tag() -> String {
    sessiond_domain::TaskId::new().to_string().replace('-', "")[..16].to_owned()
}

fn say(msg: impl AsRef<str>) {
    eprintln!("bench: {}", msg.as_ref());
}

/// The turn path (see `turn.rs`) on SQLite and, unless `--no-postgres`,
/// on PostgreSQL: printed, and written between its own markers.
async fn run_turns(opts: &Opts, dir: &Path) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let (pg_url, _cluster) = if opts.postgres {
        let (url, cluster) = postgres().await?;
        (Some(url), cluster)
    } else {
        (None, None)
    };
    for backend in ["sqlite", "postgres"] {
        if backend == "postgres" && pg_url.is_none() {
            continue;
        }
        let db = new_db(backend, dir, pg_url.as_deref())?;
        let store = recovery::open(&db.url()).await?;
        let tdir = dir.join(format!("turns-{backend}"));
        std::fs::create_dir_all(&tdir)?;
        // On a worker, as a gRPC handler calls SendMessage, not on the
        // `block_on` thread (both paths are measured there).
        let row =
            tokio::spawn(turn::measure(store, opts.bin_dir.clone(), tdir, opts.turns)).await??;
        say(report::turn_line(backend, &row));
        rows.push((backend, row));
    }
    let text = report::render_turn(&rows, &opts.command);
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    if let Some(out) = &opts.out {
        report::write_between(out, report::TURN_BEGIN, report::TURN_END, &text)?;
        say(format!("wrote the turn path into {}", out.display()));
    }
    Ok(())
}

/// The burst of heavy relaunches (see `burst.rs`): printed, and written
/// between its own markers.
async fn run_burst(opts: &Opts, dir: &Path) -> anyhow::Result<()> {
    let row = burst::measure(&opts.bin_dir, dir, opts.burst).await?;
    say(burst::line(&row));
    let text = burst::render(&row, &opts.command);
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    if let Some(out) = &opts.out {
        report::write_between(out, burst::BEGIN, burst::END, &text)?;
        say(format!("wrote the burst section into {}", out.display()));
    }
    Ok(())
}

async fn run(opts: Opts) -> anyhow::Result<()> {
    let total = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("sessiond-bench-")
        .tempdir()?;
    let only = opts.only_turns || opts.only_availability || opts.only_replicas || opts.only_burst;
    if opts.turns > 0 && (!only || opts.only_turns) {
        run_turns(&opts, dir.path()).await?;
    }
    if opts.only_turns {
        return Ok(());
    }
    if opts.burst > 0 && (!only || opts.only_burst) {
        run_burst(&opts, dir.path()).await?;
    }
    if opts.only_burst {
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let mut report = Report::new(&opts.command);

    // The fleet: one process answering for every remote executor, on 4 ports.
    let mut fleet_cmd = Command::new(&exe);
    fleet_cmd.args(["fleet", "4"]);
    let (fleet, fleet_addrs) = spawn_with_addrs(fleet_cmd, "fleet listening on", 4)?;
    let fleet_urls: Vec<String> = fleet_addrs.iter().map(|a| format!("http://{a}")).collect();
    say(format!(
        "fleet pid {} on {}",
        fleet.pid(),
        fleet_addrs.join(", ")
    ));

    if opts.only_replicas {
        let (pg, _cluster) = postgres().await?;
        run_replicas(&opts, dir.path(), &pg, &fleet_urls).await?;
        return Ok(());
    }
    if opts.availability_n > 0 {
        let row = availability::measure(
            dir.path(),
            &opts.bin_dir,
            &fleet_urls,
            opts.availability_n,
            opts.availability_pairs,
        )
        .await?;
        say(availability::line(&row));
        let text = availability::render(&row, &opts.command);
        #[allow(clippy::print_stdout)]
        {
            println!("{text}");
        }
        if let Some(out) = &opts.out {
            report::write_between(out, availability::BEGIN, availability::END, &text)?;
            say(format!("wrote availability into {}", out.display()));
        }
    }
    if opts.only_availability {
        return Ok(());
    }

    // PostgreSQL: DATABASE_URL, else a throwaway cluster of our own.
    let (pg_url, _cluster) = if !opts.postgres {
        (None, None)
    } else {
        let (url, cluster) = postgres().await?;
        (Some(url), cluster)
    };

    // 1. Startup recovery of remote executors.
    let mut backends = vec!["sqlite"];
    if pg_url.is_some() {
        backends.push("postgres");
    }
    let mut rss_db: Option<(Db, Vec<seed::Seeded>)> = None;
    for backend in &backends {
        for &n in &opts.sizes {
            // Small N takes ~100 ms, where one scheduling hiccup of a shared
            // machine moves the ratio; take the median of fresh rounds.
            let rounds = if n <= 1_000 { 5 } else { 1 };
            let mut measured = Vec::new();
            let mut outcomes = String::new();
            for _ in 0..rounds {
                let db = new_db(backend, dir.path(), pg_url.as_deref())?;
                let url = db.url();
                let t = Instant::now();
                let seeded = {
                    let store = recovery::open(&url).await?;
                    let profile = seed::profile(&store).await?;
                    let s = seed::remote_sessions(&store, &profile, &fleet_urls, n).await?;
                    // Warm the page cache alike for both measurements.
                    store.load_recoverable_executors().await?;
                    s
                };
                say(format!(
                    "{backend} N={n}: seeded in {:.1}s",
                    t.elapsed().as_secs_f64()
                ));
                let baseline =
                    recovery::baseline(&url, recovery::manager_config().recovery_concurrency)
                        .await?;
                let (took, o) =
                    recovery::recover(&url, recovery::remote_drivers(), OutcomeLabel::Resumed, n)
                        .await?;
                measured.push((took, baseline));
                outcomes = o;
                if *backend == "sqlite" && n == opts.rss_sessions {
                    rss_db = Some((db, seeded));
                }
            }
            let row =
                RecoveryRow::from_rounds(format!("remote, {backend}"), n, outcomes, &measured);
            say(report::recovery_line(&row));
            report.recovery.push(row);
        }
    }

    // 2. Standalone executors: real agentctl processes.
    if opts.standalone > 0 {
        let db = new_db("sqlite", dir.path(), None)?;
        let url = db.url();
        let sdir = dir.path().join("standalone");
        std::fs::create_dir_all(&sdir)?;
        let store = recovery::open(&url).await?;
        let t = Instant::now();
        let made = standalone::create(&store, &opts.bin_dir, &sdir, opts.standalone).await;
        let result = async {
            let made = made.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            say(format!(
                "standalone: {} sessions created in {:.1}s",
                made.len(),
                t.elapsed().as_secs_f64()
            ));
            // A reattach leaves the world as it found it, so the same
            // processes serve five rounds; report the medians.
            let mut measured = Vec::new();
            let mut outcomes = String::new();
            for _ in 0..5 {
                let baseline =
                    recovery::baseline(&url, recovery::manager_config().recovery_concurrency)
                        .await?;
                let (took, o) = recovery::recover(
                    &url,
                    standalone::drivers(&opts.bin_dir, &sdir),
                    OutcomeLabel::Reattached,
                    made.len(),
                )
                .await?;
                measured.push((took, baseline));
                outcomes = o;
            }
            Ok::<_, anyhow::Error>(RecoveryRow::from_rounds(
                "standalone (agentctl processes), sqlite".into(),
                made.len(),
                outcomes,
                &measured,
            ))
        }
        .await;
        // Whatever happened: end every process this part started.
        let created = match &made {
            Ok(m) => m.clone(),
            Err(_) => Vec::new(),
        };
        standalone::cleanup(&store, &opts.bin_dir, &sdir, &created).await;
        let row = result?;
        say(report::recovery_line(&row));
        report.recovery.push(row);
    }

    // 3. `sessiond serve` over the 10,000-session SQLite database: peak RSS
    //    after startup recovery, then GetSessionStatus under load.
    let clients = 32;
    let duration = Duration::from_secs(opts.load_secs);
    if let Some((db, seeded)) = &rss_db {
        // The yardstick runs before sessiond starts and after it stops; the
        // mean of both stands beside the status load between them, so a
        // drift of the shared machine's load moves both sides alike.
        let echo_before = measure_echo(&exe, clients, duration).await?;
        let data = dir.path().join("sessiond-data");
        // SESSIOND_BENCH_WRAP (e.g. `heaptrack -o /tmp/h`): run the server
        // under a profiler; its figures then describe the profiled run.
        let wrapped = std::env::var("SESSIOND_BENCH_WRAP")
            .ok()
            .filter(|w| !w.trim().is_empty());
        let mut cmd = match &wrapped {
            Some(w) => {
                let mut words = w.split_whitespace();
                let mut c = Command::new(words.next().unwrap_or_default());
                c.args(words).arg(opts.bin_dir.join("sessiond"));
                // Its own process group, ended as one (`stop_wrapped`).
                std::os::unix::process::CommandExt::process_group(&mut c, 0);
                c
            }
            None => Command::new(opts.bin_dir.join("sessiond")),
        };
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
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(dir.path().join("sessiond.log"))?);
        let t = Instant::now();
        let (mut server, addrs) = spawn_with_addrs(cmd, "sessiond listening on", 1)?;
        let addr = addrs[0].clone();
        let ready = load::wait_serving(&addr, Duration::from_secs(300)).await?;
        let after_recovery = proc_status(server.pid())?;
        let log = std::fs::read_to_string(dir.path().join("sessiond.log")).unwrap_or_default();
        for line in log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .take(3)
        {
            say(format!("sessiond log: {line}"));
        }
        say(format!(
            "sessiond serve: {} sessions recovered, SERVING after {:.2}s (since spawn {:.2}s); VmHWM {} MiB",
            seeded.len(),
            ready.as_secs_f64(),
            t.elapsed().as_secs_f64(),
            after_recovery.0 / 1024
        ));
        let cpu_before = proc_cpu(server.pid())?;
        let mut status = load::status(&addr, seeded, clients, duration).await?;
        status.server_cpu = proc_cpu(server.pid())?.saturating_sub(cpu_before);
        let after_load = proc_status(server.pid())?;
        // Idle cost: the window runs past the first liveness round (one
        // `Health` per executor, `LIVENESS_INTERVAL` after SERVING) and the
        // few seconds it takes.
        let idle = if opts.idle_window {
            let serving_at = t + ready;
            let until = serving_at + LIVENESS_INTERVAL + Duration::from_secs(20);
            let (s0, f0) = (proc_cpu(server.pid())?, proc_cpu(fleet.pid())?);
            let from = Instant::now();
            tokio::time::sleep_until(until.into()).await;
            let idle = report::IdleCpu {
                window: from.elapsed(),
                server_cpu: proc_cpu(server.pid())?.saturating_sub(s0),
                fleet_cpu: proc_cpu(fleet.pid())?.saturating_sub(f0),
            };
            say(format!(
                "idle {:.0} s: sessiond {:.2} s CPU, fleet {:.2} s CPU",
                idle.window.as_secs_f64(),
                idle.server_cpu.as_secs_f64(),
                idle.fleet_cpu.as_secs_f64()
            ));
            Some(idle)
        } else {
            None
        };
        if wrapped.is_some() {
            stop_wrapped(&mut server);
        }
        drop(server);

        let echo = echo_before.mean(&measure_echo(&exe, clients, duration).await?);
        report.rss = Some(report::Rss {
            sessions: seeded.len(),
            serving_after: ready,
            hwm_after_recovery_kib: after_recovery.0,
            rss_after_recovery_kib: after_recovery.1,
            hwm_after_load_kib: after_load.0,
            idle,
        });
        report.status = Some(report::StatusRow {
            clients,
            duration,
            status,
            echo,
        });
        say(report::status_line(
            report.status.as_ref().context("status")?,
        ));
    }

    // 4. Event latency, in process: commit -> watch_session subscribers.
    {
        let db = new_db("sqlite", dir.path(), None)?;
        let store = recovery::open(&db.url()).await?;
        let profile = seed::profile(&store).await?;
        let seeded = seed::remote_sessions(&store, &profile, &fleet_urls, 1_000).await?;
        let (s, others) = (seeded[0], &seeded[1..]);
        let manager = SessionManager::new(store, Vec::new(), recovery::manager_config());
        // Enough events that one scheduling stall of the shared machine (it
        // delays all 1,000 deliveries of that event) stays under the p99.
        // The third row: one watcher each on 999 other sessions, to which
        // no event goes (fan-out is per session).
        for (subs, bystanders, events) in [
            (1usize, 0usize, 1_000usize),
            (1_000, 0, 500),
            (1, others.len(), 1_000),
        ] {
            let l = events::latency(
                &manager,
                s,
                subs,
                &others[..bystanders],
                events,
                Duration::from_millis(5),
            )
            .await?;
            say(report::latency_line(&l));
            report.latency.push(l);
        }
        manager.shutdown();
    }

    // 5. Replicas on one PostgreSQL: adoption, events across replicas.
    if let Some(pg) = &pg_url
        && opts.replicas_n > 0
    {
        run_replicas(&opts, dir.path(), pg, &fleet_urls).await?;
    }

    drop(fleet);
    report.total = total.elapsed();
    let text = report.render();
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    if let Some(out) = &opts.out {
        report::write_into(out, &text)?;
        say(format!("wrote {}", out.display()));
    }
    Ok(())
}

/// PostgreSQL for the measurements that need it: `DATABASE_URL`, else a
/// throwaway cluster of our own (stopped when the guard drops).
async fn postgres() -> anyhow::Result<(String, Option<sessiond_testkit::postgres::Cluster>)> {
    match std::env::var("DATABASE_URL") {
        Ok(u) if !u.is_empty() => Ok((u, None)),
        _ => {
            let c = tokio::task::spawn_blocking(sessiond_testkit::postgres::try_start_cluster)
                .await?
                .map_err(anyhow::Error::msg)
                .context("starting a throwaway PostgreSQL (set DATABASE_URL to use another)")?;
            Ok((c.url().to_owned(), Some(c)))
        }
    }
}

/// Adoption by two survivors and event latency across replicas
/// (`replicas.rs`): printed, and written between their own markers.
async fn run_replicas(
    opts: &Opts,
    dir: &Path,
    pg: &str,
    fleet_urls: &[String],
) -> anyhow::Result<()> {
    let adoption = replicas::adoption(
        dir,
        &opts.bin_dir,
        pg,
        fleet_urls,
        opts.replicas_n,
        opts.lease_ttl,
    )
    .await?;
    let events =
        replicas::cross_latency(dir, pg, fleet_urls, 1_000, Duration::from_millis(5)).await?;
    say(replicas::line(&adoption, &events));
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let text = replicas::render(&adoption, &events, &opts.command, build);
    #[allow(clippy::print_stdout)]
    {
        println!("{text}");
    }
    if let Some(out) = &opts.out {
        report::write_between(out, replicas::BEGIN, replicas::END, &text)?;
        say(format!("wrote the replicas section into {}", out.display()));
    }
    Ok(())
}

/// Ends a wrapped `sessiond serve` and its wrapper: SIGINT to the group
/// (sessiond shuts down, a profiler writes its data), SIGKILL to the group
/// after 10 s. Killing the wrapper alone left sessiond running.
fn stop_wrapped(server: &mut ChildGuard) {
    let group = format!("-{}", server.pid());
    let signal = |name: &str| {
        let _ = Command::new("kill")
            .args([name, "--", &group])
            .stderr(Stdio::null())
            .status();
    };
    signal("-INT");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && matches!(server.0.try_wait(), Ok(None)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    signal("-KILL");
}

/// The bare tonic yardstick (`sessiond-bench echo`, a child process)
/// under the status load's clients.
async fn measure_echo(
    exe: &std::path::Path,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<load::Load> {
    let mut cmd = Command::new(exe);
    cmd.arg("echo");
    let (child, addrs) = spawn_with_addrs(cmd, "echo listening on", 1)?;
    let cpu_before = proc_cpu(child.pid())?;
    let mut echo = load::echo(&addrs[0], clients, duration).await?;
    echo.server_cpu = proc_cpu(child.pid())?.saturating_sub(cpu_before);
    drop(child);
    Ok(echo)
}

/// `sessiond serve`'s liveness interval with the default configuration
/// (executors never idle out): min(30 s, idle timeout / 3).
const LIVENESS_INTERVAL: Duration = Duration::from_secs(30);

/// User + system CPU a process has used (`/proc/PID/stat`, clock ticks).
fn proc_cpu(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .context("unreadable /proc stat")?;
    // After the command: state is field 3, utime 14 and stime 15.
    let field = |n: usize| -> anyhow::Result<u64> {
        Ok(rest
            .split_whitespace()
            .nth(n - 3)
            .context("short /proc stat")?
            .parse()?)
    };
    let ticks = field(14)? + field(15)?;
    Ok(Duration::from_secs_f64(
        ticks as f64 / clock_ticks()? as f64,
    ))
}

/// `getconf CLK_TCK`: the unit of /proc's CPU times.
fn clock_ticks() -> anyhow::Result<u64> {
    let out = Command::new("getconf").arg("CLK_TCK").output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// (VmHWM, VmRSS) of a process, in KiB.
fn proc_status(pid: u32) -> anyhow::Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmHWM:"), field("VmRSS:")))
}
