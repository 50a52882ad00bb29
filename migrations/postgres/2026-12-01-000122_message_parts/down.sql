ALTER TABLE session_messages DROP COLUMN data;
ALTER TABLE session_messages DROP COLUMN kind;
