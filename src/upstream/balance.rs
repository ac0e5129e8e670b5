//! Which server of an upstream a request goes to: `round_robin` (smooth
//! weighted round robin, nginx's: each server in proportion to its weight,
//! interleaved), `least_request` (the less busy, for its weight, of two
//! servers picked at random) or `hash` (weighted rendezvous hashing: the
//! same key goes to the same server, and adding a server moves only the
//! keys that now rank it first). A request without a key (its header is
//! missing) is balanced round robin.
//!
//! The caller says which servers are candidates ([`Balancer::pick`]'s
//! `usable`): health, backups, panic mode and per-server limits are
//! [`crate::upstream`]'s.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderMap;
use parking_lot::Mutex;

use crate::config::{Balance, HashKey, Server};

/// The choice among one upstream's servers.
pub struct Balancer {
    balance: Balance,
    weights: Box<[u32]>,
    /// Smooth weighted round robin's current weights, one per server.
    current: Mutex<Box<[i64]>>,
    /// State of `least_request`'s random picks (xorshift): cheap, and good
    /// enough to spread choices.
    rng: AtomicU64,
    /// Per server, the seed that ranks it for a hash key.
    seeds: Box<[u64]>,
    /// `hash_key = "ip"`: IPv6 clients hash by this many leading bits, as
    /// rules key them (`client.ipv6_prefix`).
    ipv6_prefix: u8,
}

impl Balancer {
    /// The choice among `servers`.
    pub fn new(balance: &Balance, servers: &[Server], ipv6_prefix: u8) -> Balancer {
        Balancer {
            balance: balance.clone(),
            weights: servers.iter().map(|s| s.weight.max(1)).collect(),
            current: Mutex::new(vec![0; servers.len()].into_boxed_slice()),
            rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            seeds: servers.iter().map(|s| hash_bytes(s.address.as_bytes())).collect(),
            ipv6_prefix,
        }
    }

    /// The key `hash` balancing hashes for a request: `None` for the other
    /// balances, and when the header it hashes is missing.
    pub fn key(&self, client_ip: IpAddr, headers: &HeaderMap) -> Option<u64> {
        match &self.balance {
            Balance::Hash(HashKey::Ip) => match crate::wire::client::key_addr(client_ip, self.ipv6_prefix) {
                IpAddr::V4(a) => Some(hash_bytes(&a.octets())),
                IpAddr::V6(a) => Some(hash_bytes(&a.octets())),
            },
            Balance::Hash(HashKey::Header(name)) => headers.get(name).map(|v| hash_bytes(v.as_bytes())),
            _ => None,
        }
    }

    /// The server for a request with hash `key` among the `n` servers for
    /// which `usable` holds; `None` when there is none. `load` is a
    /// server's requests in flight.
    pub fn pick(
        &self,
        n: usize,
        key: Option<u64>,
        usable: impl Fn(usize) -> bool,
        load: impl Fn(usize) -> u64,
    ) -> Option<usize> {
        match (&self.balance, key) {
            (Balance::Hash(_), Some(key)) => (0..n).filter(|&i| usable(i)).max_by(|&a, &b| {
                let (ra, rb) = (self.rank(key, a), self.rank(key, b));
                ra.total_cmp(&rb)
            }),
            (Balance::LeastRequest, _) => self.least_request(n, &usable, &load),
            _ => self.round_robin(n, &usable),
        }
    }

    /// Smooth weighted round robin over the usable servers: each gains its
    /// weight, the one ahead is picked and loses the total. With one of
    /// three equal servers out, the other two share its turns evenly.
    fn round_robin(&self, n: usize, usable: &impl Fn(usize) -> bool) -> Option<usize> {
        let mut current = self.current.lock();
        let mut total: i64 = 0;
        let mut best: Option<usize> = None;
        for i in 0..n {
            if !usable(i) {
                continue;
            }
            let w = i64::from(self.weights[i]);
            current[i] += w;
            total += w;
            if best.is_none_or(|b| current[i] > current[b]) {
                best = Some(i);
            }
        }
        let b = best?;
        current[b] -= total;
        Some(b)
    }

    /// Two usable servers at random, the one with less in flight for its
    /// weight wins.
    fn least_request(&self, n: usize, usable: &impl Fn(usize) -> bool, load: &impl Fn(usize) -> u64) -> Option<usize> {
        let candidates: Vec<usize> = (0..n).filter(|&i| usable(i)).collect();
        let m = candidates.len() as u64;
        let r = self.random();
        let a = *candidates.get((r % m.max(1)) as usize)?;
        if m == 1 {
            return Some(a);
        }
        // A second, different candidate.
        let ai = (r % m) as usize;
        let b = candidates[(ai + 1 + ((r >> 32) % (m - 1)) as usize) % candidates.len()];
        // load(a) / w(a) against load(b) / w(b), without division.
        let cost = |i: usize, other: usize| u128::from(load(i)) * u128::from(self.weights[other]);
        Some(if cost(b, a) < cost(a, b) { b } else { a })
    }

