//! Settling a turn that a restart left RUNNING: the at-most-once rule
//! (docs/decisions/0007-at-most-once-turns.md), as two pure decisions.
//!
//! The engine's update pump first reads everything agentctl buffered; if no
//! end of the turn came, it asks agentctl's Health and the stored messages
//! for the [`SettleFacts`] and acts on [`settle`]. When that says
//! [`Settle::Redeliver`], it sends the Prompt again with the same turn id,
//! *only if agentctl's journal never saw it*, and acts on [`redelivered`]
//! of the answer. A turn is delivered again only when agentctl's journal
//! proves the prompt never reached an agent; whenever it is not known, the
//! turn ends *interrupted* (what is stored of the reply is kept, a system
//! message says so, the user decides whether to send it again).

/// What agentctl says of its agent when a pending turn is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentNow {
    /// agentctl runs no agent (never launched, or it exited).
    NoAgent,
    /// The agent is working, or starting: its turn end may still come.
    Busy,
    /// The agent is idle.
    Idle,
}

/// What [`settle`] needs to know, read at the moment of settling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettleFacts {
    /// The agent in agentctl now.
    pub agent: AgentNow,
    /// agentctl (the same process the pump reads) has updates past the
    /// pump's cursor: the turn's end may be among them.
    pub unread_updates: bool,
    /// The turn's user message is stored.
    pub user_message_stored: bool,
    /// Any part of a reply to the turn is stored (text, a tool call, a
    /// plan, a thought, a permission request, a terminal), or the pump is
    /// streaming one: the prompt reached the agent.
    pub reply_stored: bool,
    /// agentctl keeps a turn journal.
    pub journaled: bool,
    /// agentctl's journal was created by this agentctl process (it did not
    /// find one from an earlier process).
    pub journal_fresh: bool,
    /// The agentctl process answering now is the one last known alive
    /// before the turn's Prompt.
    pub same_instance: bool,
    /// The turn was sent to the executor generation that runs now.
    pub same_generation: bool,
    /// The executor is on a remote host (its agentctl may restart on its
    /// own, with the same generation).
    pub remote: bool,
}

/// Why a turn ends interrupted rather than being delivered again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupted {
    /// A part of the reply is stored (or the user message is not), and the
    /// turn's end was lost.
    PartialReply,
    /// agentctl keeps no journal.
    NoJournal,
    /// agentctl was relaunched with a new journal.
    FreshJournal,
    /// The turn's end was lost with agentctl's dropped updates.
    EndDropped,
    /// An earlier agentctl process handed the prompt to the agent.
    HandedToAgent,
}

impl Interrupted {
    /// The reason, as the system message and the logs say it.
    pub fn why(self) -> &'static str {
        match self {
            Interrupted::PartialReply => "a partial reply was stored and its end was lost",
            Interrupted::NoJournal => {
                "agentctl keeps no turn journal, so it cannot tell whether the agent got the message"
            }
            Interrupted::FreshJournal => {
                "agentctl was relaunched with a new journal, so it cannot tell whether the agent got the message"
            }
            Interrupted::EndDropped => "its end was lost with agentctl's dropped updates",
            Interrupted::HandedToAgent => {
                "an earlier agentctl process handed it to the agent, which may have run it"
            }
        }
    }
}

/// What to do with a pending turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Nothing yet: the agent is busy, its turn end may still come.
    Wait,
    /// Read agentctl's newer updates first, then settle again.
    ReadOn,
    /// No agent runs: as the agent's exit (the session goes ERROR, the turn
    /// ends interrupted).
    AgentExited,
    /// End the turn interrupted.
    Interrupt(Interrupted),
    /// Prompt again with the same turn id, only if agentctl's journal never
    /// saw it; then [`redelivered`].
    Redeliver,
}

/// The decision for a pending turn.
pub fn settle(f: &SettleFacts) -> Settle {
    match f.agent {
        AgentNow::NoAgent => return Settle::AgentExited,
        AgentNow::Busy => return Settle::Wait,
        AgentNow::Idle => {}
    }
    if f.unread_updates {
        return Settle::ReadOn;
    }
    if !f.user_message_stored || f.reply_stored {
        return Settle::Interrupt(Interrupted::PartialReply);
    }
    if !f.journaled {
        return Settle::Interrupt(Interrupted::NoJournal);
    }
    // A fresh journal covers the turn only if the Prompt can have gone to
    // no other process: the same process answers, or (local executors) the
    // same generation, whose one agentctl created the journal.
    if f.journal_fresh && !f.same_instance && (!f.same_generation || f.remote) {
        return Settle::Interrupt(Interrupted::FreshJournal);
    }
    Settle::Redeliver
}

/// agentctl's answer to the conditional Prompt of [`Settle::Redeliver`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redelivery {
    /// The journal already had the turn (the Prompt was not sent again).
    pub already_accepted: bool,
    /// ... accepted by the agentctl process answering now.
    pub by_this_process: bool,
    /// ... and its turn ended there.
    pub turn_ended: bool,
    /// ... and the pump has read past the update that ended it.
    pub end_already_read: bool,
}

