//! The write path: one [`Changeset`] is one transaction.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use diesel::prelude::*;
use sessiond_domain::{
    Event, EventPayload, ExecutorId, ExecutorRecord, Message, MessageId, Session, SessionId,
    TaskEvent, TaskId, TaskState, TitleSource,
};

use crate::{
    Error, Result,
    conn::{AnyConnection, KeepPrepared, Ts, With, native},
    error::on_unique,
    rows::{EventRow, ExecutorRow, MessageRow, SessionChanges, SessionRow},
    schema::{executors_running, session_events, session_messages, task_sessions, tasks},
};

/// Everything one state change writes, committed all-or-nothing by
/// [`Store::commit`](crate::Store::commit).
///
/// Versions: a session or executor update carries the version the caller
/// read (`session.version`, `record.version`); the store writes version + 1,
/// or fails with [`Error::Conflict`] when the row has moved on. Seqs: new
/// messages and events get their `seq` (per session) and `task_seq` (per task)
/// from the store, gap-free; whatever the caller put there is ignored.
/// `updated_at` of every updated row is set by the store.
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct Changeset {
    // Boxed: a changeset travels by value through every layer of a
    // commit's futures, and each holds its own copy.
    pub(crate) session: Option<Box<Session>>,
    pub(crate) executor: Option<Box<ExecutorWrite>>,
    pub(crate) task_state: Option<(TaskId, TaskChange)>,
    pub(crate) new_messages: Vec<Message>,
    pub(crate) message_updates: Vec<MessageUpdate>,
    pub(crate) events: Vec<(SessionId, EventPayload)>,
    pub(crate) fence: Option<Fence>,
    pub(crate) title: Option<(SessionId, String, TitleSource)>,
}

/// A fencing token: the lease a replica holds on a session's executor, as
/// `owner` at `epoch` (see [`Changeset::fenced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The session whose executor's lease the write depends on.
    pub session: SessionId,
    /// The replica the writer is.
    pub owner: String,
    /// The lease epoch the writer claimed.
    pub epoch: i64,
}

/// How a changeset moves a task.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TaskChange {
    To(TaskState),
    /// The task's state machine applied to the stored state inside the
    /// transaction; no change when the event does not move it.
    Event(TaskEvent),
}

/// How a changeset writes an executor record.
#[derive(Debug, Clone)]
pub enum ExecutorWrite {
    /// A new record; stored with version 1. At most one per session.
    Insert(ExecutorRecord),
    /// Replaces the record if its stored version is still `record.version`.
    Update(ExecutorRecord),
}

/// New content for a message (an agent's reply streams into one message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageUpdate {
    /// The message to update.
    pub id: MessageId,
    /// Its whole content now.
    pub content: String,
    /// Whether the message is complete (a reply's turn ended).
    pub complete: bool,
    /// A new `data` (an activity part's state); `None` keeps it.
    pub data: Option<String>,
}

/// What a commit wrote, as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// The session as written, when the changeset updated it.
    pub session: Option<Session>,
    /// The executor record as written, when the changeset wrote one.
    pub executor: Option<ExecutorRecord>,
    /// New messages, then updated ones, in changeset order.
    pub messages: Vec<Message>,
    /// In changeset order, with their seqs.
    pub events: Vec<Event>,
}

impl Changeset {
    /// An empty changeset.
    pub fn new() -> Changeset {
        Changeset::default()
    }

    /// Updates the session, expecting its stored version to be
    /// `session.version`. Its task, id and `created_at` are not changed.
    pub fn update_session(mut self, session: Session) -> Self {
        self.session = Some(Box::new(session));
        self
    }

    /// Inserts a new executor record.
    pub fn insert_executor(mut self, record: ExecutorRecord) -> Self {
        self.executor = Some(Box::new(ExecutorWrite::Insert(record)));
        self
    }

    /// Updates an executor record, expecting its stored version to be
    /// `record.version`.
    pub fn update_executor(mut self, record: ExecutorRecord) -> Self {
        self.executor = Some(Box::new(ExecutorWrite::Update(record)));
        self
    }

    /// Sets the task's state (no transition check: see [`Changeset::task_event`]).
    pub fn set_task_state(mut self, task: TaskId, state: TaskState) -> Self {
        self.task_state = Some((task, TaskChange::To(state)));
        self
    }

    /// Moves the task by `event` if its stored state allows it (read and
    /// written inside the transaction, so no separate read and no race with
    /// another writer); an event that does not apply changes nothing.
    pub fn task_event(mut self, task: TaskId, event: TaskEvent) -> Self {
        self.task_state = Some((task, TaskChange::Event(event)));
        self
    }

    /// Appends a message to its session; the store assigns its `seq`.
    pub fn add_message(mut self, message: Message) -> Self {
        self.new_messages.push(message);
        self
    }

