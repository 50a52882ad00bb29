//! [`Store`]: connect, migrate, and the repository operations.

use std::{
    collections::HashMap,
    fmt,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use diesel::{
    connection::SimpleConnection,
    prelude::*,
    r2d2::{ManageConnection, Pool},
};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use sessiond_domain::{
    AgentProfile, AgentProfileId, Event, EventPayload, ExecutorId, ExecutorRecord, ExecutorStatus,
    Message, MessageId, MessageKind, Runtime, Session, SessionId, SessionState, Task, TaskId,
    TitleSource,
};

use crate::{
    Error, Result, append,
    changeset::{self, Changeset, Committed, Fence},
    checkpoint::Checkpointer,
    conn::{self, AnyConnection, Manager, Ts, write_transaction},
    error::on_unique,
    lanes::{self, Yield},
    rows::{EventRow, ExecutorRow, MessageRow, ProfileRow, SessionRow, TaskRow},
    schema::{
        agent_profiles, executors_running, session_events, session_messages, task_sessions, tasks,
    },
};

const POSTGRES_MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");
const SQLITE_MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

/// Serializes migrations of several processes on one Postgres database.
const MIGRATION_LOCK_KEY: i64 = 0x5e55_10d0;

/// One executor its owner saw alive (a liveness check's answer), for
/// [`Store::touch_executors`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    /// The executor whose agentctl answered.
    pub executor: ExecutorId,
    /// The generation the check talked to.
    pub generation: i64,
    /// The lease the writer holds on the executor's session; `None` with
    /// an exclusive store (one process, no one to fence).
    pub fence: Option<Fence>,
}

/// What [`Store::touch_executors`] wrote.
#[derive(Debug, Default)]
pub struct Touched {
    /// Rows whose `last_seen_at` was written.
    pub touched: usize,
    /// Heartbeats refused because the executor's lease is no longer the
    /// fence's: each fence with the [`Error::LeaseLost`] naming the lease now.
    pub lost: Vec<(Fence, Error)>,
}

/// Which database a [`Store`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// PostgreSQL (`postgres://`).
    Postgres,
    /// SQLite (a file path, `sqlite://` or `file:` URL).
    Sqlite,
}

/// How to open a [`Store`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StoreOptions {
    /// Pool size (1 for an in-memory SQLite database, whatever is set here).
    pub max_connections: u32,
    /// How long to wait for a connection, at connect and from the pool.
    pub connect_timeout: Duration,
    /// SQLite: how long a writer waits for the write lock before failing.
    pub busy_timeout: Duration,
    /// Apply pending migrations at connect.
    pub migrate: bool,
    /// PostgreSQL: how long the server keeps a transaction of this store
    /// open while it waits for the next statement, then ends the
    /// connection (`idle_in_transaction_session_timeout`). The store's
    /// transactions go from statement to statement without waiting, so
    /// only a stopped process (SIGSTOP, a frozen VM, a half-open
    /// connection) reaches it: its row locks, the task's event counter
    /// among them, would otherwise hold every other writer of that task,
    /// on every replica, for as long as the stop lasts.
    pub idle_in_transaction_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_connections: 8,
            connect_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(10),
            migrate: true,
            idle_in_transaction_timeout: Duration::from_secs(5),
        }
    }
}

impl StoreOptions {
    /// Largest number of pooled connections (at least 1).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a connection may take to open.
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// SQLite: how long a statement waits for another process's write lock.
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    /// Whether `connect` applies pending migrations (default yes).
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// PostgreSQL: see [`StoreOptions::idle_in_transaction_timeout`]
    /// (default 5 s; at least 1 ms).
    pub fn idle_in_transaction_timeout(mut self, d: Duration) -> Self {
        self.idle_in_transaction_timeout = d.max(Duration::from_millis(1));
        self
    }
}

/// The persistence of sessiond. Cheap to clone; all clones share one pool.
///
/// Every method runs its queries on a pooled connection inside
/// `tokio::task::spawn_blocking`, so async callers never block the runtime
/// (and must call from within a tokio runtime).
#[derive(Clone)]
pub struct Store {
    pool: Pool<Manager>,
    backend: Backend,
    /// SQLite: this process's writers take turns here (see `write`).
    writer: Arc<lanes::Turns>,
    /// The pool connections yielding work may hold (`lanes.rs`).
    slots: Arc<lanes::Slots>,
    /// The pool's checkout timeout (also bounds the wait for a slot).
    checkout_timeout: Duration,
    /// PostgreSQL with other replicas: this replica's id, sent with the
    /// `NOTIFY` of each committed event (`events.rs`); unset, none is sent.
    origin: Arc<std::sync::OnceLock<String>>,
    /// What the pool connects to (the event listener opens its own connection).
    pub(crate) target: Arc<str>,
    /// Whether the database is known to be unreachable right now.
    health: Arc<Health>,
    /// Which task each session belongs to, as commits read it.
    tasks: Arc<changeset::SessionTasks>,
    /// A SQLite file's WAL checkpoints, run beside the commits.
    checkpointer: Option<Arc<Checkpointer>>,
}

/// While the database is known down, a checkout waits at most this long
/// instead of the whole connect timeout: long enough for a connection the
/// pool is opening as the database comes back, short enough that a caller
/// hears UNAVAILABLE at once instead of after the timeout, every time.
const DOWN_CHECKOUT: Duration = Duration::from_secs(1);

/// The database is *down* from a failed connection attempt or a connection
/// lost mid-call until a connection opens or a statement succeeds again.
#[derive(Debug, Default)]
struct Health {
    down: std::sync::atomic::AtomicBool,
}

impl Health {
    fn is_down(&self) -> bool {
        self.down.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_down(&self, down: bool) {
        self.down.store(down, std::sync::atomic::Ordering::Relaxed);
    }

    /// Learns from a call's outcome on `conn`; a lost connection is
    /// discarded, not returned to the pool.
    fn observe<T>(&self, result: &Result<T>, conn: &mut AnyConnection) {
        match result {
            Ok(_) => self.set_down(false),
            Err(Error::ConnectionLost(_)) => {
                self.set_down(true);
                conn::discard(conn);
            }
            Err(_) => {}
        }
    }

    /// A pooled connection: within `timeout`, or [`DOWN_CHECKOUT`] while the
    /// database is known down.
    fn checkout(
        &self,
        pool: &Pool<Manager>,
        timeout: Duration,
    ) -> Result<diesel::r2d2::PooledConnection<Manager>> {
        let wait = if self.is_down() {
            timeout.min(DOWN_CHECKOUT)
        } else {
            timeout
        };
        Ok(pool.get_timeout(wait)?)
    }
}

/// The pool's connection attempts tell [`Health`] how the database is.
#[derive(Debug)]
struct HealthHooks(Arc<Health>);

impl diesel::r2d2::HandleError<diesel::r2d2::Error> for HealthHooks {
    fn handle_error(&self, error: diesel::r2d2::Error) {
        self.0.set_down(true);
        tracing::warn!(%error, "cannot connect to the database");
    }
}

impl diesel::r2d2::CustomizeConnection<AnyConnection, diesel::r2d2::Error> for HealthHooks {
    fn on_acquire(&self, _conn: &mut AnyConnection) -> Result<(), diesel::r2d2::Error> {
        self.0.set_down(false);
        Ok(())
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend)
            .field("pool", &self.pool.state())
            .finish()
    }
}

