"""The demo's workload and engine: what ``kvconnect demo`` replays, and how.

* ``Workload``: deterministic token streams of the deployment guides' benchmark
  (SGLang's ``bench_serving --dataset-name generated-shared-prefix`` and
  ``benchmark/hicache/bench_multiturn.py``): groups sharing a system prompt, clients whose
  conversations grow a turn per round;
* page keys: SGLang's prefix-chained SHA-256 of token pages (``page_hasher``);
* ``PageContent``: bytes derived from a page's hash, written and checked word for word;
* two ways to reach a store with the same calls and batch sizes as SGLang's
  ``HiCacheController``: ``SGLangPath`` (kvconnect's real SGLang adapter, built by SGLang's
  ``StorageBackendFactory``, over a real SGLang host pool on CPU) and ``HostBufferPath`` (the
  ``PageStore`` directly, without sglang);
* ``serve_request``: one request as the controller serves it from L3 (look up, load, verify,
  prefill the missing pages, back them up).

``kvconnect.connectors.demo`` is the command around it; ``examples/`` drive it from their own
processes.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvconnect.connectors.base import Segment

GiB = 1 << 30
MiB = 1 << 20
STORAGE_BATCH_SIZE = 128  # pages per get/set/exists call, as SGLang's cache controller
POISON = 0xA5


# ---------------------------------------------------------------------------------
# Model geometry
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """KV geometry of one rank of a model (what a host-pool page holds)."""

    name: str
    layers: int
    kv_heads: int  # MHA: KV heads; MLA: 1
    head_dim: int  # MHA: head dim; MLA: kv_lora_rank
    dtype: str = "bfloat16"
    mla: bool = False
    rope_dim: int = 0  # MLA: qk_rope_head_dim
    note: str = ""

    @property
    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        if self.mla:
            return self.layers * (self.head_dim + self.rope_dim) * self.itemsize
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    def describe(self) -> str:
        if self.mla:
            g = f"MLA, {self.layers} layers, latent {self.head_dim}+{self.rope_dim}"
        else:
            g = f"MHA, {self.layers} layers, {self.kv_heads} KV heads x {self.head_dim}"
        return f"{self.name} ({g}, {self.dtype}{', ' + self.note if self.note else ''})"

    def geometry(self) -> str:
        if self.mla:
            return f"mla:L{self.layers}:R{self.head_dim}:P{self.rope_dim}"
        return f"mha:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("tiny", 4, 2, 64),
    ModelShape("tiny-mla", 4, 1, 64, mla=True, rope_dim=32),
    ModelShape("llama-8b", 32, 8, 128, note="Llama-3.1-8B, one rank"),
    ModelShape("qwen3-32b", 64, 8, 128, note="Qwen3-32B, one rank at TP 1"),
    ModelShape("deepseek-v3", 61, 1, 512, mla=True, rope_dim=64, note="DeepSeek-V3/R1 MLA"),
)}
LAYOUTS_MHA = ("page_first", "page_first_direct", "layer_first", "page_head")
LAYOUTS_MLA = ("page_first", "page_first_direct", "layer_first")


# ---------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------


class Workload:
    """Deterministic token streams: shared system prompts plus per-client growing turns."""

    VOCAB = 151_000  # token ids below a Qwen-sized vocabulary (all fit uint32)

    def __init__(self, groups: int, clients: int, rounds: int, prefix_tokens: int, turn_tokens: int,
                 seed: int = 0):
        self.groups, self.clients, self.rounds = groups, clients, rounds
        self.prefix_tokens, self.turn_tokens, self.seed = prefix_tokens, turn_tokens, seed
        self._system = [self._tokens(("system", g), prefix_tokens) for g in range(groups)]
        self._turns: dict[tuple[int, int], list[int]] = {}

    def _tokens(self, what: tuple, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}/{what}")
        return [rng.randrange(self.VOCAB) for _ in range(n)]

    def group_of(self, client: int) -> int:
        return client % self.groups

    def prompt(self, client: int, round_: int) -> list[int]:
        """Tokens client ``client`` sends in round ``round_``: system prompt + turns 0..round."""
        toks = list(self._system[self.group_of(client)])
        for r in range(round_ + 1):
            turn = self._turns.get((client, r))
            if turn is None:
                turn = self._turns[(client, r)] = self._tokens(("turn", client, r), self.turn_tokens)
            toks += turn
        return toks

    def requests(self) -> list[list[tuple[int, int]]]:
        """Per round, the (client, round) pairs; a barrier separates rounds."""
        return [[(c, r) for c in range(self.clients)] for r in range(self.rounds)]


# ---------------------------------------------------------------------------------
# Page keys: SGLang's prefix-chained SHA-256 of token pages
# ---------------------------------------------------------------------------------


def hashlib_page_hashes(tokens: Sequence[int], page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's page-key scheme in plain Python, for full pages only.

    ``digest_i = SHA256(digest_{i-1} || tokens of page i as little-endian uint32)``; the first
    page has no prior digest unless ``prior_hash`` is given (as ``sglang.srt.mem_cache.utils.
    get_hash_str``, tokens below 2**32).
    """
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    fmt = struct.Struct(f"<{page_size}I")
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prior = hashlib.sha256(prior + fmt.pack(*tokens[start:start + page_size])).digest()
        out.append(prior.hex())
    return out


