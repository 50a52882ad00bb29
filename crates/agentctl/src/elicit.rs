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

/// What a form asks for: the properties it names (with their JSON schema)
/// and those it requires. Empty for a URL.
#[derive(Debug, Clone, Default)]
pub struct Form {
    properties: Map<String, Value>,
    required: Vec<String>,
}

/// The form of an elicitation request (empty for a URL).
pub fn form(req: &CreateElicitationRequest) -> Form {
    let ElicitationMode::Form(f) = &req.mode else {
        return Form::default();
    };
    let schema = serde_json::to_value(&f.requested_schema).unwrap_or_default();
    Form {
        properties: schema
            .get("properties")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default(),
        required: schema
            .get("required")
            .cloned()
            .and_then(|r| serde_json::from_value(r).ok())
            .unwrap_or_default(),
    }
}

/// The form's values as sent (`{}` when empty): a JSON object holding
/// every `required` property, each value of the type its property's schema
/// says (`string`, with its `enum` if any; `number`; `integer`; `boolean`;
/// `array` of strings), and no property the form does not name.
pub fn form_values(content_json: &str, form: &Form) -> Result<Map<String, Value>, String> {
    let text = if content_json.trim().is_empty() {
        "{}"
    } else {
        content_json
    };
    let Value::Object(map) = serde_json::from_str::<Value>(text).map_err(|e| e.to_string())? else {
        return Err("not a JSON object".into());
    };
    for (k, v) in &map {
        let Some(schema) = form.properties.get(k) else {
            if form.properties.is_empty() {
                // A form that names no properties: any plain value.
                check_type(k, v, None)?;
                continue;
            }
            let mut names: Vec<&str> = form.properties.keys().map(String::as_str).collect();
            names.sort_unstable();
            return Err(format!(
                "the form has no field {k:?} (its fields: {})",
                names.join(", ")
            ));
        };
        check_type(k, v, Some(schema))?;
    }
    if let Some(missing) = form.required.iter().find(|r| !map.contains_key(*r)) {
        return Err(format!("the form requires {missing:?}"));
    }
    Ok(map)
}

/// `v` as field `k` with `schema` (any plain value without one).
fn check_type(k: &str, v: &Value, schema: Option<&Value>) -> Result<(), String> {
    let wanted = schema.and_then(|s| s.get("type")).and_then(Value::as_str);
    let ok = match wanted {
        Some("string") => v.is_string(),
        Some("number") => v.is_number(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("boolean") => v.is_boolean(),
        Some("array") => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
        _ => match v {
            Value::String(_) | Value::Number(_) | Value::Bool(_) => true,
            Value::Array(items) => items.iter().all(Value::is_string),
            _ => false,
        },
    };
    if !ok {
        return Err(match wanted {
            Some("array") => format!("{k:?} is {v}; the form wants an array of strings"),
            Some(t) => format!("{k:?} is {v}; the form wants a {t}"),
            None => {
                format!("{k:?} is {v}; values are strings, numbers, booleans or arrays of strings")
            }
        });
    }
    let choices = schema.and_then(|s| s.get("enum")).and_then(Value::as_array);
    if let Some(choices) = choices
        && !choices.contains(v)
    {
        let listed: Vec<String> = choices.iter().map(Value::to_string).collect();
        return Err(format!(
            "{k:?} is {v}; the form allows {}",
            listed.join(", ")
        ));
    }
    Ok(())
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
        let free = Form {
            properties: Map::new(),
            required: vec!["name".to_owned()],
        };
        let ok = form_values(r#"{"name":"Ada","age":36,"ok":true,"tags":["a"]}"#, &free).unwrap();
        let acp = to_acp(ok);
        assert_eq!(acp["age"], ElicitationContentValue::Integer(36));
        assert!(form_values("{}", &free).unwrap_err().contains("\"name\""));
        assert!(
            form_values("[1]", &Form::default())
                .unwrap_err()
                .contains("object")
        );
        assert!(
            form_values(r#"{"x":{"y":1}}"#, &Form::default())
                .unwrap_err()
                .contains("\"x\"")
        );
        assert!(form_values("", &Form::default()).unwrap().is_empty());
    }

    #[test]
    fn form_values_follow_the_schema() {
        let schema: Value = serde_json::from_str(
            r#"{"type":"object","required":["name"],"properties":{
                "name":{"type":"string"},"age":{"type":"integer"},
                "size":{"type":"string","enum":["S","M"]},"ok":{"type":"boolean"}}}"#,
        )
        .unwrap();
        let form = Form {
            properties: schema["properties"].as_object().unwrap().clone(),
            required: vec!["name".to_owned()],
        };
        assert!(form_values(r#"{"name":"Ada","age":3,"size":"M","ok":false}"#, &form).is_ok());
        let err = |json| form_values(json, &form).unwrap_err();
        assert!(err(r#"{"name":true}"#).contains("wants a string"));
        assert!(err(r#"{"name":"a","age":1.5}"#).contains("wants a integer"));
        assert!(err(r#"{"name":"a","size":"XL"}"#).contains("allows \"S\", \"M\""));
        assert!(err(r#"{"name":"a","city":"x"}"#).contains("no field \"city\""));
    }
}