    /// Replaces a message's content (and completeness, and `data` when given).
    pub fn update_message(
        mut self,
        id: MessageId,
        content: impl Into<String>,
        complete: bool,
    ) -> Self {
        self.message_updates.push(MessageUpdate {
            id,
            content: content.into(),
            complete,
            data: None,
        });
        self
    }

    /// Replaces an activity part's summary and state (see `Message::data`).
    pub fn update_part(
        mut self,
        id: MessageId,
        content: impl Into<String>,
        data: impl Into<String>,
        complete: bool,
    ) -> Self {
        self.message_updates.push(MessageUpdate {
            id,
            content: content.into(),
            complete,
            data: Some(data.into()),
        });
        self
    }

    /// Appends an event to the session's outbox. A `MessageAdded` or
    /// `MessageUpdated` payload about a message of this changeset is stored
    /// with that message as written (seq and timestamps included).
    pub fn event(mut self, session: SessionId, payload: EventPayload) -> Self {
        self.events.push((session, payload));
        self
    }

    /// Names the session, unless a stronger source named it already (see
    /// [`TitleSource`]); written with the rest, so a prompt and the title it
    /// gives are stored together.
    pub fn set_title(mut self, session: SessionId, title: String, source: TitleSource) -> Self {
        self.title = Some((session, title, source));
        self
    }

    /// Makes the write depend on the lease: it commits only if the
    /// session's executor row still names `fence.owner` at `fence.epoch`
    /// (checked, and the row locked, in the same transaction, so a claim by
    /// another replica is ordered wholly before or after it); otherwise
    /// nothing is written and the commit fails with
    /// [`Error::LeaseLost`]. A session without an executor row passes only
    /// when the changeset inserts one (a create).
    pub fn fenced(mut self, fence: Fence) -> Self {
        self.fence = Some(fence);
        self
    }

    /// The session this changeset is about: the updated session, the
    /// executor's, or the first message's or event's.
    pub fn subject(&self) -> Option<SessionId> {
        self.session
            .as_ref()
            .map(|s| s.id)
            .or(match self.executor.as_deref() {
                Some(ExecutorWrite::Insert(r) | ExecutorWrite::Update(r)) => Some(r.session_id),
                None => None,
            })
            .or(self.new_messages.first().map(|m| m.session_id))
            .or(self.events.first().map(|(s, _)| *s))
            .or(self.title.as_ref().map(|(s, _, _)| *s))
    }

    /// Whether the changeset writes nothing.
    pub fn is_empty(&self) -> bool {
        self.session.is_none()
            && self.executor.is_none()
            && self.task_state.is_none()
            && self.new_messages.is_empty()
            && self.message_updates.is_empty()
            && self.events.is_empty()
            && self.title.is_none()
    }
}

/// Sets a session's title when no stronger source set it (the sources a
/// title may replace are listed in the WHERE clause, so the check and the
/// write are one statement). Neither the version nor `updated_at` moves: a
/// title is not a state change, and a writer holding the session must not
/// lose its update to a rename. Returns the rows written (0: a stronger
/// title stands, or the session is gone).
pub(crate) fn write_title(
    conn: &mut AnyConnection,
    session: SessionId,
    title: &str,
    source: TitleSource,
) -> Result<usize> {
    let replaceable: &[&str] = match source {
        TitleSource::Prompt => &[""],
        TitleSource::Agent => &["", "prompt", "agent"],
        TitleSource::User => &["", "prompt", "agent", "user"],
    };
    // A user who clears the title hands naming back to the prompt and agent.
    let stored_source = if title.is_empty() {
        ""
    } else {
        source.as_str()
    };
    let target = task_sessions::table
        .find(session.to_string())
        .filter(task_sessions::deleted_at.is_null())
        .filter(task_sessions::title_source.eq_any(replaceable));
    let set = (
        task_sessions::title.eq(title),
        task_sessions::title_source.eq(stored_source),
    );
    // `RETURNING`: an `execute` would not keep it prepared (see `Prepared`).
    let written: Vec<String> = native!(conn, |c| diesel::update(target)
        .set(set)
        .returning(task_sessions::id)
        .prepared()
        .load(c))?;
    Ok(written.len())
}

/// Events written by one `INSERT` at most on PostgreSQL (seven binds
/// each: far below its limit on a statement's parameters).
const EVENTS_PER_INSERT: usize = 256;

/// Per session: how many event and message seqs this changeset needs.
#[derive(Debug, Default, Clone, Copy)]
struct Need {
    events: i64,
    messages: i64,
}

