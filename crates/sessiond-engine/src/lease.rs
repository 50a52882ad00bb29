//! The leases this replica holds on executors, and the fencing token each
//! of its writes and agentctl calls carries ([`Leases`]). Claiming,
//! renewing and releasing are the store's (its `replicas.rs`); the
//! heartbeat and the adoption loop that drive them are `replica.rs`.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex as StdMutex, MutexGuard},
};

use chrono::Utc;
use sessiond_domain::{ExecutorRecord, SessionId};
use sessiond_store::{Changeset, Committed, Fence};

use crate::{
    error::{Error, Result},
    sync::lock,
};

/// A lease this replica claimed on one session's executor.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// The newest epoch claimed; kept after the lease is lost, so a late
    /// write still carries the old epoch and is refused instead of going
    /// out unfenced.
    epoch: i64,
    /// The lease is still this replica's (as far as it knows).
    owned: bool,
}

/// This replica's leases. With an exclusive store (SQLite, one process)
/// every session counts as owned and nothing is fenced.
#[derive(Debug)]
pub(crate) struct Leases {
    exclusive: bool,
    replica: String,
    held: StdMutex<HashMap<SessionId, Held>>,
}

impl Leases {
    pub fn new(exclusive: bool, replica: String) -> Self {
        Self {
            exclusive,
            replica,
            held: StdMutex::default(),
        }
    }

    fn held(&self) -> MutexGuard<'_, HashMap<SessionId, Held>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this replica holds the lease of `session`'s executor.
    pub fn owns(&self, session: SessionId) -> bool {
        self.exclusive || self.held().get(&session).is_some_and(|h| h.owned)
    }

    /// The sessions whose leases this replica holds now.
    pub fn owned(&self) -> HashSet<SessionId> {
        self.held()
            .iter()
            .filter(|(_, h)| h.owned)
            .map(|(s, _)| *s)
            .collect()
    }

    /// This replica holds `session`'s lease at `epoch` (a claim, or the
    /// lease a create inserted); an older epoch never replaces a newer one.
    pub fn claimed(&self, session: SessionId, epoch: i64) {
        if self.exclusive {
            return;
        }
        let mut held = self.held();
        let h = held.entry(session).or_insert(Held { epoch, owned: true });
        h.epoch = h.epoch.max(epoch);
        h.owned = true;
    }

    /// The lease went to another replica: not owned any more, its epoch
    /// kept for fencing.
    pub fn lost(&self, session: SessionId) {
        if let Some(h) = self.held().get_mut(&session) {
            h.owned = false;
        }
    }

    /// Whether `epoch` is the newest this replica claimed for `session` and
    /// it still counts the lease as its own.
    pub fn holds_at(&self, session: SessionId, epoch: i64) -> bool {
        self.held()
            .get(&session)
            .is_some_and(|h| h.owned && h.epoch == epoch)
    }

    /// The executor row is gone: nothing to fence any more.
    pub fn forget(&self, session: SessionId) {
        self.held().remove(&session);
    }

    /// Every lease was released (graceful handoff).
    pub fn released_all(&self) {
        for h in self.held().values_mut() {
            h.owned = false;
        }
    }

    /// The fencing token of writes and agentctl calls on `session`: the
    /// newest epoch claimed, still carried after the lease was lost (then
    /// it is refused). `None` with an exclusive store or for a session this
    /// replica never held.
    pub fn fence(&self, session: SessionId) -> Option<Fence> {
        if self.exclusive {
            return None;
        }
        let epoch = self.held().get(&session)?.epoch;
        Some(Fence {
            session,
            owner: self.replica.clone(),
            epoch,
        })
    }
}

/// A session the adoption loop claimed and has not recovered yet: its
/// record, and the recovery under way (`None`: not started, or failed and
/// to be tried again).
pub(crate) struct Adoption {
    pub(crate) record: sessiond_domain::ExecutorRecord,
    pub(crate) recovery: Option<crate::pass::SharedRecovery>,
}

