"""The hand-encoded ``grpc.health.v1`` messages (``connectors/grpc_health.py``) against stubs
that grpcio-tools (the ``dev`` extra) generates from the standard ``health.proto``, the file
``grpcio-health-checking`` is built from: the generated client asks our handlers (the thread-pool
server of the peer nodes, the asyncio server of the HF3FS metadata service), and our client asks a
server of the generated servicer; both messages match protobuf's own encoding byte for byte."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc")

from kvconnect.connectors import grpc_health  # noqa: E402

HEALTH_PROTO = """syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    protoc = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path_factory.mktemp("health")
    (out / "health.proto").write_text(HEALTH_PROTO)
    assert protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}",
                        str(out / "health.proto")]) == 0
    sys.path.insert(0, str(out))
    try:
        import health_pb2
        import health_pb2_grpc
    finally:
        sys.path.remove(str(out))
    yield health_pb2, health_pb2_grpc
    for name in ("health_pb2", "health_pb2_grpc"):
        sys.modules.pop(name, None)


def _server(*handlers):
    server = grpc.server(ThreadPoolExecutor(2), handlers=list(handlers))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _ask(stubs, address: str, service: str = "") -> int:
    pb2, pb2_grpc = stubs
    with grpc.insecure_channel(address) as ch:
        return pb2_grpc.HealthStub(ch).Check(pb2.HealthCheckRequest(service=service), timeout=5).status


def test_messages_are_protobufs_encoding(stubs):
    pb2, _ = stubs
    for service in ("", "kvconnect.hf3fs.Meta", "é" * 200):
        assert grpc_health.encode_request(service) == pb2.HealthCheckRequest(service=service).SerializeToString()
        assert grpc_health.decode_request(pb2.HealthCheckRequest(service=service).SerializeToString()) == service
    for status in (1, 2, 3):
        wire = pb2.HealthCheckResponse(status=status).SerializeToString()
        assert grpc_health.encode_response(status) == wire and grpc_health.decode_response(wire) == status


def test_the_generated_client_asks_our_handlers(stubs, tmp_path):
    up = {"now": True}
    server, address = _server(grpc_health.handler(("kvconnect.peer.Node",), serving=lambda: up["now"]))
    try:
        assert _ask(stubs, address) == _ask(stubs, address, "kvconnect.peer.Node") == grpc_health.SERVING
        up["now"] = False
        assert _ask(stubs, address) == grpc_health.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            _ask(stubs, address, "no.such.Service")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(0)

    from kvconnect.connectors.hf3fs import protocol as P
    from kvconnect.connectors.hf3fs.service import MetaServer

    srv = MetaServer("127.0.0.1", 0, str(tmp_path / "meta"), token="s3cret", fsync="never").start()
    try:  # the asyncio handler, no token (probes carry none)
        assert _ask(stubs, srv.address) == _ask(stubs, srv.address, P.SERVICE) == grpc_health.SERVING
    finally:
        srv.stop()


def test_our_client_asks_the_generated_servicer(stubs):
    pb2, pb2_grpc = stubs

    class Health(pb2_grpc.HealthServicer):
        def Check(self, request, context):
            status = pb2.HealthCheckResponse.NOT_SERVING if request.service == "down" else pb2.HealthCheckResponse.SERVING
            return pb2.HealthCheckResponse(status=status)

    server = grpc.server(ThreadPoolExecutor(2))
    pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert grpc_health.check(f"127.0.0.1:{port}") == grpc_health.SERVING
        assert grpc_health.check(f"127.0.0.1:{port}", "down") == grpc_health.NOT_SERVING
    finally:
        server.stop(0)
