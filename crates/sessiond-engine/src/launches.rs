//! Admission of agent launches, per host: [`LaunchScheduler`].
//!
//! Starting an agent (a node runtime, `initialize`, loading a long history)
//! costs seconds of CPU; a reattach costs one `Health`. Started all at once
//! after a restart, real agents contend for a few cores and every one of
//! them takes many times its own launch time. So launches wait for a slot of
//! their host (the local machine for standalone and Docker executors, each
//! remote host for its own), while reattaches never do.
//!
//! The number of slots adapts (AIMD, as TCP's window does): it starts at
//! the host's core count ([`LaunchLimits::start`]); a launch that ends
//! within twice the fastest launch seen recently, while the host is not
//! overloaded (local load average under twice its cores), adds one slot
//! while the host is in slow start (the limit doubles per window of
//! launches, so a host that carries many finds it within a few rounds) and
//! `1 / limit` after (one slot per window); a launch slower than four times
//! the fastest, or cut for silence, halves it. The first launch slower than
//! twice the fastest ends slow start. Neither counts when agentctl counted
//! that the agent spent under a quarter of its launch waiting for a CPU
//! (its tree's run-queue delay, [`CpuWait`]): such an agent was slow by
//! itself (asleep, blocked on the network), not crowded out, and cutting
//! the limit for it would queue every other agent behind it. The limit stays within
//! `1..=LaunchLimits::ceiling`, except while launches are cheap (up within
//! [`CHEAP_LAUNCH`], which no real agent is): they always count as fast and
//! the limit grows past the ceiling, since there is no load to protect.
//!
//! Waiters are served by priority, then in arrival order: a launch a caller
//! waits on (a call on the session, an explicit resume) goes before the
//! pass's and the background retries' ([`LaunchScheduler::promote`] moves
//! a waiting one up when a call joins it). Where a session waits in its
//! host's queue is what its status shows.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use sessiond_domain::{ExecutorRecord, Runtime, SessionId};
use tokio::sync::oneshot;

use crate::{config::LaunchLimits, sync::lock};

/// A launch (agent started and resumed) up within this long is cheap: no
/// real agent's runtime loads a host's CPU and answers this fast (they take
/// hundreds of milliseconds to seconds), so the limit does not hold such
/// launches back.
const CHEAP_LAUNCH: Duration = Duration::from_millis(50);

/// The most slots a host whose launches are cheap grows to (the pass's own
/// concurrency bounds it before that by default).
const CHEAP_CEILING: f64 = 256.0;

/// Who waits for a launch: lower goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Priority {
    /// A caller waits on this session (a call, an explicit resume).
    Call = 0,
    /// The startup pass, a background retry.
    Background = 1,
}

/// How a launch ended, for the adaptation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The agent is up (launched and resumed) after this long.
    Up(Duration),
    /// It was cut for silence, or the agent failed in a way that load can
    /// cause (it exited while starting).
    Cut,
    /// It failed for a reason of its own (a verdict): says nothing of load.
    Neutral,
}

/// How long a launch's agent waited for a CPU (agentctl's count of its
/// process tree's run-queue delay) over how long the launch had run then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CpuWait {
    pub(crate) waited: Duration,
    pub(crate) over: Duration,
}

impl CpuWait {
    /// The agent spent a quarter or more of its launch ready to run with
    /// no CPU free: the host is crowded, and its slowness says so.
    fn crowded(self) -> bool {
        self.waited.saturating_mul(4) >= self.over
    }
}

/// The host a launch runs on: the machine itself for local runtimes and
/// custom ones, a remote host by its address.
pub(crate) fn host_of(record: &ExecutorRecord) -> String {
    host_key(record.runtime, record.agentctl_url.as_deref())
}

fn host_key(runtime: Runtime, agentctl_url: Option<&str>) -> String {
    match runtime {
        Runtime::Remote => {
            let url = agentctl_url.unwrap_or_default();
            let rest = url.split_once("://").map_or(url, |(_, r)| r);
            let authority = rest.split('/').next().unwrap_or(rest);
            // The port is agentctl's own: executors of one host differ by it.
            match authority.rsplit_once(':') {
                Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host.to_owned(),
                _ => authority.to_owned(),
            }
        }
        _ => "local".to_owned(),
    }
}

