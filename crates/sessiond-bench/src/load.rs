//! Closed-loop unary load: C clients, each on its own connection, call as
//! fast as answers come for a fixed time; throughput and latency quantiles.

use std::time::{Duration, Instant};

use sessiond_proto::sessiond::v1::{
    GetSessionStatusRequest, session_service_client::SessionServiceClient,
};
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

use crate::seed::Seeded;

#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub calls: u64,
    pub errors: u64,
    pub per_sec: f64,
    pub p50: Duration,
    pub p99: Duration,
    /// CPU the server process used over the load (user + system; zero
    /// until the caller measures it): what a call costs the server, which
    /// the shared machine's scheduling moves less than the rate.
    pub server_cpu: Duration,
}

impl Load {
    /// The server's CPU per answered call.
    pub fn cpu_per_call(&self) -> Duration {
        self.server_cpu / u32::try_from(self.calls.max(1)).unwrap_or(u32::MAX)
    }

    /// Two runs of the same load as one: calls and errors added, the rate
    /// and the quantiles averaged.
    pub fn mean(&self, other: &Load) -> Load {
        Load {
            calls: self.calls + other.calls,
            errors: self.errors + other.errors,
            per_sec: (self.per_sec + other.per_sec) / 2.0,
            p50: (self.p50 + other.p50) / 2,
            p99: (self.p99 + other.p99) / 2,
            server_cpu: self.server_cpu + other.server_cpu,
        }
    }
}

pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub(crate) async fn channel(addr: &str) -> anyhow::Result<Channel> {
    Ok(Endpoint::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await?)
}

/// Runs `clients` loops of `call` for `duration` after a short warm-up.
async fn run<F, Fut>(clients: usize, duration: Duration, make: F) -> anyhow::Result<Load>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(u64, Vec<Duration>)>> + Send + 'static,
{
    let mut tasks = Vec::new();
    let started = Instant::now();
    for i in 0..clients {
        tasks.push(tokio::spawn(make(i)));
    }
    let mut lat = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (e, l) = t.await??;
        errors += e;
        lat.extend(l);
    }
    let elapsed = started.elapsed().min(duration + Duration::from_secs(1));
    lat.sort_unstable();
    Ok(Load {
        calls: lat.len() as u64,
        errors,
        per_sec: lat.len() as f64 / elapsed.as_secs_f64(),
        p50: quantile(&lat, 0.50),
        p99: quantile(&lat, 0.99),
        server_cpu: Duration::ZERO,
    })
}

/// GetSessionStatus against a `sessiond serve` at `addr`, over the seeded sessions.
pub async fn status(
    addr: &str,
    sessions: &[Seeded],
    clients: usize,
    duration: Duration,
) -> anyhow::Result<Load> {
    // The requests made once: a client holds its ids as text already.
    let requests: std::sync::Arc<[GetSessionStatusRequest]> = sessions
        .iter()
        .map(|s| GetSessionStatusRequest {
            task_id: s.task.to_string(),
            session_id: s.session.to_string(),
        })
        .collect();
    let mut channels = Vec::new();
    for _ in 0..clients {
        channels.push(channel(addr).await?);
    }
    run(clients, duration, move |i| {
        let mut client = SessionServiceClient::new(channels[i].clone());
        let requests = requests.clone();
        async move {
            let mut lat = Vec::with_capacity(100_000);
            let mut errors = 0;
            let mut k = i * 7919;
            let end = Instant::now() + duration;
            while Instant::now() < end {
                k = k.wrapping_add(1);
                let request = requests[k % requests.len()].clone();
                let t = Instant::now();
                let r = client.get_session_status(request).await;
                match r {
                    Ok(_) => lat.push(t.elapsed()),
                    Err(_) => errors += 1,
                }
            }
            Ok((errors, lat))
        }
    })
    .await
}

/// The bare unary yardstick: `grpc.health.v1.Health/Check` at `addr`.
pub async fn echo(addr: &str, clients: usize, duration: Duration) -> anyhow::Result<Load> {
    let mut channels = Vec::new();
    for _ in 0..clients {
        channels.push(channel(addr).await?);
    }
    run(clients, duration, move |i| {
        let mut client = HealthClient::new(channels[i].clone());
        async move {
            let mut lat = Vec::with_capacity(100_000);
            let mut errors = 0;
            let end = Instant::now() + duration;
            while Instant::now() < end {
                let t = Instant::now();
                match client
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                {
                    Ok(_) => lat.push(t.elapsed()),
                    Err(_) => errors += 1,
                }
            }
            Ok((errors, lat))
        }
    })
    .await
}

/// Waits until the server at `addr` reports SERVING (startup recovery done).
pub async fn wait_serving(addr: &str, limit: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        if let Ok(ch) = channel(addr).await {
            let mut c = HealthClient::new(ch);
            if let Ok(r) = c
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                && r.into_inner().status
                    == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            {
                return Ok(started.elapsed());
            }
        }
        if started.elapsed() > limit {
            anyhow::bail!("{addr} did not report SERVING within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
