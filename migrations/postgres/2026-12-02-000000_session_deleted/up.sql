-- A deleted session keeps its row, messages and events as history, but the
-- API no longer serves it (NOT_FOUND): reads filter on deleted_at IS NULL.
ALTER TABLE task_sessions ADD COLUMN deleted_at TIMESTAMPTZ;
