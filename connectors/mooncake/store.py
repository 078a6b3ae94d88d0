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
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

from kvconnect.connectors.base import (BackendUnavailable, Capability, MissingDependency, Page, PageStore, StoreUsage,
                                       page_nbytes)
from kvconnect.connectors.buffers import gather_into, scatter, scatter_many
from kvconnect.connectors.config import parse_config
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.mooncake import errors as mc_errors
from kvconnect.connectors.mooncake.calls import ABANDONED, DONE, RAISED, DeadlineRunner, run_inline
from kvconnect.connectors.mooncake.config import WHERE, MooncakeConfig, merged_options
from kvconnect.connectors.retry import CoolOff
from kvconnect.connectors.mooncake.master_metrics import MasterMetrics, metrics_url
from kvconnect.connectors.mooncake.local_copy import PROBE_BYTES, find_own_endpoint, mapping_base, memory_replicas
from kvconnect.connectors.shared_memory import SameHostSegments, SharedSegmentFile
from kvconnect.connectors.transfer_engine import (RegisteredRegions, StagingMemory, apply_engine_defaults,
                                                  apply_inline_timeouts)

log = logging.getLogger("kvconnect.mooncake")

# Mooncake's setup retries its master connection ~every 4.5 s (20 times by default).
_SETUP_ATTEMPT_S = 4.5
_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_USER_RETRIES = _RETRIES_ENV in os.environ  # a user's own choice is never overridden


_REGEX_SPECIAL = set(".^$*+?()[]{}|\\/")


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


def _wait_for_tcp(address: str, deadline: float) -> str | None:
    """None once ``host:port`` accepts a TCP connection before ``deadline``, else why not."""
    host, _, port = address.rpartition(":")
    why = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, 2.0)):
                return None
        except OSError as e:
            why = f"{type(e).__name__}: {e.strerror or e}"
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


_MISS_CAUSE = {mc_errors.Outcome.BAD_REQUEST: "mismatch", mc_errors.Outcome.LEASED: "deadline"}
"""Why a Mooncake error code missed (``PageStore._miss``); anything else: the cluster failed us."""


