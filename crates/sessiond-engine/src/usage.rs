//! A turn's usage between agentctl's `TurnUsage`, the domain's
//! [`TurnUsage`] and the JSON kept in the data of the turn's user message
//! (`{"usage": {...}}`), which the server reads back for the API.

use serde_json::{Value, json};
use sessiond_domain::{Cost, TurnUsage};
use sessiond_proto::agentctl::v1 as pb;

/// agentctl's report as the domain's. A cost that is not a finite,
/// non-negative number is dropped (it would poison every sum).
pub(crate) fn from_agentctl(u: &pb::TurnUsage) -> TurnUsage {
    TurnUsage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        thought_tokens: u.thought_tokens,
        cached_read_tokens: u.cached_read_tokens,
        cached_write_tokens: u.cached_write_tokens,
        total_tokens: u.total_tokens,
        context_used: u.context_used,
        context_size: u.context_size,
        cost: u
            .cost_amount
            .filter(|a| a.is_finite() && *a >= 0.0)
            .map(|amount| Cost {
                amount,
                currency: u.cost_currency.chars().take(16).collect(),
            }),
    }
}

/// `data` of the user message with the turn's usage set.
pub(crate) fn with_usage(data: &str, u: &TurnUsage) -> String {
    let mut v = serde_json::from_str::<Value>(data)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    v["usage"] = json!({
        "inputTokens": u.input_tokens,
        "outputTokens": u.output_tokens,
        "thoughtTokens": u.thought_tokens,
        "cachedReadTokens": u.cached_read_tokens,
        "cachedWriteTokens": u.cached_write_tokens,
        "totalTokens": u.total_tokens,
        "contextUsed": u.context_used,
        "contextSize": u.context_size,
        "cost": u.cost.as_ref().map(|c| json!({"amount": c.amount, "currency": c.currency})),
    });
    v.to_string()
}

/// The turn's usage kept in its user message's `data`, if any.
pub fn of_message_data(data: &str) -> Option<TurnUsage> {
    let v = serde_json::from_str::<Value>(data).ok()?;
    let u = v.get("usage").filter(|u| u.is_object())?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    Some(TurnUsage {
        input_tokens: n("inputTokens"),
        output_tokens: n("outputTokens"),
        thought_tokens: n("thoughtTokens"),
        cached_read_tokens: n("cachedReadTokens"),
        cached_write_tokens: n("cachedWriteTokens"),
        total_tokens: n("totalTokens"),
        context_used: n("contextUsed"),
        context_size: n("contextSize"),
        cost: u.get("cost").and_then(|c| {
            Some(Cost {
                amount: c.get("amount")?.as_f64()?,
                currency: c.get("currency")?.as_str()?.to_owned(),
            })
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_round_trips_through_message_data() {
        let u = TurnUsage {
            input_tokens: Some(3),
            context_size: Some(9),
            cost: Some(Cost {
                amount: 0.5,
                currency: "USD".into(),
            }),
            ..TurnUsage::default()
        };
        let data = with_usage("", &u);
        assert_eq!(of_message_data(&data), Some(u));
        assert_eq!(of_message_data(""), None);
    }
}