/// Writes a changeset inside the caller's write transaction.
///
/// Lock order (Postgres): task rows in id order, then session rows in id
/// order, then the rest; every writer follows it, so writers queue instead of
/// deadlocking. Each counter is advanced with `UPDATE .. SET c = c + n` (which
/// takes the row lock until commit) and returns its new value, so seqs are
/// gap-free: a rolled-back transaction gives its numbers back. Every write
/// is a [`Prepared`](crate::conn::Prepared) statement. On PostgreSQL, where
/// each statement is a round trip, the common commit (one task, a session,
/// a new message, its events) is two: the task's and the session's
/// updates, then the message's and the events' inserts (see
/// [`With`](crate::conn::With)).
pub(crate) fn apply(
    conn: &mut AnyConnection,
    change: Changeset,
    tasks: &SessionTasks,
) -> Result<Committed> {
    let now = Ts::new(crate::conn::now());

    // Which task each involved session belongs to (immutable, read unlocked).
    let mut task_of: BTreeMap<SessionId, TaskId> = BTreeMap::new();
    let mut update_targets: Vec<(MessageUpdate, SessionId)> = Vec::new();
    for u in &change.message_updates {
        let target = session_messages::table.find(u.id.to_string());
        let sid: Option<String> = native!(conn, |c| target
            .select(session_messages::session_id)
            .get_result(c))
        .optional()?;
        let sid = sid.ok_or_else(|| Error::not_found("message", u.id))?;
        let sid = SessionId::parse(&sid).map_err(|e| Error::corrupt("message", u.id, e))?;
        update_targets.push((u.clone(), sid));
    }
    let involved = change
        .session
        .iter()
        .map(|s| s.id)
        .chain(change.new_messages.iter().map(|m| m.session_id))
        .chain(change.events.iter().map(|(s, _)| *s))
        .chain(update_targets.iter().map(|(_, s)| *s))
        .collect::<BTreeSet<_>>();
    for sid in involved {
        task_of.insert(sid, tasks.task_of(conn, sid)?);
    }
    for m in &change.new_messages {
        if m.task_id != task_of[&m.session_id] {
            return Err(Error::Invalid(format!(
                "message {} names task {} but session {} belongs to task {}",
                m.id, m.task_id, m.session_id, task_of[&m.session_id]
            )));
        }
    }

    let mut need: BTreeMap<SessionId, Need> = BTreeMap::new();
    for m in &change.new_messages {
        need.entry(m.session_id).or_default().messages += 1;
    }
    let mut task_events: BTreeMap<TaskId, i64> = BTreeMap::new();
    for (sid, _) in &change.events {
        need.entry(*sid).or_default().events += 1;
        *task_events.entry(task_of[sid]).or_default() += 1;
    }

    // 1. Task rows, in id order: state and the task_seq counter.
    let mut next_task_seq: HashMap<TaskId, i64> = HashMap::new();
    let mut task_ids: BTreeSet<TaskId> = task_events.keys().copied().collect();
    if let Some((t, _)) = &change.task_state {
        task_ids.insert(*t);
    }
    let mut session_ids: BTreeSet<SessionId> = need.keys().copied().collect();
    if let Some(s) = &change.session {
        session_ids.insert(s.id);
    }
    // PostgreSQL: the one task's update goes in with the first session's,
    // in one statement (see `counted_task` below), its row still locked
    // first: one round trip less.
    let merge_task =
        matches!(conn, AnyConnection::Pg(_)) && task_ids.len() == 1 && !session_ids.is_empty();
    let mut kept_task: Option<KeptTaskUpdate> = None;
    for t in task_ids {
        let k = task_events.get(&t).copied().unwrap_or(0);
        let target = tasks::table.find(t.to_string());
        // Runs a task update, or keeps it for the session's.
        macro_rules! task_update {
            ($stmt:expr) => {{
                let stmt = $stmt;
                if merge_task {
                    kept_task = Some(KeptTaskUpdate {
                        task: t,
                        events: k,
                        update: Box::new(stmt),
                    });
                    continue;
                }
                native!(conn, |c| stmt.prepared().get_result(c)).optional()?
            }};
        }
        let state = match change.task_state {
            Some((st, TaskChange::To(state))) if st == t => StateWrite::Set(state),
            // With events to number, the counter's update applies the event
            // too, so the stored state is not read first (a round trip).
            Some((st, TaskChange::Event(event))) if st == t => {
                match (k > 0).then(|| moves(event)).flatten() {
                    Some(write) => write,
                    None => match read_transition(conn, t, event)? {
                        Some(state) => StateWrite::Set(state),
                        None => StateWrite::Keep,
                    },
                }
            }
            _ => StateWrite::Keep,
        };
        // The counter as advanced comes back with the update: one statement.
        let last: Option<i64> = match state {
            StateWrite::Set(state) => {
                let set = (
                    tasks::state.eq(state.as_str()),
                    tasks::updated_at.eq(now),
                    tasks::last_event_seq.eq(tasks::last_event_seq + k),
                );
                task_update!(
                    diesel::update(target.clone())
                        .set(set)
                        .returning(tasks::last_event_seq)
                )
            }
            StateWrite::Moving { from, to } => {
                let moving = tasks::state.eq_any(from);
                let set = (
                    tasks::state.eq(diesel::dsl::case_when::<_, _, diesel::sql_types::Text>(
                        moving.clone(),
                        to.as_str(),
                    )
                    .otherwise(tasks::state)),
                    tasks::updated_at.eq(
                        diesel::dsl::case_when::<_, _, crate::conn::UtcTimestamp>(moving, now)
                            .otherwise(tasks::updated_at),
                    ),
                    tasks::last_event_seq.eq(tasks::last_event_seq + k),
                );
                task_update!(
                    diesel::update(target.clone())
                        .set(set)
                        .returning(tasks::last_event_seq)
                )
            }
            // An event that leaves the task as it is, with no task events:
            // nothing to write (the read above found the task).
            StateWrite::Keep if k == 0 => continue,
            StateWrite::Keep => task_update!(
                diesel::update(target.clone())
                    .set(tasks::last_event_seq.eq(tasks::last_event_seq + k))
                    .returning(tasks::last_event_seq)
            ),
        };
        number_task_events(t, k, last, &mut next_task_seq)?;
    }

    // 2. Session rows, in id order: the versioned update and the counters.
    let mut next_seq: HashMap<SessionId, Need> = HashMap::new();
    let mut written_session: Option<SessionRow> = None;
    for sid in session_ids {
        let with_task = kept_task.take();
        let n = need.get(&sid).copied().unwrap_or_default();
        let target = task_sessions::table.find(sid.to_string());
        let counters = (
            task_sessions::last_event_seq.eq(task_sessions::last_event_seq + n.events),
            task_sessions::last_message_seq.eq(task_sessions::last_message_seq + n.messages),
        );
        let seqs = (
            task_sessions::last_event_seq,
            task_sessions::last_message_seq,
        );
        // The counters as advanced come back with the update: one statement.
        let advanced: (i64, i64) = match change.session.as_ref().filter(|s| s.id == sid) {
            Some(s) => {
                // The row as written comes back too: the caller's copy.
                let versioned = target.clone().filter(task_sessions::version.eq(s.version));
                let set = (
                    SessionChanges::from_domain(s, now),
                    task_sessions::version.eq(task_sessions::version + 1),
                    counters,
                );
                let written: Option<(SessionRow, i64, i64, Option<i64>)> =
                    match (with_task, &mut *conn) {
                        (Some(task), AnyConnection::Pg(c)) => {
                            let counted = (task.task, task.events);
                            let written: Option<(SessionRow, i64, i64, Option<i64>)> = With {
                                name: "counted_task",
                                first: task.update,
                                then: diesel::update(versioned)
                                    .filter(counted_task_written())
                                    .set(set)
                                    .returning((
                                        session_columns(),
                                        seqs.0,
                                        seqs.1,
                                        counted_task_seq(),
                                    )),
                            }
                            .prepared()
                            .get_result(c)
                            .optional()?;
                            task_counted(
                                c,
                                counted,
                                written.as_ref().map(|w| w.3),
                                &mut next_task_seq,
                            )?;
                            written
                        }
                        (_, conn) => native!(conn, |c| diesel::update(versioned)
                            .set(set)
                            .returning((session_columns(), seqs.0, seqs.1))
                            .prepared()
                            .get_result(c))
                        .optional()?
                        .map(|(row, events, messages)| (row, events, messages, None)),
                    };
                let Some((row, events, messages, _)) = written else {
                    let actual: Option<i64> = native!(conn, |c| target
                        .select(task_sessions::version)
                        .get_result(c))
                    .optional()?;
                    return Err(match actual {
                        None => Error::not_found("session", sid),
                        Some(actual_version) => Error::Conflict {
                            entity: "session",
                            id: sid.to_string(),
                            expected_version: s.version,
                            actual_version,
                        },
                    });
                };
                written_session = Some(row);
                (events, messages)
            }
            None => {
                let written: Option<(i64, i64)> = match (with_task, &mut *conn) {
                    (Some(task), AnyConnection::Pg(c)) => {
                        let counted = (task.task, task.events);
                        let written = With {
                            name: "counted_task",
                            first: task.update,
                            then: diesel::update(target)
                                .filter(counted_task_written())
                                .set(counters)
                                .returning((seqs.0, seqs.1, counted_task_seq())),
                        }
                        .prepared()
                        .get_result::<(i64, i64, Option<i64>)>(c)
                        .optional()?;
                        task_counted(c, counted, written.map(|w| w.2), &mut next_task_seq)?;
                        written.map(|(events, messages, _)| (events, messages))
                    }
                    (_, conn) => native!(conn, |c| diesel::update(target)
                        .set(counters)
                        .returning(seqs)
                        .prepared()
                        .get_result(c))
                    .optional()?,
                };
                written.ok_or_else(|| Error::not_found("session", sid))?
            }
        };
        if n.events + n.messages > 0 {
            let (last_event, last_message) = advanced;
            next_seq.insert(
                sid,
                Need {
                    events: last_event - n.events + 1,
                    messages: last_message - n.messages + 1,
                },
            );
        }
    }

    // The title's session row is one of those above, or the only row
    // this changeset touches: the lock order holds.
    if let Some((sid, title, source)) = &change.title {
        write_title(conn, *sid, title, *source)?;
    }

    // 3. The fence (locks the executor row; after the task and session
    //    rows, like every writer of executors), then the executor record.
    if let Some(fence) = &change.fence {
        check_fence(conn, fence, change.executor.as_deref())?;
    }
    let executor = match change.executor.map(|e| *e) {
        None => None,
        Some(ExecutorWrite::Insert(mut record)) => {
            record.version = 1;
            let task = session_task(conn, record.session_id)?;
            if task != record.task_id {
                return Err(Error::Invalid(format!(
                    "executor {} names task {} but session {} belongs to task {task}",
                    record.id, record.task_id, record.session_id
                )));
            }
            let row = ExecutorRow::from_domain(&record)?;
            native!(conn, |c| diesel::insert_into(executors_running::table)
                .values(&row)
                .returning(executors_running::id)
                .prepared()
                .get_result::<String>(c))
            .map_err(|e| {
                on_unique(e, "executor", |detail| {
                    if detail.contains("session_id") {
                        format!("for session {}", record.session_id)
                    } else {
                        record.id.to_string()
                    }
                })
            })?;
            Some(ExecutorOut::Inserted(record.id))
        }
        Some(ExecutorWrite::Update(record)) => {
            let mut row = ExecutorRow::from_domain(&record)?;
            let expected = record.version;
            row.version = expected + 1;
            row.updated_at = now;
            let target = executors_running::table.find(record.id.to_string());
            // The row as written comes back: the caller's copy, with the
            // columns this update leaves alone (see `ExecutorRow`).
            let versioned = target
                .clone()
                .filter(executors_running::version.eq(expected));
            let written: Option<ExecutorRow> = native!(conn, |c| diesel::update(versioned)
                .set(&row)
                .returning(executor_columns())
                .prepared()
                .get_result(c))
            .optional()?;
            let Some(written) = written else {
                let actual: Option<i64> = native!(conn, |c| target
                    .select(executors_running::version)
                    .get_result(c))
                .optional()?;
                return Err(match actual {
                    None => Error::not_found("executor", record.id),
                    Some(actual_version) => Error::Conflict {
                        entity: "executor",
                        id: record.id.to_string(),
                        expected_version: expected,
                        actual_version,
                    },
                });
            };
            Some(ExecutorOut::Written(Box::new(written)))
        }
    };

    // 4. Messages.
    // PostgreSQL: a changeset's one new message goes in with its events, in
    // one statement (a turn's start, a reply's first chunk): one round trip.
    let message_with_events = matches!(conn, AnyConnection::Pg(_))
        && change.new_messages.len() == 1
        && update_targets.is_empty()
        && (1..=EVENTS_PER_INSERT).contains(&change.events.len());
    let mut messages = Vec::with_capacity(change.new_messages.len() + update_targets.len());
    for mut m in change.new_messages {
        let next = next_seq.get_mut(&m.session_id).map(|n| &mut n.messages);
        let Some(next) = next else {
            return Err(Error::Invalid("message seq not allocated".into()));
        };
        m.seq = *next;
        *next += 1;
        m.created_at = crate::conn::truncate(m.created_at);
        m.updated_at = crate::conn::truncate(m.updated_at);
        if !message_with_events {
            let row = MessageRow::from_domain(&m);
            native!(conn, |c| diesel::insert_into(session_messages::table)
                .values(&row)
                .returning(session_messages::seq)
                .prepared()
                .get_result::<i64>(c))
            .map_err(|e| on_unique(e, "message", |_| m.id.to_string()))?;
        }
        messages.push(m);
    }
    for (u, _) in &update_targets {
        let target = session_messages::table.find(u.id.to_string());
        // `data` only when given; the row as written comes back.
        let set = (
            session_messages::content.eq(&u.content),
            session_messages::complete.eq(u.complete),
            session_messages::updated_at.eq(now),
            u.data.as_ref().map(|d| session_messages::data.eq(d)),
        );
        let row: MessageRow = native!(conn, |c| diesel::update(target)
            .set(set)
            .returning(message_columns())
            .prepared()
            .get_result(c))?;
        messages.push(row.into_domain()?);
    }

    // 5. Events.
    let mut events = Vec::with_capacity(change.events.len());
    for (sid, mut payload) in change.events {
        match &mut payload {
            EventPayload::MessageAdded(m)
            | EventPayload::MessageUpdated(m)
            | EventPayload::PermissionRequested(m) => {
                // The latest written state of that message in this changeset.
                if let Some(stored) = messages.iter().rev().find(|s| s.id == m.id) {
                    *m = stored.clone();
                }
            }
            _ => {}
        }
        let task = task_of[&sid];
        let seq = next_seq.get_mut(&sid).map(|n| &mut n.events);
        let task_seq = next_task_seq.get_mut(&task);
        let (Some(seq), Some(task_seq)) = (seq, task_seq) else {
            return Err(Error::Invalid("event seq not allocated".into()));
        };
        let event = Event {
            session_id: sid,
            task_id: task,
            seq: *seq,
            task_seq: *task_seq,
            payload,
            created_at: now.0,
        };
        *seq += 1;
        *task_seq += 1;
        events.push(event);
    }
    match conn {
        // One multi-row `INSERT` for the changeset's events (a turn's start
        // or end has several): each would be a round trip.
        AnyConnection::Pg(c) => {
            let mut message = message_with_events.then(|| MessageRow::from_domain(&messages[0]));
            for group in events.chunks(EVENTS_PER_INSERT) {
                let rows: Vec<EventRow> = group.iter().map(EventRow::from_domain).collect();
                let insert_events = diesel::insert_into(session_events::table)
                    .values(&rows)
                    .returning(session_events::seq);
                match message.take() {
                    None => insert_events.prepared().load::<i64>(c).map(drop)?,
                    Some(row) => With {
                        name: "added_message",
                        first: diesel::insert_into(session_messages::table)
                            .values(&row)
                            .returning(session_messages::seq),
                        then: insert_events,
                    }
                    .prepared()
                    .load::<i64>(c)
                    .map(drop)
                    .map_err(|e| match &e {
                        diesel::result::Error::DatabaseError(_, info)
                            if info.table_name() == Some("session_messages") =>
                        {
                            on_unique(e, "message", |_| row.id.clone())
                        }
                        _ => Error::from(e),
                    })?,
                }
            }
        }
        // No round trips to save in process: one kept-prepared `INSERT`
        // per event, whose text never varies with the event count.
        AnyConnection::Sqlite(c) => {
            for event in &events {
                diesel::insert_into(session_events::table)
                    .values(EventRow::from_domain(event))
                    .returning(session_events::seq)
                    .prepared()
                    .get_result::<i64>(c)?;
            }
        }
    }

    // 6. Read back what the caller will hold.
    // The updated row, unless this changeset also wrote its title after it.
    let session = match (&change.session, written_session) {
        (Some(s), written) => {
            let titled = change.title.as_ref().is_some_and(|(t, _, _)| *t == s.id);
            let row = match written {
                Some(row) if !titled => row,
                _ => {
                    let target = task_sessions::table.find(s.id.to_string());
                    native!(conn, |c| target
                        .select(SessionRow::as_select())
                        .get_result(c))?
                }
            };
            Some(row.into_domain()?)
        }
        (None, _) => None,
    };
    let executor = match executor {
        Some(ExecutorOut::Inserted(id)) => Some(load_executor(conn, id)?),
        Some(ExecutorOut::Written(row)) => Some(row.into_domain()?),
        None => None,
    };
    Ok(Committed {
        session,
        executor,
        messages,
        events,
    })
}

