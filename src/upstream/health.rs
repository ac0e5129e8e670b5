//! Whether each server of an upstream takes requests: passive health (a
//! server that has refused, reset or timed out `eject_after` times in a row
//! is taken out for a backoff that doubles while it keeps failing) and
//! active health checks (a GET to `health_check.path` every `interval`, in
//! a background task per server).
//!
//! How many servers may be out at once, and what happens when more are, is
//! the upstream's decision ([`crate::upstream`]): this module keeps one
//! server's state.
//!
//! Only upstreams with several servers or a health check use this: a
//! single-`url` upstream without one forwards as it always did, with no
//! health state on its request path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, HOST, HeaderValue, USER_AGENT};
use http::{Request, Uri};
use http_body_util::Empty;
use prometheus::IntGauge;

use tokio::time::Instant;

use crate::config::{HealthCheck, Server, Upstream};
use crate::upstream::pool::Pool;

/// The first backoff after a failure; each further failure in a row
/// doubles it, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// The longest a failing server stays out before it is tried again.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One server's health, shared by the request path and its check task.
///
/// Atomics, not a lock: the request path reads it on every request to an
/// upstream with several servers.
pub struct Health {
    /// Passive: failures in a row, reset by a success.
    failures: AtomicU32,
    /// Passive: out until this many milliseconds after `epoch`; 0 when in.
    out_until: AtomicU64,
    /// Active: taken out by failed checks.
    check_down: AtomicBool,
    epoch: Instant,
    /// `tollgate_upstream_server_healthy`.
    gauge: IntGauge,
}

impl Health {
    /// A server that is up until it fails. Every server of an upstream
    /// shares `epoch`, so one reading of [`Health::now_ms`] serves them all.
    pub fn new(gauge: IntGauge, epoch: Instant) -> Health {
        gauge.set(1);
        Health {
            failures: AtomicU32::new(0),
            out_until: AtomicU64::new(0),
            check_down: AtomicBool::new(false),
            epoch,
            gauge,
        }
    }

    /// The instant its clock counts from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Milliseconds since `epoch`, at least 1 (0 means "in").
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Whether requests may go to this server at `now_ms` (from
    /// [`Health::now_ms`]): a server whose backoff has run out is tried
    /// again, and its first success takes it back fully.
    pub fn is_up(&self, now_ms: u64) -> bool {
        !self.check_down.load(Ordering::Relaxed) && self.out_until.load(Ordering::Relaxed) <= now_ms
    }

    /// The server refused, reset or timed out. Once that has happened
    /// `eject_after` times in a row, and `may_eject` allows it (the
    /// upstream's cap on servers out), it is out for the backoff, which
    /// doubles with each further failure in a row. Failures of requests
    /// that were in flight together while it is already out do not count.
    /// Says whether it was taken out.
    pub fn failed(&self, eject_after: u32, may_eject: impl FnOnce() -> bool) -> bool {
        let now = self.now_ms();
        if self.out_until.load(Ordering::Relaxed) > now {
            return false;
        }
        let failures = self.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if failures < eject_after || !may_eject() {
            return false;
        }
        let n = (failures - eject_after).min(16);
        let backoff = FIRST_BACKOFF.saturating_mul(1 << n).min(MAX_BACKOFF);
        self.out_until.store(now + backoff.as_millis() as u64, Ordering::Relaxed);
        self.gauge.set(0);
        true
    }

    /// The server answered: any passive backoff is over.
    pub fn succeeded(&self) {
        // A load first: the common case writes nothing.
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.out_until.store(0, Ordering::Relaxed);
            self.set_gauge();
        }
    }

    fn set_gauge(&self) {
        let out = self.check_down.load(Ordering::Relaxed) || self.out_until.load(Ordering::Relaxed) != 0;
        self.gauge.set(i64::from(!out));
    }

    /// Whether passive health has taken it out (its backoff may have run
    /// out since: it is then tried again).
    pub fn ejected(&self) -> bool {
        self.out_until.load(Ordering::Relaxed) != 0
    }
}

/// Starts the check task of one server. It stops once `health` is dropped
/// (the upstream is gone).
pub fn spawn_check(health: &Arc<Health>, server: &Server, check: &HealthCheck, upstream: &Upstream) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        tracing::error!(upstream = %upstream.name, "no runtime: health checks do not run");
        return;
    };
    let weak = Arc::downgrade(health);
    // Checks speak to the server as requests do (TLS, HTTP/2), on their
    // own connections: with HTTP/1.1, each check's connection closes after
    // it.
    let pool = Pool::<Empty<Bytes>>::for_server(upstream, server, 16 * 1024);
    let server = server.clone();
    let check = check.clone();
    let upstream = upstream.name.clone();
    rt.spawn(async move {
        let mut every = tokio::time::interval(check.interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut streak = Streak::default();
        loop {
            every.tick().await;
            let ok = matches!(tokio::time::timeout(check.timeout, probe(&pool, &server, &check)).await, Ok(Ok(true)));
            let Some(health) = weak.upgrade() else { return };
            match health.checked(&mut streak, ok, &check) {
                Some(true) => {
                    tracing::info!(upstream = %upstream, server = %server.address, "health check passed: server back in");
                }
                Some(false) => {
                    tracing::warn!(upstream = %upstream, server = %server.address, "health check failed: server taken out");
                }
                None => {}
            }
        }
    });
}

