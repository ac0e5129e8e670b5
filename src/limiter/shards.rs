//! The one sharded map of the crate: a fixed set of mutexes, each around
//! its own part of the state, a key's part chosen by its hash. Requests for
//! different keys then rarely wait on one another, and no operation ever
//! locks the whole. The memory store's counters, the Redis store's leases
//! and over-limit cache, the verified-token cache and the `/top` sketches
//! all use it.
//!
//! The mutexes are `parking_lot`'s, as every lock of the crate (clippy.toml
//! bans `std::sync::Mutex` and `RwLock`):
//! - They block rather than yield: a shard is held for a few hash-map
//!   operations and never across an `.await`, so a blocking lock costs less
//!   than an async one (as mini-redis's `db.rs` argues).
//! - They have no poisoning. A panic while a shard is locked leaves it as the
//!   panicking code left it, and every user writes its entries whole (`Copy`
//!   values assigned at once, or an insert or a removal), so a later lock
//!   finds each entry either before or after the write. With std's mutex
//!   each of the 30-odd call sites recovered the poisoned guard by hand.
//! - Locking and unlocking are one compare-and-swap each, without std's
//!   check of the panic count on both: the memory store locks a shard on
//!   every request.

use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

/// `count` shards of `T`. A clone is another handle on the same shards
/// (the memory store's concurrency slots give theirs back through one).
pub struct Shards<T> {
    shards: Arc<[Mutex<T>]>,
    /// Seeded at random per process, so a client cannot choose keys that
    /// all land in one shard.
    hasher: foldhash::quality::RandomState,
}

impl<T> Clone for Shards<T> {
    fn clone(&self) -> Self {
        Shards { shards: self.shards.clone(), hasher: self.hasher.clone() }
    }
}

impl<T> Shards<T> {
    /// `count` shards (at least one), each made by `make`.
    pub fn new(count: usize, make: impl FnMut() -> T) -> Shards<T> {
        let mut make = make;
        Shards {
            shards: (0..count.max(1)).map(|_| Mutex::new(make())).collect(),
            hasher: foldhash::quality::RandomState::default(),
        }
    }

    /// How many shards there are.
    pub fn count(&self) -> usize {
        self.shards.len()
    }

    /// The 64-bit hash of `key` that [`Shards::lock_hash`] takes: for users
    /// that keep the hash (the memory store's map key is this hash).
    pub fn hash<K: Hash + ?Sized>(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of a [`Shards::hash`]. From bits 16 to 47: not the low bits
    /// (a hash map's bucket index) nor the top seven (hashbrown's control
    /// tag), or the keys of one shard, keyed by that same hash, would crowd
    /// together in their map. Multiplied down to the shard count rather
    /// than taken modulo it: no division, and any count works.
    pub fn index(&self, hash: u64) -> usize {
        let bits = u64::from((hash >> 16) as u32);
        ((bits * self.shards.len() as u64) >> 32) as usize
    }

    /// Locks shard `i` (`i < count`).
    pub fn lock(&self, i: usize) -> MutexGuard<'_, T> {
        self.shards[i].lock()
    }

    /// Locks shard `i` if no one holds it.
    pub fn try_lock(&self, i: usize) -> Option<MutexGuard<'_, T>> {
        self.shards[i].try_lock()
    }

    /// Locks the shard of a [`Shards::hash`].
    pub fn lock_hash(&self, hash: u64) -> MutexGuard<'_, T> {
        self.lock(self.index(hash))
    }

    /// Locks `key`'s shard.
    pub fn lock_key<K: Hash + ?Sized>(&self, key: &K) -> MutexGuard<'_, T> {
        self.lock_hash(self.hash(key))
    }

    /// Every shard in turn, each locked only while the caller holds its
    /// guard: a sweep never holds more than one.
    pub fn each(&self) -> impl Iterator<Item = MutexGuard<'_, T>> {
        self.shards.iter().map(|s| s.lock())
    }

    /// The sum of `f` over the shards, one locked at a time.
    pub fn sum(&self, f: impl Fn(&T) -> usize) -> usize {
        self.each().map(|s| f(&s)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_hash_has_a_shard_and_all_are_used() {
        for count in [1, 3, 8, 16, 64] {
            let shards = Shards::new(count, || 0u32);
            for i in 0..10_000u32 {
                *shards.lock_key(&i) += 1;
            }
            assert_eq!(shards.sum(|n| *n as usize), 10_000);
            assert!(shards.each().all(|n| *n > 0), "{count} shards: one got no key");
        }
        let shards = Shards::new(7, || ());
        assert_eq!(shards.index(u64::MAX), 6);
        assert_eq!(shards.index(0), 0);
    }

    #[test]
    fn a_held_shard_is_not_taken_twice() {
        let shards = Shards::new(2, Vec::<u8>::new);
        let held = shards.lock(1);
        assert!(shards.try_lock(1).is_none());
        assert!(shards.try_lock(0).is_some());
        drop(held);
        assert!(shards.try_lock(1).is_some());
        assert_eq!(Shards::new(0, || ()).count(), 1);
    }
}
