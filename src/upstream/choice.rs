//! Which servers of an upstream are candidates for a try, and the state
//! that decides it: passive health's cap on servers out (never the last
//! one in), panic mode, backups, `max_inflight`, and the retry budget.
//! [`crate::upstream::balance`] then picks one of the candidates.

use std::sync::atomic::{AtomicU64, Ordering};

use super::client::UpstreamClient;
use crate::config::MIN_RETRY_CONCURRENCY;

/// The servers a request already went to (at most `retries + 1`).
#[derive(Default)]
pub(super) struct Tried {
    pub(super) ids: [usize; 12],
    pub(super) len: usize,
}

impl Tried {
    pub(super) fn contains(&self, i: usize) -> bool {
        self.ids[..self.len].contains(&i)
    }

    pub(super) fn push(&mut self, i: usize) {
        if self.len < self.ids.len() {
            self.ids[self.len] = i;
            self.len += 1;
        }
    }
}

/// Why no server could be picked.
pub(super) enum NoServer {
    /// Every candidate is at its `max_inflight`.
    Busy,
    /// None is left.
    None,
}

impl UpstreamClient {
    /// The server for a request with `key`, among those in service and not
    /// tried yet.
    pub(super) fn pick(&self, key: Option<u64>, tried: &Tried) -> Result<usize, NoServer> {
        let n = self.servers.len();
        let now = self.servers[0].health.now_ms();
        let servers = &self.config.servers;
        let up = |i: usize| self.servers[i].health.is_up(now);
        let primaries = servers.iter().filter(|s| !s.backup).count();
        let primaries_up = (0..n).filter(|&i| !servers[i].backup && up(i)).count();
        // Which servers are candidates: those in of the primaries, or of
        // the backups once every primary is out; all of them (panic) when
        // fewer are in than the cap on servers out allows.
        let in_service: Box<dyn Fn(usize) -> bool + '_> = if primaries_up > 0 {
            if primaries_up >= primaries - self.cap(primaries) {
                Box::new(move |i| !servers[i].backup && up(i))
            } else {
                self.counters.panic.inc();
                Box::new(|i| !servers[i].backup)
            }
        } else if (0..n).any(|i| servers[i].backup && up(i)) {
            Box::new(move |i| servers[i].backup && up(i))
        } else {
            self.counters.panic.inc();
            Box::new(|_| true)
        };
        self.pick_among(key, tried, &in_service)
    }

    /// The server for a request with `key` among those `in_service` and
    /// not tried yet, under their `max_inflight`.
    pub(super) fn pick_among(
        &self,
        key: Option<u64>,
        tried: &Tried,
        in_service: &dyn Fn(usize) -> bool,
    ) -> Result<usize, NoServer> {
        let n = self.servers.len();
        let load = |i: usize| self.servers[i].inflight();
        let open = |i: usize| self.config.max_inflight.is_none_or(|max| load(i) < max);
        let pick = self.balancer.pick(n, key, |i| in_service(i) && !tried.contains(i) && open(i), load);
        match pick {
            Some(i) => Ok(i),
            None if (0..n).any(|i| in_service(i) && !tried.contains(i)) => Err(NoServer::Busy),
            None => Err(NoServer::None),
        }
    }

    /// How many of `of` servers passive health may take out at once:
    /// `max_ejected_percent` of them.
    fn cap(&self, of: usize) -> usize {
        of * usize::from(self.config.max_ejected_percent) / 100
    }

    /// Whether server `i` may be taken out now: fewer of its group
    /// (primaries or backups) are out than the cap allows, and another
    /// server of the upstream is still in (the last one in never goes).
    fn may_eject(&self, i: usize) -> bool {
        let now = self.servers[0].health.now_ms();
        let backup = self.config.servers[i].backup;
        let (mut size, mut out, mut others_in) = (0, 0, 0);
        for (j, s) in self.servers.iter().enumerate() {
            let up = s.health.is_up(now);
            if j != i && up {
                others_in += 1;
            }
            if self.config.servers[j].backup == backup {
                size += 1;
                out += usize::from(!up);
            }
        }
        out < self.cap(size) && others_in > 0
    }

    /// Records a failure of server `i` against its passive health.
    pub(super) fn failed(&self, i: usize) {
        let server = &self.servers[i];
        server.failures.inc();
        if self.single {
            return;
        }
        let taken_out = server.health.failed(self.config.eject_after, || {
            let _one_at_a_time = self.ejecting.lock();
            self.may_eject(i)
        });
        if taken_out {
            tracing::warn!(upstream = %self.config.name, server = %server.address, "server taken out after failures in a row");
        }
    }

    /// A retry in flight, if the budget has room: retries in flight stay
    /// under `retry_budget_percent` of the requests in flight, or
    /// [`MIN_RETRY_CONCURRENCY`].
    pub(super) fn retry_budget(&self) -> Option<RetryGuard<'_>> {
        let budget =
            (self.inflight() as u64 * u64::from(self.config.retry_budget_percent) / 100).max(MIN_RETRY_CONCURRENCY);
        let taken = self.retrying.fetch_add(1, Ordering::Relaxed);
        if taken >= budget {
            self.retrying.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(RetryGuard(&self.retrying))
    }
}

