//! The penalty box of the memory store: keys refused by a rule until a
//! moment, whatever the rule's counters say. A key enters it when a rule
//! with `penalty` refuses it (the `penalty_after`-th time in one window),
//! or when an operator blocks it through the admin API (`POST /blocks`);
//! it leaves when its time is up, or when the block is lifted.
//!
//! The Redis store keeps the same entries in Redis, in the buckets
//! themselves (see `redis::blocks` and `src/store/lua/box.lua`); this one
//! is this process's own.
//!
//! The request path pays for the box only when it holds something: one
//! atomic load says it is empty, which it is for a rule set without
//! `penalty` and without blocks. Keys are chosen by clients, so the box
//! is bounded: penalties stop entering (the key is refused by its counters
//! alone) when it holds `capacity` live entries; blocks always enter.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::limiter::shards::Shards;
use crate::limiter::{Boxed, Nanos, Penalty, Verdict};

const SHARDS: usize = 16;

/// Why a key is in the box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A rule's `penalty`.
    Penalty,
    /// `POST /blocks`, with the operator's reason.
    Api(String),
}

impl Source {
    /// As `GET /blocks` names it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::Penalty => "penalty",
            Source::Api(_) => "api",
        }
    }

    /// The operator's reason of a block; a penalty's is always the same.
    pub fn reason(&self) -> &str {
        match self {
            Source::Penalty => "over the limit",
            Source::Api(r) => r,
        }
    }
}

/// One key in the box: refused until `until` (store time, nanoseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub until: Nanos,
    pub source: Source,
}

/// A key's entry as listed: the bucket key, how long it has left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub left: Nanos,
    pub source: Source,
}

#[derive(Default)]
struct Shard {
    boxed: HashMap<String, Entry>,
    /// Refusals of keys whose rule waits for several (`penalty_after`):
    /// when the first of the current window was, and how many since.
    strikes: HashMap<String, (Nanos, u32)>,
}

/// The keys in the box, by bucket key (a bucket key starts with its
/// rule's name, so a key is boxed for its rule only). A clone is another
/// handle on the same box.
#[derive(Clone)]
pub struct PenaltyBox {
    shards: Shards<Shard>,
    /// Entries and strikes held, expired or not: 0 lets the request path
    /// skip the box.
    held: Arc<AtomicUsize>,
    capacity: usize,
}

impl PenaltyBox {
    /// An empty box taking at most `capacity` penalties.
    pub fn new(capacity: usize) -> PenaltyBox {
        PenaltyBox { shards: Shards::new(SHARDS, Shard::default), held: Arc::new(AtomicUsize::new(0)), capacity }
    }

    /// Whether the box may hold something: the one question the request
    /// path asks of an empty box.
    #[inline]
    pub fn is_active(&self) -> bool {
        self.held.load(Ordering::Relaxed) > 0
    }

    /// The refusal of `key` if it is in the box at `now`.
    pub fn verdict(&self, key: &str, now: Nanos) -> Option<Verdict> {
        let shard = self.shards.lock_key(key);
        let entry = shard.boxed.get(key).filter(|e| e.until > now)?;
        Some(refusal(entry.until - now, Boxed::In))
    }

