//! The session's ACP config options (the model, a reasoning effort, ...):
//! the wire form of what the agent offers, and the check of a value before
//! `session/set_config_option` is sent.

use agent_client_protocol::v1::schema::{
    SessionConfigKind, SessionConfigOption, SessionConfigOptionValue, SessionConfigSelectOptions,
};
use sessiond_proto::agentctl::v1::{ConfigOption, ConfigValue};

use crate::error::{Error, Result};

fn category(o: &SessionConfigOption) -> String {
    o.category
        .as_ref()
        .and_then(|c| serde_json::to_value(c).ok())
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn values(o: &SessionConfigOption) -> Vec<ConfigValue> {
    let SessionConfigKind::Select(s) = &o.kind else {
        return Vec::new();
    };
    let flat: Vec<_> = match &s.options {
        SessionConfigSelectOptions::Ungrouped(v) => v.iter().collect(),
        SessionConfigSelectOptions::Grouped(groups) => {
            groups.iter().flat_map(|g| g.options.iter()).collect()
        }
        _ => Vec::new(),
    };
    flat.into_iter()
        .map(|v| ConfigValue {
            value: v.value.0.to_string(),
            name: v.name.clone(),
            description: v.description.clone().unwrap_or_default(),
        })
        .collect()
}

/// An option as agentctl reports it.
pub fn wire(o: &SessionConfigOption) -> ConfigOption {
    let (kind, current) = match &o.kind {
        SessionConfigKind::Select(s) => ("select", s.current_value.0.to_string()),
        SessionConfigKind::Boolean(b) => ("boolean", b.current_value.to_string()),
        _ => ("other", String::new()),
    };
    ConfigOption {
        id: o.id.0.to_string(),
        name: o.name.clone(),
        description: o.description.clone().unwrap_or_default(),
        category: category(o),
        r#type: kind.to_owned(),
        current_value: current,
        values: values(o),
    }
}

/// The ACP value to send for `value` of option `config_id`, or
/// INVALID_ARGUMENT naming what the agent offers.
pub fn value_for(
    options: &[SessionConfigOption],
    config_id: &str,
    value: &str,
) -> Result<SessionConfigOptionValue> {
    let Some(o) = options.iter().find(|o| &*o.id.0 == config_id) else {
        let ids: Vec<&str> = options.iter().map(|o| &*o.id.0).collect();
        return Err(Error::InvalidArgument(format!(
            "config_id: the agent has no config option {config_id:?}; its options are {}",
            if ids.is_empty() {
                "none".to_owned()
            } else {
                ids.join(", ")
            }
        )));
    };
    match &o.kind {
        SessionConfigKind::Boolean(_) => match value {
            "true" => Ok(SessionConfigOptionValue::boolean(true)),
            "false" => Ok(SessionConfigOptionValue::boolean(false)),
            _ => Err(Error::InvalidArgument(format!(
                "value: config option {config_id} is true or false, not {value:?}"
            ))),
        },
        _ => {
            let offered = values(o);
            if offered.iter().any(|v| v.value == value) {
                Ok(SessionConfigOptionValue::value_id(value.to_owned()))
            } else {
                let names: Vec<&str> = offered.iter().map(|v| v.value.as_str()).collect();
                Err(Error::InvalidArgument(format!(
                    "value: the agent does not offer {value:?} for config option {config_id}; it offers {}",
                    names.join(", ")
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use agent_client_protocol::v1::schema::{
        SessionConfigBoolean, SessionConfigOptionCategory, SessionConfigSelect,
        SessionConfigSelectOption,
    };

    use super::*;

    fn options() -> Vec<SessionConfigOption> {
        vec![
            SessionConfigOption::new(
                "model",
                "Model",
                SessionConfigKind::Select(SessionConfigSelect::new(
                    "small",
                    vec![
                        SessionConfigSelectOption::new("small", "Small"),
                        SessionConfigSelectOption::new("large", "Large"),
                    ],
                )),
            )
            .category(SessionConfigOptionCategory::Model),
            SessionConfigOption::new(
                "fast",
                "Fast",
                SessionConfigKind::Boolean(SessionConfigBoolean::new(false)),
            ),
        ]
    }

    #[test]
    fn options_on_the_wire_and_values_checked() {
        let o = options();
        let w = wire(&o[0]);
        assert_eq!(
            (
                w.id.as_str(),
                w.category.as_str(),
                w.r#type.as_str(),
                w.current_value.as_str()
            ),
            ("model", "model", "select", "small")
        );
        assert_eq!(w.values.len(), 2);
        assert_eq!(wire(&o[1]).current_value, "false");
        assert!(value_for(&o, "model", "large").is_ok());
        assert!(value_for(&o, "fast", "true").is_ok());
        let e = value_for(&o, "model", "huge").unwrap_err().to_string();
        assert!(e.contains("it offers small, large"), "{e}");
        let e = value_for(&o, "effort", "high").unwrap_err().to_string();
        assert!(e.contains("its options are model, fast"), "{e}");
    }
}

/// The MCP servers a profile gives its agent, secrets resolved. Held in
/// memory only; `Debug` names the servers, never their environment or
/// headers.
#[derive(Clone, Default)]
pub struct McpServers(pub Vec<agent_client_protocol::v1::schema::McpServer>);

impl std::fmt::Debug for McpServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use agent_client_protocol::v1::schema::McpServer as M;
        let names: Vec<&str> = self
            .0
            .iter()
            .map(|s| match s {
                M::Stdio(s) => s.name.as_str(),
                M::Http(s) => s.name.as_str(),
                M::Sse(s) => s.name.as_str(),
                _ => "?",
            })
            .collect();
        write!(f, "McpServers({names:?})")
    }
}

impl McpServers {
    /// From LaunchAgent's servers.
    pub fn from_wire(servers: Vec<sessiond_proto::agentctl::v1::McpServer>) -> Result<Self> {
        use agent_client_protocol::v1::schema::{
            EnvVariable, HttpHeader, McpServer as M, McpServerHttp, McpServerSse, McpServerStdio,
        };
        let headers = |h: std::collections::HashMap<String, String>| {
            let mut h: Vec<_> = h.into_iter().collect();
            h.sort();
            h.into_iter()
                .map(|(k, v)| HttpHeader::new(k, v))
                .collect::<Vec<_>>()
        };
        servers
            .into_iter()
            .map(|s| {
                Ok(match s.r#type.as_str() {
                    "stdio" | "" => {
                        let mut env: Vec<_> = s.env.into_iter().collect();
                        env.sort();
                        M::Stdio(
                            McpServerStdio::new(s.name, s.command).args(s.args).env(
                                env.into_iter()
                                    .map(|(k, v)| EnvVariable::new(k, v))
                                    .collect(),
                            ),
                        )
                    }
                    "http" => {
                        M::Http(McpServerHttp::new(s.name, s.url).headers(headers(s.headers)))
                    }
                    "sse" => M::Sse(McpServerSse::new(s.name, s.url).headers(headers(s.headers))),
                    other => {
                        return Err(Error::InvalidArgument(format!(
                            "mcp_servers: {:?} has type {other:?}, not stdio, http or sse",
                            s.name
                        )));
                    }
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(McpServers)
    }

    /// FAILED_PRECONDITION naming the first server the agent's MCP
    /// capabilities cannot take.
    pub fn check(&self, caps: &agent_client_protocol::v1::schema::McpCapabilities) -> Result<()> {
        use agent_client_protocol::v1::schema::McpServer as M;
        for s in &self.0 {
            let (name, needs) = match s {
                M::Http(s) if !caps.http => (&s.name, "http"),
                M::Sse(s) if !caps.sse => (&s.name, "sse"),
                _ => continue,
            };
            return Err(Error::FailedPrecondition(format!(
                "the agent does not take MCP servers over {needs} (its mcpCapabilities.{needs} \
                 is false), and the session's MCP servers (its profile's, or its create \
                 request's) include {name:?}: remove that server or use an agent that offers it"
            )));
        }
        Ok(())
    }
}
