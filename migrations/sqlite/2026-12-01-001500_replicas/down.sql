DROP INDEX executors_running_owner_idx;
ALTER TABLE executors_running DROP COLUMN lease_epoch;
DROP TABLE replicas;
