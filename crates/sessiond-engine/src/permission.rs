//! Permission requests of profile policy `ask`.
//!
//! agentctl puts each request on the update stream as an activity part of
//! kind `permission` (rev 1 pending; rev 2 complete: `selected`,
//! `timed_out` or `cancelled`). The pump stores it as one message (kind
//! `Permission`, incomplete while it waits) and announces it with
//! `session.permission.requested` / `session.permission.resolved`, in the
//! same transaction. So the store is the list of pending requests (a
//! restarted backend shows them again while agentctl still waits), and a
//! replay after a restart writes nothing twice.
//!
//! A request can only be answered while its agentctl waits; when the turn
//! ends without agentctl resolving it (the agent or agentctl died, the
//! session was stopped), [`cancel_open`] resolves it `cancelled` here.

use chrono::Utc;
use serde_json::Value;
use sessiond_domain::{
    AgentProcessState, EventPayload, ExecutorStatus, Message, MessageId, MessageKind, SessionId,
    TaskId,
};
use sessiond_executor::Failure;
use sessiond_proto::agentctl::v1 as pb;
use sessiond_store::Changeset;

use crate::{
    error::{Error, Result},
    flows::RecoverFirst,
    manager::SessionManager,
    ops::Agents,
};

/// The request's state inside a stored part (`{"rev", "update": {...}}`).
fn request_of(data: &str) -> Value {
    serde_json::from_str::<Value>(data)
        .ok()
        .and_then(|v| v.get("update").cloned())
        .unwrap_or(Value::Null)
}

/// The status of a stored request (`pending` when it says none).
pub(crate) fn status_of(data: &str) -> String {
    request_of(data)
        .get("status")
        .and_then(Value::as_str)
        .unwrap_or("pending")
        .to_owned()
}

