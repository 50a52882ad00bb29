-- A profile's default values of the agent's config options (its model,
-- ...), a JSON object of option id to value, set when a session starts.
ALTER TABLE agent_profiles ADD COLUMN config_defaults TEXT NOT NULL DEFAULT '{}';
