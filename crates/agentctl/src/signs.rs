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
}

impl Signs {
    /// Nothing seen yet of the agent whose tree is `tree`.
    pub fn new(tree: AgentRecord) -> Self {
        Self {
            tree,
            lines: AtomicU64::new(0),
            cpu_ms: AtomicU64::new(0),
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

    /// Reads the CPU time (user + system, in milliseconds) of the agent's
    /// process tree now. Never less than an earlier reading: a descendant
    /// that ended without being waited for by the tree takes its time
    /// with it, which must not read as going backwards.
    pub fn sample_cpu_ms(&self) -> u64 {
        let now = tree::cpu_ms(&self.tree);
        self.cpu_ms.fetch_max(now, Ordering::Relaxed).max(now)
    }

    /// The last CPU time read (for an agent that has exited).
    pub fn last_cpu_ms(&self) -> u64 {
        self.cpu_ms.load(Ordering::Relaxed)
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
/// CPU time used since the last sign) for `silence`, or `cap` passes. A
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
    let mut cpu_mark = signs.sample_cpu_ms();
    let mut quiet_since = Instant::now();
    let mut last_tick = Instant::now();
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            out = &mut work => return Ok(out),
            _ = ticks.tick() => {
                let (now_lines, now_cpu) = (signs.lines(), signs.sample_cpu_ms());
                let was_late = last_tick.elapsed() > late;
                last_tick = Instant::now();
                if now_lines != lines || now_cpu >= cpu_mark + CPU_SIGN_MS || was_late {
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
