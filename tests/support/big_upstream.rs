//! An upstream that answers every request with the same large body, and
//! counts how much of it got onto the wire.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the upstream writes, shared by all its connections so the test's
/// own memory per connection stays small.
static PIECE: [u8; 64 * 1024] = [b'x'; 64 * 1024];

/// Socket buffers of the tests' own ends (the kernel doubles the figure).
pub const SMALL_BUFFER: u32 = 32 * 1024;

/// An upstream that answers every request with `len` bytes, written in
/// 64 KiB pieces, and counts how many it got onto the wire. Stops when
/// dropped.
pub struct BigUpstream {
    pub addr: std::net::SocketAddr,
    pub written: Arc<AtomicUsize>,
    /// Set when a write failed: the proxy closed the connection.
    pub broken: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl BigUpstream {
    pub async fn start(len: usize) -> BigUpstream {
        // A small send buffer (inherited by accepted connections): the count
        // is close to what the proxy took, not what the kernel queued here.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_send_buffer_size(SMALL_BUFFER).expect("send buffer");
        socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
        let listener = socket.listen(1024).expect("listen");
        let addr = listener.local_addr().expect("address");
        let (written, broken) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let task = tokio::spawn({
            let (written, broken) = (written.clone(), broken.clone());
            async move {
                loop {
                    let Ok((s, _)) = listener.accept().await else { continue };
                    tokio::spawn(serve(s, len, written.clone(), broken.clone()));
                }
            }
        });
        BigUpstream { addr, written, broken, task }
    }
}

/// Answers the requests of one keep-alive connection.
async fn serve(mut s: tokio::net::TcpStream, len: usize, written: Arc<AtomicUsize>, broken: Arc<AtomicBool>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        head.clear();
        let resp = format!("HTTP/1.1 200 OK\r\ncontent-length: {len}\r\n\r\n");
        if s.write_all(resp.as_bytes()).await.is_err() {
            broken.store(true, Ordering::SeqCst);
            return;
        }
        let mut left = len;
        while left > 0 {
            let n = left.min(PIECE.len());
            match s.write(&PIECE[..n]).await {
                Ok(0) | Err(_) => {
                    broken.store(true, Ordering::SeqCst);
                    return;
                }
                Ok(n) => {
                    written.fetch_add(n, Ordering::SeqCst);
                    left -= n;
                }
            }
        }
    }
}

impl Drop for BigUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Bytes the kernel holds in the queues of the TCP sockets (IPv4, not
/// listening) with a local or remote port among `ports`: sent and not yet
/// acknowledged or not yet sent, and received and not yet read, from
/// /proc/net/tcp (Linux). What an upstream wrote, less this for the
/// connections between it, the proxy and the clients, is what the proxy
/// itself holds.
pub fn kernel_queued(ports: &[u16]) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port_of = |addr: &str| addr.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
    let hex = |v: &str| usize::from_str_radix(v, 16).unwrap_or(0);
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, remote, state, queues) = (f.get(1)?, f.get(2)?, f.get(3)?, f.get(4)?);
            // 0A: LISTEN, whose "rx_queue" is its accept backlog.
            let ours = [local, remote].iter().any(|a| port_of(a).is_some_and(|p| ports.contains(&p)));
            let (tx, rx) = queues.split_once(':')?;
            (ours && *state != "0A").then(|| hex(tx) + hex(rx))
        })
        .sum()
}
