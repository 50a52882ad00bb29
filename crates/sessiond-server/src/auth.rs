//! Who may call: bearer-token authentication for every gRPC (and gRPC-web)
//! call except `grpc.health.v1.Health`, and the browser checks — a request
//! from a web page (`Origin`) must come from a configured origin, and a
//! server without authentication answers only requests addressed to a
//! loopback name (`Host` / `:authority`), which defeats DNS rebinding.
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

use crate::{config::AllowedOrigins, limits::Caller};

/// Paths that never need a token: health checks by load balancers and
/// orchestrators.
pub(crate) const PUBLIC_PREFIX: &str = "/grpc.health.v1.Health/";

/// sessiond's authentication as a tower layer, for the services of
/// [`crate::Services`]: every call but `grpc.health.v1` must carry
/// `authorization: Bearer <token>` with one of the tokens
/// (UNAUTHENTICATED otherwise), and a browser `Origin` must be allowed
/// (PERMISSION_DENIED otherwise). [`crate::serve`] puts it around the API.
#[derive(Clone)]
pub struct AuthLayer {
    policy: Arc<Policy>,
}

struct Policy {
    /// `None`: authentication disabled (explicitly asked for).
    tokens: Option<Arc<[Vec<u8>]>>,
    origins: AllowedOrigins,
}

impl std::fmt::Debug for AuthLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthLayer")
            .field("enabled", &self.policy.tokens.is_some())
            .finish()
    }
}

impl AuthLayer {
    /// `tokens: None` serves without authentication; then only loopback
    /// `Host`s are answered.
    pub fn new(tokens: Option<Vec<String>>, origins: AllowedOrigins) -> Self {
        Self {
            policy: Arc::new(Policy {
                tokens: tokens.map(|t| t.into_iter().map(String::into_bytes).collect()),
                origins,
            }),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            policy: self.policy.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    policy: Arc<Policy>,
}

impl<S> std::fmt::Debug for Auth<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("enabled", &self.policy.tokens.is_some())
            .finish()
    }
}

/// Compares `presented` with every accepted token in constant time (per
/// token length); the loop never exits early. Answers the index of the
/// token that matched (who is calling, for per-token limits).
fn accepted(tokens: &[Vec<u8>], presented: &[u8]) -> Option<usize> {
    use subtle::ConditionallySelectable;
    let mut ok = subtle::Choice::from(0u8);
    let mut index = 0u64;
    for (i, token) in tokens.iter().enumerate() {
        let hit = token.as_slice().ct_eq(presented);
        index = u64::conditional_select(&index, &(i as u64), hit);
        ok |= hit;
    }
    bool::from(ok).then_some(index as usize)
}

/// Longest part of a refused header value quoted back in a message.
const ECHO_LIMIT: usize = 128;

fn quoted(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    let mut out: String = text.chars().take(ECHO_LIMIT).collect();
    if text.chars().count() > ECHO_LIMIT {
        out.push('…');
    }
    format!("{out:?}")
}

/// Refuses a browser request from an origin that is not configured, and,
/// without authentication, a request addressed to a name that is not
/// loopback (a DNS-rebinding page reaches 127.0.0.1 under its own name).
fn refuse_browser<B>(policy: &Policy, request: &http::Request<B>) -> Option<String> {
    let host: Option<&[u8]> = request
        .uri()
        .authority()
        .map(|a| a.as_str().as_bytes())
        .or_else(|| {
            request
                .headers()
                .get(http::header::HOST)
                .map(http::HeaderValue::as_bytes)
        });
    if let Some(origin) = request.headers().get(http::header::ORIGIN) {
        // The console served by this server calls back to its own origin.
        // That is no cross-origin call; a DNS-rebinding page that looks
        // same-origin is still refused by the loopback-host rule below
        // (without auth) or has no token (with auth).
        let same_origin = host.is_some_and(|h| {
            let o = origin.as_bytes();
            [&b"http://"[..], &b"https://"[..]].iter().any(|scheme| {
                o.len() == scheme.len() + h.len() && o.starts_with(scheme) && o.ends_with(h)
            })
        });
        let allowed = same_origin
            || match &policy.origins {
                AllowedOrigins::Any => true,
                AllowedOrigins::None => false,
                AllowedOrigins::List(list) => {
                    list.iter().any(|o| o.as_bytes() == origin.as_bytes())
                }
            };
        if !allowed {
            return Some(format!(
                "cross-origin request from origin {} refused: it is not listed in \
                 cors.allowed_origins",
                quoted(origin.as_bytes())
            ));
        }
    }
    if policy.tokens.is_none()
        && let Some(host) = host
        && !is_loopback_host(host)
    {
        return Some(format!(
            "host {} refused: without authentication (insecure_no_auth) only \
                 localhost or a loopback address may be used",
            quoted(host)
        ));
    }
    None
}

