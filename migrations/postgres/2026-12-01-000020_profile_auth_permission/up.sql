-- ACP authenticate and permission policy per agent profile (issue 12).
-- 'ask' is allowed already: the ask flow needs no second migration.
ALTER TABLE agent_profiles ADD COLUMN auth_method TEXT;
ALTER TABLE agent_profiles ADD COLUMN permission_policy TEXT NOT NULL DEFAULT 'allow'
    CHECK (permission_policy IN ('allow', 'deny', 'ask'));
