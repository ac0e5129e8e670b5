//! Which keys each rule sees most, and which it limits most: the admin
//! `/top` endpoint and `tollgate top`, without a Prometheus label per key.
//!
//! Every rule has two [`SpaceSaving`] sketches per half-minute period, one
//! fed every request the rule decides (`by=requests`), one the requests it
//! finds over its limit (`by=limited`, shadow rules included). A report
//! merges the current period with the one before, so it covers the last 30
//! to 60 seconds. Memory is fixed by `[admin] top_keys`: at most
//! `4 × top_keys × shards` keys per rule, whatever the traffic.
//!
//! The request path must not queue every worker behind one lock per rule,
//! so a rule's sketches are split into shards (one per CPU, at most
//! [`MAX_SHARDS`]): a worker counts in its own shard and, should that one
//! be busy, in the next free one, waiting only when all are. Nothing is
//! sampled or skipped. Shards are merged when a report is read, with the
//! error bounds of mergeable summaries (Agarwal et al., 2012): a key's
//! `count` never undercounts it, `count - error` never overcounts it, and
//! `error` stays within `total / top_keys`, as for a single sketch.
//!
//! Nor does the request path read the clock: it reads the period from an
//! atomic that [`TopKeys::tick`] advances every [`TICK`] (a clock read is
//! half of what counting a key costs). A request may thus count in the
//! period before its own for up to a second after the turn.
//!
//! Keys are the rules' bucket keys, as `tollgate explain` prints them: an
//! API key appears only as its SHA-256, never in clear (see
//! [`crate::limit::rules::Rule::key`]).

mod space_saving;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

pub use space_saving::SpaceSaving;

use crate::limiter::Nanos;
use crate::limiter::clock::SharedClock;
use crate::limiter::shards::Shards;

/// How long one period lasts: a report covers the current one and the one
/// before.
pub const PERIOD: Duration = Duration::from_secs(30);
const PERIOD_NANOS: Nanos = PERIOD.as_nanos() as Nanos;

/// How often the server calls [`TopKeys::tick`].
pub const TICK: Duration = Duration::from_secs(1);

/// Most shards per rule: past a handful, workers rarely meet on one anyway,
/// and each shard is memory.
pub const MAX_SHARDS: usize = 8;

/// Most `[admin] top_keys`, checked by the config.
pub use crate::config::MAX_TOP_KEYS;

/// What a report ranks keys by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// Requests the rule decided.
    Requests,
    /// Requests over the rule's limit (answered 429 by an enforced rule,
    /// or counted as `shadow_limited`).
    Limited,
}

impl By {
    pub fn parse(s: &str) -> Option<By> {
        match s {
            "requests" => Some(By::Requests),
            "limited" => Some(By::Limited),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            By::Requests => "requests",
            By::Limited => "limited",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Rules that each hold their sketches, by name: the rule set
/// ([`crate::limit::rules::RuleSet`]), which this module sits below and does not
/// name.
pub trait Sketched {
    /// Calls `f` with each rule's name and where its sketches go.
    fn each_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<Arc<RuleTop>>));

    /// [`each_sketch`](Self::each_sketch) for the rules that have no
    /// sketches yet (compiled anew).
    fn each_fresh_sketch(&mut self, f: &mut dyn FnMut(&str, &mut Option<Arc<RuleTop>>));
}

/// The sketches of every rule in force, kept across reloads by rule name.
pub struct TopKeys {
    capacity: usize,
    shards: usize,
    clock: SharedClock,
    /// The current period, as of the last [`TopKeys::tick`].
    period: AtomicU64,
    by_rule: Mutex<HashMap<String, Arc<RuleTop>, foldhash::fast::RandomState>>,
}

/// One rule's sketches.
pub struct RuleTop {
    shards: Shards<Shard>,
}

/// What one shard saw in the current period and the one before.
struct Shard {
    period: u64,
    /// Indexed by [`By::index`].
    current: [SpaceSaving; 2],
    previous: [SpaceSaving; 2],
}

/// One sketch as read for a report.
struct Summary {
    entries: Vec<(String, u64, u64)>,
    floor: u64,
    total: u64,
}

/// A report: the heaviest keys of one rule.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    pub keys: Vec<TopKey>,
    /// Everything counted in the window (requests or limited requests).
    pub total: u64,
    /// How far back the window reaches.
    pub window: Duration,
}

