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
from typing import Any, Literal, Mapping

from kvconnect.connectors.auth import env_var, resolve_token
from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.config import Size, StoreConfig, field_doc

ENV_CONFIG_PATH = "SGLANG_HICACHE_HF3FS_CONFIG_PATH"
ENV_TOKEN = env_var("hf3fs")

# SGLang extra-config keys that reach a storage backend but are not store options.
SGLANG_PASSTHROUGH_KEYS = ("use_mock_hf3fs_client",)


@dataclass(frozen=True)
class HF3FSConfig(StoreConfig):
    # -- SGLang's hf3fs keys (same names, same meaning) ------------------------------
    file_path_prefix: str = field(metadata=field_doc("data file prefix; the file is {prefix}.{rank}.bin"))
    file_size: Size = field(metadata=field_doc("bytes per data file ('1tb' style accepted)"))
    numjobs: int = field(metadata=field_doc("I/O worker threads (and usrbio rings) per store"))
    entries: int = field(metadata=field_doc("pages per I/O submission (one worker task)"))
    metadata_server_url: str | None = field(default=None, metadata=field_doc(
        "metadata service address (http://host:port, grpc://host:port or host:port); "
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
    meta_retries: int = field(default=3, metadata=field_doc("metadata RPC attempts before a miss"))
    fsync_data: bool = field(default=False, metadata=field_doc(
        "fdatasync the data file before confirming a write (power-loss safety)"))
    use_mock_hf3fs_client: bool = field(default=False, metadata=field_doc(
        "SGLang's test switch; here: force the POSIX client"))

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
        if self.metadata_server_url is not None:
            parse_meta_url(self.metadata_server_url)

    def token(self) -> str | None:
        """The shared secret: ``auth_token``, else ``auth_token_file``, else the env var."""
        return resolve_token(self.auth_token, self.auth_token_file, "hf3fs")


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