/// Where a task's events are numbered from, given its counter as advanced
/// by `events` (`None`: the task was not found).
fn number_task_events(
    task: TaskId,
    events: i64,
    last: Option<i64>,
    next_task_seq: &mut HashMap<TaskId, i64>,
) -> Result<()> {
    let Some(last) = last else {
        return Err(Error::not_found("task", task));
    };
    if events > 0 {
        next_task_seq.insert(task, last - events + 1);
    }
    Ok(())
}

/// A task's update kept to run as `counted_task` with a session's update
/// (PostgreSQL): the session's row is written only if the task's was,
/// which `WHERE EXISTS` also makes PostgreSQL run first (the lock order).
struct KeptTaskUpdate {
    task: TaskId,
    events: i64,
    update: Box<dyn diesel::query_builder::QueryFragment<diesel::pg::Pg> + Send>,
}

/// After a statement with a kept task update: the task's counter as it
/// returned it, or, if the statement wrote nothing, whether that was for
/// want of the task.
fn task_counted(
    c: &mut diesel::PgConnection,
    (task, events): (TaskId, i64),
    returned: Option<Option<i64>>,
    next_task_seq: &mut HashMap<TaskId, i64>,
) -> Result<()> {
    match returned {
        Some(last) => number_task_events(task, events, last, next_task_seq),
        None => {
            let found: Option<String> = tasks::table
                .find(task.to_string())
                .select(tasks::id)
                .get_result(c)
                .optional()?;
            match found {
                None => Err(Error::not_found("task", task)),
                // The session's own failure, told by the caller.
                Some(_) => Ok(()),
            }
        }
    }
}