def page_hasher(use_sglang: bool) -> tuple[Callable[[Sequence[int], int], list[str]], str]:
    """(hash function over full pages, description). SGLang's native one when it loads."""
    if use_sglang:
        try:
            from sglang.srt.mem_cache.utils import get_hash_str

            get_hash_str([1] * 4, None, page_size=4)  # builds / loads the native extension now

            def sglang_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
                full = len(tokens) // page_size * page_size
                return list(get_hash_str(list(tokens[:full]), None, page_size=page_size)) if full else []

            return sglang_hashes, "sglang.srt.mem_cache.utils.get_hash_str (native)"
        except Exception as e:  # noqa: BLE001 - any failure to load: same scheme in Python
            return hashlib_page_hashes, f"hashlib (sglang's native hash unavailable: {type(e).__name__}: {e})"
    return hashlib_page_hashes, "hashlib (SGLang's scheme)"


# ---------------------------------------------------------------------------------
# Page contents: deterministic bytes derived from the page hash, written and verified
# ---------------------------------------------------------------------------------


class VerificationError(AssertionError):
    """A page loaded from the store does not hold the bytes written for its key."""


class PageContent:
    """Fills and checks page segments with words derived from the page hash.

    Segment ``j`` of the page with hash ``h`` holds uint64 words
    ``i * K + seed(h) + j * S`` (mod 2**64): every word of every segment of every page
    differs, so a foreign page, a shifted copy, a torn or partial page and a single flipped
    byte are all caught.
    """

    K = 0x9E3779B97F4A7C15  # odd: i -> i*K is a bijection mod 2**64
    S = 0xD1B54A32D192ED03

    def __init__(self, max_segment_bytes: int):
        import numpy as np

        self.np = np
        words = (max_segment_bytes + 7) // 8
        self._ramp = np.arange(words, dtype=np.uint64) * np.uint64(self.K)
        self._local = threading.local()

    def _scratch(self, words: int):
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < words:
            buf = self.np.empty(len(self._ramp), dtype=self.np.uint64)
            self._local.buf = buf
        return buf[:words]

    def _view(self, addr: int, nbytes: int):
        if nbytes % 8:
            raise ValueError(f"segment of {nbytes} bytes is not a multiple of 8")
        return self.np.ctypeslib.as_array((ctypes.c_uint64 * (nbytes // 8)).from_address(addr))

    def _seed(self, page_hash: str, segment: int):
        return self.np.uint64((int(page_hash[:16], 16) + segment * self.S) & 0xFFFF_FFFF_FFFF_FFFF)

    def fill(self, page: Sequence[Segment], page_hash: str) -> None:
        for j, (addr, n) in enumerate(page):
            view = self._view(addr, n)
            self.np.add(self._ramp[: len(view)], self._seed(page_hash, j), out=view)

    @staticmethod
    def poison(page: Sequence[Segment]) -> None:
        for addr, n in page:
            ctypes.memset(addr, POISON, n)

    def check(self, page: Sequence[Segment], page_hash: str) -> str | None:
        """None when the page holds exactly its bytes; else where the first difference is."""
        offset = 0
        for j, (addr, n) in enumerate(page):
            view = self._view(addr, n)
            exp = self._scratch(len(view))
            self.np.add(self._ramp[: len(view)], self._seed(page_hash, j), out=exp)
            if not self.np.array_equal(view, exp):
                w = int(self.np.flatnonzero(view != exp)[0])
                got, want = int(view[w]).to_bytes(8, "little"), int(exp[w]).to_bytes(8, "little")
                b = next(i for i in range(8) if got[i] != want[i])
                return (f"segment {j} byte {w * 8 + b} (page byte {offset + w * 8 + b}): "
                        f"got 0x{got[b]:02x}, expected 0x{want[b]:02x}")
            offset += n
        return None


# ---------------------------------------------------------------------------------
# Two ways to reach the store: the real SGLang adapter over a real host pool, or a plain
# PageStore over a HostBuffer. Same operations, same batch sizes.
# ---------------------------------------------------------------------------------


class _Timer:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


def _batched(hashes: list[str], t: _Timer, call: Callable[[list[str], int], int]) -> int:
    """``call(batch, start)`` per controller-sized batch, timed; stops at the first short batch
    (as SGLang's controller does). Returns the pages done."""
    done = 0
    for s in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[s:s + STORAGE_BATCH_SIZE]
        t0 = time.perf_counter()
        n = call(batch, s)
        t.seconds += time.perf_counter() - t0
        t.calls += 1
        done += n
        if n < len(batch):
            break
    return done


class SGLangPath:
    """``KVConnectStorage`` built by SGLang's ``StorageBackendFactory`` over a real host pool."""

    ops = ("batch_exists", "batch_get_v1", "batch_set_v1")

    def __init__(self, shape: ModelShape, layout: str, page_size: int, host_pages: int, store: str,
                 store_options: dict[str, Any]):
        import sglang
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        from kvconnect.connectors.engines.sglang_host_pools import make_cpu_host_pool

        self.host = make_cpu_host_pool(layout, page_size=page_size, layer_num=shape.layers,
                                       head_num=shape.kv_heads, head_dim=shape.head_dim, dtype=shape.dtype,
                                       mla=shape.mla, host_tokens=host_pages * page_size,
                                       rope_dim=shape.rope_dim if shape.mla else None)
        self.page_size = page_size
        extra = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
                 "class_name": "KVConnectStorage", "interface_v1": 1, "store": store, **store_options}
        self.extra_config = extra
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=shape.mla, enable_storage_metrics=False,
            is_page_first_layout=layout == "page_first", model_name=f"kvconnect-demo/{shape.name}",
            extra_config=dict(extra))
        # Exactly what HiCacheController.attach_storage_backend does.
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.host)
        self.backend.register_mem_pool_host(self.host)
        if hasattr(self.backend, "on_host_pools_registered"):
            self.backend.on_host_pools_registered()
        self._extra_info = HiCacheStorageExtraInfo
        self._alloc_lock = threading.Lock()
        self.description = (f"SGLang {sglang.__version__} HiCache adapter kvconnect.connectors.engines.sglang_hicache."
                            f"KVConnectStorage (StorageBackendFactory 'dynamic', interface_v1) on a real "
                            f"{type(self.host).__name__} ({layout}, {host_pages} pages)")
        probe = self.host.alloc(page_size)
        ptrs, sizes = self.host.get_page_buffer_meta(probe)
        self.host.free(probe)
        self.segments_per_page = len(ptrs)
        self.page_bytes = sum(sizes)
        self.max_segment = max(sizes)

    # host memory
    def alloc(self, pages: int):
        with self._alloc_lock:
            idx = self.host.alloc(pages * self.page_size)
        if idx is None:
            raise RuntimeError(f"host pool exhausted allocating {pages} pages")
        return idx

    def free(self, handle) -> None:
        with self._alloc_lock:
            self.host.free(handle)

    def pages(self, handle) -> list[list[Segment]]:
        ptrs, sizes = self.host.get_page_buffer_meta(handle)
        k = self.segments_per_page
        return [list(zip(ptrs[i:i + k], sizes[i:i + k])) for i in range(0, len(ptrs), k)]

    # the controller's calls
    def exists(self, hashes: list[str], t: _Timer) -> int:
        return _batched(hashes, t, lambda b, s: self.backend.batch_exists(b, self._extra_info(prefix_keys=None)))

    def _slots(self, handle, first_page: int, count: int):
        ps = self.page_size
        return handle[first_page * ps:(first_page + count) * ps]

    def get(self, hashes: list[str], handle, first_page: int, t: _Timer) -> int:
        from kvconnect.namespace import leading_hits

        return _batched(hashes, t, lambda b, s: leading_hits(self.backend.batch_get_v1(
            b, self._slots(handle, first_page + s, len(b)), self._extra_info(prefix_keys=None))))

    def set(self, hashes: list[str], handle, first_page: int, t: _Timer) -> int:
        # the controller stops a backup at the first failed batch: a batch counts only if all of it was stored
        return _batched(hashes, t, lambda b, s: len(b) if all(self.backend.batch_set_v1(
            b, self._slots(handle, first_page + s, len(b)), self._extra_info(prefix_keys=None))) else 0)

    def clear(self) -> None:
        self.backend.clear()

    def store_stats(self) -> dict[str, Any] | None:
        stats = getattr(self.backend, "kvconnect_stats", None)  # store counters + swallowed errors
        if stats is not None:
            return stats()
        store = getattr(self.backend, "store", None)
        return store.stats().as_dict() if store is not None else None

    def keyspace_prefix(self) -> str:
        spaces = (self.store_stats() or {}).get("keyspaces") or {}
        return spaces.get("kv", "").rsplit(" -> ", 1)[-1]

    def adapter_errors(self) -> int:
        stats = self.store_stats() or {}
        return sum((stats.get("adapter_errors") or {}).values())

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close:
            close()


