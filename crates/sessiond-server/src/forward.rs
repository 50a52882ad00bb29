//! Any replica answers any call: a command on a session whose executor
//! another live replica owns is forwarded to that owner over gRPC, and the
//! owner's answer is the answer.
//!
//! - **Authentication**: the caller's own `authorization` metadata travels
//!   with the forwarded call and the owner authenticates it exactly as if
//!   the caller had called it directly. Forwarding therefore grants nothing:
//!   no replica trusts another, there is no inter-replica secret to hand
//!   out or rotate, and a client cannot use the forwarding path to skip
//!   authentication (the owner checks the same token again). It needs every
//!   replica to accept the same `auth.tokens`, which a load balancer that
//!   sends any call anywhere needs anyway. A server without authentication
//!   (`insecure_no_auth`) never forwards: it answers `not_owner` naming
//!   the owner instead.
//! - **TLS between replicas**: a replica serving TLS advertises an
//!   `https://` address; a call for a session it owns is forwarded over TLS,
//!   verified with `replica.peer_tls_ca_file` (and `peer_tls_domain_name`
//!   when the certificates do not name the advertised host). A replica
//!   without that CA does not forward to an `https://` owner, and one whose
//!   CA does not verify the owner's certificate gives up at the handshake:
//!   both answer `not_owner` naming the owner and why, at once (the owner is
//!   alive; retrying through this replica would not help). A replica serving
//!   TLS does not forward to a plain-text owner either: the caller's token
//!   came over TLS and is not passed on in clear text.
//! - **Hop guard**: a forwarded call carries `sessiond-forwarded-by: <replica
//!   id>`. A call carrying it that lands on a replica which does not own the
//!   session (ownership moved while it travelled) is not forwarded again: it
//!   answers UNAVAILABLE `not_owner` with a `retry-after-ms` hint. A client
//!   setting the header only gives up forwarding for itself.
//! - **Deadline and cancellation**: the caller's `grpc-timeout` (what is
//!   left of it) becomes the forwarded call's; a caller that goes away drops
//!   the handler, which drops the forwarded call (its HTTP/2 stream is
//!   reset and the owner's handler is dropped in turn).
//! - **An owner that does not answer** (refused connection, reset, a paused
//!   process caught by HTTP/2 keep-alive) means ownership is moving: its
//!   lease has not run out yet, and when it does another replica adopts the
//!   session (or this one, on the retry: a call on an expired lease claims
//!   and recovers it here). The answer is UNAVAILABLE `ownership_moving`
//!   with `retry-after-ms` = what is left of the lease plus one adoption
//!   round.
//! - Clients (tonic channels) are kept per owner replica and address; a
//!   replica that comes back at another address gets a new one.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::future::BoxFuture;
use sessiond_domain::SessionId;
use sessiond_proto::sessiond::v1::{
    self as pb, session_service_client::SessionServiceClient,
    workspace_service_client::WorkspaceServiceClient,
};
use tonic::{
    Request, Response, Status,
    metadata::{AsciiMetadataValue, MetadataMap},
    transport::{Channel, ClientTlsConfig, Endpoint},
};

use crate::error::{ApiError, ERROR_METADATA};

/// Marks a call one replica forwarded to another (its value: the sender's
/// replica id). Such a call is never forwarded again.
pub const FORWARDED_BY: &str = "sessiond-forwarded-by";

/// Milliseconds after which a retry may find the session served: on every
/// `not_owner` and `ownership_moving` answer.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// What a call that lands on a replica mid-move is told to wait when no
/// lease says better (ownership has just moved: retry soon).
pub const RETRY_SOON: Duration = Duration::from_millis(500);

/// Metadata copied from the caller's request onto the forwarded one.
const PASSED_ON: [&str; 3] = ["authorization", "traceparent", "tracestate"];

/// How long connecting to an owner may take before it counts as gone.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// HTTP/2 pings on a connection to an owner while calls are in flight: a
/// paused owner (SIGSTOP, partition) fails the call after
/// `KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT` instead of holding it forever.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// How this replica reaches the other replicas' API ports.
#[derive(Debug, Clone, Default)]
pub struct PeerTls {
    /// Trust roots (and name) for owners whose advertised address is
    /// `https://`; `None`: calls are not forwarded to them.
    pub trust: Option<ClientTlsConfig>,
    /// This replica serves TLS: it does not pass a caller's credentials on
    /// to a plain-text owner.
    pub no_plain_text: bool,
}

