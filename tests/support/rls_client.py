"""A gRPC client of Envoy's rate limit service for tests/envoy_rls.rs.

Generated at test time by grpcio-tools from the vendored proto/ files (the
published wire format), so tollgate is driven by another implementation's
code, not by its own generated client.

    python3 rls_client.py GEN_DIR ADDRESS

GEN_DIR holds the generated modules. Each stdin line is a RateLimitRequest
in protobuf's JSON mapping; each stdout line is {"ok": RateLimitResponse as
JSON, field names as in the proto, defaults included} or {"error": status
code name, "details": text}.
"""

import json
import sys

sys.path.insert(0, sys.argv[1])

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc  # noqa: E402


def to_dict(message):
    try:
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf before 5.26 names the option differently
        return json_format.MessageToDict(
            message, preserving_proto_field_name=True, including_default_value_fields=True
        )


def main():
    stub = rls_pb2_grpc.RateLimitServiceStub(grpc.insecure_channel(sys.argv[2]))
    for line in sys.stdin:
        request = json_format.Parse(line, rls_pb2.RateLimitRequest())
        try:
            out = {"ok": to_dict(stub.ShouldRateLimit(request, timeout=10))}
        except grpc.RpcError as e:
            out = {"error": e.code().name, "details": e.details()}
        print(json.dumps(out), flush=True)


main()
