-- Several sessiond replicas on one database. Each replica registers here
-- and heartbeats; a replica whose heartbeat is older than its lease TTL is
-- gone, and the executors it owned are adopted by the others.
CREATE TABLE replicas (
    id            TEXT PRIMARY KEY,
    -- Where other replicas and clients reach its API (host:port).
    address       TEXT NOT NULL,
    hostname      TEXT NOT NULL,
    pid           BIGINT NOT NULL,
    started_at    TIMESTAMPTZ NOT NULL,
    heartbeat_at  TIMESTAMPTZ NOT NULL,
    lease_ttl_ms  BIGINT NOT NULL CHECK (lease_ttl_ms > 0)
);

-- The fencing token of an executor's lease: every claim by a replica
-- (owner NULL or lease expired) adds one.
ALTER TABLE executors_running ADD COLUMN lease_epoch BIGINT NOT NULL DEFAULT 0;
CREATE INDEX executors_running_owner_idx ON executors_running (owner_id);
