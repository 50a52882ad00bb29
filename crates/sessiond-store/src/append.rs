//! PostgreSQL: a reply's first chunk (one new message and its
//! `MessageAdded`, nothing else) in one statement, in autocommit.
//!
//! Through [`apply`](crate::changeset::apply) that commit is four round
//! trips (`BEGIN`, the counters' `UPDATE`, the message's and event's
//! `INSERT`, `COMMIT`), and it sits on a turn's path to its first chunk at
//! a watcher (decision 0003). Here the counters' updates and both inserts
//! are data-modifying `WITH`s of one statement, which PostgreSQL runs
//! all-or-nothing as its own transaction: one round trip. What it writes is
//! what `apply` writes: the same rows, gap-free seqs from the same counters,
//! the same lock order (the task's row, then the session's, then a fence's
//! executor row), and with replicas the same `NOTIFY`.

use diesel::RunQueryDsl;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Bool, Integer, Text};
use sessiond_domain::{Event, EventPayload};

use crate::{
    Error, Result,
    changeset::{Changeset, Committed, Fence, SessionTasks},
    conn::{AnyConnection, KeepPrepared, Ts, UtcTimestamp},
    error::on_unique,
    rows::{EventRow, MessageRow},
};

/// The message's seq as written into the event's payload before the store
/// knows it: split there, the payload's two halves go to PostgreSQL, which
/// puts the seq it allocates between them. `"seq":` followed by a number
/// cannot occur inside a JSON string (its quotes are escaped there), and a
/// payload with it more than once is not taken.
const SEQ_MARK: i64 = i64::MIN;

/// `change` when it is one new message and its `MessageAdded`, nothing
/// else: the shape [`append_alone`] writes.
pub(crate) fn alone(change: &Changeset) -> bool {
    let [m] = change.new_messages.as_slice() else {
        return false;
    };
    let [(sid, EventPayload::MessageAdded(added))] = change.events.as_slice() else {
        return false;
    };
    change.session.is_none()
        && change.executor.is_none()
        && change.task_state.is_none()
        && change.message_updates.is_empty()
        && change.title.is_none()
        && change.fence.as_ref().is_none_or(|f| f.session == *sid)
        && *sid == m.session_id
        && added.id == m.id
}

/// Marks a failed fence's error: the statement casts it to a number when
/// the fence's row is not the writer's (see [`AppendAlone`]).
const LEASE_LOST: &str = "sessiond_lease_lost";

/// Writes a changeset [`alone`] accepted, on PostgreSQL, outside any
/// transaction (the statement is one); with `notify` (a channel and this
/// replica's name), announced by a `NOTIFY` as `events::notify` does.
pub(crate) fn append_alone(
    conn: &mut AnyConnection,
    change: Changeset,
    tasks: &SessionTasks,
    notify: Option<(&str, &str)>,
) -> Result<Committed> {
    let fence = change.fence.clone();
    let Some(mut m) = change.new_messages.into_iter().next() else {
        return Err(Error::Invalid("no message to append".into()));
    };
    let sid = m.session_id;
    let task = tasks.task_of(conn, sid)?;
    if m.task_id != task {
        return Err(Error::Invalid(format!(
            "message {} names task {} but session {sid} belongs to task {task}",
            m.id, m.task_id
        )));
    }
    let now = Ts::new(crate::conn::now());
    m.created_at = crate::conn::truncate(m.created_at);
    m.updated_at = crate::conn::truncate(m.updated_at);
    m.seq = SEQ_MARK;
    let payload = EventPayload::MessageAdded(m.clone());
    let marked = EventRow::from_domain(&Event {
        session_id: sid,
        task_id: task,
        seq: 0,
        task_seq: 0,
        payload,
        created_at: now.0,
    });
    let mark = format!("\"seq\":{SEQ_MARK}");
    let (head, tail) = match marked.payload.match_indices(&mark).collect::<Vec<_>>()[..] {
        [(at, _)] => (
            &marked.payload[..at + "\"seq\":".len()],
            &marked.payload[at + mark.len()..],
        ),
        _ => {
            return Err(Error::Invalid(format!(
                "message {}: its event's payload does not name its seq once",
                m.id
            )));
        }
    };
    let row = MessageRow::from_domain(&m);
    let AnyConnection::Pg(c) = conn else {
        return Err(Error::Invalid(
            "one-statement append is PostgreSQL's".into(),
        ));
    };
    let statement = AppendAlone {
        task: &row.task_id,
        row: &row,
        kind: &marked.kind,
        head,
        tail,
        at: &now,
        fence: fence.as_ref(),
        notify,
    };
    let written: Option<(i64, i64, i64, i32, i64)> = match statement.prepared().get_result(c) {
        Ok(written) => Some(written),
        Err(diesel::result::Error::NotFound) => None,
        Err(e) => {
            let info = match &e {
                diesel::result::Error::DatabaseError(_, info) => Some(info),
                _ => None,
            };
            if info.is_some_and(|i| i.table_name() == Some("session_messages")) {
                return Err(on_unique(e, "message", |_| row.id.clone()));
            }
            let lost = info.is_some_and(|i| i.message().contains(LEASE_LOST));
            if let Some(fence) = fence.as_ref().filter(|_| lost) {
                // Nothing was written; the fence's own check says whose
                // the executor is now.
                crate::changeset::check_fence(conn, fence, None)?;
                return Err(Error::LeaseLost {
                    session_id: fence.session.to_string(),
                    owner: fence.owner.clone(),
                    epoch: fence.epoch,
                    current_owner: "-".into(),
                    current_epoch: 0,
                });
            }
            return Err(Error::from(e));
        }
    };
    // No row: the task or the session is gone. Neither is ever deleted, and
    // the session was just found under this task.
    let Some((event_seq, message_seq, task_seq, _, _)) = written else {
        return Err(Error::not_found("session", sid));
    };
    m.seq = message_seq;
    let event = Event {
        session_id: sid,
        task_id: task,
        seq: event_seq,
        task_seq,
        payload: EventPayload::MessageAdded(m.clone()),
        created_at: now.0,
    };
    Ok(Committed {
        session: None,
        executor: None,
        messages: vec![m],
        events: vec![event],
    })
}

