#!/usr/bin/env python3
"""An HTTP/2 (h2c, prior knowledge) client driven line by line, that reports
what the server does to its connection.

    h2_client.py PORT

Commands, one per line on stdin:

- "get PATH [NAME=VALUE ...]": a GET on a new stream, with those headers;
- "ping": a PING frame (and nothing else).

Events, one per line on stdout:

- "ready" once the server's SETTINGS are in;
- "response STREAM STATUS", "end STREAM", "reset STREAM CODE";
- "goaway LAST_STREAM CODE" for each GOAWAY;
- "closed" when the server closes the connection (then the client exits).

It also exits when its stdin closes. Used by tests/connection_lifetime.rs.

GOAWAY frames are taken out of the byte stream before the h2 package sees
them: it treats a GOAWAY as the end of the connection and refuses the
frames of the streams a graceful GOAWAY lets finish.
"""

import os
import select
import socket
import sys

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def say(line):
    print(line, flush=True)


def split_goaways(data):
    """The whole frames of `data` but its GOAWAYs (each reported), and the
    bytes of an incomplete last frame."""
    kept = b""
    while len(data) >= 9:
        length = int.from_bytes(data[0:3], "big")
        if len(data) < 9 + length:
            break
        frame, data = data[: 9 + length], data[9 + length :]
        if frame[3] == 0x7:
            last = int.from_bytes(frame[9:13], "big") & 0x7FFFFFFF
            say(f"goaway {last} {int.from_bytes(frame[13:17], 'big')}")
        else:
            kept += frame
    return kept, data


def run(conn, sock, words):
    """One command of stdin."""
    try:
        if words and words[0] == "get":
            sid = conn.get_next_available_stream_id()
            headers = [(":method", "GET"), (":scheme", "http"), (":authority", "t"), (":path", words[1])]
            headers += [tuple(w.split("=", 1)) for w in words[2:]]
            conn.send_headers(sid, headers, end_stream=True)
        elif words and words[0] == "ping":
            conn.ping(b"12345678")
        sock.sendall(conn.data_to_send())
    except (h2.exceptions.ProtocolError, OSError) as e:
        say(f"refused {type(e).__name__}")


def main():
    port = int(sys.argv[1])
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    ready = False
    pending = b""
    commands = b""
    while True:
        readable, _, _ = select.select([sys.stdin, sock], [], [])
        if sys.stdin in readable:
            # Raw reads: a buffered readline would keep the lines after the
            # first out of select's sight.
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            commands += chunk
            while b"\n" in commands:
                line, commands = commands.split(b"\n", 1)
                run(conn, sock, line.decode().split())
        if sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                say("closed")
                return
            pending += data
            frames, pending = split_goaways(pending)
            try:
                events = conn.receive_data(frames)
            except h2.exceptions.ProtocolError as e:
                say(f"protocol-error {e}")
                events = []
            for e in events:
                if isinstance(e, h2.events.RemoteSettingsChanged) and not ready:
                    ready = True
                    say("ready")
                elif isinstance(e, h2.events.ResponseReceived):
                    status = dict(e.headers).get(":status")
                    say(f"response {e.stream_id} {status}")
                elif isinstance(e, h2.events.DataReceived):
                    conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
                elif isinstance(e, h2.events.StreamEnded):
                    say(f"end {e.stream_id}")
                elif isinstance(e, h2.events.StreamReset):
                    say(f"reset {e.stream_id} {int(e.error_code)}")
            out = conn.data_to_send()
            if out:
                try:
                    sock.sendall(out)
                except OSError:
                    pass


if __name__ == "__main__":
    main()
