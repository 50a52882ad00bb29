//! Signs of life of the agent process, and waiting on it bounded by its
//! silence rather than by a wall clock.
//!
//! Real agents take seconds to start (a Node runtime, an npm wrapper) and
//! to reload a long conversation, more on a loaded machine. A fixed deadline
//! on such work turns load into failure; what tells a stuck agent from a
//! slow one is whether it still does anything. [`Signs`] counts the lines
//! the agent writes (ACP messages on stdout, log lines on stderr) and reads
//! the CPU time of its process tree; [`until_silent`] waits for an answer
//! as long as either grows, cut only after a whole silence limit without
//! either, or at a generous overall cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::journal::AgentRecord;
use crate::tree;

/// The overall cap on one setup call of the agent (ACP `initialize`,
/// `session/new`, `session/load`, `session/resume`), however busy it is:
/// an agent that computes for this long without answering is taken as
/// stuck in a loop.
pub const SETUP_CAP: Duration = Duration::from_secs(600);

/// CPU time that counts as a sign of life since the last one: more than
/// an idle runtime's timers (or a process polling a file) use in a silence
/// limit, so an agent stuck waiting is not taken for one working. sessiond
/// judges agentctl's Health the same way.
pub const CPU_SIGN_MS: u64 = 50;

/// How often [`until_silent`] looks for signs of life at most, and at
/// least (a quarter of the silence limit, within these bounds).
const MIN_TICK: Duration = Duration::from_millis(10);
const MAX_TICK: Duration = Duration::from_millis(500);

/// Signs of life of one agent process (one launch).
#[derive(Debug)]
pub struct Signs {
    tree: AgentRecord,
    lines: AtomicU64,
    cpu_ms: AtomicU64,
    /// `u64::MAX` until a count was read (see [`tree::CpuUse::wait_ms`]).
    wait_ms: AtomicU64,
}

impl Signs {
    /// Nothing seen yet of the agent whose tree is `tree`.
    pub fn new(tree: AgentRecord) -> Self {
        Self {
            tree,
            lines: AtomicU64::new(0),
            cpu_ms: AtomicU64::new(0),
            wait_ms: AtomicU64::new(u64::MAX),
        }
    }

    /// The agent wrote one line (an ACP message, a log line).
    pub fn line(&self) {
        self.lines.fetch_add(1, Ordering::Relaxed);
    }

    /// Lines the agent wrote since it was launched.
    pub fn lines(&self) -> u64 {
        self.lines.load(Ordering::Relaxed)
    }

    /// Reads what the agent's process tree has used of the CPU now (its
    /// CPU time, and its wait for a CPU). Never less than an earlier
    /// reading: a descendant that ended without being waited for by the
    /// tree takes its time with it, which must not read as going backwards.
    pub fn sample(&self) -> tree::CpuUse {
        let now = tree::cpu_use(&self.tree);
        self.cpu_ms.fetch_max(now.cpu_ms, Ordering::Relaxed);
        if let Some(w) = now.wait_ms {
            // The unknown mark is the largest value: the first count replaces it.
            let _ = self
                .wait_ms
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    (old == u64::MAX || w > old).then_some(w)
                });
        }
        self.last()
    }

    /// The last reading (for an agent that has exited).
    pub fn last(&self) -> tree::CpuUse {
        let wait = self.wait_ms.load(Ordering::Relaxed);
        tree::CpuUse {
            cpu_ms: self.cpu_ms.load(Ordering::Relaxed),
            wait_ms: (wait != u64::MAX).then_some(wait),
        }
    }
}

/// Why [`until_silent`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// No new line and no more CPU time for the silence limit.
    Silent(Duration),
    /// The overall cap passed while the agent still showed signs of life.
    Cap(Duration),
}

impl Cut {
    /// `what` (e.g. "ACP session/new") was not answered, and why.
    pub fn describe(self, what: &str) -> String {
        match self {
            Self::Silent(limit) => format!(
                "the agent did not answer {what}: no sign of life for {} ms (no output, no CPU time)",
                limit.as_millis()
            ),
            Self::Cap(cap) => format!(
                "the agent did not answer {what} within {} s, though it kept showing signs of life",
                cap.as_secs()
            ),
        }
    }
}

