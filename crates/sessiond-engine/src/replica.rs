//! This process as one replica of several on one database: membership,
//! executor ownership by lease, adoption of a dead replica's executors and
//! the graceful handoff (see `sessiond_store` `replicas.rs` for the SQL).
//!
//! - Only the owner of an executor's lease recovers, pumps, checks the
//!   liveness of and talks to it. The in-memory set `owned` mirrors the
//!   leases this replica holds; every recovery starts by checking it
//!   (`ensure_owner`), so the startup pass, a call's recovery, a background
//!   reconnect and an adoption all run the same step machine only on what
//!   was claimed.
//! - One heartbeat task (every third of the TTL) refreshes the replica's
//!   row and renews all its leases in one transaction; a session whose
//!   lease is no longer this replica's (it was paused past its TTL and
//!   someone adopted it) is dropped at once: pump stopped, caches cleared.
//! - One adoption task claims expired leases (waking when the next lease of
//!   another replica runs out, at most every third of the TTL or 1 s) and
//!   recovers them with bounded concurrency, claiming the next ones while
//!   the current ones recover (a pipeline; see `adoption_loop`).
//! - A call on a session whose executor another replica holds (unexpired)
//!   is refused with [`Error::NotOwner`] (UNAVAILABLE, naming the owner);
//!   one whose lease is expired or free is claimed by the call and
//!   recovered first (adoption on demand).
//! - With `exclusive` (SQLite, one process), none of this writes anything:
//!   every session counts as owned.

use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::FutureExt;
use sessiond_domain::{ExecutorRecord, ExecutorStatus, SessionId};
use sessiond_store::{EventWake, ReplicaInfo};
use tokio::sync::{Semaphore, mpsc};

use crate::{
    error::{Error, Result},
    lease::Fencing,
    manager::SessionManager,
    metrics::ms,
    pass::{ExecutorKey, Lane, SharedRecovery},
    recovery::Pass,
    sync::lock,
};

/// How many expired leases one claim of the adoption loop takes at most
/// (per transaction); it also takes no more than its free slots.
const ADOPTION_BATCH: u32 = 64;

/// After a claim cut to its fair share, how long the adoption loop waits
/// (unless one of its recoveries ends first) before it claims again: time
/// for the other survivors, woken by the same lease expiry, to take their
/// share, without leaving rows unclaimed for long if they do not.
const SHARE_PAUSE: Duration = Duration::from_millis(20);

/// One stretch of adoption (from its first claim until nothing is left in
/// flight), summed up in one log line at its end.
#[derive(Default)]
struct Burst {
    started: Option<Instant>,
    claimed: usize,
    recovered: usize,
    failed: usize,
}

impl Burst {
    fn claimed(&mut self, n: usize, at: Instant) {
        self.started.get_or_insert(at);
        self.claimed += n;
    }

    fn done(&mut self, ok: bool) {
        if ok {
            self.recovered += 1;
        } else {
            self.failed += 1;
        }
    }

    fn active(&self) -> bool {
        self.started.is_some()
    }

    /// Logs the burst that ends now, if any, and starts counting afresh;
    /// whether there was one.
    fn end(&mut self) -> bool {
        let ended = std::mem::take(self);
        let Some(started) = ended.started else {
            return false;
        };
        tracing::info!(
            claimed = ended.claimed,
            recovered = ended.recovered,
            failed = ended.failed,
            took_ms = ms(started.elapsed()),
            "adopted executors of a replica whose lease expired"
        );
        true
    }
}

/// This replica among the backends that share one store
/// ([`SessionManager::replica`]): its id, the sessions it holds leases on,
/// its start (heartbeat and adoption of what other replicas lose) and its
/// graceful handoff.
#[derive(Clone, Copy)]
pub struct Replica<'m>(pub(crate) &'m SessionManager);

impl std::fmt::Debug for Replica<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Replica").field(&self.id()).finish()
    }
}

impl SessionManager {
    /// This replica: its id, leases, start and handoff.
    pub fn replica(&self) -> Replica<'_> {
        Replica(self)
    }
}

