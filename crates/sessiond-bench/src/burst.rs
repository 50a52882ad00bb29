//! A burst of heavy relaunches (`--burst N`, default 32; `--only-burst`):
//! N standalone sessions whose agents are slow to start (the demo agent's
//! heavy mode), `kill -9` of every agentctl and agent, then a fresh
//! `SessionManager` with the default settings recovers them with no call.
//!
//! Beside it, in the same run:
//! - T1: the same recovery of one session alone (median of 3);
//! - a bare baseline without sessiond's launch scheduler: the same N
//!   relaunches straight through agentctl (the driver's spawn, then
//!   `LaunchAgent` and `ResumeSession` on an `AgentctlClient`) at fixed
//!   concurrencies, whose best wall time says what parallelism P the host
//!   sustains (P = N * T1 / best wall time).
//!
//! The ratio is the pass's time until every agent is back over T1 * N / P.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::{StreamExt, TryStreamExt};
use rustix::process::{Pid, Signal};
use sessiond_domain::{
    AgentProfile, AgentProfileId, OutcomeLabel, PermissionPolicy, Runtime, SessionId, SessionState,
    Task, TaskId, TaskState, Worktree,
};
use sessiond_engine::{ManagerConfig, NewSession, SessionManager};
use sessiond_executor::{
    ExecutorHandle,
    process::{self, OwnedProcess},
};
use sessiond_proto::agentctl::v1 as pb;
use sessiond_store::Store;

use crate::{
    recovery::{manager_config, open},
    report::{machine, ms, verdict},
    standalone::drivers,
};

pub const BEGIN: &str = "<!-- bench:burst:begin -->";
pub const END: &str = "<!-- bench:burst:end -->";

/// The demo agent's heavy mode: it sleeps, burns CPU and holds memory
/// before it serves (>= 2 s to relaunch alone), and its `session/load`
/// burns CPU per stored history message. An agent built without heavy
/// mode ignores these (T1 then says so).
pub const HEAVY: &[(&str, &str)] = &[
    ("ACP_DEMO_STARTUP_MS", "1500"),
    ("ACP_DEMO_BUSY_MS", "600"),
    ("ACP_DEMO_RSS_MB", "32"),
    ("ACP_DEMO_LOAD_MS_PER_MESSAGE", "50"),
];

/// Prompts each session answers before the kill: its history to load.
pub const PROMPTS: usize = 3;

/// Concurrencies of the bare baseline.
pub const CONCURRENCY: [usize; 4] = [1, 2, 4, 8];

/// Rounds of the single-session recovery (T1 is their median).
const T1_ROUNDS: usize = 3;

/// The bare baseline at one concurrency.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub concurrency: usize,
    pub wall: Duration,
    /// Median of one relaunch's own time (spawn to resumed).
    pub each_p50: Duration,
    /// Relaunches that failed (the wall time then does not count).
    pub failed: usize,
    /// The 1-minute load average when it began.
    pub load: f64,
}

#[derive(Debug, Clone)]
pub struct BurstRow {
    pub n: usize,
    pub t1_rounds: Vec<Duration>,
    pub baselines: Vec<Baseline>,
    /// `summary.duration`: every agent back.
    pub all_back: Duration,
    /// `summary.workspaces_back`: what SERVING waits for.
    pub serving: Duration,
    /// When `wait_workspaces_recovered` returned, from the pass's start.
    pub serving_seen: Duration,
    pub not_back: usize,
    pub failed: usize,
    /// Sessions not WAITING_FOR_INPUT with their agent running after the pass.
    pub errors: usize,
    pub outcomes: String,
    /// User + system CPU of this process (the manager) during the pass.
    pub cpu: Duration,
    /// Peak resident memory of this process during the pass, and before it.
    pub rss_peak_kib: u64,
    pub rss_before_kib: u64,
    pub pass_load: f64,
    /// Creating the N sessions and their history (not timed against anything).
    pub setup: Duration,
}

impl BurstRow {
    /// T1: the median single-session recovery.
    pub fn t1(&self) -> Duration {
        let mut v = self.t1_rounds.clone();
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    }

    /// The bare baseline with the best wall time (no failed relaunch).
    pub fn best(&self) -> Option<&Baseline> {
        self.baselines
            .iter()
            .filter(|b| b.failed == 0)
            .min_by_key(|b| b.wall)
    }