/// Good or failed checks in a row.
#[derive(Debug, Default)]
pub struct Streak {
    good: u32,
    bad: u32,
}

impl Health {
    /// Records one check: `Some(true)` when it brings the server back in,
    /// `Some(false)` when it takes it out.
    pub fn checked(&self, streak: &mut Streak, ok: bool, check: &HealthCheck) -> Option<bool> {
        if ok {
            (streak.good, streak.bad) = (streak.good.saturating_add(1), 0);
        } else {
            (streak.good, streak.bad) = (0, streak.bad.saturating_add(1));
        }
        let down = self.check_down.load(Ordering::Relaxed);
        // Out after failed checks, or after failed requests (passive):
        // either way, answering its checks brings it back.
        let out = down || self.out_until.load(Ordering::Relaxed) != 0;
        if out && streak.good >= check.healthy {
            self.check_down.store(false, Ordering::Relaxed);
            // Reachable again: a passive backoff from before is over too.
            self.failures.store(0, Ordering::Relaxed);
            self.out_until.store(0, Ordering::Relaxed);
            self.set_gauge();
            Some(true)
        } else if !down && streak.bad >= check.unhealthy {
            self.check_down.store(true, Ordering::Relaxed);
            self.set_gauge();
            Some(false)
        } else {
            None
        }
    }
}

/// One check on a new connection: whether the server answered one of
/// `expect_status` (2xx or 3xx unless configured).
async fn probe(
    pool: &Pool<Empty<Bytes>>,
    server: &Server,
    check: &HealthCheck,
) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    let mut req = Request::new(Empty::new());
    *req.uri_mut() = Uri::from(check.path.clone());
    let host = match &check.host {
        Some(h) => h.clone(),
        None => HeaderValue::from_str(server.authority.as_str())?,
    };
    req.headers_mut().insert(HOST, host);
    if pool.speaks_http1() {
        req.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    }
    req.headers_mut().insert(USER_AGENT, HeaderValue::from_static("tollgate-health-check"));
    let status = pool.send(req).await?.status();
    Ok(check.passes(status.as_u16()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> Health {
        Health::new(IntGauge::new("healthy", "test").expect("valid metric definition"), Instant::now())
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_server_is_out_for_a_backoff_that_doubles_up_to_30s() {
        let h = health();
        let mut expected = Vec::new();
        let mut got = Vec::new();
        // In until the third failure in a row.
        assert!(!h.failed(3, || true));
        assert!(!h.failed(3, || true));
        assert!(h.is_up(h.now_ms()));
        assert_eq!(h.gauge.get(), 1);
        for want in [1, 2, 4, 8, 16, 30, 30] {
            assert!(h.failed(3, || true));
            assert!(!h.is_up(h.now_ms()));
            assert_eq!(h.gauge.get(), 0);
            // Failures while it is out (requests that were in flight) do
            // not grow the backoff.
            assert!(!h.failed(3, || true));
            let mut waited = 0;
            while !h.is_up(h.now_ms()) {
                assert!(waited < 60_000, "still out after {waited} ms");
                tokio::time::advance(Duration::from_millis(500)).await;
                waited += 500;
            }
            expected.push(want * 1000);
            got.push(waited);
        }
        assert_eq!(got, expected);
        // Back in on its own after the backoff; a success ends the streak.
        h.succeeded();
        assert_eq!(h.gauge.get(), 1);
        h.failed(1, || true);
        tokio::time::advance(FIRST_BACKOFF).await;
        assert!(h.is_up(h.now_ms()));
    }

    #[test]
    fn a_server_the_upstream_may_not_take_out_stays_in_whatever_its_failures() {
        let h = health();
        for _ in 0..20 {
            assert!(!h.failed(1, || false));
        }
        assert!(h.is_up(h.now_ms()));
        assert_eq!(h.gauge.get(), 1);
        // Once it may, the next failure takes it out.
        assert!(h.failed(1, || true));
        assert!(!h.is_up(h.now_ms()));
    }

    #[test]
    fn checks_take_a_server_out_after_unhealthy_failures_and_back_after_healthy_passes() {
        let check = HealthCheck {
            path: http::uri::PathAndQuery::from_static("/healthz"),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            healthy: 2,
            unhealthy: 3,
            host: None,
            expect_status: vec![(200, 399)],
        };
        let h = health();
        let mut s = Streak::default();
        let now = h.now_ms();
        let results: Vec<Option<bool>> =
            [false, false, true, false, false, false, false, true, false, true, true, true]
                .into_iter()
                .map(|ok| h.checked(&mut s, ok, &check))
                .collect();
        assert_eq!(results, [None, None, None, None, None, Some(false), None, None, None, None, Some(true), None]);
        assert!(h.is_up(now));
        assert_eq!(h.gauge.get(), 1);
    }
}