/// Whether this replica forwards, and why not when it does not.
#[derive(Debug, Clone)]
pub enum Policy {
    Forward,
    /// The reason, told to the caller with the `not_owner` answer.
    Refuse(&'static str),
}

/// This replica's side of forwarding: its id, its policy and the clients
/// of the owners it has forwarded to. Cheap to clone.
#[derive(Clone)]
pub struct Peers {
    inner: Arc<Inner>,
}

struct Inner {
    me: String,
    policy: Policy,
    tls: PeerTls,
    /// Largest message a forwarded answer may carry.
    max_message: usize,
    channels: Mutex<HashMap<String, (String, Channel)>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("me", &self.inner.me)
            .field("policy", &self.inner.policy)
            .finish_non_exhaustive()
    }
}

/// What a forwarded call needs from the caller's request: taken before
/// the handler consumes it.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    passed_on: Vec<(&'static str, AsciiMetadataValue)>,
    /// Set when another replica forwarded this call here.
    forwarded_by: Option<String>,
    deadline: Option<Instant>,
}

impl Origin {
    pub fn of<T>(request: &Request<T>) -> Self {
        let md = request.metadata();
        Self {
            passed_on: PASSED_ON
                .iter()
                .filter_map(|k| md.get(*k).map(|v| (*k, v.clone())))
                .collect(),
            forwarded_by: md
                .get(FORWARDED_BY)
                .map(|v| v.to_str().unwrap_or("?").to_owned()),
            deadline: md
                .get("grpc-timeout")
                .and_then(|v| v.to_str().ok())
                .and_then(parse_grpc_timeout)
                .map(|d| Instant::now() + d),
        }
    }

    pub fn forwarded_by(&self) -> Option<&str> {
        self.forwarded_by.as_deref()
    }
}

/// `grpc-timeout`: at most 8 digits and a unit (H M S m u n).
pub(crate) fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The owner a call goes to, with a client for it.
#[derive(Debug, Clone)]
pub struct Owner {
    pub session: SessionId,
    pub replica: String,
    pub address: String,
    channel: Channel,
    origin: Origin,
    me: String,
    max_message: usize,
}

impl Owner {
    /// `message` as a request to the owner: the caller's credentials and
    /// trace context, the hop marker, what is left of the caller's deadline.
    pub fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        let md: &mut MetadataMap = request.metadata_mut();
        for (key, value) in &self.origin.passed_on {
            md.insert(*key, value.clone());
        }
        if let Ok(me) = self.me.parse() {
            md.insert(FORWARDED_BY, me);
        }
        if let Some(deadline) = self.origin.deadline {
            request.set_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        request
    }

    pub fn sessions(&self) -> SessionServiceClient<Channel> {
        SessionServiceClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    pub fn workspace(&self) -> WorkspaceServiceClient<Channel> {
        WorkspaceServiceClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message)
            .max_encoding_message_size(self.max_message)
    }

    /// Whether the caller's deadline has passed.
    pub fn deadline_passed(&self) -> bool {
        self.origin.deadline.is_some_and(|d| d <= Instant::now())
    }
}

/// A call that can be sent on to the replica owning its session: which
/// service method carries it there. One impl per forwarded RPC, so the
/// handlers share one route-or-forward path (`Api::here_or_forward`).
pub(crate) trait Forward: Sized + Send + 'static {
    /// What the owner answers.
    type Reply;
    /// Sends `self` to `owner` as its own request (credentials, hop
    /// marker, deadline: [`Owner::request`]).
    fn send(self, owner: &Owner) -> BoxFuture<'static, Result<Response<Self::Reply>, Status>>;
}

/// A workspace call: the session it acts on travels in the request.
pub(crate) trait WorkspaceCall: Forward {
    fn session(&self) -> Option<&pb::SessionRef>;
}

macro_rules! forward {
    ($client:ident: $($method:ident($req:ident) -> $reply:ident;)*) => {$(
        impl Forward for pb::$req {
            type Reply = pb::$reply;
            fn send(
                self,
                owner: &Owner,
            ) -> BoxFuture<'static, Result<Response<pb::$reply>, Status>> {
                let mut client = owner.$client();
                let request = owner.request(self);
                Box::pin(async move { client.$method(request).await })
            }
        }
    )*};
}

