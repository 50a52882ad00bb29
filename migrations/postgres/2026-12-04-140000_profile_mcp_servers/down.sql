ALTER TABLE agent_profiles DROP COLUMN mcp_servers;