/// Splits a database URL into backend and what its driver is given.
///
/// `postgres://..` and `postgresql://..` are Postgres. `sqlite://PATH`,
/// `sqlite:PATH`, a `file:` URI or a plain path are SQLite; `:memory:` and
/// `sqlite::memory:` are a private in-memory SQLite database.
pub fn parse_database_url(url: &str) -> Result<(Backend, String)> {
    let url = url.trim();
    if url.is_empty() {
        return Err(Error::Invalid("empty database URL".into()));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok((Backend::Postgres, url.to_owned()));
    }
    let target = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    if target.is_empty() {
        return Err(Error::Invalid(format!("no SQLite path in {url:?}")));
    }
    if target.contains("://") {
        return Err(Error::Invalid(format!(
            "unsupported database URL {url:?}: expected postgres://.., sqlite://PATH or a file path"
        )));
    }
    Ok((Backend::Sqlite, target.to_owned()))
}

fn is_memory(target: &str) -> bool {
    target == ":memory:" || target.contains("mode=memory")
}

/// One PostgreSQL connection alone, before the pool: the server's own
/// answer (a wrong password, a database that does not exist, nothing
/// listening) comes at once, instead of after the pool's `timeout` and a
/// warning for each of its attempts (helper-50 4). An attempt still
/// running after `timeout` (a host that drops packets) is left to the
/// pool, which times out as before.
fn first_connection(manager: &Manager, timeout: Duration) -> Result<()> {
    let alone = manager.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("sessiond-db-first".into())
        .spawn(move || {
            let _ = tx.send(alone.connect().map(drop));
        })
        .map_err(|e| Error::Blocking(format!("cannot start a thread to connect: {e}")))?;
    match rx.recv_timeout(timeout) {
        Ok(Err(e)) => Err(Error::Pool(Box::new(e))),
        Ok(Ok(())) | Err(_) => Ok(()),
    }
}

