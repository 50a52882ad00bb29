ALTER TABLE executors_running DROP COLUMN worktree_base;
ALTER TABLE executors_running DROP COLUMN worktree_repository;
ALTER TABLE task_sessions DROP COLUMN worktree_base;
ALTER TABLE task_sessions DROP COLUMN worktree_repository;
