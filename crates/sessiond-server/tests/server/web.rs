//! gRPC-web over plain HTTP/1.1 (hand-built frames on a TcpStream, as a
//! browser's fetch would send them), CORS preflight, and reflection.

use std::time::Duration;

use prost::Message as _;
use sessiond_proto::sessiond::v1 as pb;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

use crate::support::*;

pub struct HttpResponse {
    pub status_line: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on a fresh connection (`connection: close`).
pub async fn http1(addr: &str, head: &str, body: &[u8]) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .unwrap()
        .unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    HttpResponse {
        status_line,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n").unwrap();
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        data = &data[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// A gRPC-web answer's status: in its headers (trailers-only), else in its
/// trailer frame.
fn grpc_web_status(r: &HttpResponse) -> Option<String> {
    if let Some(code) = r.header("grpc-status") {
        return Some(code.to_owned());
    }
    let (_, trailers) = frames(&r.body)
        .into_iter()
        .find(|(flag, _)| *flag == 0x80)?;
    String::from_utf8_lossy(&trailers).lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("grpc-status")
            .then(|| v.trim().to_owned())
    })
}

/// gRPC-web frames: (flag, payload).
pub fn frames(mut body: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let flag = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        out.push((flag, body[5..5 + len].to_vec()));
        body = &body[5 + len..];
    }
    out
}

pub fn grpc_web_request(
    addr: &str,
    method: &str,
    token: Option<&str>,
    message: &[u8],
) -> (String, Vec<u8>) {
    grpc_web_request_from(addr, "http://app.example", method, token, message)
}

/// A gRPC-web POST as a page of `origin` would send it to `host`.
pub fn grpc_web_request_from(
    host: &str,
    origin: &str,
    method: &str,
    token: Option<&str>,
    message: &[u8],
) -> (String, Vec<u8>) {
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let head = format!(
        "POST {method} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/grpc-web+proto\r\n\
         x-grpc-web: 1\r\norigin: {origin}\r\n{auth}content-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    );
    (head, body)
}

#[tokio::test]
async fn grpc_web_call_over_http1_succeeds_with_cors_headers_for_a_browser_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &dir.path().join("data"),
        &["--cors-allowed-origins", "http://app.example"],
    );

    // A task created through gRPC-web, then listed through gRPC-web.
    let create = pb::CreateTaskRequest {
        title: "from the browser".into(),
    }
    .encode_to_vec();
    let (head, body) = grpc_web_request(
        &server.addr,
        "/sessiond.v1.SessionService/CreateTask",
        Some(TOKEN),
        &create,
    );
    let r = http1(&server.addr, &head, &body).await;
    assert!(
        r.status_line.starts_with("HTTP/1.1 200"),
        "{}",
        r.status_line
    );
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("application/grpc-web"),
        "{:?}",
        r.headers
    );
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example"),
        "{:?}",
        r.headers
    );
    let exposed = r.header("access-control-expose-headers").unwrap();
    assert!(exposed.contains("grpc-status"), "{exposed}");
    assert!(exposed.contains("sessiond-error"), "{exposed}");
    let f = frames(&r.body);
    assert_eq!(f.len(), 2, "{f:?}");
    assert_eq!(f[0].0, 0x00);
    let created = pb::CreateTaskResponse::decode(f[0].1.as_slice())
        .unwrap()
        .task
        .unwrap();
    assert_eq!(created.title, "from the browser");
    assert_eq!(f[1].0, 0x80);
    let trailers = String::from_utf8_lossy(&f[1].1).to_lowercase();
    assert!(trailers.contains("grpc-status:0"), "{trailers}");

    // The same client without an `Origin` (not a browser): served, and no
    // CORS headers, which only browsers read.
    let (head, body) = grpc_web_request(
        &server.addr,
        "/sessiond.v1.SessionService/ListTasks",
        Some(TOKEN),
        &pb::ListTasksRequest::default().encode_to_vec(),
    );
    let without_origin = head.replace("origin: http://app.example\r\n", "");
    assert_ne!(without_origin, head, "the request carried no origin");
    let r = http1(&server.addr, &without_origin, &body).await;
    let cors: Vec<_> = r
        .headers
        .iter()
        .filter(|(name, _)| {
            let name = name.to_ascii_lowercase();
            name.starts_with("access-control-") || name == "vary"
        })
        .collect();
    assert!(cors.is_empty(), "CORS headers without an Origin: {cors:?}");
    let f = frames(&r.body);
    let listed = pb::ListTasksResponse::decode(f[0].1.as_slice()).unwrap();
    assert_eq!(listed.tasks.len(), 1);
    assert_eq!(listed.tasks[0].id, created.id);
}

