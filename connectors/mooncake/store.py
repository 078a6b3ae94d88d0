"""``mooncake``: KV pages in a Mooncake Store, zero-copy.

One page is one Mooncake object: its segments are written with
``batch_put_from_multi_buffers`` and read back with ``batch_get_into_multi_buffers``
straight between the caller's registered memory and the store's segments. A page is
visible only once all its bytes landed (Mooncake publishes an object at the end of its
put) and is never torn by a removal or eviction while it is read (Mooncake grants every
read a lease; eviction and our non-forced removes respect it, and a read that outlives
its lease fails with LEASE_EXPIRED, which is a miss here).

Memory paths
  * *direct*: every segment of the page lies in memory registered with
    ``register_memory`` (SGLang's host pool, LMCache's buffers) and ``io_mode`` is
    ``"direct"``: one Mooncake call moves the bytes.
  * *staged*: anything else (plain buffers, the conformance suite's ``HostBuffer``s, or
    every page under ``io_mode="staged"``): pages are gathered into / scattered out of
    extents of one registered staging buffer the store owns. Registering caller memory on
    the fly was rejected: with RDMA each registration pins and maps memory (slow), and an
    unregister racing an abandoned transfer is undefined.
  * *local copy* (``local_copy``, on by default in a process that lends a segment): pages
    whose replica lies in this process's own segment are copied by kvconnect's copy
    threads under the read lease of a ``batch_get_replica_desc`` query (Mooncake 0.3.x
    copies local replicas with one thread); see ``kvconnect.connectors.mooncake.local_copy``. The
    same holds for replicas in a same-host store process that lends its segment from
    shared memory (``shared_segment``; ``kvconnect.connectors.shared_memory``). Other
    pages take the paths above.

Deadlines and failures
  ``call_mode="worker"`` (default): every Mooncake call runs on one of ``io_threads``
  persistent worker threads (``kvconnect.connectors.mooncake.calls``); the calling (engine) thread
  waits at most ``op_timeout``. ``call_mode="inline"``: calls run on the engine thread (no
  hand-off, no abandoned calls), bounded only by Mooncake's own timeouts, which the store
  derives from ``op_timeout``; they do not bound every case by it (a get from a stopped
  peer fails after ~2 s per 4 transfers queued to it: 7 s for 8 pages), hence not the
  default; measured bounds in ``docs/mooncake.md``.
  In worker mode a call past its deadline is *abandoned*: the
  caller gets misses / failed writes at once and the store turns unhealthy; while any
  abandoned call is still running, and until a health check passes (every
  ``reconnect_interval``), calls return misses without touching Mooncake. Mooncake's
  client reconnects to a restarted master by itself; the health check notices.

  What an abandoned call may still do when it finally runs to its end:
  * staged: it reads/writes only its staging extent, released only after the call
    returns, so nothing the caller owns is touched; a put publishes the bytes it had.
  * direct put: it may read caller memory that the caller has reused; the keys it
    reports written are therefore force-removed as soon as it returns (never served
    to anyone as the caller's page, except inside that removal's window).
  * direct get: it may write into caller memory after the caller got a miss. It cannot
    be stopped; the caller's memory is its own. This happens only when a transfer hangs
    past ``op_timeout`` (a dead master fails the metadata RPC first, a killed peer
    resets the connection); deployments that cannot rule that out set
    ``io_mode="staged"`` (one extra memcpy per page).

Errors: every Mooncake code is classified in ``kvconnect.connectors.mooncake.errors``; on the data
path they are misses, failed writes or "already stored", never exceptions.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from kvconnect.connectors.base import Capability, MissingDependency, Page, PageStore, StoreUsage
from kvconnect.connectors.config import parse_config
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.mooncake import errors as mc_errors
from kvconnect.connectors.mooncake.config import WHERE, MooncakeConfig, merged_options
from kvconnect.connectors.mooncake.local_replicas import LocalReplicas
from kvconnect.connectors.mooncake.master_metrics import MasterMetrics, metrics_url
from kvconnect.connectors.mooncake.session import Session
from kvconnect.connectors.mooncake.transfers import Transfers

log = logging.getLogger("kvconnect.mooncake")

_REGEX_SPECIAL = set(".^$*+?()[]{}|\\/")

COUNTERS = ("timeouts", "abandoned", "unavailable", "short_circuited", "direct_pages", "staged_pages",
            "poisoned_removed", "local_copy_pages", "local_copy_late", "shared_copy_pages",
            "shared_copy_holder_gone")
"""What the store counts (``stats().extra``), by the parts that do it."""


def _registers_device_memory() -> bool:
    """Whether the installed Mooncake can register GPU memory: any build but the -non-cuda
    wheel (a CUDA build installs as mooncake-transfer-engine)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        return True
    try:
        distribution("mooncake-transfer-engine")
        return True
    except PackageNotFoundError:
        return False


