//! `Recover`: a recovering backend's one round trip (see the proto).
//!
//! Calls that ask for the agent run one at a time ([`Recoveries::begin`]
//! holds a lock for the whole call); one that asks only for health and
//! capabilities does not wait for them (a launch and resume take as long as
//! the agent does, and a backend restarted meanwhile must see a live
//! agentctl, not one it would take for hung). The agent part acts only on an absent agent (none
//! launched, or it exited). So two calls in a row, or the same call sent
//! twice by a backend that crashed after sending it, cannot start two
//! agents or reopen the conversation twice: the second finds the first's
//! agent running and leaves it alone, answering the first's result when it
//! asked the same (generation and token) of the same agent process.

use sessiond_proto::agentctl::v1 as pb;
use tokio::sync::{Mutex, MutexGuard};
use tonic::Status;

/// How the refusal of a call for another executor begins.
pub const WRONG_EXECUTOR: &str = "wrong_executor";

/// How the refusal of an older generation begins.
pub const STALE_GENERATION: &str = "stale_generation";

/// What earlier `Recover` calls of this process did.
#[derive(Debug, Default)]
pub struct Recoveries {
    memory: Mutex<Memory>,
    /// The newest generation a call carried.
    newest_generation: std::sync::Mutex<Option<i64>>,
}

/// Held for the length of one `Recover` call that asks for the agent.
#[derive(Debug, Default)]
pub struct Memory {
    last: Option<Remembered>,
}

/// The last agent part a `Recover` did.
#[derive(Debug, Clone)]
struct Remembered {
    generation: i64,
    token: String,
    agent_pid: u32,
    launched: pb::LaunchAgentResponse,
    resumed: pb::ResumeSessionResponse,
}

impl Recoveries {
    /// Waits for the calls before this one, then admits `generation`: one
    /// older than the newest a call carried is refused.
    pub async fn begin(&self, generation: i64) -> Result<MutexGuard<'_, Memory>, Status> {
        let memory = self.memory.lock().await;
        self.admit(generation)?;
        Ok(memory)
    }

    /// Admits `generation` for a call that asks nothing of the agent, at
    /// once, even while another call launches one.
    pub fn admit(&self, generation: i64) -> Result<(), Status> {
        let mut newest = self
            .newest_generation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *newest {
            Some(n) if generation < n => Err(Status::failed_precondition(format!(
                "{STALE_GENERATION}: this Recover carries executor generation {generation}, \
                 but agentctl has served generation {n}: the executor was relaunched since \
                 the caller read its record"
            ))),
            _ => {
                *newest = Some(generation);
                Ok(())
            }
        }
    }
}

impl Memory {
    /// The answer of an earlier call that asked `token` of `generation`, if
    /// the agent it launched (`agent_pid`) is the one running now.
    pub fn duplicate(
        &self,
        generation: i64,
        token: &str,
        agent_pid: u32,
    ) -> Option<pb::RecoverAgent> {
        let m = self.last.as_ref()?;
        (m.generation == generation && m.token == token && m.agent_pid == agent_pid).then(|| {
            pb::RecoverAgent {
                outcome: pb::RecoverOutcome::Duplicate as i32,
                launched: Some(m.launched.clone()),
                resumed: Some(m.resumed.clone()),
                ..Default::default()
            }
        })
    }

    /// Records what this call did, for a call that repeats it.
    pub fn remember(
        &mut self,
        generation: i64,
        token: String,
        launched: &pb::LaunchAgentResponse,
        resumed: &pb::ResumeSessionResponse,
    ) {
        self.last = Some(Remembered {
            generation,
            token,
            agent_pid: launched.agent_pid,
            launched: launched.clone(),
            resumed: resumed.clone(),
        });
    }
}

/// The agent part failed in `call` with `status`.
pub fn failed(
    call: &str,
    status: &Status,
    launched: Option<pb::LaunchAgentResponse>,
) -> pb::RecoverAgent {
    pb::RecoverAgent {
        outcome: pb::RecoverOutcome::Failed as i32,
        launched,
        resumed: None,
        failed_call: call.to_owned(),
        code: status.code() as i32,
        message: status.message().to_owned(),
    }
}

/// An agent part that did nothing, for `outcome`.
pub fn nothing(outcome: pb::RecoverOutcome) -> pb::RecoverAgent {
    pb::RecoverAgent {
        outcome: outcome as i32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_older_generation_is_refused_and_a_newer_one_raises_it() {
        let r = Recoveries::default();
        drop(r.begin(3).await.expect("first"));
        drop(r.begin(3).await.expect("same"));
        let err = r.begin(2).await.expect_err("older");
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().starts_with(STALE_GENERATION), "{err:?}");
        assert!(err.message().contains("generation 2") && err.message().contains("generation 3"));
        drop(r.begin(4).await.expect("newer"));
        assert!(r.begin(3).await.is_err(), "4 is the newest now");
    }

    #[tokio::test]
    async fn a_duplicate_is_the_same_generation_token_and_agent() {
        let r = Recoveries::default();
        let mut m = r.begin(1).await.expect("begin");
        let launched = pb::LaunchAgentResponse {
            agent_pid: 77,
            ..Default::default()
        };
        let resumed = pb::ResumeSessionResponse {
            resume_token: "tok".into(),
            ..Default::default()
        };
        assert!(
            m.duplicate(1, "tok", 77).is_none(),
            "nothing remembered yet"
        );
        m.remember(1, "tok".into(), &launched, &resumed);
        let dup = m.duplicate(1, "tok", 77).expect("duplicate");
        assert_eq!(dup.outcome(), pb::RecoverOutcome::Duplicate);
        assert_eq!(dup.resumed, Some(resumed));
        assert!(m.duplicate(2, "tok", 77).is_none(), "another generation");
        assert!(m.duplicate(1, "other", 77).is_none(), "another token");
        assert!(m.duplicate(1, "tok", 78).is_none(), "another agent process");
    }
}
