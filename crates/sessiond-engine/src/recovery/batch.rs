//! The startup pass's outcome commits, written together (group commit):
//! while one batch is written, the outcomes that arrive meanwhile queue and
//! go in the next (`Store::commit_batch`), so N executors cost about
//! N / batch transactions instead of N. Before writing, the writer yields to
//! the runtime while the queue still grows, so the recoveries about to
//! finish join the batch; it never waits for time, and an outcome that
//! arrives alone is written once nothing else is ready to run. A recovery a
//! caller waits on commits on its own, never behind a batch.
//!
//! Its re-reads under the session lock are grouped the same way: each
//! recovery asks once it holds its lock, and the reads that arrive while
//! one group is read go in the next (one blocking call, two statements),
//! gathered the same way.

use sessiond_domain::{ExecutorId, ExecutorRecord, Session};
use sessiond_store::{Changeset, Committed, Store, Yield};
use tokio::sync::{mpsc, oneshot};

use crate::{
    error::Result,
    lease::Fencing,
    manager::SessionManager,
    pass::{OutcomeCommit, Outcomes, RecordRead},
};

/// Outcomes in one transaction at most (the pass's concurrency is 64):
/// bounds how long another writer waits behind one batch.
const MOST: usize = 64;

/// Starts the pass's outcome writer; it ends once every clone of the
/// handle is dropped and the queue is written.
pub(crate) fn start(manager: &SessionManager) -> Outcomes {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(writer(manager.clone(), rx));
    let (reads, asked) = mpsc::unbounded_channel();
    tokio::spawn(reader(manager.clone(), asked));
    Outcomes { tx, reads }
}

/// The executor record and its session as stored now, read in the next
/// group (as `Store::get_executor_and_session` would on its own).
pub(crate) async fn read(
    outcomes: &Outcomes,
    me: &SessionManager,
    id: ExecutorId,
) -> Result<(ExecutorRecord, Session)> {
    let (reply, answer) = oneshot::channel();
    if outcomes.reads.send((id, reply)).is_err() {
        return Ok(me.inner.store.get_executor_and_session(id).await?);
    }
    answered(answer, "the pass's record reader ended before answering").await
}

/// What the reader or the writer sent back; `ended` when it is gone first.
async fn answered<T>(answer: oneshot::Receiver<Result<T>>, ended: &str) -> Result<T> {
    answer
        .await
        .unwrap_or_else(|_| Err(crate::error::Error::Internal(ended.into())))
}

async fn reader(me: SessionManager, mut rx: mpsc::UnboundedReceiver<RecordRead>) {
    let flag = Yield::new();
    let mut items = Vec::with_capacity(MOST);
    while rx.recv_many(&mut items, MOST).await > 0 {
        gather(&mut rx, &mut items).await;
        let (ids, replies): (Vec<_>, Vec<_>) = items.drain(..).unzip();
        let read = Store::yielding(
            flag.clone(),
            me.inner.store.get_executors_and_sessions(ids.clone()),
        )
        .await;
        match read {
            Ok(answers) => {
                for (answer, reply) in answers.into_iter().zip(replies) {
                    let _ = reply.send(answer.map_err(Into::into));
                }
            }
            // The read itself failed: each on its own, as without a group.
            Err(e) => {
                tracing::debug!(error = %e, reads = ids.len(),
                    "a group of recovery re-reads failed; reading them one by one");
                for (id, reply) in ids.into_iter().zip(replies) {
                    let answer =
                        Store::yielding(flag.clone(), me.inner.store.get_executor_and_session(id))
                            .await;
                    let _ = reply.send(answer.map_err(Into::into));
                }
            }
        }
    }
}

/// Lets the recoveries about to ask queue their asks behind the first
/// before a group is read or a batch written: each costs a blocking-pool
/// hop, and a batch its begin and its commit (the WAL's frames). Without
/// it, N = 1,000 on two cores wrote batches of about five outcomes; with
/// it, about thirty. Yields to the runtime while the queue grows, never
/// waits for time.
async fn gather<T>(rx: &mut mpsc::UnboundedReceiver<T>, items: &mut Vec<T>) {
    const ROUNDS: usize = 4;
    for _ in 0..ROUNDS {
        let before = items.len();
        tokio::task::yield_now().await;
        while items.len() < MOST {
            match rx.try_recv() {
                Ok(item) => items.push(item),
                Err(_) => break,
            }
        }
        if items.len() == before || items.len() >= MOST {
            break;
        }
    }
}

/// Writes `change` in the next batch, as `SessionManager::commit` would on
/// its own (fenced, then the cache, snapshot and watchers updated).
pub(crate) async fn commit(
    outcomes: &Outcomes,
    me: &SessionManager,
    change: Changeset,
) -> Result<Committed> {
    let (reply, answer) = oneshot::channel();
    if let Err(mpsc::error::SendError((change, _))) = outcomes.tx.send((change, reply)) {
        return me.commit(change).await;
    }
    answered(
        answer,
        "the pass's outcome writer ended before writing an outcome",
    )
    .await
}

async fn writer(me: SessionManager, mut rx: mpsc::UnboundedReceiver<OutcomeCommit>) {
    // The pass's writes give way to everyone else's, as its recoveries' do.
    let flag = Yield::new();
    let mut items = Vec::with_capacity(MOST);
    while rx.recv_many(&mut items, MOST).await > 0 {
        gather(&mut rx, &mut items).await;
        let mut fences = Vec::with_capacity(items.len());
        let mut replies = Vec::with_capacity(items.len());
        let fenced = items
            .drain(..)
            .map(|(change, reply)| {
                let fence = change.subject().and_then(|s| Fencing(&me).fence(s));
                replies.push(reply);
                fences.push(fence.clone());
                match fence {
                    Some(f) => change.fenced(f),
                    None => change,
                }
            })
            .collect();
        // A failed transaction is written again changeset by changeset
        // inside `commit_batch`: each outcome gets its own answer.
        let written = Store::yielding(flag.clone(), me.inner.store.commit_batch(fenced)).await;
        let results = match written {
            Ok(results) => results,
            // The lot never came back to be written one by one.
            Err(e) => {
                tracing::warn!(error = %e, outcomes = replies.len(),
                    "a batch of recovery outcomes was not written");
                for reply in replies {
                    let _ = reply.send(Err(crate::error::Error::Internal(format!(
                        "the recovery's outcome was not written: {e}"
                    ))));
                }
                continue;
            }
        };
        for ((result, fence), reply) in results.into_iter().zip(fences).zip(replies) {
            let result = match result {
                Ok(done) => {
                    me.after_commit(&done);
                    Ok(done)
                }
                Err(e) => {
                    if let Some(f) = &fence
                        && e.is_lease_lost()
                    {
                        Fencing(&me).lease_lost(f.session, f.epoch, "store", &e.to_string());
                    }
                    Err(Fencing(&me).lease_error(e))
                }
            };
            let _ = reply.send(result);
        }
    }
}
