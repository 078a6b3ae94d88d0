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
    except MetadataError as e:
        client.close()
        raise BackendUnavailable("hf3fs", f"{e} (config key 'metadata_server_url')") from e
    except BaseException:
        client.close()
        raise
    return client
