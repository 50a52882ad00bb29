//! The diesel schema, shared by both backends (see `migrations/`).
//!
//! Written by hand to match `migrations/{postgres,sqlite}`; only types the
//! `MultiBackend` understands are used (Text, BigInt, Integer, Bool) plus the
//! store's own `UtcTimestamp`.

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    tasks (id) {
        id -> Text,
        title -> Text,
        state -> Text,
        last_event_seq -> BigInt,
        created_at -> UtcTimestamp,
        updated_at -> UtcTimestamp,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    agent_profiles (id) {
        id -> Text,
        name -> Text,
        command -> Text,
        args -> Text,
        env -> Text,
        supports_session_resume -> Bool,
        created_at -> UtcTimestamp,
        updated_at -> UtcTimestamp,
        container -> Nullable<Text>,
        auth_method -> Nullable<Text>,
        permission_policy -> Text,
        permission_timeout_ms -> BigInt,
        config_defaults -> Text,
        mcp_servers -> Text,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    task_sessions (id) {
        id -> Text,
        task_id -> Text,
        state -> Text,
        agent_profile_id -> Text,
        agent_execution_id -> Nullable<Text>,
        runtime -> Text,
        executor_id -> Nullable<Text>,
        worktree_id -> Text,
        worktree_path -> Text,
        worktree_branch -> Text,
        worktree_repository -> Text,
        worktree_base -> Text,
        metadata -> Text,
        error_message -> Nullable<Text>,
        version -> BigInt,
        last_event_seq -> BigInt,
        last_message_seq -> BigInt,
        created_at -> UtcTimestamp,
        updated_at -> UtcTimestamp,
        deleted_at -> Nullable<UtcTimestamp>,
        title -> Text,
        title_source -> Text,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    executors_running (id) {
        id -> Text,
        session_id -> Text,
        task_id -> Text,
        runtime -> Text,
        status -> Text,
        agentctl_url -> Nullable<Text>,
        agentctl_port -> Nullable<Integer>,
        container_id -> Nullable<Text>,
        pid -> Nullable<BigInt>,
        pid_start_time -> Nullable<BigInt>,
        auth_secret -> Text,
        generation -> BigInt,
        supports_session_resume -> Bool,
        supports_workspace_only -> Bool,
        resume_token -> Nullable<Text>,
        workspace_path -> Text,
        worktree_id -> Text,
        worktree_path -> Text,
        worktree_branch -> Text,
        worktree_repository -> Text,
        worktree_base -> Text,
        last_seen_at -> Nullable<UtcTimestamp>,
        error_message -> Nullable<Text>,
        owner_id -> Nullable<Text>,
        lease_expires_at -> Nullable<UtcTimestamp>,
        version -> BigInt,
        lease_epoch -> BigInt,
        created_at -> UtcTimestamp,
        updated_at -> UtcTimestamp,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    session_messages (id) {
        id -> Text,
        session_id -> Text,
        task_id -> Text,
        role -> Text,
        content -> Text,
        seq -> BigInt,
        complete -> Bool,
        created_at -> UtcTimestamp,
        updated_at -> UtcTimestamp,
        kind -> Text,
        data -> Text,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    session_events (session_id, seq) {
        session_id -> Text,
        seq -> BigInt,
        task_id -> Text,
        task_seq -> BigInt,
        kind -> Text,
        payload -> Text,
        created_at -> UtcTimestamp,
    }
}

diesel::table! {
    use diesel::sql_types::*;
    use crate::conn::UtcTimestamp;

    replicas (id) {
        id -> Text,
        address -> Text,
        hostname -> Text,
        pid -> BigInt,
        started_at -> UtcTimestamp,
        heartbeat_at -> UtcTimestamp,
        lease_ttl_ms -> BigInt,
    }
}

diesel::joinable!(task_sessions -> tasks (task_id));
diesel::joinable!(task_sessions -> agent_profiles (agent_profile_id));
diesel::joinable!(executors_running -> task_sessions (session_id));
diesel::joinable!(session_messages -> task_sessions (session_id));
diesel::joinable!(session_events -> task_sessions (session_id));

diesel::allow_tables_to_appear_in_same_query!(
    tasks,
    agent_profiles,
    task_sessions,
    executors_running,
    session_messages,
    session_events,
    replicas,
);