/// The statement: the task's counter, then (its row locked first, as every
/// writer does) the session's, then the fence's executor row, then the
/// message and its event numbered by them, and the `NOTIFY`. Answers the
/// session's event and message seqs and the task's event seq as advanced
/// (and two columns that only make the fence and the notification run);
/// no row when the task or session is missing. A fence that does not
/// hold fails the statement (a text that is no number, cast to one), so
/// nothing of it is kept, the counters' advance included.
struct AppendAlone<'a> {
    task: &'a str,
    row: &'a MessageRow,
    kind: &'a str,
    head: &'a str,
    tail: &'a str,
    at: &'a Ts,
    fence: Option<&'a Fence>,
    /// The channel, and the replica the event is from.
    notify: Option<(&'a str, &'a str)>,
}

impl QueryId for AppendAlone<'_> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for AppendAlone<'_> {
    type SqlType = (BigInt, BigInt, BigInt, Integer, BigInt);
}

impl<Conn> RunQueryDsl<Conn> for AppendAlone<'_> {}

impl QueryFragment<Pg> for AppendAlone<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> diesel::QueryResult<()> {
        let r = self.row;
        out.push_sql(
            "WITH counted_task AS (UPDATE tasks SET last_event_seq = last_event_seq + 1 \
             WHERE id = ",
        );
        out.push_bind_param::<Text, _>(self.task)?;
        out.push_sql(
            " RETURNING last_event_seq), \
             counted_session AS (UPDATE task_sessions \
             SET last_event_seq = last_event_seq + 1, last_message_seq = last_message_seq + 1 \
             WHERE id = ",
        );
        out.push_bind_param::<Text, _>(&r.session_id)?;
        // A one-time filter: the task's row is locked before the session's.
        out.push_sql(
            " AND EXISTS (SELECT 1 FROM counted_task) \
             RETURNING last_event_seq, last_message_seq), \
             added_message AS (INSERT INTO session_messages \
             (id, session_id, task_id, role, content, seq, complete, created_at, updated_at, kind, data) \
             SELECT ",
        );
        out.push_bind_param::<Text, _>(&r.id)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.session_id)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.task_id)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.role)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.content)?;
        out.push_sql(", last_message_seq, ");
        out.push_bind_param::<Bool, _>(&r.complete)?;
        out.push_sql(", ");
        out.push_bind_param::<UtcTimestamp, _>(&r.created_at)?;
        out.push_sql(", ");
        out.push_bind_param::<UtcTimestamp, _>(&r.updated_at)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.kind)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&r.data)?;
        out.push_sql(
            " FROM counted_session RETURNING seq), \
             added_event AS (INSERT INTO session_events \
             (session_id, seq, task_id, task_seq, kind, payload, created_at) \
             SELECT ",
        );
        out.push_bind_param::<Text, _>(&r.session_id)?;
        out.push_sql(", s.last_event_seq, ");
        out.push_bind_param::<Text, _>(self.task)?;
        out.push_sql(", t.last_event_seq, ");
        out.push_bind_param::<Text, _>(self.kind)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(self.head)?;
        out.push_sql(" || s.last_message_seq::text || ");
        out.push_bind_param::<Text, _>(self.tail)?;
        out.push_sql(", ");
        out.push_bind_param::<UtcTimestamp, _>(self.at)?;
        out.push_sql(" FROM counted_session s, counted_task t RETURNING seq)");
        if let Some(fence) = self.fence {
            // After the session's row: a one-time filter, as above.
            out.push_sql(
                ", fenced AS (UPDATE executors_running SET lease_epoch = lease_epoch \
                 WHERE session_id = ",
            );
            out.push_bind_param::<Text, _>(&r.session_id)?;
            out.push_sql(" AND owner_id = ");
            out.push_bind_param::<Text, _>(&fence.owner)?;
            out.push_sql(" AND lease_epoch = ");
            out.push_bind_param::<BigInt, _>(&fence.epoch)?;
            out.push_sql(" AND EXISTS (SELECT 1 FROM counted_session) RETURNING id)");
        }
        if let Some((channel, origin)) = self.notify {
            out.push_sql(", notified AS (SELECT pg_notify(");
            out.push_bind_param::<Text, _>(channel)?;
            out.push_sql(", ");
            out.push_bind_param::<Text, _>(origin)?;
            out.push_sql(" || ' ' || ");
            out.push_bind_param::<Text, _>(&r.session_id)?;
            out.push_sql(" || ' ' || s.last_event_seq::text || ' ' || ");
            out.push_bind_param::<Text, _>(self.task)?;
            out.push_sql(
                " || ' ' || t.last_event_seq::text) FROM counted_session s, counted_task t)",
            );
        }
        out.push_sql(" SELECT s.last_event_seq, s.last_message_seq, t.last_event_seq, ");
        if self.fence.is_some() {
            out.push_sql("CAST(CASE WHEN EXISTS (SELECT 1 FROM fenced) THEN '1' ELSE ");
            out.push_bind_param::<Text, _>(LEASE_LOST)?;
            out.push_sql(" END AS integer), ");
        } else {
            out.push_sql("1, ");
        }
        if self.notify.is_some() {
            out.push_sql("(SELECT count(*) FROM notified)");
        } else {
            out.push_sql("0::bigint");
        }
        out.push_sql(" FROM counted_session s, counted_task t");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use sessiond_domain::{Message, MessageId, MessageKind, MessageRole, SessionId, TaskId};

    fn message(session: SessionId, task: TaskId) -> Message {
        Message {
            id: MessageId::new(),
            session_id: session,
            task_id: task,
            role: MessageRole::Agent,
            content: "\"seq\":-9223372036854775808 inside the text".into(),
            kind: MessageKind::Text,
            data: String::new(),
            seq: 0,
            complete: false,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }
    }

    #[test]
    fn only_a_lone_message_with_its_added_event_goes_alone() {
        let (s, t) = (SessionId::new(), TaskId::new());
        let m = message(s, t);
        let added = |m: &Message| EventPayload::MessageAdded(m.clone());
        let lone = Changeset::new().add_message(m.clone()).event(s, added(&m));
        assert!(alone(&lone));
        assert!(!alone(&Changeset::new().add_message(m.clone())));
        let other = message(s, t);
        assert!(!alone(
            &Changeset::new()
                .add_message(m.clone())
                .event(s, added(&other))
        ));
        assert!(!alone(
            &Changeset::new()
                .add_message(m.clone())
                .event(s, added(&m))
                .event(s, added(&m))
        ));
        assert!(!alone(
            &Changeset::new()
                .add_message(m.clone())
                .event(s, added(&m))
                .task_event(t, sessiond_domain::TaskEvent::WorkStarted)
        ));
        assert!(!alone(
            &Changeset::new()
                .add_message(m.clone())
                .event(s, added(&m))
                .set_title(s, "t".into(), sessiond_domain::TitleSource::User)
        ));
    }

    #[test]
    fn the_mark_is_found_once_even_when_the_text_quotes_it() {
        let (s, t) = (SessionId::new(), TaskId::new());
        let mut m = message(s, t);
        m.seq = SEQ_MARK;
        let row = EventRow::from_domain(&Event {
            session_id: s,
            task_id: t,
            seq: 0,
            task_seq: 0,
            payload: EventPayload::MessageAdded(m),
            created_at: Utc::now(),
        });
        let mark = format!("\"seq\":{SEQ_MARK}");
        assert_eq!(row.payload.matches(&mark).count(), 1, "{}", row.payload);
    }
}
