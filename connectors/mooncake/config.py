"""Configuration of the Mooncake store: our JSON keys, SGLang's ``MOONCAKE_*`` variables.

Users who run SGLang's built-in ``mooncake`` backend already export ``MOONCAKE_MASTER``,
``MOONCAKE_PROTOCOL`` ... or point ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` at a JSON
file. The same setup works unchanged here. Precedence, lowest first:

  1. defaults below;
  2. ``MOONCAKE_*`` environment variables (``ENV_KEYS``);
  3. the JSON file named by the ``config_path`` option, else by
     ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` (SGLang's file format);
  4. the options given to the store (``--hicache-storage-backend-extra-config``, LMCache
     adapter params, CLI flags).

So an explicit option always wins, and a file beats the environment, as in SGLang.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.config import Size, StoreConfig, field_doc

WHERE = "store 'mooncake'"

# option key -> environment variables read for it (first one set wins)
ENV_KEYS: dict[str, tuple[str, ...]] = {
    "master_server_address": ("MOONCAKE_MASTER",),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER",),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME"),
    "protocol": ("MOONCAKE_PROTOCOL",),
    "device_name": ("MOONCAKE_DEVICE",),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE",),
    "tenant_id": ("MOONCAKE_TENANT_ID",),
    "call_mode": ("MOONCAKE_CALL_MODE",),
}
CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"

# Keys of SGLang's Mooncake config file that only steer SGLang's own backend and have
# no effect here; accepted (so the same file works) and ignored.
SGLANG_ONLY_KEYS = frozenset({"master_metrics_port", "check_server", "extra_backend_tag",
                              "enable_group_semantics"})
# SGLang keys naming modes this store does not implement: an error, not a silent drop.
UNSUPPORTED_KEYS = {
    "standalone_storage": "the standalone (dummy-client) mode; run a contributing store process instead",
    "client_server_address": "the standalone (dummy-client) mode; set master_server_address",
    "enable_ssd_offload": "Mooncake SSD offload",
    "ssd_offload_path": "Mooncake SSD offload",
}

PROTOCOLS = ("tcp", "rdma", "efa", "cxl", "nvlink", "nvlink_intra", "hip", "ascend")


@dataclass(frozen=True)
class MooncakeConfig(StoreConfig):
    master_server_address: str = field(default="", metadata=field_doc(
        "mooncake_master RPC address host:port (env MOONCAKE_MASTER); required"))
    metadata_server: str = field(default="P2PHANDSHAKE", metadata=field_doc(
        "Transfer Engine metadata: 'P2PHANDSHAKE', 'http://h:p/metadata' or etcd 'h:p' "
        "(env MOONCAKE_TE_META_DATA_SERVER)"))
    local_hostname: str = field(default="localhost", metadata=field_doc(
        "address peers use to reach this process (env MOONCAKE_LOCAL_HOSTNAME / LOCAL_HOSTNAME)"))
    protocol: Literal[PROTOCOLS] = field(default="rdma", metadata=field_doc(  # type: ignore[valid-type]
        "transport (env MOONCAKE_PROTOCOL); 'rdma' falls back to TCP where no RDMA NIC exists, "
        "as in SGLang"))
    device_name: str = field(default="", metadata=field_doc(
        "RDMA device(s), comma-separated, or a JSON map {tp_rank: devices} (env MOONCAKE_DEVICE)"))
    global_segment_size: Size = field(default=4 << 30, metadata=field_doc(
        "memory this process contributes to the store, e.g. '4gb'; 0 = a client that only "
        "reads and writes other processes' segments (env MOONCAKE_GLOBAL_SEGMENT_SIZE)"))
    local_buffer_size: Size = field(default=16 << 20, metadata=field_doc(
        "Mooncake's own transfer buffer (env MOONCAKE_LOCAL_BUFFER_SIZE); zero-copy I/O does "
        "not use it"))
    tenant_id: str = field(default="default", metadata=field_doc(
        "Mooncake tenant (env MOONCAKE_TENANT_ID)"))
    replica_num: int = field(default=1, metadata=field_doc("replicas per page"))
    prefer_local_segment: bool = field(default=False, metadata=field_doc(
        "put new pages into this process's own segment while it has room (Mooncake's "
        "preferred_segment), so this process reads them back with a local copy instead of a "
        "transfer; they leave the store with the process (keep replica_num > 1 or a standalone "
        "store process for pages that must outlive it); needs global_segment_size > 0"))
    local_copy: bool = field(default=True, metadata=field_doc(
        "read pages that lie in this process's own segment with kvconnect's parallel copy "
        "(KVCONNECT_COPY_THREADS threads) under the read lease Mooncake grants, instead of "
        "Mooncake's one memcpy thread; only with global_segment_size > 0"))
    lease_ttl: float = field(default=10.0, metadata=field_doc(
        "the master's --default_kv_lease_ttl in seconds; a local copy that ends later than "
        "half of it after its lease was granted is a miss (never possibly torn bytes)"))
    shared_segment: bool = field(default=False, metadata=field_doc(
        "lend global_segment_size from a file in shared memory (shared_segment_dir) and publish "
        "it, so kvconnect engines on the same host copy its pages instead of a Transfer Engine "
        "transfer (for a standalone store process; needs that much free space in /dev/shm)"))
    shared_segment_dir: str = field(default="/dev/shm/kvconnect-mooncake", metadata=field_doc(
        "where shared segments and their registry live (readers with local_copy look there)"))
    io_mode: Literal["direct", "staged"] = field(default="direct", metadata=field_doc(
        "'direct': zero-copy to/from registered caller memory (pages outside it are staged); "
        "'staged': every page goes through the store's registered staging buffer, so a call "
        "abandoned at its deadline can never touch caller memory later"))
    staging_size: Size = field(default=64 << 20, metadata=field_doc(
        "registered staging buffer for pages outside registered memory (and io_mode=staged)"))
    setup_timeout: float = field(default=10.0, metadata=field_doc(
        "seconds to connect to the master at start before BackendUnavailable"))
    op_timeout: float = field(default=5.0, metadata=field_doc(
        "per-call deadline in seconds; a call past it returns misses / failed writes"))
    call_mode: Literal["worker", "inline"] = field(default="worker", metadata=field_doc(
        "'worker': Mooncake calls run on io_threads worker threads, so the caller gets its "
        "answer at op_timeout at the latest (a call past it is abandoned and may finish "
        "later); lookups (exists: one master RPC) run on the caller's thread where op_timeout "
        ">= 5 s, bounded by Mooncake's RPC timeouts (op_timeout / 2, set unless the user did) "
        "and its ~4.5 s give-up on a dead master; 'inline': every call on the caller's thread "
        "(no thread hand-off, no abandoned calls), "
        "bounded by Mooncake's own timeouts, which kvconnect derives from op_timeout unless "
        "set (MC_TCP_PROGRESS_TIMEOUT_SEC, MC_RPC_TIMEOUT_MS, ...; env MOONCAKE_CALL_MODE)"))
    lease_wait: float = field(default=12.0, metadata=field_doc(
        "seconds delete/clear wait for a read/write lease to lapse (the master's "
        "--default_kv_lease_ttl, 10 s by default, plus a margin)"))
    master_metrics: str = field(default="auto", metadata=field_doc(
        "the master's metrics endpoint (mooncake_master --metrics_port), read for the "
        "cluster's used and capacity bytes in stats(): 'auto' = the master's host, port "
        "9003 (mooncake_master's default); 'host:port' or an http:// URL; '' = not asked "
        "(stats() then reports no bytes)"))
    reconnect_interval: float = field(default=2.0, metadata=field_doc(
        "seconds between health checks while the master is unreachable"))
    io_threads: int = field(default=4, metadata=field_doc(
        "threads that run Mooncake calls under their deadline"))
    tp_rank: int = field(default=0, metadata=field_doc(
        "the rank whose devices a JSON device_name map gives when no engine says its own"))
    config_path: str = field(default="", metadata=field_doc(
        f"SGLang-format JSON config file (default: ${CONFIG_PATH_ENV})"))

    def __post_init__(self) -> None:
        if not self.master_server_address:
            raise ConfigError("master_server_address",
                              "is required (or set MOONCAKE_MASTER)", "host:port", WHERE)
        host, _, port = self.master_server_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("master_server_address",
                              f"expected host:port, got {self.master_server_address!r}", "host:port", WHERE)
        for key in ("setup_timeout", "op_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}", None, WHERE)
        if not self.lease_ttl > 0:
            raise ConfigError("lease_ttl", f"must be > 0, got {self.lease_ttl}", None, WHERE)
        for key in ("lease_wait", "reconnect_interval"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}", None, WHERE)
        if self.replica_num < 1:
            raise ConfigError("replica_num", f"must be >= 1, got {self.replica_num}", None, WHERE)
        if self.prefer_local_segment and self.global_segment_size <= 0:
            raise ConfigError("prefer_local_segment", "needs a segment of this process's own "
                              "(global_segment_size > 0)", None, WHERE)
        if self.shared_segment and self.global_segment_size <= 0:
            raise ConfigError("shared_segment", "needs memory to lend (global_segment_size > 0)", None, WHERE)
        if self.io_threads < 1:
            raise ConfigError("io_threads", f"must be >= 1, got {self.io_threads}", None, WHERE)
        if self.staging_size < (1 << 20):
            raise ConfigError("staging_size", f"must be at least 1mb, got {self.staging_size}", None, WHERE)
        self.rdma_devices()  # validates a JSON device map

    def rdma_devices(self, tp_rank: int | None = None) -> str:
        """The device list Mooncake's setup takes, resolving a per-rank JSON map by ``tp_rank``
        (the engine's; ``self.tp_rank`` when no engine said)."""
        name = self.device_name.strip()
        if not name.startswith("{"):
            return name
        try:
            table = json.loads(name)
        except json.JSONDecodeError as e:
            raise ConfigError("device_name", f"not valid JSON: {e}",
                              "device names, comma-separated, or a JSON map {tp_rank: devices}", WHERE) from e
        if not isinstance(table, dict):
            raise ConfigError("device_name", "a JSON device map must be an object", None, WHERE)
        rank = self.tp_rank if tp_rank is None else tp_rank
        value = table.get(str(rank), table.get(rank, ""))  # type: ignore[call-overload]
        return str(value or "")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError("config_path", f"cannot read {path!r}: {e}", None, WHERE) from e
    except json.JSONDecodeError as e:
        raise ConfigError("config_path", f"{path!r} is not valid JSON: {e}", None, WHERE) from e
    if not isinstance(data, dict):
        raise ConfigError("config_path", f"{path!r} must hold a JSON object", None, WHERE)
    return data


def merged_options(options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Options after applying environment, config file and explicit options (in that order)."""
    env = os.environ if environ is None else environ
    options = dict(options or {})
    merged: dict[str, Any] = {}
    for key, names in ENV_KEYS.items():
        for name in names:
            value = env.get(name)
            if value not in (None, ""):
                merged[key] = value
                break
    path = options.get("config_path") or env.get(CONFIG_PATH_ENV) or ""
    if path:
        from_file = _read_file(str(path))
        merged.update({k: v for k, v in from_file.items() if k not in SGLANG_ONLY_KEYS})
    merged.update(options)
    for key, what in UNSUPPORTED_KEYS.items():
        value = merged.get(key)
        if value not in (None, "", False, 0, "false", "False", "0"):
            raise ConfigError(key, f"{what} is not supported by kvconnect's mooncake store", None, WHERE)
        merged.pop(key, None)
    return merged
