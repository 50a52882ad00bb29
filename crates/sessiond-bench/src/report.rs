//! The table: printed, and written into docs/PERFORMANCE.md between markers.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::Context as _;

use crate::{events::Latency, load::Load, recovery::RecoveryRow, turn::TurnRow};

/// The targets each figure is judged by: ratios against a baseline measured
/// in the same run (docs/PERFORMANCE.md).
const RECOVERY_REMOTE: f64 = 1.2;
const RECOVERY_STANDALONE: f64 = 1.3;
const TURN_P50: f64 = 1.2;
const TURN_P99: f64 = 1.5;
const STATUS: f64 = 0.8;

pub const BEGIN: &str = "<!-- bench:begin -->";
pub const END: &str = "<!-- bench:end -->";
/// The turn-path figures have markers of their own, so `--only-turns`
/// refreshes them without the long runs.
pub const TURN_BEGIN: &str = "<!-- bench:turn:begin -->";
pub const TURN_END: &str = "<!-- bench:turn:end -->";

#[derive(Debug, Clone, Copy)]
pub struct Rss {
    pub sessions: usize,
    pub serving_after: Duration,
    pub hwm_after_recovery_kib: u64,
    pub rss_after_recovery_kib: u64,
    pub hwm_after_load_kib: u64,
    /// CPU of `sessiond serve` (and of the fleet answering it) over a window
    /// holding one liveness round of every executor, with no client calls.
    pub idle: Option<IdleCpu>,
}

#[derive(Debug, Clone, Copy)]
pub struct IdleCpu {
    pub window: Duration,
    pub server_cpu: Duration,
    pub fleet_cpu: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct StatusRow {
    pub clients: usize,
    pub duration: Duration,
    pub status: Load,
    pub echo: Load,
}

#[derive(Debug)]
pub struct Report {
    command: String,
    pub recovery: Vec<RecoveryRow>,
    pub status: Option<StatusRow>,
    pub latency: Vec<Latency>,
    pub rss: Option<Rss>,
    pub total: Duration,
}

pub(crate) fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else if ms >= 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.2} ms")
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**missed**" }
}

pub fn recovery_line(r: &RecoveryRow) -> String {
    format!(
        "recovery {} N={}: {} vs baseline {} (read {} + health {} + write {}) = {:.2}x (rounds: {}) [{}]",
        r.label,
        r.n,
        ms(r.recovery),
        ms(r.baseline()),
        ms(r.base_read),
        ms(r.base_health),
        ms(r.base_write),
        r.ratio(),
        r.rounds_text(),
        r.outcomes
    )
}

pub fn status_line(s: &StatusRow) -> String {
    format!(
        "GetSessionStatus {:.0}/s p50 {} p99 {} vs echo {:.0}/s p50 {} p99 {} = {:.2}x; \
         server CPU per call {:.1} vs {:.1} µs",
        s.status.per_sec,
        ms(s.status.p50),
        ms(s.status.p99),
        s.echo.per_sec,
        ms(s.echo.p50),
        ms(s.echo.p99),
        s.status.per_sec / s.echo.per_sec.max(1e-9),
        s.status.cpu_per_call().as_secs_f64() * 1e6,
        s.echo.cpu_per_call().as_secs_f64() * 1e6
    )
}

pub fn turn_line(backend: &str, t: &TurnRow) -> String {
    format!(
        "turn path ({backend}), {} turns: SendMessage -> first chunk at a watcher p50 {} p99 {} vs Prompt -> first chunk straight from agentctl p50 {} p99 {} = {:.2}x at p50",
        t.turns,
        ms(t.sessiond_p50),
        ms(t.sessiond_p99),
        ms(t.direct_p50),
        ms(t.direct_p99),
        t.ratio()
    )
}

/// The turn-path section (between [`TURN_BEGIN`] and [`TURN_END`]): one
/// pair of rows per store backend.
pub fn render_turn(rows: &[(&str, TurnRow)], command: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "- Machine: {}; {}; `{command}` (release build)",
        machine(),
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "| store | path | turns | p50 | p99 |\n|---|---|---:|---:|---:|"
    );
    for (backend, t) in rows {
        let _ = writeln!(
            o,
            "| {backend} | `SendMessage` -> first agent chunk at a `watch_session` subscriber (journaled turn) | {} | {} | {} |\n\
             | {backend} | the same prompt straight to agentctl: `Prompt` -> first chunk on `StreamUpdates` | {} | {} | {} |",
            t.turns,
            ms(t.sessiond_p50),
            ms(t.sessiond_p99),
            t.turns,
            ms(t.direct_p50),
            ms(t.direct_p99)
        );
    }
    let _ = writeln!(o);
    for (backend, t) in rows {
        let _ = writeln!(
            o,
            "- {backend}: ratio at p50 {:.2}x (target <= {TURN_P50}x: {}); at p99 {:.2}x (target <= {TURN_P99}x: {})",
            t.ratio(),
            verdict(t.ratio() <= TURN_P50),
            t.ratio_p99(),
            verdict(t.ratio_p99() <= TURN_P99)
        );
    }
    o
}

