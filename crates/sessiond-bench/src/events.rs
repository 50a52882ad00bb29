//! Event latency: from a committed state change (`Store::commit` returned) to
//! its arrival at `watch_session` subscribers (the stream `WatchSession`
//! serves). The commit itself is timed apart and reported beside it.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::StreamExt;
use sessiond_domain::{EventPayload, SessionState};
use sessiond_engine::SessionManager;
use sessiond_store::Changeset;

use crate::{load::quantile, seed::Seeded};

#[derive(Debug, Clone, Copy)]
pub struct Latency {
    pub subscribers: usize,
    /// Other sessions, each with one watcher of its own, that no event is for.
    pub bystanders: usize,
    pub events: usize,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    /// `Store::commit` of the state change (before the clock above starts).
    pub commit_p50: Duration,
    pub commit_p99: Duration,
}

/// `events` state changes of `session`, one every `gap`, each committed and
/// published the way `SessionManager` does it (`Store::commit`, then
/// `EventBus::publish` of what was stored), while each of `bystanders`
/// (other sessions) has a watcher that must receive nothing.
pub async fn latency(
    manager: &SessionManager,
    session: Seeded,
    subscribers: usize,
    bystanders: &[Seeded],
    events: usize,
    gap: Duration,
) -> anyhow::Result<Latency> {
    let store = manager.store().clone();
    let mut idle = Vec::new();
    for b in bystanders {
        let mut stream = manager
            .watch_session(b.session, store.last_event_seq(b.session).await?)
            .await?;
        idle.push(tokio::spawn(async move { stream.next().await.is_some() }));
    }
    let start_seq = store.last_event_seq(session.session).await?;
    let mut receivers = Vec::new();
    for _ in 0..subscribers {
        let mut stream = manager.watch_session(session.session, start_seq).await?;
        receivers.push(tokio::spawn(async move {
            let mut got = Vec::with_capacity(events);
            while got.len() < events {
                match stream.next().await {
                    Some(Ok(e)) => got.push((e.seq, Instant::now())),
                    _ => break,
                }
            }
            got
        }));
    }
    // Let every watcher finish its (empty) replay before the first commit.
    tokio::time::sleep(Duration::from_millis(200 + subscribers as u64)).await;

    let mut sent: HashMap<i64, Instant> = HashMap::new();
    let mut commits = Vec::with_capacity(events);
    let mut current = store.get_session(session.session).await?;
    for _ in 0..events {
        let to = if current.state == SessionState::Running {
            SessionState::WaitingForInput
        } else {
            SessionState::Running
        };
        let mut next = current.clone();
        next.state = to;
        let change = Changeset::new().update_session(next).event(
            session.session,
            EventPayload::StateChanged {
                from: current.state,
                to,
                error_message: None,
            },
        );
        let before = Instant::now();
        let committed = store.commit(change).await?;
        let t = Instant::now();
        commits.push(t - before);
        manager.events().publish(&committed.events);
        for e in &committed.events {
            sent.insert(e.seq, t);
        }
        current = committed
            .session
            .ok_or_else(|| anyhow::anyhow!("commit returned no session"))?;
        tokio::time::sleep(gap).await;
    }
    let sent = Arc::new(sent);
    let mut lat = Vec::with_capacity(events * subscribers);
    for r in receivers {
        let got = tokio::time::timeout(Duration::from_secs(60), r).await??;
        anyhow::ensure!(
            got.len() == events,
            "a subscriber got {} of {events} events",
            got.len()
        );
        for (seq, at) in got {
            let t = sent
                .get(&seq)
                .ok_or_else(|| anyhow::anyhow!("unexpected seq {seq}"))?;
            lat.push(at.saturating_duration_since(*t));
        }
    }
    for w in idle {
        anyhow::ensure!(!w.is_finished(), "a bystander's watcher got an event");
        w.abort();
    }
    lat.sort_unstable();
    commits.sort_unstable();
    Ok(Latency {
        subscribers,
        bystanders: bystanders.len(),
        events,
        p50: quantile(&lat, 0.5),
        p99: quantile(&lat, 0.99),
        max: lat.last().copied().unwrap_or_default(),
        commit_p50: quantile(&commits, 0.5),
        commit_p99: quantile(&commits, 0.99),
    })
}
