"""SGLang 0.5.23's real ``HiCacheController`` on CPU with kvconnect as its storage backend.

What attach / detach / re-attach tests drive: the controller's constructor (storage attached
at start, as ``--hicache-storage-backend dynamic`` does), ``attach_storage_backend``,
``detach_storage_backend``, and its backup, prefetch and prefetch-I/O threads, which call
``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` as a GPU server's do.

Not real, and why: the scheduler. The controller's GPU<->host copies and the radix tree
need a model on CUDA; the few scheduler lines that move a prefetch from the hit queue to
the I/O thread (``UnifiedRadixCache``: allocate host slots, ``prefetch_buffer.put``) are
copied into ``prefetch()``, and the controller is handed a stand-in token allocator whose
only use is ``get_kvcache()`` (the real CPU device pool of ``make_cpu_host_pool``).

``check_reattach_finds_every_page`` and ``check_clear_empties_only_its_key_space`` are the
re-attach and ``clear()`` checks themselves, shared by the tests that run them over the
in-process test store, the HF3FS metadata service and every store's harness.
"""

from __future__ import annotations

import hashlib
import random
import threading
from typing import Any, Callable

from kvconnect.connectors.testing.sglang import HICACHE_EXTRA_CONFIG, fill_pages, make_cpu_host_pool, page_bytes

MODEL = "tiny/lifecycle"

_published = False


def _publish_single_rank() -> None:
    """SGLang's runtime context of one scheduler rank (what the controller's storage config reads)."""
    global _published
    if _published:
        return
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    rc.publish(ServerArgs(model_path="dummy", device="cpu"), role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    rc.get_parallel().override_permanently(pp_group=None)
    _published = True


class _Allocator:
    """The scheduler's token allocator, as far as the controller uses it on CPU: its device pool."""

    def __init__(self, device_pool):
        self.device_pool = device_pool

    def get_kvcache(self):
        return self.device_pool


def controller(host, extra: dict, attach: bool = True, model: str = MODEL):
    """A real ``HiCacheController`` over ``host`` with kvconnect attached at start, as
    ``--hicache-storage-backend dynamic`` does."""
    from sglang.srt.managers.cache_controller import HiCacheController

    _publish_single_rank()
    return HiCacheController(
        _Allocator(host._kvconnect_device_pool), host, host.page_size, None, threading.Event(), io_backend="direct",
        storage_backend="dynamic" if attach else None, model_name=model,
        storage_backend_extra_config={**HICACHE_EXTRA_CONFIG, **extra})


def attach(cc, extra: dict, model: str = MODEL) -> None:
    cc.attach_storage_backend("dynamic", model_name=model, storage_backend_extra_config={**HICACHE_EXTRA_CONFIG,
                                                                                          **extra})


def backup(cc, host_indices, tokens) -> int:
    """Write a request's pages to L3 through the controller's backup thread; tokens written."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    keys = list(get_storage_hash_str(list(tokens), None, page_size=cc.page_size))
    op_id = cc.write_storage(host_indices, list(tokens), hash_value=keys)
    ack = cc.ack_backup_queue.get(timeout=30)
    assert ack.id == op_id
    return ack.completed_tokens


def prefetch(cc, rid: str, tokens):
    """A request's L3 prefetch through the controller's threads (hit query, then I/O), with the
    scheduler's part in between (``UnifiedRadixCache``: allocate host slots for the hit, queue
    it for I/O). Returns (tokens loaded, host indices or None)."""
    cc.prefetch(rid, list(tokens))
    op = cc.prefetch_hit_queue.get(timeout=30)
    if op.storage_hit_count == 0:
        return 0, None
    op.host_indices = cc.mem_pool_host.alloc(op.storage_hit_count)
    cc.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=30)
        if ack.completed_tokens is not None:
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            return done, op.host_indices


def request_tokens(n_pages: int, tag: int, page_size: int) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(1, 30000) for _ in range(n_pages * page_size)]


def pages_at(host, idx) -> list[bytes]:
    ps = host.page_size
    return [page_bytes(host, int(idx[i * ps])) for i in range(len(idx) // ps)]


def check_reattach_finds_every_page(make_extra: Callable[[], dict[str, Any]], page_size: int = 4) -> int:
    """Pages a real controller backed up before ``detach_storage_backend`` (which closes the
    backend) are all found, byte-exact, after ``attach_storage_backend`` builds a new backend
    over the same store (``make_extra()``: its extra config), and by a second engine's
    controller. Returns the pages found (twice the pages written: 100 %)."""
    from kvconnect.connectors.engines.sglang_hicache import KVConnectStorage

    host = make_cpu_host_pool("page_first", page_size=page_size, host_tokens=page_size * 80)
    cc = controller(host, make_extra())
    first = cc.storage_backend
    assert type(first) is KVConnectStorage and cc.page_get_func == cc._page_get_zero_copy
    requests = {f"r{i}": request_tokens(6 + i, 100 + i, page_size) for i in range(3)}
    want = {}
    for rid, tokens in requests.items():
        idx = host.alloc(len(tokens))
        fill_pages(host, idx, seed=len(want) + 1)
        assert backup(cc, idx, tokens) == len(tokens)
        want[rid] = pages_at(host, idx)
    pages_written = sum(len(w) for w in want.values())

    cc.detach_storage_backend()
    assert cc.storage_backend is None and not cc.enable_storage
    assert first.store.closed

    attach(cc, make_extra())
    assert cc.storage_backend is not first and not cc.storage_backend.store.closed
    other_host = make_cpu_host_pool("page_first", page_size=page_size, host_tokens=page_size * 80)
    other = controller(other_host, make_extra())  # a second engine on the same store
    try:
        found = 0
        for c, h in ((cc, host), (other, other_host)):
            for rid, tokens in requests.items():
                done, idx = prefetch(c, f"{rid}-{id(c)}", tokens)
                assert done == len(tokens), f"{rid}: {done} of {len(tokens)} tokens after re-attach"
                assert pages_at(h, idx) == want[rid]
                found += done // page_size
        assert found == 2 * pages_written  # 100 % of the pages, on both engines
        return found
    finally:
        cc.detach_storage_backend()
        other.detach_storage_backend()


def direct_backend(host, extra: dict, model: str = MODEL, **fields):
    """kvconnect's backend built as SGLang's controller builds it: the storage factory
    (``dynamic``), then the host pool registered; ``fields``: ``HiCacheStorageConfig`` fields."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconnect.connectors.testing.sglang import storage_config

    cfg = storage_config(extra_config=extra, model_name=model, layout=host.layout, **fields)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


