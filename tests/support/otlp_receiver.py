"""A real OTLP/HTTP trace receiver for tests/tracing.rs: decodes each
POST /v1/traces body with the `opentelemetry-proto` package (installed by
scripts/test) and prints one JSON line per span on stdout.

    python3 otlp_receiver.py      # prints "port N", then the spans
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    print(json.dumps({
                        "service": resource.get("service.name"),
                        "scope": ss.scope.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "trace_state": s.trace_state,
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "status_code": s.status.code,
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                    }), flush=True)
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"port {server.server_address[1]}", flush=True)
server.serve_forever()
