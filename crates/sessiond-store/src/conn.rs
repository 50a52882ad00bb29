//! The one connection type of the store, its pool, the timestamp SQL type,
//! and write transactions.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use diesel::{
    Connection,
    backend::Backend as DieselBackend,
    connection::{AnsiTransactionManager, SimpleConnection, TransactionManager},
    deserialize::{self, FromSql, FromSqlRow},
    expression::AsExpression,
    pg::{Pg, PgConnection},
    r2d2::{self, ManageConnection, R2D2Connection},
    serialize::{self, IsNull, Output, ToSql},
    sql_types::{HasSqlType, SqlType, Timestamptz},
    sqlite::{Sqlite, SqliteConnection},
};

use crate::{Backend, Error, Result};

/// A connection to either backend. Repository code is written once against
/// this type; diesel's `MultiConnection` derive dispatches every query to the
/// inner connection and generates the `MultiBackend` the schema is typed for.
#[derive(diesel::MultiConnection)]
pub enum AnyConnection {
    Pg(PgConnection),
    Sqlite(SqliteConnection),
}

/// Runs `$body` on the backend's own connection, bound to `$c`.
///
/// Through [`AnyConnection`], diesel serializes a statement's SQL on every
/// execution, several times (to look it up in the statement cache, to bind
/// its parameters): for a row of twenty-odd columns that costs more than
/// SQLite running it. On the backend's own connection a statement with a
/// static query id is built once, when it is first prepared. So the hot
/// statements (every commit's, the recovery's reads) go through here; the
/// body is compiled once per backend.
macro_rules! native {
    ($conn:expr, |$c:ident| $body:expr) => {
        match $conn {
            $crate::conn::AnyConnection::Pg($c) => $body,
            $crate::conn::AnyConnection::Sqlite($c) => $body,
        }
    };
}
pub(crate) use native;

/// A point in time, UTC, microsecond precision. `TIMESTAMPTZ` on Postgres;
/// on SQLite fixed-width RFC 3339 text (`2026-01-02T03:04:05.123456Z`), which
/// sorts like the time it denotes.
#[derive(Debug, Clone, Copy, Default, SqlType, diesel::query_builder::QueryId)]
#[diesel(postgres_type(oid = 1184, array_oid = 1185))]
#[diesel(sqlite_type(name = "Text"))]
pub struct UtcTimestamp;

/// Rust side of [`UtcTimestamp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, AsExpression, FromSqlRow)]
#[diesel(sql_type = UtcTimestamp)]
pub struct Ts(pub(crate) DateTime<Utc>);

impl Ts {
    pub(crate) fn new(t: DateTime<Utc>) -> Ts {
        Ts(truncate(t))
    }
}

/// What both backends can store: microseconds.
pub(crate) fn truncate(t: DateTime<Utc>) -> DateTime<Utc> {
    t.trunc_subsecs(6)
}

pub(crate) fn now() -> DateTime<Utc> {
    truncate(Utc::now())
}

impl ToSql<UtcTimestamp, Pg> for Ts {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        <DateTime<Utc> as ToSql<Timestamptz, Pg>>::to_sql(&self.0, out)
    }
}

impl FromSql<UtcTimestamp, Pg> for Ts {
    fn from_sql(bytes: <Pg as DieselBackend>::RawValue<'_>) -> deserialize::Result<Self> {
        <DateTime<Utc> as FromSql<Timestamptz, Pg>>::from_sql(bytes).map(Ts)
    }
}

impl ToSql<UtcTimestamp, Sqlite> for Ts {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Sqlite>) -> serialize::Result {
        out.set_value(self.0.to_rfc3339_opts(SecondsFormat::Micros, true));
        Ok(IsNull::No)
    }
}

impl FromSql<UtcTimestamp, Sqlite> for Ts {
    fn from_sql(mut bytes: <Sqlite as DieselBackend>::RawValue<'_>) -> deserialize::Result<Self> {
        // Parsed where SQLite holds it: no copy per timestamp read.
        let text = bytes.read_text();
        let t = DateTime::parse_from_rfc3339(text)
            .map_err(|e| format!("timestamp {text:?} is not RFC 3339: {e}"))?;
        Ok(Ts(t.with_timezone(&Utc)))
    }
}

impl HasSqlType<UtcTimestamp> for MultiBackend {
    fn metadata(lookup: &mut Self::MetadataLookup) -> Self::TypeMetadata {
        MultiBackend::lookup_sql_type::<UtcTimestamp>(lookup)
    }
}