struct Waiter {
    session: SessionId,
    grant: oneshot::Sender<LaunchPermit>,
}

struct Host {
    /// The adaptive number of slots.
    limit: f64,
    running: usize,
    /// By (priority, arrival).
    waiting: BTreeMap<(Priority, u64), Waiter>,
    /// The fastest launch seen recently (it drifts up slowly, so a host
    /// that became slower for good is judged by its new pace).
    fastest: Option<Duration>,
    /// Until launches first slow down, each fast one adds a whole slot.
    slow_start: bool,
}

struct Shared {
    /// Resolved once: the core count behind a 0 is read from the cgroup
    /// files, too costly for every launch.
    limits: LaunchLimits,
    hosts: Mutex<HashMap<String, Host>>,
    next: Mutex<u64>,
}

/// Per-host admission of agent launches; see the module documentation.
#[derive(Clone)]
pub(crate) struct LaunchScheduler {
    shared: Arc<Shared>,
}

/// A launch slot; dropping it frees the slot (as [`Ended::Neutral`]).
pub(crate) struct LaunchPermit {
    shared: Arc<Shared>,
    host: String,
    ended: Option<Ended>,
    cpu_wait: Option<CpuWait>,
    /// False for a grant nobody took: `dispatch` frees its slot itself.
    armed: bool,
}

impl LaunchPermit {
    /// Frees the slot, telling how the launch ended.
    #[cfg(test)]
    pub(crate) fn finish(self, ended: Ended) {
        self.finish_seen(ended, None);
    }

    /// Frees the slot, telling how the launch ended and, when agentctl
    /// counted it, how long its agent waited for a CPU: a slow or cut
    /// launch whose agent hardly waited (blocked on the network, asleep)
    /// says nothing of the host's load, and does not cut its limit.
    pub(crate) fn finish_seen(mut self, ended: Ended, cpu_wait: Option<CpuWait>) {
        self.ended = Some(ended);
        self.cpu_wait = cpu_wait;
    }
}

impl Drop for LaunchPermit {
    fn drop(&mut self) {
        if self.armed {
            let ended = self.ended.take().unwrap_or(Ended::Neutral);
            release(&self.shared, &self.host, ended, self.cpu_wait);
        }
    }
}

/// Removes a waiter whose acquire was dropped before it was granted.
struct Leave {
    shared: Arc<Shared>,
    host: String,
    key: (Priority, u64),
}

impl Drop for Leave {
    fn drop(&mut self) {
        let mut hosts = lock(&self.shared.hosts);
        if let Some(h) = hosts.get_mut(&self.host) {
            h.waiting.remove(&self.key);
        }
    }
}

impl LaunchScheduler {
    pub(crate) fn new(limits: LaunchLimits) -> Self {
        Self {
            shared: Arc::new(Shared {
                limits: LaunchLimits {
                    initial: limits.start(),
                    max: limits.ceiling(),
                },
                hosts: Mutex::default(),
                next: Mutex::new(0),
            }),
        }
    }

    /// Waits for a launch slot on `host` for `session`.
    pub(crate) async fn acquire(
        &self,
        host: String,
        session: SessionId,
        priority: Priority,
    ) -> LaunchPermit {
        let seq = {
            let mut next = lock(&self.shared.next);
            *next += 1;
            *next
        };
        let key = (priority, seq);
        let (tx, rx) = oneshot::channel();
        {
            let mut hosts = lock(&self.shared.hosts);
            let start = self.shared.limits.start() as f64;
            let h = hosts.entry(host.clone()).or_insert_with(|| Host {
                limit: start,
                running: 0,
                waiting: BTreeMap::new(),
                fastest: None,
                slow_start: true,
            });
            h.waiting.insert(key, Waiter { session, grant: tx });
            dispatch(&self.shared, &host, h);
        }
        let _leave = Leave {
            shared: self.shared.clone(),
            host,
            key,
        };
        // The sender is only dropped by a grant (which sends) or by `Leave`
        // (which is ours): a closed channel cannot happen while we wait.
        match rx.await {
            Ok(permit) => permit,
            Err(_) => unreachable!("a waiter's grant is sent or it is still waiting"),
        }
    }

