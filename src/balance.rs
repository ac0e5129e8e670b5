//! Which server of an upstream a request goes to: `round_robin`,
//! `least_request` (the less busy of two servers picked at random) or
//! `hash` (rendezvous hashing: the same key goes to the same server, and
//! adding a server moves only the keys that now rank it first, about one
//! in the number of servers). Servers that [`crate::health`] has taken out
//! are skipped.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use http::HeaderMap;

use crate::config::{Balance, HashKey};

/// The choice among one upstream's servers.
pub struct Balancer {
    balance: Balance,
    /// Round robin's next turn.
    next: AtomicUsize,
    /// State of `least_request`'s random picks (xorshift): cheap, and good
    /// enough to spread choices.
    rng: AtomicU64,
    /// Per server, the seed that ranks it for a hash key.
    seeds: Box<[u64]>,
}

impl Balancer {
    /// The choice among servers whose configured addresses are `addresses`.
    pub fn new(balance: &Balance, addresses: &[&str]) -> Balancer {
        Balancer {
            balance: balance.clone(),
            next: AtomicUsize::new(0),
            rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            seeds: addresses.iter().map(|a| hash_bytes(a.as_bytes())).collect(),
        }
    }

    /// The key `hash` balancing hashes for a request; 0 for the others.
    pub fn key(&self, client_ip: IpAddr, headers: &HeaderMap) -> u64 {
        match &self.balance {
            Balance::Hash(HashKey::Ip) => match client_ip {
                IpAddr::V4(a) => hash_bytes(&a.octets()),
                IpAddr::V6(a) => hash_bytes(&a.octets()),
            },
            // A missing header hashes as empty.
            Balance::Hash(HashKey::Header(name)) => hash_bytes(headers.get(name).map_or(&[][..], |v| v.as_bytes())),
            _ => 0,
        }
    }

    /// The server for a request with hash `key`, among the `n` servers for
    /// which `up` holds, other than `skip` (the one that just failed it);
    /// `None` when there is none.
    pub fn pick(
        &self,
        n: usize,
        key: u64,
        skip: Option<usize>,
        up: impl Fn(usize) -> bool,
        load: impl Fn(usize) -> u64,
    ) -> Option<usize> {
        let usable = |i: usize| Some(i) != skip && up(i);
        match &self.balance {
            Balance::RoundRobin => {
                let start = self.next.fetch_add(1, Ordering::Relaxed);
                (0..n).map(|k| (start + k) % n).find(|&i| usable(i))
            }
            Balance::LeastRequest => {
                let r = self.random();
                let a = (r % n as u64) as usize;
                // A second, different server (when there is one).
                let b = if n > 1 { (a + 1 + ((r >> 32) % (n as u64 - 1)) as usize) % n } else { a };
                match (usable(a), usable(b)) {
                    (true, true) => Some(if load(b) < load(a) { b } else { a }),
                    (true, false) => Some(a),
                    (false, true) => Some(b),
                    // Both out: the least busy of the others.
                    (false, false) => (0..n).filter(|&i| usable(i)).min_by_key(|&i| load(i)),
                }
            }
            Balance::Hash(_) => (0..n).filter(|&i| usable(i)).max_by_key(|&i| rank(key, self.seeds[i])),
        }
    }

    fn random(&self) -> u64 {
        // Lost updates between threads only repeat a number: harmless here.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        x
    }
}

/// The rank of a server (its seed) for a key: the highest wins
/// (rendezvous hashing).
fn rank(key: u64, seed: u64) -> u64 {
    mix(key ^ seed)
}

/// FNV-1a, then mixed: stable across processes and versions, so every
/// tollgate instance sends a key to the same server.
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

/// splitmix64's finaliser: every input bit affects every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addresses(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("http://10.0.0.{}:8080", i + 1)).collect()
    }

    fn hashing(n: usize) -> Balancer {
        let a = addresses(n);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        Balancer::new(&Balance::Hash(HashKey::Ip), &refs)
    }

    fn pick_hash(b: &Balancer, n: usize, key: u64) -> usize {
        b.pick(n, key, None, |_| true, |_| 0).expect("a server is up")
    }

    #[test]
    fn hash_keeps_a_key_on_one_server_and_adding_a_server_moves_few_keys() {
        let (three, four) = (hashing(3), hashing(4));
        let keys: Vec<u64> = (0..10_000u32).map(|k| hash_bytes(&k.to_be_bytes())).collect();
        let mut moved = 0;
        let mut per_server = [0usize; 3];
        for &k in &keys {
            let before = pick_hash(&three, 3, k);
            assert_eq!(before, pick_hash(&three, 3, k), "the same key, the same server");
            per_server[before] += 1;
            let after = pick_hash(&four, 4, k);
            if after != before {
                // A key only ever moves to the new server.
                assert_eq!(after, 3);
                moved += 1;
            }
        }
        // About a quarter of the keys move to the fourth server; modulo
        // hashing would move three quarters.
        assert!((1500..3500).contains(&moved), "{moved} of 10000 keys moved");
        assert!(per_server.iter().all(|&c| c > 2500), "keys spread: {per_server:?}");
    }

    #[test]
    fn hash_sends_a_down_servers_keys_elsewhere_and_only_those() {
        let b = hashing(3);
        for k in 0..1000u64 {
            let key = mix(k);
            let first = pick_hash(&b, 3, key);
            let without = b.pick(3, key, None, |i| i != 1, |_| 0).expect("two are up");
            if first != 1 {
                assert_eq!(without, first);
            } else {
                assert_ne!(without, 1);
            }
        }
    }

    #[test]
    fn round_robin_takes_turns_and_skips_servers_that_are_out() {
        let a = addresses(3);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let b = Balancer::new(&Balance::RoundRobin, &refs);
        let picks: Vec<usize> = (0..6).filter_map(|_| b.pick(3, 0, None, |_| true, |_| 0)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        let picks: Vec<usize> = (0..4).filter_map(|_| b.pick(3, 0, None, |i| i != 1, |_| 0)).collect();
        assert!(!picks.contains(&1) && picks.len() == 4);
        assert_eq!(b.pick(3, 0, Some(0), |i| i == 0, |_| 0), None);
    }

    #[test]
    fn least_request_prefers_the_idle_server() {
        let a = addresses(2);
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let b = Balancer::new(&Balance::LeastRequest, &refs);
        for _ in 0..100 {
            assert_eq!(b.pick(2, 0, None, |_| true, |i| if i == 0 { 5 } else { 0 }), Some(1));
        }
    }
}
