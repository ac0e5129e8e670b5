//! Clients that do not read their response: tollgate buffers a bounded
//! amount for them, pulls no more than that from the upstream, and
//! disconnects them after `send_timeout`. (Linux: one test reads
//! /proc/self/status.)

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use support::big_upstream::{BigUpstream, SMALL_BUFFER, kernel_queued};
use support::{DEADLINE, Tollgate, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn config(upstream: &BigUpstream, listen: &str) -> String {
    format!(
        r#"[listen]
proxy = "127.0.0.1:0"
admin = "127.0.0.1:0"
{listen}

[rules]
path = "rules"

[[upstream]]
name = "big"
url = "http://{}"
timeout = "10s"

[[route]]
path_prefix = "/"
upstream = "big"
"#,
        upstream.addr
    )
}

const MIB: usize = 1024 * 1024;
/// The tests here run one at a time: one of them measures this process's
/// memory.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends a GET and never reads the answer.
async fn get_and_never_read(tg: &Tollgate) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(SMALL_BUFFER).expect("receive buffer");
    let mut s = socket.connect(tg.proxy_addr).await.expect("connect");
    s.write_all(b"GET /big HTTP/1.1\r\nhost: t\r\n\r\n").await.expect("request");
    s
}

/// Waits until the upstream's count has stopped moving for a while.
async fn settled(written: &AtomicUsize) -> usize {
    let mut last = usize::MAX;
    loop {
        let now = written.load(Ordering::SeqCst);
        if now == last {
            return now;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn a_client_that_reads_nothing_is_closed_after_send_timeout() {
    let _serial = SERIAL.lock().await;
    let upstream = BigUpstream::start(64 * MIB).await;
    let tg = Tollgate::with(&config(&upstream, "send_timeout = \"1s\""), &[]).await;
    let mut s = get_and_never_read(&tg).await;
    // tollgate gives up on the client, and with it on the upstream's
    // response: the upstream's next write fails.
    eventually("the upstream connection is closed", || async { upstream.broken.load(Ordering::SeqCst) }).await;
    // The client finds its connection closed after what was in flight.
    let mut received = 0usize;
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match tokio::time::timeout(DEADLINE, s.read(&mut buf)).await.expect("the connection ends") {
            Ok(0) | Err(_) => break,
            Ok(n) => received += n,
        }
    }
    assert!(received < 64 * MIB, "the whole response arrived: the connection was not cut");
}

#[tokio::test]
async fn a_client_that_reads_nothing_pulls_a_bounded_amount_from_the_upstream() {
    let _serial = SERIAL.lock().await;
    let upstream = BigUpstream::start(64 * MIB).await;
    let tg = Tollgate::with(&config(&upstream, ""), &[]).await;
    let _clients: Vec<TcpStream> = {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(get_and_never_read(&tg).await);
        }
        v
    };
    eventually("the upstream started writing", || async { upstream.written.load(Ordering::SeqCst) > 0 }).await;
    let pulled = settled(&upstream.written).await;
    // What waits towards the clients, in tollgate's send queues and the
    // clients' receive queues, is the kernel's to size (autotuned, up to
    // 4 MiB a client here): the rest is what tollgate pulled for itself, in
    // its own buffers and in the queues of its upstream sockets, whose size
    // follows how eagerly it reads. Measured here (8 runs): 16.3 to 17 MiB
    // pulled, 15 MiB of it towards the clients, 0.7 to 1.4 MiB upstream
    // side, 424 KiB in tollgate; with hyper's default upstream read buffer
    // instead of forward::UPSTREAM_READ_BUFFER (990ca46's behaviour; 3
    // runs), 19 to 21.9 MiB pulled, 3.2 to 3.6 MiB upstream side and 630 KiB
    // in tollgate. The bound sits midway.
    let client_side = kernel_queued(&[tg.proxy_addr.port()]);
    let upstream_side = kernel_queued(&[upstream.addr.port()]);
    let in_tollgate = pulled.saturating_sub(client_side + upstream_side);
    println!(
        "pulled {} KiB for 4 clients: {} KiB queued client side, {} KiB upstream side, {} KiB in tollgate",
        pulled / 1024,
        client_side / 1024,
        upstream_side / 1024,
        in_tollgate / 1024
    );
    let for_itself = pulled.saturating_sub(client_side);
    assert!(
        for_itself < 4 * 704 * 1024,
        "tollgate pulled {} KiB for itself for 4 clients that read nothing",
        for_itself / 1024
    );
    // README, Slow readers: at most 97 KiB queued for an HTTP/1.1 client and
    // 16 KiB read ahead, within 128 KiB.
    assert!(in_tollgate <= 4 * 128 * 1024, "tollgate holds {} KiB for 4 clients that read nothing", in_tollgate / 1024);
    assert!(pulled < 4 * 8 * MIB, "{pulled} bytes pulled from the upstream for 4 clients that read nothing");
}

/// This process's resident memory, from /proc (Linux).
fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

#[tokio::test]
async fn clients_that_read_nothing_cost_little_memory_each() {
    let _serial = SERIAL.lock().await;
    const CLIENTS: usize = 40;
    let upstream = BigUpstream::start(16 * MIB).await;
    let tg = Tollgate::with(&config(&upstream, ""), &[]).await;
    // Warm up: one complete exchange, so first-use allocations are made.
    let mut warm = get_and_never_read(&tg).await;
    let mut sink = vec![0u8; 256 * 1024];
    let mut got = 0;
    while got < 16 * MIB {
        match tokio::time::timeout(DEADLINE, warm.read(&mut sink))
            .await
            .expect("the warm-up download moves")
            .expect("read")
        {
            0 => break,
            n => got += n,
        }
    }
    drop(warm);
    let before = rss_bytes();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(get_and_never_read(&tg).await);
    }
    eventually("every upstream response started", || async { upstream.written.load(Ordering::SeqCst) > 16 * MIB })
        .await;
    settled(&upstream.written).await;
    let grown = rss_bytes().saturating_sub(before);
    // About 175 KiB per client here (tollgate's buffers, both ends' socket
    // bookkeeping, the test's tasks); about 380 KiB with hyper's default
    // upstream read buffer (990ca46), which grows to 400 KiB.
    println!("grew {} KiB for {CLIENTS} clients", grown / 1024);
    assert!(grown < CLIENTS * 280 * 1024, "grew {} KiB for {CLIENTS} clients that read nothing", grown / 1024);
}
