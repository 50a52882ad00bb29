//! Replicas and executor leases: several sessiond processes on one database.
//!
//! A replica registers a row in `replicas` and heartbeats it. Every live
//! executor is owned by one replica through a lease on its
//! `executors_running` row (`owner_id`, `lease_expires_at`, `lease_epoch`):
//! claimed with a conditional `UPDATE` (no owner, the claimer itself, or an
//! expired lease), which adds one to the epoch (the fencing token) and to
//! the row's version (so a writer still holding the previous owner's copy
//! gets a `Conflict`), renewed for all of a replica's executors in one
//! statement, and released (expired at once) on a graceful stop. Times are
//! the replicas' clocks: they must agree well within one lease TTL.
//! Changeset updates never write the lease columns (see `changeset.rs`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use sessiond_domain::{ExecutorId, ExecutorRecord, ExecutorStatus, SessionId};

use crate::{
    Error, Result,
    conn::{self, AnyConnection, Ts},
    rows::ExecutorRow,
    schema::{executors_running, replicas},
    store::Store,
};

/// One replica as registered, with what it owns now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaInfo {
    /// The replica id (stable across its restarts).
    pub id: String,
    /// Where its API is reached (`host:port`).
    pub address: String,
    /// The host it runs on.
    pub hostname: String,
    /// Its process id there.
    pub pid: i64,
    /// When it registered.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// How long its leases last without a renewal.
    pub lease_ttl: Duration,
    /// Executors it holds an unexpired lease on (not `stopped`).
    pub owned_executors: i64,
}

impl ReplicaInfo {
    /// Whether its last heartbeat is within its lease TTL of `now`.
    pub fn is_live(&self, now: DateTime<Utc>) -> bool {
        chrono::Duration::from_std(self.lease_ttl)
            .ok()
            .and_then(|ttl| self.heartbeat_at.checked_add_signed(ttl))
            .is_none_or(|until| until > now)
    }
}

/// An executor this replica just claimed: its record (owner, lease and
/// version as written by the claim) and its new lease epoch.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The executor record as the claim wrote it.
    pub record: ExecutorRecord,
    /// The lease epoch this replica now holds (its fencing token).
    pub epoch: i64,
}

#[derive(Queryable, Selectable, Insertable, AsChangeset)]
#[diesel(table_name = replicas)]
struct ReplicaRow {
    id: String,
    address: String,
    hostname: String,
    pid: i64,
    started_at: Ts,
    heartbeat_at: Ts,
    lease_ttl_ms: i64,
}

fn ttl_ms(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn expiry(now: DateTime<Utc>, ttl: Duration) -> Ts {
    Ts::new(now + chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::days(1)))
}

/// Status values whose executor needs an owner.
fn live_statuses() -> [&'static str; 3] {
    [
        ExecutorStatus::Starting.as_str(),
        ExecutorStatus::Ready.as_str(),
        ExecutorStatus::Error.as_str(),
    ]
}

/// Claims one executor for `owner` if it is free (no owner, `owner`
/// itself, or an expired lease), or whatever its lease says when `force`.
/// Returns the new epoch, `None` when another replica holds it.
fn claim_one(
    c: &mut AnyConnection,
    id: &str,
    owner: &str,
    now: DateTime<Utc>,
    ttl: Duration,
    force: bool,
) -> Result<Option<i64>> {
    let at = Ts::new(now);
    let target = executors_running::table.find(id);
    let set = (
        executors_running::owner_id.eq(Some(owner)),
        executors_running::lease_expires_at.eq(Some(expiry(now, ttl))),
        executors_running::lease_epoch.eq(executors_running::lease_epoch + 1),
        executors_running::version.eq(executors_running::version + 1),
    );
    let n = if force {
        diesel::update(target).set(set).execute(c)?
    } else {
        diesel::update(
            target.filter(
                executors_running::owner_id
                    .is_null()
                    .or(executors_running::owner_id.eq(owner))
                    .or(executors_running::lease_expires_at.is_null())
                    .or(executors_running::lease_expires_at.le(at)),
            ),
        )
        .set(set)
        .execute(c)?
    };
    if n == 0 {
        return Ok(None);
    }
    let epoch = executors_running::table
        .find(id)
        .select(executors_running::lease_epoch)
        .get_result(c)?;
    Ok(Some(epoch))
}