/// This replica's side of a session's lease: whether it owns the session,
/// the fencing token its writes and agentctl calls carry, claiming records,
/// and what a write or call refused as fenced means (the lease is lost).
pub(crate) struct Fencing<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Fencing<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Fencing<'_> {
    /// Before any recovery step: the lease must be ours.
    pub(crate) fn ensure_owner(&self, record: &ExecutorRecord) -> Result<()> {
        if self.owns(record.session_id) {
            return Ok(());
        }
        Err(self.not_owner(record, None))
    }

    pub(crate) fn exclusive(&self) -> bool {
        self.inner.config.replica.exclusive
    }

    /// Whether this replica holds the lease of `session`'s executor (always
    /// with an exclusive store).
    pub(crate) fn owns(&self, session: SessionId) -> bool {
        self.inner.leases.owns(session)
    }

    /// Records that this replica holds `session`'s lease at `epoch` (a
    /// claim, or the lease a create inserted).
    pub(crate) fn mark_owned(&self, session: SessionId, epoch: i64) {
        self.inner.leases.claimed(session, epoch);
    }

    /// Forgets `session`'s lease after its executor row was deleted.
    pub(crate) fn forget_lease(&self, session: SessionId) {
        self.inner.leases.forget(session);
    }

    /// The fencing token of this replica's writes and agentctl calls on
    /// `session`: the newest epoch it claimed, still carried after the
    /// lease was lost (then it is refused). `None` with an exclusive store
    /// or for a session this replica never held.
    pub(crate) fn fence(&self, session: SessionId) -> Option<Fence> {
        self.inner.leases.fence(session)
    }

    /// Every write of the session path: fenced by the lease this replica
    /// holds on the changeset's session (checked in the write's
    /// transaction). On [`sessiond_store::Error::LeaseLost`] the session is
    /// dropped here (see [`Fencing::lease_lost`]) and the error
    /// returned: the caller stops, it never retries as if nothing happened.
    pub(crate) async fn store_commit(
        &self,
        mut change: Changeset,
    ) -> std::result::Result<Committed, sessiond_store::Error> {
        let fence = change.subject().and_then(|s| self.fence(s));
        if let Some(f) = &fence {
            change = change.fenced(f.clone());
        }
        let out = self.inner.store.commit(change).await;
        if let (Err(e), Some(f)) = (&out, &fence)
            && e.is_lease_lost()
        {
            self.lease_lost(f.session, f.epoch, "store", &e.to_string());
        }
        out
    }

    /// The result of a store call fenced by `fence` outside a changeset: a
    /// lost lease drops the session here (as [`Self::store_commit`] does)
    /// and is [`Error::NotOwner`].
    pub(crate) fn fenced_result<T>(
        &self,
        fence: &Fence,
        result: std::result::Result<T, sessiond_store::Error>,
    ) -> Result<T> {
        result.map_err(|e| {
            if e.is_lease_lost() {
                self.lease_lost(fence.session, fence.epoch, "store", &e.to_string());
            }
            self.lease_error(e)
        })
    }

    /// A store error as the manager's: a lost lease is [`Error::NotOwner`]
    /// naming the replica that holds it now (retryable there).
    pub(crate) fn lease_error(&self, e: sessiond_store::Error) -> Error {
        match e {
            sessiond_store::Error::LeaseLost {
                session_id,
                current_owner,
                ..
            } => match SessionId::parse(&session_id) {
                Ok(session_id) => Error::NotOwner {
                    session_id,
                    owner: current_owner,
                    address: String::new(),
                    ttl_secs: self.inner.config.replica.lease_ttl.as_secs().max(1),
                },
                Err(_) => Error::Unavailable(format!("lease of session {session_id} lost")),
            },
            other => other.into(),
        }
    }

    /// Whether `error` (of an agentctl call on `session`) is agentctl
    /// refusing a superseded lease epoch; if so the session is dropped
    /// here as after a refused write.
    pub(crate) fn executor_refused(
        &self,
        session: SessionId,
        error: &sessiond_executor::Error,
    ) -> bool {
        match error {
            sessiond_executor::Error::StaleEpoch { message, .. } => {
                self.fenced_by_agentctl(session, message);
                true
            }
            _ => false,
        }
    }

    fn fenced_by_agentctl(&self, session: SessionId, why: &str) {
        if let Some(f) = self.fence(session) {
            self.lease_lost(session, f.epoch, "agentctl", why);
        } else {
            self.inner.metrics.fenced("agentctl");
            tracing::warn!(%session, reason = why, "fenced: agentctl refused a superseded lease epoch");
        }
    }

    /// A write (`by` = `store`) or an agentctl call (`by` = `agentctl`) was
    /// refused for `epoch`: another claim superseded it. When `epoch` is
    /// still the newest this replica holds for the session (it did not
    /// claim it again meanwhile), the session is dropped at once, as the
    /// heartbeat would have: no pump, no client, no caches.
    pub(crate) fn lease_lost(&self, session: SessionId, epoch: i64, by: &'static str, why: &str) {
        self.inner.metrics.fenced(by);
        tracing::warn!(%session, epoch, by, reason = why, "fenced: lease epoch superseded, action refused");
        if self.inner.leases.holds_at(session, epoch) {
            self.relinquish(session);
        }
    }

    /// The lease fields a new executor record of this replica carries.
    pub(crate) fn new_lease(&self, record: &mut ExecutorRecord) {
        if self.exclusive() {
            return;
        }
        let r = &self.inner.config.replica;
        record.owner_id = Some(r.id.clone());
        record.lease_expires_at = Some(Utc::now() + chrono_ttl(r.lease_ttl));
    }

    /// Claims the executors of `records` this replica may take (free,
    /// expired, or its own from before a restart) and returns their fresh
    /// records; the others belong to live replicas. With an exclusive store
    /// every record is returned as is.
    pub(crate) async fn claim_records(
        &self,
        records: Vec<ExecutorRecord>,
    ) -> Result<Vec<ExecutorRecord>> {
        if self.exclusive() || records.is_empty() {
            return Ok(records);
        }
        let r = &self.inner.config.replica;
        let claimed = self
            .inner
            .store
            .claim_executors(
                &r.id,
                records.iter().map(|x| x.id).collect(),
                Utc::now(),
                r.lease_ttl,
                false,
            )
            .await?;
        let mut out = Vec::with_capacity(claimed.len());
        for c in claimed {
            self.mark_owned(c.record.session_id, c.epoch);
            out.push(c.record);
        }
        Ok(out)
    }

    pub(crate) fn not_owner(&self, record: &ExecutorRecord, address: Option<String>) -> Error {
        Error::NotOwner {
            session_id: record.session_id,
            owner: record.owner_id.clone().unwrap_or_default(),
            address: address.unwrap_or_default(),
            ttl_secs: self.inner.config.replica.lease_ttl.as_secs().max(1),
        }
    }

    /// `e`, unless this replica lost `session`'s lease meanwhile (a
    /// fenced write or a heartbeat dropped it while the call ran, clearing
    /// the caches the call's checks read): then [`Error::NotOwner`].
    pub(crate) async fn unless_lost(&self, session: SessionId, e: Error) -> Error {
        let Some(f) = self.fence(session) else {
            return e;
        };
        if !self.owns(session) {
            return self.not_owner_now(session).await;
        }
        // Still owned here: the row says whether another claim happened
        // (a failure caused by the lost lease, noticed before any write).
        match self.inner.store.get_executor_for_session(session).await {
            Ok(Some(r)) if r.owner_id.as_deref() != Some(&f.owner) || r.lease_epoch != f.epoch => {
                let why = format!(
                    "executor now {} at epoch {}",
                    r.owner_id.as_deref().unwrap_or("-"),
                    r.lease_epoch
                );
                self.lease_lost(session, f.epoch, "store", &why);
                self.not_owner_now(session).await
            }
            _ => e,
        }
    }

    /// [`Error::NotOwner`] naming the replica the store says owns
    /// `session`'s executor now (after this replica was fenced off).
    pub(crate) async fn not_owner_now(&self, session: SessionId) -> Error {
        let store = &self.inner.store;
        let record = match store.get_executor_for_session(session).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Error::Unavailable(format!("session {session} has no executor now"));
            }
            Err(e) => return e.into(),
        };
        let owner = record.owner_id.clone().unwrap_or_default();
        let address = store
            .get_replica(&owner)
            .await
            .ok()
            .flatten()
            .map(|r| r.address);
        self.not_owner(&record, address)
    }

    /// This replica's id.
    pub(crate) fn replica_id(&self) -> &str {
        &self.inner.config.replica.id
    }

    /// Drops everything this replica keeps for `session` after its lease
    /// went to another replica: no pump, no connection, no cached state.
    pub(crate) fn relinquish(&self, session: SessionId) {
        self.inner.leases.lost(session);
        lock(&self.inner.adoptions).remove(&session);
        self.inner.sessions.stop_pump(session);
        self.inner.sessions.remove_execution(session);
        self.inner.agent_restarts.forget(session);
        tracing::warn!(%session, "lease lost to another replica; no longer acting on this session");
    }
}