/// The session update's condition that the task's was written.
fn counted_task_written() -> diesel::expression::SqlLiteral<diesel::sql_types::Bool> {
    diesel::dsl::sql("EXISTS (SELECT 1 FROM counted_task)")
}

/// The task's counter as `counted_task` advanced it, in a `RETURNING`.
fn counted_task_seq()
-> diesel::expression::SqlLiteral<diesel::sql_types::Nullable<diesel::sql_types::BigInt>> {
    diesel::dsl::sql("(SELECT last_event_seq FROM counted_task)")
}

/// How a changeset's task state is written with the task's counter.
enum StateWrite {
    /// As it is.
    Keep,
    /// To this state.
    Set(TaskState),
    /// To `to` from any of `from` (as stored), else as it is.
    Moving {
        from: Vec<&'static str>,
        to: TaskState,
    },
}

/// The write that applies `event` to whatever state a task has stored:
/// the states it moves out of, to the one state they all move to (`Keep`
/// if it moves none); `None` when they move to different states (then the
/// state is read first).
fn moves(event: TaskEvent) -> Option<StateWrite> {
    let mut to = None;
    let mut from = Vec::new();
    for s in TaskState::ALL {
        if let Some(next) = s.transition(event).ok().filter(|n| n != s) {
            if to.is_some_and(|t| t != next) {
                return None;
            }
            to = Some(next);
            from.push(s.as_str());
        }
    }
    Some(match to {
        Some(to) => StateWrite::Moving { from, to },
        None => StateWrite::Keep,
    })
}

