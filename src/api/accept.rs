//! The accept loop both API listeners share: a bounded number of
//! connections, and no spinning on an accept error.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The next connection that gets one of `slots`, with `TCP_NODELAY` set.
/// An accept error (out of file descriptors) is retried after 50 ms rather
/// than at once; a connection over the bound is closed: the caller's own
/// timeout and retry policy take it from there.
pub(super) async fn next(listener: &TcpListener, slots: &Arc<Semaphore>) -> (TcpStream, OwnedSemaphorePermit) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else { continue };
        let _ = stream.set_nodelay(true);
        return (stream, permit);
    }
}
