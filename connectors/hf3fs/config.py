"""HF3FS store configuration: SGLang's hf3fs JSON, unchanged, plus kvconnect's own keys.

Sources, later ones override earlier ones:

1. the JSON file named by ``config_path`` (an option) or, when absent, by the env var
   ``SGLANG_HICACHE_HF3FS_CONFIG_PATH`` (SGLang's own variable, so an existing deployment's
   file works as is);
2. inline options (SGLang's ``--hicache-storage-backend-extra-config`` keys, LMCache adapter
   params, ``create_store("hf3fs", {...})``).

SGLang's keys keep their meaning: ``file_path_prefix`` (file ``{prefix}.{rank}.bin``),
``file_size`` (bytes per file), ``numjobs`` (I/O workers), ``entries`` (pages per I/O
submission), ``metadata_server_url`` (absent: an in-process index), ``client_timeout``.
Unlike SGLang there is no silent fallback to ``/data/hicache.{rank}.bin``: a missing
required key is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping

from kvconnect.connectors.auth import env_var, resolve_token
from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.config import Range, Size, StoreConfig, field_doc

ENV_CONFIG_PATH = "SGLANG_HICACHE_HF3FS_CONFIG_PATH"
ENV_TOKEN = env_var("hf3fs")

# SGLang extra-config keys that reach a storage backend but are not store options.
SGLANG_PASSTHROUGH_KEYS = ("use_mock_hf3fs_client",)


@dataclass(frozen=True)
class HF3FSConfig(StoreConfig):
    # -- SGLang's hf3fs keys (same names, same meaning) ------------------------------
    file_path_prefix: str = field(metadata=field_doc("data file prefix; the file is {prefix}.{rank}.bin"))
    file_size: Size = field(metadata=field_doc("bytes per data file ('1tb' style accepted)"))
    numjobs: Annotated[int, Range(1, 1024)] = field(metadata=field_doc("I/O worker threads (and usrbio rings) per store"))
    entries: Annotated[int, Range(1, 65536)] = field(metadata=field_doc("pages per I/O submission (one worker task)"))
    metadata_server_url: str | None = field(default=None, metadata=field_doc(
        "page index: the kvconnect metadata service (http://host:port, grpc://host:port or host:port), "
        "or Redis/Valkey (redis://[user@]host:port[/db], rediss://... with TLS, "
        "redis+sentinel://[user@]host:port,host:port,.../master-name[/db], "
        "redis+cluster://[user@]host:port,host:port,... for Redis Cluster); "
        "absent: an in-process index (single process per file)"))
    client_timeout: float = field(default=5.0, metadata=field_doc(
        "seconds: metadata RPC deadline and usrbio I/O wait"))
    # -- kvconnect keys ---------------------------------------------------------------
    config_path: str | None = field(default=None, metadata=field_doc(
        f"SGLang hf3fs JSON file (default: ${ENV_CONFIG_PATH})"))
    auth_token: str | None = field(default=None, metadata=field_doc(
        f"shared secret for the metadata service (default: ${ENV_TOKEN})"))
    auth_token_file: str | None = field(default=None, metadata=field_doc("file holding the shared secret"))
    checksums: bool = field(default=False, metadata=field_doc(
        "CRC32 of every page kept in the index and checked after each read"))
    client: Literal["auto", "posix", "usrbio"] = field(default="auto", metadata=field_doc(
        "file client: usrbio (hf3fs_fuse.io) on a 3FS mount, posix elsewhere"))
    posix_read: Literal["auto", "mmap", "preadv"] = field(default="auto", metadata=field_doc(
        "POSIX client reads: memcpy from a shared mapping of the file, or preadv "
        "(auto: mmap on local file systems)"))
    posix_write: Literal["auto", "direct", "staged"] = field(default="auto", metadata=field_doc(
        "POSIX client writes: pwritev straight from the pages, or staged through a small "
        "per-worker buffer (auto: staged with one file, two or more workers and cores)"))
    posix_files: int = field(default=1, metadata=field_doc(
        "POSIX client: data files per rank (and page size); more than 1 stripes pages over "
        "{file}.x{n}, {file}.x{n}.1, ... so that writes to different files run in parallel"))
    page_bytes: Size | None = field(default=None, metadata=field_doc(
        "bytes per page; default: the engine's page size (or the first page written)"))
    meta_retries: Annotated[int, Range(1, 100)] = field(default=3, metadata=field_doc("metadata RPC attempts before a miss"))
    fsync_data: bool = field(default=False, metadata=field_doc(
        "fdatasync the data file before confirming a write (power-loss safety)"))
    use_mock_hf3fs_client: bool = field(default=False, metadata=field_doc(
        "SGLang's test switch; here: force the POSIX client"))
    verify_pages: Literal["auto", "on", "off"] = field(default="auto", metadata=field_doc(
        "keep each page's identity (key hash + slot generation) in a sidecar file {file}.ids and check it "
        "around every read: an index entry that the file does not match (a Redis failover, a copied data "
        "dir, per-host files under one index) is a miss, never another key's bytes (auto: on with a "
        "metadata service or redis index, off with the in-process index)"))
    # -- Redis / Valkey page index (metadata_server_url redis://, rediss://, redis+sentinel://) -----
    metadata_wait_replicas: int = field(default=0, metadata=field_doc(
        "redis index: WAIT for this many replicas to acknowledge each confirm; a write they do not "
        "acknowledge in time fails (0: asynchronous replication)"))
    metadata_wait_timeout: float = field(default=0.5, metadata=field_doc(
        "redis index: seconds a confirm waits for metadata_wait_replicas"))
    metadata_key_prefix: str = field(default="kvc:hf3fs", metadata=field_doc(
        "redis index: prefix of every Redis key (deployments sharing a server use different prefixes)"))
    metadata_tls_ca_file: str | None = field(default=None, metadata=field_doc(
        "redis index over rediss://: CA certificate file (default: the system's trust store)"))
    metadata_tls_cert_file: str | None = field(default=None, metadata=field_doc(
        "redis index over rediss://: client certificate file (mutual TLS)"))
    metadata_tls_key_file: str | None = field(default=None, metadata=field_doc(
        "redis index over rediss://: client private key file (mutual TLS)"))
    metadata_sentinel_auth: bool = field(default=False, metadata=field_doc(
        "redis index: send the ACL user and password to the sentinels too"))

    def __post_init__(self) -> None:
        where = "store 'hf3fs'"
        if not self.file_path_prefix:
            raise ConfigError("file_path_prefix", "must not be empty", None, where)
        if self.file_size <= 0:
            raise ConfigError("file_size", f"must be > 0, got {self.file_size}", None, where)
        if self.numjobs < 1:
            raise ConfigError("numjobs", f"must be >= 1, got {self.numjobs}", None, where)
        if self.entries < 1:
            raise ConfigError("entries", f"must be >= 1, got {self.entries}", None, where)
        if self.client_timeout <= 0:
            raise ConfigError("client_timeout", f"must be > 0, got {self.client_timeout}", None, where)
        if not 1 <= self.posix_files <= 64:
            raise ConfigError("posix_files", f"must be between 1 and 64, got {self.posix_files}", None, where)
        if self.meta_retries < 1:
            raise ConfigError("meta_retries", f"must be >= 1, got {self.meta_retries}", None, where)
        if self.page_bytes is not None and self.page_bytes <= 0:
            raise ConfigError("page_bytes", f"must be > 0, got {self.page_bytes}", None, where)
        if self.page_bytes is not None and self.file_size // self.page_bytes < 1:
            raise ConfigError("file_size", f"{self.file_size} bytes hold no page of {self.page_bytes} bytes",
                              None, where)
        if self.page_bytes is not None:
            check_page_count(self.file_size, self.page_bytes, where)
        if self.metadata_server_url is not None:
            check_meta_url(self.metadata_server_url)
        _check_redis_keys(self, where)

    def token(self) -> str | None:
        """The shared secret: ``auth_token``, else ``auth_token_file``, else the env var."""
        return resolve_token(self.auth_token, self.auth_token_file, "hf3fs")


def check_page_count(file_size: int, page_bytes: int, where: str | None = "store 'hf3fs'") -> None:
    """A ``ConfigError`` (naming ``file_size``) for a file of more pages than an index holds."""
    from kvconnect.connectors.hf3fs.index import MAX_PAGES

    if file_size // page_bytes > MAX_PAGES:
        raise ConfigError("file_size", f"{file_size} bytes are {file_size // page_bytes} pages of {page_bytes} bytes",
                          f"at most {MAX_PAGES} pages per file: file_size <= {MAX_PAGES * page_bytes} "
                          f"for pages of {page_bytes} bytes (the index keeps ~40 bytes per page)", where)


def check_meta_url(url: str) -> None:
    """A ``ConfigError`` (naming ``metadata_server_url``) unless ``url`` is a kvconnect
    service address or a Redis URL."""
    from kvconnect.connectors.hf3fs.redis_index import is_redis_url, parse_redis_url

    if is_redis_url(url):
        parse_redis_url(url)
    else:
        parse_meta_url(url)


REDIS_ONLY_KEYS = ("metadata_wait_replicas", "metadata_tls_ca_file", "metadata_tls_cert_file", "metadata_tls_key_file",
                   "metadata_sentinel_auth")


def _check_redis_keys(cfg: "HF3FSConfig", where: str) -> None:
    from kvconnect.connectors.hf3fs.redis_index import is_redis_url, parse_redis_url

    url = cfg.metadata_server_url
    redis = is_redis_url(url)
    for key in REDIS_ONLY_KEYS:
        if getattr(cfg, key) and not redis:
            raise ConfigError(key, "applies to a Redis page index only",
                              "a metadata_server_url of redis://, rediss://, redis+sentinel://, rediss+sentinel:// or "
                              "redis+cluster://", where)
    if redis and cfg.metadata_sentinel_auth and parse_redis_url(url).cluster:
        raise ConfigError("metadata_sentinel_auth", "a redis+cluster:// index has no sentinels",
                          "false, or a redis+sentinel:// metadata_server_url", where)
    if cfg.metadata_wait_replicas < 0:
        raise ConfigError("metadata_wait_replicas", f"must be >= 0, got {cfg.metadata_wait_replicas}", None, where)
    too_long = cfg.metadata_wait_replicas and cfg.metadata_wait_timeout >= cfg.client_timeout
    if cfg.metadata_wait_timeout <= 0 or too_long:
        raise ConfigError("metadata_wait_timeout", f"must be > 0 and below client_timeout ({cfg.client_timeout:g} s), "
                          f"got {cfg.metadata_wait_timeout:g}", None, where)
    if not cfg.metadata_key_prefix or any(c in cfg.metadata_key_prefix for c in "{}\n "):
        raise ConfigError("metadata_key_prefix", f"{cfg.metadata_key_prefix!r}: must be non-empty, without braces, "
                          "spaces or newlines", None, where)
    tls_files = (cfg.metadata_tls_ca_file, cfg.metadata_tls_cert_file, cfg.metadata_tls_key_file)
    if redis and any(tls_files) and not parse_redis_url(url).tls:
        key = REDIS_ONLY_KEYS[1 + [bool(f) for f in tls_files].index(True)]
        raise ConfigError(key, "TLS files need a rediss:// or rediss+sentinel:// metadata_server_url", None, where)
    if bool(cfg.metadata_tls_cert_file) != bool(cfg.metadata_tls_key_file):
        raise ConfigError("metadata_tls_key_file" if cfg.metadata_tls_cert_file else "metadata_tls_cert_file",
                          "a client certificate needs both metadata_tls_cert_file and metadata_tls_key_file", None,
                          where)
    for key, path in zip(REDIS_ONLY_KEYS[1:4], tls_files):
        if path and not os.path.isfile(path):
            raise ConfigError(key, f"no such file: {path!r}", None, where)


def parse_meta_url(url: str) -> str:
    """``host:port`` for gRPC from SGLang's ``http://host:port`` (or grpc://, or bare)."""
    rest = url.strip()
    for scheme in ("http://", "https://", "grpc://"):
        if rest.lower().startswith(scheme):
            rest = rest[len(scheme):]
            break
    rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in rest:
        raise ConfigError("metadata_server_url", f"cannot read {url!r} as an address",
                          "http://host:port, grpc://host:port or host:port")
    return f"{host}:{port}"


def merged_options(options: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The SGLang JSON file's keys overlaid with inline ``options``."""
    env = os.environ if env is None else env
    opts = dict(options or {})
    path = opts.get("config_path") or env.get(ENV_CONFIG_PATH)
    if not path:
        return opts
    key = "config_path" if opts.get("config_path") else ENV_CONFIG_PATH
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(key, f"cannot read {path!r}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(key, f"{path!r} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigError(key, f"{path!r} must hold a JSON object")
    merged = {**doc, **opts}
    merged["config_path"] = path
    return merged
