//! MCP servers one session's agent gets besides its profile's: given at
//! create, kept in the session's metadata (`mcp_servers`, JSON), and added
//! to the profile's on every launch of the session's agent (new, load,
//! resume). Secret values are kept as the references they were given as
//! (`env` / `file`, which must be ones the configuration names, read at
//! startup), never resolved into the database.

use std::{collections::BTreeMap, sync::Arc};

use serde_json::{Value, json};
use sessiond_domain::{AgentProfile, McpServer, McpTransport, SecretValue, Secrets};

use crate::{Error, Result};

/// The session metadata key holding its own MCP servers.
pub(crate) const KEY: &str = "mcp_servers";

/// Checks servers given for one session: names unique and not the
/// profile's, a stdio command or an http/sse URL, references resolvable.
/// The most MCP servers one create may add to its profile's.
const MAX_SESSION_MCP_SERVERS: usize = 32;

pub(crate) fn check(
    profile: &AgentProfile,
    servers: &[McpServer],
    secrets: &Secrets,
) -> Result<()> {
    if servers.len() > MAX_SESSION_MCP_SERVERS {
        return Err(Error::InvalidArgument(format!(
            "mcp_servers: {} given, at most {MAX_SESSION_MCP_SERVERS}",
            servers.len()
        )));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, s) in servers.iter().enumerate() {
        let bad = |what: String| {
            Error::InvalidArgument(format!("mcp_servers[{i}] ({:?}): {what}", s.name))
        };
        if s.name.trim().is_empty() {
            return Err(bad("name: required".into()));
        }
        // The agent shows it and names the server's tools after it.
        if s.name.len() > 64
            || !s
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(bad("name: up to 64 letters, digits, '-', '_' or '.'".into()));
        }
        if !names.insert(s.name.as_str()) || profile.mcp_servers.iter().any(|p| p.name == s.name) {
            return Err(bad(format!(
                "the name is taken (by another server of the request or of profile {:?})",
                profile.name
            )));
        }
        let values = match &s.transport {
            McpTransport::Stdio { command, args, env } => {
                if command.trim().is_empty() {
                    return Err(bad("command: required for a stdio server".into()));
                }
                if command.contains("://") {
                    return Err(bad(format!(
                        "command {command:?} looks like a URL: an http(s) server is given as \
                         type http or sse with url"
                    )));
                }
                if command.contains('\0') || args.iter().any(|a| a.contains('\0')) {
                    return Err(bad("command and args must not contain NUL bytes".into()));
                }
                if let Some(k) = env.keys().find(|k| k.is_empty() || k.contains(['=', '\0'])) {
                    return Err(bad(format!(
                        "env: {k:?} is not a variable name (empty, or holds '=' or NUL)"
                    )));
                }
                env
            }
            McpTransport::Http { url, headers } | McpTransport::Sse { url, headers } => {
                if let Some(problem) = sessiond_domain::http_url_problem(url) {
                    return Err(bad(format!("url {url:?}: {problem}")));
                }
                headers
            }
        };
        for (k, v) in values {
            if secrets.resolve(v).is_none() {
                return Err(bad(format!(
                    "{k} refers to {}, which is not a secret the configuration names (only \
                     references a profile's MCP servers use are read at startup)",
                    match v {
                        SecretValue::Env(var) => format!("the environment variable {var}"),
                        SecretValue::File(path) => format!("the file {path}"),
                        SecretValue::Plain(_) => "a plain value".into(),
                    }
                )));
            }
        }
    }
    Ok(())
}

/// The servers as stored in the session's metadata.
pub(crate) fn to_metadata(servers: &[McpServer]) -> String {
    let values = |m: &BTreeMap<String, SecretValue>| -> Value {
        m.iter()
            .map(|(k, v)| {
                let v = match v {
                    SecretValue::Plain(x) => json!({"plain": x}),
                    SecretValue::Env(x) => json!({"env": x}),
                    SecretValue::File(x) => json!({"file": x}),
                };
                (k.clone(), v)
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    Value::Array(
        servers
            .iter()
            .map(|s| match &s.transport {
                McpTransport::Stdio { command, args, env } => json!({
                    "name": s.name, "type": "stdio", "command": command, "args": args, "env": values(env),
                }),
                McpTransport::Http { url, headers } => json!({
                    "name": s.name, "type": "http", "url": url, "headers": values(headers),
                }),
                McpTransport::Sse { url, headers } => json!({
                    "name": s.name, "type": "sse", "url": url, "headers": values(headers),
                }),
            })
            .collect(),
    )
    .to_string()
}

/// The session's own servers, from its metadata.
pub fn of_metadata(metadata: &BTreeMap<String, String>) -> Vec<McpServer> {
    let Some(v) = metadata
        .get(KEY)
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
    else {
        return Vec::new();
    };
    let s = |v: &Value, k: &str| {
        v.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let values = |v: Option<&Value>| -> BTreeMap<String, SecretValue> {
        v.and_then(Value::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| {
                let secret = if let Some(x) = v.get("plain").and_then(Value::as_str) {
                    SecretValue::Plain(x.to_owned())
                } else if let Some(x) = v.get("env").and_then(Value::as_str) {
                    SecretValue::Env(x.to_owned())
                } else {
                    SecretValue::File(v.get("file")?.as_str()?.to_owned())
                };
                Some((k.clone(), secret))
            })
            .collect()
    };
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let transport = match e.get("type")?.as_str()? {
                "stdio" => McpTransport::Stdio {
                    command: s(e, "command"),
                    args: e
                        .get("args")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(|a| a.as_str().map(str::to_owned))
                        .collect(),
                    env: values(e.get("env")),
                },
                "http" => McpTransport::Http {
                    url: s(e, "url"),
                    headers: values(e.get("headers")),
                },
                "sse" => McpTransport::Sse {
                    url: s(e, "url"),
                    headers: values(e.get("headers")),
                },
                _ => return None,
            };
            Some(McpServer {
                name: s(e, "name"),
                transport,
            })
        })
        .collect()
}

/// `profile` with the session's own servers after its own.
pub(crate) fn with_session_servers(
    mut profile: Arc<AgentProfile>,
    metadata: &BTreeMap<String, String>,
) -> Arc<AgentProfile> {
    // Shared: copied only when the session has servers of its own.
    let servers = of_metadata(metadata);
    if !servers.is_empty() {
        Arc::make_mut(&mut profile).mcp_servers.extend(servers);
    }
    profile
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_round_trip_through_metadata_as_references() {
        let servers = vec![
            McpServer {
                name: "tools".into(),
                transport: McpTransport::Stdio {
                    command: "mcp-tools".into(),
                    args: vec!["--ro".into()],
                    env: [
                        ("MODE".to_owned(), SecretValue::Plain("ro".into())),
                        ("TOKEN".to_owned(), SecretValue::Env("TOOLS_TOKEN".into())),
                    ]
                    .into(),
                },
            },
            McpServer {
                name: "docs".into(),
                transport: McpTransport::Sse {
                    url: "https://mcp.example/sse".into(),
                    headers: [(
                        "Authorization".to_owned(),
                        SecretValue::File("/run/k".into()),
                    )]
                    .into(),
                },
            },
        ];
        let mut m = BTreeMap::new();
        m.insert(KEY.to_owned(), to_metadata(&servers));
        assert_eq!(of_metadata(&m), servers);
        assert!(!m[KEY].contains("TOOLS_TOKEN=") && m[KEY].contains("\"env\":\"TOOLS_TOKEN\""));
        assert!(of_metadata(&BTreeMap::new()).is_empty());
    }
}