/// What a conditional Prompt's answer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redelivered {
    /// The journal never saw it: delivered now, exactly once.
    Delivered,
    /// This agentctl process has it: its end is ahead on the stream.
    WaitForEnd,
    /// End the turn interrupted.
    Interrupt(Interrupted),
}

/// The decision on a conditional Prompt's answer.
pub fn redelivered(r: &Redelivery) -> Redelivered {
    if !r.already_accepted {
        return Redelivered::Delivered;
    }
    if !r.by_this_process {
        return Redelivered::Interrupt(Interrupted::HandedToAgent);
    }
    if r.turn_ended && r.end_already_read {
        return Redelivered::Interrupt(Interrupted::EndDropped);
    }
    Redelivered::WaitForEnd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idle agent, nothing unread, no reply, journaled, not fresh, same
    /// process and generation, local: the turn is delivered again.
    fn base() -> SettleFacts {
        SettleFacts {
            agent: AgentNow::Idle,
            unread_updates: false,
            user_message_stored: true,
            reply_stored: false,
            journaled: true,
            journal_fresh: false,
            same_instance: true,
            same_generation: true,
            remote: false,
        }
    }

    #[test]
    fn settle_table() {
        use Interrupted::*;
        use Settle::*;
        let b = base();
        #[rustfmt::skip]
        let table: Vec<(&str, SettleFacts, Settle)> = vec![
            ("base: journal proves nothing reached an agent", b, Redeliver),
            ("no agent", SettleFacts { agent: AgentNow::NoAgent, ..b }, AgentExited),
            ("no agent wins over unread", SettleFacts { agent: AgentNow::NoAgent, unread_updates: true, ..b }, AgentExited),
            ("busy agent", SettleFacts { agent: AgentNow::Busy, ..b }, Wait),
            ("busy wins over a stored reply", SettleFacts { agent: AgentNow::Busy, reply_stored: true, ..b }, Wait),
            ("unread updates", SettleFacts { unread_updates: true, ..b }, ReadOn),
            ("unread wins over a stored reply", SettleFacts { unread_updates: true, reply_stored: true, ..b }, ReadOn),
            ("reply stored", SettleFacts { reply_stored: true, ..b }, Interrupt(PartialReply)),
            ("user message missing", SettleFacts { user_message_stored: false, ..b }, Interrupt(PartialReply)),
            ("no journal", SettleFacts { journaled: false, ..b }, Interrupt(NoJournal)),
            ("no journal, fresh flag ignored", SettleFacts { journaled: false, journal_fresh: true, same_instance: false, ..b }, Interrupt(NoJournal)),
            ("fresh, same process", SettleFacts { journal_fresh: true, ..b }, Redeliver),
            ("fresh, other process, same local generation", SettleFacts { journal_fresh: true, same_instance: false, ..b }, Redeliver),
            ("fresh, other process, new generation", SettleFacts { journal_fresh: true, same_instance: false, same_generation: false, ..b }, Interrupt(FreshJournal)),
            ("fresh, other process, remote", SettleFacts { journal_fresh: true, same_instance: false, remote: true, ..b }, Interrupt(FreshJournal)),
            ("fresh, same process, remote", SettleFacts { journal_fresh: true, remote: true, ..b }, Redeliver),
            ("not fresh, other process, new generation", SettleFacts { same_instance: false, same_generation: false, ..b }, Redeliver),
        ];
        for (name, facts, want) in table {
            assert_eq!(settle(&facts), want, "{name}: {facts:?}");
        }
    }

    #[test]
    fn redelivered_table() {
        use Redelivered::*;
        let r = |already_accepted, by_this_process, turn_ended, end_already_read| Redelivery {
            already_accepted,
            by_this_process,
            turn_ended,
            end_already_read,
        };
        #[rustfmt::skip]
        let table = [
            ("journal never saw it", r(false, false, false, false), Delivered),
            ("never saw it, other fields ignored", r(false, true, true, true), Delivered),
            ("this process has it, running", r(true, true, false, false), WaitForEnd),
            ("this process ended it, end not read yet", r(true, true, true, false), WaitForEnd),
            ("this process ended it, end already read past", r(true, true, true, true), Interrupt(Interrupted::EndDropped)),
            ("an earlier process handed it over", r(true, false, false, false), Interrupt(Interrupted::HandedToAgent)),
            ("an earlier process, ended", r(true, false, true, true), Interrupt(Interrupted::HandedToAgent)),
        ];
        for (name, answer, want) in table {
            assert_eq!(redelivered(&answer), want, "{name}: {answer:?}");
        }
    }

    #[test]
    fn every_reason_says_why() {
        for r in [
            Interrupted::PartialReply,
            Interrupted::NoJournal,
            Interrupted::FreshJournal,
            Interrupted::EndDropped,
            Interrupted::HandedToAgent,
        ] {
            assert!(r.why().len() > 20, "{r:?}");
        }
    }
}