/// Runs `work` (a call the agent must answer) to its end, unless the agent
/// shows no sign of life ([`Signs`]: a line written, or [`CPU_SIGN_MS`] of
/// CPU time used or of waiting for a CPU since the last sign: an agent
/// starved by a crowded host is not hung) for `silence`, or `cap` passes. A
/// reading that comes late (agentctl itself got no CPU for half
/// the limit: a host paused or overloaded) starts the count again rather
/// than blame the agent for time nobody watched.
pub async fn until_silent<F: Future>(
    signs: &Signs,
    silence: Duration,
    cap: Duration,
    work: F,
) -> Result<F::Output, Cut> {
    let started = Instant::now();
    let tick = (silence / 4).clamp(MIN_TICK, MAX_TICK);
    let late = (silence / 2).max(tick * 2);
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lines = signs.lines();
    let mut cpu_mark = signs.sample();
    let mut quiet_since = Instant::now();
    let mut last_tick = Instant::now();
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return Ok(out),
            _ = ticks.tick() => {
                let (now_lines, now_cpu) = (signs.lines(), signs.sample());
                let was_late = last_tick.elapsed() > late;
                last_tick = Instant::now();
                let waited = now_cpu
                    .wait_ms
                    .is_some_and(|w| w >= cpu_mark.wait_ms.unwrap_or(0) + CPU_SIGN_MS);
                if now_lines != lines
                    || now_cpu.cpu_ms >= cpu_mark.cpu_ms + CPU_SIGN_MS
                    || waited
                    || was_late
                {
                    lines = now_lines;
                    cpu_mark = now_cpu;
                    quiet_since = Instant::now();
                } else if quiet_since.elapsed() >= silence {
                    return Err(Cut::Silent(silence));
                }
                if started.elapsed() >= cap {
                    return Err(Cut::Cap(cap));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signs of a process that does not exist: no CPU time, ever, so
    /// only lines count (this test process computes all the time).
    fn no_tree() -> Signs {
        Signs::new(AgentRecord {
            instance: String::new(),
            pid: u32::MAX,
            start_time: 0,
            marker: String::new(),
        })
    }

    /// A process that always wants the CPU but hardly gets it (pinned to
    /// CPU 0 at nice 10 beside four spinning processes at nice 0: about 3%
    /// of the CPU, under the CPU time that counts per silence limit) writes
    /// nothing: it is starved, not hung, and its wait for a CPU keeps it
    /// from being cut (it was, before the wait counted). The kernel adds to
    /// the wait each time the process gets the CPU, every ~100 ms here, so
    /// the limit is a second. `taskset` (util-linux) is needed: its
    /// absence fails here.
    #[tokio::test]
    async fn an_agent_starved_of_cpu_is_not_cut_for_silence() {
        let spin = |nice: &str| {
            std::process::Command::new("taskset")
                .args([
                    "-c",
                    "0",
                    "nice",
                    "-n",
                    nice,
                    "sh",
                    "-c",
                    "while :; do :; done",
                ])
                .spawn()
                .expect("taskset (util-linux) runs a pinned spinner")
        };
        let mut hogs = [spin("0"), spin("0"), spin("0"), spin("0")];
        let mut starved = spin("10");
        let signs = Signs::new(AgentRecord {
            instance: String::new(),
            pid: starved.id(),
            start_time: 0,
            marker: String::new(),
        });
        // Settle: taskset and nice exec into the shell.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = signs.sample();
        let work = tokio::time::sleep(Duration::from_secs(3));
        let result = until_silent(&signs, Duration::from_secs(1), SETUP_CAP, work).await;
        let after = signs.sample();
        for c in hogs.iter_mut().chain([&mut starved]) {
            let _ = c.kill();
            let _ = c.wait();
        }
        let used = after.cpu_ms - before.cpu_ms;
        let waited = after.wait_ms.unwrap_or(0) - before.wait_ms.unwrap_or(0);
        assert!(
            waited >= 1000,
            "the starved process waited {waited} ms for a CPU ({before:?} -> {after:?})"
        );
        assert_eq!(
            result,
            Ok(()),
            "cut though it waited {waited} ms for a CPU and used {used} ms of it"
        );
    }

    #[tokio::test]
    async fn silence_cuts_and_lines_keep_it_waiting() {
        let signs = no_tree();
        // Nothing happens: cut after the silence limit.
        let cut = until_silent(
            &signs,
            Duration::from_millis(100),
            SETUP_CAP,
            std::future::pending::<()>(),
        )
        .await;
        assert_eq!(cut, Err(Cut::Silent(Duration::from_millis(100))));

        // A line every 20 ms for 600 ms keeps a 200 ms silence limit from
        // cutting work that takes 600 ms.
        let writer = async {
            for _ in 0..30 {
                signs.line();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let work = async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            7
        };
        let both = async {
            tokio::join!(
                writer,
                until_silent(&signs, Duration::from_millis(200), SETUP_CAP, work)
            )
            .1
        };
        assert_eq!(both.await, Ok(7));

        // The cap cuts even a lively agent.
        let lively = async {
            loop {
                signs.line();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let capped = tokio::select! {
            () = lively => unreachable!(),
            r = until_silent(&signs, Duration::from_secs(10), Duration::from_millis(100), std::future::pending::<()>()) => r,
        };
        assert_eq!(capped, Err(Cut::Cap(Duration::from_millis(100))));
    }
}
