-- Messages that are parts of an agent's activity (tool calls, plans,
-- thoughts, ...): `kind` says which, `data` holds the part's state as JSON
-- text (empty for text messages).
ALTER TABLE session_messages ADD COLUMN kind TEXT NOT NULL DEFAULT 'text';
ALTER TABLE session_messages ADD COLUMN data TEXT NOT NULL DEFAULT '';
