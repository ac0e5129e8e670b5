//! A settlement (`cost_response_header`) never gives back more than its
//! reservation still weighs: not to a window the reservation was not
//! counted in, and not what a token bucket has already drained of it. On
//! the memory store and on a real Redis.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::redis::{RedisServer, tollgate_config};
use support::{Call, Reply, Tollgate, Upstream, eventually};
use tollgate::config::{Backend, OnError, StoreConfig};
use tollgate::limiter::clock::SystemClock;
use tollgate::limiter::{Algorithm, Limits, NANOS_PER_SEC};
use tollgate::obs::metrics::Metrics;
use tollgate::store::{Check, Mode, RedisStore};

/// A request from `ip` whose upstream answers `x-tokens-used: used`.
fn used(addr: std::net::SocketAddr, ip: &str, used: &str) -> Call {
    Call::new("GET", addr, "/").from_ip(ip).header("x-echo-header", &format!("x-tokens-used: {used}"))
}

fn remaining(r: &Reply) -> u64 {
    r.header("x-ratelimit-remaining").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{r:?}"))
}

// ---------------------------------------------------------------------------
// A token bucket's reservation that has drained
// ---------------------------------------------------------------------------

/// Burst 10 refilled at 10 per 10 s, every request reserving 10.
const BUCKET: &str = "[[rule]]\nname = \"llm\"\nkey = [\"ip\"]\nalgorithm = \"token_bucket\"\nlimit = 10\n\
                      window = \"10s\"\ncost = 10\ncost_response_header = \"x-tokens-used\"\n";

/// The case: a reservation of 10 answered 12 s later with a real
/// cost of 0. By then the bucket has drained it (10 s at one a second) and
/// admitted 10 more; giving the 10 back let 20 units through in 2 s
/// against a ceiling of 12 (the burst and 2 s of refill).
#[tokio::test]
async fn a_token_bucket_never_gives_back_a_reservation_it_has_drained() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BUCKET).await;
    let ip = "198.51.100.20";
    let slow = used(tg.proxy_addr, ip, "0").header("x-echo-hold", "1");
    let slow = tokio::spawn(slow.send());
    up.wait_held(1).await;
    tg.advance(Duration::from_secs(10));
    assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::OK);
    tg.advance(Duration::from_secs(2));
    up.release(1);
    let slow = slow.await.expect("the slow request");
    assert_eq!(slow.status, StatusCode::OK);
    // 10 taken 2 s ago, 2 refilled since: no room for 10 more.
    let next = used(tg.proxy_addr, ip, "10").send().await;
    assert_eq!(next.status, StatusCode::TOO_MANY_REQUESTS, "the drained reservation was given back: {next:?}");
}

/// Half drained: the half still in the bucket comes back, no more.
#[tokio::test]
async fn a_token_bucket_gives_back_what_is_left_of_a_reservation() {
    let up = Upstream::start().await;
    let tg = Tollgate::start(&up, BUCKET).await;
    let ip = "198.51.100.21";
    let slow = used(tg.proxy_addr, ip, "0").header("x-echo-hold", "1");
    let slow = tokio::spawn(slow.send());
    up.wait_held(1).await;
    tg.advance(Duration::from_secs(5));
    up.release(1);
    assert_eq!(remaining(&slow.await.expect("the slow request")), 0);
    // 5 drained, 5 given back: the bucket is full again, 10 - 10 left.
    assert_eq!(remaining(&used(tg.proxy_addr, ip, "10").send().await), 0);
    assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::TOO_MANY_REQUESTS);
}

/// A Redis store of its own on `url`: no leases, generous timeout.
async fn redis_store(url: &str) -> RedisStore {
    let config = StoreConfig {
        backend: Backend::Redis,
        url: Some(url.to_string()),
        timeout: Duration::from_secs(2),
        on_error: OnError::Deny,
        pool_size: 1,
        key_prefix: "bounds:".to_string(),
        lease_percent: 0,
        lease_idle: Duration::from_secs(1),
        lease_lifetime: Duration::from_secs(10),
        tls_ca: None,
        tls_client: None,
        max_keys: 1_000,
    };
    RedisStore::connect(&config, Arc::new(SystemClock), Arc::new(Metrics::new())).await.expect("the store connects")
}

/// The same on Redis, whose clock no test moves: a settle that says its
/// reservation was counted 5 s ago (at one unit a second, 5 of its 10
/// drained) gives back 5, not 10.
#[tokio::test]
async fn a_token_bucket_on_redis_gives_back_only_what_is_left_of_a_reservation() {
    let redis = RedisServer::start();
    let store = redis_store(&redis.url()).await;
    let limits =
        Limits { algorithm: Algorithm::TokenBucket, limit: 10, window: 10 * NANOS_PER_SEC, burst: 10, origin: 0 };
    let check = Check {
        key: "llm|ip=198.51.100.22",
        limits,
        cost: 10,
        enforced: true,
        on_error: OnError::Deny,
        settles: true,
        penalty: None,
    };
    let (answers, _) = store.check_holding(std::slice::from_ref(&check), Mode::Consume).await;
    let v = answers[0].as_ref().expect("decided");
    assert!(v.allowed && v.remaining == 0, "{v:?}");
    store.settle(&check, -10, Duration::from_secs(5));
    let one = Check { cost: 1, ..check.clone() };
    let peek = || async {
        let (answers, _) = store.check_holding(std::slice::from_ref(&one), Mode::Peek).await;
        answers[0].as_ref().expect("decided").remaining
    };
    eventually("the settle to run", || async { peek().await > 0 }).await;
    // 5 back: a request of one would leave 4.
    assert_eq!(peek().await, 4, "more was given back than the reservation still weighed");
}