impl FromSql<UtcTimestamp, MultiBackend> for Ts {
    fn from_sql(bytes: <MultiBackend as DieselBackend>::RawValue<'_>) -> deserialize::Result<Self> {
        bytes.from_sql::<Ts, UtcTimestamp>()
    }
}

impl ToSql<UtcTimestamp, MultiBackend> for Ts {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, MultiBackend>) -> serialize::Result {
        out.set_value((UtcTimestamp, self));
        Ok(IsNull::No)
    }
}

/// Runs `f` in one write transaction and commits it, or rolls everything back
/// when `f` fails.
///
/// On SQLite the transaction is `BEGIN IMMEDIATE`: it takes the database's
/// write lock before the first read, so two writers never both hold a read
/// snapshot and then deadlock upgrading it (the second waits in
/// `busy_timeout` instead). On Postgres it is a plain `BEGIN` (READ
/// COMMITTED); writers serialize on the row locks their `UPDATE`s take.
pub(crate) fn write_transaction<T>(
    conn: &mut AnyConnection,
    f: impl FnOnce(&mut AnyConnection) -> Result<T>,
) -> Result<T> {
    match conn {
        AnyConnection::Pg(c) => AnsiTransactionManager::begin_transaction_sql(c, "BEGIN")?,
        AnyConnection::Sqlite(c) => {
            AnsiTransactionManager::begin_transaction_sql(c, "BEGIN IMMEDIATE")?
        }
    }
    match f(conn) {
        Ok(value) => {
            match conn {
                AnyConnection::Pg(c) => commit(c)?,
                AnyConnection::Sqlite(c) => commit(c)?,
            }
            Ok(value)
        }
        Err(e) => {
            // The caller's error is the one that matters; a failed rollback
            // leaves the connection broken, and the pool discards it.
            let _ = match conn {
                AnyConnection::Pg(c) => rollback(c),
                AnyConnection::Sqlite(c) => rollback(c),
            };
            Err(e)
        }
    }
}

/// Marks a connection whose socket is gone as broken, so the pool drops it
/// when it comes back instead of handing it out again: diesel reports a
/// PostgreSQL connection broken only for a transaction left open, so a dead
/// connection that failed a plain read would otherwise circulate forever.
pub(crate) fn discard(conn: &mut AnyConnection) {
    match conn {
        AnyConnection::Pg(c) => {
            <AnsiTransactionManager as TransactionManager<PgConnection>>::transaction_manager_status_mut(c)
                .set_in_error()
        }
        AnyConnection::Sqlite(c) => {
            <AnsiTransactionManager as TransactionManager<SqliteConnection>>::transaction_manager_status_mut(c)
                .set_in_error()
        }
    }
}

fn commit<C>(c: &mut C) -> diesel::QueryResult<()>
where
    C: Connection<TransactionManager = AnsiTransactionManager>,
{
    <AnsiTransactionManager as TransactionManager<C>>::commit_transaction(c)
}

fn rollback<C>(c: &mut C) -> diesel::QueryResult<()>
where
    C: Connection<TransactionManager = AnsiTransactionManager>,
{
    <AnsiTransactionManager as TransactionManager<C>>::rollback_transaction(c)
}

/// Opens connections of one backend for the pool; never guesses the backend
/// from a failed attempt at the other one.
#[derive(Debug, Clone)]
pub(crate) struct Manager {
    pub(crate) backend: Backend,
    pub(crate) target: String,
    pub(crate) busy_timeout: Duration,
    pub(crate) idle_in_transaction_timeout: Duration,
}

impl ManageConnection for Manager {
    type Connection = AnyConnection;
    type Error = r2d2::Error;