class HostBufferPath:
    """The ``PageStore`` driven directly over a ``HostBuffer`` (no sglang here)."""

    ops = ("PageStore.exists", "PageStore.get_into", "PageStore.put_from")

    def __init__(self, shape: ModelShape, page_size: int, host_pages: int, store: str,
                 store_options: dict[str, Any], why: str):
        from kvconnect.connectors.buffers import HostBuffer
        from kvconnect.connectors.engines.common import build_store
        from kvconnect.namespace import KeySpace

        self.page_size = page_size
        self.page_bytes = shape.bytes_per_token * page_size
        segments = 1 if shape.mla else 2  # K and V halves in separate regions, as SGLang's page_first
        self.buf = HostBuffer(host_pages, self.page_bytes, segments)
        self.segments_per_page = segments
        self.max_segment = self.page_bytes // segments
        # The same option handling as the engine adapters: store options inline, plus tenant etc.
        self.store, eo = build_store({**store_options, "store": store}, where="kvconnect demo")
        self.keyspace = KeySpace(model=f"kvconnect-demo/{shape.name}", layout=f"hostbuffer-{segments}seg",
                                 page_size=page_size, dtype=shape.dtype, geometry=shape.geometry(),
                                 rank_replicated=shape.mla, tenant=eo.tenant, weights=eo.model_fingerprint)
        self._free = list(range(host_pages))
        self._alloc_lock = threading.Lock()
        self.description = (f"PageStore {store!r} directly over a HostBuffer ({host_pages} pages), "
                            f"NOT through SGLang: {why}")

    def alloc(self, pages: int) -> list[int]:
        with self._alloc_lock:
            if len(self._free) < pages:
                raise RuntimeError(f"host buffer exhausted allocating {pages} pages")
            got, self._free = self._free[:pages], self._free[pages:]
        return got

    def free(self, handle: list[int]) -> None:
        with self._alloc_lock:
            self._free.extend(handle)

    def pages(self, handle: list[int]) -> list[list[Segment]]:
        return [self.buf.page(i) for i in handle]

    def _pages(self, handle: list[int], first: int, count: int) -> list:
        return [self.buf.page(i) for i in handle[first:first + count]]

    def exists(self, hashes: list[str], t: _Timer) -> int:
        from kvconnect.namespace import count_hits

        return _batched(hashes, t, lambda b, s: count_hits(self.store.exists(self.keyspace.keys(b))))

    def get(self, hashes: list[str], handle: list[int], first_page: int, t: _Timer) -> int:
        from kvconnect.namespace import leading_hits

        return _batched(hashes, t, lambda b, s: leading_hits(
            self.store.get_into(self.keyspace.keys(b), self._pages(handle, first_page + s, len(b)))))

    def set(self, hashes: list[str], handle: list[int], first_page: int, t: _Timer) -> int:
        # a batch counts only if every page of it was stored (SGLang's all(batch_set_v1))
        return _batched(hashes, t, lambda b, s: len(b) if all(
            self.store.put_from(self.keyspace.keys(b), self._pages(handle, first_page + s, len(b)))) else 0)

    def clear(self) -> None:
        self.store.clear()

    def store_stats(self) -> dict[str, Any] | None:
        return {"store": self.store.stats().as_dict()}

    def keyspace_prefix(self) -> str:
        return self.keyspace.prefix

    def adapter_errors(self) -> int:
        return 0

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    pages_looked_up: int = 0
    pages_exist: int = 0
    pages_loaded: int = 0
    pages_prefilled: int = 0
    pages_stored: int = 0
    pages_store_failed: int = 0
    pages_verified: int = 0
    exists: _Timer = field(default_factory=_Timer)
    get: _Timer = field(default_factory=_Timer)
    set: _Timer = field(default_factory=_Timer)
    prefill_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, other: "Totals") -> None:
        for k, v in other.__dict__.items():
            if isinstance(v, _Timer):
                mine = getattr(self, k)
                mine.seconds += v.seconds
                mine.calls += v.calls
            else:
                setattr(self, k, getattr(self, k) + v)


