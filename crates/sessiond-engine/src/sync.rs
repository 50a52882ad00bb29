//! Locking a std mutex whose holder panicked: its data is taken as it is
//! (every critical section in this crate leaves it consistent at each step),
//! so one panicking task does not take the whole engine down with it.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Mutex, MutexGuard},
};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Keys held by guards, each as many times as guards hold it: a key is
/// held from its first [`Holds::hold`] until its last guard is dropped.
#[derive(Debug)]
pub(crate) struct Holds<K>(Mutex<HashMap<K, usize>>);

impl<K> Default for Holds<K> {
    fn default() -> Self {
        Holds(Mutex::new(HashMap::new()))
    }
}

/// One hold of a key; let go when dropped.
pub(crate) struct Held<'a, K: Eq + Hash> {
    holds: &'a Holds<K>,
    key: K,
}

impl<K: Eq + Hash + Copy> Holds<K> {
    /// Holds `key` until the returned guard is dropped.
    pub(crate) fn hold(&self, key: K) -> Held<'_, K> {
        *lock(&self.0).entry(key).or_default() += 1;
        Held { holds: self, key }
    }

    /// Whether a guard holds `key` now.
    pub(crate) fn is_held(&self, key: K) -> bool {
        lock(&self.0).contains_key(&key)
    }
}

impl<K: Eq + Hash> Drop for Held<'_, K> {
    fn drop(&mut self) {
        let mut holds = lock(&self.holds.0);
        if let Some(n) = holds.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                holds.remove(&self.key);
            }
        }
    }
}