    /// Weighted rendezvous: `weight / -ln(u)` with `u` uniform in (0, 1)
    /// from the key and the server's seed. Equal weights rank as the hash
    /// alone would.
    fn rank(&self, key: u64, i: usize) -> f64 {
        let h = rank(key, self.seeds[i]);
        // 53 bits in (0, 1): never 0, so the logarithm is finite.
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        f64::from(self.weights[i]) / -u.ln()
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

    fn servers(weights: &[u32]) -> Vec<Server> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| Server {
                address: format!("http://10.0.0.{}:8080", i + 1),
                scheme: http::uri::Scheme::HTTP,
                authority: http::uri::Authority::from_static("10.0.0.1:8080"),
                weight,
                backup: false,
            })
            .collect()
    }

    fn hashing(n: usize) -> Balancer {
        Balancer::new(&Balance::Hash(HashKey::Ip), &servers(&vec![1; n]), 64)
    }

    fn pick_hash(b: &Balancer, n: usize, key: u64) -> usize {
        b.pick(n, Some(key), |_| true, |_| 0).expect("a server is up")
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
            let without = b.pick(3, Some(key), |i| i != 1, |_| 0).expect("two are up");
            if first != 1 {
                assert_eq!(without, first);
            } else {
                assert_ne!(without, 1);
            }
        }
    }

    #[test]
    fn hash_weights_share_keys_in_proportion() {
        let b = Balancer::new(&Balance::Hash(HashKey::Ip), &servers(&[1, 3]), 64);
        let mut per = [0usize; 2];
        for k in 0..20_000u64 {
            per[pick_hash(&b, 2, mix(k))] += 1;
        }
        // 1 : 3, within a few percent.
        assert!((4500..5500).contains(&per[0]), "{per:?}");
    }

    #[test]
    fn a_request_without_a_hash_key_is_balanced_round_robin() {
        let b = hashing(3);
        let h = HeaderMap::new();
        let header = Balancer::new(
            &Balance::Hash(HashKey::Header(http::HeaderName::from_static("x-user"))),
            &servers(&[1, 1, 1]),
            64,
        );
        assert_eq!(header.key("127.0.0.1".parse().expect("address"), &h), None);
        let picks: Vec<usize> = (0..6).filter_map(|_| header.pick(3, None, |_| true, |_| 0)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert!(b.key("127.0.0.1".parse().expect("address"), &h).is_some());
    }

    #[test]
    fn ipv6_clients_hash_by_their_prefix() {
        let b = hashing(3);
        let h = HeaderMap::new();
        let one = b.key("2001:db8:1:2::5".parse().expect("address"), &h);
        let same_64 = b.key("2001:db8:1:2:ffff::9".parse().expect("address"), &h);
        let other_64 = b.key("2001:db8:1:3::5".parse().expect("address"), &h);
        assert_eq!(one, same_64);
        assert_ne!(one, other_64);
    }

    #[test]
    fn round_robin_takes_turns_and_skips_servers_that_are_out() {
        let b = Balancer::new(&Balance::RoundRobin, &servers(&[1, 1, 1]), 64);
        let picks: Vec<usize> = (0..6).filter_map(|_| b.pick(3, None, |_| true, |_| 0)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(b.pick(3, None, |i| i == 5, |_| 0), None);
    }

    #[test]
    fn with_one_of_three_out_the_other_two_share_its_turns_evenly() {
        let b = Balancer::new(&Balance::RoundRobin, &servers(&[1, 1, 1]), 64);
        let mut per = [0usize; 3];
        for _ in 0..600 {
            per[b.pick(3, None, |i| i != 1, |_| 0).expect("two are up")] += 1;
        }
        assert_eq!(per, [300, 0, 300]);
    }

    #[test]
    fn smooth_weighted_round_robin_interleaves_by_weight() {
        // nginx's example: weights 5, 1, 1 give a a a b a c a, not a a a a a b c.
        let b = Balancer::new(&Balance::RoundRobin, &servers(&[5, 1, 1]), 64);
        let picks: Vec<usize> = (0..7).filter_map(|_| b.pick(3, None, |_| true, |_| 0)).collect();
        assert_eq!(picks, [0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn least_request_prefers_the_idle_server_for_its_weight() {
        let b = Balancer::new(&Balance::LeastRequest, &servers(&[1, 1]), 64);
        for _ in 0..100 {
            assert_eq!(b.pick(2, None, |_| true, |i| if i == 0 { 5 } else { 0 }), Some(1));
        }
        // Three times the weight takes three times the load before it loses.
        let w = Balancer::new(&Balance::LeastRequest, &servers(&[3, 1]), 64);
        for _ in 0..100 {
            assert_eq!(w.pick(2, None, |_| true, |i| if i == 0 { 5 } else { 2 }), Some(0));
        }
        assert_eq!(w.pick(2, None, |i| i == 1, |_| 0), Some(1));
    }
}