impl Store {
    /// Opens a pool on `url` (see [`parse_database_url`]) and, unless
    /// `opts.migrate` is false, applies pending migrations. A SQLite file and
    /// its parent directory are created when missing.
    pub async fn connect(url: &str, opts: StoreOptions) -> Result<Store> {
        let (backend, target) = parse_database_url(url)?;
        blocking(move || {
            let mut max = opts.max_connections.max(1);
            if backend == Backend::Sqlite {
                if is_memory(&target) {
                    max = 1;
                } else if let Some(parent) = Path::new(&target)
                    .parent()
                    .filter(|p| !target.starts_with("file:") && !p.as_os_str().is_empty())
                {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        Error::Invalid(format!(
                            "cannot create directory {} for the database: {e}",
                            parent.display()
                        ))
                    })?;
                }
            }
            let manager = Manager {
                backend,
                target: target.clone(),
                busy_timeout: opts.busy_timeout,
                idle_in_transaction_timeout: opts.idle_in_transaction_timeout,
            };
            // A file-backed SQLite keeps a few connections open: opening
            // one (WAL, pragmas) while a call waits for it cost a call
            // arriving during startup recovery's load tens of ms. Cheap
            // for a local file; a server's connections stay on demand.
            let idle = if backend == Backend::Sqlite && !is_memory(&target) {
                max.min(4)
            } else {
                1
            };
            match backend {
                // One connection alone first switches a new file to WAL, so
                // the pool's connections, opened at once, only read the mode.
                Backend::Sqlite => drop(manager.connect().map_err(|e| Error::Pool(Box::new(e)))?),
                Backend::Postgres => first_connection(&manager, opts.connect_timeout)?,
            }
            let checkpointer = if backend == Backend::Sqlite && !is_memory(&target) {
                let started = Checkpointer::start(&target).map_err(|e| {
                    Error::Blocking(format!("cannot start the SQLite checkpoint thread: {e}"))
                })?;
                Some(Arc::new(started))
            } else {
                None
            };
            let health = Arc::new(Health::default());
            let pool = Pool::builder()
                .error_handler(Box::new(HealthHooks(health.clone())))
                .connection_customizer(Box::new(HealthHooks(health.clone())))
                .max_size(max)
                .min_idle(Some(idle))
                // No `SELECT 1` before every checkout: it doubled the cost
                // of each store call (a network round trip on Postgres). A
                // connection that broke is still dropped on return
                // (`has_broken`), and the next call gets a fresh one.
                .test_on_check_out(false)
                .connection_timeout(opts.connect_timeout)
                .build(manager)
                .map_err(|e| Error::Pool(Box::new(e)))?;
            let store = Store {
                pool,
                backend,
                writer: Arc::default(),
                slots: Arc::new(lanes::Slots::new(max)),
                checkout_timeout: opts.connect_timeout,
                origin: Arc::default(),
                target: target.into(),
                health,
                tasks: Arc::default(),
                checkpointer,
            };
            if opts.migrate {
                let mut conn = store.pool.get()?;
                run_pending(&mut conn)?;
            }
            Ok(store)
        })
        .await
    }

    /// Which database this store talks to.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// PostgreSQL: announce every event this store commits with a `NOTIFY`
    /// naming `replica` (see [`Store::listen_events`]). Set once; later
    /// calls are ignored. SQLite has no other replica to tell.
    pub fn announce_events_as(&self, replica: &str) {
        if self.backend == Backend::Postgres {
            let _ = self.origin.set(replica.to_owned());
        }
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<()> {
        self.read(|c| {
            c.batch_execute("SELECT 1")?;
            Ok(())
        })
        .await
    }

    /// Applies pending migrations; returns their versions.
    pub async fn run_pending_migrations(&self) -> Result<Vec<String>> {
        self.read(run_pending).await
    }

    /// Reverts every applied migration (for tests of the down migrations);
    /// returns their versions, newest first.
    pub async fn revert_all_migrations(&self) -> Result<Vec<String>> {
        self.read(|c| {
            let reverted = match c {
                AnyConnection::Pg(c) => c.revert_all_migrations(POSTGRES_MIGRATIONS),
                AnyConnection::Sqlite(c) => c.revert_all_migrations(SQLITE_MIGRATIONS),
            }
            .map_err(Error::Migration)?;
            Ok(reverted.iter().map(ToString::to_string).collect())
        })
        .await
    }

    // ------------------------------------------------------------ tasks

    /// Stores a new task; returns it as stored (times at microseconds).
    pub async fn create_task(&self, task: &Task) -> Result<Task> {
        let row = TaskRow::from_domain(task);
        self.write(move |c| {
            let id = row.id.clone();
            diesel::insert_into(tasks::table)
                .values(&row)
                .execute(c)
                .map_err(|e| on_unique(e, "task", |_| id))?;
            row.into_domain()
        })
        .await
    }

    /// The task `id`, or [`Error::NotFound`].
    pub async fn get_task(&self, id: TaskId) -> Result<Task> {
        self.read(move |c| {
            tasks::table
                .find(id.to_string())
                .select(TaskRow::as_select())
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("task", id))?
                .into_domain()
        })
        .await
    }

    /// Tasks in id order (ids are time-ordered), after `after`, at most `limit`.
    pub async fn list_tasks(&self, after: Option<TaskId>, limit: u32) -> Result<Vec<Task>> {
        self.read(move |c| {
            let mut q = tasks::table
                .select(TaskRow::as_select())
                .order(tasks::id)
                .limit(i64::from(limit))
                .into_boxed();
            if let Some(after) = after {
                q = q.filter(tasks::id.gt(after.to_string()));
            }
            q.load(c)?.into_iter().map(TaskRow::into_domain).collect()
        })
        .await
    }

    // ------------------------------------------------------------ profiles

    /// Creates the profile, or updates the one with the same name (keeping
    /// its id and `created_at`). Returns the stored profile.
    ///
    /// Two concurrent upserts of a new name both succeed with one id: the
    /// loser of the insert race (a unique violation on Postgres) retries as
    /// an update.
    pub async fn upsert_agent_profile(&self, profile: &AgentProfile) -> Result<AgentProfile> {
        let row = ProfileRow::from_domain(profile);
        let mut attempt = 0;
        loop {
            let row = row.clone();
            let result = self.write(move |c| upsert_profile(c, &row)).await;
            match result {
                Err(Error::AlreadyExists { .. }) if attempt == 0 => attempt += 1,
                other => return other,
            }
        }
    }

    /// The agent profile `id`, or [`Error::NotFound`].
    pub async fn get_agent_profile(&self, id: AgentProfileId) -> Result<AgentProfile> {
        self.read(move |c| {
            let key = id.to_string();
            load_profile(c, false, &key)
        })
        .await
    }

    /// The agent profile named `name`, or [`Error::NotFound`].
    pub async fn get_agent_profile_by_name(&self, name: &str) -> Result<AgentProfile> {
        let name = name.to_owned();
        self.read(move |c| load_profile(c, true, &name)).await
    }

    /// All profiles, by name.
    pub async fn list_agent_profiles(&self) -> Result<Vec<AgentProfile>> {
        self.read(|c| {
            agent_profiles::table
                .select(ProfileRow::as_select())
                .order(agent_profiles::name)
                .load(c)?
                .into_iter()
                .map(ProfileRow::into_domain)
                .collect()
        })
        .await
    }

    // ------------------------------------------------------------ sessions

    /// Stores a new session (at version 1) and its first events in one
    /// transaction. Returns the stored session and the events with seqs.
    pub async fn create_session(
        &self,
        session: &Session,
        events: Vec<EventPayload>,
    ) -> Result<(Session, Vec<Event>)> {
        let mut change = Changeset::new();
        for payload in events {
            change = change.event(session.id, payload);
        }
        let (stored, committed) = self.insert_session_then(session, change).await?;
        Ok((stored, committed.events))
    }

    /// Inserts a new session and applies `then` in the same transaction, so
    /// a session never exists without what its creation wrote next (its
    /// executor intent): a crash leaves both or neither. `then` may update
    /// the new session (its version is 1).
    pub async fn create_session_with(
        &self,
        session: &Session,
        then: Changeset,
    ) -> Result<Committed> {
        Ok(self.insert_session_then(session, then).await?.1)
    }

    /// The session as inserted (version 1), and what `then` wrote after it.
    async fn insert_session_then(
        &self,
        session: &Session,
        then: Changeset,
    ) -> Result<(Session, Committed)> {
        let mut row = SessionRow::from_domain(session);
        row.version = 1;
        let (sid, task, profile) = (session.id, session.task_id, session.agent_profile_id);
        let origin = self.origin.clone();
        let tasks = self.tasks.clone();
        self.write(move |c| {
            check_session_parents(c, task, profile)?;
            diesel::insert_into(task_sessions::table)
                .values(&row)
                .execute(c)
                .map_err(|e| on_unique(e, "session", |_| sid.to_string()))?;
            let committed = changeset::apply(c, then, &tasks)?;
            crate::events::notify(c, origin.get().map(String::as_str), &committed.events)?;
            Ok((row.into_domain()?, committed))
        })
        .await
    }

    /// The session `id`, or [`Error::NotFound`].
    pub async fn get_session(&self, id: SessionId) -> Result<Session> {
        self.read(move |c| load_session(c, id)).await
    }

    /// What a session's status is derived from, in one round trip to the
    /// pool: the session, its profile's `supports_session_resume` claim, and
    /// its executor record if it has one.
    pub async fn session_status_inputs(
        &self,
        id: SessionId,
    ) -> Result<(Session, bool, Option<ExecutorRecord>)> {
        self.read(move |c| {
            let key = id.to_string();
            let session = task_sessions::table
                .find(&key)
                .filter(task_sessions::deleted_at.is_null())
                .select(SessionRow::as_select())
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("session", id))?
                .into_domain()?;
            let profile = session.agent_profile_id;
            let claim: bool = agent_profiles::table
                .find(profile.to_string())
                .select(agent_profiles::supports_session_resume)
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("agent profile", profile))?;
            let record = executors_running::table
                .filter(executors_running::session_id.eq(&key))
                .select(ExecutorRow::as_select())
                .get_result(c)
                .optional()?
                .map(ExecutorRow::into_domain)
                .transpose()?;
            Ok((session, claim, record))
        })
        .await
    }

    /// [`Store::session_status_inputs`] of every session whose executor
    /// record is not `stopped` (the sessions a backend manages; ended ones
    /// keep a stopped record as history and are left out), in one blocking
    /// call: the records, then their sessions by id in chunks, then the
    /// profiles' claims. Not one snapshot: a caller that needs the result
    /// current must account for commits made meanwhile.
    pub async fn managed_session_status_inputs(
        &self,
    ) -> Result<Vec<(Session, bool, Option<ExecutorRecord>)>> {
        self.read(|c| {
            let live = [
                ExecutorStatus::Starting,
                ExecutorStatus::Ready,
                ExecutorStatus::Error,
            ];
            let records = load_executors(c, Some(&live))?;
            let claims: HashMap<String, bool> = agent_profiles::table
                .select((agent_profiles::id, agent_profiles::supports_session_resume))
                .load(c)?
                .into_iter()
                .collect();
            let mut by_session: HashMap<String, ExecutorRecord> = records
                .into_iter()
                .map(|r| (r.session_id.to_string(), r))
                .collect();
            let keys: Vec<String> = by_session.keys().cloned().collect();
            let mut out = Vec::with_capacity(keys.len());
            // Well under SQLite's and Postgres' bind-parameter limits.
            for chunk in keys.chunks(500) {
                let rows: Vec<SessionRow> = task_sessions::table
                    .filter(task_sessions::id.eq_any(chunk))
                    .select(SessionRow::as_select())
                    .load(c)?;
                for row in rows {
                    let session = row.into_domain()?;
                    let profile = session.agent_profile_id;
                    let claim = *claims
                        .get(&profile.to_string())
                        .ok_or_else(|| Error::not_found("agent profile", profile))?;
                    let record = by_session.remove(&session.id.to_string());
                    out.push((session, claim, record));
                }
            }
            Ok(out)
        })
        .await
    }

    /// Names a session, unless a stronger source named it already (see
    /// [`TitleSource`]; a [`TitleSource::User`] title always is written, and
    /// an empty one hands naming back to the prompt and the agent). Returns
    /// the session as stored, and whether the title was written.
    /// [`Error::NotFound`] when it does not exist or is deleted.
    pub async fn set_session_title(
        &self,
        id: SessionId,
        title: String,
        source: TitleSource,
    ) -> Result<(Session, bool)> {
        self.write(move |c| {
            let written = crate::changeset::write_title(c, id, &title, source)? > 0;
            let session = task_sessions::table
                .find(id.to_string())
                .filter(task_sessions::deleted_at.is_null())
                .select(SessionRow::as_select())
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("session", id))?
                .into_domain()?;
            Ok((session, written))
        })
        .await
    }

    /// Marks a session deleted: from then on every read of it answers
    /// [`Error::NotFound`] and it leaves [`Store::list_sessions`]; its row,
    /// messages and events stay as history. The version is bumped, so a
    /// writer still holding the session fails with [`Error::Conflict`].
    /// [`Error::NotFound`] when it does not exist or is deleted already.
    pub async fn mark_session_deleted(&self, id: SessionId) -> Result<()> {
        self.write(move |c| {
            let n = diesel::update(
                task_sessions::table
                    .find(id.to_string())
                    .filter(task_sessions::deleted_at.is_null()),
            )
            .set((
                task_sessions::deleted_at.eq(Some(Ts::new(conn::now()))),
                task_sessions::version.eq(task_sessions::version + 1),
            ))
            .execute(c)?;
            if n == 0 {
                return Err(Error::not_found("session", id));
            }
            Ok(())
        })
        .await
    }

    /// The sessions of a task, oldest first.
    pub async fn list_sessions(&self, task: TaskId) -> Result<Vec<Session>> {
        self.read(move |c| {
            task_sessions::table
                .filter(task_sessions::task_id.eq(task.to_string()))
                .filter(task_sessions::deleted_at.is_null())
                .select(SessionRow::as_select())
                .order((task_sessions::created_at, task_sessions::id))
                .load(c)?
                .into_iter()
                .map(SessionRow::into_domain)
                .collect()
        })
        .await
    }

    /// The sessions (not deleted) working in directory `path` or below it:
    /// a worktree is not removed from under another session. Read rarely
    /// (a delete), so a scan of the sessions is fine.
    pub async fn list_sessions_in_directory(&self, path: String) -> Result<Vec<Session>> {
        self.read(move |c| {
            let below = format!(
                "{}/%",
                path.trim_end_matches('/')
                    .replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_")
            );
            task_sessions::table
                .filter(task_sessions::deleted_at.is_null())
                .filter(
                    task_sessions::worktree_path
                        .eq(path.clone())
                        .or(task_sessions::worktree_path.like(below).escape('\\')),
                )
                .select(SessionRow::as_select())
                .order((task_sessions::created_at, task_sessions::id))
                .load(c)?
                .into_iter()
                .map(SessionRow::into_domain)
                // Exactly: SQLite's LIKE ignores ASCII case.
                .filter(|s: &Result<Session>| {
                    s.as_ref().map_or(true, |s| {
                        Path::new(&s.worktree.path).starts_with(Path::new(&path))
                    })
                })
                .collect()
        })
        .await
    }

    /// The ids of the sessions in `state` (not deleted). Startup recovery
    /// asks for STARTING ones: a resume cut off after its intent left them
    /// so, whatever their executor's status.
    pub async fn list_session_ids_in_state(&self, state: SessionState) -> Result<Vec<SessionId>> {
        self.read(move |c| {
            let ids: Vec<String> = task_sessions::table
                .filter(task_sessions::state.eq(state.as_str()))
                .filter(task_sessions::deleted_at.is_null())
                .select(task_sessions::id)
                .load(c)?;
            ids.iter()
                .map(|s| SessionId::parse(s).map_err(|e| Error::corrupt("session", s, e)))
                .collect()
        })
        .await
    }

    /// The sessions in `state` whose metadata holds `key`, oldest first
    /// (startup recovery's look for turns left pending in ERROR sessions,
    /// without reading every session of a large store).
    pub async fn list_sessions_with_metadata_key(
        &self,
        state: SessionState,
        key: String,
    ) -> Result<Vec<Session>> {
        self.read(move |c| {
            // Metadata is a JSON object: the key appears as `"key":`. A
            // match on a value that looks the same is dropped below.
            let pattern = format!(
                "%{}:%",
                serde_json::Value::String(key.clone())
                    .to_string()
                    .replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_")
            );
            let rows = task_sessions::table
                .filter(task_sessions::state.eq(state.as_str()))
                .filter(task_sessions::deleted_at.is_null())
                .filter(task_sessions::metadata.like(pattern).escape('\\'))
                .select(SessionRow::as_select())
                .order((task_sessions::created_at, task_sessions::id))
                .load(c)?;
            let mut out = Vec::with_capacity(rows.len());
            for row in rows {
                let session = row.into_domain()?;
                if session.metadata.contains_key(&key) {
                    out.push(session);
                }
            }
            Ok(out)
        })
        .await
    }

    /// How many sessions are in each state (states with none are absent);
    /// deleted sessions are not counted.
    pub async fn count_sessions_by_state(&self) -> Result<Vec<(SessionState, i64)>> {
        self.read(|c| {
            let rows: Vec<(String, i64)> = task_sessions::table
                .filter(task_sessions::deleted_at.is_null())
                .group_by(task_sessions::state)
                .select((task_sessions::state, diesel::dsl::count_star()))
                .load(c)?;
            rows.into_iter()
                .map(|(state, n)| {
                    SessionState::parse(&state)
                        .map(|s| (s, n))
                        .map_err(|e| Error::Corrupt {
                            entity: "session",
                            id: format!("state {state}"),
                            reason: e.to_string(),
                        })
                })
                .collect()
        })
        .await
    }

    // ------------------------------------------------------------ executors

    /// How many executors of each runtime are in each status (pairs with
    /// none are absent); the metrics' `sessiond_executors` gauge.
    pub async fn count_executors_by_runtime_and_status(
        &self,
    ) -> Result<Vec<(Runtime, ExecutorStatus, i64)>> {
        self.read(|c| {
            let rows: Vec<(String, String, i64)> = executors_running::table
                .group_by((executors_running::runtime, executors_running::status))
                .select((
                    executors_running::runtime,
                    executors_running::status,
                    diesel::dsl::count_star(),
                ))
                .load(c)?;
            rows.into_iter()
                .map(|(runtime, status, n)| {
                    let corrupt = |e: String| Error::Corrupt {
                        entity: "executor",
                        id: format!("runtime {runtime} status {status}"),
                        reason: e,
                    };
                    let r = Runtime::parse(&runtime).map_err(|e| corrupt(e.to_string()))?;
                    let s = ExecutorStatus::parse(&status).map_err(|e| corrupt(e.to_string()))?;
                    Ok((r, s, n))
                })
                .collect()
        })
        .await
    }

    /// The executor record `id`, or [`Error::NotFound`].
    pub async fn get_executor(&self, id: ExecutorId) -> Result<ExecutorRecord> {
        self.read(move |c| changeset::load_executor(c, id)).await
    }

    /// An executor record and its session, on one pooled connection in one
    /// blocking call (recovery re-reads both under the session lock).
    pub async fn get_executor_and_session(
        &self,
        id: ExecutorId,
    ) -> Result<(ExecutorRecord, Session)> {
        self.read(move |c| {
            let record = changeset::load_executor(c, id)?;
            let session = load_session(c, record.session_id)?;
            Ok((record, session))
        })
        .await
    }

    /// [`Self::get_executor_and_session`] of several executors in one
    /// blocking call and two statements: each id's answer, in the order
    /// asked (the recovery pass's re-reads, grouped).
    pub async fn get_executors_and_sessions(
        &self,
        ids: Vec<ExecutorId>,
    ) -> Result<Vec<Result<(ExecutorRecord, Session)>>> {
        use crate::conn::{KeepPrepared, native};
        self.read(move |c| {
            let wanted: Vec<String> = ids.iter().map(ExecutorId::to_string).collect();
            let asked = few_lengths(wanted.clone());
            let rows: Vec<ExecutorRow> = native!(c, |c| executors_running::table
                .filter(executors_running::id.eq_any(&asked))
                .select(ExecutorRow::as_select())
                .prepared()
                .load(c))?;
            let records: HashMap<String, Result<ExecutorRecord>> = rows
                .into_iter()
                .map(|row| (row.id.clone(), row.into_domain()))
                .collect();
            let session_ids: Vec<String> = few_lengths(
                records
                    .values()
                    .filter_map(|r| r.as_ref().ok().map(|r| r.session_id.to_string()))
                    .collect(),
            );
            let rows: Vec<SessionRow> = native!(c, |c| task_sessions::table
                .filter(task_sessions::id.eq_any(&session_ids))
                .filter(task_sessions::deleted_at.is_null())
                .select(SessionRow::as_select())
                .prepared()
                .load(c))?;
            let sessions: HashMap<String, Result<Session>> = rows
                .into_iter()
                .map(|row| (row.id.clone(), row.into_domain()))
                .collect();
            // A row that does not convert fails only its own id's answer.
            let reason = |e: &Error| match e {
                Error::Corrupt { reason, .. } => reason.clone(),
                other => other.to_string(),
            };
            Ok(ids
                .into_iter()
                .zip(&wanted)
                .map(|(id, key)| {
                    let record = match records.get(key) {
                        None => return Err(Error::not_found("executor", id)),
                        Some(Err(e)) => return Err(Error::corrupt("executor", id, reason(e))),
                        Some(Ok(r)) => r.clone(),
                    };
                    let sid = record.session_id;
                    match sessions.get(&sid.to_string()) {
                        None => Err(Error::not_found("session", sid)),
                        Some(Err(e)) => Err(Error::corrupt("session", sid, reason(e))),
                        Some(Ok(s)) => Ok((record, s.clone())),
                    }
                })
                .collect())
        })
        .await
    }

    /// The executor record of a session, if it has one.
    pub async fn get_executor_for_session(
        &self,
        session: SessionId,
    ) -> Result<Option<ExecutorRecord>> {
        self.read(move |c| {
            executors_running::table
                .filter(executors_running::session_id.eq(session.to_string()))
                .select(ExecutorRow::as_select())
                .get_result(c)
                .optional()?
                .map(ExecutorRow::into_domain)
                .transpose()
        })
        .await
    }

    /// All executor records, oldest first.
    pub async fn list_executors(&self) -> Result<Vec<ExecutorRecord>> {
        self.read(|c| load_executors(c, None)).await
    }

    /// The executors whose status is one of `statuses`, oldest first
    /// (startup recovery's look at failed ones: without reading every
    /// executor of a large store).
    pub async fn list_executors_with_status(
        &self,
        statuses: Vec<ExecutorStatus>,
    ) -> Result<Vec<ExecutorRecord>> {
        self.read(move |c| load_executors(c, Some(&statuses))).await
    }

    /// The executors startup recovery must look at: status `starting` or
    /// `ready`, oldest first.
    pub async fn load_recoverable_executors(&self) -> Result<Vec<ExecutorRecord>> {
        self.read(|c| load_executors(c, Some(ExecutorStatus::RECOVERABLE)))
            .await
    }

    /// A page of [`Self::load_recoverable_executors`]: at most `limit`
    /// recoverable executors created no later than `until`, in the same
    /// order, after `after` (the `created_at` and id of the previous page's
    /// last one). Startup recovery reads a large store page by page, so a
    /// call that arrives meanwhile goes ahead between two pages.
    pub async fn load_recoverable_executors_page(
        &self,
        until: chrono::DateTime<chrono::Utc>,
        after: Option<(chrono::DateTime<chrono::Utc>, ExecutorId)>,
        limit: u32,
    ) -> Result<Vec<ExecutorRecord>> {
        self.read(move |c| {
            let mut q = executors_running::table
                .select(ExecutorRow::as_select())
                .filter(
                    executors_running::status
                        .eq_any(ExecutorStatus::RECOVERABLE.iter().map(|s| s.as_str())),
                )
                .filter(executors_running::created_at.le(Ts::new(until)))
                .order((executors_running::created_at, executors_running::id))
                .limit(i64::from(limit))
                .into_boxed();
            if let Some((at, id)) = after {
                q = q.filter(
                    executors_running::created_at
                        .gt(Ts::new(at))
                        .or(executors_running::created_at
                            .eq(Ts::new(at))
                            .and(executors_running::id.gt(id.to_string()))),
                );
            }
            q.load(c)?
                .into_iter()
                .map(ExecutorRow::into_domain)
                .collect()
        })
        .await
    }

    /// Records that agentctl answered: `last_seen_at = at` for each
    /// heartbeat's executor still `ready` at its generation and, when the
    /// heartbeat carries a [`Fence`], still leased to that owner at that
    /// epoch; all in one transaction. A heartbeat, not a state change: no
    /// version bump and no event (a writer holding an older copy may write
    /// its older `last_seen_at` back, which only makes the executor look
    /// seen earlier). A heartbeat whose lease moved (a replica resumed after
    /// a pause, another one adopted the executor) touches nothing and comes
    /// back in [`Touched::lost`], so the caller drops the session as after
    /// any fenced write.
    pub async fn touch_executors(
        &self,
        seen: Vec<Heartbeat>,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Touched> {
        if seen.is_empty() {
            return Ok(Touched::default());
        }
        // In id order, the lock order of every multi-row writer (see
        // `replicas.rs`): in the order the checks finished, this deadlocked
        // with a heartbeat locking the same rows.
        let mut seen = seen;
        seen.sort_by_key(|h| h.executor.to_string());
        self.write(move |c| {
            let at = Ts::new(at);
            let mut out = Touched::default();
            for h in seen {
                let row = executors_running::table
                    .find(h.executor.to_string())
                    .filter(executors_running::generation.eq(h.generation))
                    .filter(executors_running::status.eq(ExecutorStatus::Ready.as_str()));
                let Some(fence) = h.fence else {
                    out.touched += diesel::update(row)
                        .set(executors_running::last_seen_at.eq(Some(at)))
                        .execute(c)?;
                    continue;
                };
                let n = diesel::update(
                    row.filter(executors_running::owner_id.eq(&fence.owner))
                        .filter(executors_running::lease_epoch.eq(fence.epoch)),
                )
                .set(executors_running::last_seen_at.eq(Some(at)))
                .execute(c)?;
                out.touched += n;
                if n > 0 {
                    continue;
                }
                // Not touched: the lease moved, or only the executor did
                // (a relaunch, a stop): the lease says which.
                let current: Option<(Option<String>, i64)> = executors_running::table
                    .find(h.executor.to_string())
                    .select((executors_running::owner_id, executors_running::lease_epoch))
                    .get_result(c)
                    .optional()?;
                if let Some((owner, epoch)) = current
                    && (owner.as_deref() != Some(fence.owner.as_str()) || epoch != fence.epoch)
                {
                    let error = Error::LeaseLost {
                        session_id: fence.session.to_string(),
                        owner: fence.owner.clone(),
                        epoch: fence.epoch,
                        current_owner: owner.unwrap_or_else(|| "-".to_owned()),
                        current_epoch: epoch,
                    };
                    out.lost.push((fence, error));
                }
            }
            Ok(out)
        })
        .await
    }

    /// Whether `fence`'s lease is still the writer's ([`Error::LeaseLost`]
    /// if not): for an action outside the database that only the owner may
    /// take (removing an executor), checked just before it.
    pub async fn check_lease(&self, fence: Fence) -> Result<()> {
        self.write(move |c| changeset::check_fence(c, &fence, None))
            .await
    }

    /// Deletes an executor record; false when there was none. With a
    /// [`Fence`], only while the lease is still the writer's (else
    /// [`Error::LeaseLost`], nothing deleted), checked in the same
    /// transaction.
    pub async fn delete_executor(&self, id: ExecutorId, fence: Option<Fence>) -> Result<bool> {
        self.write(move |c| {
            if let Some(f) = &fence {
                let exists: i64 = executors_running::table
                    .find(id.to_string())
                    .count()
                    .get_result(c)?;
                if exists == 0 {
                    return Ok(false);
                }
                changeset::check_fence(c, f, None)?;
            }
            let n = diesel::delete(executors_running::table.find(id.to_string())).execute(c)?;
            Ok(n > 0)
        })
        .await
    }

    // ------------------------------------------------------------ the write path

    /// Writes a [`Changeset`] in one transaction: all of it, or nothing.
    pub async fn commit(&self, change: Changeset) -> Result<Committed> {
        if change.is_empty() {
            return Ok(Committed::default());
        }
        let origin = self.origin.clone();
        let tasks = self.tasks.clone();
        // A reply's first chunk, on PostgreSQL: one statement, no
        // transaction around it (`append.rs`).
        if self.backend == Backend::Postgres && append::alone(&change) {
            return self
                .write_as(Transaction::Statement, move |c| {
                    let notify = origin.get().map(|o| (crate::events::CHANNEL, o.as_str()));
                    append::append_alone(c, change, &tasks, notify)
                })
                .await;
        }
        self.write(move |c| {
            let done = changeset::apply(c, change, &tasks)?;
            crate::events::notify(c, origin.get().map(String::as_str), &done.events)?;
            Ok(done)
        })
        .await
    }

    /// Writes many independent [`Changeset`]s in one transaction: one
    /// commit (one WAL sync, one round of lock traffic) for the lot. One
    /// that fails (a stale version, a missing row) is rolled back alone and
    /// reported in its slot while the others are written (the lot is tried
    /// under one savepoint, then, after a failure, each changeset under its
    /// own). When the transaction itself fails (no connection, its begin or
    /// commit refused: nothing of it is written), each changeset is written
    /// on its own, as [`Store::commit`] would, and reported in its slot.
    /// Events get their seqs as with [`Store::commit`].
    pub async fn commit_batch(&self, changes: Vec<Changeset>) -> Result<Vec<Result<Committed>>> {
        if changes.is_empty() {
            return Ok(Vec::new());
        }
        let origin = self.origin.clone();
        let tasks = self.tasks.clone();
        // The lot comes back here however the write ends (even unrun), so
        // a failed transaction's changesets are written one by one below
        // without a copy of each kept beside the batch.
        let returned = Arc::new(std::sync::Mutex::new(None));
        let lot = Returned {
            changes,
            to: returned.clone(),
        };
        let written = self
            .write(move |c| {
                let changes = &lot.changes;
                // Nearly every batch writes whole: one savepoint for the
                // lot instead of two statements per changeset. One that
                // fails rolls the lot back, and the batch is written again
                // below, each changeset in its own savepoint.
                c.batch_execute("SAVEPOINT batch_whole")?;
                let whole = changes
                    .iter()
                    .filter(|change| !change.is_empty())
                    .map(|change| {
                        let done = changeset::apply(c, change.clone(), &tasks)?;
                        crate::events::notify(c, origin.get().map(String::as_str), &done.events)?;
                        Ok(done)
                    })
                    .collect::<Result<Vec<_>>>();
                if let Ok(done) = whole {
                    c.batch_execute("RELEASE SAVEPOINT batch_whole")?;
                    // One `done` per changeset that was not empty, in order.
                    let mut done = done.into_iter();
                    return Ok(changes
                        .iter()
                        .map(|change| {
                            if change.is_empty() {
                                Ok(Committed::default())
                            } else {
                                Ok(done.next().unwrap_or_default())
                            }
                        })
                        .collect());
                }
                c.batch_execute(
                    "ROLLBACK TO SAVEPOINT batch_whole; RELEASE SAVEPOINT batch_whole",
                )?;
                let mut out = Vec::with_capacity(changes.len());
                for change in changes {
                    if change.is_empty() {
                        out.push(Ok(Committed::default()));
                        continue;
                    }
                    c.batch_execute("SAVEPOINT batch_item")?;
                    match changeset::apply(c, change.clone(), &tasks).and_then(|done| {
                        crate::events::notify(c, origin.get().map(String::as_str), &done.events)?;
                        Ok(done)
                    }) {
                        Ok(done) => {
                            c.batch_execute("RELEASE SAVEPOINT batch_item")?;
                            out.push(Ok(done));
                        }
                        Err(e) => {
                            c.batch_execute(
                                "ROLLBACK TO SAVEPOINT batch_item; RELEASE SAVEPOINT batch_item",
                            )?;
                            out.push(Err(e));
                        }
                    }
                }
                Ok(out)
            })
            .await;
        let failed = match written {
            Ok(out) => return Ok(out),
            Err(e) => e,
        };
        let Some(changes) = returned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        else {
            return Err(failed);
        };
        tracing::debug!(error = %failed, changesets = changes.len(),
            "a batch's transaction failed; writing its changesets one by one");
        let mut out = Vec::with_capacity(changes.len());
        for change in changes {
            out.push(self.commit(change).await);
        }
        Ok(out)
    }

    // ------------------------------------------------------------ messages & events

    /// Messages of a session with `seq > after_seq`, in seq order.
    pub async fn list_messages(
        &self,
        session: SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<Message>> {
        self.read(move |c| {
            session_messages::table
                .filter(session_messages::session_id.eq(session.to_string()))
                .filter(session_messages::seq.gt(after_seq))
                .order(session_messages::seq)
                .limit(i64::from(limit))
                .select(MessageRow::as_select())
                .load(c)?
                .into_iter()
                .map(MessageRow::into_domain)
                .collect()
        })
        .await
    }

    /// One message of a session; `None` when the session has no such message.
    pub async fn get_message(&self, session: SessionId, id: MessageId) -> Result<Option<Message>> {
        self.read(move |c| {
            session_messages::table
                .filter(session_messages::session_id.eq(session.to_string()))
                .filter(session_messages::id.eq(id.to_string()))
                .select(MessageRow::as_select())
                .get_result(c)
                .optional()?
                .map(MessageRow::into_domain)
                .transpose()
        })
        .await
    }

    /// A session's newest message of `kind` (highest seq), if any: the part
    /// a session-wide update such as `AvailableCommands` replaces.
    pub async fn latest_part(
        &self,
        session: SessionId,
        kind: MessageKind,
    ) -> Result<Option<Message>> {
        self.read(move |c| {
            session_messages::table
                .filter(session_messages::session_id.eq(session.to_string()))
                .filter(session_messages::kind.eq(kind.as_str()))
                .order(session_messages::seq.desc())
                .select(MessageRow::as_select())
                .first(c)
                .optional()?
                .map(MessageRow::into_domain)
                .transpose()
        })
        .await
    }

    /// A session's activity parts of `kind` that are not complete yet (for
    /// `Permission`: the requests still waiting), in seq order.
    pub async fn open_parts(&self, session: SessionId, kind: MessageKind) -> Result<Vec<Message>> {
        self.read(move |c| {
            session_messages::table
                .filter(session_messages::session_id.eq(session.to_string()))
                .filter(session_messages::kind.eq(kind.as_str()))
                .filter(session_messages::complete.eq(false))
                .order(session_messages::seq)
                .select(MessageRow::as_select())
                .load(c)?
                .into_iter()
                .map(MessageRow::into_domain)
                .collect()
        })
        .await
    }

    /// How many activity parts of `kind` are not complete, over all
    /// sessions (the pending permission requests gauge).
    pub async fn count_open_parts(&self, kind: MessageKind) -> Result<i64> {
        self.read(move |c| {
            Ok(session_messages::table
                .filter(session_messages::kind.eq(kind.as_str()))
                .filter(session_messages::complete.eq(false))
                .count()
                .get_result(c)?)
        })
        .await
    }

    /// Events of a session with `seq > after_seq`, in seq order.
    pub async fn events_after(
        &self,
        session: SessionId,
        after_seq: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        self.read(move |c| {
            session_events::table
                .filter(session_events::session_id.eq(session.to_string()))
                .filter(session_events::seq.gt(after_seq))
                .order(session_events::seq)
                .limit(i64::from(limit))
                .select(EventRow::as_select())
                .load(c)?
                .into_iter()
                .map(EventRow::into_domain)
                .collect()
        })
        .await
    }

    /// Events of all sessions of a task with `task_seq > after_task_seq`, in
    /// task_seq order.
    pub async fn task_events_after(
        &self,
        task: TaskId,
        after_task_seq: i64,
        limit: u32,
    ) -> Result<Vec<Event>> {
        self.read(move |c| {
            session_events::table
                .filter(session_events::task_id.eq(task.to_string()))
                .filter(session_events::task_seq.gt(after_task_seq))
                .order(session_events::task_seq)
                .limit(i64::from(limit))
                .select(EventRow::as_select())
                .load(c)?
                .into_iter()
                .map(EventRow::into_domain)
                .collect()
        })
        .await
    }

    /// A watcher's replay page: the session's events after `after_seq`, at
    /// most `limit` of them and no more than `max_bytes` of payload (always
    /// at least one), so a replay of large events (a long reply's updates,
    /// each carrying the whole message) holds a bounded amount in memory;
    /// and whether more may follow (the page was cut by either bound).
    pub async fn events_page_after(
        &self,
        session: SessionId,
        after_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<(Vec<Event>, bool)> {
        self.read(move |c| {
            replay_page(c, limit, max_bytes, || {
                session_events::table
                    .filter(session_events::session_id.eq(session.to_string()))
                    .filter(session_events::seq.gt(after_seq))
                    .order(session_events::seq)
                    .into_boxed()
            })
        })
        .await
    }

    /// [`Self::events_page_after`] for a task's events, by `task_seq`.
    pub async fn task_events_page_after(
        &self,
        task: TaskId,
        after_task_seq: i64,
        limit: u32,
        max_bytes: u64,
    ) -> Result<(Vec<Event>, bool)> {
        self.read(move |c| {
            replay_page(c, limit, max_bytes, || {
                session_events::table
                    .filter(session_events::task_id.eq(task.to_string()))
                    .filter(session_events::task_seq.gt(after_task_seq))
                    .order(session_events::task_seq)
                    .into_boxed()
            })
        })
        .await
    }

    /// The seq of the session's newest event (0 when it has none): a
    /// watcher's snapshot cursor.
    pub async fn last_event_seq(&self, session: SessionId) -> Result<i64> {
        self.read(move |c| {
            task_sessions::table
                .find(session.to_string())
                .select(task_sessions::last_event_seq)
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("session", session))
        })
        .await
    }

    /// The newest task_seq of a task (0 when it has no events).
    pub async fn last_task_event_seq(&self, task: TaskId) -> Result<i64> {
        self.read(move |c| {
            tasks::table
                .find(task.to_string())
                .select(tasks::last_event_seq)
                .get_result(c)
                .optional()?
                .ok_or_else(|| Error::not_found("task", task))
        })
        .await
    }

    // ------------------------------------------------------------ plumbing

    /// Runs `fut` as bulk work whose store calls yield to everyone else's
    /// while `flag` is set: a SQLite write turn is taken only when no other
    /// writer waits, and at most all but two of the pool's connections are
    /// held by such work (see `lanes.rs`). Startup recovery's pass runs in
    /// it, so a call that recovers one session ahead of the pass does not
    /// queue behind the pass's writes. (The future it returns holds `fut`
    /// once; an `async fn` would hold it twice.)
    pub fn yielding<F: std::future::Future>(
        flag: Yield,
        fut: F,
    ) -> impl std::future::Future<Output = F::Output> {
        lanes::scope(flag, fut)
    }

    /// Runs `f` on a pooled connection on the blocking thread pool.
    pub(crate) async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut AnyConnection) -> Result<T> + Send + 'static,
    {
        let pool = self.pool.clone();
        let slots = self.slots.clone();
        let timeout = self.checkout_timeout;
        let health = self.health.clone();
        let flag = lanes::current();
        blocking(move || {
            let asked = Instant::now();
            let _urgent = (!flag.as_ref().is_some_and(Yield::is_yielding)).then(|| slots.urgent());
            let _slot = slots
                .take(flag.as_ref(), timeout)
                .map_err(|()| Error::Pool(Box::new(TimedOut(timeout))))?;
            let mut conn = health.checkout(&pool, timeout)?;
            waited("read", flag.as_ref(), asked);
            let result = f(&mut conn);
            health.observe(&result, &mut conn);
            result
        })
        .await
    }

    /// Like `read`, inside one write transaction.
    pub(crate) async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut AnyConnection) -> Result<T> + Send + 'static,
    {
        self.write_as(Transaction::Begun, f).await
    }

    /// Like `write`; `Transaction::Statement` runs `f`, which writes in
    /// one statement, without a transaction of its own around it.
    async fn write_as<T, F>(&self, transaction: Transaction, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut AnyConnection) -> Result<T> + Send + 'static,
    {
        let pool = self.pool.clone();
        let writer = (self.backend == Backend::Sqlite).then(|| self.writer.clone());
        let slots = self.slots.clone();
        let timeout = self.checkout_timeout;
        let health = self.health.clone();
        let checkpointer = self.checkpointer.clone();
        let flag = lanes::current();
        blocking(move || {
            let asked = Instant::now();
            // SQLite has one write lock. Writers that found it taken slept
            // in its busy handler (1, 2, 5, 10, ... ms) and were not woken
            // when it freed; queued here, the next one starts at once. The
            // turn is taken before the pool checkout, so a waiting writer
            // holds no connection. (Other processes still meet busy_timeout.)
            let _urgent = (!flag.as_ref().is_some_and(Yield::is_yielding)).then(|| slots.urgent());
            let turn = writer.as_ref().map(|w| w.take(flag.as_ref()));
            // The one writer holding SQLite's turn takes no slot: yielding
            // work leaves it a connection (`lanes::Slots`), so the pass's
            // serial writes never wait behind its own reads.
            let _slot = if turn.is_some() {
                None
            } else {
                slots
                    .take(flag.as_ref(), timeout)
                    .map_err(|()| Error::Pool(Box::new(TimedOut(timeout))))?
            };
            let mut conn = health.checkout(&pool, timeout)?;
            waited("write", flag.as_ref(), asked);
            let result = match transaction {
                Transaction::Begun => write_transaction(&mut conn, f),
                Transaction::Statement => f(&mut conn),
            };
            health.observe(&result, &mut conn);
            if let (Ok(_), Some(checkpointer)) = (&result, &checkpointer) {
                checkpointer.committed();
            }
            result
        })
        .await
    }
}