def check_clear_empties_only_its_key_space(make_extra: Callable[..., dict[str, Any]], page_size: int = 4) -> None:
    """``clear()`` removes every page of the engine's key space; another tenant's pages, TP
    rank 1's pages and another model's pages on the same store survive, byte-exact, and the
    cleared engine writes and reads again. ``make_extra(**keys)``: the extra config of one
    backend over the store, with more adapter keys (``tenant``, ``model_fingerprint``)."""
    ps = page_size
    host = make_cpu_host_pool("page_first", page_size=ps, host_tokens=ps * 120)
    n = 6
    keys = [hashlib.sha256(f"clear:{i}".encode()).hexdigest() for i in range(n)]
    engines = {
        "mine": direct_backend(host, make_extra(tenant="a")),
        "tenant b": direct_backend(host, make_extra(tenant="b")),
        "tp rank 1": direct_backend(host, make_extra(tenant="a"), tp_rank=1, tp_size=2),
        "other model": direct_backend(host, make_extra(tenant="a", model_fingerprint="v2")),
    }
    try:
        want = {}
        for seed, (name, b) in enumerate(engines.items()):
            idx = host.alloc(n * ps)
            fill_pages(host, idx, seed=seed + 10)
            want[name] = pages_at(host, idx)
            assert b.batch_set_v1(keys, idx) == [True] * n, name
            assert b.batch_exists(keys) == n, name
        assert engines["mine"].clear() is True
        assert engines["mine"].batch_exists(keys) == 0
        assert not any(engines["mine"].batch_get_v1(keys, host.alloc(n * ps)))
        for name, b in engines.items():
            if name == "mine":
                continue
            idx = host.alloc(n * ps)
            assert b.batch_exists(keys) == n, name
            assert b.batch_get_v1(keys, idx) == [True] * n, name
            assert pages_at(host, idx) == want[name], name
        # the cleared engine writes and reads again
        idx = host.alloc(n * ps)
        fill_pages(host, idx, seed=99)
        assert engines["mine"].batch_set_v1(keys, idx) == [True] * n
        back = host.alloc(n * ps)
        assert engines["mine"].batch_get_v1(keys, back) == [True] * n
        assert pages_at(host, back) == pages_at(host, idx)
    finally:
        for b in engines.values():
            b.close()
