"""The shared page index a store talks to, chosen by ``metadata_server_url``.

``kvconnect hf3fs-meta serve`` (``http://``, ``grpc://`` or ``host:port``; ``RemoteMetadata``)
or Redis / Valkey (``redis://``, ``rediss://``, ``redis+sentinel://``; ``RedisMetadata``).
Both implement ``MetadataClient``, so the store never asks which one it has; what differs is
a property of the client (``may_serve_stale``), not a branch in the store.
"""

from __future__ import annotations

from kvconnect.connectors.base import BackendUnavailable, ConfigError
from kvconnect.connectors.hf3fs.client import AuthError, MetadataClient, MetadataError
from kvconnect.connectors.hf3fs.config import HF3FSConfig, parse_meta_url
from kvconnect.connectors.hf3fs.redis_index import is_redis_url


def connect_metadata(config: HF3FSConfig, ns: str) -> MetadataClient:
    """A connected client of ``config.metadata_server_url`` (one authenticated round trip
    done): ``ConfigError`` for bad credentials, ``BackendUnavailable`` when unreachable."""
    url = config.metadata_server_url
    if is_redis_url(url):
        from kvconnect.connectors.hf3fs.redis_index import RedisMetadata

        client: MetadataClient = RedisMetadata(
            url, config.token(), timeout=config.client_timeout, retries=config.meta_retries,
            wait_replicas=config.metadata_wait_replicas, wait_timeout=config.metadata_wait_timeout,
            key_prefix=config.metadata_key_prefix, tls_ca_file=config.metadata_tls_ca_file,
            tls_cert_file=config.metadata_tls_cert_file, tls_key_file=config.metadata_tls_key_file,
            sentinel_auth=config.metadata_sentinel_auth)
    else:
        from kvconnect.connectors.hf3fs.client import RemoteMetadata

        client = RemoteMetadata(parse_meta_url(url), config.token(), timeout=config.client_timeout,
                                retries=config.meta_retries)
    try:
        client.connect()
        client.initialize(ns, 0, 0)  # authenticated round trip
    except AuthError as e:
        client.close()
        raise ConfigError("auth_token", str(e)) from e
    except (MetadataError, BackendUnavailable) as e:
        client.close()
        if not is_redis_url(url) and _answers_http(parse_meta_url(url)):
            raise ConfigError(
                "metadata_server_url",
                f"{url} answers plain HTTP, not kvconnect's gRPC metadata service: it looks like SGLang's "
                "mini_3fs_metadata_server, whose API kvconnect does not speak. Run "
                "'kvconnect hf3fs-meta serve --host HOST --port PORT --data-dir DIR' (it also takes that "
                "server's --persistence-path / --save-interval flags) and point metadata_server_url at it",
                "http://HOST:PORT of 'kvconnect hf3fs-meta serve', or redis://...") from e
        if isinstance(e, BackendUnavailable):
            raise
        raise BackendUnavailable("hf3fs", f"{e} (config key 'metadata_server_url')") from e
    except BaseException:
        client.close()
        raise
    return client


def _answers_http(address: str, timeout: float = 1.0) -> bool:
    """Whether ``host:port`` answers an HTTP/1.0 request (our service speaks only gRPC there)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            return s.recv(5) == b"HTTP/"
    except (OSError, ValueError):
        return False
