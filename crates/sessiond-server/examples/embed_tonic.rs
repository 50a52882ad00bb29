//! Embeds sessiond's gRPC services in an existing tonic server that has
//! authentication of its own (here: an `x-api-key` header checked by a
//! tower layer), beside a service of the embedder's.
//!
//! ```text
//! cargo run -p sessiond-server --example embed_tonic
//! ```
//!
//! It builds sessiond on a SQLite database in a temporary directory, serves
//! it on a free loopback port, then plays the client: a call without the
//! key is refused by *our* layer, one with it creates a task, and health
//! says SERVING once startup recovery is done. Then it shuts down the way
//! `sessiond serve` does. `cargo xtask ci` runs it.

use std::{
    task::{Context, Poll},
    time::Duration,
};

use sessiond_proto::sessiond::v1 as pb;
use sessiond_server::{Sessiond, config::FileConfig};
use tonic::{
    Code,
    body::Body,
    transport::{Channel, Server},
};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// The embedder's own authentication: every call must carry `x-api-key`.
#[derive(Debug, Clone)]
struct ApiKeyLayer(&'static str);

impl<S> tower::Layer<S> for ApiKeyLayer {
    type Service = ApiKey<S>;
    fn layer(&self, inner: S) -> ApiKey<S> {
        ApiKey { key: self.0, inner }
    }
}

#[derive(Debug, Clone)]
struct ApiKey<S> {
    key: &'static str,
    inner: S,
}

impl<S> tower::Service<http::Request<Body>> for ApiKey<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let allowed = request
            .headers()
            .get("x-api-key")
            .is_some_and(|v| v.as_bytes() == self.key.as_bytes());
        if !allowed {
            let status = tonic::Status::unauthenticated("x-api-key missing or wrong");
            return Box::pin(async move { Ok(status.into_http()) });
        }
        Box::pin(self.inner.call(request))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    // The configuration is a value: here the TOML form, validated. Our
    // layer authenticates, so sessiond's own tokens are not needed.
    let mut file = FileConfig::parse(&format!(
        r#"
        data_dir = "{data}"
        [executors]
        worktree_roots = ["{data}"]
        "#,
        data = dir.path().display()
    ))?;
    file.default_agent = "demo".into();
    let config = file.validate_for_embedding()?;
    let sessiond = Sessiond::builder(config).build().await?;

    // The embedder's server: its layer, its health entries, sessiond's services.
    let health = sessiond.health_reporter();
    health
        .set_service_status("example.Embedder", tonic_health::ServingStatus::Serving)
        .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let server = tokio::spawn(
        Server::builder()
            .layer(ApiKeyLayer("s3cret"))
            .add_routes(sessiond.services().into_routes())
            // Nagle off: a reply written in parts would otherwise wait for
            // the client's delayed ACK (40 ms).
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                sessiond.stopped(),
            ),
    );
    sessiond.start(&address.to_string()).await?;

    // A client of the embedder's API.
    let channel = Channel::from_shared(format!("http://{address}"))?
        .connect()
        .await?;
    let mut sessions = pb::session_service_client::SessionServiceClient::new(channel.clone());
    let refused = sessions
        .create_task(pb::CreateTaskRequest {
            title: "no key".into(),
        })
        .await
        .expect_err("a call without the key is refused");
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");

    let with_key = |mut request: tonic::Request<()>| {
        request
            .metadata_mut()
            .insert("x-api-key", "s3cret".parse().expect("ascii"));
        Ok(request)
    };
    let mut health_client = HealthClient::with_interceptor(channel.clone(), with_key);
    let mut serving = false;
    for _ in 0..200 {
        let status = health_client
            .check(HealthCheckRequest {
                service: "sessiond.v1.SessionService".into(),
            })
            .await?
            .into_inner()
            .status;
        if status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
            serving = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(serving, "health never turned SERVING");
    let mut sessions =
        pb::session_service_client::SessionServiceClient::with_interceptor(channel, with_key);
    let task = sessions
        .create_task(pb::CreateTaskRequest {
            title: "embedded".into(),
        })
        .await?
        .into_inner()
        .task
        .ok_or("CreateTask returned no task")?;
    let profiles = sessions
        .list_agent_profiles(pb::ListAgentProfilesRequest::default())
        .await?
        .into_inner();
    tracing::info!(task = %task.id, profiles = profiles.profiles.len(), "served");
    // The same store, reached from Rust without gRPC.
    let stored = sessiond.store().get_task(task.id.parse()?).await?;
    assert_eq!(stored.title, "embedded");

    sessiond.shutdown().await;
    server.await??;
    sessiond.release().await;
    #[allow(clippy::print_stdout)]
    {
        println!(
            "embed_tonic: ok (task {} created through the embedder's server)",
            task.id
        );
    }
    Ok(())
}
