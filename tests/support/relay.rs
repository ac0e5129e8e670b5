//! A fault-injecting TCP relay between tollgate and one Redis node, for
//! the tests of what a dropped or reset connection does to calls in
//! flight (`toxiproxy` is not packaged here).
//!
//! It forwards bytes both ways and reads the client's side as Redis
//! commands (arrays of bulk strings, all a client sends), so that a test
//! can act on a chosen command:
//!
//! - [`Relay::log`]: every command forwarded, as its arguments.
//! - [`Relay::hold_replies_after`]: once a command matching a predicate
//!   has been forwarded, the replies on that connection are held (the
//!   node ran the command; the client does not hear it) until
//!   [`Relay::release`] or the connection ends.
//! - [`Relay::duplicate`]: a command matching a predicate is also sent on
//!   a connection of the relay's own, whose reply is read and dropped: the
//!   node runs it twice, as it would a call a client sent again.
//! - [`Relay::reset_all`] / [`Relay::drop_all`]: ends every connection
//!   now, with a TCP reset or a plain close; [`Relay::reset_after`] resets
//!   each new connection once it has carried that many bytes from the
//!   client.
//!
//! Runs on the test's tokio runtime; stops (and ends its connections) when
//! dropped.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One command: its arguments.
pub type Command = Vec<Vec<u8>>;
type Predicate = Arc<dyn Fn(&Command) -> bool + Send + Sync>;

/// How a connection is ended on command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    Reset,
    Close,
}

struct State {
    target: SocketAddr,
    log: Mutex<Vec<Command>>,
    hold_after: Mutex<Option<Predicate>>,
    duplicate: Mutex<Option<Predicate>>,
    reset_after: Mutex<Option<u64>>,
    /// Bumped by `release`: held connections go on.
    release: watch::Sender<u64>,
    /// Every connection watches it: `reset_all` and `drop_all`.
    end: watch::Sender<(u64, End)>,
    /// The relay's own connection for duplicates.
    side: tokio::sync::Mutex<Option<TcpStream>>,
    /// Duplicates the node has answered.
    duplicated: std::sync::atomic::AtomicUsize,
}

/// A running relay: connect to `port`, reach `target`.
pub struct Relay {
    pub port: u16,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Relay {
    /// Listens on a free loopback port and relays to `target`.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("relay bind: {e}"));
        Relay::serve(listener, target)
    }

    /// As [`Relay::start`], on `port` (a Redis Cluster node may announce
    /// it as its own: see `cluster-announce-port`).
    pub async fn start_on(port: u16, target: SocketAddr) -> Relay {
        let listener =
            TcpListener::bind(("127.0.0.1", port)).await.unwrap_or_else(|e| panic!("relay bind {port}: {e}"));
        Relay::serve(listener, target)
    }

    fn serve(listener: TcpListener, target: SocketAddr) -> Relay {
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_else(|e| panic!("relay addr: {e}"));
        let state = Arc::new(State {
            target,
            log: Mutex::new(Vec::new()),
            hold_after: Mutex::new(None),
            duplicate: Mutex::new(None),
            reset_after: Mutex::new(None),
            release: watch::Sender::new(0),
            end: watch::Sender::new((0, End::Open)),
            side: tokio::sync::Mutex::new(None),
            duplicated: std::sync::atomic::AtomicUsize::new(0),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(state.target).await {
                        relay(state, client, server).await;
                    }
                });
            }
        });
        Relay { port, state, task }
    }

    /// Every command forwarded so far, oldest first.
    pub fn log(&self) -> Vec<Command> {
        self.state.log.lock().clone()
    }

    /// How many commands forwarded so far match `matches`.
    pub fn count(&self, matches: impl Fn(&Command) -> bool) -> usize {
        self.state.log.lock().iter().filter(|c| matches(c)).count()
    }

    /// Holds the replies of a connection once it has forwarded a command
    /// matching `matches` (the first such command of any connection only:
    /// the predicate is cleared when it matches).
    pub fn hold_replies_after(&self, matches: impl Fn(&Command) -> bool + Send + Sync + 'static) {
        *self.state.hold_after.lock() = Some(Arc::new(matches));
    }

    /// Lets held replies go on.
    pub fn release(&self) {
        self.state.release.send_modify(|n| *n += 1);
    }

    /// Sends every command matching `matches` to the node twice from now on.
    pub fn duplicate(&self, matches: impl Fn(&Command) -> bool + Send + Sync + 'static) {
        *self.state.duplicate.lock() = Some(Arc::new(matches));
    }

    /// How many duplicates the node has run (and answered) so far.
    pub fn duplicated(&self) -> usize {
        self.state.duplicated.load(Ordering::SeqCst)
    }

    /// Resets every connection open now (RST to the client).
    pub fn reset_all(&self) {
        self.state.end.send_modify(|(n, e)| (*n, *e) = (*n + 1, End::Reset));
    }

    /// Closes every connection open now (FIN to the client).
    pub fn drop_all(&self) {
        self.state.end.send_modify(|(n, e)| (*n, *e) = (*n + 1, End::Close));
    }

    /// Resets each connection opened from now on once it has carried
    /// `bytes` from the client (`None`: never).
    pub fn reset_after(&self, bytes: Option<u64>) {
        *self.state.reset_after.lock() = bytes;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.drop_all();
    }
}