    fn connect(&self) -> Result<AnyConnection, r2d2::Error> {
        match self.backend {
            Backend::Postgres => {
                let mut c =
                    PgConnection::establish(&self.target).map_err(r2d2::Error::ConnectionError)?;
                // Only for what the server renders as text (logs, psql);
                // the store reads and writes timestamps in binary UTC.
                c.batch_execute(&format!(
                    "SET TIME ZONE 'UTC'; SET idle_in_transaction_session_timeout = {}",
                    self.idle_in_transaction_timeout.as_millis().max(1)
                ))
                .map_err(r2d2::Error::QueryError)?;
                Ok(AnyConnection::Pg(c))
            }
            Backend::Sqlite => {
                let mut c = SqliteConnection::establish(&self.target)
                    .map_err(r2d2::Error::ConnectionError)?;
                // Checkpoints run on a thread of their own (`checkpoint.rs`);
                // a commit checkpoints only past the backstop.
                let pragmas = format!(
                    "PRAGMA busy_timeout = {};
                     PRAGMA synchronous = NORMAL;
                     PRAGMA foreign_keys = ON;
                     PRAGMA wal_autocheckpoint = {};",
                    self.busy_timeout.as_millis(),
                    crate::checkpoint::BACKSTOP_PAGES
                );
                c.batch_execute(&pragmas).map_err(r2d2::Error::QueryError)?;
                // WAL is a property of the file, and switching to it takes
                // an exclusive lock that busy_timeout does not wait for: the
                // pool opens several connections at once, so only one that
                // finds the file not yet in WAL switches it (the store opens
                // one connection alone first, see `Store::open`).
                if !is_wal(&mut c).map_err(r2d2::Error::QueryError)? {
                    c.batch_execute("PRAGMA journal_mode = WAL;")
                        .map_err(r2d2::Error::QueryError)?;
                }
                Ok(AnyConnection::Sqlite(c))
            }
        }
    }

    fn is_valid(&self, conn: &mut AnyConnection) -> Result<(), r2d2::Error> {
        conn.ping().map_err(r2d2::Error::QueryError)
    }

    fn has_broken(&self, conn: &mut AnyConnection) -> bool {
        std::thread::panicking() || conn.is_broken()
    }
}

/// Whether the SQLite file is already in WAL mode (reading the mode takes
/// no lock; an in-memory database answers `memory`).
fn is_wal(c: &mut SqliteConnection) -> diesel::QueryResult<bool> {
    #[derive(diesel::QueryableByName)]
    struct Mode {
        #[diesel(sql_type = diesel::sql_types::Text)]
        journal_mode: String,
    }
    use diesel::RunQueryDsl;
    let mode: Mode = diesel::sql_query("PRAGMA journal_mode").get_result(c)?;
    Ok(mode.journal_mode.eq_ignore_ascii_case("wal"))
}

impl From<diesel::result::Error> for Error {
    fn from(e: diesel::result::Error) -> Self {
        if connection_lost(&e) {
            Error::ConnectionLost(Box::new(e))
        } else {
            Error::Database(Box::new(e))
        }
    }
}

/// Whether a statement failed because the connection is gone rather than
/// because of the statement: libpq reporting the connection bad, SQLSTATE
/// class 08 (connection exception), or the server ending the session
/// (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now),
/// which diesel reports as `Unknown` with the server's message; or the
/// statement could not be sent at all. A rollback
/// that could not run (`BrokenTransactionManager`) is the same loss seen
/// one step later.
fn connection_lost(e: &diesel::result::Error) -> bool {
    use diesel::result::{DatabaseErrorKind, Error as D};
    // The server's and libpq's wording of 57P01-57P03 and of a dropped socket.
    const LOST: &[&str] = &[
        "terminating connection",
        "server closed the connection unexpectedly",
        "the database system is shutting down",
        "the database system is starting up",
        "the database system is in recovery mode",
        "no connection to the server",
        "connection to server",
        "could not receive data from server",
        "could not send data to server",
        "SSL connection has been closed unexpectedly",
    ];
    match e {
        // libpq could not send the statement: the socket is gone.
        D::DatabaseError(
            DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
            _,
        ) => true,
        D::DatabaseError(DatabaseErrorKind::Unknown, info) => {
            LOST.iter().any(|m| info.message().contains(m))
        }
        D::BrokenTransactionManager => true,
        _ => false,
    }
}

impl From<r2d2::PoolError> for Error {
    fn from(e: r2d2::PoolError) -> Self {
        Error::Pool(Box::new(e))
    }
}

/// A statement kept prepared by the connection's statement cache, keyed by
/// its SQL text.
///
/// diesel prepares every `UPDATE`, and every `INSERT` with a nullable
/// column, afresh on each execution (their SQL may vary with the values),
/// which on SQLite means parsing and compiling it every time: most of a
/// commit's own cost. Keyed by the SQL text and its bind types instead of
/// the query's type, each distinct text is prepared once and reused, and
/// a statement whose text varies only gets an entry per variant.
///
/// Only through a load (`get_result`, `load`): diesel's `execute` looks at
/// the statement through a reference, whose cache check walks the inner
/// statement and never reaches this wrapper's answer. A statement that
/// returns nothing gets a `RETURNING` of its key instead.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prepared<Q>(pub(crate) Q);

