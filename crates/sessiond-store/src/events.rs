//! Events across replicas on PostgreSQL: every commit that stores events
//! also sends, in its transaction, one `NOTIFY sessiond_events` per event
//! (delivered only if the transaction commits, in commit order), naming the
//! replica that wrote it. Each replica listens on a connection of its own
//! and hands what the *other* replicas committed to its event bus. A
//! notification only wakes: readers read the outbox after their last seq,
//! so a lost notification delays an event, never loses or reorders it.
//!
//! The listener waits on libpq's socket itself (diesel's connection offers
//! no way to block until a notification comes): a wake-up costs the
//! notification's trip, not a polling interval.

use std::time::Duration;

use tokio::sync::mpsc::{self, Receiver, Sender, error::TrySendError};

use diesel::RunQueryDsl;
use sessiond_domain::{Event, SessionId, TaskId};

use crate::{Result, conn::AnyConnection, pg_listen::Listener, store::Store};

pub(crate) const CHANNEL: &str = "sessiond_events";

/// How long the listener waits on its socket before it looks whether
/// anyone still listens.
const WAIT: Duration = Duration::from_secs(1);

/// What the listener hands out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventWake {
    /// Another replica committed this event.
    Committed {
        /// The event's session.
        session: SessionId,
        /// Its seq in the session.
        seq: i64,
        /// The session's task.
        task: TaskId,
        /// Its seq in the task.
        task_seq: i64,
    },
    /// The listener (re)connected: notifications may have been missed
    /// meanwhile; readers should look at the outbox.
    Resync,
    /// Another replica stopped and released its leases: they may be
    /// claimed now.
    LeasesReleased,
}

/// The payload word of a release (`{origin} released`).
const RELEASED: &str = "released";

/// PostgreSQL: tells the other replicas that `origin` released its leases,
/// in the caller's transaction (delivered when it commits).
pub(crate) fn notify_released(c: &mut AnyConnection, origin: &str) -> Result<()> {
    if let AnyConnection::Pg(pg) = c {
        diesel::sql_query("SELECT pg_notify($1, $2)")
            .bind::<diesel::sql_types::Text, _>(CHANNEL)
            .bind::<diesel::sql_types::Text, _>(format!("{origin} {RELEASED}"))
            .execute(pg)?;
    }
    Ok(())
}

/// Sends one notification per event in the caller's transaction (Postgres,
/// with an origin only), all in one statement: one round trip per commit,
/// not per event.
pub(crate) fn notify(c: &mut AnyConnection, origin: Option<&str>, events: &[Event]) -> Result<()> {
    let (Some(origin), AnyConnection::Pg(pg)) = (origin, c) else {
        return Ok(());
    };
    if events.is_empty() {
        return Ok(());
    }
    let payloads: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{origin} {} {} {} {}",
                e.session_id, e.seq, e.task_id, e.task_seq
            )
        })
        .collect();
    diesel::sql_query("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p")
        .bind::<diesel::sql_types::Text, _>(CHANNEL)
        .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(payloads)
        .execute(pg)?;
    Ok(())
}

fn parse(payload: &str, me: &str) -> Option<EventWake> {
    let mut parts = payload.split(' ');
    let origin = parts.next()?;
    if origin == me {
        return None;
    }
    let first = parts.next()?;
    if first == RELEASED {
        return Some(EventWake::LeasesReleased);
    }
    let mut parts = std::iter::once(first).chain(parts);
    Some(EventWake::Committed {
        session: SessionId::parse(parts.next()?).ok()?,
        seq: parts.next()?.parse().ok()?,
        task: TaskId::parse(parts.next()?).ok()?,
        task_seq: parts.next()?.parse().ok()?,
    })
}

impl Store {
    /// PostgreSQL: listens for the events other replicas commit (all but
    /// `me`'s) on a connection of its own, on a thread that ends when the
    /// receiver is dropped. Returns once the `LISTEN` is in place (waiting
    /// at most 10 s; a listener that needed longer sends
    /// [`EventWake::Resync`] once it is, as after any reconnect), so no
    /// commit after the call goes unnoticed. `None` on SQLite.
    pub fn listen_events(&self, me: &str) -> Option<Receiver<EventWake>> {
        if self.backend() != crate::Backend::Postgres {
            return None;
        }
        let (tx, rx) = mpsc::channel(4096);
        let target = self.target.to_string();
        let me = me.to_owned();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("sessiond-listen".into())
            .spawn(move || listen(&target, &me, &tx, &ready_tx))
            .ok()?;
        if ready_rx.recv_timeout(LISTEN_READY).is_err() {
            tracing::warn!("the event listener is not listening yet; it resyncs once it is");
        }
        Some(rx)
    }
}

/// How long [`Store::listen_events`] waits for its `LISTEN`.
pub(crate) const LISTEN_READY: Duration = Duration::from_secs(10);

fn listen(target: &str, me: &str, tx: &Sender<EventWake>, ready: &std::sync::mpsc::Sender<()>) {
    let mut first = true;
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut conn = match Listener::connect(target, CHANNEL) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "event listener cannot connect; retrying");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
                if tx.is_closed() {
                    return;
                }
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        // The caller gave up waiting for the first LISTEN (its receiver of
        // `ready` is gone): what was committed meanwhile is read again.
        let caller_waited = first && ready.send(()).is_ok();
        if !caller_waited && !send(tx, EventWake::Resync) {
            return;
        }
        first = false;
        loop {
            match conn.wait(WAIT) {
                Ok(payloads) => {
                    for p in payloads {
                        if let Some(wake) = parse(&p, me)
                            && !send(tx, wake)
                        {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event listener lost its connection; reconnecting");
                    break;
                }
            }
            // Also notices a receiver that went away while all was quiet.
            if tx.is_closed() {
                return;
            }
        }
    }
}

/// False when nobody listens any more. A full channel drops the wake and
/// asks for a resync instead (readers catch up from the outbox).
fn send(tx: &Sender<EventWake>, wake: EventWake) -> bool {
    match tx.try_send(wake) {
        Ok(()) => true,
        // The relay is behind: it resyncs from the outbox once it gets here.
        Err(TrySendError::Full(_)) => tx.blocking_send(EventWake::Resync).is_ok(),
        Err(TrySendError::Closed(_)) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_of_others_parse_and_ours_are_skipped() {
        let s = SessionId::new();
        let t = TaskId::new();
        let payload = format!("replica-a {s} 7 {t} 12");
        assert_eq!(
            parse(&payload, "replica-b"),
            Some(EventWake::Committed {
                session: s,
                seq: 7,
                task: t,
                task_seq: 12
            })
        );
        assert_eq!(parse(&payload, "replica-a"), None);
        assert_eq!(parse("garbage", "x"), None);
        assert_eq!(
            parse("replica-a released", "replica-b"),
            Some(EventWake::LeasesReleased)
        );
        assert_eq!(parse("replica-a released", "replica-a"), None);
    }
}
