//! The agent's session modes and config options (ACP): read, set, and
//! kept per execution so a status call does not ask agentctl every time.

use sessiond_domain::{
    AgentModes, AgentProcessState, ExecutorRecord, ExecutorStatus, Session, SessionId,
    SessionState, TaskId,
};
use sessiond_executor::Failure;

use crate::{
    error::{Error, Result},
    flows::RecoverFirst,
    manager::SessionManager,
    ops::Agents,
    ops::agent_modes,
    turn::Turns,
};

impl SessionManager {
    /// The session modes the session's agent offers (ACP session modes),
    /// read live from agentctl; `None` when the agent runs without modes,
    /// does not run, or does not answer.
    pub async fn session_modes(
        &self,
        task: TaskId,
        session_id: SessionId,
    ) -> Result<Option<AgentModes>> {
        self.check_task(task, session_id).await?;
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Ok(None);
        };
        let execution_id = execution.record.execution_id();
        let (cached, stamp) = self.inner.sessions.cached_modes(session_id, &execution_id);
        if let Some(modes) = cached {
            return Ok(modes);
        }
        let Ok(client) = Agents(self).client(&execution.record) else {
            return Ok(None);
        };
        // Not kept when the agent did not answer: the next call asks again.
        let Ok(health) = client.health().await else {
            return Ok(None);
        };
        let modes = health.modes.map(|m| agent_modes(&m));
        self.inner
            .sessions
            .remember_modes(session_id, execution_id, stamp, modes.clone());
        Ok(modes)
    }

    /// Switches the session's agent to session mode `mode_id` (ACP
    /// `session/set_mode`); returns the modes with it current. The agent
    /// must run (WAITING_FOR_INPUT or RUNNING: ACP allows a switch during
    /// a turn). INVALID_ARGUMENT names the modes when `mode_id` is not one.
    pub async fn set_session_mode(
        &self,
        task: TaskId,
        session_id: SessionId,
        mode_id: &str,
    ) -> Result<AgentModes> {
        let mode_id = mode_id.to_owned();
        self.to_completion(move |m| async move {
            m.set_session_mode_inner(task, session_id, &mode_id).await
        })
        .await
    }

    async fn set_session_mode_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        mode_id: &str,
    ) -> Result<AgentModes> {
        if mode_id.trim().is_empty() {
            return Err(Error::InvalidArgument("mode_id: must not be empty".into()));
        }
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let session = self.inner.store.get_session(session_id).await?;
        match session.state {
            SessionState::WaitingForInput | SessionState::Running => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            SessionState::Error => {
                return Err(Turns(self).agent_not_running(&session).await);
            }
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action: "set the session mode",
                    hint: "wait until the agent is ready",
                });
            }
        }
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(Turns(self).agent_not_running(&session).await);
        };
        let client = Agents(self).client(&execution.record)?;
        self.inner.sessions.forget_modes(session_id);
        let (_, stamp) = self.inner.sessions.cached_modes(session_id, "");
        let modes = client
            .set_mode(mode_id)
            .await
            .map_err(|e| Error::agent("SetMode", &e))?
            .unwrap_or_default();
        tracing::info!(session = %session_id, mode_id, "session mode set");
        let modes = agent_modes(&modes);
        self.inner.sessions.remember_modes(
            session_id,
            execution.record.execution_id(),
            stamp,
            Some(modes.clone()),
        );
        self.read_session_updates(&session, &execution.record);
        Ok(modes)
    }

    /// Sets config option `config_id` of the session's agent to `value`
    /// (ACP `session/set_config_option`); returns the modes and options as
    /// the agent answered. The agent must run, as for a mode. An option or
    /// a value the agent does not offer is INVALID_ARGUMENT naming what it
    /// offers.
    pub async fn set_session_config_option(
        &self,
        task: TaskId,
        session_id: SessionId,
        config_id: &str,
        value: &str,
    ) -> Result<AgentModes> {
        let config_id = config_id.to_owned();
        let value = value.to_owned();
        self.to_completion(move |m| async move {
            m.set_session_config_option_inner(task, session_id, &config_id, &value)
                .await
        })
        .await
    }

    async fn set_session_config_option_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        config_id: &str,
        value: &str,
    ) -> Result<AgentModes> {
        if config_id.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "config_id: must not be empty".into(),
            ));
        }
        self.session_of_task(task, session_id).await?;
        self.ensure_recovered(session_id).await?;
        let session = self.inner.store.get_session(session_id).await?;
        match session.state {
            SessionState::WaitingForInput | SessionState::Running => {}
            s if s.is_terminal() => {
                return Err(Error::SessionEnded {
                    session_id,
                    state: s,
                });
            }
            SessionState::Error => {
                return Err(Turns(self).agent_not_running(&session).await);
            }
            s => {
                return Err(Error::InvalidState {
                    session_id,
                    state: s,
                    action: "set a config option",
                    hint: "wait until the agent is ready",
                });
            }
        }
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(Turns(self).agent_not_running(&session).await);
        };
        // Checked here first, so the answer names what the agent offers
        // without a round trip to it.
        if let Some(modes) = self.session_modes(task, session_id).await? {
            check_config_value(&modes, config_id, value)?;
        }
        let client = Agents(self).client(&execution.record)?;
        self.inner.sessions.forget_modes(session_id);
        let (_, stamp) = self.inner.sessions.cached_modes(session_id, "");
        let modes = client
            .set_config_option(config_id, value)
            .await
            .map_err(|e| match e.failure() {
                Failure::InvalidArgument => Error::InvalidArgument(e.answer()),
                _ => Error::agent("SetConfigOption", &e),
            })?
            .unwrap_or_default();
        tracing::info!(session = %session_id, config_id, value, "config option set");
        let modes = agent_modes(&modes);
        self.inner.sessions.remember_modes(
            session_id,
            execution.record.execution_id(),
            stamp,
            Some(modes.clone()),
        );
        self.read_session_updates(&session, &execution.record);
        Ok(modes)
    }

    /// agentctl puts a mode or options set through it on the session's
    /// update stream, so every watcher sees them (other tabs, other
    /// clients: helper-49 1); an idle session's parked pump reads it now
    /// rather than at the next turn.
    fn read_session_updates(&self, session: &Session, record: &ExecutorRecord) {
        if !self.inner.sessions.has_pump(session.id) {
            Turns(self).start_pump(session, record);
        }
    }
}

/// INVALID_ARGUMENT unless the agent offers option `config_id` with
/// `value`, naming what it offers.
pub(crate) fn check_config_value(modes: &AgentModes, config_id: &str, value: &str) -> Result<()> {
    let Some(o) = modes.config_options.iter().find(|o| o.id == config_id) else {
        let ids: Vec<&str> = modes.config_options.iter().map(|o| o.id.as_str()).collect();
        return Err(Error::InvalidArgument(format!(
            "config_id: the agent has no config option {config_id:?}; its options are {}",
            if ids.is_empty() {
                "none".to_owned()
            } else {
                ids.join(", ")
            }
        )));
    };
    let offered = o.offered();
    if offered.contains(&value) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "value: the agent does not offer {value:?} for config option {config_id}; it offers {}",
            offered.join(", ")
        )))
    }
}
