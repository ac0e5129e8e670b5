//! [`IdleIo`] on in-memory pipes, with tokio's paused clock.

use super::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

/// `f`, which should end by the timers under test: far longer than any of
/// them on the paused clock, so a regression that leaves it pending fails
/// the test instead of hanging the run (a paused clock with no timer due
/// would wait forever).
async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(3600), f).await.expect("ended within an hour of test time")
}

/// An `IdleIo` over one end of an in-memory pipe: closed after `idle`
/// seconds with no request in flight, failed by a write blocked for `send`
/// seconds.
fn pipe_io(
    server: DuplexStream,
    idle: u64,
    send: u64,
    inflight: &Inflight,
    budget: &SendBudget,
) -> IdleIo<DuplexStream> {
    IdleIo::new(server, Duration::from_secs(idle), Duration::from_secs(send), inflight.clone(), budget.clone())
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_reads_as_closed_after_the_timeout() {
    let (client, server) = tokio::io::duplex(64);
    let mut io = pipe_io(server, 5, 60, &Inflight::default(), &SendBudget::default());
    let started = Instant::now();
    let mut buf = [0u8; 8];
    let n = bounded(io.read(&mut buf)).await.expect("read");
    assert_eq!(n, 0, "idle connection reads as end of file");
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    drop(client);
}

#[tokio::test(start_paused = true)]
async fn activity_and_inflight_requests_keep_it_open() {
    let (mut client, server) = tokio::io::duplex(64);
    let inflight = Inflight::default();
    let mut io = pipe_io(server, 5, 60, &inflight, &SendBudget::default());
    let started = Instant::now();
    let writer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(4)).await;
        client.write_all(b"x").await.expect("write");
        client
    });
    let mut buf = [0u8; 8];
    assert_eq!(bounded(io.read(&mut buf)).await.expect("read"), 1);
    let _client = bounded(writer).await.expect("writer");
    // A request in flight for 20 s: not idle, whatever the silence.
    let guard = inflight.start();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(20)).await;
        drop(guard);
    });
    assert_eq!(bounded(io.read(&mut buf)).await.expect("read"), 0);
    bounded(release).await.expect("release");
    // Never while the request was in flight (until t = 24 s), nor within
    // a timeout after it; no bytes marked its end, so the timer noticed
    // it late, by up to one timeout (in real use the response's bytes
    // mark it, see the next tests).
    let closed = started.elapsed();
    assert!(closed >= Duration::from_secs(29) && closed <= Duration::from_secs(34), "closed at {closed:?}");
}

#[tokio::test(start_paused = true)]
async fn bytes_without_a_request_do_not_keep_it_open() {
    let (mut client, server) = tokio::io::duplex(64);
    let mut io = pipe_io(server, 5, 60, &Inflight::default(), &SendBudget::default());
    let started = Instant::now();
    // A PING every second, each answered: bytes both ways, no request.
    let pinger = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if client.write_all(b"p").await.is_err() {
                break;
            }
        }
    });
    let mut buf = [0u8; 8];
    bounded(async {
        while io.read(&mut buf).await.expect("read") > 0 {
            io.write_all(b"a").await.expect("answer");
        }
    })
    .await;
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    pinger.abort();
}

#[tokio::test(start_paused = true)]
async fn the_idle_time_starts_with_the_last_response_bytes() {
    let (client, server) = tokio::io::duplex(64);
    let inflight = Inflight::default();
    let mut io = pipe_io(server, 5, 60, &inflight, &SendBudget::default());
    let started = Instant::now();
    // A request in flight for 3 s, whose response leaves after it ended.
    let guard = inflight.start();
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(guard);
    io.write_all(b"response").await.expect("answer");
    let mut buf = [0u8; 8];
    assert_eq!(bounded(io.read(&mut buf)).await.expect("read"), 0);
    assert_eq!(started.elapsed(), Duration::from_secs(8));
    drop(client);
}

/// An `IdleIo` with a 60 s idle timeout and a 5 s header timeout.
fn timed(server: DuplexStream, inflight: &Inflight) -> IdleIo<DuplexStream> {
    pipe_io(server, 60, 60, inflight, &SendBudget::default()).with_header_timeout(Duration::from_secs(5))
}

/// Reads until end of file; how long it took.
async fn read_to_close(io: &mut IdleIo<DuplexStream>) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 64];
    while bounded(io.read(&mut buf)).await.expect("read") > 0 {}
    started.elapsed()
}