pub fn latency_line(l: &Latency) -> String {
    format!(
        "event latency, {} subscriber(s), {} watched other sessions, {} events: p50 {} p99 {} max {} (the commit before it: p50 {} p99 {})",
        l.subscribers,
        l.bystanders,
        l.events,
        ms(l.p50),
        ms(l.p99),
        ms(l.max),
        ms(l.commit_p50),
        ms(l.commit_p99)
    )
}

pub(crate) fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!(
        "{cpus} CPUs (nproc), {model}, {:.1} GiB memory, {}",
        mem_kib as f64 / 1024.0 / 1024.0,
        std::env::consts::ARCH
    )
}

impl Report {
    pub fn new(command: &str) -> Self {
        Self {
            command: command.to_owned(),
            recovery: Vec::new(),
            status: None,
            latency: Vec::new(),
            rss: None,
            total: Duration::ZERO,
        }
    }

    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "- Machine: {}", machine());
        let _ = writeln!(
            o,
            "- Date: {}",
            chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
        );
        let _ = writeln!(o, "- Command: `{}` (release build)", self.command);
        let _ = writeln!(o, "- Bench wall time: {:.0} s", self.total.as_secs_f64());
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "### Startup recovery (`RecoveryControl::recover_all` on a fresh manager)"
        );
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "Recovery and baseline: medians over the rounds (5 for N <= 1,000, else 1). \
             Ratio: the median of the rounds' own recovery / baseline ratios, listed \
             in the order measured."
        );
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "| executors | N | recovery | baseline (read + health + write) | ratio | ratio per round | outcomes |"
        );
        let _ = writeln!(o, "|---|---:|---:|---|---:|---|---|");
        for r in &self.recovery {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} ({} + {} + {}) | {:.2}x | {} | {} |",
                r.label,
                r.n,
                ms(r.recovery),
                ms(r.baseline()),
                ms(r.base_read),
                ms(r.base_health),
                ms(r.base_write),
                r.ratio(),
                r.rounds_text(),
                r.outcomes
            );
        }
        let _ = writeln!(o);
        if let Some(s) = &self.status {
            let _ = writeln!(
                o,
                "### GetSessionStatus ({} concurrent clients, one connection each, {} s closed loop)",
                s.clients,
                s.duration.as_secs()
            );
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "| server | calls | calls/s | p50 | p99 | errors | server CPU per call |"
            );
            let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|");
            for (name, l) in [
                (
                    "`sessiond serve` GetSessionStatus (10k sessions)",
                    &s.status,
                ),
                ("bare tonic unary (grpc.health Check)", &s.echo),
            ] {
                let _ = writeln!(
                    o,
                    "| {name} | {} | {:.0} | {} | {} | {} | {:.1} µs |",
                    l.calls,
                    l.per_sec,
                    ms(l.p50),
                    ms(l.p99),
                    l.errors,
                    l.cpu_per_call().as_secs_f64() * 1e6
                );
            }
            let _ = writeln!(
                o,
                "\nRatio status / echo: **{:.2}x**\n",
                s.status.per_sec / s.echo.per_sec.max(1e-9)
            );
        }
        if !self.latency.is_empty() {
            let _ = writeln!(
                o,
                "### Event latency (committed state change -> `watch_session` subscriber)"
            );
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "| subscribers | other sessions watched | events | p50 | p99 | max | the commit before it: p50 | p99 |"
            );
            let _ = writeln!(o, "|---:|---:|---:|---:|---:|---:|---:|---:|");
            for l in &self.latency {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    l.subscribers,
                    l.bystanders,
                    l.events,
                    ms(l.p50),
                    ms(l.p99),
                    ms(l.max),
                    ms(l.commit_p50),
                    ms(l.commit_p99)
                );
            }
            let _ = writeln!(o);
        }
        if let Some(r) = &self.rss {
            let _ = writeln!(o, "### Memory of `sessiond serve`");
            let _ = writeln!(o);
            let _ = writeln!(
                o,
                "{} sessions recovered (SERVING after {:.2} s): peak RSS (VmHWM) {}, RSS {}; peak after the status load {}.\n",
                r.sessions,
                r.serving_after.as_secs_f64(),
                mib(r.hwm_after_recovery_kib),
                mib(r.rss_after_recovery_kib),
                mib(r.hwm_after_load_kib)
            );
            if let Some(i) = &r.idle {
                let _ = writeln!(
                    o,
                    "Idle, over {:.0} s holding one liveness round (a `Health` per executor): \
                     `sessiond serve` used {:.2} s of CPU ({:.1} % of one core), the fleet \
                     answering it {:.2} s.\n",
                    i.window.as_secs_f64(),
                    i.server_cpu.as_secs_f64(),
                    100.0 * i.server_cpu.as_secs_f64() / i.window.as_secs_f64().max(1e-9),
                    i.fleet_cpu.as_secs_f64()
                );
            }
        }
        let _ = writeln!(o, "### Targets");
        let _ = writeln!(o);
        for r in &self.recovery {
            let target = if r.label.starts_with("standalone") {
                RECOVERY_STANDALONE
            } else {
                RECOVERY_REMOTE
            };
            let _ = writeln!(
                o,
                "- recovery <= {target}x baseline, {} N={}: {:.2}x, {}",
                r.label,
                r.n,
                r.ratio(),
                verdict(r.ratio() <= target)
            );
        }
        for r in self
            .recovery
            .iter()
            .filter(|r| r.n == 1_000 && r.label.starts_with("remote"))
        {
            let _ = writeln!(
                o,
                "- 1,000 remote sessions recovered and resumed in < 2 s ({}): {}, {}",
                r.label,
                ms(r.recovery),
                verdict(r.recovery < Duration::from_secs(2))
            );
        }
        if let Some(s) = &self.status {
            let ratio = s.status.per_sec / s.echo.per_sec.max(1e-9);
            let _ = writeln!(
                o,
                "- status throughput >= {STATUS}x bare echo: {ratio:.2}x, {}",
                verdict(ratio >= STATUS)
            );
        }
        if let Some(l) = self.latency.iter().find(|l| l.subscribers >= 1_000) {
            let _ = writeln!(
                o,
                "- event latency p99 < 5 ms with 1,000 subscribers: {}, {}",
                ms(l.p99),
                verdict(l.p99 < Duration::from_millis(5))
            );
        }
        if let Some(r) = &self.rss {
            let _ = writeln!(
                o,
                "- peak RSS < 150 MB with {} sessions: {}, {}",
                r.sessions,
                mib(r.hwm_after_recovery_kib),
                verdict(r.hwm_after_recovery_kib * 1024 < 150_000_000)
            );
        }
        o
    }
}

