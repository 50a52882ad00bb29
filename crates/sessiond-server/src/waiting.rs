//! What `sessiond serve` answers while its database does not answer yet
//! (the machine booting, PostgreSQL restarted with it): it listens at once
//! instead of refusing connections, health says NOT_SERVING, and every
//! other call is UNAVAILABLE `database_unavailable` with `retry-after-ms`
//! and the database's last error, which clients retry. The real server
//! takes the same socket over once the database answers.

use std::task::{Context, Poll};

use futures::future::{BoxFuture, FutureExt};
use http::{HeaderValue, StatusCode};
use tokio::sync::watch;
use tonic::body::Body;
use tower::{Layer, Service};

/// How long a client is told to wait before it retries.
const RETRY_AFTER_MS: &str = "1000";

/// Answers every call but health's with the wait: `why` holds the
/// database's last error. Two of them: outside gRPC-web's translation,
/// for plain HTTP (which that layer would refuse as a bad request); and
/// inside it, for gRPC and gRPC-web.
#[derive(Clone)]
pub(crate) struct WaitingLayer {
    pub(crate) why: watch::Receiver<Option<String>>,
    /// This one answers plain HTTP and passes gRPC on; else the reverse.
    pub(crate) http: bool,
}

impl<S> Layer<S> for WaitingLayer {
    type Service = Waiting<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Waiting {
            inner,
            why: self.why.clone(),
            http: self.http,
        }
    }
}

#[derive(Clone)]
pub(crate) struct Waiting<S> {
    inner: S,
    why: watch::Receiver<Option<String>>,
    http: bool,
}

impl<S> Waiting<S> {
    /// The database's error only behind auth (plain HTTP is answered
    /// before it): it names the database's host.
    fn message(&self) -> String {
        let why = match self.http {
            true => String::new(),
            false => self
                .why
                .borrow()
                .as_deref()
                .map(|e| format!(" ({})", e.trim_end()))
                .unwrap_or_default(),
        };
        format!(
            "sessiond is starting and its database does not answer yet{why}; \
             calls are served once it does: retry shortly"
        )
    }
}

impl<S, B> Service<http::Request<B>> for Waiting<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let grpc = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let health = request.uri().path().starts_with(crate::auth::PUBLIC_PREFIX);
        if health || grpc == self.http {
            let clone = self.inner.clone();
            let mut inner = std::mem::replace(&mut self.inner, clone);
            return inner.call(request).boxed();
        }
        let message = self.message();
        let response = if grpc {
            let mut status = tonic::Status::unavailable(message);
            let meta = status.metadata_mut();
            meta.insert(
                crate::error::ERROR_METADATA,
                tonic::metadata::MetadataValue::from_static("database_unavailable"),
            );
            meta.insert(
                crate::forward::RETRY_AFTER_MS,
                tonic::metadata::MetadataValue::from_static(RETRY_AFTER_MS),
            );
            status.into_http()
        } else {
            // A browser (the console) or another HTTP client.
            let mut response = http::Response::new(Body::new(http_body_util::Full::new(
                bytes::Bytes::from(format!("{message}\n")),
            )));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let headers = response.headers_mut();
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        };
        futures::future::ready(Ok(response)).boxed()
    }
}
