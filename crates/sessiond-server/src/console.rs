//! The web console: the files of `console/` (built from `web/`), embedded at build time
//! (build.rs), served at `/` on the API's own port. Same origin as the API,
//! so the page needs no CORS; a strict Content-Security-Policy allows only
//! its own scripts, styles and gRPC-web calls back to this origin.
//!
//! As the outermost layer it answers `GET`/`HEAD` requests (gRPC and
//! gRPC-web are always `POST`) and passes everything else on untouched.
//! The console's files are public (the page asks for the API token itself).

use std::task::{Context, Poll};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use tonic::body::Body;
use tower::{Layer, Service};

mod assets {
    include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));
}

/// Same origin only; no inline script or style, no plugins, no framing.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; font-src 'self'; connect-src 'self'; manifest-src 'self'; \
    base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("json" | "map") => "application/json",
        Some("woff2") => "font/woff2",
        Some("txt") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// Vite names what it emits under `assets/` by content hash, so those never
/// change under one name; `index.html` names them and must be revalidated.
fn cache_control(path: &str) -> &'static str {
    if path.starts_with("/assets/") {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    }
}

fn find(path: &str) -> Option<(&'static str, &'static [u8])> {
    let path = if path == "/" { "/index.html" } else { path };
    assets::ASSETS
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(p, bytes)| (*p, *bytes))
}

/// Whether the binary was built with the console's files.
pub fn embedded() -> bool {
    find("/").is_some()
}

/// Whether `accept` (an `Accept-Encoding` value) takes `coding`: named
/// (or `*`) without `q=0`.
fn accepts(accept: &str, coding: &str) -> bool {
    accept.split(',').any(|item| {
        let mut parts = item.split(';').map(str::trim);
        let name = parts.next().unwrap_or_default();
        let refused = parts.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.trim().parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        (name.eq_ignore_ascii_case(coding) || name == "*") && !refused
    })
}

/// The precompressed copy of `path` (built beside it: `.br`, `.gz`) the
/// client accepts, best first.
fn encoded(path: &str, accept: &str) -> Option<(&'static str, &'static [u8])> {
    [("br", "br"), ("gzip", "gz")]
        .into_iter()
        .filter(|(coding, _)| accepts(accept, coding))
        .find_map(|(coding, ext)| find(&format!("{path}.{ext}")).map(|(_, bytes)| (coding, bytes)))
}

fn respond(method: &Method, path: &str, accept: &str) -> Response<Body> {
    let mut builder = Response::builder()
        .header(header::CONTENT_SECURITY_POLICY, CSP)
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(header::REFERRER_POLICY, "no-referrer")
        .header(header::X_FRAME_OPTIONS, "DENY");
    let (status, body, ctype, cache) = match find(path) {
        Some((p, bytes)) => {
            let has_copies = encoded(p, "br, gzip").is_some();
            let bytes = match encoded(p, accept) {
                Some((coding, smaller)) => {
                    builder = builder.header(header::CONTENT_ENCODING, coding);
                    smaller
                }
                None => bytes,
            };
            if has_copies {
                builder = builder.header(header::VARY, "accept-encoding");
            }
            (
                StatusCode::OK,
                Bytes::from_static(bytes),
                content_type(p),
                cache_control(p),
            )
        }
        None if !embedded() => (
            StatusCode::NOT_FOUND,
            Bytes::from_static(
                b"this sessiond was built without the web console (its console/ directory was missing)\n",
            ),
            "text/plain; charset=utf-8",
            "no-store",
        ),
        None => (
            StatusCode::NOT_FOUND,
            Bytes::from_static(b"not found\n"),
            "text/plain; charset=utf-8",
            "no-store",
        ),
    };
    builder = builder
        .status(status)
        .header(header::CONTENT_TYPE, ctype)
        .header(header::CACHE_CONTROL, cache)
        .header(header::CONTENT_LENGTH, body.len());
    let body = if method == Method::HEAD {
        Bytes::new()
    } else {
        body
    };
    builder
        .body(Body::new(Full::new(body)))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ConsoleLayer;

impl<S> Layer<S> for ConsoleLayer {
    type Service = Console<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Console { inner }
    }
}

#[derive(Debug, Clone)]
pub struct Console<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Console<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let method = request.method().clone();
        if method == Method::GET || method == Method::HEAD {
            let accept = request
                .headers()
                .get(header::ACCEPT_ENCODING)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let response = respond(&method, request.uri().path(), accept);
            return futures::future::ready(Ok(response)).boxed();
        }
        self.inner
            .call(request)
            .map(|r| r.map(|response| response.map(Body::new)))
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::{accepts, cache_control, content_type};

    #[test]
    fn accepted_codings() {
        assert!(accepts("gzip, deflate, br, zstd", "br"));
        assert!(accepts("gzip;q=0.5", "gzip"));
        assert!(!accepts("gzip;q=0, br", "gzip"));
        assert!(accepts("*", "br"));
        assert!(!accepts("identity", "gzip"));
        assert!(!accepts("", "br"));
    }

    #[test]
    fn types_and_caching_by_path() {
        assert_eq!(content_type("/index.html"), "text/html; charset=utf-8");
        assert_eq!(
            content_type("/assets/index-abc.js"),
            "text/javascript; charset=utf-8"
        );
        assert_eq!(
            content_type("/assets/index-abc.css"),
            "text/css; charset=utf-8"
        );
        assert_eq!(cache_control("/index.html"), "no-cache");
        assert_eq!(
            cache_control("/assets/index-abc.js"),
            "public, max-age=31536000, immutable"
        );
    }
}
