-- How a profile's agent runs in a container (image, command, args, env), as
-- one JSON object; NULL: as on the host.
ALTER TABLE agent_profiles ADD COLUMN container TEXT;
