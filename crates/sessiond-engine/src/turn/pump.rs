//! The per-session update pump: consumes agentctl's `StreamUpdates` from the
//! session's cursor and turns it into stored messages and state changes.
//!
//! - An agent reply is ONE message: added on its first chunk, updated as
//!   chunks arrive (at most every `message_flush_interval`), completed when
//!   the turn ends. Its id is agentctl's `message_id` (a UUID), so replaying
//!   the same updates after a backend restart rewrites the same message
//!   instead of adding a second one.
//! - The cursor is kept in memory and written to the session's metadata
//!   (`agentctl_cursor` = `<generation>:<cursor>@<instance>`) at every turn
//!   end and agent exit; a restarted backend continues from there, naming
//!   the agentctl instance the cursor belongs to (cursors restart at 1 in
//!   every agentctl process). Updates after the stored cursor are replayed:
//!   a replayed reply is rebuilt from its first chunk and never written
//!   shorter than what is stored (it only grows; a complete one is left
//!   alone), and a turn end whose turn is not the session's current one
//!   changes no state.
//! - `Gap` (the cursor fell out of agentctl's buffer, or agentctl is a new
//!   process): what was streamed is kept and the session's turn is settled
//!   by the decision table below, never ended as if its reply were whole.
//! - The agent exiting (not on our request) puts a live session in ERROR.
//! - A pending turn (the pump starts on a RUNNING session with a `turn_id`,
//!   i.e. after a restart or resume): the pump first catches up, i.e. reads
//!   up to agentctl's `latest_cursor`, so a reply the agent gave while the
//!   backend was down is stored and its `TurnEnded` moves the session to
//!   WAITING_FOR_INPUT before anything else can happen. If no `TurnEnded` of
//!   that turn came and the agent is idle, the turn is settled
//!   ([`Pump::settle_pending`], table in docs/decisions/0007-at-most-once-turns.md): at most
//!   once — delivered again only when agentctl's journal proves the prompt
//!   never reached an agent, otherwise ended *interrupted* with a system
//!   message.

//! - Parking: the pump runs only while it has work. An idle session
//!   (WAITING_FOR_INPUT, nothing pending, caught up with agentctl) holds no
//!   stream and no connection; see [`Turns::attach_updates`] and
//!   `Pump::try_park`. The next `send_message` starts a pump from the parked
//!   cursor; an agent exit while parked is found by the liveness check.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::Utc;
use sessiond_domain::{
    AgentProcessState, EventPayload, ExecutorRecord, ExecutorStatus, Message, MessageId,
    MessageKind, MessageRole, Runtime, Session, SessionEvent, SessionId, SessionState, TaskEvent,
    TaskId, TitleSource, UsageTotals,
};
use sessiond_executor::{AgentState, AgentctlClient};
use sessiond_proto::agentctl::v1::{self as pb, agent_update::Kind};
use sessiond_store::Changeset;

use super::{
    CANCELLED_LAST_KEY, CURSOR_KEY, Cut, STALE_STOP_RESTARTED, STALE_STOP_STOPPED, STALE_STOP_WHY,
    TURN_CANCELLED, TURN_GENERATION_KEY, TURN_INSTANCE_KEY, TURN_KEY, Turns, agent_title,
    cursor_value, cut_turn, part_data, pending_turn, stored_cursor, stored_part_rev,
};
use crate::{
    changes::transition,
    error::Result,
    flows::{RecoverFirst, TurnInFlight},
    lease::Fencing,
    manager::SessionManager,
    ops::Agents,
    ops::agent_process,
    restarts::{AfterExit, after_agent_exit, exit_how, stopped_after_cancel},
};

/// A pump with nothing to do (no reply streaming, no pending turn) checks
/// after this long without an update whether it can park.
const PARK_AFTER: Duration = Duration::from_millis(250);

/// How many reconnects in a row may fail before agentctl counts as lost.
const MAX_STREAM_FAILURES: u32 = 5;

/// The agent message being streamed.
#[derive(Debug)]
pub(super) struct Pending {
    id: MessageId,
    content: String,
    stored: bool,
    dirty: bool,
    last_flush: Instant,
    /// What the store already holds for this message, when it is longer
    /// than `content` (a replay rebuilding it from its first chunk): the
    /// stored reply only grows, so nothing shorter is written.
    floor: String,
    /// The stored message was complete: the replay changes nothing.
    frozen: bool,
}

pub(super) struct Pump {
    pub(super) mgr: SessionManager,
    pub(super) session_id: SessionId,
    pub(super) task_id: TaskId,
    pub(super) generation: i64,
    pub(super) client: AgentctlClient,
    pub(super) cursor: u64,
    pub(super) pending: Option<Pending>,
    /// Activity parts this pump has stored, with the rev stored.
    pub(super) parts: HashMap<MessageId, u64>,
    /// The session's pending turn (user message id) to settle once caught up.
    pub(super) settle: Option<String>,
    /// agentctl's latest cursor when this pump started (for `settle`).
    pub(super) target: Option<u64>,
    /// This pump counts in the manager's `settling` (`settle` is set).
    pub(super) settling: bool,
    /// The agentctl instance `cursor` belongs to (empty: not known).
    pub(super) instance: String,
    /// The instance was checked against agentctl's before the first open.
    pub(super) instance_checked: bool,
    /// When the last update came (or the stream opened).
    pub(super) last_activity: Instant,
}