    /// A launch slot on `host` now, if one is free and nobody waits for
    /// one (it never goes before a waiter); `None` otherwise. For a launch
    /// that rides on a call made anyway (recovery's `Recover`), which
    /// without a slot goes without the launch rather than wait.
    pub(crate) fn try_acquire(&self, host: String) -> Option<LaunchPermit> {
        let mut hosts = lock(&self.shared.hosts);
        let start = self.shared.limits.start() as f64;
        let h = hosts.entry(host.clone()).or_insert_with(|| Host {
            limit: start,
            running: 0,
            waiting: BTreeMap::new(),
            fastest: None,
            slow_start: true,
        });
        if !h.waiting.is_empty() || (h.running as f64) >= h.limit.floor().max(1.0) {
            return None;
        }
        h.running += 1;
        Some(LaunchPermit {
            shared: self.shared.clone(),
            host,
            ended: None,
            cpu_wait: None,
            armed: true,
        })
    }

    /// A caller now waits on `session`: its waiting launch (if any) goes
    /// before the background ones.
    pub(crate) fn promote(&self, session: SessionId) {
        let mut hosts = lock(&self.shared.hosts);
        for h in hosts.values_mut() {
            let keys: Vec<_> = h
                .waiting
                .iter()
                .filter(|(k, w)| w.session == session && k.0 != Priority::Call)
                .map(|(k, _)| *k)
                .collect();
            for key in keys {
                if let Some(w) = h.waiting.remove(&key) {
                    h.waiting.insert((Priority::Call, key.1), w);
                }
            }
        }
    }

    /// Where `session` waits for a launch: its 1-based place in its host's
    /// queue, and how many wait there.
    pub(crate) fn place(&self, session: SessionId) -> Option<(usize, usize)> {
        let hosts = lock(&self.shared.hosts);
        hosts.values().find_map(|h| {
            h.waiting
                .values()
                .position(|w| w.session == session)
                .map(|i| (i + 1, h.waiting.len()))
        })
    }

    /// The current limit and launches running on `host`.
    #[cfg(test)]
    pub(crate) fn load(&self, host: &str) -> Option<(usize, usize)> {
        lock(&self.shared.hosts)
            .get(host)
            .map(|h| (h.limit.floor() as usize, h.running))
    }
}

/// Grants slots to the first waiters while the host has room; a waiter
/// that left (its acquire was dropped) is skipped.
fn dispatch(shared: &Arc<Shared>, host: &str, h: &mut Host) {
    while (h.running as f64) < h.limit.floor().max(1.0) {
        let Some((_, w)) = h.waiting.pop_first() else {
            return;
        };
        h.running += 1;
        let permit = LaunchPermit {
            shared: shared.clone(),
            host: host.to_owned(),
            ended: None,
            cpu_wait: None,
            armed: true,
        };
        if let Err(mut permit) = w.grant.send(permit) {
            // Gone meanwhile: the slot is free again, without adapting
            // (`hosts` is locked here, so not through the permit's drop).
            permit.armed = false;
            h.running -= 1;
        }
    }
}

