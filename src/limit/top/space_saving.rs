//! Space-Saving (Metwally, Agrawal and El Abbadi, "Efficient computation of
//! frequent and top-k elements in data streams", 2005): the heaviest keys of
//! a stream in `capacity` slots, whatever the number of distinct keys.
//!
//! A key already held is counted in its slot. A new key takes a free slot,
//! or, once all are taken, the slot of the least counted key, inheriting
//! that count as the most it may overestimate by. Hence, for every key held,
//! `count - error <= true count <= count`; a key not held was seen at most
//! [`SpaceSaving::floor`] times; and every key seen more than
//! `total / capacity` times is held.
//!
//! The least counted slot is the root of a binary min-heap, so a new key
//! costs a hash lookup and O(log capacity) swaps; a key already held costs
//! a lookup and usually no swap at all. Memory is allocated once, at the
//! first key, for `capacity` slots; key buffers are reused when a slot
//! changes hands.

use std::hash::BuildHasher;

use hashbrown::HashTable;

/// The sketch of one stream of keys.
pub struct SpaceSaving {
    capacity: usize,
    /// Every key recorded since the last [`SpaceSaving::clear`].
    total: u64,
    slots: Vec<Slot>,
    /// Slot numbers as a binary min-heap on their count.
    heap: Vec<u32>,
    /// Slot numbers by the hash of their key: one copy of each key, in its
    /// slot.
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
}

struct Slot {
    key: String,
    hash: u64,
    count: u64,
    /// How much `count` may exceed the key's true count.
    error: u64,
    /// Where the slot is in the heap.
    at: u32,
}

/// Most slots a sketch may have: heap positions are `u32`, and
/// `[admin] top_keys` is validated far below this.
pub const MAX_CAPACITY: usize = 1 << 20;

impl SpaceSaving {
    /// An empty sketch of `capacity` slots (at least 1); nothing is
    /// allocated until the first key.
    pub fn new(capacity: usize) -> SpaceSaving {
        SpaceSaving::with_hasher(capacity, foldhash::fast::RandomState::default())
    }

    /// [`SpaceSaving::new`] hashing keys with `hasher`: sketches sharing
    /// one take a key's [`SpaceSaving::hash`] computed once.
    pub fn with_hasher(capacity: usize, hasher: foldhash::fast::RandomState) -> SpaceSaving {
        SpaceSaving {
            capacity: capacity.clamp(1, MAX_CAPACITY),
            total: 0,
            slots: Vec::new(),
            heap: Vec::new(),
            index: HashTable::new(),
            hasher,
        }
    }

    /// The hash [`SpaceSaving::record_hashed`] takes.
    pub fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Counts one occurrence of `key`.
    pub fn record(&mut self, key: &str) {
        self.record_hashed(key, self.hash(key));
    }

    /// Counts one occurrence of `key`, whose [`SpaceSaving::hash`] (by
    /// this sketch or one with the same hasher) is `hash`.
    pub fn record_hashed(&mut self, key: &str, hash: u64) {
        self.total += 1;
        let slots = &self.slots;
        if let Some(&s) = self.index.find(hash, |&s| slots[s as usize].key == key) {
            let slot = &mut self.slots[s as usize];
            slot.count += 1;
            let at = slot.at as usize;
            self.sift_down(at);
            return;
        }
        if self.slots.len() < self.capacity {
            if self.slots.capacity() == 0 {
                // Exactly `capacity`, once: growth by doubling would leave
                // up to twice the configured memory.
                self.slots.reserve_exact(self.capacity);
                self.heap.reserve_exact(self.capacity);
                self.index.reserve(self.capacity, |_| 0);
            }
            // `capacity <= MAX_CAPACITY`: both fit in a u32.
            let s = self.slots.len() as u32;
            let at = self.heap.len();
            self.slots.push(Slot { key: key.to_owned(), hash, count: 1, error: 0, at: at as u32 });
            self.heap.push(s);
            let slots = &self.slots;
            self.index.insert_unique(hash, s, |&x| slots[x as usize].hash);
            self.sift_up(at);
            return;
        }
        // Full: the key takes over the least counted slot.
        let s = self.heap[0];
        let old_hash = self.slots[s as usize].hash;
        if let Ok(entry) = self.index.find_entry(old_hash, |&x| x == s) {
            entry.remove();
        }
        let slot = &mut self.slots[s as usize];
        slot.error = slot.count;
        slot.count += 1;
        slot.key.clear();
        slot.key.push_str(key);
        slot.hash = hash;
        let slots = &self.slots;
        self.index.insert_unique(hash, s, |&x| slots[x as usize].hash);
        self.sift_down(0);
    }

    /// Forgets every key, keeping the memory for the next ones.
    pub fn clear(&mut self) {
        self.total = 0;
        self.slots.clear();
        self.heap.clear();
        self.index.clear();
    }

