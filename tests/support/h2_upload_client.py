#!/usr/bin/env python3
"""An HTTP/2 (h2c, prior knowledge) client whose uploads stall on purpose.

    h2_upload_client.py PORT STREAMS BYTES

opens STREAMS streams (as many as the server's SETTINGS allow), each a POST
/upload with no content-length, sends BYTES of body on each as fast as flow
control lets it, and never ends any of them. Once nothing more can be sent
for a second (every stream done, or the server granting no more window), it
prints "settled N" with N the body bytes sent in all, then holds the
connection open until its stdin closes. Used by tests/h2_slow_readers.rs.
"""

import select
import socket
import sys
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def main():
    port, streams, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.connect(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    limit = streams
    while True:
        data = sock.recv(65536)
        if not data:
            print("closed", flush=True)
            return
        done = False
        for e in conn.receive_data(data):
            if isinstance(e, h2.events.RemoteSettingsChanged):
                c = e.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                if c is not None:
                    limit = min(streams, c.new_value)
                done = True
        sock.sendall(conn.data_to_send())
        if done:
            break
    left = {}
    for _ in range(limit):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "t"), (":path", "/upload")])
        left[sid] = size
    sock.sendall(conn.data_to_send())
    chunk = b"x" * 16384
    sent = 0
    last_progress = time.monotonic()
    while time.monotonic() - last_progress < 1.0:
        moved = False
        for sid in list(left):
            if left[sid] == 0:
                continue
            try:
                n = min(left[sid], conn.local_flow_control_window(sid), conn.max_outbound_frame_size, len(chunk))
            except (h2.exceptions.StreamClosedError, KeyError):
                left[sid] = 0
                continue
            if n > 0:
                conn.send_data(sid, chunk[:n])
                left[sid] -= n
                sent += n
                moved = True
        out = conn.data_to_send()
        if out:
            sock.sendall(out)
        if moved:
            last_progress = time.monotonic()
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            data = sock.recv(65536)
            if not data:
                break
            try:
                conn.receive_data(data)
            except h2.exceptions.ProtocolError:
                break
            out = conn.data_to_send()
            if out:
                sock.sendall(out)
            last_progress = time.monotonic() if not moved else last_progress
    print(f"settled {sent}", flush=True)
    # Hold the connection (reading, so the server's frames do not pile up)
    # until stdin closes.
    while True:
        ready, _, _ = select.select([sys.stdin, sock], [], [])
        if sys.stdin in ready and not sys.stdin.read(1):
            return
        if sock in ready:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            try:
                conn.receive_data(data)
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
            except h2.exceptions.ProtocolError:
                pass


if __name__ == "__main__":
    main()