/// The event a permission part's new state announces: requested (a part
/// seen pending for the first time) or resolved.
pub(crate) fn event_for(m: &Message, first: bool) -> Option<EventPayload> {
    let req = request_of(&m.data);
    let status = req
        .get("status")
        .and_then(Value::as_str)
        .unwrap_or("pending");
    let text = |k: &str| {
        req.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    match status {
        "pending" if first => Some(EventPayload::PermissionRequested(m.clone())),
        "pending" => None,
        outcome => Some(EventPayload::PermissionResolved {
            request_id: m.id.to_string(),
            outcome: outcome.to_owned(),
            option_id: text("optionId"),
            reason: text("reason"),
        }),
    }
}

/// Adds to `change` what resolves every permission request of `session`
/// still open in the store as `cancelled` (`reason` says why): the part
/// completed (rev + 1, so agentctl's own later `cancelled` rev is not
/// written again) and `session.permission.resolved`.
pub(crate) async fn cancel_open(
    mgr: &SessionManager,
    session: SessionId,
    mut change: Changeset,
    reason: &str,
) -> Result<Changeset> {
    let open = mgr
        .inner
        .store
        .open_parts(session, MessageKind::Permission)
        .await?;
    let now = Utc::now();
    for m in open {
        let env: Value = serde_json::from_str(&m.data).unwrap_or(Value::Null);
        let rev = env.get("rev").and_then(Value::as_u64).unwrap_or(1);
        let mut req = env
            .get("update")
            .cloned()
            .unwrap_or_else(|| Value::Object(Default::default()));
        if let Some(o) = req.as_object_mut() {
            o.insert("status".into(), "cancelled".into());
            o.insert("reason".into(), reason.into());
        }
        let mut done = m.clone();
        done.data = crate::turn::part_data(rev + 1, &req.to_string());
        done.complete = true;
        done.updated_at = now;
        change = change
            .update_part(m.id, m.content.clone(), done.data.clone(), true)
            .event(session, EventPayload::MessageUpdated(done.clone()))
            .event(
                session,
                EventPayload::PermissionResolved {
                    request_id: m.id.to_string(),
                    outcome: "cancelled".into(),
                    option_id: None,
                    reason: Some(reason.to_owned()),
                },
            );
    }
    Ok(change)
}

impl SessionManager {
    /// The permission requests the session's agent waits on, oldest first.
    /// Only a RUNNING session can have any (a turn's end resolves them):
    /// callers that know the state (GetSessionStatus) skip the store read
    /// for the others.
    pub async fn pending_permissions(&self, session_id: SessionId) -> Result<Vec<Message>> {
        Ok(self
            .inner
            .store
            .open_parts(session_id, MessageKind::Permission)
            .await?)
    }

    /// Answers permission request `request_id` of the session with
    /// `option_id`. agentctl gives the agent the answer; the resolution is
    /// stored from the update stream (`session.permission.resolved`,
    /// outcome `selected`). Returns the request as stored now.
    pub async fn respond_to_permission(
        &self,
        task: TaskId,
        session_id: SessionId,
        request_id: &str,
        option_id: &str,
    ) -> Result<Message> {
        self.respond_with_values(task, session_id, request_id, option_id, "")
            .await
    }

    /// [`Self::respond_to_permission`] with the values of a form: an
    /// elicitation (the agent's question to the user) answered `accept`
    /// carries them as a JSON object (agentctl checks them against the
    /// form's required properties).
    pub async fn respond_with_values(
        &self,
        task: TaskId,
        session_id: SessionId,
        request_id: &str,
        option_id: &str,
        content_json: &str,
    ) -> Result<Message> {
        let request_id = request_id.to_owned();
        let option_id = option_id.to_owned();
        let content_json = content_json.to_owned();
        self.to_completion(move |m| async move {
            m.respond_with_values_inner(task, session_id, &request_id, &option_id, &content_json)
                .await
        })
        .await
    }

    async fn respond_with_values_inner(
        &self,
        task: TaskId,
        session_id: SessionId,
        request_id: &str,
        option_id: &str,
        content_json: &str,
    ) -> Result<Message> {
        self.session_of_task(task, session_id).await?;
        let not_found = || Error::PermissionNotFound {
            session_id,
            request_id: request_id.to_owned(),
        };
        let id = MessageId::parse(request_id).map_err(|_| {
            Error::InvalidArgument(format!(
                "request_id {request_id:?} is not a permission request id (a UUID from session.permission.requested)"
            ))
        })?;
        if option_id.is_empty() {
            return Err(Error::InvalidArgument(
                "option_id is empty: name one of the request's options".into(),
            ));
        }
        self.ensure_recovered(session_id).await?;
        let m = self
            .inner
            .store
            .get_message(session_id, id)
            .await?
            .filter(|m| m.kind == MessageKind::Permission)
            .ok_or_else(not_found)?;
        if m.complete {
            return Err(Error::PermissionResolved {
                request_id: request_id.to_owned(),
                detail: resolved_detail(&m),
            });
        }
        let req = request_of(&m.data);
        let options: Vec<(String, String)> = req
            .get("options")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|o| {
                let id = o.get("optionId")?.as_str()?.to_owned();
                let kind = o.get("kind").and_then(Value::as_str).unwrap_or_default();
                Some((id, kind.to_owned()))
            })
            .collect();
        let option_id = choose_option(&options, option_id).ok_or_else(|| {
            let offered: Vec<String> = options
                .iter()
                .map(|(id, kind)| format!("{id} ({kind})"))
                .collect();
            Error::InvalidArgument(format!(
                "option_id {option_id:?} is not offered by permission request {request_id}: \
                 answer with one of its option ids, or with the kind of one (allow, \
                 allow-always, reject or reject-always, as the agent offers them); it offers: {}",
                offered.join(", ")
            ))
        })?;
        let option_id = option_id.as_str();
        let Some(execution) = self.execution(session_id).filter(|e| {
            e.record.status == ExecutorStatus::Ready && e.agent == AgentProcessState::Running
        }) else {
            return Err(Error::AgentNotRunning {
                session_id,
                hint: "its permission requests are cancelled when the agent is found gone".into(),
            });
        };
        let client = Agents(self).client(&execution.record)?;
        let answered = client
            .respond_permission(pb::RespondPermissionRequest {
                request_id: request_id.to_owned(),
                option_id: option_id.to_owned(),
                content_json: content_json.to_owned(),
            })
            .await;
        match answered {
            Ok(_) => {
                tracing::info!(session = %session_id, request_id, option_id, "permission request answered");
                Ok(m)
            }
            // agentctl no longer waits: timed out or cancelled a moment
            // ago (its resolution is on its way through the update
            // stream), or it is another agentctl process now.
            Err(e) if e.failure() == Failure::NotFound => Err(Error::PermissionResolved {
                request_id: request_id.to_owned(),
                detail: format!(
                    "the agent no longer waits for it ({}); watch for session.permission.resolved",
                    e.answer()
                ),
            }),
            Err(e) if e.failure() == Failure::InvalidArgument => {
                // agentctl's message names its code already; ours adds it.
                let answer = e.answer();
                let answer = answer.strip_prefix("invalid argument: ").unwrap_or(&answer);
                Err(Error::InvalidArgument(answer.to_owned()))
            }
            Err(e) => Err(Error::agent("RespondPermission", &e)),
        }
    }
}

