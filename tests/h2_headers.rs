//! HTTP/2 request headers are bounded by `listen.max_header_bytes` as
//! HTTP/1.1's are: the same count (`name: value\r\n`), the same JSON 431,
//! whatever HTTP/2's own accounting (32 bytes more per field) says. Driven
//! by the Python h2 package over h2c.

use crate::support;

use support::{DEADLINE, Tollgate, Upstream, config};
use tokio::process::Command;

/// Sends one GET over h2c (prior knowledge) to `port` with `count` headers
/// `x-<i>` of `size` bytes each, and prints the response's status, then
/// its body. Python h2 does not hold a client to the server's
/// SETTINGS_MAX_HEADER_LIST_SIZE, so the server's own limits decide.
const PY_H2_GET: &str = r#"
import socket, sys
import h2.config, h2.connection, h2.events
port, path, count, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sock = socket.create_connection(("127.0.0.1", port), timeout=10)
conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
conn.initiate_connection()
headers = [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "h2.test")]
headers += [("x-%03d" % i, "v" * size) for i in range(count)]
conn.send_headers(1, headers, end_stream=True)
sock.sendall(conn.data_to_send())
status, body, done = None, b"", False
while not done:
    data = sock.recv(65536)
    if not data:
        break
    for ev in conn.receive_data(data):
        if isinstance(ev, h2.events.ResponseReceived):
            status = dict(ev.headers)[":status"]
        elif isinstance(ev, h2.events.DataReceived):
            body += ev.data
            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated)):
            done = True
    sock.sendall(conn.data_to_send())
print(status)
print(body.decode())
"#;

/// The status and body of [`PY_H2_GET`]'s request.
async fn h2_get(tg: &Tollgate, path: &str, count: usize, size: usize) -> (String, String) {
    let port = tg.proxy_addr.port().to_string();
    let run =
        Command::new("python3").args(["-c", PY_H2_GET, &port, path, &count.to_string(), &size.to_string()]).output();
    let out = tokio::time::timeout(DEADLINE, run)
        .await
        .expect("the h2 client finishes")
        .expect("python3 runs (scripts/test installs its h2 package)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let (status, body) = stdout.split_once('\n').expect("a status line");
    (status.to_string(), body.trim_end().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_headers_within_max_header_bytes_are_forwarded_and_beyond_it_get_the_json_431() {
    let upstream = Upstream::start().await;
    let tg = Tollgate::start(&upstream, "").await;
    // 20 KiB of headers: within the default 64 KiB, as over HTTP/1.1.
    let (status, body) = h2_get(&tg, "/within", 5, 4000).await;
    assert_eq!(status, "200", "{body}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body).expect("the echo")["path"], "/within");
    // 80 KiB: tollgate's JSON 431.
    let (status, body) = h2_get(&tg, "/beyond", 20, 4000).await;
    assert_eq!(status, "431");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    assert_eq!(body["error"], "request_header_fields_too_large", "{body}");
    assert_eq!(upstream.hits(), 1, "the oversized request reached the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_small_h2_headers_are_counted_as_http1_counts_them() {
    // 449 fields `x-NNN` with empty values are 4041 bytes as
    // max_header_bytes counts them (`x-NNN: \r\n`), 4090 with the
    // X-Request-Id tollgate adds (under 4096), and 16613 as HTTP/2 counts
    // them (32 more per field, over hyper's default list size of 16 KiB):
    // HTTP/2's accounting must not refuse what HTTP/1.1 accepts. One more
    // field is over the limit.
    let upstream = Upstream::start().await;
    let cfg = config(upstream.addr)
        .replace("admin = \"127.0.0.1:0\"\n", "admin = \"127.0.0.1:0\"\nmax_header_bytes = 4096\n")
        .replace("path_prefix = \"/\"", "path_prefix = \"/routed\"");
    let tg = Tollgate::with(&cfg, &[("r.toml", "")]).await;
    // Routed nowhere: tollgate's 404 shows the headers passed its checks
    // (the echo upstream takes 100 headers at most).
    let (status, body) = h2_get(&tg, "/nowhere", 449, 0).await;
    assert_eq!(status, "404", "{body}");
    let (status, body) = h2_get(&tg, "/nowhere", 450, 0).await;
    assert_eq!(status, "431", "{body}");
    assert!(body.contains("request_header_fields_too_large"), "{body}");
}
