//! CORS for the calls that need it: a request with an `Origin` header (a
//! browser's) goes through `tower_http`'s CORS service; any other client
//! gets no CORS headers, which no client but a browser reads and which
//! every call would otherwise pay for twice (`vary` and
//! `access-control-expose-headers` encoded by sessiond and decoded by the
//! client: a tenth of a GetSessionStatus's cost under load).

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures::future::Either;
use tower::{Layer, Service};
use tower_http::cors::{Cors, CorsLayer};

/// Wraps a service in [`BrowserCors`].
#[derive(Debug, Clone)]
pub(crate) struct BrowserCorsLayer(pub(crate) CorsLayer);

impl<S> Layer<S> for BrowserCorsLayer {
    type Service = BrowserCors<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BrowserCors {
            cors: Arc::new(self.0.clone()),
            inner,
        }
    }
}

/// `inner`, behind CORS for requests that carry an `Origin`.
#[derive(Debug, Clone)]
pub(crate) struct BrowserCors<S> {
    /// Shared: the server clones its service stack for every call, and a
    /// `CorsLayer`'s clone copies its header lists.
    cors: Arc<CorsLayer>,
    inner: S,
}

impl<S, B, R> Service<http::Request<B>> for BrowserCors<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>> + Clone,
    R: Default,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Either<tower_http::cors::ResponseFuture<S::Future>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The clone that was polled ready serves this call; keep a fresh one.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        if request.headers().contains_key(http::header::ORIGIN) {
            let mut cors: Cors<S> = self.cors.layer(ready);
            Either::Left(cors.call(request))
        } else {
            let mut ready = ready;
            Either::Right(ready.call(request))
        }
    }
}