impl Pump {
    pub(super) async fn run(mut self) {
        let mut failures = 0u32;
        loop {
            if self.settle.is_some() && self.target.is_none() {
                self.target = self.latest_cursor().await;
            }
            if !self.instance_checked {
                self.check_instance().await;
            }
            // Naming the instance: a cursor of an earlier agentctl process
            // gets a Gap and then everything the new one buffered.
            let opened = self
                .client
                .stream_updates(self.cursor, &self.instance)
                .await;
            let mut stream = match opened {
                Ok(r) => {
                    failures = 0;
                    self.last_activity = Instant::now();
                    self.try_settle().await;
                    r
                }
                Err(status) => {
                    if Fencing(&self.mgr).executor_refused(self.session_id, &status) {
                        return;
                    }
                    failures += 1;
                    tracing::debug!(session = %self.session_id, error = %status, failures, "update stream failed");
                    if let Some(gone) = self.agentctl_process_gone() {
                        self.agentctl_lost(&gone, TurnInFlight::Interrupt).await;
                        return;
                    }
                    if failures >= MAX_STREAM_FAILURES {
                        self.agentctl_lost(&status.to_string(), TurnInFlight::Settle)
                            .await;
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100 << failures.min(5))).await;
                    continue;
                }
            };
            loop {
                let flush_at = self
                    .pending
                    .as_ref()
                    .filter(|p| p.dirty)
                    .map(|p| p.last_flush + self.mgr.inner.config.message_flush_interval);
                let park_at = (self.pending.is_none() && self.settle.is_none())
                    .then_some(self.last_activity + PARK_AFTER);
                let next = tokio::select! {
                    m = stream.message() => m,
                    () = sleep_until(flush_at) => {
                        if let Err(e) = self.flush(false).await {
                            if e.is_store_unavailable() {
                                self.restart_from_store(&e).await;
                                return;
                            }
                            tracing::warn!(session = %self.session_id, error = %e, "could not write agent message");
                        }
                        continue;
                    }
                    () = sleep_until(park_at) => {
                        if self.try_park().await {
                            return;
                        }
                        self.last_activity = Instant::now();
                        continue;
                    }
                };
                match next {
                    Ok(Some(update)) => {
                        self.last_activity = Instant::now();
                        let mut restarted = false;
                        if !update.instance_id.is_empty() && update.instance_id != self.instance {
                            restarted = !self.instance.is_empty();
                            self.instance.clone_from(&update.instance_id);
                        }
                        if restarted && matches!(update.kind, Some(Kind::Gap(_))) {
                            // agentctl is another process now: what the old
                            // one had not sent is gone with it. Not a loss in
                            // the new one's stream; a turn pending is settled
                            // by the decision table (its journal says
                            // whether the old agent got the prompt).
                            self.cursor = update.cursor;
                            self.instance_restarted().await;
                            continue;
                        }
                        let turn_start = matches!(update.kind, Some(Kind::TurnStarted(_)));
                        if let Err(e) = self.handle(update).await {
                            if e.is_store_unavailable() {
                                self.restart_from_store(&e).await;
                                return;
                            }
                            tracing::warn!(session = %self.session_id, error = %e, "could not apply agent update");
                            if turn_start {
                                break;
                            }
                        }
                        self.try_settle().await;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            // The stream ended (agentctl restarting, network); reconnect.
            failures += 1;
            if let Some(gone) = self.agentctl_process_gone() {
                self.agentctl_lost(&gone, TurnInFlight::Interrupt).await;
                return;
            }
            if failures >= MAX_STREAM_FAILURES {
                self.agentctl_lost("the update stream keeps closing", TurnInFlight::Settle)
                    .await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(100 << failures.min(5))).await;
        }
    }

    /// The store could not take what this pump read (`e`: the database is
    /// down), so an update is read past but not stored (a turn's end among
    /// them: helper-42, sessions left RUNNING until a restart). Waits until
    /// the store answers again, then replaces this pump with one started
    /// from the session as stored (its cursor, its reply so far, a turn to
    /// settle), which replays what agentctl buffered since, as a restarted
    /// backend does. An executor replaced meanwhile, or a session gone or
    /// no longer this replica's, starts nothing.
    async fn restart_from_store(&self, e: &crate::error::Error) {
        tracing::warn!(session = %self.session_id, error = %e,
            "the database is unavailable; the agent's updates are read again from the stored cursor once it answers");
        let store = &self.mgr.inner.store;
        let mut pause = Duration::from_millis(200);
        let (session, record) = loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
            let read = async {
                let session = store.get_session(self.session_id).await?;
                let record = store.get_executor_for_session(self.session_id).await?;
                Ok::<_, sessiond_store::Error>((session, record))
            }
            .await;
            match read {
                Ok((session, Some(record))) => break (session, record),
                Ok((_, None)) => return,
                Err(e) if e.is_unavailable() => continue,
                Err(e) => {
                    tracing::warn!(session = %self.session_id, error = %e,
                        "cannot read the session again after the database came back");
                    return;
                }
            }
        };
        if record.generation != self.generation
            || session.state.is_terminal()
            || !Fencing(&self.mgr).owns(self.session_id)
        {
            return;
        }
        tracing::info!(session = %self.session_id, "the database answers again; reading the agent's updates from the stored cursor");
        Turns(&self.mgr).start_pump(&session, &record);
    }

    /// This pump's agentctl is a local process that is gone (its recorded
    /// pid and start time no longer run, as `watch_local_agentctls` checks
    /// for idle sessions): its stream cannot come back, so it is lost at
    /// once instead of after the reconnects' backoff (seconds during which
    /// the status said RUNNING). Returns why, for the session's error.
    fn agentctl_process_gone(&self) -> Option<String> {
        let execution = self.mgr.execution(self.session_id)?;
        let r = &execution.record;
        let pid = crate::ops::local_agentctl_gone(r).filter(|_| r.generation == self.generation)?;
        Some(format!("its process {pid} exited"))
    }

    pub(super) async fn handle(&mut self, mut update: pb::AgentUpdate) -> Result<()> {
        let cursor = update.cursor;
        without_nul(&mut update);
        match update.kind {
            Some(Kind::MessageChunk(chunk)) => {
                self.cursor = cursor;
                self.chunk(&chunk.message_id, &chunk.text).await?;
            }
            Some(Kind::TurnEnded(end)) => {
                self.cursor = cursor;
                self.turn_ended(&end).await?;
            }
            Some(Kind::StateChanged(s)) => {
                self.cursor = cursor;
                let state = AgentState::try_from(s.state).unwrap_or(AgentState::Unspecified);
                self.mgr
                    .cache_update(self.session_id, |e| e.agent = agent_process(state));
            }
            Some(Kind::AgentExited(exit)) => {
                self.cursor = cursor;
                self.agent_exited(exit.exit.as_ref()).await?;
            }
            Some(Kind::Gap(gap)) => {
                self.cursor = gap.next_cursor.saturating_sub(1).max(cursor);
                self.gap().await?;
            }
            Some(Kind::Activity(a)) => {
                self.cursor = cursor;
                self.activity(a).await?;
            }
            Some(Kind::TurnStarted(started)) => {
                // Read again (the stream reopened before it) until it is
                // recorded: what follows belongs to it.
                self.turn_started(&started).await?;
                self.cursor = cursor;
            }
            Some(Kind::ToolCall(_)) | None => self.cursor = cursor,
        }
        Ok(())
    }

    /// Stores an activity part (a tool call, plan, thought, ...) as one
    /// message per part: added the first time, replaced by each higher rev.
    /// A replay (after a restart) meets revs already stored and writes
    /// nothing, so a part never moves backwards.
    pub(super) async fn activity(&mut self, a: pb::Activity) -> Result<()> {
        let id = Self::message_id(&a.part_id);
        if self.parts.get(&id).is_some_and(|r| *r >= a.rev) {
            return Ok(());
        }
        let kind = MessageKind::parse(&a.kind).unwrap_or(MessageKind::Other);
        // The mode or the config options changed: the next status asks
        // agentctl again.
        if kind == MessageKind::CurrentMode
            || (kind == MessageKind::Other && a.text == "config_option_update")
        {
            self.mgr.inner.sessions.forget_modes(self.session_id);
        }
        if kind == MessageKind::Permission {
            return self.permission(id, a).await;
        }
        // The agent names the session: its title, unless the user named it
        // (written with the part, so a replay writes the same again).
        let title = (kind == MessageKind::Other)
            .then(|| agent_title(&a.json))
            .flatten();
        let titled = |c: Changeset| match &title {
            Some(t) => c.set_title(self.session_id, t.clone(), TitleSource::Agent),
            None => c,
        };
        let data = part_data(a.rev, &a.json);
        let now = Utc::now();
        let m = Message {
            id,
            session_id: self.session_id,
            task_id: self.task_id,
            role: MessageRole::Agent,
            content: a.text,
            kind,
            data,
            seq: 0,
            complete: a.complete,
            created_at: now,
            updated_at: now,
        };
        let update = |m: &Message| {
            titled(Changeset::new())
                .update_part(m.id, m.content.clone(), m.data.clone(), m.complete)
                .event(self.session_id, EventPayload::MessageUpdated(m.clone()))
        };
        // The agent's command list describes the session, not a turn, and
        // agents send it again on every `session/load`: the new list
        // replaces the stored one (same message, `message.updated`) instead
        // of adding one per load.
        let replaced = if kind == MessageKind::AvailableCommands && !self.parts.contains_key(&id) {
            self.mgr
                .inner
                .store
                .latest_part(self.session_id, kind)
                .await?
                .filter(|stored| stored.id != id)
        } else {
            None
        };
        let change = if let Some(stored) = replaced {
            update(&Message {
                id: stored.id,
                seq: stored.seq,
                created_at: stored.created_at,
                ..m
            })
        } else if self.parts.contains_key(&id) {
            update(&m)
        } else {
            let add = titled(Changeset::new())
                .add_message(m.clone())
                .event(self.session_id, EventPayload::MessageAdded(m.clone()));
            match Fencing(&self.mgr).store_commit(add).await {
                Ok(c) => {
                    self.mgr.inner.bus.publish(&c.events);
                    self.parts.insert(id, a.rev);
                    if kind == MessageKind::Unparsed {
                        self.mgr.inner.metrics.unparsed_update();
                    }
                    return Ok(());
                }
                Err(sessiond_store::Error::AlreadyExists { .. }) => {
                    // Replayed after a restart: keep the later of the two.
                    let stored = self
                        .mgr
                        .inner
                        .store
                        .list_messages(self.session_id, 0, u32::MAX)
                        .await?
                        .into_iter()
                        .find(|s| s.id == id);
                    let stored_rev = stored.map_or(0, |s| stored_part_rev(&s.data));
                    if stored_rev >= a.rev {
                        self.parts.insert(id, stored_rev);
                        return Ok(());
                    }
                    update(&m)
                }
                Err(e) => return Err(e.into()),
            }
        };
        let c = Fencing(&self.mgr).store_commit(change).await?;
        self.mgr.inner.bus.publish(&c.events);
        self.parts.insert(id, a.rev);
        Ok(())
    }

    /// A permission request's part: like any part, plus its event
    /// (`permission.requested` when first stored pending,
    /// `permission.resolved` when it completes) in the same commit. Read
    /// against the store first: a request sessiond resolved itself
    /// ([`crate::permission::cancel_open`]) or a replayed rev is not
    /// written again.
    pub(super) async fn permission(&mut self, id: MessageId, a: pb::Activity) -> Result<()> {
        // Under the session lock, like every turn end that may cancel the
        // request: one of the two resolves it, never both.
        let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let stored = self
            .mgr
            .inner
            .store
            .get_message(self.session_id, id)
            .await?;
        if let Some(s) = &stored
            && (s.complete || stored_part_rev(&s.data) >= a.rev)
        {
            self.parts.insert(id, stored_part_rev(&s.data).max(a.rev));
            return Ok(());
        }
        let now = Utc::now();
        let m = Message {
            id,
            session_id: self.session_id,
            task_id: self.task_id,
            role: MessageRole::Agent,
            content: a.text,
            kind: MessageKind::Permission,
            data: part_data(a.rev, &a.json),
            seq: 0,
            complete: a.complete,
            created_at: now,
            updated_at: now,
        };
        let event = crate::permission::event_for(&m, stored.is_none());
        let mut change = if stored.is_some() {
            Changeset::new()
                .update_part(m.id, m.content.clone(), m.data.clone(), m.complete)
                .event(self.session_id, EventPayload::MessageUpdated(m.clone()))
        } else {
            Changeset::new()
                .add_message(m.clone())
                .event(self.session_id, EventPayload::MessageAdded(m.clone()))
        };
        if let Some(ev) = event {
            change = change.event(self.session_id, ev);
        }
        self.mgr.commit(change).await?;
        self.parts.insert(id, a.rev);
        Ok(())
    }

    pub(super) fn message_id(raw: &str) -> MessageId {
        uuid::Uuid::try_parse(raw)
            .map(MessageId::from_uuid)
            .unwrap_or_else(|_| MessageId::new())
    }

    pub(super) async fn chunk(&mut self, raw_id: &str, text: &str) -> Result<()> {
        self.mgr.inner.metrics.chunk(self.session_id);
        let id = Self::message_id(raw_id);
        match &mut self.pending {
            Some(p) if p.id == id && p.frozen => {}
            Some(p) if p.id == id => {
                if !append_capped(&mut p.content, text) {
                    return Ok(());
                }
                p.dirty = true;
                if p.last_flush.elapsed() >= self.mgr.inner.config.message_flush_interval {
                    self.flush(false).await?;
                }
            }
            _ => {
                if self.pending.is_some() {
                    self.flush(true).await?;
                }
                let mut content = String::new();
                append_capped(&mut content, text);
                self.pending = Some(Pending {
                    id,
                    content,
                    stored: false,
                    dirty: true,
                    last_flush: Instant::now(),
                    floor: String::new(),
                    frozen: false,
                });
                self.flush(false).await?;
                // Test-only crash point: a reply's first part is stored
                // (incomplete), the turn is RUNNING, its end not seen.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("reply-after-first-chunk");
            }
        }
        Ok(())
    }

    /// The pending message as a changeset (added the first time, else updated).
    pub(super) fn message_change(
        &self,
        p: &Pending,
        complete: bool,
        change: Changeset,
    ) -> Changeset {
        let now = Utc::now();
        let content = if p.content.len() >= p.floor.len() {
            p.content.clone()
        } else {
            p.floor.clone()
        };
        let m = Message {
            id: p.id,
            session_id: self.session_id,
            task_id: self.task_id,
            role: MessageRole::Agent,
            content: content.clone(),
            kind: MessageKind::Text,
            data: String::new(),
            seq: 0,
            complete,
            created_at: now,
            updated_at: now,
        };
        if p.stored {
            change
                .update_message(p.id, content, complete)
                .event(self.session_id, EventPayload::MessageUpdated(m))
        } else {
            change
                .add_message(m.clone())
                .event(self.session_id, EventPayload::MessageAdded(m))
        }
    }

    /// Writes the pending message; `complete` ends it.
    pub(super) async fn flush(&mut self, complete: bool) -> Result<()> {
        let Some(p) = self.pending.as_ref() else {
            return Ok(());
        };
        if p.frozen {
            if complete {
                self.pending = None;
            }
            return Ok(());
        }
        if !p.dirty && !complete {
            return Ok(());
        }
        if !complete && p.stored && p.content.len() <= p.floor.len() {
            // A replay still below what is stored: writing would shrink it.
            if let Some(p) = self.pending.as_mut() {
                p.dirty = false;
            }
            return Ok(());
        }
        let change = self.message_change(p, complete, Changeset::new());
        match Fencing(&self.mgr).store_commit(change).await {
            Ok(c) => self.mgr.inner.bus.publish(&c.events),
            Err(sessiond_store::Error::AlreadyExists { .. }) if !p.stored => {
                // Replayed after a restart: the message exists. The replay
                // rebuilds it from its first chunk, so what is stored may be
                // longer than what was replayed so far: it is kept (a stored
                // reply only grows, watchers never see it shrink), and a
                // complete one is left alone.
                let id = p.id;
                let stored = self
                    .mgr
                    .inner
                    .store
                    .list_messages(self.session_id, 0, u32::MAX)
                    .await?
                    .into_iter()
                    .find(|m| m.id == id);
                let Some(mut again) = self.pending.take() else {
                    return Ok(());
                };
                again.stored = true;
                if let Some(m) = stored {
                    if m.complete {
                        again.frozen = true;
                        again.dirty = false;
                        if !complete {
                            self.pending = Some(again);
                        }
                        return Ok(());
                    }
                    if m.content.len() > again.content.len() {
                        again.floor = m.content;
                    }
                }
                if complete || again.content.len() > again.floor.len() {
                    let change = self.message_change(&again, complete, Changeset::new());
                    let c = Fencing(&self.mgr).store_commit(change).await?;
                    self.mgr.inner.bus.publish(&c.events);
                }
                again.dirty = false;
                self.pending = Some(again);
            }
            Err(e) => return Err(e.into()),
        }
        if complete {
            self.pending = None;
        } else if let Some(p) = self.pending.as_mut() {
            p.stored = true;
            p.dirty = false;
            p.last_flush = Instant::now();
        }
        Ok(())
    }

    /// Ends the pending message inside `change` (for a write that also changes state).
    pub(super) async fn complete_pending_into(&mut self, change: Changeset) -> Result<Changeset> {
        let Some(p) = self.pending.as_ref() else {
            return Ok(change);
        };
        if !p.stored {
            // Make sure it exists (or is found to exist) first.
            self.flush(false).await?;
        }
        let Some(p) = self.pending.take() else {
            return Ok(change);
        };
        if p.frozen {
            return Ok(change);
        }
        let mut stored = p;
        stored.stored = true;
        Ok(self.message_change(&stored, true, change))
    }

    pub(super) async fn turn_ended(&mut self, end: &pb::TurnEnded) -> Result<()> {
        let running_now = if end.stop_reason == "error" {
            self.agent_running().await
        } else {
            None
        };
        // The agent that ran the turn exited under it: agentctl says so (an
        // agentctl older than `agent_exited` only by none running now).
        let exited = end.stop_reason == "error" && (end.agent_exited || running_now == Some(false));
        // ... and another one runs already: the agent died while sessiond
        // was down, and recovery relaunched it before this update was read.
        // The turn is still cut (interrupted, the queue held); nothing is
        // restarted again.
        let replaced = exited && running_now == Some(true);
        // The agent lives but lost the conversation (the Claude Code adapter
        // whose CLI died answers every prompt "Session not found"; helper-40
        // 1): restarted as if it had exited, so it loads the conversation
        // again, within the same restart limit, and watchers see the
        // session go STARTING and come back.
        let gone = end.stop_reason == "error"
            && !exited
            && running_now != Some(false)
            && super::conversation_gone_in_agent(&end.error_message);
        let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let session = self.mgr.inner.store.get_session(self.session_id).await?;
        let current_turn = session.metadata.get(TURN_KEY).cloned();
        let ours = current_turn.as_deref().is_none_or(|t| t == end.turn_id);
        // The turn after a cancelled one ended at once with nothing at all:
        // the stop the cancelled turn left behind (the Claude Code adapter
        // 0.23, claude-agent-acp #551), after which every reply comes one
        // turn late. The agent is out of step with its turns; restarted
        // like one that lost the conversation, it loads it in step
        // (helper-43 2, helper-45 F4).
        let stale = end.stop_reason == "end_turn"
            && ours
            && session.state == SessionState::Running
            && session.metadata.contains_key(CANCELLED_LAST_KEY)
            && self.pending.is_none()
            && end.usage.as_ref().is_none_or(|u| {
                [u.input_tokens, u.output_tokens, u.total_tokens]
                    .iter()
                    .all(|n| n.unwrap_or(0) == 0)
            });
        // ... and nothing of it is stored either (a tool call, a thought: a
        // turn that did work is never taken for a stale stop, whose message
        // would then be sent twice).
        let stale = stale && !self.turn_left_anything(current_turn.as_deref()).await?;
        let lost = gone || stale;
        // The agent died in the middle of the session's turn: its reply is
        // kept as streamed and the turn ends interrupted, not as if whole.
        let died_in = current_turn
            .clone()
            .filter(|_| exited && ours && session.state == SessionState::Running);
        let mut change = if died_in.is_some() {
            self.flush(false).await?;
            self.pending = None;
            Changeset::new()
        } else {
            self.complete_pending_into(Changeset::new()).await?
        };
        let mut next = session.clone();
        let mut task_event = None;
        let mut counted = None;
        let mut restart = AfterExit::Error { exhausted: false };
        // What the agent's exit was, if the turn died with it.
        let cancel_stop = self
            .mgr
            .inner
            .agent_restarts
            .take_cancel_stop(self.session_id)
            .filter(|_| exited);
        let exit_what = match cancel_stop {
            Some(grace) => stopped_after_cancel(grace),
            None if end.error_message.is_empty() => "the agent exited during the turn".to_owned(),
            None => end.error_message.clone(),
        };
        if session.state == SessionState::Running && ours {
            let outcome = if exited && cancel_stop.is_some() {
                crate::metrics::TurnOutcome::Cancelled
            } else if died_in.is_some() {
                crate::metrics::TurnOutcome::Interrupted
            } else if exited || stale {
                crate::metrics::TurnOutcome::Failed
            } else {
                crate::metrics::TurnOutcome::from_stop_reason(&end.stop_reason)
            };
            self.mgr.inner.metrics.turn_ended(self.session_id, outcome);
            if replaced {
                // Counted when its `AgentExited` update, next on the
                // stream, is read (it finds an agent running).
                self.mgr.inner.agent_restarts.exit_to_count(self.session_id);
            }
            let (s, events) = if (exited && !replaced) || lost {
                let what = if stale {
                    STALE_STOP_WHY.to_owned()
                } else if lost {
                    format!("the agent lost the conversation ({})", end.error_message)
                } else {
                    exit_what.clone()
                };
                let restart_or_error = if stale {
                    crate::restarts::restart_uncounted
                } else {
                    after_agent_exit
                };
                let (s, events, decided) = restart_or_error(
                    &self.mgr.inner.config,
                    &self.mgr.inner.agent_restarts,
                    &session,
                    &what,
                )?;
                restart = decided;
                (s, events)
            } else {
                task_event = Some(TaskEvent::ReadyForReview);
                let (s, ev) = transition(&session, SessionEvent::TurnEnded, None)?;
                (s, ev.into_iter().collect())
            };
            next = s;
            // The turn's usage: on its user message and in the session's
            // totals, in the commit that ends the turn, so a replay of its
            // end (which finds the session no longer running) counts
            // nothing again.
            if let Some(u) = end.usage.as_ref().map(crate::usage::from_agentctl) {
                let user = match current_turn.as_deref().map(MessageId::parse) {
                    Some(Ok(id)) => {
                        self.mgr
                            .inner
                            .store
                            .get_message(self.session_id, id)
                            .await?
                    }
                    _ => None,
                };
                if let Some(mut user) = user {
                    user.data = crate::usage::with_usage(&user.data, &u);
                    user.updated_at = Utc::now();
                    change = change
                        .update_part(
                            user.id,
                            user.content.clone(),
                            user.data.clone(),
                            user.complete,
                        )
                        .event(self.session_id, EventPayload::MessageUpdated(user));
                }
                let mut totals = UsageTotals::from_metadata(&next.metadata);
                totals.add_turn(&u);
                totals.write_metadata(&mut next.metadata);
                counted = Some(u);
            }
            if let Some(turn) = &died_in {
                let cut = match cancel_stop {
                    Some(_) => Cut::CancelEnforced(&exit_what),
                    None => Cut::Interrupted(&exit_what),
                };
                change = cut_turn(&self.mgr, &session, turn, cut, change, &mut next).await?;
            }
            for ev in events {
                change = change.event(self.session_id, ev);
            }
            let note = match end.stop_reason.as_str() {
                _ if stale => Some(match restart {
                    AfterExit::Restart(_) => STALE_STOP_RESTARTED.to_owned(),
                    AfterExit::Error { .. } => STALE_STOP_STOPPED.to_owned(),
                }),
                // The adapter's own advice ("start a new session") is wrong
                // here: the conversation comes back (helper-43 5).
                "error" if lost && matches!(restart, AfterExit::Restart(_)) => Some(format!(
                    "the agent's turn failed: {}; the agent lost the conversation, so sessiond \
                     restarts it and loads the conversation again: send the message again once \
                     the session is waiting for input",
                    end.error_message
                )),
                "error" if lost => Some(format!(
                    "the agent's turn failed: {}; the agent lost the conversation and sessiond \
                     does not restart it again by itself: resume the session to continue",
                    end.error_message
                )),
                "error" if !exited => {
                    Some(format!("the agent's turn failed: {}", end.error_message))
                }
                "cancelled" => Some(TURN_CANCELLED.to_owned()),
                _ => None,
            };
            if let Some(content) = note {
                let now = Utc::now();
                let m = Message {
                    id: MessageId::new(),
                    session_id: self.session_id,
                    task_id: self.task_id,
                    role: MessageRole::System,
                    content,
                    kind: MessageKind::Text,
                    data: String::new(),
                    seq: 0,
                    complete: true,
                    created_at: now,
                    updated_at: now,
                };
                change = change
                    .add_message(m.clone())
                    .event(self.session_id, EventPayload::MessageAdded(m));
            }
            // A turn that died with the agent has its `turn_ended`
            // (interrupted) from `interrupt_turn`.
            if died_in.is_none() {
                // A stale stop answered nothing: a failed turn to clients
                // (`sessionctl send` exits non-zero; helper-46 F3), not the
                // agent's `end_turn`.
                let (stop_reason, error_message) = if stale {
                    ("error".to_owned(), Some(STALE_STOP_WHY.to_owned()))
                } else {
                    (
                        end.stop_reason.clone(),
                        Some(end.error_message.clone()).filter(|m| !m.is_empty()),
                    )
                };
                change = change.event(
                    self.session_id,
                    EventPayload::TurnEnded {
                        turn_id: current_turn.clone().unwrap_or_else(|| end.turn_id.clone()),
                        stop_reason,
                        error_message,
                    },
                );
            }
            super::end_turn_record(&mut next.metadata);
            next.metadata.remove(TURN_GENERATION_KEY);
            next.metadata.remove(TURN_INSTANCE_KEY);
            if end.stop_reason == "cancelled" {
                next.metadata
                    .insert(CANCELLED_LAST_KEY.into(), end.turn_id.clone());
            } else {
                next.metadata.remove(CANCELLED_LAST_KEY);
            }
            if died_in.is_none() {
                // agentctl resolves every request before the turn ends; one
                // still open can never be answered now.
                change = crate::permission::cancel_open(
                    &self.mgr,
                    self.session_id,
                    change,
                    "the turn ended while the request waited",
                )
                .await?;
            }
        }
        next.metadata.insert(
            CURSOR_KEY.into(),
            cursor_value(self.generation, self.cursor, &self.instance),
        );
        change = change.update_session(next);
        if let Some(ev) = task_event {
            change = change.task_event(self.task_id, ev);
        }
        // An agent that exited is not running, whatever the commit does:
        // said before the commit publishes the session's end of turn, so no
        // status read in between pairs it with a running agent (CI saw
        // ERROR with `agent running` once).
        if exited && !replaced {
            self.mgr
                .cache_update(self.session_id, |e| e.agent = AgentProcessState::NotRunning);
        }
        let committed = self.mgr.commit(change).await;
        let restarting = matches!(restart, AfterExit::Restart(_));
        if committed.is_ok() && lost {
            // Its restart (or, past the restart limit, the user's resume)
            // must find no agent running, or it would only reattach to the
            // one that lost the conversation (helper-45 F1: a resume then
            // changed nothing).
            if stale {
                tracing::warn!(session = %self.session_id, restarting,
                    "the agent ended a turn after a cancel with nothing (out of step); stopping it so that it loads the conversation again");
            } else {
                tracing::warn!(session = %self.session_id, said = %end.error_message, restarting,
                    "the agent lost the conversation; stopping it so that it loads the conversation again");
            }
            self.stop_agent_that_lost_the_conversation().await;
        }
        // Before the restart starts: its recovery announces itself at once,
        // and a status read meanwhile must not pair it with a running agent.
        if committed.is_ok() && lost {
            self.mgr
                .cache_update(self.session_id, |e| e.agent = AgentProcessState::NotRunning);
        }
        self.mgr
            .spawn_agent_restart(self.session_id, restart, committed.is_ok());
        committed?;
        if let Some(u) = counted {
            self.mgr.inner.metrics.turn_usage(&u);
        }
        Ok(())
    }

    /// Whether the store holds anything after the turn's user message
    /// (`turn`: its id): a reply, a tool call, a note. Unknown turn: true.
    async fn turn_left_anything(&self, turn: Option<&str>) -> Result<bool> {
        let Some(Ok(id)) = turn.map(MessageId::parse) else {
            return Ok(true);
        };
        let store = &self.mgr.inner.store;
        let Some(user) = store.get_message(self.session_id, id).await? else {
            return Ok(true);
        };
        Ok(!store
            .list_messages(self.session_id, user.seq, 1)
            .await?
            .is_empty())
    }

    /// Stops the agent whose restart was just decided because it lost the
    /// conversation (its exit, read next on the stream, belongs to that
    /// restart).
    async fn stop_agent_that_lost_the_conversation(&self) {
        match self
            .mgr
            .inner
            .store
            .get_executor_for_session(self.session_id)
            .await
        {
            Ok(Some(record)) => Agents(&self.mgr).stop_agent_quietly(&record).await,
            Ok(None) => {}
            Err(e) => tracing::warn!(session = %self.session_id, error = %e,
                "cannot read the executor to stop the agent that lost the conversation"),
        }
    }

    /// True when agentctl reports no running agent right now.
    pub(super) async fn agent_gone(&self) -> bool {
        self.agent_running().await == Some(false)
    }

    /// Whether agentctl runs an agent right now (starting included);
    /// `None` when it did not answer.
    pub(super) async fn agent_running(&self) -> Option<bool> {
        match self.client.health().await {
            Ok(h) => Some(matches!(
                h.agent_state,
                AgentState::Ready | AgentState::Busy | AgentState::Starting
            )),
            Err(_) => None,
        }
    }

    pub(super) async fn agent_exited(&mut self, exit: Option<&pb::AgentExit>) -> Result<()> {
        let gone = self.agent_gone().await;
        if self.mgr.inner.agent_restarts.count_exit(
            self.session_id,
            &self.instance,
            self.cursor,
            gone,
        ) {
            self.mgr
                .inner
                .metrics
                .agent_exited(crate::metrics::ExitCause::of(
                    exit.and_then(|e| e.code),
                    exit.and_then(|e| e.signal),
                ));
        }
        // A replayed exit of an agent that has been replaced since changes nothing.
        if !gone {
            return Ok(());
        }
        self.mgr
            .cache_update(self.session_id, |e| e.agent = AgentProcessState::NotRunning);
        let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let session = self.mgr.inner.store.get_session(self.session_id).await?;
        if self.mgr.exit_belongs_to_recovery(&session) {
            // Handled already (its TurnEnded decided a restart), or an agent
            // dying while it is brought up: the recovery retries it.
            return Ok(());
        }
        // Its TurnEnded did not come first: the turn died with the agent,
        // its reply unfinished (kept as streamed, marked interrupted).
        let turn = pending_turn(&session);
        let mut change = if turn.is_some() {
            self.flush(false).await?;
            self.pending = None;
            Changeset::new()
        } else {
            self.complete_pending_into(Changeset::new()).await?
        };
        let mut next = session.clone();
        let mut restart = AfterExit::Error { exhausted: false };
        if matches!(
            session.state,
            SessionState::Starting | SessionState::Running | SessionState::WaitingForInput
        ) {
            let how = exit_how(exit);
            let cancel_stop = self
                .mgr
                .inner
                .agent_restarts
                .take_cancel_stop(self.session_id);
            if session.state == SessionState::Running {
                let outcome = match cancel_stop {
                    Some(_) => crate::metrics::TurnOutcome::Cancelled,
                    None => crate::metrics::TurnOutcome::Interrupted,
                };
                self.mgr.inner.metrics.turn_ended(self.session_id, outcome);
            }
            let (what, why) = match cancel_stop {
                Some(grace) => {
                    let what = format!("{} ({how})", stopped_after_cancel(grace));
                    (what.clone(), what)
                }
                None => (
                    format!("the agent process exited ({how})"),
                    format!("the agent process exited ({how}) during the turn"),
                ),
            };
            let (s, events, decided) = after_agent_exit(
                &self.mgr.inner.config,
                &self.mgr.inner.agent_restarts,
                &session,
                &what,
            )?;
            next = s;
            restart = decided;
            super::end_turn_record(&mut next.metadata);
            if let Some(turn) = &turn {
                let cut = match cancel_stop {
                    Some(_) => Cut::CancelEnforced(&why),
                    None => Cut::Interrupted(&why),
                };
                change = cut_turn(&self.mgr, &session, turn, cut, change, &mut next).await?;
            }
            for ev in events {
                change = change.event(self.session_id, ev);
            }
        }
        next.metadata.insert(
            CURSOR_KEY.into(),
            cursor_value(self.generation, self.cursor, &self.instance),
        );
        let committed = self.mgr.commit(change.update_session(next)).await;
        self.mgr
            .spawn_agent_restart(self.session_id, restart, committed.is_ok());
        committed?;
        Ok(())
    }

    /// Updates of this agentctl were dropped from its buffer before we read
    /// them. What was streamed of the reply is kept (stored, not completed);
    /// the session's turn, if one is pending, goes through the decision
    /// table ([`Pump::settle_pending`]) instead of being ended as if whole.
    pub(super) async fn gap(&mut self) -> Result<()> {
        tracing::warn!(session = %self.session_id, cursor = self.cursor, "agent updates were lost (gap); settling the pending turn");
        self.resettle().await
    }

    /// agentctl is another process than the one our cursor belonged to.
    pub(super) async fn instance_restarted(&mut self) {
        tracing::warn!(session = %self.session_id, instance = %self.instance,
            "agentctl restarted (new instance); settling the pending turn from its journal");
        if let Err(e) = self.resettle().await {
            tracing::warn!(session = %self.session_id, error = %e, "could not settle after an agentctl restart");
        }
    }

    /// Keeps what was streamed, and settles the session's turn (if any)
    /// once caught up with agentctl as it is now.
    pub(super) async fn resettle(&mut self) -> Result<()> {
        if self.pending.is_some() {
            self.flush(false).await?;
        }
        let session = self.mgr.inner.store.get_session(self.session_id).await?;
        if let Some(turn) = pending_turn(&session) {
            self.settle = Some(turn);
            self.note_settling();
            self.target = self.latest_cursor().await;
            self.try_settle().await;
        }
        Ok(())
    }

    /// Before the first open of a pump that continues a parked one: if
    /// agentctl is another process than the one the cursor belongs to (it
    /// restarted while the session was idle; cursors began at 1 again), read
    /// everything it still buffers (from 0) instead.
    pub(super) async fn check_instance(&mut self) {
        self.instance_checked = true;
        if self.instance.is_empty() || self.cursor == 0 {
            return;
        }
        let limit = self.mgr.inner.config.executor_deadline;
        if let Ok(Ok(h)) = tokio::time::timeout(limit, self.client.health()).await
            && !h.instance_id.is_empty()
            && h.instance_id != self.instance
        {
            tracing::info!(session = %self.session_id, cursor = self.cursor,
                "agentctl restarted while the session was idle; reading its updates from the start");
            self.cursor = 0;
            self.instance = h.instance_id;
        }
    }

    /// Parks this pump if the session has nothing for it: no reply being
    /// streamed, no pending turn, the session WAITING_FOR_INPUT with an idle
    /// agent (or ERROR), and everything agentctl has was read (its
    /// `latest_cursor` is not past ours). Decided under the session lock, so
    /// no turn can start meanwhile (`send_message` takes the lock and starts
    /// a pump when there is none). Parking records the cursor and instance,
    /// removes this pump and evicts the session's agentctl client; the
    /// caller then returns, dropping the stream, so the connection closes.
    pub(super) async fn try_park(&mut self) -> bool {
        if self.pending.is_some() || self.settle.is_some() {
            return false;
        }
        let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
        let Ok(session) = self.mgr.inner.store.get_session(self.session_id).await else {
            return false;
        };
        let needs_idle_agent = match session.state {
            SessionState::WaitingForInput if pending_turn(&session).is_none() => true,
            SessionState::Error => false,
            _ => return false,
        };
        let limit = self.mgr.inner.config.executor_deadline;
        let health = tokio::time::timeout(limit, self.client.health()).await;
        let Ok(Ok(h)) = health else {
            return false; // not answering: the stream handling decides
        };
        if h.latest_cursor > self.cursor {
            return false; // updates still to read
        }
        let vanished = matches!(h.agent_state, AgentState::None | AgentState::Exited)
            && self
                .mgr
                .execution(self.session_id)
                .is_some_and(|e| e.agent == AgentProcessState::Running);
        if vanished {
            // The agent went without an `AgentExited` (a remote host
            // restarted its agentctl, which runs none now). Liveness skips
            // sessions with a pump, and the status would say "running" for
            // as long as this pump lives: handled as the agent's exit
            // (restarted, the conversation resumed).
            drop(_guard);
            tracing::warn!(session = %self.session_id, state = ?h.agent_state,
                "agentctl runs no agent while the session's agent was running; handling it as the agent's exit");
            if let Err(e) = self.agent_exited(h.agent_exit.as_ref()).await {
                tracing::warn!(session = %self.session_id, error = %e, "could not record the vanished agent");
            }
            return false;
        }
        if needs_idle_agent && h.agent_state != AgentState::Ready {
            return false;
        }
        if self
            .mgr
            .inner
            .parking_held
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return false;
        }
        if !h.instance_id.is_empty() {
            self.instance = h.instance_id;
        }
        self.mgr.inner.sessions.set_parked(
            self.session_id,
            crate::sessions::Parked {
                generation: self.generation,
                cursor: self.cursor,
                instance: std::mem::take(&mut self.instance),
            },
        );
        self.mgr.inner.sessions.remove_own_pump(self.session_id);
        self.mgr.inner.sessions.evict_client(self.session_id);
        tracing::debug!(session = %self.session_id, cursor = self.cursor, "update pump parked (session idle)");
        true
    }