/// The state `event` moves task `t` to from its stored state, `None` if
/// it leaves it as it is.
fn read_transition(
    conn: &mut AnyConnection,
    t: TaskId,
    event: TaskEvent,
) -> Result<Option<TaskState>> {
    let target = tasks::table.find(t.to_string());
    let stored: Option<String> =
        native!(conn, |c| target.select(tasks::state).get_result(c)).optional()?;
    let stored = stored.ok_or_else(|| Error::not_found("task", t))?;
    let stored = TaskState::parse(&stored).map_err(|e| Error::corrupt("task", t, e))?;
    Ok(stored.transition(event).ok().filter(|next| *next != stored))
}

/// What the executor write left to read back.
enum ExecutorOut {
    Inserted(ExecutorId),
    /// The row an update returned.
    Written(Box<ExecutorRow>),
}

/// [`MessageRow`]'s columns, in its field order.
type MessageColumns = (
    session_messages::id,
    session_messages::session_id,
    session_messages::task_id,
    session_messages::role,
    session_messages::content,
    session_messages::seq,
    session_messages::complete,
    session_messages::created_at,
    session_messages::updated_at,
    session_messages::kind,
    session_messages::data,
);

/// [`MessageRow`]'s columns in its field order, for a `RETURNING` clause
/// (as [`session_columns`]).
fn message_columns() -> MessageColumns {
    use session_messages as m;
    (
        m::id,
        m::session_id,
        m::task_id,
        m::role,
        m::content,
        m::seq,
        m::complete,
        m::created_at,
        m::updated_at,
        m::kind,
        m::data,
    )
}