/// Replaces what is between the markers of `path` with `text` (or creates
/// the file with a heading and the markers).
pub fn write_into(path: &Path, text: &str) -> anyhow::Result<()> {
    write_between(path, BEGIN, END, text)
}

/// Every section the bench writes: heading and markers, in the order of
/// docs/PERFORMANCE.md.
fn sections() -> [(&'static str, &'static str, &'static str); 5] {
    [
        ("Results", BEGIN, END),
        ("The turn path", TURN_BEGIN, TURN_END),
        (
            "Availability while recovering",
            crate::availability::BEGIN,
            crate::availability::END,
        ),
        (
            "Replicas on one PostgreSQL",
            crate::replicas::BEGIN,
            crate::replicas::END,
        ),
        (
            "A burst of heavy relaunches",
            crate::burst::BEGIN,
            crate::burst::END,
        ),
    ]
}

/// A new output file: a heading and every section's markers, so that each
/// section of the run finds its place.
fn new_file() -> String {
    let mut o = String::from("# Performance\n\nFigures of `cargo xtask bench`.\n");
    for (heading, begin, end) in sections() {
        let _ = write!(o, "\n## {heading}\n\n{begin}\n{end}\n");
    }
    o
}

/// Replaces what stands between markers `begin` and `end` in `path` (a
/// file that does not exist yet is made with every section's markers).
pub fn write_between(path: &Path, begin: &str, end: &str, text: &str) -> anyhow::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => new_file(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let (Some(b), Some(e)) = (old.find(begin), old.find(end)) else {
        anyhow::bail!(
            "{} has no {begin} ... {end} markers; add them where the figures go",
            path.display()
        );
    };
    let new = format!("{}{begin}\n{text}{}", &old[..b], &old[e..]);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, new)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{sections, write_between};

    /// `--out NEW_FILE`: every section of one run lands in a file that did
    /// not exist before, and a second run replaces them.
    #[test]
    fn a_new_file_takes_every_section() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("figures.md");
        for round in 0..2 {
            for (heading, begin, end) in sections() {
                write_between(&path, begin, end, &format!("{heading} {round}\n")).unwrap();
            }
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (heading, begin, end) in sections() {
            let expected = format!("{begin}\n{heading} 1\n{end}");
            assert_eq!(text.matches(&expected).count(), 1, "{text}");
            assert!(!text.contains(&format!("{heading} 0")), "{text}");
        }
    }

    /// An existing file without a section's markers is left alone.
    #[test]
    fn an_existing_file_needs_the_markers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("figures.md");
        std::fs::write(&path, "# Mine\n").unwrap();
        let (_, begin, end) = sections()[4];
        let err = write_between(&path, begin, end, "x\n").unwrap_err();
        assert!(err.to_string().contains("markers"), "{err}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "# Mine\n");
    }
}
