ALTER TABLE agent_profiles DROP COLUMN container;
