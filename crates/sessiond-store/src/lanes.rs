//! Bulk work that yields to everyone else's store calls.
//!
//! A startup recovery pass runs dozens of executors' recoveries at once,
//! each a few reads and writes. A call that waits for one session (its own
//! recovery, then its own writes) would otherwise queue behind all of
//! them: for SQLite's single writer (this process's writers take turns on
//! one lock) and for the pool's connections. Work run inside
//! [`Store::yielding`] (with a [`Yield`] flag that is set) takes the write
//! turn only when no other writer waits, and, while anyone else's store
//! call is in flight, holds at most all but [`RESERVED`] of the pool's
//! connections besides the writer's, so a call's store work never waits
//! for more than the one statement in progress. Alone (no other store call
//! in flight: the pass without any call) it uses the pool as work that does
//! not yield would, so yielding costs the pass nothing. The flag is shared:
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

/// Connections of the pool (besides the writer's) that yielding work leaves
/// free while anyone else's store call is in flight.
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

/// Runs `fut` with its store calls yielding while `flag` says so. Not an
/// `async fn`: that would hold `fut` twice (its argument and the scope).
pub(crate) fn scope<F: std::future::Future>(
    flag: Yield,
    fut: F,
) -> tokio::task::futures::TaskLocalFuture<Yield, F> {
    YIELD.scope(flag, fut)
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

/// Counts the pool connections yielding work holds, and the store calls
/// of everyone else in flight.
///
/// Yielding work holds at most all the pool's connections but one (kept for
/// SQLite's writer, which takes no slot: see `Store::write`) while nobody
/// else is using the store, so the pass alone runs as it would without
/// yielding; while another call is in flight it holds at most all but
/// [`RESERVED`] more, so that call waits for at most one yielding statement
/// to end (new yielding work waits here, not in the pool's queue).
#[derive(Debug)]
pub(crate) struct Slots {
    state: Mutex<SlotState>,
    freed: Condvar,
    /// Connections yielding work may hold while nobody else uses the store.
    alone: u32,
    /// ... and while someone does.
    shared: u32,
}

#[derive(Debug, Default)]
struct SlotState {
    /// Connections held (or being checked out) by yielding work.
    held: u32,
    /// Store calls of non-yielding work in flight.
    urgent: u32,
}

/// One connection's worth of [`Slots`], given back when dropped.
pub(crate) struct Slot<'a>(&'a Slots);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.lock().held -= 1;
        self.0.freed.notify_one();
    }
}

/// A non-yielding store call in flight (see [`Slots::urgent`]).
pub(crate) struct Urgent<'a>(&'a Slots);

impl Drop for Urgent<'_> {
    fn drop(&mut self) {
        self.0.lock().urgent -= 1;
        // Yielding work waiting for the tighter limit may go on.
        self.0.freed.notify_all();
    }
}

impl Slots {
    /// For a pool of `pool_size` connections (see the type's docs; each
    /// limit at least one).
    pub(crate) fn new(pool_size: u32) -> Self {
        let alone = pool_size.saturating_sub(1).max(1);
        Slots {
            state: Mutex::default(),
            freed: Condvar::new(),
            alone,
            shared: pool_size.saturating_sub(1 + RESERVED).max(1).min(alone),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A store call of work that does not yield is starting: from now until
    /// the guard drops, yielding work keeps [`RESERVED`] connections free.
    pub(crate) fn urgent(&self) -> Urgent<'_> {
        self.lock().urgent += 1;
        Urgent(self)
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
        let mut s = self.lock();
        loop {
            let limit = if s.urgent > 0 {
                self.shared
            } else {
                self.alone
            };
            if s.held < limit {
                break;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            s = self
                .freed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        s.held += 1;
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
    fn yielding_work_leaves_reserved_connections_while_others_use_the_store() {
        let slots = Slots::new(8);
        let low = Yield::new();
        // Alone: all but the writer's connection.
        let mut held: Vec<_> = (0..7)
            .map(|_| slots.take(Some(&low), Duration::from_secs(1)).unwrap())
            .collect();
        assert!(slots.take(Some(&low), Duration::from_millis(20)).is_err());
        // Urgent work takes no slot at all.
        assert!(slots.take(None, Duration::ZERO).unwrap().is_none());
        // Someone else is using the store: yielding work shrinks to 5 (two
        // more left free) as its statements end.
        let call = slots.urgent();
        held.truncate(5);
        assert!(slots.take(Some(&low), Duration::from_millis(20)).is_err());
        drop(call);
        let sixth = slots.take(Some(&low), Duration::ZERO).unwrap();
        assert!(sixth.is_some());
        drop(held);
        assert!(slots.take(Some(&low), Duration::ZERO).unwrap().is_some());
    }

    #[test]
    fn the_last_urgent_call_ending_wakes_waiting_yielding_work() {
        let slots = Arc::new(Slots::new(8));
        let call = slots.urgent();
        let low = Yield::new();
        let held: Vec<_> = (0..5)
            .map(|_| slots.take(Some(&low), Duration::from_secs(1)).unwrap())
            .collect();
        let waiter = {
            let (slots, low) = (slots.clone(), low.clone());
            std::thread::spawn(move || {
                slots
                    .take(Some(&low), Duration::from_secs(30))
                    .map(|s| s.is_some())
            })
        };
        // Let it reach the wait (if it has not, it takes the slot at once
        // below: the test passes without proving the wake-up, never fails).
        std::thread::sleep(Duration::from_millis(50));
        drop(call);
        assert_eq!(waiter.join().unwrap(), Ok(true));
        drop(held);
    }
}
