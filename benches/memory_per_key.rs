//! Bytes per tracked key in the memory store, per algorithm: inserts
//! 1,000,000 distinct keys and reads the process's resident memory before
//! and after (Linux `/proc/self/status`).
//!
//! `cargo bench --bench memory_per_key` (release build). The figures go in
//! docs/benchmarks.md. Not a timing benchmark: it reports memory only.

use std::sync::Arc;

use tollgate::limiter::clock::ManualClock;
use tollgate::limiter::{Algorithm, Limits, NANOS_PER_SEC};
use tollgate::store::{Check, MemoryStore, Mode};

const KEYS: usize = 1_000_000;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowCounter,
    Algorithm::SlidingWindowLog,
];

/// Each algorithm is measured in a fresh process (this program run again
/// with `TOLLGATE_MEM_ALG` set): memory freed by one measurement and kept by
/// the allocator would otherwise make the next look cheaper than it is.
fn main() {
    if let Ok(name) = std::env::var("TOLLGATE_MEM_ALG") {
        if let Some(a) = ALGORITHMS.into_iter().find(|a| a.as_str() == name) {
            measure(a);
        }
        return;
    }
    println!("{:<24} {:>12} {:>14}", "algorithm", "RSS (MB)", "bytes per key");
    let me = std::env::current_exe().expect("own path");
    for algorithm in ALGORITHMS {
        let out = std::process::Command::new(&me).env("TOLLGATE_MEM_ALG", algorithm.as_str()).output().expect("runs");
        print!("{}", String::from_utf8_lossy(&out.stdout));
    }
}

fn measure(algorithm: Algorithm) {
    {
        let clock = ManualClock::new(1_800_000_000 * NANOS_PER_SEC);
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let limits = Limits { algorithm, limit: 100, window: 60 * NANOS_PER_SEC, burst: 100, origin: 0 };
        let before = rss_bytes();
        let mut key = String::with_capacity(48);
        for i in 0..KEYS {
            key.clear();
            use std::fmt::Write as _;
            let _ = write!(key, "per-user|user=user-{i}");
            let check = Check {
                key: &key,
                limits,
                cost: 1,
                enforced: true,
                on_error: tollgate::config::OnError::Allow,
                settles: false,
                penalty: None,
            };
            store.check_now(std::slice::from_ref(&check), Mode::Consume);
        }
        let after = rss_bytes();
        assert_eq!(store.len(), KEYS);
        let per_key = (after.saturating_sub(before)) as f64 / KEYS as f64;
        println!("{:<24} {:>12.1} {:>14.1}", algorithm.as_str(), (after - before) as f64 / 1e6, per_key);
        drop(store);
    }
}