    /// P = N * T1 / best bare wall time.
    pub fn parallelism(&self) -> f64 {
        let best = self.best().map_or(0.0, |b| b.wall.as_secs_f64());
        self.n as f64 * self.t1().as_secs_f64() / best.max(1e-9)
    }

    /// T1 * N / P (the best bare wall time, by construction).
    pub fn baseline_time(&self) -> Duration {
        let p = self.parallelism();
        if p <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(self.t1().as_secs_f64() * self.n as f64 / p)
    }

    pub fn ratio(&self) -> f64 {
        self.all_back.as_secs_f64() / self.baseline_time().as_secs_f64().max(1e-9)
    }

    /// CPU of the pass as a share of one core.
    pub fn cpu_share(&self) -> f64 {
        self.cpu.as_secs_f64() / self.all_back.as_secs_f64().max(1e-9)
    }

    /// Whether the agent ran in heavy mode (>= 2 s to relaunch alone).
    pub fn heavy(&self) -> bool {
        self.t1() >= Duration::from_secs(2)
    }
}

/// One store of standalone sessions, in its own directory.
struct World {
    dir: PathBuf,
    url: String,
    store: Store,
    task: TaskId,
    profile: AgentProfile,
    sessions: Vec<SessionId>,
}

/// Every agentctl this part started or recovered, killed (by pid and start
/// time) when it ends, whatever happened.
#[derive(Default, Clone)]
struct Reaper(Arc<Mutex<Vec<(u32, u64)>>>);

impl Reaper {
    fn add(&self, pid: u32, start_time: u64) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !v.contains(&(pid, start_time)) {
            v.push((pid, start_time));
        }
    }

    fn kill_all(&self) {
        let all = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for (pid, st) in all {
            kill_tree(pid, st);
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if Arc::strong_count(&self.0) == 1 {
            self.kill_all();
        }
    }
}

/// The manager of the measured pass: the default settings.
fn pass_config() -> ManagerConfig {
    ManagerConfig::default()
}

pub async fn measure(bin_dir: &Path, dir: &Path, n: usize) -> anyhow::Result<BurstRow> {
    let reaper = Reaper::default();
    let result = measure_with(bin_dir, dir, n, &reaper).await;
    reaper.kill_all();
    result
}

