//! Ids distinct across every instance: request ids (the members of
//! sliding-log entries and concurrency slots) and undo ids (calls that
//! take back, applied once).

use std::sync::atomic::{AtomicU64, Ordering};

/// Unique ids for sliding-log entries and concurrency slots: a random
/// per-process prefix of 64 bits and a counter, so no two requests of any
/// instance add the same member. With 32 bits, two instances among some
/// 77,000 (or restarts of one) would share a prefix by the birthday bound
/// with even odds, and merge their entries; at 64 bits that takes billions.
pub(super) struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub(super) fn new() -> RequestIds {
        RequestIds { prefix: random_u64(), next: AtomicU64::new(0) }
    }

    /// The prefix as 16 hex digits, then the counter.
    pub(super) fn next(&self) -> String {
        format!("{:016x}{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

/// Length of an undo id: 32 hex digits.
pub(super) const UNDO_ID: usize = 32;

/// A new undo id: this process's 64 random bits and a counter, both as 16
/// hex digits, so that no two calls of any instance share one.
pub(super) fn undo_id() -> [u8; UNDO_ID] {
    use std::sync::LazyLock;
    static PREFIX: LazyLock<u64> = LazyLock::new(random_u64);
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let text = format!("{:016x}{:016x}", *PREFIX, NEXT.fetch_add(1, Ordering::Relaxed));
    // Two u64 in 16 hex digits each: always 32 bytes.
    text.as_bytes().try_into().unwrap_or([b'0'; UNDO_ID])
}

/// 64 random bits: a hash under the keys the standard library draws from
/// the operating system for its hash maps (a fresh pair per `RandomState`),
/// of this process's id and the time.
pub(super) fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now.as_nanos()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_distinct() {
        let ids = RequestIds::new();
        let a = ids.next();
        let b = ids.next();
        assert_ne!(a, b);
        assert!(a.len() >= 17);
    }

    /// Every id of an instance starts with the same 16 hex digits, drawn
    /// at random per instance: all 64 bits vary between instances (a
    /// 32-bit prefix left the upper half of the first 16 digits to the
    /// counter, and the first ids of every instance ended alike).
    #[test]
    fn request_ids_carry_a_64_bit_random_prefix() {
        let prefix = |id: &str| u64::from_str_radix(id.get(..16).unwrap_or(id), 16).ok();
        let mut seen = std::collections::HashSet::new();
        let (mut high, mut low) = (0u64, 0u64);
        for _ in 0..64 {
            let ids = RequestIds::new();
            let (a, b) = (ids.next(), ids.next());
            assert!(a.len() >= 17 && b.len() >= 17, "{a} {b}");
            let p = prefix(&a).expect("16 hex digits");
            assert_eq!(prefix(&b), Some(p), "one prefix per instance: {a} {b}");
            assert!(seen.insert(p), "a prefix drawn twice: {p:016x}");
            high |= p >> 32;
            low |= p & 0xffff_ffff;
        }
        // 64 random draws leave no bit of either half always 0 (a chance
        // of 64 in 2^64).
        assert_eq!((high, low), (0xffff_ffff, 0xffff_ffff), "bits that never varied");
    }
}
