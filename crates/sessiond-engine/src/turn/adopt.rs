//! A turn agentctl started that the store never recorded: sessiond sends a
//! turn's Prompt while its intent commits (agentctl journals the turn
//! before its agent sees it), so a backend that died between the two, or a
//! commit that failed, leaves a turn that ran with no record. agentctl puts
//! `TurnStarted` (with the text) on its stream ahead of everything the turn
//! produces, and the pump records the turn from it, as the send would have:
//! the user message (its id the turn id), the session RUNNING. A turn an
//! earlier agentctl process handed to its agent (both died since) is
//! recorded and ended *interrupted* at once: nothing runs it now, and its
//! reply went with that process.

use chrono::Utc;
use sessiond_domain::{Message, MessageId, MessageKind, MessageRole, SessionState};
use sessiond_proto::agentctl::v1 as pb;

use super::{LAST_TURN_KEY, TURN_KEY, pump::Pump, start::turn_start_change};
use crate::error::Result;

impl Pump {
    pub(super) async fn turn_started(&mut self, started: &pb::TurnStarted) -> Result<()> {
        // The usual case, on the turn's path to its first chunk: the send
        // that started the turn committed it, as the status snapshot shows
        // (no lock, no store read).
        let known =
            |s: &sessiond_domain::Session| s.metadata.get(LAST_TURN_KEY) == Some(&started.turn_id);
        let in_snapshot = || {
            self.mgr
                .inner
                .sessions
                .committed_session(self.session_id)
                .is_some_and(|s| known(&s))
        };
        if in_snapshot() {
            return Ok(());
        }
        let guard = self.mgr.inner.sessions.lock(self.session_id).await;
        // The send holds the lock while the turn commits (its `TurnStarted`
        // can come first, the commit runs beside the Prompt): once it has
        // the lock, the snapshot has the turn, with no store read on the
        // way to the first chunk.
        if in_snapshot() {
            return Ok(());
        }
        let store = &self.mgr.inner.store;
        let session = store.get_session(self.session_id).await?;
        if known(&session) {
            return Ok(());
        }
        let Ok(id) = uuid::Uuid::try_parse(&started.turn_id).map(MessageId::from_uuid) else {
            tracing::warn!(session = %self.session_id, turn_id = %started.turn_id,
                "agentctl started a turn whose id is not a message id; not recorded");
            return Ok(());
        };
        if store.get_message(self.session_id, id).await?.is_some() {
            return Ok(());
        }
        // Recovery found the turn on agentctl and runs the session with it
        // (`turn_id` alone, not `last_turn`).
        let marked = session.state == SessionState::Running
            && session.metadata.get(TURN_KEY) == Some(&started.turn_id);
        if session.state != SessionState::WaitingForInput && !marked {
            tracing::warn!(session = %self.session_id, turn_id = %started.turn_id,
                state = %session.state,
                "agentctl started a turn the store does not have, on a session that cannot take one; not recorded");
            return Ok(());
        }
        let now = Utc::now();
        let message = Message {
            id,
            session_id: self.session_id,
            task_id: self.task_id,
            role: MessageRole::User,
            content: started.text.clone(),
            kind: MessageKind::Text,
            data: if started.blocks == 0 {
                String::new()
            } else {
                // The blocks' contents are not on the stream.
                serde_json::json!({"unrecorded_blocks": started.blocks}).to_string()
            },
            seq: 0,
            complete: true,
            created_at: now,
            updated_at: now,
        };
        let change = turn_start_change(&session, &message, self.generation, self.instance.clone())?;
        self.mgr.commit(change).await?;
        self.mgr.inner.metrics.turn_started(self.session_id);
        drop(guard);
        if started.earlier_instance {
            tracing::warn!(session = %self.session_id, turn_id = %started.turn_id,
                ended = started.ended,
                "recorded a turn an earlier agentctl process handed to its agent; its reply was lost with it");
            let why = if started.ended {
                "the agent answered, but its reply was lost with its agentctl before sessiond stored it"
            } else {
                "agentctl and its agent stopped while the agent ran it"
            };
            return self.end_interrupted(&started.turn_id, why).await;
        }
        tracing::warn!(session = %self.session_id, turn_id = %started.turn_id,
            "recorded a turn agentctl started that the store did not have");
        Ok(())
    }
}