/// A retry in flight, counted against the budget until dropped.
pub(super) struct RetryGuard<'a>(&'a AtomicU64);

impl Drop for RetryGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::obs::metrics::Metrics;
    use crate::upstream::pool::{Answered, PoolError};
    use crate::wire::error::ProxyError;

    fn client(extra: &str) -> UpstreamClient {
        let text = format!(
            "[[upstream]]\nname = \"svc\"\nservers = [\"http://127.0.0.1:1\", \"http://127.0.0.1:2\", \"http://127.0.0.1:3\", \"http://127.0.0.1:4\"]\n{extra}\n"
        );
        let config = crate::config::Config::parse(std::path::Path::new("t.toml"), &text).expect("valid config");
        UpstreamClient::new(&config.upstreams[0], &Metrics::new(), 64, None)
    }

    #[test]
    fn retries_in_flight_stay_within_the_budget_with_a_floor_of_three() {
        let u = client("retry_budget_percent = 20");
        // Nothing in flight: the floor.
        let floor: Vec<RetryGuard<'_>> = (0..3).map_while(|_| u.retry_budget()).collect();
        assert_eq!(floor.len(), 3);
        assert!(u.retry_budget().is_none());
        drop(floor);
        // 100 requests in flight: 20 retries.
        let inflight: Vec<Answered> = (0..100).map(|i| u.servers[i % 4].start()).collect();
        let budget: Vec<RetryGuard<'_>> = (0..50).map_while(|_| u.retry_budget()).collect();
        assert_eq!(budget.len(), 20);
        drop(budget);
        drop(inflight);
        assert_eq!(u.inflight(), 0);
    }

    #[test]
    fn at_most_max_ejected_percent_of_the_servers_go_out_and_never_the_last() {
        let u = client("eject_after = 1");
        // Four servers at 50%: two may go out, not a third.
        let out: Vec<bool> = (0..4).map(|i| u.servers[i].health.failed(1, || u.may_eject(i))).collect();
        assert_eq!(out, [true, true, false, false]);
        let all = client("eject_after = 1\nmax_ejected_percent = 100");
        let out: Vec<bool> = (0..4).map(|i| all.servers[i].health.failed(1, || all.may_eject(i))).collect();
        assert_eq!(out, [true, true, true, false], "the last one in stays");
        let none = client("eject_after = 1\nmax_ejected_percent = 0");
        assert!(!none.servers[0].health.failed(1, || none.may_eject(0)));
    }

    #[test]
    fn more_servers_out_than_the_cap_is_panic_mode_every_server_a_candidate() {
        let u = client("");
        // Three of four out (as active health checks can take them): fewer
        // in than 50% allows, so requests go to all four.
        for i in 0..3 {
            assert!(u.servers[i].health.failed(1, || true));
        }
        let mut picked = [0; 4];
        for _ in 0..8 {
            let Ok(i) = u.pick(None, &Tried::default()) else { panic!("a server is picked") };
            picked[i] += 1;
        }
        assert_eq!(picked, [2, 2, 2, 2]);
        assert_eq!(u.counters.panic.get(), 8);
    }

    #[test]
    fn running_out_of_descriptors_or_ports_is_not_the_servers_fault() {
        let u = client("eject_after = 1");
        let local = |code| PoolError::Connect(Box::new(std::io::Error::from_raw_os_error(code)));
        // EMFILE, ENFILE, EADDRNOTAVAIL: 503, counted as local, no failure.
        for code in [24, 23, 99] {
            assert_eq!(u.upstream_error_at(0, Some(&local(code))), ProxyError::ProxyOverloaded);
        }
        assert_eq!(u.counters.local.get(), 3);
        assert_eq!(u.servers[0].failures.get(), 0);
        assert!(u.servers[0].health.is_up(u.servers[0].health.now_ms()));
        // ECONNREFUSED is the server's.
        assert_eq!(u.upstream_error_at(0, Some(&local(111))), ProxyError::BadGateway);
        assert_eq!(u.servers[0].failures.get(), 1);
        assert!(!u.servers[0].health.is_up(u.servers[0].health.now_ms()));
    }
}
