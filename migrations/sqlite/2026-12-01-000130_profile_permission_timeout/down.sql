DROP INDEX session_messages_kind_complete;
ALTER TABLE agent_profiles DROP COLUMN permission_timeout_ms;
