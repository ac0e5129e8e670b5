#!/usr/bin/env python3
"""An HTTP/2 (h2c, prior knowledge) client that misbehaves on purpose.

    h2_slow_client.py PORT STREAMS MODE [tls]

opens STREAMS streams, each a GET /big, and then:

- MODE "noread": grants huge flow-control windows, then never reads its
  socket again (a small receive buffer, so the kernel takes little);
- MODE "nowindow": announces a stream window of 0 and never sends a
  WINDOW_UPDATE, but keeps reading (so tollgate's writes never block).

It prints "sent" once the requests are on the wire, then, for "nowindow",
"closed" when tollgate closes the connection. It runs until its stdin closes
or tollgate closes the connection. With "tls" it speaks HTTP/2 over TLS
(ALPN h2, the certificate not checked) instead of h2c. Used by
tests/h2_slow_readers.rs and tests/tls.rs.
"""

import select
import socket
import sys

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


def main():
    port, streams, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.connect(("127.0.0.1", port))
    tls = len(sys.argv) > 4 and sys.argv[4] == "tls"
    if tls:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
        sock = ctx.wrap_socket(sock, server_hostname="a.test")
        if sock.selected_alpn_protocol() != "h2":
            print("no h2 over TLS", flush=True)
            return
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    window = 0 if mode == "nowindow" else 2**31 - 1
    conn.local_settings = h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
        },
    )
    conn.initiate_connection()
    if mode == "noread":
        conn.increment_flow_control_window(2**31 - 1 - 65535)
    sock.sendall(conn.data_to_send())
    # Read the server's SETTINGS (its stream limit) before opening streams.
    limit = streams
    while True:
        data = sock.recv(65536)
        if not data:
            print("closed", flush=True)
            return
        events = conn.receive_data(data)
        done = False
        for e in events:
            if isinstance(e, h2.events.RemoteSettingsChanged):
                c = e.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                if c is not None:
                    limit = min(streams, c.new_value)
                done = True
        sock.sendall(conn.data_to_send())
        if done:
            break
    for i in range(limit):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [(":method", "GET"), (":scheme", "https" if tls else "http"), (":authority", "t"), (":path", f"/big/{i}")],
            end_stream=True,
        )
    sock.sendall(conn.data_to_send())
    print(f"sent {limit}", flush=True)
    while True:
        watch = [sys.stdin, sock] if mode == "nowindow" else [sys.stdin]
        ready, _, _ = select.select(watch, [], [])
        if sys.stdin in ready and not sys.stdin.read(1):
            return
        if sock in ready:
            try:
                data = sock.recv(65536)
            except OSError:  # a reset, or a TLS connection cut short
                data = b""
            if not data:
                print("closed", flush=True)
                return
            try:
                # Events are ignored: no WINDOW_UPDATE is ever sent back
                # (h2 sends one only when asked to acknowledge data).
                conn.receive_data(data)
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
            except h2.exceptions.ProtocolError:
                pass


if __name__ == "__main__":
    main()
