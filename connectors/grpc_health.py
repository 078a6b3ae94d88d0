"""The standard gRPC health checking protocol (``grpc.health.v1.Health/Check``), by hand.

Load balancers, Kubernetes' ``grpc`` probes and ``grpc_health_probe`` ask it. The
``grpcio-health-checking`` package is not a dependency, so the two tiny messages are
encoded here (their wire format is fixed): ``HealthCheckRequest{string service = 1}`` and
``HealthCheckResponse{ServingStatus status = 1}``. The check needs no token (it says only
whether the server answers), as probes send none. ``Watch`` is not served.

Why by hand: that package would bring ``protobuf`` and its generated modules into every
install of the ``hf3fs`` and ``peer`` extras, whose own messages are raw bytes (no protobuf
anywhere else in the product), and its servicer keeps a status table we would have to feed;
what is served is one unary method of two one-field messages, which this module encodes in
~60 lines. That it is the standard wire format is tested, not assumed:
``tests/unit/test_grpc_health.py`` compiles the standard ``health.proto`` with grpcio-tools
(the ``dev`` extra), checks both messages byte for byte against protobuf's encoding, has the
generated ``HealthStub`` ask the peer nodes' and the metadata service's handlers, and this
module's ``check`` ask a server of the generated ``HealthServicer``.
"""

from __future__ import annotations

from typing import Callable

SERVICE = "grpc.health.v1.Health"
CHECK = f"/{SERVICE}/Check"
SERVING, NOT_SERVING = 1, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def encode_request(service: str = "") -> bytes:
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_request(data: bytes) -> str:
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        if tag & 7 == 2:
            n, i = _read_varint(data, i)
            if tag >> 3 == 1:
                return data[i:i + n].decode()
            i += n
        elif tag & 7 == 0:
            _, i = _read_varint(data, i)
        else:
            raise ValueError(f"unexpected wire type {tag & 7}")
    return ""


def encode_response(status: int) -> bytes:
    return b"\x08" + _varint(status)


def decode_response(data: bytes) -> int:
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        v, i = _read_varint(data, i)
        if tag == 0x08:
            return v
    return 0  # UNKNOWN


def handler(services: tuple[str, ...], serving: Callable[[], bool] = lambda: True, aio: bool = False):
    """A generic handler answering ``Check`` for ``""`` (the whole server) and ``services``."""
    import grpc

    def status(req: bytes) -> int | None:
        name = decode_request(req)
        if name and name not in services:
            return None
        return SERVING if serving() else NOT_SERVING

    if aio:
        async def check(req: bytes, ctx) -> bytes:
            st = status(req)
            if st is None:
                await ctx.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            return encode_response(st)
    else:
        def check(req: bytes, ctx) -> bytes:  # type: ignore[misc]
            st = status(req)
            if st is None:
                ctx.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
            return encode_response(st)

    return grpc.method_handlers_generic_handler(SERVICE, {"Check": grpc.unary_unary_rpc_method_handler(check)})


def check(target: str, service: str = "", timeout: float = 2.0) -> int:
    """Ask ``target`` (host:port) ``Check``; the ``ServingStatus`` (1 SERVING, 2 NOT_SERVING)."""
    import grpc

    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(CHECK, request_serializer=None, response_deserializer=None)
        return decode_response(call(encode_request(service), timeout=timeout))
