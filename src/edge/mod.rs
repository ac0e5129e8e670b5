//! The edge: listeners and the composition root ([`server`]), one client
//! connection's life (TLS, the first byte, idle and send timeouts, the
//! send budget, draining), and what the binaries share ([`process`]).

pub mod connection;
pub mod drain;
pub mod handshake;
pub mod idle;
pub mod process;
pub mod redirect;
pub mod send_budget;
pub mod server;
pub mod tls;