/// Logs (at debug) a store call that waited for its turn or a connection:
/// what a slow call waited on, with its yielding flag.
fn waited(kind: &'static str, flag: Option<&Yield>, asked: Instant) {
    let waited = asked.elapsed();
    if waited >= Duration::from_millis(5) {
        tracing::debug!(
            kind,
            waited_ms = waited.as_secs_f64() * 1e3,
            yielding = flag.is_some_and(Yield::is_yielding),
            "store call waited for its turn or a connection"
        );
    }
}

/// `ids` lengthened (its last id repeated) to one of a few lengths. SQLite
/// binds `IN` lists one parameter per id, so each length is a statement of
/// its own, prepared (parsed and planned) the first time each pooled
/// connection meets it: the recovery pass's grouped re-reads, whose groups
/// come in every size up to 64, prepared most of theirs anew. A repeated id
/// matches the same row once.
fn few_lengths(mut ids: Vec<String>) -> Vec<String> {
    let len = match ids.len() {
        0 => return ids,
        1..=8 => 8,
        9..=64 => 64,
        n => n.next_multiple_of(64),
    };
    let last = ids[ids.len() - 1].clone();
    ids.resize(len, last);
    ids
}

/// A batch's changesets, handed back to `to` when the write that owns
/// them ends: after it ran, or when it is dropped unrun (no connection).
struct Returned {
    changes: Vec<Changeset>,
    to: Arc<std::sync::Mutex<Option<Vec<Changeset>>>>,
}

