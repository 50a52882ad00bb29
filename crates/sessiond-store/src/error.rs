//! The store's one error type.

/// A boxed source error (diesel, r2d2, migrations); its type is not part of
/// the store's API.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with the store's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a store call can fail with; each message names the entity
/// and id involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The row does not exist.
    #[error("{entity} {id} not found")]
    NotFound {
        /// What kind of row (`task`, `session`, ...).
        entity: &'static str,
        /// Its id.
        id: String,
    },

    /// Optimistic concurrency: someone else wrote the row since the caller
    /// read it. Re-read and decide again.
    #[error(
        "{entity} {id} was changed concurrently: expected version {expected_version}, \
         found {actual_version}"
    )]
    Conflict {
        /// What kind of row.
        entity: &'static str,
        /// Its id.
        id: String,
        /// The version the caller read.
        expected_version: i64,
        /// The version stored now.
        actual_version: i64,
    },

    /// Fencing: the write was made for the lease of `session_id`'s executor
    /// as `owner` at `epoch`, but the row says another claim happened since
    /// (another replica adopted it, or this one claimed it again). Nothing
    /// was written; the writer must stop acting on the session.
    #[error(
        "lease of session {session_id} lost: written as {owner} at epoch {epoch}, but the \
         executor is now {current_owner} at epoch {current_epoch}"
    )]
    LeaseLost {
        /// The session written.
        session_id: String,
        /// The replica that wrote.
        owner: String,
        /// The epoch it wrote at.
        epoch: i64,
        /// The executor's owner now; `-` when the row is gone or has none.
        current_owner: String,
        /// The executor's epoch now.
        current_epoch: i64,
    },

    /// A row with this key (or unique value) exists already.
    #[error("{entity} {id} already exists")]
    AlreadyExists {
        /// What kind of row.
        entity: &'static str,
        /// Its id (or unique value).
        id: String,
    },

    /// A stored row does not map to a domain value (unknown state, bad JSON).
    #[error("stored {entity} {id} is corrupt: {reason}")]
    Corrupt {
        /// What kind of row.
        entity: &'static str,
        /// Its id.
        id: String,
        /// What does not map.
        reason: String,
    },

    /// The caller passed something the store cannot accept (e.g. a malformed
    /// database URL, a message for a session it does not belong to).
    #[error("invalid input: {0}")]
    Invalid(String),

    /// The database refused or failed a statement.
    #[error("database error: {0}")]
    Database(#[source] BoxError),

    /// No connection could be had from the pool in time.
    #[error("cannot get a database connection: {0}")]
    Pool(#[source] BoxError),

    /// The connection was lost during the call (the server terminated it,
    /// closed it, or is gone). Nothing of a write was committed unless its
    /// COMMIT had been answered; the call may be retried once the database
    /// is back.
    #[error("the database connection was lost: {0}")]
    ConnectionLost(#[source] BoxError),

    /// Applying the embedded migrations failed.
    #[error("migration failed: {0}")]
    Migration(#[source] BoxError),

    /// The blocking task running the query panicked or was cancelled, or a
    /// worker thread of the store (SQLite's checkpoints) could not start.
    #[error("database worker task failed: {0}")]
    Blocking(String),
}

impl Error {
    pub(crate) fn not_found(entity: &'static str, id: impl ToString) -> Error {
        Error::NotFound {
            entity,
            id: id.to_string(),
        }
    }

    pub(crate) fn corrupt(entity: &'static str, id: impl ToString, reason: impl ToString) -> Error {
        Error::Corrupt {
            entity,
            id: id.to_string(),
            reason: reason.to_string(),
        }
    }

    /// True for [`Error::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound { .. })
    }

    /// True when the database could not be reached or the connection was
    /// lost ([`Error::Pool`], [`Error::ConnectionLost`]): worth a retry.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Pool(_) | Error::ConnectionLost(_))
    }

    /// True for [`Error::LeaseLost`].
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// True for [`Error::Conflict`].
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Conflict { .. })
    }
}

/// Maps a unique violation to [`Error::AlreadyExists`], anything else as usual.
pub(crate) fn on_unique(
    e: diesel::result::Error,
    entity: &'static str,
    id: impl FnOnce(&str) -> String,
) -> Error {
    use diesel::result::{DatabaseErrorKind, Error as D};
    match &e {
        D::DatabaseError(DatabaseErrorKind::UniqueViolation, info) => {
            let detail = format!(
                "{} {}",
                info.constraint_name().unwrap_or_default(),
                info.message()
            );
            Error::AlreadyExists {
                entity,
                id: id(&detail),
            }
        }
        _ => Error::from(e),
    }
}