/// One key of a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopKey {
    pub key: String,
    /// At least the key's true count.
    pub count: u64,
    /// How much `count` may exceed the true count.
    pub error: u64,
}

impl TopKeys {
    /// The sketches for `[admin] top_keys = capacity`; `None` (nothing
    /// counted, nothing allocated) when it is 0.
    pub fn new(capacity: usize, clock: SharedClock) -> Option<TopKeys> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        TopKeys::with_shards(capacity, cpus.min(MAX_SHARDS), clock)
    }

    /// [`TopKeys::new`] with a given number of shards per rule.
    pub fn with_shards(capacity: usize, shards: usize, clock: SharedClock) -> Option<TopKeys> {
        (capacity > 0).then(|| TopKeys {
            capacity: capacity.min(MAX_TOP_KEYS),
            shards: shards.clamp(1, MAX_SHARDS),
            period: AtomicU64::new(clock.now() / PERIOD_NANOS),
            clock,
            by_rule: Mutex::new(HashMap::default()),
        })
    }

    /// Keys per sketch: the most a report can show.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The current period as of the last [`TopKeys::tick`], read once per
    /// request and passed to [`RuleTop::record`].
    pub fn period_now(&self) -> u64 {
        self.period.load(Ordering::Relaxed)
    }

    /// Brings [`TopKeys::period_now`] up to the clock; the server calls it
    /// every [`TICK`].
    pub fn tick(&self) {
        self.period.store(self.clock.now() / PERIOD_NANOS, Ordering::Relaxed);
    }

    /// Gives every rule of `set` its sketches: a rule kept by a reload
    /// keeps what it counted; the sketches of rules gone are dropped, so
    /// memory follows the rules in force.
    pub fn attach(&self, set: &mut impl Sketched) {
        let mut by_rule = self.by_rule.lock();
        let mut next = HashMap::with_capacity_and_hasher(by_rule.len(), Default::default());
        set.each_sketch(&mut |name, slot| {
            // A kept rule's entry moves over with its name, not a copy of it.
            let (name, top) = match by_rule.remove_entry(name) {
                Some(kept) => kept,
                None => match next.get(name) {
                    Some(top) => (name.to_string(), Arc::clone(top)),
                    None => (name.to_string(), Arc::new(RuleTop::new(self.capacity, self.shards))),
                },
            };
            *slot = Some(top.clone());
            next.insert(name, top);
        });
        *by_rule = next;
    }

    /// [`attach`](Self::attach) for a set whose rules have the names of the
    /// set in force, each at its place (a reload that edited rules and
    /// added, removed or renamed none): no entry goes, and only the rules
    /// compiled anew need their sketches, which their names hold (a kept
    /// rule has its own already).
    pub fn attach_fresh(&self, set: &mut impl Sketched) {
        let mut by_rule = self.by_rule.lock();
        set.each_fresh_sketch(&mut |name, slot| {
            let top = match by_rule.get(name) {
                Some(top) => Arc::clone(top),
                None => {
                    let top = Arc::new(RuleTop::new(self.capacity, self.shards));
                    by_rule.insert(name.to_string(), Arc::clone(&top));
                    top
                }
            };
            *slot = Some(top);
        });
    }

    /// The `n` heaviest keys of `top` by `by` over the last 30 to 60
    /// seconds, heaviest first.
    pub fn report(&self, top: &RuleTop, by: By, n: usize) -> Report {
        let now = self.clock.now();
        let period = now / PERIOD_NANOS;
        let parts = top.summaries(period, by);
        let window = Duration::from_nanos(now.saturating_sub(period.saturating_sub(1) * PERIOD_NANOS));
        Report { total: parts.iter().map(|p| p.total).sum(), keys: merge(&parts, n), window }
    }
}