#[tokio::test]
async fn grpc_web_without_token_is_unauthenticated_and_preflight_needs_none() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &dir.path().join("data"),
        &["--cors-allowed-origins", "http://app.example"],
    );

    let (head, body) = grpc_web_request(
        &server.addr,
        "/sessiond.v1.SessionService/ListTasks",
        None,
        &[],
    );
    let r = http1(&server.addr, &head, &body).await;
    assert!(
        r.status_line.starts_with("HTTP/1.1 200"),
        "{}",
        r.status_line
    );
    assert_eq!(
        grpc_web_status(&r).as_deref(),
        Some("16"),
        "{:?}",
        r.headers
    );

    let preflight = format!(
        "OPTIONS /sessiond.v1.SessionService/ListTasks HTTP/1.1\r\nhost: {}\r\n\
         origin: http://app.example\r\naccess-control-request-method: POST\r\n\
         access-control-request-headers: authorization,content-type,x-grpc-web\r\n\
         connection: close\r\n\r\n",
        server.addr
    );
    let r = http1(&server.addr, &preflight, &[]).await;
    assert!(
        r.status_line.starts_with("HTTP/1.1 200"),
        "{}",
        r.status_line
    );
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let allowed = r
        .header("access-control-allow-headers")
        .unwrap()
        .to_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    assert!(
        r.header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
}

#[tokio::test]
async fn reflection_lists_exactly_the_served_services() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let mut reflection = ServerReflectionClient::with_interceptor(
        channel(&server.addr).await,
        |mut req: tonic::Request<()>| {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
            Ok(req)
        },
    );
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    let mut names = names;
    names.sort();
    // agentctl's service shares the descriptor set but is not served here.
    assert_eq!(
        names,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "sessiond.v1.SessionService",
            "sessiond.v1.WorkspaceService",
        ]
    );
}

fn get(addr: &str, path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n")
}

/// The console's text files go out precompressed (brotli, else gzip) to a
/// client that accepts it: the bytes built beside each file, with
/// `content-encoding` and `vary`; a client that accepts neither gets the
/// file as is.
#[tokio::test]
async fn console_assets_are_served_precompressed_to_clients_that_accept_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);
    let console = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console");
    let html = std::fs::read_to_string(console.join("index.html")).unwrap();
    let js = html
        .split('"')
        .find(|s| s.starts_with("/assets/") && s.ends_with(".js"))
        .expect("the page names its script")
        .to_owned();
    let with = |path: &str, accept: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nhost: {}\r\naccept-encoding: {accept}\r\nconnection: close\r\n\r\n",
            server.addr
        )
    };
    let on_disk = |rel: &str| std::fs::read(console.join(rel.trim_start_matches('/'))).unwrap();
    for (accept, coding, ext) in [
        ("gzip, deflate, br, zstd", Some("br"), ".br"),
        ("gzip", Some("gzip"), ".gz"),
        ("br;q=0, gzip;q=0.8", Some("gzip"), ".gz"),
        ("identity", None, ""),
    ] {
        for path in [js.as_str(), "/index.html"] {
            let r = http1(&server.addr, &with(path, accept), b"").await;
            assert!(
                r.status_line.starts_with("HTTP/1.1 200"),
                "{path}: {}",
                r.status_line
            );
            assert_eq!(r.header("content-encoding"), coding, "{path} with {accept}");
            assert_eq!(r.header("vary"), Some("accept-encoding"), "{path}");
            assert_eq!(
                r.body,
                on_disk(&format!("{path}{ext}")),
                "{path} with {accept}"
            );
        }
    }
    let compressed = on_disk(&format!("{js}.br")).len();
    let raw = on_disk(&js).len();
    assert!(compressed * 3 < raw, "brotli {compressed} of {raw} bytes");
}

