//! Messages sent while a turn runs wait in the session's queue and are
//! delivered one turn at a time, in the order they were sent.
//!
//! The queue lives in the session's metadata, one entry per message
//! (`queued_message:<position>` → `<id> <queued_at>\n<content>`), so taking
//! a message off the queue and starting its turn is one commit: a message
//! is delivered at most once, and a crash before that commit leaves it
//! queued. Its id becomes the id of the user message (and the turn) it is
//! delivered as.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::MessageId;

/// Key prefix of queue entries in a session's metadata.
pub const QUEUE_PREFIX: &str = "queued_message:";

/// At most this many messages wait in one session's queue.
pub const MAX_QUEUED: usize = 16;

/// Metadata key of the session's last turn when it ended interrupted (its
/// user message id), kept for a retry until another turn starts.
pub const INTERRUPTED_TURN_KEY: &str = "interrupted_turn";

/// True when messages wait and the queue is held: the last turn ended
/// interrupted, and the user decides (a retry of it, or a new message)
/// before what was queued behind it goes on.
pub fn is_held(metadata: &BTreeMap<String, String>) -> bool {
    metadata.contains_key(INTERRUPTED_TURN_KEY) && !is_empty(metadata)
}

/// A message waiting for the session's running turn to end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedMessage {
    /// Its id, which the user message and the turn take on delivery.
    pub id: MessageId,
    /// The text to send.
    pub content: String,
    /// When it was queued (UTC).
    pub queued_at: DateTime<Utc>,
}

/// The session's queue, oldest first. Entries that do not parse (written by
/// something else) are skipped.
pub fn queued(metadata: &BTreeMap<String, String>) -> Vec<QueuedMessage> {
    entries(metadata).map(|(_, q)| q).collect()
}

/// True when no message waits.
pub fn is_empty(metadata: &BTreeMap<String, String>) -> bool {
    entries(metadata).next().is_none()
}

/// The bytes of text waiting in the queue.
pub fn queued_bytes(metadata: &BTreeMap<String, String>) -> usize {
    entries(metadata).map(|(_, q)| q.content.len()).sum()
}

/// Appends `message` at the end of the queue.
pub fn enqueue(metadata: &mut BTreeMap<String, String>, message: &QueuedMessage) {
    let next = entries(metadata)
        .map(|(position, _)| position)
        .last()
        .map_or(1, |p| p + 1);
    metadata.insert(
        key(next),
        format!(
            "{} {}\n{}",
            message.id,
            message.queued_at.to_rfc3339(),
            message.content
        ),
    );
}

/// Takes `id` off the queue; `None` when it is not queued.
pub fn remove(metadata: &mut BTreeMap<String, String>, id: MessageId) -> Option<QueuedMessage> {
    let (position, found) = entries(metadata).find(|(_, q)| q.id == id)?;
    metadata.remove(&key(position));
    Some(found)
}

/// Takes every message off the queue (the session ended).
pub fn clear(metadata: &mut BTreeMap<String, String>) -> Vec<QueuedMessage> {
    let all: Vec<(u64, QueuedMessage)> = entries(metadata).collect();
    for (position, _) in &all {
        metadata.remove(&key(*position));
    }
    all.into_iter().map(|(_, q)| q).collect()
}

/// Zero-padded, so the map's order is the queue's order.
fn key(position: u64) -> String {
    format!("{QUEUE_PREFIX}{position:020}")
}

fn entries(metadata: &BTreeMap<String, String>) -> impl Iterator<Item = (u64, QueuedMessage)> {
    metadata
        .range(QUEUE_PREFIX.to_owned()..)
        .map_while(|(k, v)| Some((k.strip_prefix(QUEUE_PREFIX)?, v)))
        .filter_map(|(position, v)| Some((position.parse().ok()?, parse(v)?)))
}

fn parse(value: &str) -> Option<QueuedMessage> {
    let (head, content) = value.split_once('\n')?;
    let (id, at) = head.split_once(' ')?;
    Some(QueuedMessage {
        id: MessageId::parse(id).ok()?,
        content: content.to_owned(),
        queued_at: DateTime::parse_from_rfc3339(at).ok()?.with_timezone(&Utc),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(content: &str) -> QueuedMessage {
        QueuedMessage {
            id: MessageId::new(),
            content: content.to_owned(),
            queued_at: DateTime::parse_from_rfc3339("2026-12-04T10:00:00Z")
                .unwrap()
                .with_timezone(&Utc),
        }
    }

    #[test]
    fn messages_come_out_in_the_order_they_went_in() {
        let mut m = BTreeMap::new();
        m.insert("queued_z".to_owned(), "not an entry".to_owned());
        m.insert("agentctl_cursor".to_owned(), "1:2".to_owned());
        let (a, b, c) = (message("one"), message("two\nlines"), message(""));
        for q in [&a, &b, &c] {
            enqueue(&mut m, q);
        }
        assert_eq!(queued(&m), vec![a.clone(), b.clone(), c.clone()]);
        assert_eq!(queued_bytes(&m), 3 + 9);
        assert_eq!(remove(&mut m, b.id), Some(b.clone()));
        assert_eq!(remove(&mut m, b.id), None, "taken once");
        let d = message("four");
        enqueue(&mut m, &d);
        assert_eq!(queued(&m), vec![a, c, d]);
        // Past nine entries the order still holds (zero-padded positions).
        for i in 0..12 {
            enqueue(&mut m, &message(&i.to_string()));
        }
        let texts: Vec<String> = queued(&m).into_iter().map(|q| q.content).collect();
        assert_eq!(texts[3..].join(","), "0,1,2,3,4,5,6,7,8,9,10,11");
        assert_eq!(clear(&mut m).len(), 15);
        assert!(is_empty(&m));
        assert_eq!(m.len(), 2, "other metadata kept");
    }

    #[test]
    fn a_broken_entry_is_skipped_not_fatal() {
        let mut m = BTreeMap::new();
        m.insert(format!("{QUEUE_PREFIX}1"), "garbage".to_owned());
        let a = message("ok");
        enqueue(&mut m, &a);
        assert_eq!(queued(&m), vec![a]);
    }
}
