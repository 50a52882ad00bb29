-- ACP authenticate and permission policy per agent profile (issue 12).
-- No CHECK here: SQLite cannot drop a column a CHECK names; the store
-- validates the value when it reads the row.
ALTER TABLE agent_profiles ADD COLUMN auth_method TEXT;
ALTER TABLE agent_profiles ADD COLUMN permission_policy TEXT NOT NULL DEFAULT 'allow';