// ---------------------------------------------------------------------------
// The window a reservation was counted in
// ---------------------------------------------------------------------------

/// A TCP relay in front of a Redis server that holds every reply until a
/// deadline when one is set ([`Relay::hold_into_next_window`]): a check
/// the server counts in one window is then answered in the next.
struct Relay {
    port: u16,
    /// Wall-clock nanoseconds since the epoch; 0 for none.
    until: Arc<AtomicU64>,
}

const WINDOW: Duration = Duration::from_secs(4);

fn wall_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64
}

impl Relay {
    async fn start(redis_port: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
        let port = listener.local_addr().expect("address").port();
        let until = Arc::new(AtomicU64::new(0));
        let shared = until.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", redis_port)).await else { continue };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut from_client, &mut to_server).await });
                let until = shared.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from_server.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        let wait = until.load(Ordering::SeqCst).saturating_sub(wall_ns());
                        tokio::time::sleep(Duration::from_nanos(wait)).await;
                        if to_client.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        Relay { port, until }
    }

    /// Waits until 300 ms before a `WINDOW` ends (the server runs on this
    /// machine and its windows are epoch-aligned), then holds every reply
    /// until 100 ms into the next one: less than the second after which
    /// the store's client gives up on a connection that does not answer.
    /// Answers the window it held from.
    async fn hold_into_next_window(&self) -> u64 {
        let w = WINDOW.as_nanos() as u64;
        let lead = 300_000_000;
        let now = wall_ns();
        let wait = (w - now % w + w - lead) % w;
        tokio::time::sleep(Duration::from_nanos(wait)).await;
        let window = wall_ns() / w;
        self.until.store((window + 1) * w + 100_000_000, Ordering::SeqCst);
        window
    }
}

/// Which `WINDOW` the wall clock is in.
fn window_now() -> u64 {
    wall_ns() / WINDOW.as_nanos() as u64
}

/// A reservation Redis counted in one window but answered in the next
/// used to be stamped when the answer came, so its refund went to the
/// window it was answered in, which never counted it: that window then
/// admitted its limit and the refunded units on top. Stamped before the
/// check is sent, the refund aims at the window before (or the one it was
/// counted in), finds another window stored, and gives nothing back.
#[tokio::test]
async fn a_refund_never_reaches_a_window_its_reservation_was_not_counted_in() {
    let up = Upstream::start().await;
    let redis = RedisServer::start();
    let relay = Relay::start(redis.url().rsplit(':').next().and_then(|p| p.parse().ok()).expect("port")).await;
    let store = "timeout = \"8s\"\non_error = \"deny\"\nlease_percent = 0";
    let cfg = tollgate_config(up.addr, &format!("redis://127.0.0.1:{}", relay.port), store);
    let rules = "[[rule]]\nname = \"llm\"\nkey = [\"ip\"]\nalgorithm = \"fixed_window\"\nlimit = 10\n\
                 window = \"4s\"\ncost = 10\ncost_response_header = \"x-tokens-used\"\n";
    let tg = Tollgate::with(&cfg, &[("rules.toml", rules)]).await;
    let ip = "198.51.100.23";

    // The rule's script loaded, and the key's first window counted.
    eventually("the store to answer through the relay", || async {
        used(tg.proxy_addr, "198.51.100.24", "1").send().await.status == StatusCode::OK
    })
    .await;

    // Counted in one window, answered in the next; held at the upstream.
    let counted_in = relay.hold_into_next_window().await;
    let slow = used(tg.proxy_addr, ip, "0").header("x-echo-hold", "1");
    let slow = tokio::spawn(slow.send());
    up.wait_held(1).await;
    let window = window_now();
    assert_eq!(window, counted_in + 1, "answered in the next window");
    // This window's 10.
    assert_eq!(used(tg.proxy_addr, ip, "10").send().await.status, StatusCode::OK);
    // The slow one costs nothing after all.
    up.release(1);
    assert_eq!(slow.await.expect("the slow request").status, StatusCode::OK);
    // Time for a refund to run (it is sent in the background).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = used(tg.proxy_addr, ip, "10").send().await;
    assert_eq!(window_now(), window, "the test ran past its window: too slow to tell");
    assert_eq!(next.status, StatusCode::TOO_MANY_REQUESTS, "a window admitted 20 of 10: {next:?}");
}