    /// A refusal of `key` by a rule with `penalty` at `now`, counted:
    /// answers `verdict` as the penalty box answers it when this refusal
    /// puts the key there (the `after`-th within `window`), else as it
    /// was.
    pub fn strike(&self, key: &str, penalty: Penalty, window: Nanos, verdict: Verdict, now: Nanos) -> Verdict {
        let mut shard = self.shards.lock_key(key);
        if penalty.after > 1 {
            let count = match shard.strikes.get_mut(key) {
                Some(s) if now.saturating_sub(s.0) < window => {
                    s.1 += 1;
                    s.1
                }
                Some(s) => {
                    *s = (now, 1);
                    1
                }
                None if self.live() >= self.capacity => return verdict,
                None => {
                    self.held.fetch_add(1, Ordering::Relaxed);
                    shard.strikes.insert(key.to_string(), (now, 1));
                    1
                }
            };
            if count < penalty.after {
                return verdict;
            }
            shard.strikes.remove(key);
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        let entry = Entry { until: now.saturating_add(penalty.duration), source: Source::Penalty };
        if !shard.boxed.contains_key(key) {
            if self.live() >= self.capacity {
                return verdict;
            }
            self.held.fetch_add(1, Ordering::Relaxed);
        }
        shard.boxed.insert(key.to_string(), entry);
        Verdict { reset_after: verdict.reset_after.max(penalty.duration), ..refusal(penalty.duration, Boxed::Entered) }
    }

    /// Puts `key` in the box until `until`, whatever it held.
    pub fn block(&self, key: &str, until: Nanos, source: Source) {
        let mut shard = self.shards.lock_key(key);
        if shard.boxed.insert(key.to_string(), Entry { until, source }).is_none() {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes `key` out of the box (its strikes too); whether it was in at
    /// `now`.
    pub fn lift(&self, key: &str, now: Nanos) -> bool {
        let mut shard = self.shards.lock_key(key);
        if shard.strikes.remove(key).is_some() {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        match shard.boxed.remove(key) {
            Some(e) => {
                self.held.fetch_sub(1, Ordering::Relaxed);
                e.until > now
            }
            None => false,
        }
    }

    /// The keys in the box at `now` whose bucket key starts with `prefix`
    /// (a rule's), at most `max` of them, those with the most time left
    /// first; and how many there were in all.
    pub fn list(&self, prefix: &str, now: Nanos, max: usize) -> (Vec<Listed>, usize) {
        let mut all: Vec<Listed> = Vec::new();
        for shard in self.shards.each() {
            let live = shard.boxed.iter().filter(|(k, e)| e.until > now && k.starts_with(prefix));
            all.extend(live.map(|(k, e)| Listed { key: k.clone(), left: e.until - now, source: e.source.clone() }));
        }
        let total = all.len();
        all.sort_unstable_by(|a, b| b.left.cmp(&a.left).then_with(|| a.key.cmp(&b.key)));
        all.truncate(max);
        (all, total)
    }

    /// Drops the entries whose time is up and the strikes of windows
    /// gone by `now` (strikes older than a day, whatever their window).
    pub fn sweep(&self, now: Nanos) {
        const DAY: Nanos = 86_400 * crate::limiter::NANOS_PER_SEC;
        for mut shard in self.shards.each() {
            let before = shard.boxed.len() + shard.strikes.len();
            shard.boxed.retain(|_, e| e.until > now);
            shard.strikes.retain(|_, s| now.saturating_sub(s.0) < DAY);
            self.held.fetch_sub(before - shard.boxed.len() - shard.strikes.len(), Ordering::Relaxed);
        }
    }

    /// Entries and strikes held, past their time or not: penalties enter
    /// only while this is under the capacity.
    fn live(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

/// A refusal by the box with `left` nanoseconds to go: `Retry-After` and
/// `X-RateLimit-Reset` say when it ends.
pub fn refusal(left: Nanos, boxed: Boxed) -> Verdict {
    Verdict { allowed: false, remaining: 0, reset_after: left, retry_after: left, delay: 0, fallback: false, boxed }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::NANOS_PER_SEC as S;

    fn refused() -> Verdict {
        Verdict { allowed: false, retry_after: S, reset_after: S, ..Verdict::default() }
    }

    #[test]
    fn an_empty_box_is_inactive_and_a_penalty_refuses_until_it_ends() {
        let b = PenaltyBox::new(100);
        assert!(!b.is_active());
        let p = Penalty { duration: 60 * S, after: 1 };
        let v = b.strike("r|ip=1", p, S, refused(), 1_000 * S);
        assert_eq!((v.allowed, v.retry_after, v.boxed), (false, 60 * S, Boxed::Entered));
        assert!(b.is_active());
        let v = b.verdict("r|ip=1", 1_045 * S).expect("boxed");
        assert_eq!((v.retry_after, v.reset_after, v.boxed), (15 * S, 15 * S, Boxed::In));
        assert!(b.verdict("r|ip=2", 1_045 * S).is_none(), "another key");
        assert!(b.verdict("r|ip=1", 1_060 * S).is_none(), "time is up");
        b.sweep(1_060 * S);
        assert!(!b.is_active());
    }

    #[test]
    fn penalty_after_counts_refusals_within_one_window() {
        let b = PenaltyBox::new(100);
        let p = Penalty { duration: 60 * S, after: 3 };
        let w = 10 * S;
        assert_eq!(b.strike("k", p, w, refused(), 0).boxed, Boxed::No);
        assert_eq!(b.strike("k", p, w, refused(), S).boxed, Boxed::No);
        // A new window: the count starts again.
        assert_eq!(b.strike("k", p, w, refused(), 11 * S).boxed, Boxed::No);
        assert_eq!(b.strike("k", p, w, refused(), 12 * S).boxed, Boxed::No);
        assert_eq!(b.strike("k", p, w, refused(), 13 * S).boxed, Boxed::Entered);
        assert!(b.verdict("k", 14 * S).is_some());
    }

    #[test]
    fn blocks_enter_a_full_box_and_lift_and_list() {
        let b = PenaltyBox::new(1);
        let p = Penalty { duration: 60 * S, after: 1 };
        assert_eq!(b.strike("a|ip=1", p, S, refused(), 0).boxed, Boxed::Entered);
        assert_eq!(b.strike("a|ip=2", p, S, refused(), 0).boxed, Boxed::No, "full: refused by the counters alone");
        b.block("a|ip=3", 3_600 * S, Source::Api("abuse".into()));
        b.block("b|ip=3", 3_600 * S, Source::Api("other rule".into()));
        let (listed, total) = b.list("a|", 10 * S, 10);
        assert_eq!(total, 2);
        assert_eq!(listed[0].key, "a|ip=3");
        assert_eq!(listed[0].source.reason(), "abuse");
        assert_eq!(listed[1].source, Source::Penalty);
        assert_eq!(b.list("a|", 10 * S, 1).0.len(), 1);
        assert!(b.lift("a|ip=3", 10 * S));
        assert!(!b.lift("a|ip=3", 10 * S));
        assert!(b.verdict("a|ip=3", 10 * S).is_none());
        assert!(b.verdict("b|ip=3", 10 * S).is_some());
    }
}