class MooncakeStore(PageStore):
    """Pages as objects of a Mooncake Store cluster (see the module docstring)."""

    name = "mooncake"
    config_class = MooncakeConfig
    metric_counters = frozenset({"timeouts", "abandoned", "unavailable", "short_circuited", "direct_pages",
                                 "staged_pages", "poisoned_removed", "local_copy_pages", "local_copy_late",
                                 "shared_copy_pages", "shared_copy_holder_gone"})
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
        self._Client, ReplicateConfig = _import_mooncake()
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        self._inline = config.call_mode == "inline"
        self._runner = DeadlineRunner(config.io_threads, "kvc-mooncake")  # threads start on first use
        self._lock = threading.Lock()
        self._regions = RegisteredRegions()  # registered caller memory
        # unhealthy (open) from a timeout or an unreachable master until a health probe passes;
        # one probe per reconnect_interval
        self._circuit = CoolOff(config.reconnect_interval, one_probe=True)
        self._counts = {"timeouts": 0, "abandoned": 0, "unavailable": 0, "short_circuited": 0,
                        "direct_pages": 0, "staged_pages": 0, "poisoned_removed": 0,
                        "local_copy_pages": 0, "local_copy_late": 0, "shared_copy_pages": 0,
                        "shared_copy_holder_gone": 0}
        self._shared_file: SharedSegmentFile | None = None
        self._same_host = None
        self._master_metrics = MasterMetrics(metrics_url(config.master_metrics, config.master_server_address),
                                             timeout=min(1.0, config.op_timeout))
        self._staging = StagingMemory(config.staging_size, register=lambda addr, n: self._check_rc(
            "register staging buffer", self._client.register_buffer(addr, n)))
        try:
            self._client = self._connect()
        except BaseException:
            self._runner.close()
            raise
        # All or nothing: a start that fails after the client joined the cluster (staging,
        # a shared segment, the endpoint probe) closes the client and what it mounted.
        try:
            if config.prefer_local_segment:  # the segment name is known only once set up
                self._replicate.preferred_segment = self._client.get_hostname()
            self._staging.prepare()
            if config.shared_segment:
                self._shared_file = self._mount_shared_segment()
            self._own_endpoint = self._find_own_endpoint(ReplicateConfig) \
                if (config.local_copy or config.shared_segment) and config.global_segment_size > 0 else None
            if self._shared_file is not None:
                self._publish_shared_segment()
            self._same_host = SameHostSegments(config.shared_segment_dir, "mooncake") if config.local_copy else None
        except BaseException:
            self._close()
            raise

    def _mount_shared_segment(self) -> SharedSegmentFile:
        """Lend the segment from a shared-memory file (``shared_segment``)."""
        c = self.config
        try:
            shared = SharedSegmentFile(c.shared_segment_dir, c.global_segment_size, "mooncake")
        except OSError as e:
            raise BackendUnavailable("mooncake", f"shared_segment: {e}") from e
        result = self._call("mount_segment", self._client.mount_segment, shared.path, c.global_segment_size)
        if not result or result.get("ret") != 0:
            shared.close()
            raise BackendUnavailable("mooncake", f"shared_segment: mount_segment({shared.path}) "
                                                 f"returned {result}")
        return shared

    def _publish_shared_segment(self) -> None:
        shared = self._shared_file
        assert shared is not None
        base = mapping_base(shared.path, shared.nbytes)
        if self._own_endpoint is None or base is None:
            log.warning("mooncake: shared segment %s not published (endpoint %s, mapped at %s): "
                        "same-host readers use the Transfer Engine", shared.path, self._own_endpoint, base)
            return
        shared.publish(self._own_endpoint, base)
        log.info("mooncake: shared segment %s (%d bytes) published for same-host readers at %s",
                 shared.path, shared.nbytes, self._own_endpoint)

    def _find_own_endpoint(self, ReplicateConfig: Any) -> str | None:
        """The transport endpoint of this process's segment (``local_copy``), else None."""
        probe = ReplicateConfig()
        probe.replica_num = 1
        probe.preferred_segment = self._client.get_hostname()
        addr = self._staging.acquire(PROBE_BYTES, time.monotonic() + self.config.op_timeout)
        found = None
        if addr is not None:
            release = self._staging.releaser(addr)  # once the probe can no longer touch the extent
            found = self._call("local copy probe", find_own_endpoint, self._client, probe, addr,
                               on_abandoned_done=release)
            if found is not None:
                release(None)
        endpoint, why = found or (None, "no answer within op_timeout")
        if endpoint is None:
            log.warning("mooncake: local_copy off: %s; own-segment pages are read through Mooncake", why)
        else:
            log.info("mooncake: pages in this process's segment (%s) are read with a parallel copy", endpoint)
        return endpoint

    def _connect(self):
        """A set-up client, or BackendUnavailable naming the master, within ``setup_timeout``."""
        c = self.config
        # Mooncake retries an unreachable master for ~90 s; keep its retries within our
        # deadline (it reads the variable during setup) unless the user chose a value.
        if not _USER_RETRIES:
            os.environ[_RETRIES_ENV] = str(max(1, math.ceil(c.setup_timeout / _SETUP_ATTEMPT_S)))
        apply_engine_defaults()  # per-peer TCP queues that hold a whole batch's segments
        if c.call_mode == "inline":
            # nothing but Mooncake's own timeouts bounds an inline call: derive them from
            # op_timeout (process-wide; read by setup and by each transfer)
            apply_inline_timeouts(c.op_timeout)
        # Mooncake's setup holds the GIL while it retries, so a thread cannot bound it:
        # first wait (bounded) until the master accepts TCP connections at all.
        t0 = time.monotonic()
        left = _wait_for_tcp(c.master_server_address, t0 + c.setup_timeout)
        if left is not None:
            raise BackendUnavailable(
                "mooncake", f"cannot reach master {c.master_server_address} within "
                f"setup_timeout={c.setup_timeout:g}s ({left}; metadata {c.metadata_server}, "
                f"protocol {c.protocol})")
        client = self._Client()
        kwargs = {"tenant_id": c.tenant_id} if c.tenant_id != "default" else {}
        # a shared segment is mounted from its file after setup, not allocated by Mooncake
        segment = 0 if c.shared_segment else c.global_segment_size
        args = (c.local_hostname, c.metadata_server, segment, c.local_buffer_size,
                c.protocol, c.rdma_devices(self.context.tp_rank if self.context is not None else None),
                c.master_server_address)
        result: dict[str, Any] = {}
        done = threading.Event()
        gave_up = threading.Event()

        def run() -> None:
            try:
                result["rc"] = client.setup(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
                result["exc"] = e
            done.set()
            if gave_up.is_set():  # nobody will use this client: release it
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass

        t = threading.Thread(target=run, name="kvc-mooncake-setup", daemon=True)
        t.start()
        if not done.wait(c.setup_timeout):
            gave_up.set()
            if not done.is_set():
                raise BackendUnavailable(
                    "mooncake", f"no answer from master {c.master_server_address} within "
                    f"setup_timeout={c.setup_timeout:g}s (metadata {c.metadata_server}, protocol {c.protocol})")
        if "exc" in result:
            e = result["exc"]
            if isinstance(e, TypeError) and kwargs:
                raise BackendUnavailable("mooncake", f"this Mooncake build rejects tenant_id: {e}") from e
            raise BackendUnavailable("mooncake", f"setup against master {c.master_server_address} "
                                                 f"raised {type(e).__name__}: {e}") from e
        rc = result.get("rc", -1)
        if rc != 0:
            client.close()
            # Mooncake reports a segment it could not allocate with the same code as an
            # unreachable master: name both causes
            raise BackendUnavailable(
                "mooncake", f"setup failed (rc {rc} after {time.monotonic() - t0:.1f}s): cannot connect to "
                f"master {c.master_server_address}, or cannot allocate global_segment_size="
                f"{c.global_segment_size} bytes of memory (metadata {c.metadata_server}, protocol {c.protocol}, "
                f"local_hostname {c.local_hostname}; Mooncake's log above says which)")
        return client

    def _check_rc(self, what: str, rc: int) -> None:
        if rc != 0:
            mc_errors.raise_for(what, rc, master=self.config.master_server_address)

    # -- memory registration --------------------------------------------------------
    def _register_memory(self, address: int, nbytes: int) -> None:
        if self._regions.covers(address, nbytes):
            return
        self._check_rc("register_buffer", self._client.register_buffer(address, nbytes))
        self._regions.add(address, nbytes)

    def _split(self, pages: list[Page]) -> tuple[list[int] | None, list[int]]:
        """(pages for the direct path, pages for the staged path); None: all direct."""
        regions = self._regions
        if self.config.io_mode == "staged" or not regions:
            return [], list(range(len(pages)))
        spans = regions.spans
        if len(spans) == 1:  # the usual case (one host pool): no search
            lo, hi = spans[0]
            if all(lo <= a and a + n <= hi for p in pages for a, n in p):
                return None, []
        direct, staged = [], []
        for i, p in enumerate(pages):
            (direct if regions.covers_page(p) else staged).append(i)
        return (None if not staged else direct), staged

    # -- calls under a deadline ---------------------------------------------------------
    def _call(self, op: str, fn: Callable[..., Any], *args: Any,
              on_abandoned_done: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` within ``op_timeout``; None if it failed or timed out.

        ``call_mode="worker"``: on a worker, abandoned at ``op_timeout``; ``"inline"``: on
        this thread, bounded by Mooncake's timeouts (``transfer_engine.mooncake_timeouts``); a call that
        still took longer than ``op_timeout`` keeps its answer but turns the store unhealthy,
        so the next calls short-circuit instead of waiting as long.

        ``on_abandoned_done(result)`` runs when the caller gets None and nothing of the
        call can happen any more: at once if it failed or never ran (result None), else
        once an abandoned call has really returned (its result; e.g. to release its
        staging extent or remove what it wrote).
        """
        if not self._available():
            self._miss("unavailable")
            if on_abandoned_done is not None:
                on_abandoned_done(None)
            return None
        t0 = time.monotonic()
        status, value = self._invoke(fn, args, on_abandoned_done)
        took = time.monotonic() - t0
        if self._inline and took > self.config.op_timeout:
            with self._lock:
                self._counts["timeouts"] += 1
            self._mark_unhealthy(f"{op}: answered after {took:.1f}s > op_timeout={self.config.op_timeout:g}s")
        if status == DONE:
            return value
        self._miss("unavailable" if status == RAISED else "deadline")
        if status == RAISED:  # a binding error is a miss on the data path
            self.record_error()
            log.warning("mooncake %s raised %s: %s", op, type(value).__name__, value)
        else:
            with self._lock:
                self._counts["timeouts"] += 1
                if status == ABANDONED:
                    self._counts["abandoned"] += 1
            self._mark_unhealthy(f"{op}: no answer within op_timeout={self.config.op_timeout:g}s"
                                 if status == ABANDONED else
                                 f"{op}: no free I/O thread within op_timeout={self.config.op_timeout:g}s")
        if status != ABANDONED and on_abandoned_done is not None:
            on_abandoned_done(None)
        return None

    def _invoke(self, fn: Callable[..., Any], args: tuple,
                on_late: Callable[[Any], None] | None = None) -> tuple[str, Any]:
        """One Mooncake call, by ``call_mode``: inline, or on a worker under ``op_timeout``."""
        if self._inline:
            return run_inline(fn, args)
        return self._runner.run(fn, args, self.config.op_timeout, on_late)

    def _mark_unhealthy(self, why: str) -> None:
        if self._circuit.trip():
            log.warning("mooncake store unhealthy (master %s): %s; returning misses until it recovers",
                        self.config.master_server_address, why)

    def _available(self) -> bool:
        """Healthy, or a due health probe succeeded. Never blocks beyond ``op_timeout``."""
        if not self._circuit.tripped:
            return True
        if self._runner.abandoned or not self._circuit.allow():  # allow(): this caller is the one prober
            with self._lock:
                self._counts["short_circuited"] += 1
            return False
        # a probe that hangs counts as abandoned: no further probe until it returned
        status, rc = self._invoke(self._client.health_check, ())
        ok = status == DONE and rc == 0
        if ok:
            self._circuit.reset()
            log.warning("mooncake store healthy again (master %s)", self.config.master_server_address)
        else:
            with self._lock:
                self._counts["short_circuited"] += 1
        return ok

    def _note_codes(self, codes: list[int]) -> None:
        """Count errors; an unreachable master or peer turns the store unhealthy."""
        bad = [c for c in codes if c < 0 and mc_errors.outcome(c) not in
               (mc_errors.Outcome.MISS, mc_errors.Outcome.EXISTS)]
        if not bad:
            return
        self.record_error(len(bad))
        for c in bad:
            self._miss(_MISS_CAUSE.get(mc_errors.outcome(c), "unavailable"), 1)
        unavailable = [c for c in bad if mc_errors.outcome(c) is mc_errors.Outcome.UNAVAILABLE]
        if unavailable:
            with self._lock:
                self._counts["unavailable"] += len(unavailable)
            self._mark_unhealthy(f"{mc_errors.code_name(unavailable[0])} ({unavailable[0]})")

    # -- primitives ---------------------------------------------------------------------
    def _exists(self, keys: list[str]) -> list[bool]:
        codes = self._call("batch_is_exist", self._client.batch_is_exist, keys)
        if codes is None or len(codes) != len(keys):
            return [False] * len(keys)
        if codes and min(codes) < 0:
            self.record_error(sum(1 for c in codes if c < 0))
        return [c == 1 for c in codes]

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        same_host = self._same_host if self._same_host is not None and self._same_host.present() else None
        if self._own_endpoint is None and same_host is None:
            return self._get_through_mooncake(keys, pages)
        out, elsewhere = self._get_local(keys, pages, self._own_endpoint, same_host)
        if elsewhere:
            got = self._get_through_mooncake([keys[i] for i in elsewhere], [pages[i] for i in elsewhere])
            for i, ok in zip(elsewhere, got):
                out[i] = ok
        return out

    def _get_local(self, keys: list[str], pages: list[Page], own: str | None,
                   same_host: SameHostSegments | None) -> tuple[list[bool], list[int]]:
        """Copy the pages whose replica lies in this process's segment or in a same-host
        shared segment (``local_copy``).

        Returns (hits, indices of pages stored elsewhere, for Mooncake to read)."""
        out = [False] * len(keys)
        leased_at = time.monotonic()  # before the query: the lease starts no earlier
        replicas = self._call("batch_get_replica_desc", self._client.batch_get_replica_desc, keys)
        if replicas is None:
            return out, []  # store unavailable: misses
        if not replicas and time.monotonic() - leased_at >= self.config.op_timeout / 2:
            # the query reports no error codes: an empty answer this slow is a master that
            # did not answer (inline mode's RPC timeout is op_timeout / 2), not misses
            with self._lock:
                self._counts["unavailable"] += 1
            self._mark_unhealthy(f"batch_get_replica_desc: nothing for {len(keys)} keys after "
                                 f"{time.monotonic() - leased_at:.1f}s")
            return out, []
        local, sources, holders, elsewhere = [], [], [], []
        for i, key in enumerate(keys):
            found = replicas.get(key)
            source = holder = None
            nbytes = page_nbytes(pages[i])
            for endpoint, address in memory_replicas(found, nbytes) if found else ():
                if endpoint == own:
                    source = address
                    break
                if same_host is not None:
                    source = same_host.source(endpoint, address, nbytes)
                    if source is not None:
                        holder = endpoint
                        break
            if source is None:
                # another host's segment, another size, or no answer for the key (a miss
                # or an error: the query does not say which): Mooncake's own get decides
                elsewhere.append(i)
            else:
                local.append(i)
                sources.append(source)
                holders.append(holder)
        if local:
            scatter_many(sources, [pages[i] for i in local])
            late = time.monotonic() - leased_at > self.config.lease_ttl / 2
            # a holder still alive after the copy owned its endpoint the whole time: every
            # replica reported there was its own, in the memory just copied
            gone = {h for h in set(holders) if h is not None and not same_host.alive(h)}  # type: ignore[union-attr]
            with self._lock:
                if late:
                    self._counts["local_copy_late"] += len(local)
                else:
                    shared = sum(1 for h in holders if h is not None and h not in gone)
                    dropped = sum(1 for h in holders if h in gone)
                    self._counts["shared_copy_pages"] += shared
                    self._counts["shared_copy_holder_gone"] += dropped
                    self._counts["local_copy_pages"] += len(local) - shared - dropped
            if late:  # the lease may have lapsed mid-copy: the bytes are not trusted
                log.warning("mooncake: local copy of %d pages outlasted lease_ttl/2=%gs; misses",
                            len(local), self.config.lease_ttl / 2)
            else:
                for i, holder in zip(local, holders):
                    out[i] = holder is None or holder not in gone
        return out, elsewhere

    def _get_through_mooncake(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._by_path(keys, pages, self._get_direct, self._get_staged)

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        try:
            return self._by_path(keys, pages, self._put_direct, self._put_staged)
        finally:
            self._master_metrics.forget()  # the next stats() asks the master again

    def _by_path(self, keys: list[str], pages: list[Page], direct_op: Callable, staged_op: Callable) -> list[bool]:
        """One result per key: the pages ``_split`` finds registered go through ``direct_op``
        (all of them when it says None), the others through ``staged_op``."""
        out = [False] * len(keys)
        direct, staged = self._split(pages)
        if direct is None or direct:
            direct_op(keys, pages, direct, out)
        if staged:
            staged_op(keys, pages, staged, out)
        return out

    def _direct_args(self, keys: list[str], pages: list[Page],
                     idx: list[int] | None) -> tuple[list[str], list[list[int]], list[list[int]], list[int]]:
        """Keys, per-page segment addresses and sizes of the pages at ``idx`` (None: all),
        and the indices themselves."""
        if idx is None:
            ks, ps, idx = keys, pages, list(range(len(pages)))
        else:
            ks, ps = [keys[i] for i in idx], [pages[i] for i in idx]
        with self._lock:
            self._counts["direct_pages"] += len(idx)
        return ks, [[a for a, _ in p] for p in ps], [[n for _, n in p] for p in ps], idx

    def _get_direct(self, keys: list[str], pages: list[Page], idx: list[int] | None, out: list[bool]) -> None:
        ks, ptrs, sizes, idx = self._direct_args(keys, pages, idx)
        res = self._call("batch_get_into_multi_buffers", self._client.batch_get_into_multi_buffers,
                         ks, ptrs, sizes)
        if res is None or len(res) != len(idx):
            return
        self._note_codes(res)
        for j, i in enumerate(idx):
            # bytes read must be the whole page: a shorter object is a size mismatch (a miss)
            out[i] = res[j] == sum(sizes[j])

    def _put_direct(self, keys: list[str], pages: list[Page], idx: list[int] | None, out: list[bool]) -> None:
        ks, ptrs, sizes, idx = self._direct_args(keys, pages, idx)

        def remove_poisoned(res: list[int] | None) -> None:
            # An abandoned put may have read caller memory after the caller reused it:
            # what it published cannot be trusted.
            written = [k for k, rc in zip(ks, res or []) if rc == 0]
            if written:
                try:
                    self._client.batch_remove(written, True)
                    with self._lock:
                        self._counts["poisoned_removed"] += len(written)
                except Exception as e:  # noqa: BLE001
                    log.error("mooncake: cannot remove %d keys of an abandoned put: %s", len(written), e)

        res = self._call("batch_put_from_multi_buffers", self._client.batch_put_from_multi_buffers,
                         ks, ptrs, sizes, self._replicate, on_abandoned_done=remove_poisoned)
        self._put_results(res, idx, out)

    def _put_results(self, res: list[int] | None, idx: list[int], out: list[bool]) -> None:
        if res is None or len(res) != len(idx):
            return
        self._note_codes(res)
        for j, i in enumerate(idx):
            # 0: written; OBJECT_ALREADY_EXISTS: stored before, bytes kept (idempotent put)
            out[i] = res[j] == 0 or mc_errors.outcome(res[j]) is mc_errors.Outcome.EXISTS

    def _staged_chunks(self, pages: list[Page], idx: list[int]) -> list[list[int]]:
        """Batches whose pages fit in half the staging buffer (others can stage meanwhile)."""
        limit = max(self._staging.nbytes // 2, 1)
        chunks: list[list[int]] = [[]]
        size = 0
        for i in idx:
            n = page_nbytes(pages[i])
            if chunks[-1] and size + n > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += n
        return chunks

    def _get_staged(self, keys: list[str], pages: list[Page], idx: list[int], out: list[bool]) -> None:
        with self._lock:
            self._counts["staged_pages"] += len(idx)
        for chunk in self._staged_chunks(pages, idx):
            sizes = [page_nbytes(pages[i]) for i in chunk]
            total = sum(sizes)
            base = self._staging.acquire(total, time.monotonic() + self.config.op_timeout)
            if base is None:
                continue  # staging exhausted for the whole deadline: misses
            release = self._staging.releaser(base)

            ptrs, pos = [], base
            for n in sizes:
                ptrs.append(pos)
                pos += n
            res = self._call("batch_get_into", self._client.batch_get_into, [keys[i] for i in chunk],
                             ptrs, sizes, on_abandoned_done=release)
            if res is not None and len(res) == len(chunk):
                self._note_codes(res)
                for j, i in enumerate(chunk):
                    if res[j] == sizes[j]:
                        scatter(ptrs[j], pages[i])
                        out[i] = True
                release(None)
            elif res is not None:
                release(None)
            # res None: released by _call (failed/cancelled) or when the abandoned call ends

    def _put_staged(self, keys: list[str], pages: list[Page], idx: list[int], out: list[bool]) -> None:
        with self._lock:
            self._counts["staged_pages"] += len(idx)
        for chunk in self._staged_chunks(pages, idx):
            sizes = [page_nbytes(pages[i]) for i in chunk]
            base = self._staging.acquire(sum(sizes), time.monotonic() + self.config.op_timeout)
            if base is None:
                continue
            release = self._staging.releaser(base)

            ptrs, pos = [], base
            for i, n in zip(chunk, sizes):
                gather_into(pages[i], pos)
                ptrs.append(pos)
                pos += n
            res = self._call("batch_put_from", self._client.batch_put_from, [keys[i] for i in chunk],
                             ptrs, sizes, self._replicate, on_abandoned_done=release)
            if res is not None:
                release(None)
            self._put_results(res, chunk, out)

    def _delete(self, keys: list[str]) -> list[bool]:
        """Non-forced removes: a key leased by a reader is waited for (``lease_wait``), never
        pulled from under the read."""
        out = [False] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.config.lease_wait
        delay = 0.05
        while pending:
            codes = self._call("batch_remove", self._client.batch_remove, [keys[i] for i in pending], False)
            if codes is None or len(codes) != len(pending):
                break
            leased = []
            for i, rc in zip(pending, codes):
                if rc == 0:
                    out[i] = True
                elif mc_errors.outcome(rc) is mc_errors.Outcome.LEASED:
                    leased.append(i)
                elif mc_errors.outcome(rc) is not mc_errors.Outcome.MISS:
                    self._note_codes([rc])
            pending = leased
            if pending and time.monotonic() + delay > deadline:
                log.warning("mooncake: %d keys still leased after lease_wait=%gs; not removed",
                            len(pending), self.config.lease_wait)
                break
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self._master_metrics.forget()
        return out

    def _clear(self) -> None:
        """Remove every object (Mooncake's ``remove_all``, all tenants' keys in this cluster),
        waiting out leases held by readers for up to ``lease_wait``."""
        deadline = time.monotonic() + self.config.lease_wait
        while True:
            n = self._call("remove_all", self._client.remove_all, False)
            if n is None or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _clear_prefix(self, prefix: str) -> None:
        """Remove the objects whose keys start with ``prefix`` (``remove_by_regex``), waiting
        out readers' leases for up to ``lease_wait`` as ``clear`` does."""
        pattern = "^" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in prefix)
        deadline = time.monotonic() + self.config.lease_wait
        while True:
            n = self._call("remove_by_regex", self._client.remove_by_regex, pattern, False)
            if n is None or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _usage(self) -> StoreUsage:
        with self._lock:
            extra = dict(self._counts, healthy=self._circuit.closed(), abandoned_running=self._runner.abandoned,
                         registered_bytes=self._regions.nbytes,
                         staging_in_use=self._staging.in_use, io_mode=self.config.io_mode,
                         call_mode=self.config.call_mode, local_copy_endpoint=self._own_endpoint,
                         shared_segment=self._shared_file.path if self._shared_file else None,
                         shared_segments_mapped=self._same_host.mapped if self._same_host else 0,
                         master=self.config.master_server_address)
        cluster = self._master_metrics.read()
        extra["master_metrics"] = self._master_metrics.url
        if cluster is None:
            extra["master_metrics_error"] = self._master_metrics.error
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
        return self._circuit.closed()  # unhealthy from a timeout or an unreachable master until a probe succeeds

    def health(self) -> bool:
        """Whether the store currently serves calls (probes the master if a probe is due)."""
        return not self._closed and self._available()

    def _close(self) -> None:
        self._runner.close()
        busy = self._runner.abandoned
        regions = self._regions.clear()
        if busy:
            # Closing the client under a running call is undefined in Mooncake: leak it.
            log.warning("mooncake: %d abandoned calls still running at close; client left open", busy)
            return
        try:
            for start in regions + self._staging.addresses:
                self._client.unregister_buffer(start)
            self._client.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort
            log.warning("mooncake: close: %s", e)
        self._staging.close()
        if self._same_host is not None:
            self._same_host.close()
        if self._shared_file is not None:  # after the client let go of the segment
            self._shared_file.close()
