//! The registry of the mailboxes through which a recovery that holds a
//! session takes calls on it while it brings the agent back (what it does
//! with them: `turn/letters.rs`).

use std::{collections::HashMap, sync::Mutex};

use sessiond_domain::{MessageId, QueuedMessage, Session, SessionId};
use tokio::sync::{mpsc, oneshot};

use crate::{
    Result, Sent,
    sync::{Held, Holds, lock},
};

/// What a call asks of the recovery holding its session.
pub(crate) enum Letter {
    /// Queue a message.
    Send {
        text: String,
        /// The message's id when the send named one (its request id).
        id: Option<MessageId>,
        /// The send's request id.
        key: Option<String>,
        /// `Some`: what became of it; `None`: not taken, send it the usual
        /// way.
        reply: oneshot::Sender<Result<Option<Sent>>>,
    },
    /// Take a queued message off the queue.
    Unqueue {
        id: MessageId,
        reply: oneshot::Sender<Result<(QueuedMessage, Session)>>,
    },
}

/// Open mailboxes, by session.
#[derive(Default)]
pub(crate) struct Mailboxes {
    open: Mutex<HashMap<SessionId, mpsc::UnboundedSender<Letter>>>,
    /// Woken at each [`Self::open`].
    opened: tokio::sync::Notify,
    /// Sessions where a send goes before the queue ([`Self::goes_first`]).
    first: Holds<SessionId>,
}

/// A session's open mailbox; closed when dropped.
pub(crate) struct Mailbox<'a> {
    boxes: &'a Mailboxes,
    pub(crate) session: SessionId,
    pub(crate) letters: mpsc::UnboundedReceiver<Letter>,
}

impl Drop for Mailbox<'_> {
    fn drop(&mut self) {
        lock(&self.boxes.open).remove(&self.session);
        // Letters still in it are answered `None` as they drop.
    }
}

impl Mailboxes {
    /// Opens `session`'s mailbox (the caller holds the session's lock).
    pub(crate) fn open(&self, session: SessionId) -> Mailbox<'_> {
        let (tx, letters) = mpsc::unbounded_channel();
        lock(&self.open).insert(session, tx);
        self.opened.notify_waiters();
        Mailbox {
            boxes: self,
            session,
            letters,
        }
    }

    /// A send on `session` goes before the queue while the guard lives:
    /// one that cannot be queued (`no_queue`, attachments), made while the
    /// session's agent is brought back with nothing queued, so messages
    /// queued after it wait for it (helper-58 F1: they went first, and it
    /// was then refused as the session was RUNNING).
    pub(crate) fn goes_first(&self, session: SessionId) -> Held<'_, SessionId> {
        self.first.hold(session)
    }

    /// Whether a send on `session` goes before its queue now.
    pub(crate) fn someone_first(&self, session: SessionId) -> bool {
        self.first.is_held(session)
    }

    /// The open mailbox of `session`, if any.
    pub(crate) fn sender(&self, session: SessionId) -> Option<mpsc::UnboundedSender<Letter>> {
        lock(&self.open).get(&session).cloned()
    }

    /// Woken at each [`Self::open`].
    pub(crate) fn opened(&self) -> &tokio::sync::Notify {
        &self.opened
    }
}