/// Relays one connection until either side ends or the test ends it.
async fn relay(state: Arc<State>, mut client: TcpStream, mut server: TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut ended = state.end.subscribe();
    ended.borrow_and_update();
    let held = AtomicBool::new(false);
    let reset_after = *state.reset_after.lock();
    let outcome = {
        let (mut client_rx, mut client_tx) = client.split();
        let (mut server_rx, mut server_tx) = server.split();
        let requests = async {
            let (mut pending, mut chunk, mut carried) = (Vec::new(), vec![0u8; 16 * 1024], 0u64);
            loop {
                let n = match client_rx.read(&mut chunk).await {
                    Ok(0) | Err(_) => return End::Close,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&chunk[..n]);
                while let Some((len, command)) = split_command(&pending) {
                    if state.hold_matches(&command) {
                        held.store(true, Ordering::SeqCst);
                    }
                    let duplicate = state.duplicate_matches(&command);
                    let bytes: Vec<u8> = pending.drain(..len).collect();
                    state.log.lock().push(command);
                    if server_tx.write_all(&bytes).await.is_err() {
                        return End::Close;
                    }
                    if duplicate {
                        state.send_aside(&bytes).await;
                    }
                    carried += bytes.len() as u64;
                    if reset_after.is_some_and(|limit| carried >= limit) {
                        return End::Reset;
                    }
                }
            }
        };
        let replies = async {
            let mut release = state.release.subscribe();
            release.borrow_and_update();
            let mut chunk = vec![0u8; 16 * 1024];
            loop {
                let n = match server_rx.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                // Held: the bytes wait here for a release.
                if held.load(Ordering::SeqCst) {
                    if release.changed().await.is_err() {
                        return;
                    }
                    held.store(false, Ordering::SeqCst);
                }
                if client_tx.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            end = requests => end,
            () = replies => End::Close,
            _ = ended.changed() => ended.borrow().1,
        }
    };
    if outcome == End::Reset {
        // Closed with linger 0: a reset. (Deprecated because a lingering
        // close blocks the thread; with 0 it resets at once.)
        #[allow(deprecated)]
        let _ = client.set_linger(Some(Duration::ZERO));
    }
}

impl State {
    fn hold_matches(&self, command: &Command) -> bool {
        let mut hold = self.hold_after.lock();
        let matched = hold.as_ref().is_some_and(|p| p(command));
        if matched {
            *hold = None;
        }
        matched
    }

    fn duplicate_matches(&self, command: &Command) -> bool {
        self.duplicate.lock().as_ref().is_some_and(|p| p(command))
    }

    /// Sends `bytes` (one command) on the relay's own connection and reads
    /// its reply whole before the next.
    async fn send_aside(&self, bytes: &[u8]) {
        let mut side = self.side.lock().await;
        if side.is_none() {
            *side = TcpStream::connect(self.target).await.ok();
        }
        let Some(conn) = side.as_mut() else { return };
        if conn.write_all(bytes).await.is_err() {
            *side = None;
            return;
        }
        let mut reply = Vec::new();
        let mut chunk = [0u8; 4096];
        while reply_len(&reply).is_none() {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    *side = None;
                    return;
                }
                Ok(n) => reply.extend_from_slice(&chunk[..n]),
            }
        }
        self.duplicated.fetch_add(1, Ordering::SeqCst);
    }
}

/// The first whole command in `buf` (an array of bulk strings): its
/// length in bytes and its arguments.
pub fn split_command(buf: &[u8]) -> Option<(usize, Command)> {
    let (count, mut at) = line_number(buf, 0, b'*')?;
    let mut args = Vec::with_capacity(count.max(0) as usize);
    for _ in 0..count.max(0) {
        let (len, start) = line_number(buf, at, b'$')?;
        let end = start + len.max(0) as usize;
        if buf.len() < end + 2 {
            return None;
        }
        args.push(buf[start..end].to_vec());
        at = end + 2;
    }
    Some((at, args))
}

/// The number on the line starting at `at` with `kind`, and where the
/// next line starts.
fn line_number(buf: &[u8], at: usize, kind: u8) -> Option<(i64, usize)> {
    if *buf.get(at)? != kind {
        return None;
    }
    let end = at + buf[at..].windows(2).position(|w| w == b"\r\n")?;
    let n = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
    Some((n, end + 2))
}

/// The length of the first whole RESP2 reply in `buf`, if it is all there.
fn reply_len(buf: &[u8]) -> Option<usize> {
    reply_end(buf, 0)
}

fn reply_end(buf: &[u8], at: usize) -> Option<usize> {
    let kind = *buf.get(at)?;
    let end = at + buf[at..].windows(2).position(|w| w == b"\r\n")?;
    let next = end + 2;
    match kind {
        b'+' | b'-' | b':' => Some(next),
        b'$' => {
            let n: i64 = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
            if n < 0 {
                return Some(next);
            }
            let stop = next + n as usize + 2;
            (buf.len() >= stop).then_some(stop)
        }
        b'*' => {
            let n: i64 = std::str::from_utf8(&buf[at + 1..end]).ok()?.parse().ok()?;
            let mut at = next;
            for _ in 0..n.max(0) {
                at = reply_end(buf, at)?;
            }
            Some(at)
        }
        _ => None,
    }
}
