//! The leases this replica holds on executors, and the fencing token each
//! of its writes and agentctl calls carries ([`Leases`]). Claiming,
//! renewing and releasing are the store's (its `replicas.rs`); the
//! heartbeat and the adoption loop that drive them are `replica.rs`.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex as StdMutex, MutexGuard},
};

use sessiond_domain::SessionId;
use sessiond_store::Fence;

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
