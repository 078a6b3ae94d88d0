"""Byte movement of the ``kvconnect`` PD transfer backend (no SGLang imports here).

Two ways to move one request's KV pages and aux rows from prefill to decode; the strategy
around each (``DataPlane``: ``DirectPlane``, ``RelayPlane``) is in
``kvconnect.connectors.engines.pd_planes``. Here: the config, address arithmetic and the
relay's store I/O.

* ``"direct"``: every process registers its KV, aux and state buffers with a Transfer
  Engine; prefill writes pages one-sided into the slots decode pre-allocated (RDMA where a
  NIC exists, TCP otherwise; ``kv_blocks``, ``aux_blocks``, ``state_blocks``). Prefill waits
  for decode's destinations.
* ``StoreRelay`` (``"relay"``): prefill writes each request's pages and aux rows into a
  kvconnect store, under a key-space view of the room (``PrefixedStore``), then a
  completion marker; decode waits for the marker and reads straight into its
  pre-allocated slots. Neither side needs the other to be up at the same moment; keys are
  deleted after success, failure or timeout. Any store with the ``shared`` capability will
  do (and ``device_memory`` where the KV lives on a GPU); the factory refuses others.

``kvconnect.connectors.engines.sglang_pd`` drives the planes from SGLang's ``Common*`` classes.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence

import numpy as np

from kvconnect.connectors import auth, transfer_engine
from kvconnect.connectors.base import Capability, ConfigError, Page, PageStore, page_nbytes
from kvconnect.connectors.config import Size, StoreConfig, field_doc, parse_config
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import RateLimitedLog, serve_store_metrics
from kvconnect.connectors.views import PrefixedStore, delete_many, exists_many

logger = logging.getLogger(__name__)
_rate_limited = RateLimitedLog(logger, interval_s=10.0)  # a dead store must not flood the engine log

ENV_CONFIG = "KVCONNECT_PD_CONFIG"
ENV_TOKEN = auth.env_var("pd")
TRANSPORTS = ("direct", "relay")


# ---------------------------------------------------------------------------------
# Configuration (KVCONNECT_PD_CONFIG: JSON text or a path to a JSON file)
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PDConfig(StoreConfig):
    transport: Literal["direct", "relay"] = field(
        default="direct", metadata=field_doc("data plane: direct one-sided writes, or a relay through a shared store"))
    timeout_s: Optional[float] = field(
        default=None, metadata=field_doc(
            "bound on one transfer: decode fails a request this long after it sent its "
            "destinations, prefill fails one whose decode never sent them; None keeps SGLang's "
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT / _BOOTSTRAP_TIMEOUT"))
    register_timeout_s: float = field(default=300.0, metadata=field_doc(
        "prefill: how long a rank retries its registration with the bootstrap server (SGLang's "
        "server process starts that server while the scheduler registers); then it fails at start"))
    protocol: Literal["rdma", "tcp"] = field(
        default="rdma", metadata=field_doc("direct: Transfer Engine protocol (rdma falls back to TCP without a NIC)"))
    device: str = field(default="", metadata=field_doc("direct: RDMA device(s), '' = auto"))
    store: dict = field(default_factory=dict, metadata=field_doc(
        "relay: the store, {\"store\": NAME or \"pkg.mod:Class\", ...its options} (as for create_store)"))
    key_prefix: str = field(default="kvcpd", metadata=field_doc("relay: first component of every key"))
    key_bytes: Optional[Size] = field(default=None, metadata=field_doc(
        "relay: about this many KV bytes per store key; None: 4 MiB, or one KV page for a store "
        "without the 'any_page_size' capability (one file or slot table per page size)"))
    retain_s: float = field(default=600.0, metadata=field_doc(
        "relay: prefill deletes a room's keys this long after publishing them if decode never took them"))
    poll_interval_s: float = field(default=0.01, metadata=field_doc(
        "relay: decode's marker poll period (a prefill Success message wakes it at once)"))
    call_bytes: Size = field(default=64 << 20, metadata=field_doc(
        "relay: most KV bytes per store call; a room is written and read in calls of this size, so each "
        "call ends well within the store's op_timeout also while other rooms transfer"))
    metrics_port: Optional[int] = field(default=None, metadata=field_doc(
        "relay: serve the relay store's figures (calls, bytes, seconds) on 127.0.0.1:PORT/metrics, plus "
        "the rank index in a TP/PP group; 0: any free port; None: not served"))
    workers: int = field(default=2, metadata=field_doc(
        "transfer threads per process (2 measured best on a 2-core host; raise with cores and NICs)"))
    max_batch: int = field(default=4096, metadata=field_doc("direct: most blocks per Transfer Engine call"))
    auth_token: Optional[str] = field(default=None, metadata=field_doc(
        "shared secret decode's control messages must carry (else auth_token_file, else "
        "$KVCONNECT_PD_TOKEN); prefill drops registrations and destinations without it"))
    auth_token_file: Optional[str] = field(default=None, metadata=field_doc("file holding the shared secret"))

    def __post_init__(self) -> None:
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.register_timeout_s <= 0:
            raise ValueError("register_timeout_s must be > 0")
        if self.key_bytes is not None and self.key_bytes <= 0:
            raise ValueError("key_bytes must be > 0")
        if self.call_bytes <= 0:
            raise ValueError("call_bytes must be > 0")
        if self.poll_interval_s <= 0 or self.retain_s <= 0:
            raise ValueError("poll_interval_s and retain_s must be > 0")
        if self.transport == "relay" and not self.store.get("store"):
            raise ConfigError("store", "the relay needs a store: {\"store\": NAME, ...its options}",
                              "a store with the capability 'shared'", ENV_CONFIG)

    @property
    def is_relay(self) -> bool:
        return self.transport == "relay"


def load_pd_config(raw: str | Mapping[str, Any] | None) -> PDConfig:
    """Parse ``KVCONNECT_PD_CONFIG``: JSON text, a path to a JSON file, or a mapping."""
    import json
    import os

    where = ENV_CONFIG
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raw = {}
    if isinstance(raw, str):
        text = raw.strip()
        if not text.startswith("{"):
            if not os.path.isfile(text):
                raise ConfigError("<root>", f"is neither JSON nor a readable file: {text!r}", None, where)
            with open(text) as f:
                text = f.read()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("<root>", f"invalid JSON: {e}", None, where) from e
    config = parse_config(PDConfig, raw, where=where)
    return dataclasses.replace(config, auth_token=auth.resolve_token(config.auth_token, config.auth_token_file, "pd"))


# ---------------------------------------------------------------------------------
# Address arithmetic shared by both transports
# ---------------------------------------------------------------------------------


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` runs where both index arrays advance by one."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.size == 0:
        return []
    if src.size != dst.size:
        raise ValueError(f"{src.size} source pages but {dst.size} destination pages")
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [src.size]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


def index_runs(idx: np.ndarray) -> list[tuple[int, int]]:
    """``(start, count)`` runs of consecutive values in ``idx``."""
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size == 0:
        return []
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [idx.size]))
    return [(int(idx[s]), int(e - s)) for s, e in zip(starts, ends)]


def page_segments(ptrs: Sequence[int], item_lens: Sequence[int], pages: np.ndarray) -> list[tuple[int, int]]:
    """Segments of ``pages`` in every buffer, buffer-major: the byte order both sides agree on."""
    runs = index_runs(pages)
    return [(ptr + start * item, count * item) for ptr, item in zip(ptrs, item_lens) for start, count in runs]


@dataclass(frozen=True)
class BufferLayout:
    """One process's KV / aux / state buffers (from SGLang's ``KVArgs``)."""

    kv_ptrs: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]
    aux_ptrs: tuple[int, ...]
    aux_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    state_ptrs: tuple[tuple[int, ...], ...] = ()
    state_lens: tuple[tuple[int, ...], ...] = ()
    state_item_lens: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_kv_args(cls, kv_args: Any) -> "BufferLayout":
        def tup(name: str) -> tuple[int, ...]:
            return tuple(int(x) for x in (getattr(kv_args, name, None) or ()))

        def tup2(name: str) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(int(x) for x in comp) for comp in (getattr(kv_args, name, None) or ()))

        return cls(tup("kv_data_ptrs"), tup("kv_data_lens"), tup("kv_item_lens"),
                   tup("aux_data_ptrs"), tup("aux_data_lens"), tup("aux_item_lens"),
                   tup2("state_data_ptrs"), tup2("state_data_lens"), tup2("state_item_lens"))

    @property
    def page_bytes(self) -> int:
        return sum(self.kv_item_lens)

    @property
    def aux_row_bytes(self) -> int:
        return sum(self.aux_item_lens)

    def regions(self) -> list[tuple[int, int]]:
        """Distinct non-empty ``(ptr, nbytes)`` regions to register (duplicates break TE)."""
        out: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        pairs = list(zip(self.kv_ptrs, self.kv_lens)) + list(zip(self.aux_ptrs, self.aux_lens))
        for ptrs, lens in zip(self.state_ptrs, self.state_lens):
            pairs += list(zip(ptrs, lens))
        for ptr, n in pairs:
            if n > 0 and (ptr, n) not in seen:
                seen.add((ptr, n))
                out.append((ptr, n))
        return out

    def aux_segments(self, row: int) -> list[tuple[int, int]]:
        return [(ptr + row * item, item) for ptr, item in zip(self.aux_ptrs, self.aux_item_lens)]

    def state_segments(self, component: int, indices: np.ndarray) -> list[tuple[int, int]]:
        return page_segments(self.state_ptrs[component], self.state_item_lens[component], indices)


# ---------------------------------------------------------------------------------
# One failure type; direct write blocks
# ---------------------------------------------------------------------------------


# One failure type for both transports: the Transfer Engine's own (a one-sided write, a
# registration) and the relay's store operations raise the same class.
TransferFailed = transfer_engine.TransferFailed


def kv_blocks(src: BufferLayout, dst_kv_ptrs: Sequence[int], src_pages: np.ndarray,
              dst_pages: np.ndarray) -> list[tuple[int, int, int]]:
    """Write blocks for KV pages ``src_pages`` -> ``dst_pages`` in every buffer."""
    runs = contiguous_runs(src_pages, dst_pages)
    return [(sp + s * item, dp + d * item, n * item)
            for sp, dp, item in zip(src.kv_ptrs, dst_kv_ptrs, src.kv_item_lens) for s, d, n in runs]


def aux_blocks(src: BufferLayout, dst_aux_ptrs: Sequence[int], src_row: int, dst_row: int) -> list[tuple[int, int, int]]:
    return [(sp + src_row * item, dp + dst_row * item, item)
            for sp, dp, item in zip(src.aux_ptrs, dst_aux_ptrs, src.aux_item_lens)]


def state_blocks(src: BufferLayout, dst_state_ptrs: Sequence[Sequence[int]], src_indices: Sequence[Any],
                 dst_indices: Sequence[Any]) -> list[tuple[int, int, int]]:
    """Index-to-index copies of every state component (Mamba slots, SWA/DSA pages)."""
    blocks = []
    for comp, (s_idx, d_idx) in enumerate(zip(src_indices, dst_indices)):
        if s_idx is None or d_idx is None or comp >= len(src.state_ptrs):
            continue
        s_idx = np.asarray(s_idx, dtype=np.int64)
        d_idx = np.asarray(d_idx, dtype=np.int64)[: s_idx.size]
        runs = contiguous_runs(s_idx[: d_idx.size], d_idx)
        for sp, dp, item in zip(src.state_ptrs[comp], dst_state_ptrs[comp], src.state_item_lens[comp]):
            blocks += [(sp + s * item, dp + d * item, n * item) for s, d, n in runs]
    return blocks


# ---------------------------------------------------------------------------------
# Store relay: room-scoped keys, completion marker
# ---------------------------------------------------------------------------------

MARKER_MAGIC = b"KVCPD001"
MARKER_FMT = "<8sQIIQQII"  # magic, room, npages, block_pages, page_bytes, aux_bytes, n_state, state_count
MARKER_BYTES = 64


@dataclass(frozen=True)
class Marker:
    room: int
    npages: int
    block_pages: int
    page_bytes: int
    aux_bytes: int
    state_counts: tuple[int, ...] = ()

    def pack(self) -> bytes:
        head = struct.pack(MARKER_FMT, MARKER_MAGIC, self.room, self.npages, self.block_pages,
                           self.page_bytes, self.aux_bytes, len(self.state_counts), 0)
        tail = struct.pack(f"<{len(self.state_counts)}I", *self.state_counts)
        data = head + tail
        if len(data) > MARKER_BYTES:
            raise ValueError(f"too many state components for the marker ({len(self.state_counts)})")
        return data.ljust(MARKER_BYTES, b"\0")

    @classmethod
    def unpack(cls, data: bytes) -> "Marker":
        magic, room, npages, block_pages, page_bytes, aux_bytes, n_state, _ = struct.unpack_from(MARKER_FMT, data)
        if magic != MARKER_MAGIC:
            raise ValueError(f"not a kvconnect PD marker (magic {magic!r})")
        counts = struct.unpack_from(f"<{n_state}I", data, struct.calcsize(MARKER_FMT))
        return cls(room, npages, block_pages, page_bytes, aux_bytes, tuple(counts))


def room_namespace(prefix: str, prefill_ip: str, prefill_port: int, room: int, kv_dtype: str = "") -> str:
    """The key space of one room written by one prefill rank (its ZMQ endpoint names the
    rank instance): the relay sees the store through a view under ``<namespace>.``.
    ``kv_dtype`` (``kv_dtype_tag``): a decode of another KV dtype finds no room to read."""
    base = f"{prefix}.{prefill_ip.replace(':', '_')}_{prefill_port}.{room}"
    return f"{base}.{kv_dtype}" if kv_dtype else base


def kv_dtype_tag(kv_cache_dtype: Any) -> str:
    """The room-namespace tag of SGLang's ``--kv-cache-dtype`` (``KVArgs.kv_cache_dtype_str``):
    its logical dtype and stored scale format (``float8_e4m3fn``, ``float8_e4m3fn+mxfp8``);
    ``auto`` (the model's own dtype, alike on both sides of a pair) and older SGLang: ``""``."""
    from kvconnect.namespace import logical_kv_dtype

    try:
        pair = logical_kv_dtype(kv_cache_dtype, key="kv_cache_dtype", where="kvconnect pd")
    except ConfigError:
        return str(kv_cache_dtype).replace(".", "_")  # a name kvconnect does not know: its own space
    if pair is None:
        return ""
    return pair[0] + (f"+{pair[1]}" if pair[1] else "")


class RelayKeys:
    """The keys of one room, inside its view: KV blocks of ``block_pages`` positions, aux,
    state items, marker.

    Every state item (one index of one component) is its own key, so each kind of key has
    one size: stores that keep one file per page size stay at a few files.
    """

    def __init__(self, namespace: str, npages: int, block_pages: int, state_counts: Sequence[int] = ()):
        self.namespace = namespace
        self.npages = npages
        self.block_pages = block_pages
        self.state_counts = list(state_counts)

    @property
    def nblocks(self) -> int:
        return -(-self.npages // self.block_pages)

    def block(self, b: int) -> str:
        return f"kv.{b}"

    def block_range(self, b: int) -> tuple[int, int]:
        return b * self.block_pages, min((b + 1) * self.block_pages, self.npages)

    @property
    def aux(self) -> str:
        return "aux"

    def state(self, c: int, k: int) -> str:
        return f"state.{c}.{k}"

    @property
    def marker(self) -> str:
        return "done"

    def all(self) -> list[str]:
        return ([self.block(b) for b in range(self.nblocks)] + [self.aux]
                + [self.state(c, k) for c, n in enumerate(self.state_counts) for k in range(n)] + [self.marker])


class MarkerSlots:
    """A registered scratch area holding 64-byte markers (stores may need registered memory)."""

    def __init__(self, store: PageStore, slots: int = 1024):
        self._buf = (ctypes.c_char * (slots * MARKER_BYTES))()
        self.base = ctypes.addressof(self._buf)
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        if store.supports(Capability.NEEDS_REGISTERED_MEMORY):
            store.register_memory(self.base, slots * MARKER_BYTES)

    def acquire(self, timeout: float = 30.0) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise TransferFailed("no free marker slot")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def page(self, slot: int) -> Page:
        return [(self.base + slot * MARKER_BYTES, MARKER_BYTES)]

    def write(self, slot: int, data: bytes) -> None:
        ctypes.memmove(self.base + slot * MARKER_BYTES, data, len(data))

    def read(self, slot: int) -> bytes:
        return ctypes.string_at(self.base + slot * MARKER_BYTES, MARKER_BYTES)


def relay_requirements(context: EngineContext) -> dict[Capability, str]:
    """What a relay store must be able to do, and why."""
    need = {Capability.SHARED: "the PD relay needs: prefill writes a room, decode (another process) reads it"}
    if context.on_device:
        need[Capability.DEVICE_MEMORY] = f"the PD relay needs: SGLang's KV lives in {context.device} memory"
    return need


def create_relay_store(config: PDConfig, context: EngineContext) -> PageStore:
    from kvconnect.connectors.registry import create_store

    opts = dict(config.store)
    name = opts.pop("store")
    return create_store(name, opts, context=context, require=tuple(relay_requirements(context)),
                        why=relay_requirements(context), where=ENV_CONFIG)


class KeyCleaner:
    """Deletes relay keys in the background, batched, retrying keys a store did not drop.

    A store may refuse to delete a key a reader still leases (Mooncake: until the lease
    lapses, and an ``exists`` probe can renew it), so cleanup never probes: it retries the
    keys a delete did not report removed, once per ``retry_interval_s``, for ``retry_s``
    (a key that was never written is retried too, harmlessly). Batching all pending rooms
    into one call keeps it cheap and off the data path.
    """

    def __init__(self, store: PageStore, retry_s: float = 30.0, retry_interval_s: float = 1.0):
        self.store = store
        self.retry_s = retry_s
        self.retry_interval_s = retry_interval_s
        self._pending: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stopped = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kvconnect-pd-cleaner")
        self._thread.start()

    def submit(self, view: PrefixedStore, names: Sequence[str]) -> None:
        if names:
            self._pending.append((view, list(names), time.monotonic(), 0.0))
            self._wake.set()

    @property
    def idle(self) -> bool:
        return not self._pending and not self._busy

    def _loop(self) -> None:
        while not self._stopped:
            self._wake.wait(self.retry_interval_s / 2)
            self._wake.clear()
            now = time.monotonic()
            batch, later = [], []
            while self._pending:
                item = self._pending.popleft()
                (batch if item[3] <= now else later).append(item)
            self._pending.extend(later)
            if not batch:
                continue
            self._busy = True
            try:
                try:
                    gone = delete_many([(view, keys) for view, keys, _, _ in batch])  # one store call
                except Exception as e:  # noqa: BLE001 - retried below
                    _rate_limited.warning("delete", "kvconnect PD: deleting %d relay keys failed: %r",
                                          sum(len(keys) for _, keys, _, _ in batch), e)
                    gone = [[False] * len(keys) for _, keys, _, _ in batch]
                now = time.monotonic()
                for (view, keys, since, _), done in zip(batch, gone):
                    left = [n for n, ok in zip(keys, done) if not ok]
                    if left and now - since < self.retry_s:
                        self._pending.append((view, left, since, now + self.retry_interval_s))
            finally:
                self._busy = False

    def close(self) -> None:
        self._stopped = True
        self._wake.set()


class StoreRelay:
    """Both halves of the relay's byte movement over one ``PageStore``; one instance per SGLang
    process (``pd_planes.RelayPlane`` decides when each half runs)."""

    def __init__(self, config: PDConfig, layout: BufferLayout, context: EngineContext | None = None,
                 store: PageStore | None = None):
        self.config = config
        self.layout = layout
        context = context or EngineContext(engine="sglang-pd", page_bytes=max(1, layout.page_bytes))
        self.store = store if store is not None else create_relay_store(config, context)
        self.metrics_port = None
        if config.metrics_port is not None:   # where the relay's time goes, scraped like any store's
            port = config.metrics_port + context.rank_index if config.metrics_port else 0
            self.metrics_port = serve_store_metrics(self.store, port, engine="sglang-pd")
        if self.store.supports(Capability.NEEDS_REGISTERED_MEMORY):
            for ptr, n in layout.regions():
                self.store.register_memory(ptr, n)
        self.markers = MarkerSlots(self.store)
        self.store_errors: collections.deque = collections.deque(maxlen=8)
        self.cleaner = KeyCleaner(self.store)
        page_bytes = max(1, layout.page_bytes)
        key_bytes = config.key_bytes
        any_size = self.store.supports(Capability.ANY_PAGE_SIZE)
        if key_bytes is None:
            key_bytes = 4 << 20 if any_size else page_bytes
        self.block_pages = max(1, key_bytes // page_bytes)
        if not any_size:
            self._open_size_lanes()

    def _open_size_lanes(self) -> None:
        """A store without ``any_page_size`` keeps one file (or slot table) per page size and
        may learn of sizes other processes opened only every few seconds; write (then drop)
        one throwaway page of every size the relay uses, so this process knows them all
        from the start."""
        sizes = {MARKER_BYTES, self.layout.aux_row_bytes}
        sizes |= {sum(items) for items in self.layout.state_item_lens if items}
        sizes.discard(0)
        scratch = (ctypes.c_char * max(sizes))()
        base = ctypes.addressof(scratch)
        warmup = PrefixedStore(self.store, f"{self.config.key_prefix}.lane-warmup.")
        names = [str(n) for n in sorted(sizes)]
        try:
            warmup.put_from(names, [[(base, n)] for n in sorted(sizes)])
            warmup.delete(names)
        except Exception as e:  # noqa: BLE001 - only a latency optimisation
            logger.warning("kvconnect PD: could not open store lanes: %r", e)

    def keys(self, namespace: str, npages: int, state_counts: Sequence[int] = ()) -> RelayKeys:
        return RelayKeys(namespace, npages, self.block_pages, state_counts)

    def room(self, keys: RelayKeys) -> PrefixedStore:
        """The store as one room sees it: every key under the room's namespace."""
        return PrefixedStore(self.store, keys.namespace + ".")

    # -- prefill ----------------------------------------------------------------
    def put_blocks(self, keys: RelayKeys, src_pages: np.ndarray, blocks: Sequence[int]) -> None:
        """Write KV blocks (positions ``keys.block_range(b)``) from prefill pages ``src_pages``."""
        if not blocks:
            return
        names, pages = [], []
        for b in blocks:
            lo, hi = keys.block_range(b)
            names.append(keys.block(b))
            pages.append(page_segments(self.layout.kv_ptrs, self.layout.kv_item_lens, src_pages[lo:hi]))
        self._put(keys, names, pages)

    def put_tail(self, keys: RelayKeys, aux_row: int, state_indices: Sequence[Any] | None, room: int) -> None:
        """Aux row and state, then the marker: the marker goes last, so it means 'all landed'."""
        names = [keys.aux]
        pages = [self.layout.aux_segments(aux_row)]
        keys.state_counts = []
        for c in range(len(self.layout.state_ptrs)):
            comp = state_indices[c] if state_indices and c < len(state_indices) else None
            idx = np.asarray(comp if comp is not None else [], dtype=np.int64).ravel()
            keys.state_counts.append(int(idx.size))
            for k, i in enumerate(idx):
                names.append(keys.state(c, k))
                pages.append(self.layout.state_segments(c, idx[k:k + 1]))
        self._put(keys, names, pages)
        marker = Marker(room, keys.npages, keys.block_pages, self.layout.page_bytes,
                        self.layout.aux_row_bytes, tuple(keys.state_counts))
        slot = self.markers.acquire()
        try:
            self.markers.write(slot, marker.pack())
            self._put(keys, [keys.marker], [self.markers.page(slot)])
        finally:
            self.markers.release(slot)

    def _calls(self, pages: list[Page]) -> list[slice]:
        """Consecutive runs of ``pages`` of at most ``call_bytes`` each (at least one page)."""
        runs, start, size = [], 0, 0
        for i, page in enumerate(pages):
            n = page_nbytes(page)
            if i > start and size + n > self.config.call_bytes:
                runs.append(slice(start, i))
                start, size = i, 0
            size += n
        if start < len(pages):
            runs.append(slice(start, len(pages)))
        return runs

    def _put(self, keys: RelayKeys, names: list[str], pages: list[Page]) -> None:
        ok: list[bool] = []
        room = self.room(keys)
        try:
            for run in self._calls(pages):
                ok += room.put_from(names[run], pages[run])
                if not all(ok):
                    break  # the room fails anyway: write no further
        except Exception as e:  # noqa: BLE001 - a store error fails the room, never the engine
            raise TransferFailed(f"store {self.store.name!r} put of {len(names)} keys raised {e!r}") from e
        missing = [n for n, good in zip(names, ok) if not good]
        if missing:
            raise TransferFailed(f"store {self.store.name!r} did not take {len(missing)} of {len(names)} keys "
                                 f"(first {room.prefix}{missing[0]})")

    # -- decode -----------------------------------------------------------------
    def markers_present(self, rooms: list[RelayKeys]) -> list[bool]:
        """Whether each room's marker was published (one store call for all of them)."""
        try:
            return [found[0] for found in exists_many([(self.room(k), [k.marker]) for k in rooms])]
        except Exception as e:  # noqa: BLE001
            self.store_errors.append(f"exists() raised {e!r}")
            _rate_limited.warning("exists", "kvconnect PD: store exists() failed: %r", e)
            return [False] * len(rooms)

    def read(self, keys: RelayKeys, room: int, dst_pages: np.ndarray, aux_row: int,
             state_indices: Sequence[Any] | None) -> None:
        """Marker, then KV blocks, aux and state straight into decode's slots; raises on any miss."""
        view = self.room(keys)
        slot = self.markers.acquire()
        try:
            ok = view.get_into([keys.marker], [self.markers.page(slot)])
            if not ok[0]:
                raise TransferFailed(f"marker {view.prefix}{keys.marker} present but unreadable{self._health()}")
            marker = Marker.unpack(self.markers.read(slot))
        finally:
            self.markers.release(slot)
        if marker.room != room:
            raise RoomMismatch(f"room mismatch: marker {view.prefix}{keys.marker} is for room {marker.room}, "
                               f"decode expects {room}")
        if marker.npages != keys.npages:
            raise RoomMismatch(f"room mismatch: prefill published {marker.npages} pages for room {room}, "
                               f"decode allocated {keys.npages}")
        if (marker.block_pages, marker.page_bytes, marker.aux_bytes) != (
                keys.block_pages, self.layout.page_bytes, self.layout.aux_row_bytes):
            raise RoomMismatch(
                f"layout mismatch for room {room}: prefill wrote block_pages={marker.block_pages} "
                f"page_bytes={marker.page_bytes} aux_bytes={marker.aux_bytes}, decode has "
                f"block_pages={keys.block_pages} page_bytes={self.layout.page_bytes} "
                f"aux_bytes={self.layout.aux_row_bytes} (same model, page size and dtype on both sides?)")
        names, pages = [], []
        for b in range(keys.nblocks):
            lo, hi = keys.block_range(b)
            names.append(keys.block(b))
            pages.append(page_segments(self.layout.kv_ptrs, self.layout.kv_item_lens, dst_pages[lo:hi]))
        names.append(keys.aux)
        pages.append(self.layout.aux_segments(aux_row))
        keys.state_counts = list(marker.state_counts)
        for c, count in enumerate(marker.state_counts):
            if not count:
                continue
            comp = state_indices[c] if state_indices and c < len(state_indices) else None
            idx = np.asarray(comp if comp is not None else [], dtype=np.int64).ravel()[:count]
            if idx.size != count or c >= len(self.layout.state_ptrs):
                raise RoomMismatch(f"room {room}: prefill sent {count} state items of component {c}, "
                                   f"decode has {idx.size} slots")
            for k in range(count):
                names.append(keys.state(c, k))
                pages.append(self.layout.state_segments(c, idx[k:k + 1]))
        ok: list[bool] = []
        try:
            for run in self._calls(pages):
                ok += view.get_into(names[run], pages[run])
                if not all(ok):
                    break  # the room fails anyway: read no further
        except Exception as e:  # noqa: BLE001
            raise TransferFailed(f"store {self.store.name!r} get of {len(names)} keys raised {e!r}") from e
        missing = [n for n, good in zip(names, ok) if not good]
        if missing:
            raise TransferFailed(f"store {self.store.name!r} missed {len(missing)} of {len(names)} keys of room "
                                 f"{room} (first {view.prefix}{missing[0]}){self._health()}")

    def _health(self) -> str:
        try:
            extra = self.store.stats().extra
        except Exception:  # noqa: BLE001 - diagnostics only
            return ""
        return f" (store healthy={extra['healthy']})" if "healthy" in extra else ""

    def discard(self, keys: RelayKeys) -> None:
        """Delete every key of a room, in the background (idempotent; never raises)."""
        self.cleaner.submit(self.room(keys), keys.all())

    def close(self) -> None:
        self.cleaner.close()
        try:
            if self.config.metrics_port is not None:
                from kvconnect.connectors import metrics

                metrics.unexport_store(self.store)
            self.store.close()
        except Exception:  # noqa: BLE001
            pass


class RoomMismatch(TransferFailed):
    """Prefill and decode disagree about a room (its id, page count or layout)."""


@dataclasses.dataclass
class Deadlines:
    """Rooms to clean up at a deadline (prefill side of the relay)."""

    entries: dict = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, key: Any, when: float, value: Any) -> None:
        with self.lock:
            self.entries[key] = (when, value)

    def __contains__(self, key: Any) -> bool:
        with self.lock:
            return key in self.entries

    def pop(self, key: Any) -> Any:
        with self.lock:
            item = self.entries.pop(key, None)
        return item[1] if item else None

    def due(self, now: float | None = None) -> list[Any]:
        now = time.monotonic() if now is None else now
        with self.lock:
            keys = [k for k, (when, _) in self.entries.items() if when <= now]
            return [self.entries.pop(k)[1] for k in keys]