def _import_mooncake():
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        raise MissingDependency("mooncake", "mooncake", e) from e
    return MooncakeDistributedStore, ReplicateConfig


class Figures:
    """The store's counters, and the cluster's figures read from the master's metrics."""

    def __init__(self, config: MooncakeConfig):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.master = MasterMetrics(metrics_url(config.master_metrics, config.master_server_address),
                                    timeout=min(1.0, config.op_timeout))

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def forget_cluster(self) -> None:
        self.master.forget()  # the next stats() asks the master again


class MooncakeStore(PageStore):
    """Pages as objects of a Mooncake Store cluster (see the module docstring).

    The store composes the objects that do its jobs, each owning its state:

    * ``session`` (session.py): the client, calls under ``op_timeout``, the health circuit.
    * ``transfers`` (transfers.py): registered memory, staging, the direct and staged paths,
      replica placement of puts.
    * ``local`` (local_replicas.py): this host's segments and the copies out of them.
    * ``figures``: the counters and the master's metrics.
    """

    name = "mooncake"
    config_class = MooncakeConfig
    metric_counters = frozenset(COUNTERS)
    capabilities = frozenset({Capability.SHARED, Capability.DURABLE, Capability.DEVICE_MEMORY, Capability.ZERO_COPY,
                              Capability.ANY_PAGE_SIZE, Capability.NEEDS_REGISTERED_MEMORY})

    # -- construction -------------------------------------------------------------
    @classmethod
    def config_from_options(cls, options: Mapping[str, Any] | None = None) -> MooncakeConfig:
        """Options merged with ``MOONCAKE_*`` env and the SGLang config file, then validated."""
        return parse_config(MooncakeConfig, merged_options(options), where=WHERE)

    @classmethod
    def capabilities_of(cls, config: MooncakeConfig | None) -> frozenset[Capability]:
        have = set(cls.capabilities)
        if config is not None and config.global_segment_size > 0:
            have.discard(Capability.DURABLE)  # pages may live in this process's own segment
        if not _registers_device_memory():
            have.discard(Capability.DEVICE_MEMORY)
        return frozenset(have)

    @classmethod
    def capability_hint(cls, capability: Capability, config: Any) -> str:
        if capability is Capability.DURABLE:
            return "lend no memory from the engine (global_segment_size=0) and run a 'kvconnect mooncake-store' process"
        if capability is Capability.DEVICE_MEMORY:
            return "install a CUDA build of Mooncake (mooncake-transfer-engine); the -non-cuda wheel is installed"
        return ""

    def __init__(self, config: MooncakeConfig, context: EngineContext | None = None):
        super().__init__(context)
        self.config = config
        client_class, replicate_config = _import_mooncake()
        self.figures = Figures(config)
        self.session = Session(self, client_class)
        self.transfers = Transfers(self, replicate_config)
        self.local = LocalReplicas(self, replicate_config)
        try:
            self.session.connect()
        except BaseException:
            self.session.stop()
            raise
        # All or nothing: a start that fails after the client joined the cluster (staging,
        # a shared segment, the endpoint probe) closes the client and what it mounted.
        try:
            self.transfers.start()
            self.local.start()
        except BaseException:
            self._close()
            raise

    # -- primitives ---------------------------------------------------------------------
    def _register_memory(self, address: int, nbytes: int) -> None:
        self.transfers.register(address, nbytes)

    def _exists(self, keys: list[str]) -> list[bool]:
        codes = self.session.call("batch_is_exist", self.session.client.batch_is_exist, keys, lookup=True)
        if codes is None or len(codes) != len(keys):
            return [False] * len(keys)
        n, hits = len(codes), codes.count(1)
        if hits == n or (not hits and codes.count(0) == n):  # all stored / none: no per-key work
            return [hits == n] * n
        if min(codes) < 0:  # counted; an unreachable master turns the store unhealthy
            self.session.note_codes(codes)
        return [c == 1 for c in codes]

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        copied = self.local.get(keys, pages)
        if copied is None:  # nothing on this host to copy from
            return self.transfers.get(keys, pages)
        out, elsewhere = copied
        if elsewhere:
            got = self.transfers.get([keys[i] for i in elsewhere], [pages[i] for i in elsewhere])
            for i, ok in zip(elsewhere, got):
                out[i] = ok
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        try:
            return self.transfers.put(keys, pages)
        finally:
            self.figures.forget_cluster()

    def _delete(self, keys: list[str]) -> list[bool]:
        """Non-forced removes: a key leased by a reader is waited for (``lease_wait``), never
        pulled from under the read."""
        out = [False] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.config.lease_wait
        delay = 0.05
        while pending:
            codes = self.session.call("batch_remove", self.session.client.batch_remove, [keys[i] for i in pending],
                                      False)
            if codes is None or len(codes) != len(pending):
                break
            leased = []
            for i, rc in zip(pending, codes):
                if rc == 0:
                    out[i] = True
                elif mc_errors.outcome(rc) is mc_errors.Outcome.LEASED:
                    leased.append(i)
                elif mc_errors.outcome(rc) is not mc_errors.Outcome.MISS:
                    self.session.note_codes([rc])
            pending = leased
            if pending and time.monotonic() + delay > deadline:
                log.warning("mooncake: %d keys still leased after lease_wait=%gs; not removed",
                            len(pending), self.config.lease_wait)
                break
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self.figures.forget_cluster()
        return out

    def _clear(self) -> None:
        """Remove every object (Mooncake's ``remove_all``, all tenants' keys in this cluster),
        waiting out leases held by readers for up to ``lease_wait``."""
        deadline = time.monotonic() + self.config.lease_wait
        while True:
            n = self.session.call("remove_all", self.session.client.remove_all, False)
            if n is None or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _clear_prefix(self, prefix: str) -> None:
        """Remove the objects whose keys start with ``prefix`` (``remove_by_regex``), waiting
        out readers' leases for up to ``lease_wait`` as ``clear`` does."""
        pattern = "^" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in prefix)
        deadline = time.monotonic() + self.config.lease_wait
        while True:
            n = self.session.call("remove_by_regex", self.session.client.remove_by_regex, pattern, False)
            if n is None or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _usage(self) -> StoreUsage:
        session, transfers, c = self.session, self.transfers, self.config
        extra = dict(self.figures.counts(), healthy=session.healthy(), abandoned_running=session.runner.abandoned,
                     registered_bytes=transfers.regions.nbytes, staging_in_use=transfers.staging.in_use,
                     io_mode=c.io_mode, call_mode=c.call_mode, lookups_on_caller=session.lookups_on_caller,
                     **self.local.usage(),
                     master=c.master_server_address)
        master = self.figures.master
        cluster = master.read()
        extra["master_metrics"] = master.url
        if cluster is None:
            extra["master_metrics_error"] = master.error
            return StoreUsage(extra=extra)
        # the cluster's figures (every client's and tenant's pages, the master's evictions
        # included): the master's view of its mounted memory segments
        return StoreUsage(keys=cluster.keys, bytes_used=cluster.bytes_used, capacity_bytes=cluster.capacity_bytes,
                          extra=extra)

    def describe(self) -> str:
        from kvconnect.connectors.transfer_engine import rdma_devices

        c = self.config
        proto = c.protocol + (" (no RDMA NIC here: TCP)" if c.protocol == "rdma" and not rdma_devices() else "")
        return (f"master {c.master_server_address} (no auth: Mooncake has none), metadata {c.metadata_server}, "
                f"transport {proto}{' ' + c.device_name if c.device_name else ''}, lends {c.global_segment_size} "
                f"bytes, tenant {c.tenant_id}")

    def _backend_ok(self) -> bool:
        return self.session.healthy()  # unhealthy from a timeout or an unreachable master until a probe succeeds

    def health(self) -> bool:
        """Whether the store currently serves calls (probes the master if a probe is due)."""
        return not self._closed and self.session.available()

    def _close(self) -> None:
        busy = self.session.stop()
        registered = self.transfers.release_all()
        if busy:
            # Closing the client under a running call is undefined in Mooncake: leak it.
            log.warning("mooncake: %d abandoned calls still running at close; client left open", busy)
            return
        try:
            for start in registered:
                self.session.client.unregister_buffer(start)
            self.session.client.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort
            log.warning("mooncake: close: %s", e)
        self.transfers.staging.close()
        self.local.close()  # after the client let go of the segment