/// What became of a resolved request, for the error message.
fn resolved_detail(m: &Message) -> String {
    let req = request_of(&m.data);
    let option = req
        .get("optionId")
        .and_then(Value::as_str)
        .map(|o| format!(" with option {o:?}"))
        .unwrap_or_default();
    match status_of(&m.data).as_str() {
        "selected" => format!("it was answered already{option}"),
        "timed_out" => format!("it timed out{option}"),
        "cancelled" => format!(
            "it was cancelled ({})",
            req.get("reason")
                .and_then(Value::as_str)
                .unwrap_or("the turn ended")
        ),
        other => format!("it is {other}"),
    }
}

/// The offered option an answer names: its id (exactly), or a kind —
/// `allow` (allow once), `allow-always`, `reject` (reject once, else reject
/// always: refusing more than asked is safe, allowing more is not),
/// `reject-always`; `_` for `-` and ACP's own kind names (`allow_once`)
/// too. `options` are (id, ACP kind) pairs.
pub(crate) fn choose_option(options: &[(String, String)], answer: &str) -> Option<String> {
    if let Some((id, _)) = options.iter().find(|(id, _)| id == answer) {
        return Some(id.clone());
    }
    let kinds: &[&str] = match answer.to_ascii_lowercase().replace('-', "_").as_str() {
        "allow" | "allow_once" => &["allow_once"],
        "allow_always" => &["allow_always"],
        "reject" => &["reject_once", "reject_always"],
        "reject_once" => &["reject_once"],
        "reject_always" => &["reject_always"],
        _ => return None,
    };
    kinds.iter().find_map(|k| {
        options
            .iter()
            .find(|(_, kind)| kind == k)
            .map(|(id, _)| id.clone())
    })
}

#[cfg(test)]
mod kind_tests {
    use super::choose_option;

    fn offered(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn answers_by_id_or_by_kind() {
        // Codex's ids name no kind.
        let codex = offered(&[
            ("approved", "allow_once"),
            ("approved-for-session", "allow_always"),
            ("abort", "reject_once"),
        ]);
        let pick = |a: &str| choose_option(&codex, a);
        assert_eq!(pick("approved").as_deref(), Some("approved"));
        assert_eq!(pick("allow").as_deref(), Some("approved"));
        assert_eq!(
            pick("allow-always").as_deref(),
            Some("approved-for-session")
        );
        assert_eq!(
            pick("ALLOW_ALWAYS").as_deref(),
            Some("approved-for-session")
        );
        assert_eq!(pick("reject").as_deref(), Some("abort"));
        assert_eq!(pick("reject-always"), None, "not offered");
        assert_eq!(pick("yes"), None);
        // An id that is also a kind word is the id.
        let odd = offered(&[("reject", "allow_once"), ("no", "reject_once")]);
        assert_eq!(choose_option(&odd, "reject").as_deref(), Some("reject"));
        // Allowing never widens: no allow_once offered, `allow` is refused.
        let always = offered(&[("a", "allow_always"), ("r", "reject_always")]);
        assert_eq!(choose_option(&always, "allow"), None);
        assert_eq!(choose_option(&always, "reject").as_deref(), Some("r"));
    }
}