/// [`ExecutorRow`]'s columns, in its field order.
type ExecutorColumns = (
    executors_running::id,
    executors_running::session_id,
    executors_running::task_id,
    executors_running::runtime,
    executors_running::status,
    executors_running::agentctl_url,
    executors_running::agentctl_port,
    executors_running::container_id,
    executors_running::pid,
    executors_running::pid_start_time,
    executors_running::auth_secret,
    executors_running::generation,
    executors_running::supports_session_resume,
    executors_running::supports_workspace_only,
    executors_running::resume_token,
    executors_running::workspace_path,
    executors_running::worktree_id,
    executors_running::worktree_path,
    executors_running::worktree_branch,
    executors_running::worktree_repository,
    executors_running::worktree_base,
    executors_running::last_seen_at,
    executors_running::error_message,
    executors_running::owner_id,
    executors_running::lease_expires_at,
    executors_running::lease_epoch,
    executors_running::version,
    executors_running::created_at,
    executors_running::updated_at,
);

/// [`ExecutorRow`]'s columns in its field order, for a `RETURNING` clause
/// (as [`session_columns`]).
fn executor_columns() -> ExecutorColumns {
    use executors_running as e;
    (
        e::id,
        e::session_id,
        e::task_id,
        e::runtime,
        e::status,
        e::agentctl_url,
        e::agentctl_port,
        e::container_id,
        e::pid,
        e::pid_start_time,
        e::auth_secret,
        e::generation,
        e::supports_session_resume,
        e::supports_workspace_only,
        e::resume_token,
        e::workspace_path,
        e::worktree_id,
        e::worktree_path,
        e::worktree_branch,
        e::worktree_repository,
        e::worktree_base,
        e::last_seen_at,
        e::error_message,
        e::owner_id,
        e::lease_expires_at,
        e::lease_epoch,
        e::version,
        e::created_at,
        e::updated_at,
    )
}

/// [`SessionRow`]'s columns, in its field order.
type SessionColumns = (
    task_sessions::id,
    task_sessions::task_id,
    task_sessions::state,
    task_sessions::agent_profile_id,
    task_sessions::agent_execution_id,
    task_sessions::runtime,
    task_sessions::executor_id,
    task_sessions::worktree_id,
    task_sessions::worktree_path,
    task_sessions::worktree_branch,
    task_sessions::worktree_repository,
    task_sessions::worktree_base,
    task_sessions::metadata,
    task_sessions::error_message,
    task_sessions::version,
    task_sessions::created_at,
    task_sessions::updated_at,
    task_sessions::title,
    task_sessions::title_source,
);

