//! ACP elicitations (`elicitation/create`: the agent asks the user to fill
//! a form or visit a URL) go through the same path as permission requests
//! (see `agent.rs`): journaled, a `permission` part with options `accept`,
//! `decline`, `cancel`, answered by `RespondPermission`. This module checks
//! the form's values a backend sends.

use std::collections::BTreeMap;

use agent_client_protocol::v1::schema::{
    CreateElicitationRequest, ElicitationContentValue, ElicitationMode,
};
use serde_json::{Map, Value};

/// The properties the request's form requires (none for a URL).
pub fn required(req: &CreateElicitationRequest) -> Vec<String> {
    match &req.mode {
        ElicitationMode::Form(f) => serde_json::to_value(&f.requested_schema)
            .ok()
            .and_then(|v| v.get("required").cloned())
            .and_then(|r| serde_json::from_value(r).ok())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// The form's values as sent (`{}` when empty): a JSON object of strings,
/// numbers, booleans and string arrays holding every `required` property.
pub fn form_values(content_json: &str, required: &[String]) -> Result<Map<String, Value>, String> {
    let text = if content_json.trim().is_empty() {
        "{}"
    } else {
        content_json
    };
    let Value::Object(map) = serde_json::from_str::<Value>(text).map_err(|e| e.to_string())? else {
        return Err("not a JSON object".into());
    };
    for (k, v) in &map {
        let ok = match v {
            Value::String(_) | Value::Number(_) | Value::Bool(_) => true,
            Value::Array(items) => items.iter().all(Value::is_string),
            _ => false,
        };
        if !ok {
            return Err(format!(
                "{k:?} is {v}; values are strings, numbers, booleans or arrays of strings"
            ));
        }
    }
    if let Some(missing) = required.iter().find(|r| !map.contains_key(*r)) {
        return Err(format!("the form requires {missing:?}"));
    }
    Ok(map)
}

/// Checked values as ACP content.
pub fn to_acp(map: Map<String, Value>) -> BTreeMap<String, ElicitationContentValue> {
    map.into_iter()
        .filter_map(|(k, v)| {
            let v = match v {
                Value::String(s) => ElicitationContentValue::String(s),
                Value::Bool(b) => ElicitationContentValue::Boolean(b),
                Value::Number(n) => match n.as_i64() {
                    Some(i) => ElicitationContentValue::Integer(i),
                    None => ElicitationContentValue::Number(n.as_f64()?),
                },
                Value::Array(items) => ElicitationContentValue::StringArray(
                    items
                        .into_iter()
                        .filter_map(|i| i.as_str().map(str::to_owned))
                        .collect(),
                ),
                _ => return None,
            };
            Some((k, v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_values_are_checked() {
        let req = vec!["name".to_owned()];
        let ok = form_values(r#"{"name":"Ada","age":36,"ok":true,"tags":["a"]}"#, &req).unwrap();
        let acp = to_acp(ok);
        assert_eq!(acp["age"], ElicitationContentValue::Integer(36));
        assert!(form_values("{}", &req).unwrap_err().contains("\"name\""));
        assert!(form_values("[1]", &[]).unwrap_err().contains("object"));
        assert!(
            form_values(r#"{"x":{"y":1}}"#, &[])
                .unwrap_err()
                .contains("\"x\"")
        );
        assert!(form_values("", &[]).unwrap().is_empty());
    }
}
