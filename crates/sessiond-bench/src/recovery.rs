//! Startup recovery at scale, beside its baseline measured in the same run.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::Utc;
use futures::StreamExt;
use sessiond_domain::OutcomeLabel;
use sessiond_engine::{ManagerConfig, SessionManager};
use sessiond_executor::{
    AgentctlClient, Backoff, ClientConfig, Executor,
    remote::{RemoteConfig, RemoteExecutor},
};
use sessiond_store::{Changeset, Store, StoreOptions};

/// One recovery figure and its baseline.
#[derive(Debug, Clone)]
pub struct RecoveryRow {
    pub label: String,
    pub n: usize,
    pub recovery: Duration,
    pub outcomes: String,
    pub base_read: Duration,
    pub base_health: Duration,
    pub base_write: Duration,
    /// recovery / baseline of each round, measured back to back.
    pub round_ratios: Vec<f64>,
}

impl RecoveryRow {
    /// The row of `rounds` (recovery, [read, health, write]) pairs: median
    /// recovery beside the median baseline, and as the ratio the median of
    /// the rounds' own ratios (each pair measured back to back, so a drift
    /// of the shared machine's load between rounds cancels).
    pub fn from_rounds(
        label: String,
        n: usize,
        outcomes: String,
        rounds: &[(Duration, [Duration; 3])],
    ) -> RecoveryRow {
        let mut recoveries: Vec<Duration> = rounds.iter().map(|(r, _)| *r).collect();
        recoveries.sort();
        let mut baselines: Vec<[Duration; 3]> = rounds.iter().map(|(_, b)| *b).collect();
        baselines.sort_by_key(|[r, h, w]| *r + *h + *w);
        let [base_read, base_health, base_write] = baselines
            .get(baselines.len() / 2)
            .copied()
            .unwrap_or_default();
        let round_ratios = rounds
            .iter()
            .map(|(r, [a, b, c])| r.as_secs_f64() / (*a + *b + *c).as_secs_f64().max(1e-9))
            .collect();
        RecoveryRow {
            label,
            n,
            recovery: recoveries
                .get(recoveries.len() / 2)
                .copied()
                .unwrap_or_default(),
            outcomes,
            base_read,
            base_health,
            base_write,
            round_ratios,
        }
    }

    pub fn baseline(&self) -> Duration {
        self.base_read + self.base_health + self.base_write
    }

    pub fn ratio(&self) -> f64 {
        let mut r = self.round_ratios.clone();
        if r.is_empty() {
            return self.recovery.as_secs_f64() / self.baseline().as_secs_f64().max(1e-9);
        }
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    }

    /// The rounds' ratios in the order measured, e.g. `0.93 1.05 1.10`.
    pub fn rounds_text(&self) -> String {
        self.round_ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

pub fn client_config() -> ClientConfig {
    ClientConfig {
        connect_timeout: Duration::from_secs(5),
        call_timeout: Duration::from_secs(10),
        ..ClientConfig::default()
    }
}

pub fn manager_config() -> ManagerConfig {
    ManagerConfig {
        executor_deadline: Duration::from_secs(20),
        liveness_interval: None,
        ..ManagerConfig::default()
    }
}

pub fn remote_driver() -> Arc<dyn Executor> {
    Arc::new(RemoteExecutor::new(RemoteConfig {
        client: client_config(),
        backoff: Backoff::default(),
        ready_deadline: Duration::from_secs(10),
        ..RemoteConfig::default()
    }))
}

pub async fn open(url: &str) -> anyhow::Result<Store> {
    Ok(Store::connect(url, StoreOptions::default()).await?)
}

/// The bare cost recovery cannot avoid: read the rows, one `Health` per
/// executor at the recovery's concurrency (one connection each, as every
/// executor has its own address and secret), write the results in batches.
pub async fn baseline(url: &str, concurrency: usize) -> anyhow::Result<[Duration; 3]> {
    let store = open(url).await?;
    let t0 = Instant::now();
    let rows = store.load_recoverable_executors().await?;
    let read = t0.elapsed();

    let t1 = Instant::now();
    let config = client_config();
    let healthy: Vec<_> = futures::stream::iter(rows)
        .map(|r| {
            let config = config.clone();
            async move {
                let client = AgentctlClient::new(
                    r.agentctl_url.as_deref().unwrap_or_default(),
                    &r.auth_secret,
                    &config,
                )?;
                client.verify_identity(r.id).await?;
                Ok::<_, anyhow::Error>(r)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let health = t1.elapsed();
    let rows = healthy.into_iter().collect::<anyhow::Result<Vec<_>>>()?;

    let t2 = Instant::now();
    let now = Utc::now();
    for chunk in rows.chunks(500) {
        let batch = chunk
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r.last_seen_at = Some(now);
                Changeset::new().update_executor(r)
            })
            .collect();
        for r in store.commit_batch(batch).await? {
            r?;
        }
    }
    let write = t2.elapsed();
    Ok([read, health, write])
}

/// A "restart": a fresh store pool and manager; times `recover_all`.
pub async fn recover(
    url: &str,
    drivers: Vec<Arc<dyn Executor>>,
    expect: OutcomeLabel,
    n: usize,
) -> anyhow::Result<(Duration, String)> {
    recover_with(url, drivers, expect, n, true).await
}

/// [`recover`], with calls jumping the recovery queue (`priority`, the
/// default) or without the queue at all (the availability baseline).
pub async fn recover_with(
    url: &str,
    drivers: Vec<Arc<dyn Executor>>,
    expect: OutcomeLabel,
    n: usize,
    priority: bool,
) -> anyhow::Result<(Duration, String)> {
    let store = open(url).await?;
    let manager = SessionManager::new(store, drivers, manager_config());
    manager.recovery().set_recovery_priority(priority);
    let t = Instant::now();
    let summary = manager.recovery().recover_all().await?;
    let took = t.elapsed();
    manager.shutdown();
    let outcomes = summary
        .counts
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    if summary.count(expect) != n || summary.failed > 0 {
        let first_error = summary
            .outcomes
            .iter()
            .find_map(|(_, o)| o.as_ref().err().cloned());
        anyhow::bail!(
            "recovery of {n} executors: expected {n} {expect}, got {outcomes} (failed {}; first error {first_error:?})",
            summary.failed
        );
    }
    Ok((took, outcomes))
}

pub fn remote_drivers() -> Vec<Arc<dyn Executor>> {
    vec![remote_driver()]
}
