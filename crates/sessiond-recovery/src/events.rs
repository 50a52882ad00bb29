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

use futures::stream::BoxStream;
use sessiond_domain::{Event, SessionId, TaskId};
use sessiond_store::Store;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Error, Result};

/// A stream of events that never skips and never repeats a seq.
pub type EventStream = BoxStream<'static, Result<Event>>;

/// Fans committed events out to subscribers.
#[derive(Debug, Clone)]
pub struct EventBus {
    tx: broadcast::Sender<Event>,
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
            let _ = self.tx.send(event.clone());
        }
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Event> {
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
    let rx = bus.subscribe();
    let (tx, out) = mpsc::channel(page.clamp(16, 1024) as usize);
    tokio::spawn(async move {
        let mut w = Watcher {
            store,
            scope,
            last: after.max(0),
            page: page.max(1),
            tx,
        };
        if let Err(e) = w.run(rx).await {
            let _ = w.tx.send(Err(e)).await;
        }
    });
    Box::pin(ReceiverStream::new(out))
}

struct Watcher {
    store: Store,
    scope: Scope,
    last: i64,
    page: u32,
    tx: mpsc::Sender<Result<Event>>,
}

/// The subscriber went away; stop quietly.
struct Gone;

impl From<Gone> for Error {
    fn from(_: Gone) -> Self {
        Error::Internal("subscriber gone".into())
    }
}

impl Watcher {
    async fn run(&mut self, mut rx: broadcast::Receiver<Event>) -> Result<()> {
        if self.catch_up().await?.is_err() {
            return Ok(());
        }
        loop {
            let received = tokio::select! {
                r = rx.recv() => r,
                () = self.tx.closed() => return Ok(()),
            };
            let step = match received {
                Ok(e) if !self.scope.matches(&e) => Ok(()),
                Ok(e) => {
                    let seq = self.scope.cursor(&e);
                    if seq <= self.last {
                        Ok(())
                    } else if seq == self.last + 1 {
                        self.last = seq;
                        self.tx.send(Ok(e)).await.map_err(|_| Gone)
                    } else {
                        self.catch_up().await?
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.catch_up().await?,
                // The manager is gone (backend shutting down): end the stream.
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            };
            if step.is_err() {
                return Ok(());
            }
        }
    }

    /// Sends everything stored after the cursor.
    async fn catch_up(&mut self) -> Result<Result<(), Gone>> {
        loop {
            let batch = self.scope.read(&self.store, self.last, self.page).await?;
            let n = batch.len();
            for e in batch {
                let seq = self.scope.cursor(&e);
                if seq <= self.last {
                    continue;
                }
                self.last = seq;
                if self.tx.send(Ok(e)).await.is_err() {
                    return Ok(Err(Gone));
                }
            }
            if n < self.page as usize {
                return Ok(Ok(()));
            }
        }
    }
}