forward!(sessions:
    resume_session(ResumeSessionRequest) -> ResumeSessionResponse;
    send_message(SendMessageRequest) -> SendMessageResponse;
    cancel_queued_message(CancelQueuedMessageRequest) -> CancelQueuedMessageResponse;
    retry_turn(RetryTurnRequest) -> RetryTurnResponse;
    cancel_turn(CancelTurnRequest) -> CancelTurnResponse;
    respond_to_permission(RespondToPermissionRequest) -> RespondToPermissionResponse;
    set_session_mode(SetSessionModeRequest) -> SetSessionModeResponse;
    set_session_config_option(SetSessionConfigOptionRequest) -> SetSessionConfigOptionResponse;
    stop_session(StopSessionRequest) -> StopSessionResponse;
    delete_session(DeleteSessionRequest) -> DeleteSessionResponse;
    set_session_title(SetSessionTitleRequest) -> SetSessionTitleResponse;
);
forward!(workspace:
    exec(ExecRequest) -> ExecResponse;
    read_file(ReadFileRequest) -> ReadFileResponse;
    write_file(WriteFileRequest) -> WriteFileResponse;
    list_dir(ListDirRequest) -> ListDirResponse;
    git_status(GitStatusRequest) -> GitStatusResponse;
    git_diff(GitDiffRequest) -> GitDiffResponse;
    list_branch_commits(ListBranchCommitsRequest) -> ListBranchCommitsResponse;
);

macro_rules! workspace_call {
    ($($req:ident),*) => {$(
        impl WorkspaceCall for pb::$req {
            fn session(&self) -> Option<&pb::SessionRef> {
                self.session.as_ref()
            }
        }
    )*};
}

workspace_call!(
    ExecRequest,
    ReadFileRequest,
    WriteFileRequest,
    ListDirRequest,
    GitStatusRequest,
    GitDiffRequest
);

/// How the owner's failure is to be answered.
#[derive(Debug)]
pub enum Failure {
    /// The owner answered: its status is the answer.
    Answered(Status),
    /// The owner refused the caller's credentials (the replicas do not
    /// accept the same tokens).
    Refused(Status),
    /// The caller's deadline passed on the way.
    DeadlineExceeded(Status),
    /// The TLS handshake with the owner failed on its certificate: this
    /// replica's `peer_tls_ca_file` (or name) does not verify it. The owner
    /// is alive; the cause is configuration.
    Untrusted(Status),
    /// The owner did not answer: ownership is (probably) moving.
    Unreachable(Status),
}

/// An error and its sources, `: `-separated (transport errors keep the
/// cause, such as an untrusted certificate, in their sources).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(source) = next {
        let text = source.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = source.source();
    }
    out
}

/// Sorts an error of a forwarded call: statuses the owner's handlers give
/// carry `sessiond-error`; those without it come from the transport or the
/// owner's authentication layer.
pub fn classify(owner: &Owner, status: Status) -> Failure {
    use tonic::Code;
    if status.metadata().get(ERROR_METADATA).is_some() {
        return Failure::Answered(status);
    }
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => Failure::Refused(status),
        Code::DeadlineExceeded => Failure::DeadlineExceeded(status),
        // rustls: "invalid peer certificate: UnknownIssuer", "...: NotValidForName".
        Code::Unavailable | Code::Unknown
            if owner.address.starts_with("https://")
                && error_chain(&status).contains("certificate") =>
        {
            Failure::Untrusted(status)
        }
        Code::Cancelled if owner.deadline_passed() => Failure::DeadlineExceeded(status),
        _ => Failure::Unreachable(status),
    }
}

