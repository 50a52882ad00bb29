//! Upper bounds of every string field of the public API, checked before a
//! request is used, stored, forwarded to another replica or passed on to
//! agentctl: an oversized field is INVALID_ARGUMENT naming the field and
//! the limit, never a failure further down (agentctl, the database, the
//! kernel). Each request type lists its string fields once here
//! ([`Bounded`]); a unit test walks the compiled descriptors so a string
//! field added to a request without a bound fails the build's tests.

use sessiond_proto::sessiond::v1 as pb;

use crate::error::{ApiError, ApiResult};

/// Ids (UUIDs, page tokens): far above 36 bytes, far below anything costly.
pub(crate) const MAX_ID_BYTES: usize = 128;
/// Names and ids an agent or operator chooses (profile and runtime names,
/// ACP mode, permission request and option ids, worktree id and branch).
pub(crate) const MAX_NAME_BYTES: usize = 1024;
/// A task's title (1,000 characters of up to 4 bytes).
pub(crate) const MAX_TITLE_BYTES: usize = 4 * crate::api::MAX_TITLE_CHARS;
/// Paths and commands: Linux's PATH_MAX.
pub(crate) const MAX_PATH_BYTES: usize = 4096;
/// One Exec argument: Linux's MAX_ARG_STRLEN, less its NUL.
pub(crate) const MAX_ARG_BYTES: usize = 128 * 1024 - 1;
/// A remote agentctl's URL and secret.
pub(crate) const MAX_REMOTE_BYTES: usize = 2048;

/// A request whose string fields are all bounded.
pub(crate) trait Bounded {
    /// INVALID_ARGUMENT naming the first field over its limit;
    /// `max_message_bytes` is the configured bound of a message's content.
    fn check_bounds(&self, max_message_bytes: usize) -> ApiResult<()>;
}

/// `field` at most `max` bytes; `key` names the setting behind `max`.
fn check(field: &str, value: &str, max: usize, key: Option<&str>) -> ApiResult<()> {
    if value.len() <= max {
        return Ok(());
    }
    let key = key.map_or(String::new(), |k| format!(" ({k})"));
    Err(ApiError::invalid(format!(
        "{field}: {} bytes is longer than {max} bytes{key}",
        value.len()
    )))
}

/// The fields of the messages requests nest.
fn session_ref(r: Option<&pb::SessionRef>) -> ApiResult<()> {
    if let Some(r) = r {
        check("session.task_id", &r.task_id, MAX_ID_BYTES, None)?;
        check("session.session_id", &r.session_id, MAX_ID_BYTES, None)?;
    }
    Ok(())
}

fn worktree(w: Option<&pb::Worktree>) -> ApiResult<()> {
    if let Some(w) = w {
        check("worktree.id", &w.id, MAX_NAME_BYTES, None)?;
        check("worktree.path", &w.path, MAX_PATH_BYTES, None)?;
        check("worktree.branch", &w.branch, MAX_NAME_BYTES, None)?;
        check("worktree.repository", &w.repository, MAX_PATH_BYTES, None)?;
        check("worktree.base", &w.base, MAX_NAME_BYTES, None)?;
    }
    Ok(())
}

