"""Options of the ``peer_rdma`` store (SGLang extra-config names where the peer-pool deployment guide has them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from kvconnect.connectors.config import Range, Size, StoreConfig, field_doc


@dataclass(frozen=True)
class PeerRdmaConfig(StoreConfig):
    discovery_addr: str = field(default="127.0.0.1:31998", metadata=field_doc(
        "seed control addresses host:port, comma-separated; any live member works as a seed"))
    protocol: Literal["rdma", "tcp"] = field(default="rdma", metadata=field_doc(
        "Transfer Engine protocol; the engine uses RDMA where it finds a NIC, TCP otherwise"))
    device_name: str = field(default="", metadata=field_doc("RDMA device, e.g. mlx5_0 (empty: auto)"))
    device_names: str = field(default="", metadata=field_doc(
        "RDMA devices (rails), comma-separated; overrides device_name"))
    gid_index: Annotated[int, Range(-1, 255)] = field(default=-1, metadata=field_doc(
        "RDMA GID index (RoCE), as MC_GID_INDEX; -1: the engine's choice; ignored over tcp"))
    ib_port: Annotated[int, Range(0, 255)] = field(default=0, metadata=field_doc(
        "RDMA HCA port, as MC_IB_PORT; 0: the engine's choice; ignored over tcp"))
    local_hostname: str = field(default="", metadata=field_doc(
        "address peers use to reach this node (default: bind_host, or the route to the first seed)"))
    bind_host: str = field(default="127.0.0.1", metadata=field_doc("address the control plane listens on"))
    control_port: Annotated[int, Range(-1, 65535)] = field(default=-1, metadata=field_doc(
        "control (gRPC) port; -1: the discovery_addr port if it is free here, else any; 0: any"))
    global_segment_size: Size = field(default=4 << 30, metadata=field_doc(
        "memory this node lends to the pool ('16gb' style); 0: store no pages"))
    populate_segment: bool = field(default=True, metadata=field_doc(
        "fault the segment in at start (remote writes into untouched pages are several times slower)"))
    placement: Literal["local", "owner"] = field(default="local", metadata=field_doc(
        "where a written page lives: 'local' = the writer's own segment (writes are memcpy), "
        "'owner' = the key's owner node (one-sided remote write); a node lending 0 bytes uses 'owner'"))
    directory_replicas: int = field(default=1, metadata=field_doc(
        "extra nodes (besides the owner) holding each directory entry"))
    disk_path: str = field(default="", metadata=field_doc("write-through disk tier directory (empty: none)"))
    disk_size: Size = field(default=100 << 30, metadata=field_doc("disk tier capacity"))
    membership_url: str = field(default="", metadata=field_doc(
        "where the live set is kept: empty = heartbeats between all members (no master; pools of "
        "up to ~100 nodes), or a registry in Redis, redis://host:port[/db] or "
        "redis+sentinel://host:port,.../master-name[/db] (one call per node per heartbeat_interval "
        "whatever the pool size; docs/operations.md, sizing)"))
    membership_password_file: str = field(default="", metadata=field_doc(
        "file holding the password of the membership registry's Redis user (the URL may name the user)"))
    membership_pool: str = field(default="default", metadata=field_doc(
        "name of this pool in the membership registry (pools sharing one Redis differ by name)"))
    pool_usage_interval: float = field(default=5.0, metadata=field_doc(
        "seconds one reading of the whole pool's bytes in use (stats(): one Usage call to each "
        "other member) is reused; this node's own writes and deletes drop it; 0 = stats() reports "
        "this node's segment only (no calls: for pools of hundreds of nodes)"))
    heartbeat_interval: float = field(default=1.0, metadata=field_doc("seconds between heartbeats"))
    member_ttl: float = field(default=4.0, metadata=field_doc("a member silent this long is dropped (s)"))
    rpc_timeout: float = field(default=0.5, metadata=field_doc("deadline of one control-plane call (s)"))
    timeout: float = field(default=7.0, metadata=field_doc(
        "bound on one read/write call (s); >= 4*rpc_timeout + 5 (5: the Transfer Engine's minimum)"))
    auth_token: str = field(default="", metadata=field_doc(
        "shared secret on every RPC (else auth_token_file, else $KVCONNECT_PEER_TOKEN)"))
    auth_token_file: str = field(default="", metadata=field_doc("file holding the shared secret"))
    bounce_buffer_size: Size = field(default=256 << 20, metadata=field_doc(
        "registered staging memory for remote reads (and writes from unregistered memory), "
        "in chunks of up to 64 MiB made on first use"))
    direct_reads: bool = field(default=False, metadata=field_doc(
        "read straight into registered caller pages (zero-copy); off: stage, validate, copy, so "
        "that a transfer that timed out and lands late can never write into caller memory"))
    shared_segment: bool = field(default=False, metadata=field_doc(
        "lend global_segment_size from a file in shared memory (shared_segment_dir) and read the "
        "pages of same-host nodes that do the same by copying from their files instead of a "
        "Transfer Engine transfer (several engines on one host); needs that much free space in "
        "/dev/shm"))
    shared_segment_dir: str = field(default="/dev/shm/kvconnect-peer", metadata=field_doc(
        "where shared segments and their registry live"))
    location_cache_ttl: float = field(default=2.0, metadata=field_doc(
        "seconds a location found by exists() is reused by the next read (0: off)"))
    join_timeout: float = field(default=5.0, metadata=field_doc("seconds to wait for a seed at start"))

    def __post_init__(self) -> None:
        from kvconnect.connectors.base import ConfigError

        if not self.seeds:
            raise ConfigError("discovery_addr", "needs at least one host:port")
        for s in self.seeds:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("discovery_addr", f"{s!r} is not host:port")
            if not 0 < int(port) < 65536:
                raise ConfigError("discovery_addr", f"{s!r}: port {port} is outside 1..65535")
        if self.bounce_buffer_size <= 0:
            raise ConfigError("bounce_buffer_size", f"must be > 0 (remote reads are staged through it), got "
                              f"{self.bounce_buffer_size}", "a size > 0, e.g. '64mb' (default '256mb')")
        if self.global_segment_size < 0:
            raise ConfigError("global_segment_size", "must be >= 0")
        if self.directory_replicas < 0:
            raise ConfigError("directory_replicas", "must be >= 0")
        if self.membership_url:
            from kvconnect.connectors.redis_url import URL_FORMS, parse_redis_url

            forms = ("''", *(f for f in URL_FORMS if "+cluster" not in f))
            try:
                url = parse_redis_url(self.membership_url, "membership_url")
            except ConfigError as e:
                raise ConfigError("membership_url", e.problem, forms) from None
            if getattr(url, "cluster", False):
                raise ConfigError("membership_url", f"{self.membership_url!r}: the registry is not run on a Redis "
                                  "Cluster (a pool's keys would sit in one slot anyway); name one server or a "
                                  "Sentinel group", forms)
        if not self.membership_pool or any(c in self.membership_pool for c in "{}: "):
            raise ConfigError("membership_pool", f"{self.membership_pool!r}: needs a name without '{{', '}}', "
                              "':' or spaces")
        if self.heartbeat_interval <= 0 or self.member_ttl <= self.heartbeat_interval:
            raise ConfigError("member_ttl", "must be > heartbeat_interval > 0")
        if self.rpc_timeout <= 0:
            raise ConfigError("rpc_timeout", "must be > 0")
        if self.timeout < 4 * self.rpc_timeout + 5:
            raise ConfigError("timeout", f"must be >= 4*rpc_timeout + 5 = {4 * self.rpc_timeout + 5:g} "
                              "(the Transfer Engine cannot time a transfer out sooner than 5 s)")
        if self.disk_path and self.disk_size <= 0:
            raise ConfigError("disk_size", "must be > 0 when disk_path is set")

    @property
    def seeds(self) -> list[str]:
        return [s.strip() for s in self.discovery_addr.split(",") if s.strip()]

    @property
    def token(self) -> str:
        from kvconnect.connectors.auth import resolve_token

        return resolve_token(self.auth_token, self.auth_token_file, "peer") or ""

    @property
    def membership_password(self) -> str | None:
        if not self.membership_password_file:
            return None
        with open(self.membership_password_file) as f:
            return f.read().strip() or None

    @property
    def devices(self) -> str:
        return self.device_names or self.device_name

    @property
    def transfer_timeout(self) -> int:
        # what is left of a call's budget after its control-plane calls (at most 4 x rpc_timeout)
        return max(5, int(self.timeout - 4 * self.rpc_timeout))