impl Peers {
    pub fn new(me: String, policy: Policy, max_message: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                me,
                policy,
                tls: PeerTls::default(),
                max_message,
                channels: Mutex::default(),
            }),
        }
    }

    /// These peers reached with `tls` (default: no trust roots, plain text
    /// allowed).
    #[must_use]
    pub fn with_tls(self, tls: PeerTls) -> Self {
        Self {
            inner: Arc::new(Inner {
                me: self.inner.me.clone(),
                policy: self.inner.policy.clone(),
                tls,
                max_message: self.inner.max_message,
                channels: Mutex::default(),
            }),
        }
    }

    /// Where a call that this replica may not run goes: the owner, or an
    /// error when it must not be forwarded (hop guard, policy, no address).
    pub fn owner(
        &self,
        session: SessionId,
        replica: String,
        address: String,
        origin: &Origin,
        not_owner: sessiond_engine::Error,
    ) -> Result<Owner, ApiError> {
        if let Some(from) = origin.forwarded_by() {
            tracing::info!(%session, %from, owner = %replica, "forwarded call for a session this replica does not own; not forwarded again");
            return Err(ApiError::NotOwner {
                error: not_owner,
                retry_after: RETRY_SOON,
                note: Some(format!(
                    "(this call was forwarded here by replica {from}, and ownership moved on \
                     the way; it is not forwarded twice)"
                )),
            });
        }
        if let Policy::Refuse(why) = &self.inner.policy {
            return Err(ApiError::NotOwner {
                error: not_owner,
                retry_after: RETRY_SOON,
                note: Some(format!("(not forwarded: {why})")),
            });
        }
        if address.is_empty() {
            return Err(ApiError::OwnershipMoving {
                session,
                owner: replica,
                address,
                retry_after: RETRY_SOON,
                cause: "it has no advertised address (its replica row is gone)".into(),
            });
        }
        let refuse = |note: String| ApiError::NotOwner {
            error: not_owner,
            retry_after: RETRY_SOON,
            note: Some(note),
        };
        let tls = match (address.starts_with("https://"), &self.inner.tls) {
            (true, PeerTls { trust: None, .. }) => {
                return Err(refuse(format!(
                    "(not forwarded: replica {replica} serves TLS and this replica has no \
                     replica.peer_tls_ca_file to verify its certificate; send the call to the \
                     owner)"
                )));
            }
            (true, PeerTls { trust: Some(t), .. }) => Some(t.clone()),
            (false, PeerTls { no_plain_text, .. }) if *no_plain_text => {
                return Err(refuse(format!(
                    "(not forwarded: this replica serves TLS and does not pass the caller's \
                     credentials on in clear text to replica {replica}, whose advertised \
                     address is not https://; send the call to the owner)"
                )));
            }
            (false, _) => None,
        };
        let channel = match self.channel(&replica, &address, tls) {
            Ok(channel) => channel,
            Err(Bad::Address(cause)) => {
                return Err(ApiError::OwnershipMoving {
                    session,
                    owner: replica,
                    address,
                    retry_after: RETRY_SOON,
                    cause,
                });
            }
            Err(Bad::Tls(cause)) => {
                return Err(refuse(format!(
                    "(not forwarded: TLS to replica {replica} at {address}: {cause})"
                )));
            }
        };
        Ok(Owner {
            session,
            replica,
            address,
            channel,
            origin: origin.clone(),
            me: self.inner.me.clone(),
            max_message: self.inner.max_message,
        })
    }

    /// The cached client of `replica` at `address`, or a new one (lazy: it
    /// connects on the first call, and reconnects after a failure).
    fn channel(
        &self,
        replica: &str,
        address: &str,
        tls: Option<ClientTlsConfig>,
    ) -> Result<Channel, Bad> {
        let mut channels = self
            .inner
            .channels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((at, channel)) = channels.get(replica)
            && at == address
        {
            return Ok(channel.clone());
        }
        let url = if address.contains("://") {
            address.to_owned()
        } else {
            format!("http://{address}")
        };
        let mut endpoint = Endpoint::from_shared(url).map_err(|e| {
            Bad::Address(format!(
                "its advertised address is not host:port or https://host:port ({e})"
            ))
        })?;
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| Bad::Tls(error_chain(&e)))?;
        }
        let channel = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .tcp_nodelay(true)
            .connect_lazy();
        channels.insert(replica.to_owned(), (address.to_owned(), channel.clone()));
        Ok(channel)
    }
}

/// Why no client of an owner could be made.
enum Bad {
    Address(String),
    Tls(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            parse_grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        assert_eq!(parse_grpc_timeout("S"), None);
        assert_eq!(parse_grpc_timeout("5s"), None);
        assert_eq!(parse_grpc_timeout("123456789S"), None);
    }

