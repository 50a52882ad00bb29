-- What people call a session, and who named it (`prompt`, `agent`, `user`;
-- empty: nobody yet): a title is replaced only by the same or a stronger
-- source. Session updates never write these columns.
ALTER TABLE task_sessions ADD COLUMN title TEXT NOT NULL DEFAULT '';
ALTER TABLE task_sessions ADD COLUMN title_source TEXT NOT NULL DEFAULT '';