/// Replicas whose last heartbeat is within their lease TTL of `now`.
fn live_replicas(c: &mut AnyConnection, now: DateTime<Utc>) -> Result<i64> {
    let beats: Vec<(Ts, i64)> = replicas::table
        .select((replicas::heartbeat_at, replicas::lease_ttl_ms))
        .load(c)?;
    Ok(beats
        .into_iter()
        .filter(|(at, ttl_ms)| at.0 + chrono::Duration::milliseconds(*ttl_ms) > now)
        .count() as i64)
}

/// PostgreSQL: locks replica `owner`'s executor rows in id order before a
/// statement that updates them all, so it takes its row locks in the same
/// order as the claims (one row at a time, in id order) and the two cannot
/// deadlock. SQLite has one writer and needs nothing.
fn lock_owned_in_id_order(c: &mut AnyConnection, owner: &str) -> Result<()> {
    if let AnyConnection::Pg(pg) = c {
        diesel::sql_query(
            "SELECT id FROM executors_running WHERE owner_id = $1 ORDER BY id FOR UPDATE",
        )
        .bind::<diesel::sql_types::Text, _>(owner)
        .execute(pg)?;
    }
    Ok(())
}

fn load_claimed(c: &mut AnyConnection, id: &str, epoch: i64) -> Result<Claimed> {
    let record = executors_running::table
        .find(id)
        .select(ExecutorRow::as_select())
        .get_result(c)?
        .into_domain()?;
    Ok(Claimed { record, epoch })
}

impl Store {
    /// Registers (or re-registers, after a restart) replica `info.id`.
    pub async fn register_replica(&self, info: ReplicaInfo) -> Result<()> {
        self.write(move |c| {
            let row = ReplicaRow {
                id: info.id,
                address: info.address,
                hostname: info.hostname,
                pid: info.pid,
                started_at: Ts::new(info.started_at),
                heartbeat_at: Ts::new(info.heartbeat_at),
                lease_ttl_ms: ttl_ms(info.lease_ttl),
            };
            let n = diesel::update(replicas::table.find(&row.id))
                .set(&row)
                .execute(c)?;
            if n == 0 {
                diesel::insert_into(replicas::table)
                    .values(&row)
                    .execute(c)?;
            }
            Ok(())
        })
        .await
    }

    /// The replica's heartbeat and, in the same transaction, the renewal of
    /// every lease it holds (expired ones too, as long as nobody claimed
    /// them). Returns the sessions whose executors it owns now: an executor
    /// it thought it owned and that is not in the list was adopted by
    /// another replica.
    pub async fn heartbeat_replica(
        &self,
        id: &str,
        now: DateTime<Utc>,
        ttl: Duration,
    ) -> Result<Vec<SessionId>> {
        let id = id.to_owned();
        self.write(move |c| {
            let beat = diesel::update(replicas::table.find(&id))
                .set(replicas::heartbeat_at.eq(Ts::new(now)))
                .execute(c)?;
            if beat == 0 {
                return Err(Error::not_found("replica", &id));
            }
            lock_owned_in_id_order(c, &id)?;
            diesel::update(executors_running::table.filter(executors_running::owner_id.eq(&id)))
                .set(executors_running::lease_expires_at.eq(Some(expiry(now, ttl))))
                .execute(c)?;
            let owned: Vec<String> = executors_running::table
                .filter(executors_running::owner_id.eq(&id))
                .select(executors_running::session_id)
                .load(c)?;
            owned
                .iter()
                .map(|s| {
                    SessionId::parse(s).map_err(|e| Error::corrupt("executor", s, e.to_string()))
                })
                .collect()
        })
        .await
    }

