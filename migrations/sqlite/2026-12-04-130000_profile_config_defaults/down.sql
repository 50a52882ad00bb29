ALTER TABLE agent_profiles DROP COLUMN config_defaults;
