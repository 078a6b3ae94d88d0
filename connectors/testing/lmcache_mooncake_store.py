"""LMCache's ``mooncake_store`` L2 adapter with its native client rendered in Python, for
benchmarks where LMCache's C++ extension (``lmcache.lmcache_mooncake``) is not installed.

LMCache builds ``mooncake_store`` as its generic ``NativeConnectorL2Adapter`` (the Python
bridge: three event fds, a demux thread, client-side locks, usage accounting) over
``LMCacheMooncakeClient``, a pybind C++ connector that owns one Mooncake ``RealClient`` set up
from the adapter's JSON (``setup_internal(ConfigDict)``) and runs each batch on ``num_workers``
threads (default 4), one ``RealClient`` call per key: ``put_from`` per stored chunk,
``get_into`` per loaded chunk, ``isExist`` per looked-up key, completions signalled on one
event fd and handed out by ``drain_completions()``. PyPI's LMCache wheel ships the bridge but
not the connector.

``MooncakeStoreClient`` is that connector's interface and per-key calls over the Mooncake
wheel's ``MooncakeDistributedStore`` (the same ``RealClient``, set up from the same dict by its
``setup(config: dict)``), and ``LMCacheMooncakeStoreL2Adapter`` is LMCache's own
``NativeConnectorL2Adapter`` over it, loadable as an LMCache L2 plugin::

    {"type": "plugin", "module_path": "kvconnect.connectors.testing.lmcache_mooncake_store",
     "class_name": "LMCacheMooncakeStoreL2Adapter", "adapter_params": {<mooncake_store's JSON>}}

Its figures stand in for ``mooncake_store``'s: the per-key ``RealClient`` calls are the
same; what differs is that the submitting and the completion hand-off run in Python (the GIL
is released inside each Mooncake call). ``client_throughput`` measures the client itself,
the bound on any adapter built on those calls.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from typing import Any

from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import NativeConnectorL2Adapter

_LMCACHE_ONLY_KEYS = {"type", "num_workers", "eviction", "per_op_workers"}  # as mooncake_store's config


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def setup_dict(params: dict[str, Any]) -> dict[str, str]:
    """What ``mooncake_store`` forwards to Mooncake: every key but LMCache's own, as strings
    (``master_server_address`` also as the Python binding's ``master_server_addr``)."""
    setup = {k: str(v) for k, v in params.items() if k not in _LMCACHE_ONLY_KEYS and v is not None}
    if "master_server_address" in setup:
        setup.setdefault("master_server_addr", setup["master_server_address"])
    return setup


def open_client(params: dict[str, Any]):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(setup_dict(params))
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed: rc {rc}")
    return client


class MooncakeStoreClient:
    """``LMCacheMooncakeClient``'s interface: ``event_fd``, ``submit_batch_get/set/exists/delete``
    (a future id each), ``drain_completions`` -> ``[(future_id, ok, error, per-key bools)]``,
    ``close``; each batch's keys spread over ``num_workers`` threads, one call per key."""

    def __init__(self, params: dict[str, Any], num_workers: int = 4, client: Any = None):
        self._client = client if client is not None else open_client(params)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, list] = {}  # future id -> [per-key results, keys left, error, op]
        self._done: list[tuple[int, bool, str, list[bool] | None]] = []
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._worker, daemon=True, name=f"mc-store-{i}")
                         for i in range(max(1, int(num_workers)))]
        for t in self._threads:
            t.start()

    def event_fd(self) -> int:
        return self._efd

    def _submit(self, op: str, keys: list[str], views: list | None) -> int:
        with self._lock:
            self._next += 1
            fid = self._next
            self._pending[fid] = [[False] * len(keys), len(keys), "", op]
        if not keys:
            self._finish(fid)
        for i, key in enumerate(keys):
            self._work.put((fid, op, i, key, views[i] if views is not None else None))
        return fid

    def submit_batch_set(self, keys: list[str], views: list) -> int:
        return self._submit("set", keys, views)

    def submit_batch_get(self, keys: list[str], views: list) -> int:
        return self._submit("get", keys, views)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit("exists", keys, None)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("delete", keys, None)

    def _worker(self) -> None:
        c = self._client
        while True:
            item = self._work.get()
            if item is None:
                return
            fid, op, i, key, view = item
            err = ""
            try:
                if op == "set":
                    ok = c.put_from(key, _address(view), len(view)) == 0
                elif op == "get":
                    ok = c.get_into(key, _address(view), len(view)) >= 0
                elif op == "exists":
                    rc = c.is_exist(key)
                    ok, err = rc == 1, ("isExist failed" if rc < 0 else "")
                else:
                    ok = c.remove(key) == 0
            except Exception as e:  # noqa: BLE001 - reported in the completion, as the C++ worker does
                ok, err = False, f"{type(e).__name__}: {e}"
            with self._lock:
                entry = self._pending[fid]
                entry[0][i] = ok
                entry[1] -= 1
                if err:
                    entry[2] = err
                last = entry[1] == 0
            if last:
                self._finish(fid)

    def _finish(self, fid: int) -> None:
        with self._lock:
            bools, _, err, op = self._pending.pop(fid)
            # a lookup succeeds with misses in it; a store or load only if every key went through
            self._done.append((fid, not err and (op == "exists" or all(bools)), err, bools))
        os.eventfd_write(self._efd, 1)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join(10)
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


