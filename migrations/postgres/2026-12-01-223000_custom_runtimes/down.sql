-- Back to the three built-in runtime names; fails (and changes nothing)
-- while a session or an executor of a custom runtime exists.
ALTER TABLE executors_running ADD CONSTRAINT executors_running_runtime_check
    CHECK (runtime IN ('local_docker', 'local_standalone', 'remote'));
ALTER TABLE task_sessions ADD CONSTRAINT task_sessions_runtime_check
    CHECK (runtime IN ('local_docker', 'local_standalone', 'remote'));