fn release(shared: &Arc<Shared>, host: &str, ended: Ended, cpu_wait: Option<CpuWait>) {
    let mut hosts = lock(&shared.hosts);
    let Some(h) = hosts.get_mut(host) else {
        return;
    };
    h.running = h.running.saturating_sub(1);
    let ceiling = shared.limits.ceiling() as f64;
    match ended {
        Ended::Up(took) => {
            let fastest = h.fastest.map_or(took, |f| took.min(f.mul_f64(1.02)));
            h.fastest = Some(fastest);
            let overloaded = host == "local" && host_overloaded();
            // A launch up this fast loaded nothing worth protecting: it
            // neither ends slow start nor halves the limit, whatever its
            // ratio to the fastest (at a millisecond, queueing alone varies
            // it four times), and the limit may grow past the ceiling.
            let cheap = took <= CHEAP_LAUNCH;
            if !cheap {
                h.limit = h.limit.min(ceiling);
            }
            // Slow, but not for want of a CPU (its agent hardly waited for
            // one): another agent's start, not the host's load.
            let loaded = !cheap && cpu_wait.is_none_or(CpuWait::crowded);
            if took > fastest.saturating_mul(4) && loaded {
                h.slow_start = false;
                h.limit = (h.limit / 2.0).max(1.0);
            } else if took > fastest.saturating_mul(2) && loaded {
                h.slow_start = false;
            } else if !overloaded {
                let step = if h.slow_start {
                    1.0
                } else {
                    1.0 / h.limit.max(1.0)
                };
                let most = if cheap {
                    ceiling.max(CHEAP_CEILING)
                } else {
                    ceiling
                };
                h.limit = (h.limit + step).min(most);
            }
        }
        // An agent cut for silence that did not wait for a CPU was silent
        // by itself (asleep, blocked), not crowded out.
        Ended::Cut if cpu_wait.is_none_or(CpuWait::crowded) => {
            h.slow_start = false;
            h.limit = (h.limit / 2.0).max(1.0);
        }
        Ended::Cut => {}
        Ended::Neutral => {}
    }
    tracing::debug!(
        host,
        limit = h.limit,
        running = h.running,
        ?ended,
        ?cpu_wait,
        "launch slot freed"
    );
    dispatch(shared, host, h);
}

