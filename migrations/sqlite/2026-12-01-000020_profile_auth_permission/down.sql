ALTER TABLE agent_profiles DROP COLUMN permission_policy;
ALTER TABLE agent_profiles DROP COLUMN auth_method;
