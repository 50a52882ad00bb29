//! SQLite's WAL checkpoints, off the commit path.
//!
//! SQLite's own automatic checkpoint runs inside the commit that pushes the
//! WAL past 1,000 pages: every hundredth turn or so, a turn's commit waited
//! a few ms for pages to be copied and the file synced (the turn path's
//! p99, docs/PERFORMANCE.md). Here a thread of its own, on a connection of
//! its own, runs `PRAGMA wal_checkpoint(PASSIVE)` a moment after commits:
//! a passive checkpoint takes no write lock, so commits go on beside it.
//! The pool's connections keep an automatic checkpoint only as a backstop
//! ([`BACKSTOP_PAGES`]) for a checkpointer that cannot keep up.

use std::{
    sync::mpsc::{Receiver, SyncSender, TryRecvError, sync_channel},
    time::Duration,
};

use diesel::{Connection, SqliteConnection, connection::SimpleConnection};

/// The pool connections' `wal_autocheckpoint`: far above what the
/// checkpointer lets the WAL reach (a few hundred ms of commits), so it
/// fires only when that thread is stuck or gone.
pub(crate) const BACKSTOP_PAGES: u32 = 10_000;

/// How long the checkpointer lets commits gather after the first one it
/// hears of: one checkpoint (two fsyncs) covers them all.
const GATHER: Duration = Duration::from_millis(100);

/// Wakes the checkpointer thread; the thread ends once the last clone of
/// its store is dropped.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    wake: SyncSender<()>,
}

impl Checkpointer {
    /// Starts the thread for the SQLite file `target` (never an in-memory
    /// database: another connection would open another database).
    pub(crate) fn start(target: &str) -> std::io::Result<Checkpointer> {
        let (wake, woken) = sync_channel(1);
        let target = target.to_owned();
        std::thread::Builder::new()
            .name("sqlite-checkpoint".into())
            .spawn(move || run(&target, &woken))?;
        Ok(Checkpointer { wake })
    }

    /// A write transaction committed; never blocks (a wake-up already
    /// pending covers this commit too).
    pub(crate) fn committed(&self) {
        let _ = self.wake.try_send(());
    }
}

fn run(target: &str, woken: &Receiver<()>) {
    let mut conn = match SqliteConnection::establish(target) {
        Ok(conn) => conn,
        Err(err) => {
            tracing::warn!(%err, "SQLite checkpointer: cannot open the database; commits checkpoint by themselves");
            return;
        }
    };
    // Until the store is dropped (every sender gone).
    while woken.recv().is_ok() {
        std::thread::sleep(GATHER);
        match woken.try_recv() {
            Ok(()) | Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => return,
        }
        // Busy (another process's checkpoint, a reader on an old snapshot)
        // only leaves frames for the next round; the backstop bounds the WAL.
        if let Err(err) = conn.batch_execute("PRAGMA wal_checkpoint(PASSIVE)") {
            tracing::debug!(%err, "SQLite checkpoint did not run");
        }
    }
}