/// The console is served at `/` of the API port without a token, from the
/// files embedded in the binary, with types, caching and a strict CSP; the
/// API on the same port still needs its token.
#[tokio::test]
async fn console_is_served_at_root_with_types_caching_and_csp() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("data"), &[]);

    let index = http1(&server.addr, &get(&server.addr, "/"), b"").await;
    assert!(
        index.status_line.starts_with("HTTP/1.1 200"),
        "{}",
        index.status_line
    );
    assert_eq!(
        index.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(index.header("cache-control"), Some("no-cache"));
    let csp = index.header("content-security-policy").unwrap();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    assert!(
        !csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"),
        "{csp}"
    );
    assert_eq!(index.header("x-content-type-options"), Some("nosniff"));
    let html = String::from_utf8(index.body).unwrap();
    assert!(
        !html.contains("<script>"),
        "no inline script under the CSP: {html}"
    );

    // Every asset the page names is served with its type and cached for good.
    let assets: Vec<&str> = html
        .split('"')
        .filter(|s| s.starts_with("/assets/"))
        .collect();
    assert!(assets.iter().any(|a| a.ends_with(".js")), "{html}");
    assert!(assets.iter().any(|a| a.ends_with(".css")), "{html}");
    for asset in assets {
        let r = http1(&server.addr, &get(&server.addr, asset), b"").await;
        assert!(
            r.status_line.starts_with("HTTP/1.1 200"),
            "{asset}: {}",
            r.status_line
        );
        let expected = if asset.ends_with(".js") {
            "text/javascript; charset=utf-8"
        } else {
            "text/css; charset=utf-8"
        };
        assert_eq!(r.header("content-type"), Some(expected), "{asset}");
        assert_eq!(
            r.header("cache-control"),
            Some("public, max-age=31536000, immutable"),
            "{asset}"
        );
        assert!(!r.body.is_empty(), "{asset}");
    }

    let missing = http1(&server.addr, &get(&server.addr, "/assets/nope.js"), b"").await;
    assert!(
        missing.status_line.starts_with("HTTP/1.1 404"),
        "{}",
        missing.status_line
    );

    // The page's own calls (Origin = this server) are not cross-origin,
    // and still need the token; another origin is still refused.
    let origin = format!("http://{}", server.addr);
    let list = pb::ListTasksRequest::default().encode_to_vec();
    let method = "/sessiond.v1.SessionService/ListTasks";
    let (head, body) = grpc_web_request_from(&server.addr, &origin, method, None, &list);
    let r = http1(&server.addr, &head, &body).await;
    assert_eq!(r.header("grpc-status"), Some("16"), "{:?}", r.headers);
    let (head, body) = grpc_web_request_from(&server.addr, &origin, method, Some(TOKEN), &list);
    let r = http1(&server.addr, &head, &body).await;
    // A success's status is in the trailer frame at the end of the body.
    let trailers = String::from_utf8_lossy(&r.body).to_lowercase();
    assert!(
        trailers.contains("grpc-status:0"),
        "{:?} {trailers:?}",
        r.headers
    );
    let (head, body) = grpc_web_request(&server.addr, method, Some(TOKEN), &list);
    let r = http1(&server.addr, &head, &body).await;
    assert_eq!(r.header("grpc-status"), Some("7"), "{:?}", r.headers);
}

/// A body that is not the method's message (a varint cut short), over
/// gRPC-web and over gRPC: INVALID_ARGUMENT, the caller's mistake, not
/// INTERNAL.
#[tokio::test]
async fn an_undecodable_request_is_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(
        &dir.path().join("data"),
        &["--cors-allowed-origins", "http://app.example"],
    );
    // Field 1 (a string), its length a varint that never ends.
    let garbage = [0x0a, 0xff, 0xff, 0xff];
    let (head, body) = grpc_web_request(
        &server.addr,
        "/sessiond.v1.SessionService/GetTask",
        Some(TOKEN),
        &garbage,
    );
    let r = http1(&server.addr, &head, &body).await;
    assert_eq!(grpc_web_status(&r).as_deref(), Some("3"), "{:?}", r.headers);
    // No message at all, and a frame cut short (helper-52 14).
    for raw in [&[][..], &[0, 0, 0][..], &[0, 0, 0, 0, 10, 1, 2][..]] {
        let (head, _) = grpc_web_request(
            &server.addr,
            "/sessiond.v1.SessionService/GetTask",
            Some(TOKEN),
            &[],
        );
        let head = head.replace(
            "content-length: 5",
            &format!("content-length: {}", raw.len()),
        );
        let r = http1(&server.addr, &head, raw).await;
        assert_eq!(
            grpc_web_status(&r).as_deref(),
            Some("3"),
            "{raw:?}: {:?}",
            r.headers
        );
    }

    // The same over gRPC (HTTP/2), through a codec that sends raw bytes.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(garbage.to_vec());
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let err = grpc
        .unary(
            request,
            tonic::codegen::http::uri::PathAndQuery::from_static(
                "/sessiond.v1.SessionService/GetTask",
            ),
            RawCodec,
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
}

/// Sends and receives message bytes as they are.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Self::Error> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, Self::Error> {
        use bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}
