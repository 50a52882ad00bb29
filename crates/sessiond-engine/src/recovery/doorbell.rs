//! The doorbell: how an agent's exit reaches the backend when no update
//! stream is open to carry it. An idle session's pump is parked (it holds no
//! stream and no connection, so thousands of idle sessions cost nothing),
//! and without this its agent's death would wait for the next liveness
//! check. Local agentctls send one datagram holding their executor id to a
//! socket in the run directory when their agent exits; the engine answers
//! with an immediate liveness check of that executor, whose `Health` (an
//! authenticated call, identity checked) is what decides. A forged or stale
//! datagram therefore costs one `Health` call and changes nothing.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use sessiond_domain::{AgentProcessState, ExecutorId};

use crate::recovery::liveness::Liveness;
use crate::sync::lock;

/// The largest datagram read: an executor id is a UUID.
const MAX_DATAGRAM: usize = 128;

/// The doorbell's listener.
pub(crate) struct Doorbell<'m>(pub(crate) &'m crate::manager::SessionManager);

impl std::ops::Deref for Doorbell<'_> {
    type Target = crate::manager::SessionManager;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl Doorbell<'_> {
    /// Listens on the datagram socket `path` (replacing a stale one, mode
    /// 0600) and checks an executor at once each time its agentctl rings.
    /// Runs until the manager shuts down.
    pub(crate) fn listen_doorbell(&self, path: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let socket = tokio::net::UnixDatagram::bind(path)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        }
        let me = self.0.clone();
        // One check per executor at a time: a burst of rings is one check.
        let checking: Arc<Mutex<HashSet<ExecutorId>>> = Arc::default();
        self.spawn_background(async move {
            let mut buf = [0u8; MAX_DATAGRAM];
            loop {
                let n = match socket.recv(&mut buf).await {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(error = %e, "doorbell socket failed; idle agents' exits wait for the liveness check");
                        return;
                    }
                };
                let Some(id) = std::str::from_utf8(&buf[..n])
                    .ok()
                    .and_then(|s| ExecutorId::parse(s.trim()).ok())
                else {
                    continue;
                };
                let found = me
                    .inner
                    .sessions
                    .executions(|e| {
                        (e.record.id == id)
                            .then(|| (e.record.clone(), e.agent == AgentProcessState::Running))
                    })
                    .pop();
                let Some((record, agent_running)) = found else {
                    continue;
                };
                if !lock(&checking).insert(id) {
                    continue;
                }
                let (me, checking) = (me.clone(), checking.clone());
                tokio::spawn(async move {
                    tracing::debug!(executor = %id, "doorbell: agentctl says its agent exited");
                    if let Err(e) = Liveness(&me).check_liveness(record, agent_running).await {
                        tracing::debug!(executor = %id, error = %e, "doorbell check could not be recorded");
                    }
                    lock(&checking).remove(&id);
                });
            }
        });
        Ok(())
    }
}
