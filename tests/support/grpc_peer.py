"""A real gRPC server and client (grpcio, grpcio-status) for tests/grpc.rs.

    python3 grpc_peer.py server           # prints "port N", serves until killed
    python3 grpc_peer.py client ADDRESS   # one channel; one call per stdin line

The server needs no generated code: a generic handler serves
/test.Echo/Say (unary: the request's bytes back) and /test.Echo/Chat
(bidirectional streaming: each message back, upper-cased).

Each client stdin line is {"call": "unary" or "stream", "user": the x-user-id
metadata, "messages": [text, ...]}; each stdout line is {"ok": [replies],
"initial": {...}, "trailing": {...}} or {"error": status code name,
"details": text, "trailing": {...}, "status": google.rpc.Status decoded by
grpcio-status from grpc-status-details-bin, as {"code": n, "message": text,
"retry_delay": seconds or null}, or null when there is none}. Metadata
whose key ends in -bin is left out.
"""

import json
import sys
from concurrent import futures

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

SAY = "/test.Echo/Say"
CHAT = "/test.Echo/Chat"


def server():
    def say(request, context):
        return request

    def chat(requests, context):
        for r in requests:
            yield r.upper()

    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(say),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        },
    )
    s = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    s.add_generic_rpc_handlers((handler,))
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    print(f"port {port}", flush=True)
    s.wait_for_termination()


def metadata(md):
    return {k: v for k, v in (md or ()) if not k.endswith("-bin")}


def status_of(error):
    status = rpc_status.from_call(error)
    if status is None:
        return None
    delay = None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return {"code": status.code, "message": status.message, "retry_delay": delay}


def call(channel, line):
    md = (("x-user-id", line["user"]),)
    messages = [m.encode() for m in line["messages"]]
    try:
        if line["call"] == "unary":
            reply, c = channel.unary_unary(SAY).with_call(messages[0], metadata=md, timeout=10)
            replies = [reply]
        else:
            c = channel.stream_stream(CHAT)(iter(messages), metadata=md, timeout=10)
            replies = list(c)
        return {
            "ok": [r.decode() for r in replies],
            "initial": metadata(c.initial_metadata()),
            "trailing": metadata(c.trailing_metadata()),
        }
    except grpc.RpcError as e:
        return {
            "error": e.code().name,
            "details": e.details(),
            "trailing": metadata(e.trailing_metadata()),
            "status": status_of(e),
        }


def client(address):
    channel = grpc.insecure_channel(address)
    for line in sys.stdin:
        print(json.dumps(call(channel, json.loads(line))), flush=True)


if sys.argv[1] == "server":
    server()
else:
    client(sys.argv[2])
