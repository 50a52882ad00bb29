//! Publication of committed events, and resumable subscriptions.
//!
//! Every event is a row of the outbox before anyone sees it: the manager
//! commits a changeset, then hands the events it wrote to [`EventBus::publish`].
//! A watcher subscribes to the live channel first, then replays the outbox
//! after its cursor, then forwards live events: one whose seq is not above
//! the cursor is a duplicate and dropped; one that skips ahead (a concurrent
//! commit published out of order, or a lagging receiver) makes the watcher
//! re-read the outbox from its cursor. So a watcher sees every seq exactly
//! once, in order, whatever happens between subscribe, replay and tail.

use std::{
    collections::{HashMap, VecDeque},
    hash::Hash,
    sync::{Arc, Mutex, PoisonError, Weak},
};

use futures::stream::{self, BoxStream};
use sessiond_domain::{Event, SessionId, TaskId};
use sessiond_store::Store;
use tokio::sync::broadcast;

use crate::{error::Result, metrics::WatchMetrics};

/// A stream of events that never skips and never repeats a seq. Events are
/// shared, not copied, between the subscribers of one session.
pub type EventStream = BoxStream<'static, Result<Arc<Event>>>;

/// Fans committed events out to subscribers: one channel per watched
/// session and per watched task, so a commit wakes only the watchers of its
/// own session and task (not every watcher of every session), and costs each
/// a pointer copy (`Arc`), not a clone of the event. A channel exists while
/// someone watches its key; the last watcher to go removes it.
#[derive(Debug, Clone)]
pub struct EventBus {
    channels: Arc<Channels>,
}

#[derive(Debug)]
struct Channels {
    capacity: usize,
    metrics: WatchMetrics,
    sessions: Mutex<HashMap<SessionId, broadcast::Sender<Arc<Event>>>>,
    tasks: Mutex<HashMap<TaskId, broadcast::Sender<Arc<Event>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sends to `key`'s channel, if anyone watches it; a channel whose
/// receivers are all gone is removed.
fn send_to<K: Eq + Hash>(
    map: &Mutex<HashMap<K, broadcast::Sender<Arc<Event>>>>,
    key: &K,
    event: &Arc<Event>,
) {
    let mut map = lock(map);
    if let Some(tx) = map.get(key)
        && tx.send(event.clone()).is_err()
    {
        map.remove(key);
    }
}

fn subscribe_to<K: Eq + Hash + Copy>(
    map: &Mutex<HashMap<K, broadcast::Sender<Arc<Event>>>>,
    key: K,
    capacity: usize,
) -> broadcast::Receiver<Arc<Event>> {
    lock(map)
        .entry(key)
        .or_insert_with(|| broadcast::channel(capacity).0)
        .subscribe()
}

/// Removes `key`'s channel when the receiver about to be dropped is its last.
fn release<K: Eq + Hash>(map: &Mutex<HashMap<K, broadcast::Sender<Arc<Event>>>>, key: &K) {
    let mut map = lock(map);
    if map.get(key).is_some_and(|tx| tx.receiver_count() <= 1) {
        map.remove(key);
    }
}

impl EventBus {
    /// A bus whose per-key channels hold `capacity` events (at least 16)
    /// for slow watchers; one that falls further behind re-reads the outbox.
    pub fn new(capacity: usize) -> Self {
        Self::with_metrics(capacity, WatchMetrics::default())
    }

    pub(crate) fn with_metrics(capacity: usize, metrics: WatchMetrics) -> Self {
        Self {
            channels: Arc::new(Channels {
                metrics,
                capacity: capacity.max(16),
                sessions: Mutex::default(),
                tasks: Mutex::default(),
            }),
        }
    }

    /// Publishes committed events, in the order given. No watcher is fine:
    /// the outbox has them.
    pub fn publish(&self, events: &[Event]) {
        let c = &self.channels;
        for event in events {
            let watched_session = lock(&c.sessions).contains_key(&event.session_id);
            let watched_task = lock(&c.tasks).contains_key(&event.task_id);
            if !watched_session && !watched_task {
                continue;
            }
            let event = Arc::new(event.clone());
            if watched_session {
                send_to(&c.sessions, &event.session_id, &event);
            }
            if watched_task {
                send_to(&c.tasks, &event.task_id, &event);
            }
        }
    }

    /// Ends the live channel of a deleted session: its watchers hand out
    /// what they hold, then end with NOT_FOUND instead of waiting for good.
    pub fn close_session(&self, session: SessionId) {
        lock(&self.channels.sessions).remove(&session);
    }

    fn subscribe(&self, scope: Scope) -> broadcast::Receiver<Arc<Event>> {
        let c = &self.channels;
        match scope {
            Scope::Session(s) => subscribe_to(&c.sessions, s, c.capacity),
            Scope::Task(t) => subscribe_to(&c.tasks, t, c.capacity),
        }
    }

    /// Whether anyone here watches this session or its task.
    pub(crate) fn watches(&self, session: SessionId, task: TaskId) -> bool {
        let c = &self.channels;
        lock(&c.sessions).contains_key(&session) || lock(&c.tasks).contains_key(&task)
    }

    /// The sessions and tasks watched here now.
    pub(crate) fn watched_keys(&self) -> (Vec<SessionId>, Vec<TaskId>) {
        let c = &self.channels;
        (
            lock(&c.sessions).keys().copied().collect(),
            lock(&c.tasks).keys().copied().collect(),
        )
    }

