//! Messages sent while the session's agent is being brought back: queued
//! by the recovery that holds the session's lock, at once, instead of
//! waiting for the agent (a heavy agent takes seconds to start and load
//! its history, and a launch slot may be minutes away: helper-51 1).
//!
//! A recovery that launches or reopens an agent opens the session's
//! *mailbox* for that step ([`Mailboxes::open`](crate::mailboxes::Mailboxes::open)). A queueable send
//! ([`Turns::post_while_recovering`]) posts its message there as a
//! [`Letter`]; the recovery, between the step's own awaits
//! ([`serve_during`]), reads the session under its lock, appends the
//! message to the session's queue in one commit (as a send behind a running
//! turn does), and answers the sender with the queued copy. The queue is
//! delivered once the agent is back, by the usual kick. The recovery's own
//! later writes carry the queue on ([`carry_queue`]). A queued message is
//! taken off the queue the same way (`CancelQueuedMessage`), not after the
//! agent is back, by when it would have been delivered.
//!
//! A send finds no mailbox when no agent is being brought back; a letter
//! the recovery did not take (its step ended first, the session is in no
//! state to queue) is answered `None`, and the send goes the usual way.

use std::future::Future;

use sessiond_domain::{MessageId, QueuedMessage, Session, SessionId, SessionState, queue};
use tokio::sync::{mpsc, oneshot};

use crate::mailboxes::{Letter, Mailbox};

use super::{INTERRUPTED_TURN_KEY, Turns};
use crate::{Result, Sent};

/// Runs `step`, taking the letters posted to `mailbox` meanwhile; the
/// session as the last letter's commit left it goes to `latest`. The step
/// must not write the session itself (its version would be stale).
pub(crate) async fn serve_during<T>(
    mgr: &crate::SessionManager,
    mailbox: &mut Mailbox<'_>,
    latest: &mut Option<Session>,
    step: impl Future<Output = T>,
) -> T {
    tokio::pin!(step);
    loop {
        tokio::select! {
            biased;
            done = &mut step => return done,
            Some(letter) = mailbox.letters.recv() => {
                let turns = Turns(mgr);
                let session = mailbox.session;
                // The sender may have gone (its client's deadline): what
                // was done stands, as for any call whose answer is lost.
                match letter {
                    Letter::Send { text, id, key, reply } => {
                        let taken = turns.take_letter(session, &text, id, key.as_deref(), latest).await;
                        let _ = reply.send(taken);
                    }
                    Letter::Unqueue { id, reply } => {
                        let taken = turns.unqueue(session, id).await;
                        if let Ok((_, committed)) = &taken {
                            *latest = Some(committed.clone());
                        }
                        let _ = reply.send(taken);
                    }
                }
            }
        }
    }
}

/// `run`'s copy of the session, brought up to what the letters' commits
/// wrote (`latest`): their version, and the queue (and the interrupted
/// turn a new message gives up). The rest of `run` stays as the recovery
/// has it (what it has not written yet).
pub(crate) fn carry_queue(latest: Session, run: &mut Session) {
    let is_ours = |k: &String| k.starts_with(queue::QUEUE_PREFIX) || k == INTERRUPTED_TURN_KEY;
    run.metadata.retain(|k, _| !is_ours(k));
    run.metadata
        .extend(latest.metadata.into_iter().filter(|(k, _)| is_ours(k)));
    run.version = latest.version;
    run.updated_at = latest.updated_at;
}

impl Turns<'_> {
    /// Queues `text` with the recovery bringing `session_id`'s agent back,
    /// if one is: `None` when none is (or it did not take the message), and
    /// the send goes on the usual way.
    pub(crate) async fn post_while_recovering(
        &self,
        session_id: SessionId,
        text: &str,
        id: Option<MessageId>,
        key: Option<&str>,
    ) -> Option<Result<Sent>> {
        let mailbox = self.mailbox(session_id).await?;
        let (reply, answer) = oneshot::channel();
        let letter = Letter::Send {
            text: text.to_owned(),
            id,
            key: key.map(str::to_owned),
            reply,
        };
        mailbox.send(letter).ok()?;
        answer.await.ok()?.transpose()
    }

    /// Takes queued message `id` off the queue through the recovery
    /// bringing `session_id`'s agent back, if one is (`None`: none is).
    pub(crate) async fn unqueue_while_recovering(
        &self,
        session_id: SessionId,
        id: MessageId,
    ) -> Option<Result<(QueuedMessage, Session)>> {
        let mailbox = self.mailbox(session_id).await?;
        let (reply, answer) = oneshot::channel();
        mailbox.send(Letter::Unqueue { id, reply }).ok()?;
        answer.await.ok()
    }

    /// The session's open mailbox, once the recovery bringing its agent
    /// back opens it; `None` when no recovery does (or it ends without).
    async fn mailbox(&self, session_id: SessionId) -> Option<mpsc::UnboundedSender<Letter>> {
        let boxes = &self.inner.mailboxes;
        let until = tokio::time::Instant::now() + super::start::RECOVERY_WAIT;
        loop {
            let opened = boxes.opened().notified();
            tokio::pin!(opened);
            opened.as_mut().enable();
            if self.agent_runs(session_id) {
                return None;
            }
            if let Some(tx) = boxes.sender(session_id) {
                return Some(tx);
            }
            // A recovery under way opens the mailbox once it launches or
            // reopens the agent, or ends without (the agent was alive).
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let recovery = self.recovery();
            if !recovery.is_bringing_back(session_id) || left.is_zero() {
                return None;
            }
            tokio::select! {
                () = opened => {}
                () = recovery.brought_back(session_id, left) => return None,
            }
        }
    }

    /// What the recovery does with `letter` (it holds the lock).
    async fn take_letter(
        &self,
        session_id: SessionId,
        text: &str,
        id: Option<MessageId>,
        key: Option<&str>,
        latest: &mut Option<Session>,
    ) -> Result<Option<Sent>> {
        let session = self.inner.store.get_session(session_id).await?;
        if !matches!(
            session.state,
            SessionState::WaitingForInput | SessionState::Running | SessionState::Starting
        ) {
            return Ok(None);
        }
        if let (Some(id), Some(key)) = (id, key)
            && let Some(before) = self.sent_before(session_id, id, key, text, &[]).await?
        {
            return Ok(Some(before));
        }
        let (queued, committed) = self
            .enqueue_as(session, text, id, "while the agent is brought back")
            .await?;
        *latest = Some(committed);
        Ok(Some(Sent::Queued(queued)))
    }
}
