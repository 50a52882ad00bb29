//! A call whose caller goes away (a client's deadline or closed
//! connection drops the handler's future; so does an embedder's
//! `timeout`) at any of its await points goes on to its end: a send's turn
//! runs and is replied to, a create's session comes up. Before, a send cut
//! after its turn's commit left the store RUNNING with no Prompt sent and
//! the status snapshot WAITING_FOR_INPUT, for good.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use sessiond_domain::{MessageRole, SessionState};
use sessiond_engine::SessionManager;

use crate::support::{Db, World};

/// Polls `f` at most `polls` times, then drops it at its next wake-up:
/// the caller going away right after the future's `polls`-th await point.
struct DropAfter<F> {
    f: Pin<Box<F>>,
    polls: usize,
}

impl<F: Future> Future for DropAfter<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.polls == 0 {
            return Poll::Ready(None);
        }
        self.polls -= 1;
        self.f.as_mut().poll(cx).map(Some)
    }
}

/// Waits until `session` waits for input with `text` sent once and
/// replied to, and is still so a moment later.
async fn wait_replied(
    w: &World,
    mgr: &SessionManager,
    session: sessiond_domain::SessionId,
    text: &str,
    what: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut settled_since = None;
    loop {
        let st = w.status(mgr, session).await;
        let msgs = w.messages(session).await;
        let copies = msgs
            .iter()
            .filter(|m| m.role == MessageRole::User && m.content == text)
            .count();
        assert!(copies <= 1, "{what}: {copies} copies of the message");
        let replied = copies == 1
            && msgs
                .last()
                .is_some_and(|m| m.role == MessageRole::Agent && m.complete);
        let settled = st.state == SessionState::WaitingForInput && replied;
        match (settled, settled_since) {
            (true, Some(t)) if Instant::now() - t > Duration::from_millis(300) => return,
            (true, None) => settled_since = Some(Instant::now()),
            (true, Some(_)) => {}
            (false, _) => settled_since = None,
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the session stayed {} ({:?}) with {copies} copies of the message, \
             replied: {replied}",
            st.state,
            st.error_message
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_whose_caller_goes_away_still_runs_its_turn() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let s = w.create(&mgr, "a").await;
    assert_eq!(s.state, SessionState::WaitingForInput);
    let mut polls = 1;
    let mut completed = 0;
    // Cut after 1, 2, ... polls until the call answered three times: every
    // await point of the send, the turn's commit and its Prompt included.
    while completed < 3 {
        let text = format!("cut after {polls} polls");
        let send = DropAfter {
            f: Box::pin(mgr.send_message(w.task.id, s.id, &text)),
            polls,
        };
        if let Some(sent) = send.await {
            sent.unwrap_or_else(|e| panic!("send with {polls} polls: {e}"));
            completed += 1;
        }
        wait_replied(&w, &mgr, s.id, &text, &text).await;
        polls += 1;
    }
    let reply = w.prompt(&mgr, s.id, "still usable").await;
    assert!(reply.contains("still usable"), "{reply}");
    w.finish(&mgr, &[s.id]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_caller_goes_away_still_brings_its_session_up() {
    let w = World::new(Db::Sqlite).await;
    let mgr = w.manager();
    let mut sessions = Vec::new();
    for polls in 1..=4 {
        let name = format!("cut-{polls}");
        let create = DropAfter {
            f: Box::pin(mgr.create_session(w.new_session(&name, &w.profile))),
            polls,
        };
        let answered = create.await;
        // The session is found by its worktree, as a client that lost the
        // answer would look for it.
        let path = w.worktree(&name).path;
        let deadline = Instant::now() + Duration::from_secs(30);
        let id = loop {
            let found = w
                .store
                .list_sessions(w.task.id)
                .await
                .unwrap()
                .into_iter()
                .find(|x| x.worktree.path == path);
            if let Some(found) = found {
                break found.id;
            }
            assert!(
                Instant::now() < deadline,
                "create cut after {polls} polls (answered: {}): no session stored",
                answered.is_some()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        w.track(id).await;
        w.wait_state(&mgr, id, SessionState::WaitingForInput).await;
        let text = format!("hello {polls}");
        mgr.send_message(w.task.id, id, &text).await.unwrap();
        wait_replied(&w, &mgr, id, &text, &name).await;
        sessions.push(id);
    }
    w.finish(&mgr, &sessions).await;
}