    /// Ends replica `id`'s leases at once (a graceful stop): the others
    /// adopt its executors on their next look, without waiting for a TTL.
    /// Its row stays, with a heartbeat one TTL old, so it no longer counts
    /// as live (the others' fair shares of its executors are split among
    /// them) until it starts again; on PostgreSQL the others are told at
    /// once (a `released` notification), instead of at their next look.
    pub async fn release_leases(&self, id: &str, now: DateTime<Utc>) -> Result<usize> {
        let id = id.to_owned();
        self.write(move |c| {
            lock_owned_in_id_order(c, &id)?;
            let released = diesel::update(
                executors_running::table.filter(executors_running::owner_id.eq(&id)),
            )
            .set(executors_running::lease_expires_at.eq(Some(Ts::new(now))))
            .execute(c)?;
            let ttl_ms: Option<i64> = replicas::table
                .find(&id)
                .select(replicas::lease_ttl_ms)
                .get_result(c)
                .optional()?;
            if let Some(ttl_ms) = ttl_ms {
                let gone = now - chrono::Duration::milliseconds(ttl_ms);
                diesel::update(replicas::table.find(&id))
                    .set(replicas::heartbeat_at.eq(Ts::new(gone)))
                    .execute(c)?;
            }
            crate::events::notify_released(c, &id)?;
            Ok(released)
        })
        .await
    }

    /// Every registered replica, live or not, with the executors each holds
    /// an unexpired lease on.
    pub async fn list_replicas(&self, now: DateTime<Utc>) -> Result<Vec<ReplicaInfo>> {
        self.read(move |c| {
            let rows: Vec<ReplicaRow> = replicas::table
                .select(ReplicaRow::as_select())
                .order(replicas::id)
                .load(c)?;
            let owners: Vec<Option<String>> = executors_running::table
                .filter(executors_running::status.eq_any(live_statuses()))
                .filter(executors_running::lease_expires_at.gt(Ts::new(now)))
                .select(executors_running::owner_id)
                .load(c)?;
            Ok(rows
                .into_iter()
                .map(|r| ReplicaInfo {
                    owned_executors: owners
                        .iter()
                        .filter(|o| o.as_deref() == Some(r.id.as_str()))
                        .count() as i64,
                    id: r.id,
                    address: r.address,
                    hostname: r.hostname,
                    pid: r.pid,
                    started_at: r.started_at.0,
                    heartbeat_at: r.heartbeat_at.0,
                    lease_ttl: Duration::from_millis(u64::try_from(r.lease_ttl_ms).unwrap_or(1)),
                })
                .collect())
        })
        .await
    }

    /// One replica's row (`None` when it never registered).
    pub async fn get_replica(&self, id: &str) -> Result<Option<ReplicaInfo>> {
        let id = id.to_owned();
        let now = conn::now();
        Ok(self
            .list_replicas(now)
            .await?
            .into_iter()
            .find(|r| r.id == id))
    }