    #[test]
    fn a_forwarded_request_carries_credentials_hop_marker_and_deadline() {
        let mut incoming = Request::new(());
        incoming
            .metadata_mut()
            .insert("authorization", "Bearer t".parse().unwrap());
        incoming
            .metadata_mut()
            .insert("grpc-timeout", "10S".parse().unwrap());
        incoming
            .metadata_mut()
            .insert("x-other", "not passed on".parse().unwrap());
        let origin = Origin::of(&incoming);
        assert_eq!(origin.forwarded_by(), None);
        let peers = Peers::new("replica-b".into(), Policy::Forward, 1 << 20);
        let not_owner = || sessiond_engine::Error::NotOwner {
            session_id: SessionId::new(),
            owner: "replica-a".into(),
            address: "127.0.0.1:1".into(),
            ttl_secs: 1,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let owner = peers
            .owner(
                SessionId::new(),
                "replica-a".into(),
                "127.0.0.1:1".into(),
                &origin,
                not_owner(),
            )
            .unwrap();
        let out = owner.request(());
        let md = out.metadata();
        assert_eq!(md.get("authorization").unwrap(), "Bearer t");
        assert_eq!(md.get(FORWARDED_BY).unwrap(), "replica-b");
        assert!(md.get("x-other").is_none());
        let left = parse_grpc_timeout(md.get("grpc-timeout").unwrap().to_str().unwrap()).unwrap();
        assert!(left <= Duration::from_secs(10) && left > Duration::from_secs(5));

        // Landing on a non-owner again: not forwarded a second time.
        let mut hop = Request::new(());
        hop.metadata_mut()
            .insert(FORWARDED_BY, "replica-c".parse().unwrap());
        let err = peers
            .owner(
                SessionId::new(),
                "replica-a".into(),
                "127.0.0.1:1".into(),
                &Origin::of(&hop),
                not_owner(),
            )
            .unwrap_err();
        let status = Status::from(err);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(status.metadata().get(ERROR_METADATA).unwrap(), "not_owner");
        assert_eq!(status.metadata().get(RETRY_AFTER_MS).unwrap(), "500");
        assert!(status.message().contains("replica-c"), "{status:?}");

        // A replica without authentication never forwards.
        let closed = Peers::new("replica-b".into(), Policy::Refuse("no auth"), 1 << 20);
        let err = closed
            .owner(
                SessionId::new(),
                "replica-a".into(),
                "127.0.0.1:1".into(),
                &origin,
                not_owner(),
            )
            .unwrap_err();
        let status = Status::from(err);
        assert_eq!(status.metadata().get(ERROR_METADATA).unwrap(), "not_owner");
        assert_eq!(
            status.metadata().get("sessiond-owner").unwrap(),
            "replica-a"
        );
        assert!(status.message().contains("no auth"), "{status:?}");

        // An https owner without a peer CA: not forwarded, and said why.
        let err = peers
            .owner(
                SessionId::new(),
                "replica-a".into(),
                "https://127.0.0.1:1".into(),
                &origin,
                not_owner(),
            )
            .unwrap_err();
        let status = Status::from(err);
        assert_eq!(status.metadata().get(ERROR_METADATA).unwrap(), "not_owner");
        assert!(
            status.message().contains("replica.peer_tls_ca_file"),
            "{status:?}"
        );
        // With one, a client is made for it.
        let trusting = Peers::new("replica-b".into(), Policy::Forward, 1 << 20).with_tls(PeerTls {
            trust: Some(ClientTlsConfig::new()),
            no_plain_text: true,
        });
        let owner = trusting
            .owner(
                SessionId::new(),
                "replica-a".into(),
                "https://127.0.0.1:1".into(),
                &origin,
                not_owner(),
            )
            .unwrap();
        assert_eq!(owner.address, "https://127.0.0.1:1");
        // A replica serving TLS does not pass a token on in clear text.
        let err = trusting
            .owner(
                SessionId::new(),
                "replica-c".into(),
                "127.0.0.1:1".into(),
                &origin,
                not_owner(),
            )
            .unwrap_err();
        let status = Status::from(err);
        assert_eq!(status.metadata().get(ERROR_METADATA).unwrap(), "not_owner");
        assert!(status.message().contains("clear text"), "{status:?}");
    }
}