class LMCacheMooncakeStoreL2Adapter(NativeConnectorL2Adapter):
    """LMCache's ``NativeConnectorL2Adapter`` over ``MooncakeStoreClient`` (what
    ``mooncake_store``'s factory returns, with the connector in Python)."""

    def __init__(self, params: dict[str, Any], l1_memory_desc: Any = None, client: Any = None):
        params = dict(params or {})
        super().__init__(MooncakeStoreClient(params, int(params.get("num_workers", 4)), client=client),
                         type_name="mooncake_store (Python connector)")


def client_throughput(params: dict[str, Any], chunks: int, chunk_bytes: int, workers: int = 4,
                      rounds: int = 3) -> dict[str, float]:
    """The Mooncake client by itself on the same master: ``chunks`` chunks put, looked up and
    read back, one call per key on ``workers`` threads (as ``mooncake_store``'s connector does)
    and as one batch call each; puts also with Mooncake's ``preferred_segment`` set to the
    client's own segment (``*_local_store_MBps``: where the master places them otherwise, any
    mounted segment, the put crosses the transport); the best of ``rounds`` rounds (fresh keys
    per round), bytes verified."""
    import numpy as np
    from mooncake.store import ReplicateConfig

    client = open_client(params)
    local = ReplicateConfig()
    local.replica_num = 1
    local.preferred_segment = client.get_hostname()
    try:
        src = np.random.default_rng(3).integers(0, 255, size=(chunks, chunk_bytes), dtype=np.uint8)
        dst = np.zeros_like(src)
        for buf in (src, dst):  # registered, as Mooncake's direct paths want
            client.register_buffer(buf.ctypes.data, buf.nbytes)
        ptr = lambda a, i: a.ctypes.data + i * chunk_bytes  # noqa: E731
        mb = chunks * chunk_bytes / (1 << 20)
        best: dict[str, float] = {}

        def keep(name: str, value: float) -> None:
            best[name] = max(best.get(name, 0.0), value)

        def spread(fn) -> float:
            idx = list(range(chunks))
            lock = threading.Lock()
            fails = []

            def run() -> None:
                while True:
                    with lock:
                        if not idx:
                            return
                        i = idx.pop()
                    if not fn(i):
                        fails.append(i)

            ts = [threading.Thread(target=run) for _ in range(workers)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if fails:
                raise RuntimeError(f"{len(fails)} of {chunks} calls failed")
            return time.perf_counter() - t0

        for rnd in range(rounds + 1):  # round 0 warms connections
            keys = [f"kvc-bench-raw-{rnd}-{i}" for i in range(chunks)]
            bkeys = [k + "-b" for k in keys]
            put_s = spread(lambda i: client.put_from(keys[i], ptr(src, i), chunk_bytes) == 0)
            look_s = spread(lambda i: client.is_exist(keys[i]) == 1)
            dst[:] = 0
            get_s = spread(lambda i: client.get_into(keys[i], ptr(dst, i), chunk_bytes) == chunk_bytes)
            if not np.array_equal(src, dst):
                raise RuntimeError("the Mooncake client read back other bytes")
            t0 = time.perf_counter()
            rcs = client.batch_put_from(bkeys, [ptr(src, i) for i in range(chunks)], [chunk_bytes] * chunks)
            bput_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            ex = client.batch_is_exist(bkeys)
            blook_s = time.perf_counter() - t0
            dst[:] = 0
            t0 = time.perf_counter()
            got = client.batch_get_into(bkeys, [ptr(dst, i) for i in range(chunks)], [chunk_bytes] * chunks)
            bget_s = time.perf_counter() - t0
            if any(r != 0 for r in rcs) or any(e != 1 for e in ex) or any(g != chunk_bytes for g in got) \
                    or not np.array_equal(src, dst):
                raise RuntimeError("the Mooncake client's batch calls failed or read back other bytes")
            lkeys = [k + "-l" for k in keys]
            lput_s = spread(lambda i: client.put_from(lkeys[i] + "k", ptr(src, i), chunk_bytes, local) == 0)
            t0 = time.perf_counter()
            rcs = client.batch_put_from(lkeys, [ptr(src, i) for i in range(chunks)], [chunk_bytes] * chunks, local)
            blput_s = time.perf_counter() - t0
            dst[:] = 0
            got = client.batch_get_into(lkeys, [ptr(dst, i) for i in range(chunks)], [chunk_bytes] * chunks)
            if any(r != 0 for r in rcs) or any(g != chunk_bytes for g in got) or not np.array_equal(src, dst):
                raise RuntimeError("the Mooncake client's local-segment puts failed or read back other bytes")
            for k in keys + bkeys + lkeys + [k + "k" for k in lkeys]:
                client.remove(k)
            if rnd:
                keep("per_key_store_MBps", mb / put_s)
                keep("per_key_load_MBps", mb / get_s)
                keep("per_key_lookup_keys_per_s", chunks / look_s)
                keep("batch_store_MBps", mb / bput_s)
                keep("batch_load_MBps", mb / bget_s)
                keep("batch_lookup_keys_per_s", chunks / blook_s)
                keep("per_key_local_store_MBps", mb / lput_s)
                keep("batch_local_store_MBps", mb / blput_s)
        return {"chunks": chunks, "chunk_bytes": chunk_bytes, "workers": workers, "rounds": rounds, **best}
    finally:
        client.close()