/// A lease's time to live as a chrono duration (a day if it does not fit).
pub(crate) fn chrono_ttl(ttl: std::time::Duration) -> chrono::Duration {
    chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::days(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_lease_keeps_fencing_with_its_epoch() {
        let leases = Leases::new(false, "r1".into());
        let s = SessionId::new();
        assert!(!leases.owns(s));
        assert!(leases.fence(s).is_none());
        leases.claimed(s, 3);
        leases.claimed(s, 2); // an older claim answered late
        assert!(leases.owns(s));
        assert!(leases.holds_at(s, 3));
        assert!(!leases.holds_at(s, 2));
        leases.lost(s);
        assert!(!leases.owns(s));
        assert!(!leases.holds_at(s, 3));
        assert_eq!(leases.fence(s).map(|f| f.epoch), Some(3));
        assert!(leases.owned().is_empty());
        leases.claimed(s, 5);
        assert_eq!(leases.owned(), HashSet::from([s]));
        leases.released_all();
        assert!(!leases.owns(s));
        leases.forget(s);
        assert!(leases.fence(s).is_none());
    }

    #[test]
    fn an_exclusive_store_owns_everything_and_fences_nothing() {
        let leases = Leases::new(true, "r1".into());
        let s = SessionId::new();
        leases.claimed(s, 1);
        assert!(leases.owns(s));
        assert!(leases.fence(s).is_none());
        assert!(leases.owned().is_empty());
    }
}
