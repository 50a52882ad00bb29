#![deny(missing_docs)]
//! Persistence of sessiond on PostgreSQL and SQLite, returning domain types.
//!
//! Architecture invariant: this is the only crate that knows SQL. A state
//! change and the outbox event announcing it are written in one transaction
//! ([`Store::commit`] with a [`Changeset`]).
//!
//! Decisions:
//! - One set of repository code for both backends: `AnyConnection` is a
//!   diesel `MultiConnection` over `PgConnection` and `SqliteConnection`, and
//!   the schema uses only types its `MultiBackend` supports. Only migrations,
//!   connection setup and transaction start differ per backend.
//! - Ids are canonical UUID text. Times are UTC with microsecond precision:
//!   `TIMESTAMPTZ` on Postgres, fixed-width RFC 3339 `TEXT` on SQLite, one
//!   custom SQL type (`UtcTimestamp`) maps both to `DateTime<Utc>`.
//! - Blocking: an r2d2 pool of synchronous diesel connections; every call runs
//!   in `tokio::task::spawn_blocking`.
//! - Writes: SQLite transactions start with `BEGIN IMMEDIATE` (WAL mode,
//!   `busy_timeout`, `foreign_keys=ON`) and a process's writers queue on an
//!   in-process lock first (bulk work run in `Store::yielding`, such as
//!   startup recovery's pass, lets other writers go first and leaves two
//!   pool connections free, `lanes.rs`); Postgres runs READ COMMITTED and
//!   relies on row locks taken by `UPDATE`, in a fixed order (tasks, then
//!   sessions, by id). A SQLite file's WAL is checkpointed beside the
//!   commits, not inside them (`checkpoint.rs`). On Postgres a reply's
//!   first chunk (one message and its event) is one statement in
//!   autocommit instead of a transaction of four round trips (`append.rs`).
//! - Seqs: `tasks.last_event_seq` and `task_sessions.last_event_seq` /
//!   `last_message_seq` are counters advanced inside the writing transaction
//!   (`UPDATE .. SET c = c + n`, then read back), so event `seq` (per session),
//!   `task_seq` (per task) and message `seq` are unique and gap-free.
//! - Optimistic concurrency: session and executor updates carry the version
//!   the writer read; a stale one gets [`Error::Conflict`].
//! - Lookups by a unique key end in `get_result`, never `first`: `first`
//!   adds `LIMIT ?`, and SQLite re-prepares (parses and plans anew) a
//!   statement whose `LIMIT` is a bound parameter each time it is bound, so
//!   diesel's statement cache never served those reads (a third of all
//!   statements re-prepared before this). `first` stays only where the order
//!   picks the row.
//! - Event payloads are JSON text (`serde_json`, in this crate only) beside a
//!   `kind` column holding `EventKind::as_str()`.

mod append;
mod changeset;
mod checkpoint;
mod conn;
mod error;
mod events;
mod lanes;
mod pg_listen;
mod replicas;
mod rows;
mod schema;
mod store;

pub use changeset::{Changeset, Committed, ExecutorWrite, Fence, MessageUpdate};
pub use error::{BoxError, Error, Result};
pub use events::EventWake;
pub use lanes::Yield;
pub use replicas::{Claimed, ReplicaInfo};
pub use store::{Backend, Heartbeat, Store, StoreOptions, Touched, parse_database_url};
