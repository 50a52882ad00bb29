//! Whether the database answered this replica lately: while it does not,
//! and for one heartbeat period after it does again, this replica claims
//! no other replica's leases (decision 0022: a database outage moves
//! nothing).

use std::time::{Duration, Instant};

/// How soon a failed heartbeat is tried again: once the database is back,
/// each replica renews its leases within this, before another claims them.
pub(crate) const HEARTBEAT_RETRY: Duration = Duration::from_millis(500);

/// Whether the database answered this replica lately. While a heartbeat or
/// a claim fails, and for one heartbeat period after the database answers
/// again, this replica claims nothing: every other replica, whose leases
/// ran out during the outage through no fault of its own, renews them
/// first (decision 0022: a database outage moves nothing). Adoption of a
/// replica that died meanwhile waits that much longer.
#[derive(Debug, Default)]
pub(crate) struct DatabaseSeen {
    failing: bool,
    settle_until: Option<Instant>,
}

impl DatabaseSeen {
    pub(crate) fn failed(&mut self) {
        self.failing = true;
    }

    /// A heartbeat went through; after a failure, the others get `settle`.
    pub(crate) fn answered(&mut self, settle: Duration) {
        if std::mem::take(&mut self.failing) {
            self.settle_until = Some(Instant::now() + settle);
        }
    }

    /// When this replica may claim again (`None`: now).
    pub(crate) fn claims_from(&self) -> Option<Instant> {
        if self.failing {
            return Some(Instant::now() + HEARTBEAT_RETRY);
        }
        self.settle_until.filter(|t| *t > Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::{DatabaseSeen, Duration, HEARTBEAT_RETRY, Instant};

    #[test]
    fn claims_wait_while_the_database_fails_and_one_period_after() {
        let mut seen = DatabaseSeen::default();
        assert_eq!(seen.claims_from(), None, "a healthy replica claims now");
        seen.answered(Duration::from_secs(5));
        assert_eq!(
            seen.claims_from(),
            None,
            "an answer without a failure settles nothing"
        );
        seen.failed();
        let t = seen.claims_from().expect("no claim while failing");
        assert!(t <= Instant::now() + HEARTBEAT_RETRY);
        seen.answered(Duration::from_secs(5));
        let t = seen.claims_from().expect("the others renew first");
        assert!(t > Instant::now() + Duration::from_secs(4));
        seen.answered(Duration::from_secs(5));
        assert!(
            seen.claims_from().is_some(),
            "a later answer does not cut the wait"
        );
        let mut past = DatabaseSeen::default();
        past.failed();
        past.answered(Duration::ZERO);
        assert_eq!(past.claims_from(), None, "the wait ends");
    }
}