    /// Watchers of sessions and of tasks with a channel now (for tests).
    pub fn watched(&self) -> (usize, usize) {
        let c = &self.channels;
        (lock(&c.sessions).len(), lock(&c.tasks).len())
    }
}

/// The payload a watcher's replay page holds at most (besides its count):
/// a page of a long reply's updates, each carrying the whole message, held
/// gigabytes for each watcher that did not read.
const REPLAY_PAGE_BYTES: u64 = 4 << 20;

/// What a watcher follows.
#[derive(Debug, Clone, Copy)]
enum Scope {
    Session(SessionId),
    Task(TaskId),
}

impl Scope {
    fn cursor(self, e: &Event) -> i64 {
        match self {
            Scope::Session(_) => e.seq,
            Scope::Task(_) => e.task_seq,
        }
    }

    /// One replay page after `after`, and whether more may follow.
    async fn read(self, store: &Store, after: i64, limit: u32) -> Result<(Vec<Event>, bool)> {
        Ok(match self {
            Scope::Session(s) => {
                store
                    .events_page_after(s, after, limit, REPLAY_PAGE_BYTES)
                    .await?
            }
            Scope::Task(t) => {
                store
                    .task_events_page_after(t, after, limit, REPLAY_PAGE_BYTES)
                    .await?
            }
        })
    }
}

pub(crate) fn watch_session(
    store: Store,
    bus: &EventBus,
    session: SessionId,
    after_seq: i64,
    page: u32,
) -> EventStream {
    watch(store, bus, Scope::Session(session), after_seq, page)
}

pub(crate) fn watch_task(
    store: Store,
    bus: &EventBus,
    task: TaskId,
    after_task_seq: i64,
    page: u32,
) -> EventStream {
    watch(store, bus, Scope::Task(task), after_task_seq, page)
}

fn watch(store: Store, bus: &EventBus, scope: Scope, after: i64, page: u32) -> EventStream {
    // Subscribe before the first replay, so nothing committed after the
    // replay's read can be missed.
    let metrics = bus.channels.metrics.clone();
    metrics.opened(matches!(scope, Scope::Session(_)));
    let watcher = Watcher {
        metrics,
        seen: after.max(0),
        lag: 0,
        rx: bus.subscribe(scope),
        bus: Arc::downgrade(&bus.channels),
        store,
        scope,
        last: after.max(0),
        page: page.max(1),
        pending: VecDeque::new(),
        catch_up: true,
        done: false,
    };
    // The subscriber's own stream polls the receiver: no relay task and no
    // second channel between a commit and the subscriber.
    Box::pin(stream::unfold(watcher, |mut w| async move {
        let item = w.next().await?;
        Some((item, w))
    }))
}

struct Watcher {
    metrics: WatchMetrics,
    /// The newest seq known committed (from the live channel or a replay).
    seen: i64,
    /// This watcher's share of the outbox lag gauge.
    lag: i64,
    rx: broadcast::Receiver<Arc<Event>>,
    /// To remove the channel when this is its last watcher. Weak: watchers
    /// must not keep the bus alive (its end is what ends their streams).
    bus: Weak<Channels>,
    store: Store,
    scope: Scope,
    last: i64,
    page: u32,
    /// Replayed events not yet handed out.
    pending: VecDeque<Arc<Event>>,
    /// The outbox must be read from the cursor before the next live event.
    catch_up: bool,
    done: bool,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.metrics.lag.dec_by(self.lag);
        self.metrics.closed(matches!(self.scope, Scope::Session(_)));
        if let Some(c) = self.bus.upgrade() {
            match self.scope {
                Scope::Session(s) => release(&c.sessions, &s),
                Scope::Task(t) => release(&c.tasks, &t),
            }
        }
    }
}

impl Watcher {
    /// Re-states this watcher's lag each time its client takes an event:
    /// events known committed (replayed or received) but not handed out,
    /// plus those published and still queued in its channel.
    fn report_lag(&mut self) {
        let delivered = self.last - self.pending.len() as i64;
        let queued = i64::try_from(self.rx.len()).unwrap_or(i64::MAX / 2);
        let lag = (self.seen.max(self.last) - delivered).max(0) + queued;
        self.metrics.lag.inc_by(lag - self.lag);
        self.lag = lag;
    }

    async fn next(&mut self) -> Option<Result<Arc<Event>>> {
        let item = self.next_inner().await;
        self.report_lag();
        item
    }

    async fn next_inner(&mut self) -> Option<Result<Arc<Event>>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(Ok(e));
            }
            if self.done {
                return None;
            }
            if self.catch_up {
                match self.read_page().await {
                    Ok(full) => self.catch_up = full,
                    Err(e) => {
                        self.done = true;
                        return Some(Err(e));
                    }
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(e) => {
                    let seq = self.scope.cursor(&e);
                    self.seen = self.seen.max(seq);
                    if seq == self.last + 1 {
                        self.last = seq;
                        return Some(Ok(e));
                    }
                    // A seq at or below the cursor is a duplicate; one that
                    // skips ahead (commits published out of order) means the
                    // outbox has what came between.
                    if seq > self.last {
                        self.catch_up = true;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.catch_up = true,
                // The session was deleted (`close_session`): said, so a
                // client does not wait on it; else the manager is gone
                // (backend shutting down): the stream ends.
                Err(broadcast::error::RecvError::Closed) => {
                    self.done = true;
                    if let Scope::Session(id) = self.scope
                        && let Err(e) = self.store.get_session(id).await
                    {
                        return Some(Err(e.into()));
                    }
                }
            }
        }
    }

    /// Queues one page of what is stored after the cursor; true when the page
    /// was full (by count or by size), so there may be more.
    async fn read_page(&mut self) -> Result<bool> {
        let (batch, full) = self.scope.read(&self.store, self.last, self.page).await?;
        for e in batch {
            let seq = self.scope.cursor(&e);
            if seq > self.last {
                self.last = seq;
                self.pending.push_back(Arc::new(e));
            }
        }
        Ok(full)
    }
}
