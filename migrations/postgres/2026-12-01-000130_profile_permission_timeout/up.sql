-- How long a permission request of policy 'ask' waits for an answer (issue 12).
ALTER TABLE agent_profiles ADD COLUMN permission_timeout_ms BIGINT NOT NULL DEFAULT 300000;
-- Pending permission requests are the incomplete messages of kind
-- 'permission' (listed per session, counted for the metrics gauge).
CREATE INDEX session_messages_kind_complete ON session_messages (kind, complete);
