-- Where a worktree sessiond created came from: the repository on the
-- executor's host and the ref its branch started at. Empty for a directory
-- the caller made (sessiond then neither recreates nor removes it).
ALTER TABLE task_sessions ADD COLUMN worktree_repository TEXT NOT NULL DEFAULT '';
ALTER TABLE task_sessions ADD COLUMN worktree_base TEXT NOT NULL DEFAULT '';
ALTER TABLE executors_running ADD COLUMN worktree_repository TEXT NOT NULL DEFAULT '';
ALTER TABLE executors_running ADD COLUMN worktree_base TEXT NOT NULL DEFAULT '';