async fn measure_with(
    bin_dir: &Path,
    dir: &Path,
    n: usize,
    reaper: &Reaper,
) -> anyhow::Result<BurstRow> {
    let t = Instant::now();
    let many = world(bin_dir, &dir.join("burst-n"), n, reaper).await?;
    let one = world(bin_dir, &dir.join("burst-1"), 1, reaper).await?;
    let setup = t.elapsed();
    say(format!(
        "burst: {n} + 1 heavy sessions with {PROMPTS} prompts each made in {:.1}s",
        setup.as_secs_f64()
    ));
    kill_world(&many).await?;

    // T1: one session alone, recovered by a fresh manager (median of 3).
    let mut t1_rounds = Vec::new();
    for _ in 0..T1_ROUNDS {
        kill_world(&one).await?;
        let (summary, _) = pass(bin_dir, &one, reaper).await?;
        anyhow::ensure!(
            summary.count(OutcomeLabel::Resumed) == 1 && summary.not_back == 0,
            "the single session did not come back: {:?}",
            summary.counts
        );
        t1_rounds.push(summary.duration);
    }
    kill_world(&one).await?;
    say(format!(
        "burst: T1 rounds {}",
        t1_rounds
            .iter()
            .map(|d| ms(*d))
            .collect::<Vec<_>>()
            .join(", ")
    ));

    // The bare baseline: N relaunches at a fixed concurrency, no scheduler.
    let mut baselines = Vec::new();
    for c in CONCURRENCY {
        let b = bare(bin_dir, &many, c, reaper).await?;
        say(format!(
            "burst: bare c={c}: {} wall, {} per relaunch (p50), failed {}, load {:.1}",
            ms(b.wall),
            ms(b.each_p50),
            b.failed,
            b.load
        ));
        baselines.push(b);
    }

    // The measured pass: everything killed, a fresh manager, no call.
    kill_world(&many).await?;
    let pass_load = loadavg();
    let rss_before_kib = proc_self("VmRSS:");
    let peak_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let sampled = Arc::new(AtomicU64::new(rss_before_kib));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn({
        let (sampled, stop) = (sampled.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                sampled.fetch_max(proc_self("VmRSS:"), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let cpu0 = crate::proc_cpu(std::process::id())?;
    let (summary, (serving_seen, errors)) = pass(bin_dir, &many, reaper).await?;
    let cpu = crate::proc_cpu(std::process::id())?.saturating_sub(cpu0);
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let hwm = if peak_reset { proc_self("VmHWM:") } else { 0 };
    let rss_peak_kib = hwm.max(sampled.load(Ordering::Relaxed));
    kill_world(&many).await?;
    let outcomes = summary
        .counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    Ok(BurstRow {
        n,
        t1_rounds,
        baselines,
        all_back: summary.duration,
        serving: summary.workspaces_back,
        serving_seen,
        not_back: summary.not_back,
        failed: summary.failed,
        errors,
        outcomes,
        cpu,
        rss_peak_kib,
        rss_before_kib,
        pass_load,
        setup,
    })
}

/// A fresh store pool and manager (the default settings) recover `w` with
/// no call. Returns the summary, when `wait_workspaces_recovered` returned,
/// and how many sessions are not WAITING_FOR_INPUT with a running agent.
async fn pass(
    bin_dir: &Path,
    w: &World,
    reaper: &Reaper,
) -> anyhow::Result<(sessiond_engine::RecoverySummary, (Duration, usize))> {
    let store = open(&w.url).await?;
    let manager = SessionManager::new(store, drivers(bin_dir, &w.dir), pass_config());
    let started = Instant::now();
    let run = tokio::spawn({
        let manager = manager.clone();
        async move { manager.recovery().recover_all().await }
    });
    manager.recovery().wait_workspaces_recovered().await;
    let serving_seen = started.elapsed();
    let summary = run.await??;
    let mut errors = 0;
    for s in &w.sessions {
        let st = manager.session_status(w.task, *s).await?;
        if st.state != SessionState::WaitingForInput || !st.is_agent_running || st.recovering {
            errors += 1;
            say(format!(
                "burst: session {s} after the pass: {} running={} recovering={} ({:?})",
                st.state, st.is_agent_running, st.recovering, st.error_message
            ));
        }
    }
    manager.shutdown();
    track(w, reaper).await?;
    Ok((summary, (serving_seen, errors)))
}

/// Creates `n` heavy standalone sessions in `dir`, each answering
/// [`PROMPTS`] prompts; leaves their agentctls running.
async fn world(bin_dir: &Path, dir: &Path, n: usize, reaper: &Reaper) -> anyhow::Result<World> {
    std::fs::create_dir_all(dir)?;
    let url = format!("sqlite://{}", dir.join("sessiond.sqlite3").display());
    let store = open(&url).await?;
    let now = Utc::now();
    let profile = store
        .upsert_agent_profile(&AgentProfile {
            id: AgentProfileId::new(),
            name: "demo-heavy".into(),
            command: bin_dir.join("acp-demo-agent").display().to_string(),
            args: vec![
                "--state-dir".into(),
                dir.join("agent-state").display().to_string(),
            ],
            env: HEAVY
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            supports_session_resume: true,
            container: None,
            auth_method: None,
            permission_policy: PermissionPolicy::Allow,
            permission_timeout: sessiond_domain::DEFAULT_PERMISSION_TIMEOUT,
            config_defaults: Default::default(),
            mcp_servers: Vec::new(),
            created_at: now,
            updated_at: now,
        })
        .await?;
    let task = store
        .create_task(&Task {
            id: TaskId::new(),
            title: "burst bench".into(),
            state: TaskState::InProgress,
            created_at: now,
            updated_at: now,
        })
        .await?;
    let manager = SessionManager::new(store.clone(), drivers(bin_dir, dir), manager_config());
    let made: anyhow::Result<Vec<SessionId>> = futures::stream::iter(0..n)
        .map(|i| {
            let manager = manager.clone();
            let path = dir.join(format!("wt-{i}"));
            async move {
                std::fs::create_dir_all(&path)?;
                let s = manager
                    .create_session(NewSession {
                        task_id: task.id,
                        agent_profile_id: profile.id,
                        runtime: Runtime::LocalStandalone,
                        worktree: Worktree {
                            id: format!("wt-{i}"),
                            path: path.display().to_string(),
                            branch: format!("sessiond/wt-{i}"),
                            ..Default::default()
                        },
                        remote: None,
                        metadata: BTreeMap::new(),
                        mcp_servers: Vec::new(),
                    })
                    .await?;
                anyhow::ensure!(
                    s.state == SessionState::WaitingForInput,
                    "burst session {} is {} ({:?})",
                    s.id,
                    s.state,
                    s.error_message
                );
                for p in 0..PROMPTS {
                    prompt(&manager, task.id, s.id, &format!("burst prompt {p}")).await?;
                }
                Ok(s.id)
            }
        })
        .buffer_unordered(4)
        .try_collect()
        .await;
    manager.shutdown();
    let mut w = World {
        dir: dir.to_owned(),
        url,
        store,
        task: task.id,
        profile,
        sessions: Vec::new(),
    };
    // Whatever was made is tracked, so that it ends with the bench.
    let tasks = w.store.list_sessions(task.id).await?;
    w.sessions = tasks.iter().map(|s| s.id).collect();
    track(&w, reaper).await?;
    let made = made?;
    anyhow::ensure!(made.len() == n, "made {} of {n} sessions", made.len());
    w.sessions = made;
    Ok(w)
}

/// Sends a message and waits for the turn to end.
async fn prompt(
    manager: &SessionManager,
    task: TaskId,
    session: SessionId,
    text: &str,
) -> anyhow::Result<()> {
    manager.send_message(task, session, text).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let st = manager.session_status(task, session).await?;
        match st.state {
            SessionState::WaitingForInput => return Ok(()),
            SessionState::Error => {
                anyhow::bail!("burst session {session} failed: {:?}", st.error_message)
            }
            _ => {}
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "burst session {session} stayed {}",
            st.state
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Hands the world's recorded agentctls to the reaper.
async fn track(w: &World, reaper: &Reaper) -> anyhow::Result<()> {
    for s in &w.sessions {
        if let Some(r) = w.store.get_executor_for_session(*s).await?
            && let (Some(pid), Some(st)) = (r.pid, r.pid_start_time)
        {
            reaper.add(pid, st);
        }
    }
    Ok(())
}

/// `kill -9` of every agentctl the world's records name, and of their
/// agents; returns once they are gone.
async fn kill_world(w: &World) -> anyhow::Result<()> {
    let mut victims = Vec::new();
    for s in &w.sessions {
        if let Some(r) = w.store.get_executor_for_session(*s).await?
            && let (Some(pid), Some(st)) = (r.pid, r.pid_start_time)
        {
            victims.extend(kill_tree(pid, st));
        }
    }
    wait_gone(&victims).await
}

/// SIGKILL to agentctl `(pid, start_time)`'s process group and to the
/// process group of each of its children (the agent leads its own), each
/// only if that very process still runs and leads its group. Returns what
/// was signalled, to wait for.
fn kill_tree(pid: u32, start_time: u64) -> Vec<(u32, u64)> {
    let Some(agentctl) = OwnedProcess::open(pid, start_time) else {
        return Vec::new();
    };
    let mut victims = vec![(pid, start_time)];
    // The children first: once agentctl is gone they are no longer its.
    let kids: Vec<(u32, u64)> = children_of(pid)
        .into_iter()
        .filter_map(|k| Some((k, process::start_time(k)?)))
        .collect();
    for &(k, kst) in &kids {
        kill_group_of(k, kst);
        victims.push((k, kst));
    }
    kill_group_of(pid, start_time);
    let _ = agentctl.signal(Signal::KILL);
    victims
}

/// SIGKILL to the process group `pid` leads, if `(pid, start_time)` still
/// runs and leads it; else to that process alone.
fn kill_group_of(pid: u32, start_time: u64) {
    let Some(p) = OwnedProcess::open(pid, start_time) else {
        return;
    };
    if pgrp(pid) == Some(pid)
        && let Some(group) = i32::try_from(pid).ok().and_then(Pid::from_raw)
    {
        let _ = rustix::process::kill_process_group(group, Signal::KILL);
    }
    let _ = p.signal(Signal::KILL);
}

async fn wait_gone(victims: &[(u32, u64)]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while victims
        .iter()
        .any(|(p, st)| process::is_same_running(*p, *st))
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "processes survived kill -9: {victims:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Direct children of `pid` (`/proc/*/stat` field 4).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|c| stat_field(*c, 4) == Some(pid))
        .collect()
}

/// The process group of `pid` (`/proc/PID/stat` field 5).
fn pgrp(pid: u32) -> Option<u32> {
    stat_field(pid, 5)
}

fn stat_field(pid: u32, n: usize) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n - 3)?.parse().ok()
}

/// The bare baseline: every session of `w` relaunched straight through
/// agentctl (spawn, `LaunchAgent`, `ResumeSession`), `concurrency` at a
/// time; everything killed before and after.
async fn bare(
    bin_dir: &Path,
    w: &World,
    concurrency: usize,
    reaper: &Reaper,
) -> anyhow::Result<Baseline> {
    kill_world(w).await?;
    let driver = drivers(bin_dir, &w.dir)
        .into_iter()
        .find(|d| d.runtime() == Runtime::LocalStandalone)
        .ok_or_else(|| anyhow::anyhow!("no standalone driver"))?;
    let agent = w.profile.agent_command(Runtime::LocalStandalone);
    let request = pb::LaunchAgentRequest {
        command: agent.command,
        args: agent.args,
        env: agent.env.into_iter().collect(),
        profile_supports_session_resume: true,
        initialize_timeout_ms: u64::try_from(pass_config().agent_initialize_timeout.as_millis())
            .unwrap_or(u64::MAX),
        auth_method: String::new(),
        permission_policy: pb::PermissionPolicy::Allow as i32,
        permission_timeout_ms: u64::try_from(w.profile.permission_timeout.as_millis())
            .unwrap_or(u64::MAX),
        config_defaults: Default::default(),
        mcp_servers: Vec::new(),
    };
    let mut work = Vec::new();
    for s in &w.sessions {
        let record = w
            .store
            .get_executor_for_session(*s)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no executor for {s}"))?;
        let token = w
            .store
            .get_session(*s)
            .await?
            .resume_token
            .ok_or_else(|| anyhow::anyhow!("no resume token for {s}"))?;
        let mut spec = ExecutorHandle::from_record(&record).relaunch_spec();
        // An exclusive store (SQLite) carries no lease epoch, as recovery.
        spec.lease_epoch = None;
        work.push((spec, token));
    }
    let launched = Reaper::default();
    let load = loadavg();
    let t = Instant::now();
    let results: Vec<anyhow::Result<Duration>> = futures::stream::iter(work)
        .map(|(spec, token)| {
            let (driver, request, launched) = (driver.clone(), request.clone(), launched.clone());
            async move {
                let t = Instant::now();
                let handle = driver.launch(&spec).await?;
                if let (Some(pid), Some(st)) = (handle.pid, handle.pid_start_time) {
                    launched.add(pid, st);
                }
                let client = driver.client(&handle)?;
                client.launch_agent(request).await?;
                client.resume_session(&token).await?;
                Ok(t.elapsed())
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let wall = t.elapsed();
    // Kill what this round started (and hand nothing to the next).
    let victims: Vec<(u32, u64)> = {
        let all = launched.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (pid, st) in &all {
            reaper.add(*pid, *st);
        }
        all.iter().flat_map(|(p, st)| kill_tree(*p, *st)).collect()
    };
    launched.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    wait_gone(&victims).await?;
    let mut each = Vec::new();
    let mut failed = 0;
    for r in results {
        match r {
            Ok(d) => each.push(d),
            Err(e) => {
                failed += 1;
                say(format!(
                    "burst: bare relaunch at c={concurrency} failed: {e:#}"
                ));
            }
        }
    }
    each.sort();
    Ok(Baseline {
        concurrency,
        wall,
        each_p50: each.get(each.len() / 2).copied().unwrap_or_default(),
        failed,
        load,
    })
}

/// A field of `/proc/self/status` in KiB (`VmRSS:`, `VmHWM:`).
fn proc_self(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The 1-minute load average.
fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

fn say(msg: impl AsRef<str>) {
    crate::say(msg);
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

pub fn line(r: &BurstRow) -> String {
    format!(
        "burst N={}: all back {} (SERVING {}, seen {}), T1 {} x N / P {:.2} = {} -> {:.2}x; not back {}, ERROR/not running {}; CPU {:.2} s ({:.0} % of a core), peak RSS {} [{}]",
        r.n,
        ms(r.all_back),
        ms(r.serving),
        ms(r.serving_seen),
        ms(r.t1()),
        r.parallelism(),
        ms(r.baseline_time()),
        r.ratio(),
        r.not_back,
        r.errors,
        r.cpu.as_secs_f64(),
        100.0 * r.cpu_share(),
        mib(r.rss_peak_kib),
        r.outcomes
    )
}

/// The burst section (between [`BEGIN`] and [`END`]).
pub fn render(r: &BurstRow, command: &str) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let _ = writeln!(
        o,
        "- Machine: {}; {}; `{command}` ({build} build)",
        machine(),
        Utc::now().format("%Y-%m-%d %H:%M UTC"),
    );
    let heavy = HEAVY
        .iter()
        .map(|(k, v)| format!("`{k}={v}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        o,
        "- Agent: the demo agent with {heavy}; {PROMPTS} prompts answered per session before the kill. \
         Heavy mode in effect (T1 >= 2 s): {}.",
        if r.heavy() {
            "yes"
        } else {
            "**no** (this agent build ignores it)"
        }
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "| bare baseline: {} relaunches (spawn agentctl, `LaunchAgent`, `ResumeSession`) | wall | one relaunch, p50 | failed | load avg at start |",
        r.n
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|");
    for b in &r.baselines {
        let best = r
            .best()
            .is_some_and(|x| x.concurrency == b.concurrency && x.wall == b.wall);
        let _ = writeln!(
            o,
            "| concurrency {}{} | {} | {} | {} | {:.1} |",
            b.concurrency,
            if best { " (best)" } else { "" },
            ms(b.wall),
            ms(b.each_p50),
            b.failed,
            b.load
        );
    }
    let _ = writeln!(o);
    let t1s = r
        .t1_rounds
        .iter()
        .map(|d| ms(*d))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        o,
        "| N = {} heavy standalone sessions, SQLite, after `kill -9` of every agentctl and agent | |",
        r.n
    );
    let _ = writeln!(o, "|---|---:|");
    let _ = writeln!(
        o,
        "| T1: one session alone, `recover_all` on a fresh manager (median of {t1s}) | {} |",
        ms(r.t1())
    );
    let _ = writeln!(
        o,
        "| P: parallelism the host sustains, N x T1 / best bare wall | {:.2} |",
        r.parallelism()
    );
    let _ = writeln!(o, "| baseline: T1 x N / P | {} |", ms(r.baseline_time()));
    let _ = writeln!(
        o,
        "| `recover_all` of the N, default settings: every agent back (`summary.duration`) | {} |",
        ms(r.all_back)
    );
    let _ = writeln!(
        o,
        "| SERVING: every workspace back (`summary.workspaces_back`) | {} |",
        ms(r.serving)
    );
    let _ = writeln!(
        o,
        "| sessions not back (`summary.not_back`) / not WAITING_FOR_INPUT with the agent running after the pass | {} / {} |",
        r.not_back, r.errors
    );
    let _ = writeln!(
        o,
        "| sessiond's CPU during the pass (this process: user + system) | {:.2} s ({:.1} % of one core) |",
        r.cpu.as_secs_f64(),
        100.0 * r.cpu_share()
    );
    let _ = writeln!(
        o,
        "| sessiond's peak RSS during the pass (this process; {} before) | {} |",
        mib(r.rss_before_kib),
        mib(r.rss_peak_kib)
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "- Outcomes: {}; load average {:.1} when the pass began; `wait_workspaces_recovered` \
         returned {} after the pass began. Making the sessions and their history took {:.0} s (not timed).",
        r.outcomes,
        r.pass_load,
        ms(r.serving_seen),
        r.setup.as_secs_f64()
    );
    let _ = writeln!(
        o,
        "- every agent back within 1.3x T1 x N / P: {:.2}x ({})",
        r.ratio(),
        verdict(r.ratio() <= 1.3)
    );
    let _ = writeln!(
        o,
        "- no session in ERROR or left without its agent: {} ({})",
        r.errors + r.not_back + r.failed,
        verdict(r.errors + r.not_back + r.failed == 0)
    );
    o
}