def serve_request(path, content: PageContent, hashes: list[str], prompt_tokens: int, where: str) -> Totals:
    """One request, as the controller serves it: exists, load the hit prefix, verify, prefill, back up."""
    t = Totals(requests=1, prompt_tokens=prompt_tokens, pages_looked_up=len(hashes))
    if not hashes:
        return t
    t.pages_exist = path.exists(hashes, t.exists)
    handle = path.alloc(len(hashes))
    try:
        pages = path.pages(handle)
        for p in pages[: t.pages_exist]:
            content.poison(p)  # a get that writes nothing can never pass the check
        loaded = path.get(hashes[: t.pages_exist], handle, 0, t.get) if t.pages_exist else 0
        t0 = time.perf_counter()
        for i in range(loaded):
            bad = content.check(pages[i], hashes[i])
            if bad:
                raise VerificationError(f"{where}: page {i} (key {hashes[i]}) loaded from the store holds wrong "
                                        f"bytes: {bad}")
        t.verify_seconds = time.perf_counter() - t0
        t.pages_loaded = t.pages_verified = loaded
        t0 = time.perf_counter()
        for i in range(loaded, len(hashes)):
            content.fill(pages[i], hashes[i])
        t.prefill_seconds = time.perf_counter() - t0
        t.pages_prefilled = len(hashes) - loaded
        t.pages_stored = path.set(hashes[loaded:], handle, loaded, t.set)
        t.pages_store_failed = t.pages_prefilled - t.pages_stored
    finally:
        path.free(handle)
    return t


def ideal_hit_pages(all_hashes: list[list[list[str]]]) -> int:
    """Pages an unbounded store would hit if requests ran one after another (the best case)."""
    seen: set[str] = set()
    hits = 0
    for round_hashes in all_hashes:
        for hashes in round_hashes:
            for h in hashes:
                if h not in seen:
                    break
                hits += 1
            seen.update(hashes)
    return hits