/// `bounded! { max_message_bytes => Request { field: max, ... }; ... }`; a field may
/// name its setting (`; "key"`), `each` bounds every element of a repeated
/// field, and `nested { field => checker }` checks a nested message's fields.
fn mcp_servers(list: &[pb::McpServerSpec]) -> ApiResult<()> {
    use pb::secret_ref::Source;
    for (i, m) in list.iter().enumerate() {
        let f = |name: &str| format!("mcp_servers[{i}].{name}");
        check(&f("name"), &m.name, MAX_NAME_BYTES, None)?;
        check(&f("type"), &m.r#type, MAX_NAME_BYTES, None)?;
        check(&f("command"), &m.command, MAX_PATH_BYTES, None)?;
        check(&f("url"), &m.url, MAX_REMOTE_BYTES, None)?;
        for a in &m.args {
            check(&f("args"), a, MAX_ARG_BYTES, None)?;
        }
        for (field, map) in [("env", &m.env), ("headers", &m.headers)] {
            for (k, v) in map {
                check(&f(field), k, MAX_NAME_BYTES, None)?;
                match &v.source {
                    Some(Source::Value(x)) => {
                        check(&format!("{}.value", f(field)), x, MAX_ARG_BYTES, None)?
                    }
                    Some(Source::Env(x)) => {
                        check(&format!("{}.env", f(field)), x, MAX_NAME_BYTES, None)?
                    }
                    Some(Source::File(x)) => {
                        check(&format!("{}.file", f(field)), x, MAX_PATH_BYTES, None)?
                    }
                    None => {}
                }
            }
        }
    }
    Ok(())
}

fn watch_targets(list: &[pb::WatchTarget]) -> ApiResult<()> {
    for (i, t) in list.iter().enumerate() {
        check(
            &format!("targets[{i}].session_id"),
            &t.session_id,
            MAX_ID_BYTES,
            None,
        )?;
        check(
            &format!("targets[{i}].task_id"),
            &t.task_id,
            MAX_ID_BYTES,
            None,
        )?;
    }
    Ok(())
}

fn attachments(list: &[pb::Attachment]) -> ApiResult<()> {
    use pb::attachment::Kind;
    for (i, a) in list.iter().enumerate() {
        let f = |name: &str| format!("attachments[{i}].{name}");
        match &a.kind {
            Some(Kind::Image(img)) => {
                check(&f("mime_type"), &img.mime_type, MAX_NAME_BYTES, None)?;
                check(&f("path"), &img.path, MAX_PATH_BYTES, None)?;
            }
            Some(Kind::Link(l)) => {
                check(&f("uri"), &l.uri, MAX_PATH_BYTES, None)?;
                check(&f("name"), &l.name, MAX_NAME_BYTES, None)?;
                check(&f("mime_type"), &l.mime_type, MAX_NAME_BYTES, None)?;
            }
            Some(Kind::File(file)) => check(&f("path"), &file.path, MAX_PATH_BYTES, None)?,
            None => {}
        }
    }
    Ok(())
}

macro_rules! bounded {
    ($s:ident => $(
        $ty:ident {
            $($field:ident: $max:expr $(; $key:literal)?),* $(,)?
        } $(each { $($rep:ident: $rmax:expr),* })? $(nested { $($nest:ident => $checker:ident),* })?;
    )*) => {
        $(
            impl Bounded for pb::$ty {
                #[allow(unused_variables)]
                fn check_bounds(&self, $s: usize) -> ApiResult<()> {
                    $( check(stringify!($field), &self.$field, $max, None $(.or(Some($key)))?)?; )*
                    $($(
                        for (i, v) in self.$rep.iter().enumerate() {
                            check(&format!("{}[{i}]", stringify!($rep)), v, $rmax, None)?;
                        }
                    )*)?
                    $($( $checker(self.$nest.as_ref())?; )*)?
                    Ok(())
                }
            }
        )*
    };
}

bounded! { max_message_bytes =>
    CreateTaskRequest { title: MAX_TITLE_BYTES };
    GetTaskRequest { task_id: MAX_ID_BYTES };
    ListTasksRequest { page_token: MAX_ID_BYTES };
    ListAgentProfilesRequest {};
    ListRuntimesRequest {};
    ListRepositoriesRequest {};
    ListRepositoryBranchesRequest {
        repository: MAX_PATH_BYTES,
        remote_url: MAX_REMOTE_BYTES,
        remote_secret: MAX_REMOTE_BYTES,
        remote_executor_id: MAX_ID_BYTES,
    };
    ListReplicasRequest {};
    CreateSessionRequest {
        task_id: MAX_ID_BYTES,
        agent_profile: MAX_NAME_BYTES,
        remote_url: MAX_REMOTE_BYTES,
        remote_secret: MAX_REMOTE_BYTES,
        remote_executor_id: MAX_ID_BYTES,
        runtime_name: MAX_NAME_BYTES,
    } nested { worktree => worktree, mcp_servers => mcp_servers };
    GetSessionRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    ListSessionsRequest { task_id: MAX_ID_BYTES };
    GetSessionStatusRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    SetSessionModeRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        mode_id: MAX_NAME_BYTES,
    };
    SetSessionConfigOptionRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        config_id: MAX_NAME_BYTES,
        value: MAX_NAME_BYTES,
    };
    RespondToPermissionRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        request_id: MAX_NAME_BYTES,
        option_id: MAX_NAME_BYTES,
        content_json: max_message_bytes; "max_message_bytes",
    };
    ResumeSessionRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    SetSessionTitleRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        title: MAX_TITLE_BYTES,
    };
    SendMessageRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        content: max_message_bytes; "max_message_bytes",
        request_id: MAX_ID_BYTES,
    } nested { attachments => attachments };
    RetryTurnRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        message_id: MAX_ID_BYTES,
    };
    CancelTurnRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    CancelQueuedMessageRequest {
        task_id: MAX_ID_BYTES,
        session_id: MAX_ID_BYTES,
        message_id: MAX_ID_BYTES,
    };
    ListMessagesRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    StopSessionRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    DeleteSessionRequest { task_id: MAX_ID_BYTES, session_id: MAX_ID_BYTES };
    WatchSessionRequest { session_id: MAX_ID_BYTES };
    WatchTaskRequest { task_id: MAX_ID_BYTES };
    WatchManyRequest {} nested { targets => watch_targets };
    ExecRequest { command: MAX_PATH_BYTES, cwd: MAX_PATH_BYTES }
        each { args: MAX_ARG_BYTES } nested { session => session_ref };
    ReadFileRequest { path: MAX_PATH_BYTES } nested { session => session_ref };
    WriteFileRequest { path: MAX_PATH_BYTES } nested { session => session_ref };
    ListDirRequest { path: MAX_PATH_BYTES } nested { session => session_ref };
    ListBranchCommitsRequest {} nested { session => session_ref };
    GitStatusRequest {} nested { session => session_ref };
    GitDiffRequest {} nested { session => session_ref };
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    /// Decodes a request of the named type and checks its bounds.
    type Checker = fn(&[u8]) -> ApiResult<()>;

    macro_rules! checkers {
        ($($ty:ident),* $(,)?) => {
            &[$((
                concat!(".sessiond.v1.", stringify!($ty)),
                |b: &[u8]| pb::$ty::decode(b).map_err(|e| ApiError::invalid(e.to_string()))?.check_bounds(1000),
            )),*]
        };
    }

    const CHECKERS: &[(&str, Checker)] = checkers![
        CreateTaskRequest,
        GetTaskRequest,
        ListTasksRequest,
        ListAgentProfilesRequest,
        ListRuntimesRequest,
        ListRepositoriesRequest,
        ListRepositoryBranchesRequest,
        ListReplicasRequest,
        CreateSessionRequest,
        GetSessionRequest,
        ListSessionsRequest,
        GetSessionStatusRequest,
        SetSessionModeRequest,
        SetSessionConfigOptionRequest,
        RespondToPermissionRequest,
        ResumeSessionRequest,
        SetSessionTitleRequest,
        SendMessageRequest,
        RetryTurnRequest,
        CancelTurnRequest,
        CancelQueuedMessageRequest,
        ListMessagesRequest,
        StopSessionRequest,
        DeleteSessionRequest,
        WatchSessionRequest,
        WatchTaskRequest,
        WatchManyRequest,
        ExecRequest,
        ReadFileRequest,
        WriteFileRequest,
        ListDirRequest,
        GitStatusRequest,
        GitDiffRequest,
        ListBranchCommitsRequest,
    ];

    /// Every string field of every request of the public services, and of
    /// the messages they nest, refuses 1 MiB naming itself and its limit:
    /// a string field added to the protos without a bound here fails.
    #[test]
    fn every_string_field_of_every_request_is_bounded() {
        use prost_types::field_descriptor_proto::Type;
        let set = prost_types::FileDescriptorSet::decode(sessiond_proto::FILE_DESCRIPTOR_SET)
            .expect("the compiled descriptor set");
        let messages: std::collections::HashMap<String, &prost_types::DescriptorProto> = set
            .file
            .iter()
            .flat_map(|f| {
                f.message_type
                    .iter()
                    .map(move |m| (format!(".{}.{}", f.package(), m.name()), m))
            })
            .collect();
        let huge = "x".repeat((1 << 20) + 1);
        let mut checked = 0;
        for file in &set.file {
            for service in file.service.iter().filter(|s| {
                file.package() == "sessiond.v1"
                    && matches!(s.name(), "SessionService" | "WorkspaceService")
            }) {
                for method in &service.method {
                    let input = method.input_type();
                    let check = CHECKERS
                        .iter()
                        .find(|(name, _)| *name == input)
                        .unwrap_or_else(|| panic!("no bounds for {input}: add it to bounds.rs"))
                        .1;
                    let request = messages[input];
                    // (field path, its encoding in the request)
                    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
                    for field in &request.field {
                        let tag = u32::try_from(field.number()).expect("a field number");
                        match field.r#type() {
                            Type::String => {
                                let mut buf = Vec::new();
                                prost::encoding::string::encode(tag, &huge, &mut buf);
                                let repeated = field.label()
                                    == prost_types::field_descriptor_proto::Label::Repeated;
                                let name = if repeated {
                                    format!("{}[0]", field.name())
                                } else {
                                    field.name().to_owned()
                                };
                                cases.push((name, buf));
                            }
                            Type::Message => {
                                let nested = messages[field.type_name()];
                                for inner in &nested.field {
                                    if inner.r#type() != Type::String {
                                        continue;
                                    }
                                    let mut body = Vec::new();
                                    let inner_tag =
                                        u32::try_from(inner.number()).expect("a field number");
                                    prost::encoding::string::encode(inner_tag, &huge, &mut body);
                                    let mut buf = Vec::new();
                                    prost::encoding::bytes::encode(tag, &body, &mut buf);
                                    let repeated = field.label()
                                        == prost_types::field_descriptor_proto::Label::Repeated;
                                    let outer = if repeated {
                                        format!("{}[0]", field.name())
                                    } else {
                                        field.name().to_owned()
                                    };
                                    cases.push((format!("{outer}.{}", inner.name()), buf));
                                }
                            }
                            _ => {}
                        }
                    }
                    for (path, buf) in cases {
                        match check(&buf) {
                            Err(ApiError::InvalidArgument(m)) => {
                                assert!(
                                    m.starts_with(&format!("{path}: "))
                                        && m.contains("longer than"),
                                    "{input} {path}: {m}"
                                );
                            }
                            other => panic!("{input} {path}: 1 MiB accepted ({:?})", other.err()),
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 40, "{checked} fields checked");
    }
}
