"""gRPC settings every kvconnect control plane shares (the HF3FS metadata service and its
clients, the peer pool's nodes): one place for listener and channel options, the token check
that runs before a request body is read, and the warning for an open control plane.

* Listeners never share a port: gRPC sets ``SO_REUSEPORT`` by default, so a second process
  binding a taken port would succeed and split the callers between two servers.
* Channels reconnect within ~1 s of a service coming back (gRPC's default backoff grows to
  minutes; its minimum connect backoff is 20 s).
* A call without the right token is refused from its metadata, before its (up to 64 MiB)
  body is read or decoded: unauthenticated callers cannot make the server buffer bodies.
* Connections are bounded before any token is seen: a TCP connection that has not finished its
  HTTP/2 handshake within ``HANDSHAKE_TIMEOUT_MS`` is closed, and a listener accepts at most
  ``connection_limit()`` connections (the open-file limit less a reserve), closing the rest at
  once. Idle sockets then cannot use up the process's descriptors and lock every client out;
  a refused client gets UNAVAILABLE (a miss) and is served once the idle ones are closed.
  A connection idle (no call in flight) for ``IDLE_CLOSE_MS`` is closed too: one that finished
  the handshake holds a slot only that long; kvconnect's channels reconnect on the next call.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any, Iterable

import grpc

from kvconnect.connectors.auth import AUTH_HEADER, token_matches

log = logging.getLogger("kvconnect.rpc")

MAX_MESSAGE = 64 << 20

SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
)

CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    # gRPC's minimum connect timeout (despite the name): a handshake gets at least this long
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.enable_http_proxy", 0),
)


HANDSHAKE_TIMEOUT_MS = 2000  # as the framed port's HELLO deadline
IDLE_CLOSE_MS = 120_000
# descriptors kept back from gRPC connections for everything else the process opens: data files,
# the journal, the framed port's unauthenticated connections (256 at most), an engine's own files
RESERVED_FDS = 320


def connection_limit() -> int | None:
    """Connections one listener accepts: the open-file soft limit less ``RESERVED_FDS`` (at
    least a quarter of it is kept back), at least 16; None where there is no limit."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    return max(16, soft - max(RESERVED_FDS, soft // 4))


def server_options(extra: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Listener options, read when the server is built (after ``raise_nofile_limit``)."""
    limit = connection_limit()
    bounds = [("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS), ("grpc.max_connection_idle_ms", IDLE_CLOSE_MS)]
    if limit is not None:
        bounds.append(("grpc.max_allowed_incoming_connections", limit))
    return [*SERVER_OPTIONS, *bounds, *extra]


def channel(target: str, extra: Iterable[tuple[str, Any]] = ()) -> grpc.Channel:
    """An insecure channel with kvconnect's reconnect and size settings.

    gRPC Python moves a channel's I/O (a reconnect's TCP and HTTP/2 handshakes) only while some
    thread waits on the channel; between calls a reconnect stalls until its connect deadline
    and is retried after a backoff, which made clients miss for ~5 s after a service restart.
    A connectivity watcher (one gRPC-owned thread per channel) keeps it moving."""
    ch = grpc.insecure_channel(target, options=[*CHANNEL_OPTIONS, *extra])
    ch.subscribe(_ignore, try_to_connect=False)
    return ch


def _ignore(_state: Any) -> None:
    pass


def close_channels(channels: Iterable[grpc.Channel]) -> None:
    """Close channels made by ``channel()``. Their watchers stop first: gRPC's close does not
    wait for a watcher inside its 0.2 s poll, which then dies with 'Channel closed!'."""
    channels = list(channels)
    for ch in channels:
        ch.unsubscribe(_ignore)
    deadline = time.monotonic() + 0.5
    for ch in channels:
        state = getattr(ch, "_connectivity_state", None)  # gRPC internals; absent: no wait
        while getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)
        ch.close()


# Answered without a token: load balancers and orchestrators probe health without secrets.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


def _presents(metadata: Any, token: str | None) -> bool:
    if not token:
        return True
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            return token_matches(f"Bearer {token}", value)
    return False


def _refusal(aio: bool) -> grpc.RpcMethodHandler:
    # A stream-request handler that never iterates its requests: the body is not read.
    msg = "missing or wrong token (auth_token / auth_token_file)"
    if aio:
        async def refuse_async(_requests, ctx):
            await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        return grpc.stream_unary_rpc_method_handler(refuse_async)

    def refuse(_requests, ctx):
        ctx.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
    return grpc.stream_unary_rpc_method_handler(refuse)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token from their metadata (no token configured: none)."""

    def __init__(self, token: str | None):
        self.token = token or None
        self._refuse = _refusal(aio=False)

    def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS or _presents(details.invocation_metadata, self.token):
            return continuation(details)
        return self._refuse


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """``AuthInterceptor`` for ``grpc.aio`` servers."""

    def __init__(self, token: str | None):
        self.token = token or None
        self._refuse = _refusal(aio=True)

    async def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS or _presents(details.invocation_metadata, self.token):
            return await continuation(details)
        return self._refuse


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(what: str, host: str, token: str | None, logger: logging.Logger = log) -> bool:
    """Log a WARNING when a control plane listens beyond loopback without a token; True if so.
    On loopback without a token an INFO line says that every local user may use it."""
    if token:
        return False
    if is_loopback(host):
        logger.info("%s listens on %s without an auth token: every user of this host can read, write and "
                    "clear the cache through it (set a token to keep other local users out)", what, host)
        return False
    logger.warning("%s listens on %s with NO auth token: anyone who reaches this address can read, "
                   "write and clear the cache. Set a token (--auth-token-file FILE, auth_token_file, or "
                   "$KVCONNECT_<PART>_TOKEN) or bind 127.0.0.1.", what, host or "0.0.0.0")
    return True


def raise_nofile_limit(logger: logging.Logger = log) -> int:
    """Raise this process's open-file soft limit to its hard limit (a service holds one
    descriptor per client connection; 1024 is a common default). Returns the soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("open-file limit raised from %d to %d (RLIMIT_NOFILE)", soft, target)
            return target
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open-file limit from %d: %s", soft, e)
    return soft