impl Drop for Returned {
    fn drop(&mut self) {
        let changes = std::mem::take(&mut self.changes);
        *self
            .to
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(changes);
    }
}

/// How a write runs: in a transaction the store begins and commits, or
/// as one statement, which PostgreSQL and SQLite run all-or-nothing.
#[derive(Debug, Clone, Copy)]
enum Transaction {
    Begun,
    Statement,
}

/// No pool slot for yielding work within the checkout timeout.
#[derive(Debug)]
struct TimedOut(Duration);

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no connection free for background work within {:?}",
            self.0
        )
    }
}

impl std::error::Error for TimedOut {}

async fn blocking<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Blocking(e.to_string()))?
}

fn run_pending(conn: &mut AnyConnection) -> Result<Vec<String>> {
    fn versions<V: ToString>(applied: Result<Vec<V>, crate::BoxError>) -> Result<Vec<String>> {
        Ok(applied
            .map_err(Error::Migration)?
            .iter()
            .map(ToString::to_string)
            .collect())
    }
    match conn {
        AnyConnection::Pg(c) => {
            c.batch_execute(&format!("SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"))?;
            let applied = versions(c.run_pending_migrations(POSTGRES_MIGRATIONS));
            c.batch_execute(&format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"))?;
            applied
        }
        AnyConnection::Sqlite(c) => versions(c.run_pending_migrations(SQLITE_MIGRATIONS)),
    }
}

fn upsert_profile(c: &mut AnyConnection, row: &ProfileRow) -> Result<AgentProfile> {
    let existing: Option<String> = agent_profiles::table
        .filter(agent_profiles::name.eq(&row.name))
        .select(agent_profiles::id)
        .get_result(c)
        .optional()?;
    let id = match existing {
        Some(id) => {
            diesel::update(agent_profiles::table.find(&id))
                .set((
                    agent_profiles::command.eq(&row.command),
                    agent_profiles::args.eq(&row.args),
                    agent_profiles::env.eq(&row.env),
                    agent_profiles::supports_session_resume.eq(row.supports_session_resume),
                    agent_profiles::container.eq(&row.container),
                    agent_profiles::auth_method.eq(&row.auth_method),
                    agent_profiles::permission_policy.eq(&row.permission_policy),
                    agent_profiles::permission_timeout_ms.eq(row.permission_timeout_ms),
                    agent_profiles::config_defaults.eq(&row.config_defaults),
                    agent_profiles::mcp_servers.eq(&row.mcp_servers),
                    agent_profiles::updated_at.eq(Ts::new(conn::now())),
                ))
                .execute(c)?;
            id
        }
        None => {
            diesel::insert_into(agent_profiles::table)
                .values(row)
                .execute(c)
                .map_err(|e| on_unique(e, "agent profile", |_| row.name.clone()))?;
            row.id.clone()
        }
    };
    load_profile(c, false, &id)
}

fn load_profile(c: &mut AnyConnection, by_name: bool, key: &str) -> Result<AgentProfile> {
    let q = agent_profiles::table
        .select(ProfileRow::as_select())
        .into_boxed();
    let q = if by_name {
        q.filter(agent_profiles::name.eq(key))
    } else {
        q.filter(agent_profiles::id.eq(key))
    };
    q.get_result(c)
        .optional()?
        .ok_or_else(|| Error::not_found("agent profile", key))?
        .into_domain()
}

fn load_session(c: &mut AnyConnection, id: SessionId) -> Result<Session> {
    let id_text = id.to_string();
    crate::conn::native!(c, |c| task_sessions::table
        .find(&id_text)
        .filter(task_sessions::deleted_at.is_null())
        .select(SessionRow::as_select())
        .get_result(c))
    .optional()?
    .ok_or_else(|| Error::not_found("session", id))?
    .into_domain()
}

fn load_executors(
    c: &mut AnyConnection,
    statuses: Option<&[ExecutorStatus]>,
) -> Result<Vec<ExecutorRecord>> {
    let mut q = executors_running::table
        .select(ExecutorRow::as_select())
        .order((executors_running::created_at, executors_running::id))
        .into_boxed();
    if let Some(statuses) = statuses {
        q = q.filter(executors_running::status.eq_any(statuses.iter().map(|s| s.as_str())));
    }
    q.load(c)?
        .into_iter()
        .map(ExecutorRow::into_domain)
        .collect()
}

/// A new session's task and agent profile exist (NOT_FOUND names the missing one).
fn check_session_parents(
    c: &mut AnyConnection,
    task: TaskId,
    profile: AgentProfileId,
) -> Result<()> {
    let task_exists: i64 = tasks::table
        .filter(tasks::id.eq(task.to_string()))
        .count()
        .get_result(c)?;
    if task_exists == 0 {
        return Err(Error::not_found("task", task));
    }
    let profile_exists: i64 = agent_profiles::table
        .filter(agent_profiles::id.eq(profile.to_string()))
        .count()
        .get_result(c)?;
    if profile_exists == 0 {
        return Err(Error::not_found("agent profile", profile));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls() {
        let pg = |u: &str| parse_database_url(u).unwrap();
        assert_eq!(pg("postgres://u@h/db").0, Backend::Postgres);
        assert_eq!(pg("postgresql://h/db").0, Backend::Postgres);
        assert_eq!(
            pg("sqlite:///var/lib/s.db"),
            (Backend::Sqlite, "/var/lib/s.db".into())
        );
        assert_eq!(
            pg("sqlite://rel/s.db"),
            (Backend::Sqlite, "rel/s.db".into())
        );
        assert_eq!(pg("sqlite::memory:"), (Backend::Sqlite, ":memory:".into()));
        assert_eq!(pg("/tmp/s.db"), (Backend::Sqlite, "/tmp/s.db".into()));
        assert!(matches!(parse_database_url(""), Err(Error::Invalid(_))));
        assert!(matches!(
            parse_database_url("mysql://h/db"),
            Err(Error::Invalid(_))
        ));
    }

    #[tokio::test]
    async fn in_memory_sqlite_is_one_migrated_connection() {
        let store = Store::connect(":memory:", StoreOptions::default())
            .await
            .unwrap();
        assert_eq!(store.pool.max_size(), 1);
        assert!(store.list_tasks(None, 1).await.unwrap().is_empty());
        assert!(store.run_pending_migrations().await.unwrap().is_empty());
    }
}

/// A replay page of the events `events` selects in order: their payload
/// sizes first (no payload read), then as many events as fit in
/// `max_bytes` (at least one); and whether more may follow.
fn replay_page(
    c: &mut crate::conn::AnyConnection,
    limit: u32,
    max_bytes: u64,
    events: impl Fn() -> session_events::BoxedQuery<'static, crate::conn::MultiBackend>,
) -> Result<(Vec<Event>, bool)> {
    let sizes: Vec<i64> = events()
        .limit(i64::from(limit))
        .select(diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "CAST(length(payload) AS BIGINT)",
        ))
        .load(c)?;
    let (take, cut) = page_within(&sizes, max_bytes);
    let page = events()
        .limit(i64::try_from(take).unwrap_or(i64::MAX))
        .select(EventRow::as_select())
        .load(c)?
        .into_iter()
        .map(EventRow::into_domain)
        .collect::<Result<Vec<_>>>()?;
    Ok((page, cut || sizes.len() >= limit as usize))
}

/// How many of a page's events (their payload sizes, in order) fit in
/// `max_bytes` (at least one), and whether that cut the page short.
fn page_within(sizes: &[i64], max_bytes: u64) -> (usize, bool) {
    let mut total = 0u64;
    for (i, size) in sizes.iter().enumerate() {
        total = total.saturating_add(u64::try_from(*size).unwrap_or(0));
        if total > max_bytes && i > 0 {
            return (i, true);
        }
    }
    (sizes.len(), false)
}

#[cfg(test)]
mod page_tests {
    #[test]
    fn a_page_holds_what_fits_and_at_least_one_event() {
        assert_eq!(super::page_within(&[10, 10, 10], 25), (2, true));
        assert_eq!(super::page_within(&[10, 10, 10], 30), (3, false));
        assert_eq!(super::page_within(&[100, 1], 25), (1, true));
        assert_eq!(super::page_within(&[], 25), (0, false));
    }
}
