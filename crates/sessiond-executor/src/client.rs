//! The authenticated agentctl client every driver hands out.
//!
//! Every call carries the executor's secret (`authorization: Bearer ...`) and a
//! deadline; connecting has its own timeout. An agentctl that accepts the TCP
//! connection and then never answers therefore surfaces as [`Error::Timeout`]
//! after at most `call_timeout`, never as a hang.

use std::{fmt, time::Duration};

use sessiond_domain::ExecutorId;
use sessiond_proto::agentctl::v1::{self as pb, agent_ctl_service_client::AgentCtlServiceClient};
use tonic::{
    metadata::{Ascii, MetadataValue},
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Channel, Endpoint},
};

use crate::error::{Error, Result};

pub use pb::AgentState;

/// How the backend talks to agentctl: timeouts and transport security.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Limit for establishing the TCP (and TLS) connection.
    pub connect_timeout: Duration,
    /// Deadline of every unary call, sent to agentctl as `grpc-timeout` and
    /// enforced on this side as well.
    pub call_timeout: Duration,
    /// HTTP/2 keep-alive pings on idle connections, so a dead peer under a
    /// long update stream is noticed.
    pub keep_alive_interval: Duration,
    /// TLS for `https://` agentctl URLs (remote executors).
    pub tls: Option<TlsConfig>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(20),
            tls: None,
        }
    }
}

/// Trust settings for an `https://` agentctl.
#[derive(Clone)]
pub struct TlsConfig {
    /// PEM of the CA that signed agentctl's certificate.
    pub ca_pem: Vec<u8>,
    /// Name to verify the certificate against, when it differs from the URL host.
    pub domain_name: Option<String>,
}

impl TlsConfig {
    /// Reads the CA certificate from a PEM file. For binaries building their
    /// configuration; the library itself reads no files.
    pub fn from_ca_file(path: &std::path::Path) -> Result<Self> {
        let ca_pem = std::fs::read(path).map_err(|source| Error::Io {
            action: "reading CA file",
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            ca_pem,
            domain_name: None,
        })
    }
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

/// Adds `authorization: Bearer <secret>` to every request.
#[derive(Clone)]
pub struct BearerAuth {
    header: MetadataValue<Ascii>,
}

impl fmt::Debug for BearerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BearerAuth(<redacted>)")
    }
}

impl Interceptor for BearerAuth {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        request
            .metadata_mut()
            .insert("authorization", self.header.clone());
        Ok(request)
    }
}

/// The generated client with authentication applied; all agentctl RPCs.
pub type RawClient = AgentCtlServiceClient<InterceptedService<Channel, BearerAuth>>;

/// What `Health` says about an agentctl.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub executor_id: String,
    pub agentctl_version: String,
    pub agent_state: AgentState,
    /// agentctl's own process id as it sees it (in a container: its namespace's).
    pub pid: u32,
    pub uptime: Duration,
}

/// Whether a capability is available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// Not known until the agent has answered ACP `initialize`.
    Unknown,
    Supported,
    Unsupported,
}

impl Support {
    pub fn is_supported(self) -> bool {
        self == Support::Supported
    }

    fn from_proto(value: i32) -> Self {
        match pb::Capability::try_from(value) {
            Ok(pb::Capability::Supported) => Support::Supported,
            Ok(pb::Capability::Unsupported) => Support::Unsupported,
            _ => Support::Unknown,
        }
    }
}

/// What `Capabilities` says (seed: "Agentctl Capability Probe").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    pub supports_session_resume: Support,
    pub supports_workspace_only: Support,
    pub profile_claims_session_resume: bool,
    pub agent_load_session: Option<bool>,
}

/// An authenticated, deadline-bound client of one agentctl.
///
/// Cheap to clone; connects lazily and reconnects by itself. [`Self::raw`]
/// gives every RPC of the contract; [`Self::health`] and
/// [`Self::capabilities`] are the calls the drivers need, with errors mapped.
#[derive(Clone)]
pub struct AgentctlClient {
    inner: RawClient,
    url: String,
    call_timeout: Duration,
}