/// `localhost`, `*.localhost`, `127.x.y.z` or `[::1]`, with an optional port.
pub fn is_loopback_host(host: &[u8]) -> bool {
    let Ok(host) = std::str::from_utf8(host) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, port)) if port.is_empty() || port.starts_with(':') => ip,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.trim_end_matches('.');
    // Case-insensitive, without a lowered copy (this runs on every call).
    let tail = name
        .len()
        .checked_sub(".localhost".len())
        .and_then(|i| name.get(i..));
    if name.eq_ignore_ascii_case("localhost")
        || tail.is_some_and(|t| t.eq_ignore_ascii_case(".localhost"))
    {
        return true;
    }
    name.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// Who the request's credentials name, or why it has none that are valid.
/// Health checks need none (they get caller 0).
fn authenticate<B>(tokens: &[Vec<u8>], request: &http::Request<B>) -> Result<Caller, &'static str> {
    if request.uri().path().starts_with(PUBLIC_PREFIX) {
        return Ok(Caller(0));
    }
    let Some(value) = request.headers().get(http::header::AUTHORIZATION) else {
        return Err("missing `authorization: Bearer <token>` metadata");
    };
    // RFC 7235: the scheme is case-insensitive.
    let bytes = value.as_bytes();
    let token = match bytes.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &bytes[7..],
        _ => return Err("the authorization metadata is not a Bearer token"),
    };
    accepted(tokens, token.trim_ascii())
        .map(Caller)
        .ok_or("the bearer token is not valid")
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
        if let Some(reason) = refuse_browser(&self.policy, &request) {
            tracing::debug!(path = request.uri().path(), reason, "refused call");
            let status = tonic::Status::permission_denied(reason);
            return futures::future::ready(Ok(status.into_http())).boxed();
        }
        let mut request = request;
        let caller = match &self.policy.tokens {
            Some(tokens) => match authenticate(tokens, &request) {
                Ok(caller) => caller,
                Err(reason) => {
                    tracing::debug!(path = request.uri().path(), reason, "unauthenticated call");
                    let status = tonic::Status::unauthenticated(reason);
                    return futures::future::ready(Ok(status.into_http())).boxed();
                }
            },
            None => Caller(0),
        };
        request.extensions_mut().insert(caller);
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
        let list = "/sessiond.v1.SessionService/ListTasks";
        assert_eq!(
            authenticate(&tokens, &req("/grpc.health.v1.Health/Check", None)),
            Ok(Caller(0))
        );
        assert!(authenticate(&tokens, &req(list, None)).is_err());
        assert!(authenticate(&tokens, &req(list, Some("Basic x"))).is_err());
        assert!(authenticate(&tokens, &req(list, Some("Bearer 0123456789abcde"))).is_err());
        // The caller is the index of the token that matched.
        assert_eq!(
            authenticate(&tokens, &req(list, Some("Bearer 0123456789abcdef"))),
            Ok(Caller(0))
        );
        assert_eq!(
            authenticate(&tokens, &req(list, Some("Bearer second-token-xyz"))),
            Ok(Caller(1))
        );
        assert_eq!(
            authenticate(&tokens, &req(list, Some("BEARER second-token-xyz"))),
            Ok(Caller(1))
        );
    }

    #[test]
    fn the_console_calling_its_own_origin_is_not_cross_origin() {
        let call = |host: &str, origin: &str| {
            http::Request::builder()
                .uri("/sessiond.v1.SessionService/ListTasks")
                .header("host", host)
                .header("origin", origin)
                .body(())
                .unwrap_or_default()
        };
        let no_auth = Policy {
            tokens: None,
            origins: AllowedOrigins::None,
        };
        assert_eq!(
            refuse_browser(&no_auth, &call("127.0.0.1:50051", "http://127.0.0.1:50051")),
            None
        );
        assert_eq!(
            refuse_browser(&no_auth, &call("localhost:8080", "https://localhost:8080")),
            None
        );
        // Another port or name is another origin.
        assert!(
            refuse_browser(&no_auth, &call("127.0.0.1:50051", "http://127.0.0.1:50052")).is_some()
        );
        assert!(
            refuse_browser(&no_auth, &call("127.0.0.1:50051", "http://127.0.0.1:5005")).is_some()
        );
        assert!(
            refuse_browser(&no_auth, &call("127.0.0.1:50051", "http://evil.example")).is_some()
        );
        // DNS rebinding looks same-origin; the loopback-host rule refuses it.
        assert!(
            refuse_browser(
                &no_auth,
                &call("evil.example:50051", "http://evil.example:50051")
            )
            .is_some()
        );
    }

    #[test]
    fn loopback_hosts() {
        for ok in [
            "localhost",
            "localhost:50051",
            "LOCALHOST.",
            "app.localhost:1",
            "App.LocalHost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:50051",
        ] {
            assert!(is_loopback_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:50051",
            "localhost.evil.example",
            "evillocalhost",
            "évillocalhost",
            "é",
            "10.0.0.1:1",
            "[::2]:1",
            "[::1]x",
            "0.0.0.0",
        ] {
            assert!(!is_loopback_host(bad.as_bytes()), "{bad}");
        }
    }
}
