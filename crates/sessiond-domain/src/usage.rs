//! What an agent's turns used and cost, as the agents report them: one
//! turn's [`TurnUsage`], and [`UsageTotals`] over a session's or a task's
//! turns. A session keeps its totals in its metadata (`usage.*` keys, plain
//! numbers), written in the same commit that ends the turn, so a turn is
//! counted exactly once however often its end is replayed.

use std::collections::BTreeMap;

/// An amount in a currency (`USD`, `EUR`) or another unit (`credits`).
#[derive(Debug, Clone, PartialEq)]
pub struct Cost {
    /// How much.
    pub amount: f64,
    /// Of what.
    pub currency: String,
}

/// One turn's usage: the token counts of the agent's answer to the prompt,
/// the context window after the turn, and the turn's cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnUsage {
    /// Input tokens.
    pub input_tokens: Option<u64>,
    /// Output tokens.
    pub output_tokens: Option<u64>,
    /// Thought (reasoning) tokens.
    pub thought_tokens: Option<u64>,
    /// Input tokens read from the model's cache.
    pub cached_read_tokens: Option<u64>,
    /// Input tokens written to the model's cache.
    pub cached_write_tokens: Option<u64>,
    /// All tokens, as the agent counts them.
    pub total_tokens: Option<u64>,
    /// Tokens in the context window after the turn.
    pub context_used: Option<u64>,
    /// The context window's size.
    pub context_size: Option<u64>,
    /// What the turn cost.
    pub cost: Option<Cost>,
}

impl TurnUsage {
    /// The reported total, else the sum of the counts reported.
    pub fn tokens(&self) -> u64 {
        self.total_tokens.unwrap_or_else(|| {
            [self.input_tokens, self.output_tokens, self.thought_tokens]
                .iter()
                .flatten()
                .fold(0u64, |a, b| a.saturating_add(*b))
        })
    }
}

/// Sums over turns. Costs are summed per currency, never converted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageTotals {
    /// Turns that reported any usage.
    pub turns: u64,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Thought (reasoning) tokens.
    pub thought_tokens: u64,
    /// Input tokens read from the model's cache.
    pub cached_read_tokens: u64,
    /// Input tokens written to the model's cache.
    pub cached_write_tokens: u64,
    /// All tokens.
    pub total_tokens: u64,
    /// By currency.
    pub costs: BTreeMap<String, f64>,
}

// Costs are finite numbers (reports that are not are dropped before they
// are summed), so equality is total.
impl Eq for UsageTotals {}

const PREFIX: &str = "usage.";
const COST_PREFIX: &str = "usage.cost.";

impl UsageTotals {
    /// Counts one more turn.
    pub fn add_turn(&mut self, u: &TurnUsage) {
        self.turns += 1;
        let add = |sum: &mut u64, n: Option<u64>| *sum = sum.saturating_add(n.unwrap_or(0));
        add(&mut self.input_tokens, u.input_tokens);
        add(&mut self.output_tokens, u.output_tokens);
        add(&mut self.thought_tokens, u.thought_tokens);
        add(&mut self.cached_read_tokens, u.cached_read_tokens);
        add(&mut self.cached_write_tokens, u.cached_write_tokens);
        add(&mut self.total_tokens, Some(u.tokens()));
        if let Some(c) = &u.cost {
            *self.costs.entry(c.currency.clone()).or_default() += c.amount;
        }
    }

    /// Adds another sum (a task's totals are its sessions').
    pub fn add(&mut self, o: &UsageTotals) {
        self.turns += o.turns;
        self.input_tokens = self.input_tokens.saturating_add(o.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(o.output_tokens);
        self.thought_tokens = self.thought_tokens.saturating_add(o.thought_tokens);
        self.cached_read_tokens = self.cached_read_tokens.saturating_add(o.cached_read_tokens);
        self.cached_write_tokens = self
            .cached_write_tokens
            .saturating_add(o.cached_write_tokens);
        self.total_tokens = self.total_tokens.saturating_add(o.total_tokens);
        for (c, a) in &o.costs {
            *self.costs.entry(c.clone()).or_default() += a;
        }
    }

    fn counters(&mut self) -> [(&'static str, &mut u64); 7] {
        [
            ("turns", &mut self.turns),
            ("input_tokens", &mut self.input_tokens),
            ("output_tokens", &mut self.output_tokens),
            ("thought_tokens", &mut self.thought_tokens),
            ("cached_read_tokens", &mut self.cached_read_tokens),
            ("cached_write_tokens", &mut self.cached_write_tokens),
            ("total_tokens", &mut self.total_tokens),
        ]
    }

    /// A session's totals from its metadata (nothing there: zero; a value
    /// that does not parse counts as zero).
    pub fn from_metadata(m: &BTreeMap<String, String>) -> Self {
        let mut t = UsageTotals::default();
        for (name, n) in t.counters() {
            *n = m
                .get(&format!("{PREFIX}{name}"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
        }
        for (k, v) in m.range(COST_PREFIX.to_owned()..) {
            let Some(currency) = k.strip_prefix(COST_PREFIX) else {
                break;
            };
            if let Ok(a) = v.parse::<f64>()
                && a.is_finite()
            {
                t.costs.insert(currency.to_owned(), a);
            }
        }
        t
    }

    /// Writes these totals into a session's metadata.
    pub fn write_metadata(&self, m: &mut BTreeMap<String, String>) {
        let mut me = self.clone();
        for (name, n) in me.counters() {
            m.insert(format!("{PREFIX}{name}"), n.to_string());
        }
        for (c, a) in &self.costs {
            m.insert(format!("{COST_PREFIX}{c}"), a.to_string());
        }
    }

    /// No turn reported usage.
    pub fn is_empty(&self) -> bool {
        self.turns == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_turns_and_round_trip_through_metadata() {
        let mut t = UsageTotals::default();
        t.add_turn(&TurnUsage {
            input_tokens: Some(100),
            output_tokens: Some(20),
            cost: Some(Cost {
                amount: 0.25,
                currency: "USD".into(),
            }),
            ..TurnUsage::default()
        });
        t.add_turn(&TurnUsage {
            total_tokens: Some(50),
            cost: Some(Cost {
                amount: 0.5,
                currency: "USD".into(),
            }),
            ..TurnUsage::default()
        });
        assert_eq!((t.turns, t.input_tokens, t.total_tokens), (2, 100, 170));
        assert_eq!(t.costs.get("USD"), Some(&0.75));
        let mut m = BTreeMap::new();
        m.insert("resume_token".to_owned(), "x".to_owned());
        t.write_metadata(&mut m);
        assert_eq!(UsageTotals::from_metadata(&m), t);
        assert!(UsageTotals::from_metadata(&BTreeMap::new()).is_empty());
        let mut sum = t.clone();
        sum.add(&t);
        assert_eq!((sum.turns, sum.costs.get("USD")), (4, Some(&1.5)));
    }
}
