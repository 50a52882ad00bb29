//! Bearer-token authentication for every gRPC (and gRPC-web) call except
//! `grpc.health.v1.Health`, as a tower layer in front of all services.
//!
//! It sits inside the gRPC-web translation (so browsers get a proper
//! grpc-web UNAUTHENTICATED answer) and inside CORS (so preflight `OPTIONS`
//! requests, which carry no credentials, are answered without a token).

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures::future::{BoxFuture, FutureExt};
use subtle::ConstantTimeEq;
use tower::{Layer, Service};

/// Paths that never need a token: health checks by load balancers and
/// orchestrators.
const PUBLIC_PREFIX: &str = "/grpc.health.v1.Health/";

#[derive(Clone)]
pub struct AuthLayer {
    /// `None`: authentication disabled (explicitly asked for).
    tokens: Option<Arc<[Vec<u8>]>>,
}

impl std::fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthLayer")
            .field("enabled", &self.tokens.is_some())
            .finish()
    }
}

impl AuthLayer {
    pub fn new(tokens: Option<Vec<String>>) -> Self {
        Self {
            tokens: tokens.map(|t| t.into_iter().map(String::into_bytes).collect()),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    tokens: Option<Arc<[Vec<u8>]>>,
}

impl<S> std::fmt::Debug for Auth<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("enabled", &self.tokens.is_some())
            .finish()
    }
}

/// Compares `presented` with every accepted token in constant time (per
/// token length); the loop never exits early.
fn accepted(tokens: &[Vec<u8>], presented: &[u8]) -> bool {
    let mut ok = subtle::Choice::from(0u8);
    for token in tokens {
        ok |= token.as_slice().ct_eq(presented);
    }
    bool::from(ok)
}

/// Why a request has no valid credentials; `None` if it has.
fn reject_reason<B>(tokens: &[Vec<u8>], request: &http::Request<B>) -> Option<&'static str> {
    if request.uri().path().starts_with(PUBLIC_PREFIX) {
        return None;
    }
    let Some(value) = request.headers().get(http::header::AUTHORIZATION) else {
        return Some("missing `authorization: Bearer <token>` metadata");
    };
    let Some(token) = value
        .as_bytes()
        .strip_prefix(b"Bearer ")
        .or_else(|| value.as_bytes().strip_prefix(b"bearer "))
    else {
        return Some("the authorization metadata is not a Bearer token");
    };
    if accepted(tokens, token.trim_ascii()) {
        None
    } else {
        Some("the bearer token is not valid")
    }
}

impl<S, B, RB> Service<http::Request<B>> for Auth<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(tokens) = &self.tokens
            && let Some(reason) = reject_reason(tokens, &request)
        {
            tracing::debug!(path = request.uri().path(), reason, "unauthenticated call");
            let status = tonic::Status::unauthenticated(reason);
            return futures::future::ready(Ok(status.into_http())).boxed();
        }
        // The clone that was polled ready serves this call; keep a fresh one.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        inner.call(request).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(path: &str, auth: Option<&str>) -> http::Request<()> {
        let mut b = http::Request::builder().uri(path);
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap_or_default()
    }

    #[test]
    fn health_is_public_everything_else_needs_a_valid_token() {
        let tokens = vec![b"0123456789abcdef".to_vec(), b"second-token-xyz".to_vec()];
        assert_eq!(
            reject_reason(&tokens, &req("/grpc.health.v1.Health/Check", None)),
            None
        );
        assert!(
            reject_reason(&tokens, &req("/sessiond.v1.SessionService/ListTasks", None)).is_some()
        );
        assert!(
            reject_reason(
                &tokens,
                &req("/sessiond.v1.SessionService/ListTasks", Some("Basic x"))
            )
            .is_some()
        );
        assert!(
            reject_reason(
                &tokens,
                &req(
                    "/sessiond.v1.SessionService/ListTasks",
                    Some("Bearer 0123456789abcde")
                )
            )
            .is_some()
        );
        assert_eq!(
            reject_reason(
                &tokens,
                &req(
                    "/sessiond.v1.SessionService/ListTasks",
                    Some("Bearer second-token-xyz")
                )
            ),
            None
        );
    }
}