#[tokio::test(start_paused = true)]
async fn a_head_trickled_in_is_cut_at_the_header_timeout_whatever_the_protocol() {
    for head in [&b"GET / HTTP/1.1\r\nhost: a\r\n"[..], H2_PREFACE] {
        let (mut client, server) = tokio::io::duplex(64);
        let mut io = timed(server, &Inflight::default());
        let trickle = tokio::spawn(async move {
            for b in head {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if client.write_all(&[*b]).await.is_err() {
                    break;
                }
            }
            client
        });
        assert_eq!(read_to_close(&mut io).await, Duration::from_secs(5), "{:?}", String::from_utf8_lossy(head));
        drop(trickle);
    }
}

#[tokio::test(start_paused = true)]
async fn http1_times_the_wait_for_each_next_head_and_http2_only_the_first() {
    // HTTP/1.1: a request, answered 20 s later; the next head is due 5 s
    // after the answer.
    let (mut client, server) = tokio::io::duplex(1024);
    let inflight = Inflight::default();
    let mut io = timed(server, &inflight);
    client.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 64];
    assert!(bounded(io.read(&mut buf)).await.expect("read") > 0);
    let guard = inflight.start();
    tokio::time::sleep(Duration::from_secs(20)).await;
    io.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.expect("answer");
    drop(guard);
    assert_eq!(read_to_close(&mut io).await, Duration::from_secs(5));

    // HTTP/2: after a request, only the idle timeout.
    let (mut client, server) = tokio::io::duplex(1024);
    let mut io = timed(server, &inflight);
    client.write_all(H2_PREFACE).await.expect("write");
    assert!(bounded(io.read(&mut buf)).await.expect("read") > 0);
    drop(inflight.start());
    io.write_all(b"frames").await.expect("answer");
    assert_eq!(read_to_close(&mut io).await, Duration::from_secs(60));
    drop(client);
}

#[tokio::test(start_paused = true)]
async fn a_write_blocked_for_the_send_timeout_fails() {
    // The peer never reads: the 64-byte pipe fills up.
    let (_client, server) = tokio::io::duplex(64);
    let mut io = pipe_io(server, 60, 3, &Inflight::default(), &SendBudget::default());
    let started = Instant::now();
    let err = bounded(io.write_all(&[b'x'; 1024])).await.expect_err("a write to a peer that never reads fails");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn a_connection_holding_response_data_that_never_leaves_fails_after_the_send_timeout() {
    use http_body_util::{BodyExt, Full};
    // An HTTP/2 client that grants no window: nothing blocks, nothing
    // is written, and the response's first piece stays held.
    let (_client, server) = tokio::io::duplex(64);
    let budget = SendBudget::default();
    let mut io = pipe_io(server, 60, 3, &Inflight::default(), &budget);
    let started = Instant::now();
    let piece = bounded(budget.body(Full::new(bytes::Bytes::from_static(b"held"))).frame()).await;
    let mut buf = [0u8; 8];
    let err = bounded(io.read(&mut buf)).await.expect_err("a connection whose responses stall fails");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    drop(piece);
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_may_be_parked_after_the_delay_and_not_while_busy() {
    let (mut client, server) = tokio::io::duplex(1024);
    let inflight = Inflight::default();
    let mut io = pipe_io(server, 60, 60, &inflight, &SendBudget::default());
    io.park_when_idle(Duration::from_secs(1));
    client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 64];
    assert!(bounded(io.read(&mut buf)).await.expect("read") > 0);
    // A request in flight for 3 s: not parked, however long the silence.
    let guard = inflight.start();
    assert!(tokio::time::timeout(Duration::from_secs(3), io.read(&mut buf)).await.is_err());
    assert!(!inflight.take_park(), "parked while busy");
    io.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.expect("answer");
    io.flush().await.expect("flush");
    drop(guard);
    // Idle: parked once, within two delays.
    assert!(tokio::time::timeout(Duration::from_secs(2), io.read(&mut buf)).await.is_err());
    assert!(inflight.take_park(), "not parked after idling");
    assert!(!inflight.take_park(), "said twice");
    // The next request's bytes, and a second idle moment: parked again.
    client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
    assert!(bounded(io.read(&mut buf)).await.expect("read") > 0);
    assert!(tokio::time::timeout(Duration::from_secs(2), io.read(&mut buf)).await.is_err());
    assert!(inflight.take_park(), "not parked after idling again");
}

#[tokio::test]
async fn bytes_put_back_are_read_first() {
    let (mut client, server) = tokio::io::duplex(64);
    let mut io = pipe_io(server, 60, 60, &Inflight::default(), &SendBudget::default());
    client.write_all(b"world").await.expect("write");
    io.unread(bytes::Bytes::from_static(b"lo "));
    io.unread(bytes::Bytes::from_static(b"hel"));
    assert!(io.has_unread());
    let mut buf = [0u8; 11];
    bounded(io.read_exact(&mut buf)).await.expect("read");
    assert_eq!(&buf, b"hello world");
    assert!(!io.has_unread());
}