impl Replica<'_> {
    /// This replica's id.
    pub fn id(&self) -> &str {
        &self.0.inner.config.replica.id
    }

    /// Whether this replica holds the lease of `session`'s executor (always
    /// with an exclusive store).
    pub fn owns(&self, session: SessionId) -> bool {
        Fencing(self.0).owns(session)
    }

    /// Sessions this replica holds leases on now (empty with an exclusive store).
    pub fn owned_sessions(&self) -> HashSet<SessionId> {
        Adoptions(self.0).owned_sessions()
    }

    /// Registers this replica and starts its heartbeat (lease renewal) and,
    /// unless the store is exclusive, the adoption of expired leases.
    /// Returns once the replica row is written.
    pub async fn start(&self, info: ReplicaInfo) -> Result<()> {
        Adoptions(self.0).start_replica(info).await
    }

    /// Graceful handoff: ends every lease of this replica now, so the others
    /// adopt its executors on their next look instead of after the TTL.
    /// Call after the pumps stopped ([`SessionManager::shutdown`]).
    pub async fn release_leases(&self) -> Result<usize> {
        Adoptions(self.0).release_leases().await
    }

    /// Test hook: each heartbeat first awaits `gate`, so a test can hold a
    /// replica's belief that it still owns its sessions (as after a pause,
    /// before its first heartbeat) and prove its writes and agentctl calls
    /// are fenced, without guessing how long that moment lasts.
    #[cfg(feature = "test-hooks")]
    pub fn gate_heartbeat(&self, gate: crate::pass::PassGate) {
        Adoptions(self.0).gate_heartbeat(gate)
    }
}

