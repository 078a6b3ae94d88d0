"""Redis URLs, read strictly: one URL language for every Redis the package talks to (the HF3FS
page index, the peer pool's membership registry).

    redis://[user@]host:port[/db]                 rediss://... (TLS)
    redis+sentinel://[user@]host:port,.../master-name[/db]
    redis+cluster://[user@]host:port,host:port,...

A password never goes in the URL (it belongs in a file the store's config names). Errors are
``ConfigError`` naming the config key the URL came from (``key``) and the accepted forms.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.connectors.base import ConfigError

SCHEMES = ("redis", "rediss", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
URL_FORMS = ("redis://[user@]host:port[/db]", "rediss://[user@]host:port[/db]",
             "redis+sentinel://[user@]host:port,host:port,.../master-name[/db]",
             "rediss+sentinel://[user@]host:port,.../master-name[/db]",
             "redis+cluster://[user@]host:port,host:port,...")
DEFAULT_KEY = "metadata_server_url"
# where the password of a URL from each key goes instead
PASSWORD_KEYS = {"metadata_server_url": "auth_token_file", "membership_url": "membership_password_file"}


def is_redis_url(url: str | None) -> bool:
    return bool(url) and url.strip().lower().split("://", 1)[0] in SCHEMES and "://" in url


@dataclass(frozen=True)
class RedisURL:
    tls: bool
    sentinel: bool
    hosts: tuple[tuple[str, int], ...]
    master: str | None
    db: int
    username: str | None
    cluster: bool = False

    def describe(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        scheme = ("rediss" if self.tls else "redis") + ("+sentinel" if self.sentinel else "") + \
            ("+cluster" if self.cluster else "")
        return f"{scheme}://{hosts}" + (f"/{self.master}" if self.master else "") + (f"/{self.db}" if self.db else "")


def _host_port(item: str, default: int, url: str, key: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, ""
    if not host:
        raise ConfigError(key, f"no host in {url!r}", URL_FORMS)
    if port == "":
        return host, default
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, f"bad port {port!r} in {url!r}", URL_FORMS)
    return host, int(port)


def parse_redis_url(url: str, key: str = DEFAULT_KEY) -> RedisURL:
    """A ``redis[s][+sentinel]://`` or ``redis+cluster://`` URL read strictly: a ``ConfigError`` naming
    ``key`` and the accepted forms for anything else (a password in the URL
    included: it belongs in ``auth_token_file``)."""
    raw = url.strip()
    scheme, sep, rest = raw.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ConfigError(key, f"{url!r} is not a Redis URL", URL_FORMS)
    if "?" in rest or "#" in rest:
        raise ConfigError(key, f"{url!r}: query parameters are not read (use the store's config keys)", URL_FORMS)
    netloc, _, path = rest.partition("/")
    username = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        if ":" in userinfo:
            raise ConfigError(key, "a password in the URL is refused: put it in the file named by "
                                   f"{PASSWORD_KEYS.get(key, 'the password file key')!r} (the URL may name the ACL user)", URL_FORMS)
        username = userinfo or None
    sentinel = scheme.endswith("+sentinel")
    cluster = scheme.endswith("+cluster")
    if cluster and scheme.startswith("rediss"):
        raise ConfigError(key, f"{url!r}: TLS to a Redis Cluster is not supported; use redis+cluster:// on a "
                               "private network, or rediss+sentinel://", URL_FORMS)
    items = [h for h in netloc.split(",")]
    if not netloc or any(not h.strip() for h in items):
        raise ConfigError(key, f"no host in {url!r}", URL_FORMS)
    if not (sentinel or cluster) and len(items) > 1:
        raise ConfigError(key, f"{url!r} names several hosts: use redis+sentinel:// for a replicated index "
                               "or redis+cluster:// for a sharded one", URL_FORMS)
    hosts = tuple(_host_port(h, 26379 if sentinel else 6379, url, key) for h in items)
    parts = [p for p in path.split("/") if p] if path else []
    master = None
    if sentinel:
        if not parts:
            raise ConfigError(key, f"{url!r} names no Sentinel master (…/master-name)", URL_FORMS)
        master = parts.pop(0)
    if cluster and parts:
        raise ConfigError(key, f"{url!r}: a Redis Cluster has one database and no master name: nothing may "
                               "follow the hosts", URL_FORMS)
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise ConfigError(key, f"{url!r}: the path after the host must be a database number", URL_FORMS)
    return RedisURL(tls=scheme.startswith("rediss"), sentinel=sentinel, hosts=hosts, master=master,
                    db=int(parts[0]) if parts else 0, username=username, cluster=cluster)
