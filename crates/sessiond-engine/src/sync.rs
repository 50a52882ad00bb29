//! Locking a std mutex whose holder panicked: its data is taken as it is
//! (every critical section in this crate leaves it consistent at each step),
//! so one panicking task does not take the whole engine down with it.

use std::sync::{Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
