//! Defaults taken from the machine: how much memory tollgate may plan for.

/// Bytes one memory-store key may take, with the hash table's slack and
/// growth (32-byte entries in a table between 7/16 and 7/8 full).
const BYTES_PER_KEY: u64 = 80;

/// Fewest and most keys the default allows.
const DEFAULT_MIN: u64 = 100_000;
const DEFAULT_MAX: u64 = 50_000_000;

/// The default `[store] max_keys`: an eighth of the memory this process may
/// use (the cgroup limit if one is set, else the machine's RAM) at
/// [`BYTES_PER_KEY`] a key, between 100 000 and 50 million keys; 1 million
/// when neither can be read.
pub fn default_max_keys() -> usize {
    let budget = match memory_bytes() {
        Some(bytes) => (bytes / 8 / BYTES_PER_KEY).clamp(DEFAULT_MIN, DEFAULT_MAX),
        None => 1_000_000,
    };
    usize::try_from(budget).unwrap_or(usize::MAX)
}

/// The smaller of the cgroup v2 memory limit and `MemTotal`.
fn memory_bytes() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| s.trim().parse::<u64>().ok());
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kib.checked_mul(1024)
    });
    match (cgroup, total) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
