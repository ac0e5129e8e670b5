"""WebSocket peers for tests/websocket.rs, built on the `websockets` package.

    python3 ws_peer.py server            # echo server; prints "port N"
    python3 ws_peer.py client URL CMD..  # a client; prints one line per event

Client commands, run in order:
    send:TEXT   send a text message
    recv        wait for one message, print "recv TEXT"
    wait-close  wait until the peer closes, print "closed CODE SECONDS"
Opening prints "open" or "refused STATUS". Pings are off on both sides, so
an idle tunnel is really idle.
"""
import asyncio
import sys
import time

import websockets


async def echo(ws):
    try:
        async for message in ws:
            await ws.send(message)
    except websockets.ConnectionClosed:
        pass


async def server():
    async with websockets.serve(echo, "127.0.0.1", 0, ping_interval=None) as s:
        port = s.sockets[0].getsockname()[1]
        print(f"port {port}", flush=True)
        await asyncio.Future()


async def client(url, commands):
    try:
        ws = await websockets.connect(url, ping_interval=None, open_timeout=10,
                                      additional_headers={"x-user": "alice"})
    except websockets.InvalidStatus as e:
        print(f"refused {e.response.status_code}", flush=True)
        return
    print("open", flush=True)
    for cmd in commands:
        if cmd.startswith("send:"):
            await ws.send(cmd[5:])
        elif cmd == "recv":
            print(f"recv {await asyncio.wait_for(ws.recv(), 10)}", flush=True)
        elif cmd == "wait-close":
            started = time.monotonic()
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            except websockets.ConnectionClosed as e:
                code = e.rcvd.code if e.rcvd else "none"
                print(f"closed {code} {time.monotonic() - started:.2f}", flush=True)
            except asyncio.TimeoutError:
                print("still-open", flush=True)
    await ws.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(server())
    else:
        asyncio.run(client(sys.argv[2], sys.argv[3:]))
