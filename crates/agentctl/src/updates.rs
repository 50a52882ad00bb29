//! The bounded, cursor-addressed log of agent updates behind `StreamUpdates`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use sessiond_proto::agentctl::v1::{AgentUpdate, Gap, agent_update::Kind};
use tokio::sync::watch;

/// What a reader gets after a cursor.
#[derive(Debug, PartialEq)]
pub enum Read {
    /// Updates with cursors greater than the one asked for, in order
    /// (possibly none yet).
    Updates(Vec<AgentUpdate>),
    /// The cursor asked for is not continuous with the buffer: updates were
    /// dropped, or the cursor comes from a different agentctl process.
    Gap(Box<AgentUpdate>),
}

/// A ring buffer of updates. Cursors start at 1 and grow by one per update.
///
/// Cursors are only meaningful within one agentctl process, so every log has
/// a random `instance_id` (reported by Health and on every update); a reader
/// naming another instance gets a `Gap` first.
#[derive(Debug)]
pub struct UpdateLog {
    instance_id: String,
    ring: Mutex<Ring>,
    latest: watch::Sender<u64>,
}

#[derive(Debug)]
struct Ring {
    buf: VecDeque<AgentUpdate>,
    capacity: usize,
    next: u64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

impl UpdateLog {
    /// A log keeping at most `capacity` updates (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            instance_id: uuid::Uuid::new_v4().simple().to_string(),
            ring: Mutex::new(Ring {
                buf: VecDeque::with_capacity(capacity.clamp(1, 1 << 16)),
                capacity: capacity.max(1),
                next: 1,
            }),
            latest: watch::channel(0).0,
        }
    }

    /// This process's instance id: random, fresh for every log.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends one update and wakes every reader; returns its cursor.
    pub fn push(&self, kind: Kind) -> u64 {
        let kind = match kind {
            Kind::Activity(a) => Kind::Activity(crate::activity::bounded(a)),
            other => other,
        };
        let cursor = {
            let mut ring = self.ring();
            let cursor = ring.next;
            ring.next += 1;
            ring.buf.push_back(AgentUpdate {
                cursor,
                at_unix_ms: now_ms(),
                instance_id: self.instance_id.clone(),
                kind: Some(kind),
            });
            while ring.buf.len() > ring.capacity {
                ring.buf.pop_front();
            }
            cursor
        };
        self.latest.send_replace(cursor);
        cursor
    }

    /// The cursor of the newest update, 0 when there is none.
    pub fn latest(&self) -> u64 {
        self.ring().next - 1
    }

    /// A receiver that changes whenever an update is pushed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.latest.subscribe()
    }

    /// The first read of a stream: like [`Self::read_after`], except that a
    /// cursor of another instance (`instance` non-empty and not ours) gives a
    /// `Gap` pointing at the oldest buffered update, whatever its number.
    pub fn read_first(&self, after: u64, instance: &str, max: usize) -> Read {
        if !instance.is_empty() && instance != self.instance_id {
            let ring = self.ring();
            let oldest = ring.buf.front().map_or(ring.next, |u| u.cursor);
            return Read::Gap(Box::new(self.gap(after, oldest)));
        }
        self.read_after(after, max)
    }

    fn gap(&self, requested_after: u64, next_cursor: u64) -> AgentUpdate {
        AgentUpdate {
            cursor: next_cursor - 1,
            at_unix_ms: now_ms(),
            instance_id: self.instance_id.clone(),
            kind: Some(Kind::Gap(Gap {
                requested_after,
                next_cursor,
            })),
        }
    }

    /// Up to `max` updates after `after`, or a `Gap` when `after` is not
    /// continuous with what is buffered: updates after it were dropped (for
    /// 0, "from the start", once the first update was dropped), or it lies
    /// ahead of the newest cursor.
    pub fn read_after(&self, after: u64, max: usize) -> Read {
        let ring = self.ring();
        let latest = ring.next - 1;
        let oldest = ring.buf.front().map_or(ring.next, |u| u.cursor);
        if after > latest {
            return Read::Gap(Box::new(self.gap(after, ring.next)));
        }
        if after + 1 < oldest {
            return Read::Gap(Box::new(self.gap(after, oldest)));
        }
        let skip = usize::try_from((after + 1).saturating_sub(oldest)).unwrap_or(usize::MAX);
        Read::Updates(ring.buf.iter().skip(skip).take(max).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sessiond_proto::agentctl::v1::{AgentState, AgentStateChanged};

    fn push(log: &UpdateLog) -> u64 {
        log.push(Kind::StateChanged(AgentStateChanged {
            state: AgentState::Ready as i32,
        }))
    }

    fn cursors(r: Read) -> Vec<u64> {
        match r {
            Read::Updates(v) => v.iter().map(|u| u.cursor).collect(),
            Read::Gap(g) => panic!("unexpected gap {g:?}"),
        }
    }

    #[test]
    fn replay_gap_and_future_cursor() {
        let log = UpdateLog::new(3);
        for _ in 0..5 {
            push(&log);
        }
        assert_eq!(log.latest(), 5);
        assert_eq!(cursors(log.read_after(2, 10)), vec![3, 4, 5]);
        assert_eq!(cursors(log.read_after(4, 10)), vec![5]);
        assert_eq!(cursors(log.read_after(5, 10)), Vec::<u64>::new());
        assert_eq!(cursors(log.read_after(3, 1)), vec![4]);
        match log.read_after(1, 10) {
            Read::Gap(u) => {
                assert_eq!(u.cursor, 2);
                assert_eq!(
                    u.kind,
                    Some(Kind::Gap(Gap {
                        requested_after: 1,
                        next_cursor: 3
                    }))
                );
            }
            other => panic!("expected gap, got {other:?}"),
        }
        assert!(matches!(log.read_after(9, 10), Read::Gap(_)));
    }

    #[test]
    fn zero_before_the_ring_wrapped_is_no_gap() {
        let log = UpdateLog::new(3);
        assert_eq!(cursors(log.read_after(0, 10)), Vec::<u64>::new());
        push(&log);
        push(&log);
        push(&log);
        assert_eq!(cursors(log.read_after(0, 10)), vec![1, 2, 3]);
    }

    #[test]
    fn zero_after_the_ring_wrapped_is_a_gap() {
        let log = UpdateLog::new(3);
        for _ in 0..5 {
            push(&log);
        }
        match log.read_after(0, 10) {
            Read::Gap(u) => {
                assert_eq!(u.cursor, 2);
                assert_eq!(
                    u.kind,
                    Some(Kind::Gap(Gap {
                        requested_after: 0,
                        next_cursor: 3
                    }))
                );
            }
            other => panic!("expected gap, got {other:?}"),
        }
        // Continuing after the gap's cursor reads the buffer.
        assert_eq!(cursors(log.read_after(2, 10)), vec![3, 4, 5]);
    }

    #[test]
    fn a_cursor_of_another_instance_is_a_gap_then_everything_buffered() {
        let log = UpdateLog::new(8);
        push(&log);
        push(&log);
        let ours = log.instance_id().to_owned();
        assert_eq!(ours.len(), 32);
        assert_ne!(ours, UpdateLog::new(8).instance_id(), "fresh per log");
        // Our own instance, or none: the plain cursor rules.
        assert_eq!(cursors(log.read_first(1, &ours, 10)), vec![2]);
        assert_eq!(cursors(log.read_first(1, "", 10)), vec![2]);
        // An old backend cursor (say 1) from a previous agentctl process
        // must not skip this process's update 2 ... nor update 1.
        match log.read_first(1, "some-older-process", 10) {
            Read::Gap(u) => {
                assert_eq!(u.instance_id, ours);
                assert_eq!(
                    u.kind,
                    Some(Kind::Gap(Gap {
                        requested_after: 1,
                        next_cursor: 1
                    }))
                );
                assert_eq!(cursors(log.read_after(u.cursor, 10)), vec![1, 2]);
            }
            other => panic!("expected gap, got {other:?}"),
        }
        match log.read_after(1, 10) {
            Read::Updates(v) => assert!(v.iter().all(|u| u.instance_id == ours)),
            other => panic!("{other:?}"),
        }
    }
}
