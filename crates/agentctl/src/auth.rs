//! Bearer-secret authentication of every call, and the idle clock it feeds.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tonic::{Request, Status};

use crate::fence::EpochFence;

/// The executor's shared secret. Its `Debug` never shows the value.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    /// Wraps a secret; `None` when it is empty.
    pub fn new(value: &str) -> Option<Self> {
        let value = value.trim_end_matches(['\r', '\n']);
        if value.is_empty() {
            None
        } else {
            Some(Self(Arc::from(value.as_bytes())))
        }
    }

    /// Compares in time that depends only on the lengths, not on where the
    /// first differing byte is.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let a = &self.0;
        let mut diff = a.len() ^ candidate.len();
        for i in 0..a.len().max(candidate.len()) {
            let x = a.get(i).copied().unwrap_or(0);
            let y = candidate.get(i).copied().unwrap_or(0);
            diff |= usize::from(x ^ y);
        }
        diff == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// When the backend last made an authenticated call, and how many update
/// streams it holds open; an open stream counts as contact.
#[derive(Debug)]
pub struct Activity {
    last: std::sync::Mutex<Instant>,
    open_streams: AtomicUsize,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            last: std::sync::Mutex::new(Instant::now()),
            open_streams: AtomicUsize::new(0),
        }
    }
}

impl Activity {
    /// Records contact now.
    pub fn touch(&self) {
        *self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// How long since the last contact; zero while a stream is open.
    pub fn idle_for(&self) -> Duration {
        if self.open_streams.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed()
    }

    /// Marks a stream open until the guard drops.
    pub fn stream_guard(self: &Arc<Self>) -> StreamGuard {
        self.open_streams.fetch_add(1, Ordering::SeqCst);
        StreamGuard(self.clone())
    }
}

/// Keeps one update stream counted as open.
#[derive(Debug)]
pub struct StreamGuard(Arc<Activity>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.open_streams.fetch_sub(1, Ordering::SeqCst);
        self.0.touch();
    }
}

/// A tonic interceptor accepting only `authorization: Bearer <secret>`,
/// then only a lease epoch no older than the newest seen ([`EpochFence`]).
#[derive(Debug, Clone)]
pub struct Authenticator {
    secret: Secret,
    activity: Arc<Activity>,
    fence: Arc<EpochFence>,
}

impl Authenticator {
    /// Checks calls against `secret` and `fence`, and records accepted ones
    /// in `activity`.
    pub fn new(secret: Secret, activity: Arc<Activity>, fence: Arc<EpochFence>) -> Self {
        Self {
            secret,
            activity,
            fence,
        }
    }

    /// Accepts the request or answers UNAUTHENTICATED.
    #[allow(clippy::result_large_err)]
    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(value) = req.metadata().get("authorization") else {
            return Err(Status::unauthenticated(
                "missing `authorization: Bearer <secret>` metadata",
            ));
        };
        let bytes = value.as_bytes();
        let token = match bytes.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => &bytes[7..],
            _ => {
                return Err(Status::unauthenticated(
                    "authorization must use the Bearer scheme",
                ));
            }
        };
        if !self.secret.matches(token) {
            return Err(Status::unauthenticated("invalid executor secret"));
        }
        // Every call, reads included: a stale replica gets nothing to act on.
        self.fence.admit_metadata(req.metadata())?;
        self.activity.touch();
        Ok(req)
    }
}

impl tonic::service::Interceptor for Authenticator {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        self.check(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_compare() {
        let s = Secret::new("abc\n").expect("non-empty");
        assert!(s.matches(b"abc"));
        assert!(!s.matches(b"abd"));
        assert!(!s.matches(b"ab"));
        assert!(!s.matches(b"abcd"));
        assert!(Secret::new("\n").is_none());
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    }
}
