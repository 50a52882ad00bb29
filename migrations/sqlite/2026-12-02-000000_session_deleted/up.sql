-- A deleted session keeps its row, messages and events as history, but the
-- API no longer serves it (NOT_FOUND): reads filter on deleted_at IS NULL.
-- RFC 3339 text like every other timestamp of this backend.
ALTER TABLE task_sessions ADD COLUMN deleted_at TEXT;
