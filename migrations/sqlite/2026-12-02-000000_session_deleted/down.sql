ALTER TABLE task_sessions DROP COLUMN deleted_at;
