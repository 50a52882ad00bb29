ALTER TABLE task_sessions DROP COLUMN title_source;
ALTER TABLE task_sessions DROP COLUMN title;