    /// Claims each of `ids` for `owner` when free (no owner, `owner`
    /// itself, or an expired lease; any lease with `force`, for a store that
    /// only this process may open). One transaction; returns what it got.
    pub async fn claim_executors(
        &self,
        owner: &str,
        ids: Vec<ExecutorId>,
        now: DateTime<Utc>,
        ttl: Duration,
        force: bool,
    ) -> Result<Vec<Claimed>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let owner = owner.to_owned();
        // Rows are locked in id order by every multi-row writer here, so
        // two replicas claiming and renewing at once never deadlock.
        let mut ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        ids.sort_unstable();
        self.write(move |c| {
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(epoch) = claim_one(c, &id, &owner, now, ttl, force)? {
                    out.push(load_claimed(c, &id, epoch)?);
                }
            }
            Ok(out)
        })
        .await
    }

    /// When the next lease of another replica runs out, if any is still
    /// running: the moment an adoption round can next find something (a
    /// dead replica's leases expire when its last renewal says). Live
    /// replicas renew theirs every third of their TTL, so theirs stay ahead.
    pub async fn next_lease_expiry(
        &self,
        except: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>> {
        let except = except.to_owned();
        self.read(move |c| {
            let next: Option<Option<Ts>> = executors_running::table
                .filter(executors_running::status.eq_any(live_statuses()))
                .filter(executors_running::owner_id.ne(&except))
                .filter(executors_running::lease_expires_at.gt(Ts::new(now)))
                .order(executors_running::lease_expires_at)
                .select(executors_running::lease_expires_at)
                .first(c)
                .optional()?;
            Ok(next.flatten().map(|t| t.0))
        })
        .await
    }

    /// Claims live executors (`starting`, `ready`, `error`) whose lease is
    /// expired or that have no owner, oldest first: the adoption of a dead
    /// (or stopped) replica's executors. It takes at most `limit`, and at
    /// most its fair share: what is up for adoption divided by the live
    /// replicas (at least one), so the survivors of a crash split the work
    /// instead of the quickest taking all. Several replicas may run this at
    /// once; the conditional update gives each executor to one of them
    /// (on PostgreSQL they also skip each other's locked rows, so two
    /// claims at the same moment both get their share).
    pub async fn claim_expired(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        ttl: Duration,
        limit: u32,
    ) -> Result<Vec<Claimed>> {
        let owner = owner.to_owned();
        self.write(move |c| {
            let at = Ts::new(now);
            let up_for_adoption = || {
                executors_running::table
                    .filter(executors_running::status.eq_any(live_statuses()))
                    .filter(
                        executors_running::owner_id
                            .is_null()
                            .or(executors_running::lease_expires_at.is_null())
                            .or(executors_running::lease_expires_at.le(at)),
                    )
            };
            let waiting: i64 = up_for_adoption().count().get_result(c)?;
            if waiting == 0 {
                return Ok(Vec::new());
            }
            let live = live_replicas(c, now)?.max(1);
            let share = (waiting + live - 1) / live;
            let take = share.min(i64::from(limit.max(1)));
            // UUIDv7 ids: id order is creation order, and the lock order of
            // every multi-row writer here.
            if let AnyConnection::Pg(pg) = c {
                // Survivors claiming at the same moment take disjoint rows:
                // rows another claim has locked are skipped, not waited for
                // (waiting, the conditional update would then find them
                // taken and this claim would come back empty while rows
                // remain). The rows read are locked until the commit, so
                // the update below takes exactly them, in one statement.
                let ids: Vec<String> = up_for_adoption()
                    .order(executors_running::id)
                    .select(executors_running::id)
                    .limit(take)
                    .for_update()
                    .skip_locked()
                    .load(pg)?;
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let mut rows: Vec<ExecutorRow> = diesel::update(
                    executors_running::table
                        .filter(executors_running::id.eq_any(&ids))
                        .filter(
                            executors_running::owner_id
                                .is_null()
                                .or(executors_running::lease_expires_at.is_null())
                                .or(executors_running::lease_expires_at.le(at)),
                        ),
                )
                .set((
                    executors_running::owner_id.eq(Some(&owner)),
                    executors_running::lease_expires_at.eq(Some(expiry(now, ttl))),
                    executors_running::lease_epoch.eq(executors_running::lease_epoch + 1),
                    executors_running::version.eq(executors_running::version + 1),
                ))
                .returning(ExecutorRow::as_returning())
                .get_results(pg)?;
                rows.sort_unstable_by(|a, b| a.id.cmp(&b.id));
                return rows
                    .into_iter()
                    .map(|row| {
                        let record = row.into_domain()?;
                        let epoch = record.lease_epoch;
                        Ok(Claimed { record, epoch })
                    })
                    .collect();
            }
            let ids: Vec<String> = up_for_adoption()
                .order(executors_running::id)
                .select(executors_running::id)
                .limit(take)
                .load(c)?;
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(epoch) = claim_one(c, &id, &owner, now, ttl, false)? {
                    out.push(load_claimed(c, &id, epoch)?);
                }
            }
            Ok(out)
        })
        .await
    }
}