/// The local load average over a minute exceeds twice the core count.
fn host_overloaded() -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/loadavg") else {
        return false;
    };
    let load: f64 = text
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    static CORES: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let cores =
        *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from) as f64);
    load > 2.0 * cores
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(initial: usize, max: usize) -> LaunchLimits {
        LaunchLimits { initial, max }
    }

    /// One launch on `host` that is up after `took`.
    async fn launch_up(s: &LaunchScheduler, host: &str, took: Duration) {
        s.acquire(host.into(), SessionId::new(), Priority::Background)
            .await
            .finish(Ended::Up(took));
    }

    #[tokio::test]
    async fn admits_up_to_the_limit_then_in_priority_order() {
        let s = LaunchScheduler::new(limits(2, 2));
        let a = s
            .acquire("h".into(), SessionId::new(), Priority::Background)
            .await;
        let b = s
            .acquire("h".into(), SessionId::new(), Priority::Background)
            .await;
        assert_eq!(s.load("h"), Some((2, 2)));
        let late = SessionId::new();
        let call = SessionId::new();
        let s2 = s.clone();
        let background =
            tokio::spawn(async move { s2.acquire("h".into(), late, Priority::Background).await });
        tokio::task::yield_now().await;
        while s.place(late).is_none() {
            tokio::task::yield_now().await;
        }
        let s3 = s.clone();
        let first = tokio::spawn(async move { s3.acquire("h".into(), call, Priority::Call).await });
        while s.place(call).is_none() {
            tokio::task::yield_now().await;
        }
        assert_eq!(s.place(call), Some((1, 2)), "a call goes first");
        assert_eq!(s.place(late), Some((2, 2)));
        drop(a);
        let granted = first.await.expect("call granted");
        assert_eq!(
            s.place(late),
            Some((1, 1)),
            "the background one still waits"
        );
        drop(b);
        let granted2 = background.await.expect("background granted");
        drop((granted, granted2));
        assert_eq!(s.load("h"), Some((2, 0)));
    }

    /// `try_acquire` takes a free slot only, never one a waiter is owed.
    #[tokio::test]
    async fn try_acquire_takes_only_a_free_slot_nobody_waits_for() {
        let s = LaunchScheduler::new(limits(1, 1));
        let first = s.try_acquire("h".into()).expect("a free slot");
        assert!(
            s.try_acquire("h".into()).is_none(),
            "the only slot is taken"
        );
        let waiter = SessionId::new();
        let s2 = s.clone();
        let waiting =
            tokio::spawn(async move { s2.acquire("h".into(), waiter, Priority::Background).await });
        while s.place(waiter).is_none() {
            tokio::task::yield_now().await;
        }
        first.finish(Ended::Neutral);
        let granted = waiting.await.expect("the waiter got the slot");
        assert!(s.try_acquire("h".into()).is_none(), "the waiter holds it");
        drop(granted);
        assert!(s.try_acquire("other".into()).is_some(), "hosts are apart");
        let again = s.try_acquire("h".into()).expect("free again");
        assert_eq!(s.load("h"), Some((1, 1)));
        drop(again);
        assert_eq!(s.load("h"), Some((1, 0)));
    }

    #[tokio::test]
    async fn promote_moves_a_waiter_ahead() {
        let s = LaunchScheduler::new(limits(1, 1));
        let held = s
            .acquire("h".into(), SessionId::new(), Priority::Background)
            .await;
        let (x, y) = (SessionId::new(), SessionId::new());
        for id in [x, y] {
            let waiter = s.clone();
            tokio::spawn(async move {
                let p = waiter.acquire("h".into(), id, Priority::Background).await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
                drop(p);
            });
            while s.place(id).is_none() {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(s.place(y), Some((2, 2)));
        s.promote(y);
        assert_eq!(s.place(y), Some((1, 2)));
        drop(held);
    }

    #[tokio::test]
    async fn a_dropped_waiter_frees_its_place() {
        let s = LaunchScheduler::new(limits(1, 1));
        let held = s
            .acquire("h".into(), SessionId::new(), Priority::Background)
            .await;
        let gone = SessionId::new();
        let waiting = {
            let s = s.clone();
            tokio::spawn(async move { s.acquire("h".into(), gone, Priority::Background).await })
        };
        while s.place(gone).is_none() {
            tokio::task::yield_now().await;
        }
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(s.place(gone), None);
        drop(held);
        assert_eq!(s.load("h"), Some((1, 0)), "no slot leaked");
    }

    #[tokio::test]
    async fn the_limit_grows_with_fast_launches_and_halves_on_a_cut() {
        let s = LaunchScheduler::new(limits(2, 8));
        for _ in 0..20 {
            let p = s
                .acquire("remote-a".into(), SessionId::new(), Priority::Background)
                .await;
            p.finish(Ended::Up(Duration::from_millis(100)));
        }
        let (grown, _) = s.load("remote-a").expect("host");
        assert!(grown > 2, "grew to {grown}");
        assert!(grown <= 8, "within the ceiling: {grown}");
        let p = s
            .acquire("remote-a".into(), SessionId::new(), Priority::Background)
            .await;
        p.finish(Ended::Cut);
        let (cut, _) = s.load("remote-a").expect("host");
        assert!(cut <= grown / 2 + 1 && cut >= 1, "{grown} -> {cut}");
        // A launch far slower than the fastest halves it too.
        let before = s.load("remote-a").expect("host").0;
        let p = s
            .acquire("remote-a".into(), SessionId::new(), Priority::Background)
            .await;
        p.finish(Ended::Up(Duration::from_secs(5)));
        let after = s.load("remote-a").expect("host").0;
        assert!(after <= before.max(2) / 2 + 1, "{before} -> {after}");
        assert!(after >= 1);
    }

    #[tokio::test]
    async fn slow_start_doubles_per_window_until_launches_slow_down() {
        let s = LaunchScheduler::new(limits(2, 64));
        let launch = |took: Duration| launch_up(&s, "remote-b", took);
        let fast = Duration::from_millis(100);
        // Two windows of fast launches: 2 -> 4 -> 8.
        for _ in 0..6 {
            launch(fast).await;
        }
        assert_eq!(s.load("remote-b").expect("host").0, 8);
        // A launch at three times the fastest ends slow start without a cut.
        launch(fast * 3).await;
        assert_eq!(s.load("remote-b").expect("host").0, 8);
        // From then on, a window of fast launches (a few more, as the
        // window widens with each) adds one slot.
        for _ in 0..10 {
            launch(fast).await;
        }
        assert_eq!(s.load("remote-b").expect("host").0, 9);
    }

    /// Launches of a millisecond or two vary several times from queueing
    /// alone: they neither end slow start nor cut the limit, which grows
    /// past the ceiling; the first real (slow) launch brings it back under.
    #[tokio::test]
    async fn cheap_launches_are_not_held_back() {
        let s = LaunchScheduler::new(limits(2, 8));
        let launch = |took: Duration| launch_up(&s, "fleet", took);
        launch(Duration::from_micros(250)).await;
        for i in 0..40 {
            launch(Duration::from_micros(if i % 2 == 0 { 1_500 } else { 900 })).await;
        }
        let (grown, _) = s.load("fleet").expect("host");
        assert_eq!(
            grown, 43,
            "one slot per cheap launch, past the ceiling of 8"
        );
        launch(Duration::from_secs(2)).await;
        let (cut, _) = s.load("fleet").expect("host");
        assert_eq!(cut, 4, "a slow launch: back under the ceiling, then halved");
    }

    /// helper-31 D6: agents that sleep as they start (a CLI waiting on the
    /// network) made every launch "slow" and halved the limit down to one,
    /// so fast agents queued behind them. A slow or cut launch whose agent
    /// hardly waited for a CPU leaves the limit alone; one whose agent
    /// waited a quarter of the time or more (or not counted) still halves it.
    #[tokio::test]
    async fn slow_or_cut_launches_of_agents_that_did_not_wait_for_a_cpu_keep_the_limit() {
        let s = LaunchScheduler::new(limits(4, 8));
        let host = "remote-c";
        let finish = |ended: Ended, waited_ms: Option<u64>, over: Duration| {
            let s = s.clone();
            async move {
                s.acquire(host.into(), SessionId::new(), Priority::Background)
                    .await
                    .finish_seen(
                        ended,
                        waited_ms.map(|w| CpuWait {
                            waited: Duration::from_millis(w),
                            over,
                        }),
                    );
            }
        };
        let limit = || s.load(host).expect("host").0;
        finish(
            Ended::Up(Duration::from_millis(200)),
            Some(0),
            Duration::ZERO,
        )
        .await;
        let start = limit();
        // Asleep 8 s at start (40 times the fastest), 30 ms of it waiting.
        let eight = Duration::from_secs(8);
        finish(Ended::Up(eight), Some(30), eight).await;
        assert!(limit() >= start, "{start} -> {}", limit());
        finish(Ended::Cut, Some(10), Duration::from_secs(5)).await;
        assert!(
            limit() >= start,
            "a silent agent's cut: {start} -> {}",
            limit()
        );
        let kept = limit();
        assert!(kept >= 4, "{kept}");
        // Not counted (an older agentctl): halved as before.
        finish(Ended::Cut, None, Duration::ZERO).await;
        assert_eq!(limit(), kept / 2, "an uncounted cut halves it");
        let uncounted = limit();
        // Crowded out: 3 of its 8 s waiting for a CPU.
        finish(Ended::Up(eight), Some(3_000), eight).await;
        assert_eq!(
            limit(),
            (uncounted / 2).max(1),
            "a crowded slow launch halves it"
        );
        let crowded = limit();
        finish(Ended::Cut, Some(2_000), Duration::from_secs(5)).await;
        assert_eq!(limit(), (crowded / 2).max(1), "a crowded cut halves it");
    }

    #[test]
    fn remote_hosts_are_keyed_by_host_not_port() {
        let remote = |url| host_key(Runtime::Remote, Some(url));
        assert_eq!(remote("https://10.0.0.7:7070"), "10.0.0.7");
        assert_eq!(remote("https://10.0.0.7:7071"), "10.0.0.7");
        assert_eq!(remote("http://[::1]:7071/"), "[::1]");
        assert_eq!(host_key(Runtime::LocalStandalone, None), "local");
        assert_eq!(host_key(Runtime::LocalDocker, None), "local");
    }
}