    /// agentctl's newest cursor now: what this pump must have read to have
    /// caught up. 0 (nothing to wait for) from an agentctl too old to say;
    /// `None` when it does not answer (asked again at the next reconnect).
    pub(super) async fn latest_cursor(&self) -> Option<u64> {
        let limit = self.mgr.inner.config.executor_deadline;
        match tokio::time::timeout(limit, self.client.health()).await {
            Ok(Ok(h)) => Some(h.latest_cursor),
            _ => None,
        }
    }

    /// agentctl stopped answering: recovered in the background (see
    /// `RecoverFirst::agentctl_lost_change`). A turn in flight ends
    /// interrupted when agentctl's process is known gone (`Interrupt`: its
    /// end cannot come); when it may still run (hung, paused, or only its
    /// connection lost: `Settle`), the turn stays pending and the recovery
    /// settles it: an agentctl that answers again is reattached and its
    /// reply read on to its end, one that does not is replaced and the
    /// turn settled by its journal (decision 0007).
    pub(super) async fn agentctl_lost(&mut self, reason: &str, turn: TurnInFlight) {
        let mut reconnect = None;
        let mut retried = None;
        let result: Result<()> = async {
            // What was streamed is kept, not completed: the turn ends
            // interrupted below, or the next pump replays it to its end.
            let _ = self.flush(false).await;
            self.pending = None;
            let _guard = self.mgr.inner.sessions.lock(self.session_id).await;
            let Some(record) = self
                .mgr
                .inner
                .store
                .get_executor_for_session(self.session_id)
                .await?
            else {
                return Ok(());
            };
            if record.generation != self.generation || record.status != ExecutorStatus::Ready {
                return Ok(());
            }
            if record.runtime == Runtime::Remote {
                self.mgr
                    .commit(crate::changes::remote_lost(&record, reason)?)
                    .await?;
                self.mgr
                    .cache_update(self.session_id, |e| e.agent = AgentProcessState::NotRunning);
                reconnect = Some(record);
                return Ok(());
            }
            let (change, retry) = self.mgr.agentctl_lost_change(&record, reason, turn).await?;
            // The background recovery is announced before the commit makes
            // the interrupted turn visible: a retry sent as soon as a client
            // sees it waits for that recovery (`wait_agent_recovery`)
            // instead of finding no agent and no recovery yet.
            let recoveries = &self.mgr.inner.agent_recoveries;
            if retry.is_some() {
                let delay = self.mgr.inner.config.retry_backoff.delay(0);
                recoveries.retry_after(self.session_id, 0, reason.to_owned(), delay);
            }
            let committed = match self.mgr.commit(change).await {
                Ok(committed) => committed,
                Err(e) => {
                    if retry.is_some() {
                        recoveries.clear(self.session_id);
                    }
                    return Err(e);
                }
            };
            retried = retry.map(|failed| committed.executor.unwrap_or(failed));
            self.mgr
                .cache_update(self.session_id, |e| e.agent = AgentProcessState::NotRunning);
            Ok(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(session = %self.session_id, error = %e, "could not record lost agentctl");
        }
        // This pump ends; forget it.
        self.mgr.inner.sessions.forget_pump(self.session_id);
        // A test's hold between the commit and the recovery's start.
        let gate = crate::sync::lock(&self.mgr.inner.lost_agentctl_gate).clone();
        if let Some(gate) = gate {
            gate().await;
        }
        if let Some(record) = reconnect {
            self.mgr.spawn_reconnect(record);
        }
        if let Some(record) = retried {
            self.mgr.spawn_retry(record, 0, reason.to_owned());
        }
    }
}

/// The longest reply text stored: a message travels whole in its events
/// (and to clients that read messages of up to 64 MiB), so an agent that
/// says more has the rest dropped, and the reply says where.
pub(crate) const MAX_REPLY_BYTES: usize = 32 << 20;

/// Appended where a reply was cut at [`MAX_REPLY_BYTES`].
pub(crate) const REPLY_CUT_NOTE: &str =
    "\n\n[sessiond: the reply was cut here, at 32 MiB; the agent's further text is not kept]";

/// Appends `text` to a reply, or what fits of it and [`REPLY_CUT_NOTE`];
/// false when nothing changed (the reply was cut already). Deterministic,
/// so a replay after a restart cuts at the same place.
pub(crate) fn append_capped(content: &mut String, text: &str) -> bool {
    let room = MAX_REPLY_BYTES - REPLY_CUT_NOTE.len();
    if content.len() > room {
        return false;
    }
    if content.len() + text.len() <= room {
        content.push_str(text);
        return true;
    }
    let mut end = room - content.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    content.push_str(&text[..end]);
    content.push_str(REPLY_CUT_NOTE);
    true
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

impl Turns<'_> {
    /// Starts (or restarts) the update pump of a session from its stored cursor.
    pub(crate) fn start_pump(&self, session: &Session, record: &ExecutorRecord) {
        let client = match Agents(self).client(record) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "no update pump: no client");
                return;
            }
        };
        // A turn cancelled before this backend (re)started: the agent
        // (maybe a new one) hears the cancel again, and the grace runs
        // again from here.
        let cancelled = session.metadata.get(super::CANCEL_KEY);
        if let Some(turn) = cancelled.filter(|t| {
            session.state == SessionState::Running && session.metadata.get(TURN_KEY) == Some(*t)
        }) {
            let (me, turn, record, cancel) =
                (self.0.clone(), turn.clone(), record.clone(), client.clone());
            let session_id = session.id;
            self.spawn_background(async move {
                if let Err(e) = cancel.cancel().await {
                    tracing::warn!(session = %session_id, error = %e, "could not send the stored cancel again");
                }
                me.stop_if_cancel_ignored(session_id, turn, record);
            });
        }
        // A parked pump of this generation read further than the stored cursor.
        let (stored, stored_instance) = stored_cursor(session, record.generation);
        let (cursor, instance) = match self.inner.sessions.take_parked(session.id) {
            Some(p)
                if p.generation == record.generation
                    && (p.cursor >= stored || p.instance != stored_instance) =>
            {
                (p.cursor, p.instance)
            }
            _ => (stored, stored_instance),
        };
        let pump = Pump {
            mgr: self.0.clone(),
            session_id: session.id,
            task_id: session.task_id,
            generation: record.generation,
            client,
            cursor,
            pending: None,
            parts: HashMap::new(),
            settle: pending_turn(session),
            target: None,
            settling: false,
            instance,
            instance_checked: false,
            last_activity: Instant::now(),
        };
        let mut pump = pump;
        pump.note_settling();
        let handle = tokio::spawn(pump.run());
        self.inner
            .sessions
            .set_pump(session.id, handle.abort_handle());
    }

    /// After the agent was (re)attached: a session with work for the pump
    /// (a turn RUNNING or pending, or any state but WAITING_FOR_INPUT) gets
    /// its pump; an idle one (WAITING_FOR_INPUT, no pending turn) is parked
    /// at its stored cursor instead, with no update stream and its agentctl
    /// client evicted, so no HTTP/2 connection stays open for it. The next
    /// `send_message` starts the pump from there (replaying what agentctl
    /// buffered meanwhile, which is idempotent); an agent exit while parked
    /// is found by the liveness check.
    pub(crate) fn attach_updates(&self, session: &Session, record: &ExecutorRecord) {
        if session.state != SessionState::WaitingForInput || pending_turn(session).is_some() {
            self.start_pump(session, record);
            return;
        }
        self.inner.sessions.stop_pump(session.id);
        let (stored, instance) = stored_cursor(session, record.generation);
        let parked = match self.inner.sessions.take_parked(session.id) {
            Some(p)
                if p.generation == record.generation
                    && (p.cursor >= stored || p.instance != instance) =>
            {
                p
            }
            _ => crate::sessions::Parked {
                generation: record.generation,
                cursor: stored,
                instance,
            },
        };
        self.inner.sessions.set_parked(session.id, parked);
        self.inner.sessions.evict_client(session.id);
    }
}

/// The agent's text with each NUL (U+0000) replaced by U+FFFD: PostgreSQL
/// refuses NUL in text, and a reply holding one (a binary file read, say)
/// left its turn RUNNING for good there (helper-50 1). Replaced on every
/// store alike, so a conversation reads the same on both.
fn without_nul(update: &mut pb::AgentUpdate) {
    fn clean(text: &mut String) {
        if text.contains('\0') {
            *text = text.replace('\0', "\u{FFFD}");
        }
    }
    match &mut update.kind {
        Some(Kind::MessageChunk(c)) => clean(&mut c.text),
        Some(Kind::Activity(a)) => {
            clean(&mut a.text);
            clean(&mut a.json);
        }
        Some(Kind::TurnEnded(e)) => clean(&mut e.error_message),
        _ => {}
    }
}
