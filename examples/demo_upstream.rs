//! A tiny HTTP service to put tollgate in front of: it answers every request
//! with a JSON description of what it received, so the effect of the proxy
//! (forwarded headers, rejected requests that never arrive) is visible.
//!
//! ```text
//! cargo run --example demo_upstream -- --port 9001 --name orders
//! ```
//!
//! - any path: `200 {"service":"orders","method":"GET","path":"/x",...}`
//! - `/slow?ms=N`: the same answer after N milliseconds (at most 60 s), to
//!   watch a 504 or elastic throttling;
//! - `/status/NNN`: answers status NNN, to watch upstream errors.
//!
//! Request bodies are read and their size reported; nothing is stored.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::json;
use tokio::net::TcpListener;

/// The headers worth showing: what tollgate adds or passes on.
const SHOWN_HEADERS: &[&str] =
    &["host", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-user-id", "x-api-key", "user-agent"];

struct Options {
    addr: SocketAddr,
    name: String,
}

fn parse_args() -> Result<Options, String> {
    let mut addr = SocketAddr::from(([127, 0, 0, 1], 9001));
    let mut name = "demo".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--port" => {
                let port = value()?;
                addr.set_port(port.parse().map_err(|_| format!("--port {port:?} is not a port number"))?);
            }
            "--addr" => {
                let a = value()?;
                addr = a.parse().map_err(|_| format!("--addr {a:?} is not an address such as 0.0.0.0:9001"))?;
            }
            "--name" => name = value()?,
            "-h" | "--help" => {
                return Err("usage: demo_upstream [--port 9001 | --addr 127.0.0.1:9001] [--name demo]".into());
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(Options { addr, name })
}

#[tokio::main]
async fn main() {
    let options = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let listener = match TcpListener::bind(options.addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("demo_upstream: cannot listen on {}: {e}", options.addr);
            std::process::exit(1);
        }
    };
    eprintln!("demo_upstream {:?} listening on http://{}", options.name, options.addr);
    let name: Arc<str> = options.name.into();
    let served = Arc::new(AtomicU64::new(0));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("demo_upstream: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let name = name.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| answer(req, name.clone(), served.clone()));
            // HTTP/1.1 and h2c: tollgate's pooled client speaks HTTP/1.1.
            let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    name: Arc<str>,
    served: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let n = served.fetch_add(1, Ordering::Relaxed) + 1;
    let (parts, body) = req.into_parts();
    let body_bytes = body.collect().await.map(|b| b.to_bytes().len()).unwrap_or(0);
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or("");

    let mut status = StatusCode::OK;
    if let Some(code) = path.strip_prefix("/status/") {
        status = code.parse::<u16>().ok().and_then(|c| StatusCode::from_u16(c).ok()).unwrap_or(StatusCode::BAD_REQUEST);
    }
    if path == "/slow" || path.ends_with("/slow") {
        let ms = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("ms="))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1000)
            .min(60_000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    let headers: serde_json::Map<String, serde_json::Value> = SHOWN_HEADERS
        .iter()
        .filter_map(|h| parts.headers.get(*h).and_then(|v| v.to_str().ok()).map(|v| (h.to_string(), json!(v))))
        .collect();
    let body = json!({
        "service": &*name,
        "method": parts.method.as_str(),
        "path": path,
        "query": query,
        "headers": headers,
        "body_bytes": body_bytes,
        "requests_served": n,
    });
    let mut resp = Response::new(Full::new(Bytes::from(format!("{body}\n"))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}
