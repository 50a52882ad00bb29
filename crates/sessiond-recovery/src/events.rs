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

use std::{collections::VecDeque, sync::Arc};

use futures::stream::{self, BoxStream};
use sessiond_domain::{Event, SessionId, TaskId};
use sessiond_store::Store;
use tokio::sync::broadcast;

use crate::error::Result;

/// A stream of events that never skips and never repeats a seq. Events are
/// shared, not copied, between the subscribers of one session.
pub type EventStream = BoxStream<'static, Result<Arc<Event>>>;

/// Fans committed events out to subscribers. Events travel as `Arc`s, so a
/// commit costs each subscriber a pointer copy, not a clone of the event.
#[derive(Debug, Clone)]
pub struct EventBus {
    tx: broadcast::Sender<Arc<Event>>,
}

impl EventBus {
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(capacity.max(16));
        Self { tx }
    }

    /// Publishes committed events, in the order given.
    pub fn publish(&self, events: &[Event]) {
        for event in events {
            // No receiver is fine: the outbox has it.
            let _ = self.tx.send(Arc::new(event.clone()));
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.tx.subscribe()
    }
}

/// What a watcher follows.
#[derive(Debug, Clone, Copy)]
enum Scope {
    Session(SessionId),
    Task(TaskId),
}

impl Scope {
    fn matches(self, e: &Event) -> bool {
        match self {
            Scope::Session(s) => e.session_id == s,
            Scope::Task(t) => e.task_id == t,
        }
    }

    fn cursor(self, e: &Event) -> i64 {
        match self {
            Scope::Session(_) => e.seq,
            Scope::Task(_) => e.task_seq,
        }
    }

    async fn read(self, store: &Store, after: i64, limit: u32) -> Result<Vec<Event>> {
        Ok(match self {
            Scope::Session(s) => store.events_after(s, after, limit).await?,
            Scope::Task(t) => store.task_events_after(t, after, limit).await?,
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
    let watcher = Watcher {
        rx: bus.subscribe(),
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
    rx: broadcast::Receiver<Arc<Event>>,
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

impl Watcher {
    async fn next(&mut self) -> Option<Result<Arc<Event>>> {
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
                Ok(e) if !self.scope.matches(&e) => {}
                Ok(e) => {
                    let seq = self.scope.cursor(&e);
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
                // The manager is gone (backend shutting down): end the stream.
                Err(broadcast::error::RecvError::Closed) => self.done = true,
            }
        }
    }

    /// Queues one page of what is stored after the cursor; true when the page
    /// was full, so there may be more.
    async fn read_page(&mut self) -> Result<bool> {
        let batch = self.scope.read(&self.store, self.last, self.page).await?;
        let full = batch.len() >= self.page as usize;
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