/// `.prepared()` on a statement: see [`Prepared`].
pub(crate) trait KeepPrepared: Sized {
    fn prepared(self) -> Prepared<Self> {
        Prepared(self)
    }
}

impl<Q> KeepPrepared for Q {}

impl<Q> diesel::query_builder::QueryId for Prepared<Q> {
    type QueryId = ();
    // No static id: the cache key is the SQL text (see the type's doc).
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<Q: diesel::query_builder::Query> diesel::query_builder::Query for Prepared<Q> {
    type SqlType = Q::SqlType;
}

impl<Q, DB> diesel::query_builder::QueryFragment<DB> for Prepared<Q>
where
    DB: DieselBackend,
    Q: diesel::query_builder::QueryFragment<DB>,
{
    fn walk_ast<'b>(
        &'b self,
        pass: diesel::query_builder::AstPass<'_, 'b, DB>,
    ) -> diesel::QueryResult<()> {
        self.0.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &DB) -> diesel::QueryResult<bool> {
        Ok(true)
    }
}

impl<Q, Conn> diesel::RunQueryDsl<Conn> for Prepared<Q> {}

/// `WITH <name> AS (<first>) <then>`: two PostgreSQL statements in one
/// round trip. PostgreSQL runs a data-modifying `WITH` once and to its end
/// whether or not the main statement reads it, in the same transaction and
/// snapshot; `then` answers. For statements whose values do not depend on
/// each other's results.
#[derive(Debug, Clone, Copy)]
pub(crate) struct With<A, B> {
    pub(crate) name: &'static str,
    pub(crate) first: A,
    pub(crate) then: B,
}

impl<A, B> diesel::query_builder::QueryId for With<A, B> {
    type QueryId = ();
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl<A, B: diesel::query_builder::Query> diesel::query_builder::Query for With<A, B> {
    type SqlType = B::SqlType;
}

impl<A, B> diesel::query_builder::QueryFragment<diesel::pg::Pg> for With<A, B>
where
    A: diesel::query_builder::QueryFragment<diesel::pg::Pg>,
    B: diesel::query_builder::QueryFragment<diesel::pg::Pg>,
{
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, diesel::pg::Pg>,
    ) -> diesel::QueryResult<()> {
        out.push_sql("WITH ");
        out.push_identifier(self.name)?;
        out.push_sql(" AS (");
        self.first.walk_ast(out.reborrow())?;
        out.push_sql(") ");
        self.then.walk_ast(out.reborrow())
    }
}

impl<A, B, Conn> diesel::RunQueryDsl<Conn> for With<A, B> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transaction whose process stopped (SIGSTOP, a frozen VM) is ended
    /// by PostgreSQL after `idle_in_transaction_timeout`: the row it
    /// locked is free for another writer, and the stopped connection is
    /// found lost when it wakes.
    #[test]
    fn postgres_ends_a_transaction_left_idle_and_frees_its_rows() {
        let db = sessiond_testkit::postgres::test_database();
        let manager = Manager {
            backend: Backend::Postgres,
            target: db.url().to_owned(),
            busy_timeout: Duration::from_secs(1),
            idle_in_transaction_timeout: Duration::from_millis(300),
        };
        let (Ok(AnyConnection::Pg(mut stopped)), Ok(AnyConnection::Pg(mut other))) =
            (manager.connect(), manager.connect())
        else {
            panic!("two PostgreSQL connections");
        };
        other
            .batch_execute("CREATE TABLE held (id int PRIMARY KEY); INSERT INTO held VALUES (1)")
            .unwrap();
        stopped
            .batch_execute("BEGIN; UPDATE held SET id = 1 WHERE id = 1")
            .unwrap();
        // The other writer waits for the row (at most 20 s, then it
        // fails), and gets it once the server ended the idle transaction.
        other
            .batch_execute("SET lock_timeout = '20s'; UPDATE held SET id = 1 WHERE id = 1")
            .expect("the row is free once the idle transaction is ended");
        let woke = stopped.batch_execute("SELECT 1").unwrap_err();
        assert!(connection_lost(&woke), "{woke:?}");
    }
}
