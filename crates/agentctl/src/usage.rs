//! What a turn used and cost, as the agent reports it: its `usage_update`s
//! (tokens in context, the window's size, the session's cost so far) and
//! the token counts of its `session/prompt` answer, made into one
//! [`TurnUsage`] for the turn's `TurnEnded`.
//!
//! Agents report cost cumulatively, and from zero again when their process
//! restarts (the Claude Code CLI counts per process), so a turn's cost is
//! the last figure of the turn less the last one before it, from the same
//! agent process; a figure lower than that (a restarted count) is the
//! turn's whole cost.

use agent_client_protocol::v1::schema::{Usage, UsageUpdate};
use sessiond_proto::agentctl::v1::TurnUsage;

/// Per agent process: reset at every launch.
#[derive(Debug, Default)]
pub struct UsageTrack {
    /// The last cumulative cost reported (amount, currency).
    cost: Option<(f64, String)>,
    /// The cumulative cost when the turn in progress began.
    base: Option<(f64, String)>,
    /// Tokens in context and the window's size, last reported in the turn.
    context: Option<(u64, u64)>,
    /// A usage update came during the turn in progress.
    reported: bool,
}

/// A session's cost above this is no cost but a broken report (kept out
/// of totals, where it would drown every real one).
const MAX_COST: f64 = 1e9;

impl UsageTrack {
    /// A `usage_update`, in a turn or between turns (after a load, agents
    /// tell the cost so far: the next turn counts from there).
    pub fn update(&mut self, u: &UsageUpdate, in_turn: bool) {
        if let Some(c) = &u.cost
            && c.amount.is_finite()
            && (0.0..=MAX_COST).contains(&c.amount)
        {
            self.cost = Some((c.amount, clip_currency(&c.currency)));
        }
        if in_turn {
            self.context = Some((u.used, u.size));
            self.reported = true;
        }
    }

    pub fn turn_started(&mut self) {
        self.base = self.cost.clone();
        self.context = None;
        self.reported = false;
    }

    /// The turn's usage from what was reported during it and the prompt's
    /// answer (`tokens`); `None` when the agent reported nothing.
    pub fn turn_ended(&mut self, tokens: Option<&Usage>) -> Option<TurnUsage> {
        let reported = std::mem::take(&mut self.reported);
        if !reported && tokens.is_none() {
            return None;
        }
        let mut out = TurnUsage::default();
        if let Some(t) = tokens {
            out.input_tokens = Some(t.input_tokens);
            out.output_tokens = Some(t.output_tokens);
            out.thought_tokens = t.thought_tokens;
            out.cached_read_tokens = t.cached_read_tokens;
            out.cached_write_tokens = t.cached_write_tokens;
            out.total_tokens = Some(t.total_tokens);
        }
        if let Some((used, size)) = self.context.take() {
            out.context_used = Some(used);
            out.context_size = Some(size);
        }
        if reported && let Some((now, currency)) = &self.cost {
            let cost = match &self.base {
                Some((before, c)) if c == currency && *before <= *now => now - before,
                _ => *now,
            };
            out.cost_amount = Some(cost);
            out.cost_currency = currency.clone();
            out.session_cost_amount = Some(*now);
        }
        self.base = self.cost.clone();
        Some(out)
    }
}

/// Currencies are short codes (`USD`, `credits`); anything else is cut.
fn clip_currency(c: &str) -> String {
    c.chars().take(16).collect()
}

#[cfg(test)]
mod tests {
    use agent_client_protocol::v1::schema::Cost;

    use super::*;

    fn update(used: u64, cost: f64) -> UsageUpdate {
        UsageUpdate::new(used, 1000).cost(Cost::new(cost, "USD"))
    }

    #[test]
    fn an_absurd_cost_is_not_taken() {
        let mut t = UsageTrack::default();
        t.update(&update(10, 0.5), true);
        t.update(&update(10, 1e300), true);
        t.update(&update(10, -1.0), true);
        assert_eq!(t.turn_ended(None).unwrap().session_cost_amount, Some(0.5));
    }

    #[test]
    fn a_turn_costs_the_difference_and_a_restarted_count_is_whole() {
        let mut t = UsageTrack::default();
        t.turn_started();
        t.update(&update(10, 0.5), true);
        t.update(&update(20, 1.0), true);
        let u = t
            .turn_ended(Some(&Usage::new(30, 20, 10).thought_tokens(5)))
            .unwrap();
        assert_eq!(u.cost_amount, Some(1.0));
        assert_eq!(u.session_cost_amount, Some(1.0));
        assert_eq!((u.context_used, u.context_size), (Some(20), Some(1000)));
        assert_eq!(
            (
                u.input_tokens,
                u.output_tokens,
                u.thought_tokens,
                u.total_tokens
            ),
            (Some(20), Some(10), Some(5), Some(30))
        );
        t.turn_started();
        t.update(&update(25, 1.25), true);
        let u = t.turn_ended(None).unwrap();
        assert_eq!(u.cost_amount, Some(0.25));
        assert_eq!(u.input_tokens, None);
        // A count that went down started again: all of it is this turn's.
        t.turn_started();
        t.update(&update(5, 0.1), true);
        assert_eq!(t.turn_ended(None).unwrap().cost_amount, Some(0.1));
        // Nothing reported: nothing to count.
        t.turn_started();
        assert!(t.turn_ended(None).is_none());
        // The cost reported between turns is the next turn's base.
        t.update(&update(0, 3.0), false);
        t.turn_started();
        t.update(&update(1, 3.5), true);
        assert_eq!(t.turn_ended(None).unwrap().cost_amount, Some(0.5));
    }
}