    /// How many keys were recorded.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The most times a key not held may have been seen: the least count
    /// once every slot is taken, 0 before.
    pub fn floor(&self) -> u64 {
        if self.slots.len() < self.capacity {
            0
        } else {
            self.heap.first().map_or(0, |&s| self.slots[s as usize].count)
        }
    }

    /// Every key held, with its count and the most that count may exceed
    /// the true one by; in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, u64, u64)> {
        self.slots.iter().map(|s| (s.key.as_str(), s.count, s.error))
    }

    /// The heap memory the sketch holds, in bytes.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.slots.iter().map(|s| s.key.capacity()).sum::<usize>()
            + self.heap.capacity() * std::mem::size_of::<u32>()
            + self.index.allocation_size()
    }

    fn count_at(&self, at: usize) -> u64 {
        self.slots[self.heap[at] as usize].count
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.slots[self.heap[a] as usize].at = a as u32;
        self.slots[self.heap[b] as usize].at = b as u32;
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.count_at(parent) <= self.count_at(at) {
                break;
            }
            self.swap(parent, at);
            at = parent;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        let len = self.heap.len();
        loop {
            let (left, right) = (2 * at + 1, 2 * at + 2);
            let mut least = at;
            if left < len && self.count_at(left) < self.count_at(least) {
                least = left;
            }
            if right < len && self.count_at(right) < self.count_at(least) {
                least = right;
            }
            if least == at {
                return;
            }
            self.swap(at, least);
            at = least;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A deterministic stream: a few heavy keys among many light ones.
    fn zipf_like(n: usize) -> Vec<String> {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // One key in two is one of 8 heavy keys (weighted 1/2^i).
                if x.is_multiple_of(2) {
                    format!("heavy-{}", (x >> 8).trailing_zeros().min(7))
                } else {
                    format!("light-{}", x % 50_000)
                }
            })
            .collect()
    }

    #[test]
    fn holds_every_key_while_it_has_room_and_counts_exactly() {
        let mut s = SpaceSaving::new(8);
        for k in ["a", "b", "a", "c", "a", "b"] {
            s.record(k);
        }
        let mut e: Vec<_> = s.entries().map(|(k, c, err)| (k.to_string(), c, err)).collect();
        e.sort();
        assert_eq!(e, [("a".into(), 3, 0), ("b".into(), 2, 0), ("c".into(), 1, 0)]);
        assert_eq!((s.total(), s.floor()), (6, 0));
    }

    #[test]
    fn the_bounds_hold_and_every_heavy_key_is_held() {
        let stream = zipf_like(200_000);
        let mut truth: HashMap<&str, u64> = HashMap::new();
        let mut s = SpaceSaving::new(64);
        for k in &stream {
            *truth.entry(k).or_default() += 1;
            s.record(k);
        }
        let n = stream.len() as u64;
        assert_eq!(s.total(), n);
        assert!(s.floor() <= n / 64, "floor {} over N/k {}", s.floor(), n / 64);
        for (key, count, error) in s.entries() {
            let t = truth[key];
            assert!(count - error <= t && t <= count, "{key}: true {t} outside [{}, {count}]", count - error);
            assert!(error <= s.floor());
        }
        let held: Vec<&str> = s.entries().map(|(k, _, _)| k).collect();
        for (key, t) in &truth {
            if *t > n / 64 {
                assert!(held.contains(key), "{key} seen {t} times (> N/k = {}) is not held", n / 64);
            } else if !held.contains(key) {
                assert!(*t <= s.floor(), "{key} seen {t} times, over the floor {}", s.floor());
            }
        }
        assert!(held.contains(&"heavy-0") && held.contains(&"heavy-3"));
    }

    #[test]
    fn memory_stays_fixed_under_a_million_distinct_keys() {
        let mut s = SpaceSaving::new(64);
        let mut key = String::new();
        let mut record_range = |s: &mut SpaceSaving, range: std::ops::Range<u32>| {
            for i in range {
                key.clear();
                key.push_str("per-ip|ip=10.");
                key.push_str(&i.to_string());
                s.record(&key);
            }
        };
        record_range(&mut s, 0..1_000);
        let after_a_thousand = s.heap_bytes();
        record_range(&mut s, 1_000..1_000_000);
        assert_eq!(s.entries().count(), 64);
        assert_eq!(s.total(), 1_000_000);
        // Key buffers may grow to the longest key, nothing else moves.
        assert!(s.heap_bytes() <= after_a_thousand + 64 * 32, "{} > {after_a_thousand}", s.heap_bytes());
        assert!(s.heap_bytes() < 16 * 1024, "{} bytes for 64 slots", s.heap_bytes());
    }

    #[test]
    fn clear_forgets_and_keeps_counting() {
        let mut s = SpaceSaving::new(2);
        for k in ["a", "b", "c", "c"] {
            s.record(k);
        }
        s.clear();
        assert_eq!((s.total(), s.floor(), s.entries().count()), (0, 0, 0));
        s.record("d");
        assert_eq!(s.entries().collect::<Vec<_>>(), [("d", 1, 0)]);
    }
}
