-- Runtimes of a third party's own name (issue 17): the `runtime` columns
-- lose their CHECK on the three built-in names; the store checks a name
-- when it reads it back. (PostgreSQL named the column CHECKs
-- <table>_<column>_check.)
ALTER TABLE task_sessions DROP CONSTRAINT task_sessions_runtime_check;
ALTER TABLE executors_running DROP CONSTRAINT executors_running_runtime_check;
