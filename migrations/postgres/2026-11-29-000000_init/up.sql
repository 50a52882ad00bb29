-- sessiond schema, PostgreSQL flavour. migrations/sqlite holds the same schema
-- for SQLite; keep the two in step (same tables, columns, constraints).
--
-- Ids are UUIDs in canonical text form (TEXT keeps one diesel schema for both
-- backends). Times are TIMESTAMPTZ (UTC, microseconds). JSON documents are
-- TEXT written by the store with serde_json.

CREATE TABLE tasks (
    id              TEXT PRIMARY KEY,
    title           TEXT NOT NULL,
    state           TEXT NOT NULL
        CHECK (state IN ('TODO', 'IN_PROGRESS', 'REVIEW', 'COMPLETED', 'CANCELLED')),
    -- Last task_seq handed out to an event of this task's sessions.
    last_event_seq  BIGINT NOT NULL DEFAULT 0,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL
);
CREATE INDEX tasks_state_idx ON tasks (state);

CREATE TABLE agent_profiles (
    id                       TEXT PRIMARY KEY,
    name                     TEXT NOT NULL UNIQUE,
    command                  TEXT NOT NULL,
    args                     TEXT NOT NULL DEFAULT '[]',  -- JSON array of strings
    env                      TEXT NOT NULL DEFAULT '{}',  -- JSON object of strings
    supports_session_resume  BOOLEAN NOT NULL,
    created_at               TIMESTAMPTZ NOT NULL,
    updated_at               TIMESTAMPTZ NOT NULL
);

CREATE TABLE task_sessions (
    id                  TEXT PRIMARY KEY,
    task_id             TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    state               TEXT NOT NULL
        CHECK (state IN ('CREATED', 'STARTING', 'RUNNING', 'WAITING_FOR_INPUT',
                         'COMPLETED', 'CANCELLED', 'ERROR')),
    agent_profile_id    TEXT NOT NULL REFERENCES agent_profiles (id),
    agent_execution_id  TEXT,
    runtime             TEXT NOT NULL
        CHECK (runtime IN ('local_docker', 'local_standalone', 'remote')),
    -- The current executor; not a foreign key, the executor row may be gone.
    executor_id         TEXT,
    worktree_id         TEXT NOT NULL DEFAULT '',
    worktree_path       TEXT NOT NULL DEFAULT '',
    worktree_branch     TEXT NOT NULL DEFAULT '',
    -- JSON object of strings; "resume_token" holds the agent's resume token.
    metadata            TEXT NOT NULL DEFAULT '{}',
    error_message       TEXT,
    -- Optimistic concurrency: every update sets version = version + 1.
    version             BIGINT NOT NULL DEFAULT 1,
    -- Last seq handed out to this session's events and messages.
    last_event_seq      BIGINT NOT NULL DEFAULT 0,
    last_message_seq    BIGINT NOT NULL DEFAULT 0,
    created_at          TIMESTAMPTZ NOT NULL,
    updated_at          TIMESTAMPTZ NOT NULL
);
CREATE INDEX task_sessions_task_id_idx ON task_sessions (task_id);
CREATE INDEX task_sessions_state_idx ON task_sessions (state);

CREATE TABLE executors_running (
    id                       TEXT PRIMARY KEY,
    -- One executor per session.
    session_id               TEXT NOT NULL UNIQUE REFERENCES task_sessions (id) ON DELETE CASCADE,
    task_id                  TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    runtime                  TEXT NOT NULL
        CHECK (runtime IN ('local_docker', 'local_standalone', 'remote')),
    status                   TEXT NOT NULL
        CHECK (status IN ('starting', 'ready', 'error', 'stopped')),
    agentctl_url             TEXT,
    agentctl_port            INTEGER CHECK (agentctl_port BETWEEN 0 AND 65535),
    container_id             TEXT,
    pid                      BIGINT CHECK (pid >= 0),
    -- Start time of pid in clock ticks since boot (PID reuse detection).
    pid_start_time           BIGINT CHECK (pid_start_time >= 0),
    auth_secret              TEXT NOT NULL,
    generation               BIGINT NOT NULL DEFAULT 0,
    supports_session_resume  BOOLEAN NOT NULL,
    supports_workspace_only  BOOLEAN NOT NULL,
    resume_token             TEXT,
    workspace_path           TEXT NOT NULL DEFAULT '',
    worktree_id              TEXT NOT NULL DEFAULT '',
    worktree_path            TEXT NOT NULL DEFAULT '',
    worktree_branch          TEXT NOT NULL DEFAULT '',
    last_seen_at             TIMESTAMPTZ,
    error_message            TEXT,
    owner_id                 TEXT,
    lease_expires_at         TIMESTAMPTZ,
    version                  BIGINT NOT NULL DEFAULT 1,
    created_at               TIMESTAMPTZ NOT NULL,
    updated_at               TIMESTAMPTZ NOT NULL
);
CREATE INDEX executors_running_status_idx ON executors_running (status);
CREATE INDEX executors_running_task_id_idx ON executors_running (task_id);

CREATE TABLE session_messages (
    id          TEXT PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES task_sessions (id) ON DELETE CASCADE,
    task_id     TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    role        TEXT NOT NULL CHECK (role IN ('user', 'agent', 'system')),
    content     TEXT NOT NULL,
    seq         BIGINT NOT NULL CHECK (seq >= 1),
    complete    BOOLEAN NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL,
    UNIQUE (session_id, seq)
);
CREATE INDEX session_messages_task_id_idx ON session_messages (task_id);

-- The transactional outbox: every event a client can see is a row here first.
CREATE TABLE session_events (
    session_id  TEXT NOT NULL REFERENCES task_sessions (id) ON DELETE CASCADE,
    seq         BIGINT NOT NULL CHECK (seq >= 1),
    task_id     TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    task_seq    BIGINT NOT NULL CHECK (task_seq >= 1),
    kind        TEXT NOT NULL,
    payload     TEXT NOT NULL,  -- JSON object
    created_at  TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (session_id, seq),
    UNIQUE (task_id, task_seq)
);