/// Sessions other replicas lost: the adoption loop that claims their
/// expired leases and recovers them, this replica's heartbeat, and the
/// relay of other replicas' events to local watchers.
pub(crate) struct Adoptions<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Adoptions<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Adoptions<'_> {
    /// Sessions this replica holds leases on now (empty with an exclusive store).
    pub(crate) fn owned_sessions(&self) -> HashSet<SessionId> {
        self.inner.leases.owned()
    }

    /// Whether recovery runs on a claimed executor (what startup recovery
    /// would load: `starting` / `ready`, or `error` while retried in the
    /// background).
    fn adoptable(&self, record: &ExecutorRecord) -> bool {
        match record.status {
            ExecutorStatus::Starting | ExecutorStatus::Ready => true,
            ExecutorStatus::Error => crate::recovery::retried_in_background(
                record,
                &self.inner.drivers,
                &self.inner.config,
                self.inner.started_at,
            ),
            ExecutorStatus::Stopped => false,
        }
    }

    /// Registers this replica and starts its heartbeat (lease renewal) and,
    /// unless the store is exclusive, the adoption of expired leases.
    /// Returns once the replica row is written.
    pub(crate) async fn start_replica(&self, info: ReplicaInfo) -> Result<()> {
        self.inner.store.register_replica(info.clone()).await?;
        let ttl = self.inner.config.replica.lease_ttl;
        let every = (ttl / 3).max(Duration::from_millis(50));
        let me = self.0.clone();
        self.spawn_background(async move {
            let mut wait = every;
            loop {
                tokio::time::sleep(wait).await;
                wait = match Adoptions(&me).heartbeat(&info, every).await {
                    true => every,
                    false => crate::database_seen::HEARTBEAT_RETRY.min(every),
                };
            }
        });
        if !Fencing(self).exclusive() {
            self.start_event_relay();
            let me = self.0.clone();
            let every = every.min(Duration::from_secs(1));
            self.spawn_background(async move {
                // The startup pass claims this replica's own executors first.
                Pass(&me).wait_first_recovery().await;
                Adoptions(&me).adoption_loop(every).await;
            });
        }
        Ok(())
    }

    /// How long the adoption loop sleeps after a claim that found nothing:
    /// until the next lease of another replica runs out (plus a little for
    /// the clocks), at most `every`. A dead replica's leases are thus
    /// claimed as soon as they expire instead of up to a period later;
    /// live replicas renew theirs long before, so this only shortens the
    /// wait when a lease is really about to run out.
    async fn until_next_expiry(&self, every: Duration) -> Duration {
        const MARGIN: Duration = Duration::from_millis(10);
        let now = Utc::now();
        match self
            .inner
            .store
            .next_lease_expiry(Fencing(self).replica_id(), now)
            .await
        {
            Ok(Some(at)) => (at - now)
                .to_std()
                .map_or(every, |left| (left + MARGIN).min(every)),
            Ok(None) => every,
            Err(e) => {
                tracing::debug!(error = %e, "next lease expiry unknown; polling");
                every
            }
        }
    }

    /// Starts the recovery of a session the adoption loop claimed, or
    /// hands out the one under way; `None` when the loop is not adopting
    /// it (any more).
    fn claim_adoption(&self, session: SessionId, lane: Lane) -> Option<SharedRecovery> {
        let mut adoptions = lock(&self.inner.adoptions);
        let entry = adoptions.get_mut(&session)?;
        // One under way or done well is joined; a failed one starts again.
        if let Some(f) = &entry.recovery
            && !matches!(f.peek(), Some(Err(_)))
        {
            return Some(f.clone());
        }
        let executor = ExecutorKey::from(&entry.record);
        let me = self.0.clone();
        // On a task of its own, so a caller that goes away does not cut it short.
        let task = self.spawn_background(tracing::Instrument::in_current_span(async move {
            Pass(&me).recover_shared_in(executor, lane).await
        }));
        let fut: SharedRecovery = async move {
            task.await
                .map_err(|e| Error::Internal(format!("adoption task ended: {e}")))?
        }
        .boxed()
        .shared();
        entry.recovery = Some(fut.clone());
        Some(fut)
    }

    /// A call on a session this replica owns: when the adoption loop
    /// claimed it and has not recovered it yet, recover it now (ahead of
    /// the loop) or wait for the recovery under way, as a call does during
    /// startup recovery. A failed recovery is UNAVAILABLE: it is tried
    /// again (by the next look or call), so the caller retries.
    async fn join_adoption(&self, session: SessionId) -> Result<()> {
        if let Some(recovery) = self.claim_adoption(session, Lane::Call)
            && let Err(e) = recovery.await
        {
            tracing::debug!(%session, error = %e, "adoption recovery failed");
            return Err(Error::Unavailable(format!(
                "session {session} is being adopted by this replica and its recovery failed \
                 ({e}); it is tried again: retry in a moment"
            )));
        }
        Ok(())
    }

    /// Test hook: each heartbeat first awaits `gate`, so a test can hold a
    /// replica's belief that it still owns its sessions (as after a pause,
    /// before its first heartbeat) and prove its writes and agentctl calls
    /// are fenced, without guessing how long that moment lasts.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn gate_heartbeat(&self, gate: crate::pass::PassGate) {
        *lock(&self.inner.heartbeat_gate) = Some(gate);
    }

    /// One heartbeat: the replica row and every lease, then drop what was
    /// lost. False when the database did not answer.
    async fn heartbeat(&self, info: &ReplicaInfo, every: Duration) -> bool {
        let gate = lock(&self.inner.heartbeat_gate).clone();
        if let Some(gate) = gate {
            gate().await;
        }
        let r = &self.inner.config.replica;
        let before = self.owned_sessions();
        match self
            .inner
            .store
            .heartbeat_replica(&r.id, Utc::now(), r.lease_ttl)
            .await
        {
            Ok(now_owned) => {
                lock(&self.inner.database_seen).answered(every);
                let now_owned: HashSet<SessionId> = now_owned.into_iter().collect();
                for lost in before.difference(&now_owned) {
                    Fencing(self).relinquish(*lost);
                }
            }
            Err(sessiond_store::Error::NotFound { .. }) => {
                // Our row was removed (an operator cleaning up): register again.
                let info = ReplicaInfo {
                    heartbeat_at: Utc::now(),
                    ..info.clone()
                };
                if let Err(e) = self.inner.store.register_replica(info).await {
                    tracing::warn!(error = %e, "replica could not register again");
                }
            }
            Err(e) => {
                lock(&self.inner.database_seen).failed();
                tracing::warn!(error = %e, "replica heartbeat failed; leases not renewed");
                return false;
            }
        }
        true
    }

    /// The adoption of expired leases, as a pipeline: up to
    /// `recovery_concurrency` adoptions recover at once, and as soon as a
    /// quarter of those slots is free the next claim tops them up while the
    /// others still recover (claiming only after a whole batch finished
    /// left the slots idle behind its slowest recovery). A claim takes at
    /// most the free slots and its fair share (see
    /// `sessiond_store::Store::claim_expired`), so every survivor keeps
    /// claiming until the dead replica's rows are gone; after a claim cut
    /// to its share the next waits for one of its recoveries to end or
    /// [`SHARE_PAUSE`], so a survivor woken a moment later still gets its
    /// part instead of the first taking half of what is left again and
    /// again. No sleep while claimable rows remain. A claim that finds
    /// nothing means nothing is claimable before the next lease of another
    /// replica runs out: the loop looks again then (at most `every`), and
    /// only then retries adoptions that failed.
    async fn adoption_loop(&self, every: Duration) {
        let concurrency = self.inner.config.recovery_concurrency.max(1);
        let low_water = (concurrency / 4).max(1);
        let slots = Arc::new(Semaphore::new(concurrency));
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<bool>();
        // Nothing to claim before this moment (a claim came back empty).
        let mut dry_until: Option<Instant> = None;
        // The last claim was cut to its fair share: the next one waits a
        // little (a recovery ending, or SHARE_PAUSE) so the other survivors
        // take theirs.
        let mut after_share: Option<Instant> = None;
        let mut burst = Burst::default();
        loop {
            while let Ok(ok) = done_rx.try_recv() {
                burst.done(ok);
                after_share = None;
            }
            let free = slots.available_permits();
            let idle = free == concurrency;
            if idle && burst.end() {
                lock(&self.inner.recovery_profiles).clear();
            }
            let now = Instant::now();
            let database_wait = lock(&self.inner.database_seen).claims_from();
            if let Some(t) = database_wait {
                dry_until = Some(dry_until.map_or(t, |d| d.max(t)));
            }
            let may_claim = dry_until.is_none_or(|t| now >= t)
                && after_share.is_none_or(|t| now >= t + SHARE_PAUSE);
            if may_claim && (idle || free >= low_water) {
                let asked = Instant::now();
                let limit = free.clamp(1, ADOPTION_BATCH as usize);
                after_share = None;
                match self.claim_adoptions(limit, idle).await {
                    Ok((claimed, sessions)) => {
                        if claimed > 0 {
                            if !burst.active() {
                                self.preload_profiles().await;
                            }
                            burst.claimed(claimed, asked);
                            tracing::info!(
                                claimed,
                                in_flight = concurrency - free,
                                claim_ms = ms(asked.elapsed()),
                                "claimed expired leases"
                            );
                        }
                        for session in sessions {
                            // Only this loop takes slots, and claimed at most
                            // the free ones (retried adoptions may wait).
                            let Ok(slot) = slots.clone().acquire_owned().await else {
                                return;
                            };
                            let me = self.0.clone();
                            let done = done_tx.clone();
                            self.spawn_background(async move {
                                let ok = Adoptions(&me).adopt_one(session).await;
                                drop(slot);
                                let _ = done.send(ok);
                            });
                        }
                        if claimed > 0 {
                            dry_until = None;
                            if claimed < limit {
                                after_share = Some(Instant::now());
                            }
                            continue;
                        }
                        dry_until = Some(Instant::now() + self.until_next_expiry(every).await);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "adoption claim failed");
                        if e.kind() == crate::ErrorKind::Unavailable {
                            lock(&self.inner.database_seen).failed();
                        }
                        dry_until = Some(Instant::now() + every);
                    }
                }
            }
            let until = match (dry_until, after_share) {
                (Some(t), _) => t,
                (None, Some(t)) => t + SHARE_PAUSE,
                (None, None) => Instant::now() + every,
            };
            tokio::select! {
                Some(ok) = done_rx.recv() => {
                    burst.done(ok);
                    after_share = None;
                }
                () = self.inner.adoption_wake.notified() => dry_until = None,
                () = tokio::time::sleep_until(until.into()) => {}
            }
        }
    }

    /// Reads every agent profile once for the adoption burst that starts
    /// (as the startup pass does), instead of once per adopted executor;
    /// cleared when the burst ends. A profile edited meanwhile is seen by
    /// the adoptions of the next burst (as with the startup pass).
    async fn preload_profiles(&self) {
        match self.inner.store.list_agent_profiles().await {
            Ok(all) => {
                *lock(&self.inner.recovery_profiles) =
                    all.into_iter().map(|p| (p.id, Arc::new(p))).collect();
            }
            Err(e) => tracing::debug!(error = %e, "profiles not preloaded for adoption"),
        }
    }

    /// Claims up to `limit` expired leases (one transaction, at most
    /// [`ADOPTION_BATCH`]) and records them as owned and to adopt, before
    /// any call can see either. With `retry`, adoptions whose recovery
    /// failed earlier (often a write race with the replica that lost the
    /// lease and has not noticed yet) are handed out again: a session owned
    /// here and never recovered would otherwise stay stuck, its lease
    /// renewed by every heartbeat. Returns how many leases it claimed and
    /// the sessions to recover now.
    async fn claim_adoptions(&self, limit: usize, retry: bool) -> Result<(usize, Vec<SessionId>)> {
        let r = &self.inner.config.replica;
        let limit = u32::try_from(limit)
            .unwrap_or(ADOPTION_BATCH)
            .clamp(1, ADOPTION_BATCH);
        let claims = self.inner.claims.lock().await;
        let claimed = self
            .inner
            .store
            .claim_expired(&r.id, Utc::now(), r.lease_ttl, limit)
            .await?;
        let n = claimed.len();
        let mut sessions = Vec::with_capacity(n);
        {
            let mut adoptions = lock(&self.inner.adoptions);
            if retry {
                adoptions.retain(|_, a| {
                    !matches!(a.recovery.as_ref().and_then(|f| f.peek()), Some(Ok(_)))
                });
                for (session, a) in adoptions.iter() {
                    if a.recovery.as_ref().is_none_or(|f| f.peek().is_some()) {
                        sessions.push(*session);
                    }
                }
            }
            for c in claimed {
                Fencing(self).mark_owned(c.record.session_id, c.epoch);
                if self.adoptable(&c.record) {
                    sessions.push(c.record.session_id);
                    adoptions.insert(
                        c.record.session_id,
                        crate::lease::Adoption {
                            record: c.record,
                            recovery: None,
                        },
                    );
                }
            }
        }
        drop(claims);
        Ok((n, sessions))
    }

    /// Recovers one session the adoption loop claimed (or joins the
    /// recovery a call started); whether it ended well. A failure is kept
    /// to be tried again (by a later look or a call).
    async fn adopt_one(&self, session: SessionId) -> bool {
        let Some(recovery) = self.claim_adoption(session, Lane::Other) else {
            // No longer adopting it (its lease went elsewhere meanwhile).
            return true;
        };
        let result = recovery.await;
        let mut adoptions = lock(&self.inner.adoptions);
        match result {
            Ok(label) => {
                adoptions.remove(&session);
                tracing::info!(%session, outcome = label.as_str(), "adopted");
                true
            }
            Err(e) => {
                if let Some(a) = adoptions.get_mut(&session) {
                    a.recovery = None;
                }
                tracing::error!(%session, error = %e,
                    "adoption recovery failed; tried again on the next look");
                false
            }
        }
    }

    /// Hands the events other replicas commit to this replica's watchers:
    /// each wake names one committed event, which is read from the outbox
    /// (only when someone here watches its session or task) and published;
    /// watchers drop what they saw and re-read the outbox on a skip, so the
    /// order notifications arrive in does not matter. A resync (the
    /// listener reconnected) publishes each watched session's and task's
    /// newest event, which makes a watcher that missed some catch up.
    fn start_event_relay(&self) {
        let Some(mut wakes) = self.inner.store.listen_events(Fencing(self).replica_id()) else {
            return;
        };
        let me = self.0.clone();
        self.spawn_background(async move {
            while let Some(wake) = wakes.recv().await {
                if let Err(e) = Adoptions(&me).relay(wake).await {
                    tracing::debug!(error = %e, "event from another replica not relayed");
                }
            }
        });
    }

    async fn relay(&self, wake: EventWake) -> Result<()> {
        let store = &self.inner.store;
        let bus = &self.inner.bus;
        match wake {
            EventWake::Committed {
                session,
                seq,
                task,
                task_seq: _,
            } => {
                if !bus.watches(session, task) {
                    return Ok(());
                }
                let events = store.events_after(session, seq - 1, 1).await?;
                bus.publish(&events);
            }
            EventWake::LeasesReleased => {
                // Every survivor claims its share now, instead of the first
                // to look taking all of them.
                self.inner.adoption_wake.notify_one();
            }
            EventWake::Resync => {
                let (sessions, tasks) = bus.watched_keys();
                for s in sessions {
                    let last = store.last_event_seq(s).await?;
                    if last > 0 {
                        bus.publish(&store.events_after(s, last - 1, 1).await?);
                    }
                }
                for t in tasks {
                    let last = store.last_task_event_seq(t).await?;
                    if last > 0 {
                        bus.publish(&store.task_events_after(t, last - 1, 1).await?);
                    }
                }
            }
        }
        Ok(())
    }

    /// Graceful handoff: ends every lease of this replica now, so the others
    /// adopt its executors on their next look instead of after the TTL.
    /// Call after the pumps stopped ([`SessionManager::shutdown`]).
    pub(crate) async fn release_leases(&self) -> Result<usize> {
        if Fencing(self).exclusive() {
            return Ok(0);
        }
        let n = self
            .inner
            .store
            .release_leases(Fencing(self).replica_id(), Utc::now())
            .await?;
        self.inner.leases.released_all();
        Ok(n)
    }

    /// A call is about to act on `session`: its executor must be this
    /// replica's. A free or expired lease is claimed here and, when the
    /// executor is live, recovered before the call goes on (the same step
    /// machine as startup); a lease another replica holds is
    /// [`Error::NotOwner`]. A session without an executor needs no owner.
    pub(crate) async fn ensure_owned(&self, session: SessionId) -> Result<()> {
        if Fencing(self).owns(session) {
            return self.join_adoption(session).await;
        }
        let store = &self.inner.store;
        let Some(record) = store.get_executor_for_session(session).await? else {
            return Ok(());
        };
        let me = Fencing(self).replica_id().to_owned();
        let held_elsewhere = record.owner_id.as_deref().is_some_and(|o| o != me)
            && record.lease_expires_at.is_some_and(|t| t > Utc::now());
        if !held_elsewhere {
            let claims = self.inner.claims.lock().await;
            if Fencing(self).owns(session) {
                // The adoption loop claimed it meanwhile: claiming it again
                // would bump the version under the loop's recovery.
                drop(claims);
                return self.join_adoption(session).await;
            }
            let claimed = Fencing(self).claim_records(vec![record.clone()]).await?;
            drop(claims);
            if let Some(record) = claimed.into_iter().next() {
                tracing::info!(%session, executor_id = %record.id, "executor adopted by a call");
                if self.adoptable(&record) {
                    Pass(self)
                        .recover_shared_in((&record).into(), Lane::Call)
                        .await?;
                }
                return Ok(());
            }
        }
        // Someone else holds it (or just claimed it): name them.
        let record = store
            .get_executor_for_session(session)
            .await?
            .unwrap_or(record);
        let owner = record.owner_id.clone().unwrap_or_default();
        let address = store.get_replica(&owner).await?.map(|r| r.address);
        Err(Fencing(self).not_owner(&record, address))
    }
}

impl crate::flows::Ownership for SessionManager {
    async fn ensure_owned(&self, session: SessionId) -> Result<()> {
        Adoptions(self).ensure_owned(session).await
    }
}
