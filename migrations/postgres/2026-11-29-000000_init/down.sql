DROP TABLE IF EXISTS session_events;
DROP TABLE IF EXISTS session_messages;
DROP TABLE IF EXISTS executors_running;
DROP TABLE IF EXISTS task_sessions;
DROP TABLE IF EXISTS agent_profiles;
DROP TABLE IF EXISTS tasks;