/// [`SessionRow`]'s columns in its field order, for a `RETURNING` clause
/// (diesel's `as_returning` does not reach through our multi-backend
/// connection).
fn session_columns() -> SessionColumns {
    use task_sessions as t;
    (
        t::id,
        t::task_id,
        t::state,
        t::agent_profile_id,
        t::agent_execution_id,
        t::runtime,
        t::executor_id,
        t::worktree_id,
        t::worktree_path,
        t::worktree_branch,
        t::worktree_repository,
        t::worktree_base,
        t::metadata,
        t::error_message,
        t::version,
        t::created_at,
        t::updated_at,
        t::title,
        t::title_source,
    )
}

/// The lease check of [`Changeset::fenced`]. A no-op `UPDATE` filtered on
/// owner and epoch: it takes the row lock until commit (PostgreSQL), so a
/// concurrent claim waits for this transaction or has already changed what
/// the filter sees (READ COMMITTED re-checks the newest row version);
/// SQLite's write transaction is exclusive anyway.
pub(crate) fn check_fence(
    conn: &mut AnyConnection,
    fence: &Fence,
    executor: Option<&ExecutorWrite>,
) -> Result<()> {
    let session = fence.session.to_string();
    let held = executors_running::table
        .filter(executors_running::session_id.eq(&session))
        .filter(executors_running::owner_id.eq(&fence.owner))
        .filter(executors_running::lease_epoch.eq(fence.epoch));
    let held: Vec<String> = native!(conn, |c| diesel::update(held)
        .set(executors_running::lease_epoch.eq(executors_running::lease_epoch))
        .returning(executors_running::id)
        .prepared()
        .load(c))?;
    if !held.is_empty() {
        return Ok(());
    }
    let current: Option<(Option<String>, i64)> = executors_running::table
        .filter(executors_running::session_id.eq(&session))
        .select((executors_running::owner_id, executors_running::lease_epoch))
        .get_result(conn)
        .optional()?;
    let creating =
        matches!(executor, Some(ExecutorWrite::Insert(r)) if r.session_id == fence.session);
    let (current_owner, current_epoch) = match current {
        None if creating => return Ok(()),
        None => ("-".to_owned(), 0),
        Some((owner, epoch)) => (owner.unwrap_or_else(|| "-".to_owned()), epoch),
    };
    Err(Error::LeaseLost {
        session_id: session,
        owner: fence.owner.clone(),
        epoch: fence.epoch,
        current_owner,
        current_epoch,
    })
}

/// Which task each session belongs to, as commits have read it: a
/// session's task never changes, so a commit reads it once per session
/// instead of once per commit. A session whose row a rolled-back
/// transaction had inserted may stay here: a later commit naming it
/// updates its row (or one of its messages, which cannot exist), which
/// reports it missing. Bounded: full, it starts over.
#[derive(Debug, Default)]
pub(crate) struct SessionTasks(std::sync::Mutex<HashMap<SessionId, TaskId>>);

/// Sessions [`SessionTasks`] remembers at most (about 3 MiB).
const SESSION_TASKS_MAX: usize = 65_536;

impl SessionTasks {
    /// The session's task, read from the store the first time.
    pub(crate) fn task_of(&self, conn: &mut AnyConnection, session: SessionId) -> Result<TaskId> {
        if let Some(task) = self.get(session) {
            return Ok(task);
        }
        let task = session_task(conn, session)?;
        self.insert(session, task);
        Ok(task)
    }

    fn get(&self, session: SessionId) -> Option<TaskId> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&session)
            .copied()
    }

    fn insert(&self, session: SessionId, task: TaskId) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= SESSION_TASKS_MAX {
            map.clear();
        }
        map.insert(session, task);
    }
}

fn session_task(conn: &mut AnyConnection, sid: SessionId) -> Result<TaskId> {
    let target = task_sessions::table.find(sid.to_string());
    let task: Option<String> = native!(conn, |c| target
        .select(task_sessions::task_id)
        .get_result(c))
    .optional()?;
    let task = task.ok_or_else(|| Error::not_found("session", sid))?;
    TaskId::parse(&task).map_err(|e| Error::corrupt("session", sid, e))
}

pub(crate) fn load_executor(conn: &mut AnyConnection, id: ExecutorId) -> Result<ExecutorRecord> {
    let id_text = id.to_string();
    crate::conn::native!(conn, |c| executors_running::table
        .find(&id_text)
        .select(ExecutorRow::as_select())
        .get_result(c))
    .optional()?
    .ok_or_else(|| Error::not_found("executor", id))?
    .into_domain()
}
