//! Bulk work that yields to everyone else's store calls.
//!
//! A startup recovery pass runs dozens of executors' recoveries at once,
//! each a few reads and writes. A call that waits for one session (its own
//! recovery, then its own writes) would otherwise queue behind all of
//! them: for SQLite's single writer (this process's writers take turns on
//! one lock) and for the pool's connections. Work run inside
//! [`Store::yielding`] (with a [`Yield`] flag that is set) takes the write
//! turn only when no other writer waits, and holds at most all but
//! [`RESERVED`] of the pool's connections, so a call's store work never
//! waits for more than the one statement in progress. The flag is shared:
//! clearing it ([`Yield::promote`]) makes work already under way stop
//! yielding (a call joined that recovery and now waits for it).
//!
//! [`Store::yielding`]: crate::Store::yielding

use std::{
    sync::{
        Arc, Condvar, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// Connections of the pool that yielding work never takes.
pub(crate) const RESERVED: u32 = 2;

/// Whether the store work of a task yields to others (see the module docs).
#[derive(Debug, Clone)]
pub struct Yield(Arc<AtomicBool>);

impl Default for Yield {
    fn default() -> Self {
        Yield(Arc::new(AtomicBool::new(true)))
    }
}

impl Yield {
    /// A flag that yields until promoted.
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on this work goes in turn with everyone else's.
    pub fn promote(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    /// Whether this work still yields to everyone else's (not promoted yet).
    pub fn is_yielding(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

tokio::task_local! {
    static YIELD: Yield;
}

/// Runs `fut` with its store calls yielding while `flag` says so.
pub(crate) async fn scope<F: std::future::Future>(flag: Yield, fut: F) -> F::Output {
    YIELD.scope(flag, fut).await
}

/// The calling task's flag, if it runs inside [`scope`] (read before the
/// hop to a blocking thread, where task-locals are not visible).
pub(crate) fn current() -> Option<Yield> {
    YIELD.try_with(Clone::clone).ok()
}

fn yields(flag: Option<&Yield>) -> bool {
    flag.is_some_and(Yield::is_yielding)
}

/// A lock whose yielding waiters let the others go first.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    state: Mutex<TurnState>,
    freed: Condvar,
}

#[derive(Debug, Default)]
struct TurnState {
    held: bool,
    /// Waiters that do not yield.
    urgent: usize,
}

/// Holds the turn until dropped.
pub(crate) struct Turn<'a>(&'a Turns);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.held = false;
        drop(s);
        self.0.freed.notify_all();
    }
}

impl Turns {
    /// Waits for the turn (blocking; call on a blocking thread).
    pub(crate) fn take(&self, flag: Option<&Yield>) -> Turn<'_> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let urgent = !yields(flag);
        if urgent {
            s.urgent += 1;
        }
        loop {
            // A yielding waiter re-reads its flag on every wake-up: once
            // promoted it stops giving way.
            let give_way = !urgent && yields(flag) && s.urgent > 0;
            if !s.held && !give_way {
                break;
            }
            s = wait(&self.freed, s);
        }
        s.held = true;
        if urgent {
            s.urgent -= 1;
        }
        Turn(self)
    }
}

/// Counts the pool connections yielding work holds.
#[derive(Debug)]
pub(crate) struct Slots {
    free: Mutex<u32>,
    freed: Condvar,
}

/// One connection's worth of [`Slots`], given back when dropped.
pub(crate) struct Slot<'a>(&'a Slots);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.0.freed.notify_one();
    }
}

impl Slots {
    /// `pool_size` connections, of which yielding work may hold all but
    /// [`RESERVED`] (at least one).
    pub(crate) fn new(pool_size: u32) -> Self {
        Slots {
            free: Mutex::new(pool_size.saturating_sub(RESERVED).max(1)),
            freed: Condvar::new(),
        }
    }

    /// For yielding work: waits for a slot (up to `timeout`, the pool's own
    /// checkout timeout). Others take none. `Err`: timed out.
    pub(crate) fn take(
        &self,
        flag: Option<&Yield>,
        timeout: Duration,
    ) -> Result<Option<Slot<'_>>, ()> {
        if !yields(flag) {
            return Ok(None);
        }
        let until = Instant::now() + timeout;
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        while *free == 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            free = self
                .freed
                .wait_timeout(free, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *free -= 1;
        Ok(Some(Slot(self)))
    }
}

fn wait<'a, T>(cv: &Condvar, g: std::sync::MutexGuard<'a, T>) -> std::sync::MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn a_yielding_writer_lets_a_waiting_urgent_one_go_first() {
        let turns = Arc::new(Turns::default());
        let low = Yield::new();
        let held = turns.take(None);
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        {
            let (turns, tx, low) = (turns.clone(), tx.clone(), low.clone());
            threads.push(std::thread::spawn(move || {
                let _t = turns.take(Some(&low));
                tx.send("low").unwrap();
            }));
        }
        // The yielding one is waiting before the urgent one arrives.
        std::thread::sleep(Duration::from_millis(50));
        {
            let (turns, tx) = (turns.clone(), tx.clone());
            threads.push(std::thread::spawn(move || {
                let _t = turns.take(None);
                tx.send("urgent").unwrap();
            }));
        }
        while turns.state.lock().unwrap().urgent == 0 {
            std::thread::yield_now();
        }
        drop(held);
        assert_eq!(rx.recv().unwrap(), "urgent");
        assert_eq!(rx.recv().unwrap(), "low");
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_promoted_writer_stops_giving_way() {
        let turns = Turns::default();
        let low = Yield::new();
        low.promote();
        // No urgent waiter needed to tell: it simply takes the free turn.
        let _t = turns.take(Some(&low));
        assert!(!low.is_yielding());
    }

    #[test]
    fn yielding_work_leaves_reserved_connections() {
        let slots = Slots::new(8);
        let low = Yield::new();
        let held: Vec<_> = (0..6)
            .map(|_| slots.take(Some(&low), Duration::from_secs(1)).unwrap())
            .collect();
        assert!(slots.take(Some(&low), Duration::from_millis(20)).is_err());
        // Urgent work takes no slot at all.
        assert!(slots.take(None, Duration::ZERO).unwrap().is_none());
        drop(held);
        assert!(slots.take(Some(&low), Duration::ZERO).unwrap().is_some());
    }
}
