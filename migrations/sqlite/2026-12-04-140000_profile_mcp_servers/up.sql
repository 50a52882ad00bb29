-- A profile's MCP servers, JSON; secret values are kept as references (an
-- environment variable or a file of sessiond's), never as the secret.
ALTER TABLE agent_profiles ADD COLUMN mcp_servers TEXT NOT NULL DEFAULT '[]';