impl fmt::Debug for AgentctlClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentctlClient")
            .field("url", &self.url)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl AgentctlClient {
    /// A client of the agentctl at `url` (`http://host:port` or
    /// `https://host:port`). Does not connect yet.
    pub fn new(url: &str, secret: &str, config: &ClientConfig) -> Result<Self> {
        let bad = |what: String| Error::Config(format!("agentctl url {url:?}: {what}"));
        let mut endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| bad(e.to_string()))?
            .connect_timeout(config.connect_timeout)
            .timeout(config.call_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(config.keep_alive_interval)
            .keep_alive_timeout(config.call_timeout)
            .keep_alive_while_idle(true);
        if url.starts_with("https://") {
            let Some(tls) = &config.tls else {
                return Err(bad(
                    "https needs a CA certificate (ClientConfig::tls)".into()
                ));
            };
            endpoint = with_tls(endpoint, tls).map_err(bad)?;
        } else if !url.starts_with("http://") {
            return Err(bad("expected an http:// or https:// URL".into()));
        }
        let header: MetadataValue<Ascii> = format!("Bearer {secret}")
            .parse()
            .map_err(|_| Error::Config("the executor secret is not valid header text".into()))?;
        let channel = endpoint.connect_lazy();
        Ok(Self {
            inner: AgentCtlServiceClient::with_interceptor(channel, BearerAuth { header }),
            url: url.to_owned(),
            call_timeout: config.call_timeout,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The generated client: every agentctl RPC, authenticated, with the
    /// per-call deadline of the configuration.
    pub fn raw(&self) -> RawClient {
        self.inner.clone()
    }

    /// `Health`, under the call deadline.
    pub async fn health(&self) -> Result<Health> {
        let mut client = self.raw();
        let resp = self
            .call("Health", async move {
                client.health(pb::HealthRequest {}).await
            })
            .await?;
        Ok(Health {
            executor_id: resp.executor_id,
            agentctl_version: resp.agentctl_version,
            agent_state: AgentState::try_from(resp.agent_state).unwrap_or(AgentState::Unspecified),
            pid: resp.pid,
            uptime: Duration::from_millis(resp.uptime_ms),
        })
    }

    /// `Health`, then a check that the answer comes from `expected`'s agentctl.
    pub async fn verify_identity(&self, expected: ExecutorId) -> Result<Health> {
        let health = self.health().await?;
        if health.executor_id != expected.to_string() {
            return Err(Error::IdentityMismatch {
                url: self.url.clone(),
                expected,
                actual: health.executor_id,
            });
        }
        Ok(health)
    }

    /// `Capabilities`, under the call deadline.
    pub async fn capabilities(&self) -> Result<Capabilities> {
        let mut client = self.raw();
        let resp = self
            .call("Capabilities", async move {
                client.capabilities(pb::CapabilitiesRequest {}).await
            })
            .await?;
        Ok(Capabilities {
            supports_session_resume: Support::from_proto(resp.supports_session_resume),
            supports_workspace_only: Support::from_proto(resp.supports_workspace_only),
            profile_claims_session_resume: resp.profile_claims_session_resume,
            agent_load_session: resp.agent_load_session,
        })
    }

    /// `StopAgent`; an agentctl with no agent running counts as stopped.
    pub async fn stop_agent(&self, grace: Duration) -> Result<()> {
        let mut client = self.raw();
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        match self
            .call("StopAgent", async move {
                client.stop_agent(pb::StopAgentRequest { grace_ms }).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Rpc { status, .. })
                if matches!(
                    status.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::NotFound
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Runs one unary call under the deadline (tonic enforces it too; this
    /// bound also covers connection setup) and maps its errors.
    async fn call<T>(
        &self,
        name: &'static str,
        fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let timeout = self.call_timeout;
        // A little slack so tonic's own deadline (which says more) fires first.
        let outer = timeout + Duration::from_millis(250);
        match tokio::time::timeout(outer, fut).await {
            Err(_) => Err(Error::Timeout {
                url: self.url.clone(),
                call: name,
                timeout,
            }),
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(self.map_status(name, status)),
        }
    }

    fn map_status(&self, call: &'static str, status: tonic::Status) -> Error {
        let url = self.url.clone();
        match status.code() {
            tonic::Code::Unauthenticated => Error::Unauthenticated { url },
            tonic::Code::DeadlineExceeded => Error::Timeout {
                url,
                call,
                timeout: self.call_timeout,
            },
            tonic::Code::Cancelled if is_timeout(&status) => Error::Timeout {
                url,
                call,
                timeout: self.call_timeout,
            },
            tonic::Code::Unavailable | tonic::Code::Unknown if is_transport_error(&status) => {
                Error::Unreachable {
                    url,
                    message: error_chain(&status),
                }
            }
            _ => Error::Rpc {
                url,
                call,
                status: Box::new(status),
            },
        }
    }
}

#[cfg(feature = "tls")]
fn with_tls(endpoint: Endpoint, tls: &TlsConfig) -> Result<Endpoint, String> {
    use tonic::transport::{Certificate, ClientTlsConfig};
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
    if let Some(domain) = &tls.domain_name {
        config = config.domain_name(domain.clone());
    }
    endpoint.tls_config(config).map_err(|e| e.to_string())
}

#[cfg(not(feature = "tls"))]
fn with_tls(_endpoint: Endpoint, _tls: &TlsConfig) -> Result<Endpoint, String> {
    Err("this build has no TLS support (sessiond-executor's `tls` feature)".into())
}

fn is_timeout(status: &tonic::Status) -> bool {
    let text = error_chain(status).to_ascii_lowercase();
    text.contains("timed out") || text.contains("timeout expired")
}

/// True when the status was made on this side from a transport failure
/// (connection refused, reset, ...), not sent by agentctl.
fn is_transport_error(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
        || status.message().contains("transport error")
        || status.message().contains("connection")
}

fn error_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        text.push_str(": ");
        text.push_str(&err.to_string());
        source = err.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throwaway self-signed CA (no key kept), to build a TLS endpoint.
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBjTCCATOgAwIBAgIUeXAUr90IFS0F1942O0TNt5pb9hAwCgYIKoZIzj0EAwIw\nGzEZMBcGA1UEAwwQc2Vzc2lvbmQtdGVzdC1jYTAgFw0yNjExMjkwODQxNDVaGA8y\nMTI2MTEwNTA4NDE0NVowGzEZMBcGA1UEAwwQc2Vzc2lvbmQtdGVzdC1jYTBZMBMG\nByqGSM49AgEGCCqGSM49AwEHA0IABPFE1gf8GKH15qrHxY5jrkUbQuf3Djz0sS0M\nDuTBm0NIzactjhnRXL0yJ6n8CUEKfcWXv9wpTQPRRYmwyHS1/S6jUzBRMB0GA1Ud\nDgQWBBRyQndZ3lr/ro+6tWUsdzTnUEaV9zAfBgNVHSMEGDAWgBRyQndZ3lr/ro+6\ntWUsdzTnUEaV9zAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCID/W\nPYsDSFG0SUMsAIxJoh0K34CapoKaRmptVXf2uZGEAiEA3XbvF0cHzOrdIMlwF+5W\nARVsYYTDcvmRvm4gEVLES3Y=\n-----END CERTIFICATE-----\n";

    #[test]
    fn rejects_urls_it_cannot_serve() {
        let config = ClientConfig::default();
        let err = AgentctlClient::new("ftp://host:1", "s", &config).expect_err("scheme");
        assert!(err.to_string().contains("http:// or https://"), "{err}");
        let err = AgentctlClient::new("https://host:1", "s", &config).expect_err("no CA");
        assert!(err.to_string().contains("CA certificate"), "{err}");
        let err = AgentctlClient::new("http://host:1", "line\nbreak", &config).expect_err("header");
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    #[tokio::test]
    async fn https_with_a_ca_builds_only_with_the_tls_feature() {
        let config = ClientConfig {
            tls: Some(TlsConfig {
                ca_pem: TEST_CA.as_bytes().to_vec(),
                domain_name: None,
            }),
            ..ClientConfig::default()
        };
        let built = AgentctlClient::new("https://127.0.0.1:1", "s", &config);
        assert_eq!(built.is_ok(), cfg!(feature = "tls"), "{built:?}");
    }
}
