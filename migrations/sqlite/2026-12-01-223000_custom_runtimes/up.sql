-- Runtimes of a third party's own name (issue 17): the `runtime` columns
-- of task_sessions and executors_running lose their CHECK on the three
-- built-in names; the store checks a name when it reads it back.
--
-- SQLite cannot drop a CHECK, so the sessions table is rebuilt, and with it
-- the three tables that reference it (a foreign key names its parent table;
-- rebuilding the children keeps their ON DELETE CASCADE pointing at the new
-- one). Every row is copied, column by column; the indexes are recreated.
-- Migrations run in one transaction with foreign keys on, so a failure
-- leaves the old tables untouched.

-- 1. The new sessions table, then its children pointing at it; rows copied.
CREATE TABLE task_sessions_new (
    id                  TEXT NOT NULL PRIMARY KEY,
    task_id             TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    state               TEXT NOT NULL
        CHECK (state IN ('CREATED', 'STARTING', 'RUNNING', 'WAITING_FOR_INPUT',
                         'COMPLETED', 'CANCELLED', 'ERROR')),
    agent_profile_id    TEXT NOT NULL REFERENCES agent_profiles (id),
    agent_execution_id  TEXT,
    runtime             TEXT NOT NULL,
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
    created_at          TEXT NOT NULL,
    updated_at          TEXT NOT NULL
);
INSERT INTO task_sessions_new (
    id, task_id, state, agent_profile_id, agent_execution_id, runtime,
    executor_id, worktree_id, worktree_path, worktree_branch, metadata,
    error_message, version, last_event_seq, last_message_seq, created_at,
    updated_at
)
SELECT
    id, task_id, state, agent_profile_id, agent_execution_id, runtime,
    executor_id, worktree_id, worktree_path, worktree_branch, metadata,
    error_message, version, last_event_seq, last_message_seq, created_at,
    updated_at
FROM task_sessions;

CREATE TABLE executors_running_new (
    id                       TEXT NOT NULL PRIMARY KEY,
    -- One executor per session.
    session_id               TEXT NOT NULL UNIQUE REFERENCES task_sessions_new (id) ON DELETE CASCADE,
    task_id                  TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    runtime                  TEXT NOT NULL,
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
    last_seen_at             TEXT,
    error_message            TEXT,
    owner_id                 TEXT,
    lease_expires_at         TEXT,
    version                  BIGINT NOT NULL DEFAULT 1,
    created_at               TEXT NOT NULL,
    updated_at               TEXT NOT NULL,
    -- The fencing token of the executor's lease.
    lease_epoch              BIGINT NOT NULL DEFAULT 0
);
INSERT INTO executors_running_new (
    id, session_id, task_id, runtime, status, agentctl_url, agentctl_port,
    container_id, pid, pid_start_time, auth_secret, generation,
    supports_session_resume, supports_workspace_only, resume_token,
    workspace_path, worktree_id, worktree_path, worktree_branch,
    last_seen_at, error_message, owner_id, lease_expires_at, version,
    created_at, updated_at, lease_epoch
)
SELECT
    id, session_id, task_id, runtime, status, agentctl_url, agentctl_port,
    container_id, pid, pid_start_time, auth_secret, generation,
    supports_session_resume, supports_workspace_only, resume_token,
    workspace_path, worktree_id, worktree_path, worktree_branch,
    last_seen_at, error_message, owner_id, lease_expires_at, version,
    created_at, updated_at, lease_epoch
FROM executors_running;

CREATE TABLE session_messages_new (
    id          TEXT NOT NULL PRIMARY KEY,
    session_id  TEXT NOT NULL REFERENCES task_sessions_new (id) ON DELETE CASCADE,
    task_id     TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    role        TEXT NOT NULL CHECK (role IN ('user', 'agent', 'system')),
    content     TEXT NOT NULL,
    seq         BIGINT NOT NULL CHECK (seq >= 1),
    complete    BOOLEAN NOT NULL,
    created_at  TEXT NOT NULL,
    updated_at  TEXT NOT NULL,
    kind        TEXT NOT NULL DEFAULT 'text',
    data        TEXT NOT NULL DEFAULT '',
    UNIQUE (session_id, seq)
);
INSERT INTO session_messages_new (
    id, session_id, task_id, role, content, seq, complete, created_at,
    updated_at, kind, data
)
SELECT
    id, session_id, task_id, role, content, seq, complete, created_at,
    updated_at, kind, data
FROM session_messages;

CREATE TABLE session_events_new (
    session_id  TEXT NOT NULL REFERENCES task_sessions_new (id) ON DELETE CASCADE,
    seq         BIGINT NOT NULL CHECK (seq >= 1),
    task_id     TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    task_seq    BIGINT NOT NULL CHECK (task_seq >= 1),
    kind        TEXT NOT NULL,
    payload     TEXT NOT NULL,  -- JSON object
    created_at  TEXT NOT NULL,
    PRIMARY KEY (session_id, seq),
    UNIQUE (task_id, task_seq)
);
INSERT INTO session_events_new (
    session_id, seq, task_id, task_seq, kind, payload, created_at
)
SELECT
    session_id, seq, task_id, task_seq, kind, payload, created_at
FROM session_events;

-- 2. The old tables, children first (nothing references them any more, so
-- dropping the old sessions deletes nothing through ON DELETE CASCADE).
DROP TABLE session_events;
DROP TABLE session_messages;
DROP TABLE executors_running;
DROP TABLE task_sessions;

-- 3. The new tables take the old names; RENAME rewrites the children's
-- REFERENCES task_sessions_new to task_sessions.
ALTER TABLE task_sessions_new RENAME TO task_sessions;
ALTER TABLE executors_running_new RENAME TO executors_running;
ALTER TABLE session_messages_new RENAME TO session_messages;
ALTER TABLE session_events_new RENAME TO session_events;

-- 4. The indexes, as before.
CREATE INDEX task_sessions_task_id_idx ON task_sessions (task_id);
CREATE INDEX task_sessions_state_idx ON task_sessions (state);
CREATE INDEX executors_running_status_idx ON executors_running (status);
CREATE INDEX executors_running_task_id_idx ON executors_running (task_id);
CREATE INDEX executors_running_owner_idx ON executors_running (owner_id);
CREATE INDEX session_messages_task_id_idx ON session_messages (task_id);
CREATE INDEX session_messages_kind_complete ON session_messages (kind, complete);