impl RuleTop {
    fn new(capacity: usize, shards: usize) -> RuleTop {
        let shard = || {
            // One hasher for the shard's four sketches: a key is hashed
            // once, whether it is counted once or twice.
            let hasher = foldhash::fast::RandomState::default();
            let sketch = || SpaceSaving::with_hasher(capacity, hasher.clone());
            Shard { period: 0, current: [sketch(), sketch()], previous: [sketch(), sketch()] }
        };
        RuleTop { shards: Shards::new(shards, shard) }
    }

    /// Counts one request of `key` in `period` ([`TopKeys::period_now`]),
    /// and as limited when it was.
    pub fn record(&self, period: u64, key: &str, limited: bool) {
        let n = self.shards.count();
        let first = thread_slot() % n;
        for i in 0..n {
            if let Some(mut shard) = self.shards.try_lock((first + i) % n) {
                return shard.record(period, key, limited);
            }
        }
        // Every shard busy: wait for this thread's own rather than skip.
        self.shards.lock(first).record(period, key, limited);
    }

    /// Each shard's sketches by `by` that lie in `period` or the one
    /// before.
    fn summaries(&self, period: u64, by: By) -> Vec<Summary> {
        let mut out = Vec::with_capacity(2 * self.shards.count());
        for shard in self.shards.each() {
            let b = by.index();
            if shard.period >= period {
                out.push(Summary::of(&shard.current[b]));
                out.push(Summary::of(&shard.previous[b]));
            } else if shard.period + 1 == period {
                // Not written to since the period turned: its current
                // sketch is the previous period's.
                out.push(Summary::of(&shard.current[b]));
            }
        }
        out
    }
}

impl Shard {
    fn record(&mut self, period: u64, key: &str, limited: bool) {
        if period > self.period {
            if period == self.period + 1 {
                std::mem::swap(&mut self.current, &mut self.previous);
            } else {
                self.previous.iter_mut().for_each(SpaceSaving::clear);
            }
            self.current.iter_mut().for_each(SpaceSaving::clear);
            self.period = period;
        }
        // A clock stepped back counts in the current period.
        let requests = &mut self.current[By::Requests.index()];
        let hash = requests.hash(key);
        requests.record_hashed(key, hash);
        if limited {
            self.current[By::Limited.index()].record_hashed(key, hash);
        }
    }
}

impl Summary {
    fn of(sketch: &SpaceSaving) -> Summary {
        Summary {
            entries: sketch.entries().map(|(k, c, e)| (k.to_string(), c, e)).collect(),
            floor: sketch.floor(),
            total: sketch.total(),
        }
    }
}

/// The `n` heaviest keys of several sketches of disjoint streams. A key a
/// sketch does not hold may still have been seen up to that sketch's floor
/// times there: its upper bound takes the floor, its lower bound nothing.
fn merge(parts: &[Summary], n: usize) -> Vec<TopKey> {
    let floors: u64 = parts.iter().map(|p| p.floor).sum();
    // (upper, lower) bound of each key's count over all parts.
    let mut bounds: HashMap<&str, (u64, u64)> = HashMap::new();
    for part in parts {
        for (key, count, error) in &part.entries {
            let b = bounds.entry(key).or_insert((floors, 0));
            b.0 += count.saturating_sub(part.floor);
            b.1 += count.saturating_sub(*error);
        }
    }
    let mut keys: Vec<TopKey> = bounds
        .into_iter()
        .map(|(key, (upper, lower))| TopKey { key: key.to_string(), count: upper, error: upper - lower.min(upper) })
        .collect();
    keys.sort_unstable_by(|a, b| b.count.cmp(&a.count).then(a.error.cmp(&b.error)).then_with(|| a.key.cmp(&b.key)));
    keys.truncate(n);
    keys
}

/// This thread's preferred shard: tokio's workers are numbered as they
/// first count, so each gets its own while there are enough.
fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SLOT.with(|s| *s)
}

#[cfg(test)]
mod tests;
