"""The benchmark's stand-in for LMCache's ``mooncake_store``: LMCache's own
``NativeConnectorL2Adapter`` over ``MooncakeStoreClient``, here over a fake Mooncake client (no
master): each batch becomes one call per key on the workers, results come back through the event
fd, and LMCache's bridge turns them into its store / lookup / load results, bytes exact."""

from __future__ import annotations

import ctypes
import threading

import pytest

pytest.importorskip("lmcache")

from kvconnect.connectors.testing.lmcache_adapter import L1, load, lookup, okeys, store  # noqa: E402
from kvconnect.connectors.testing.lmcache_mooncake_store import (  # noqa: E402
    LMCacheMooncakeStoreL2Adapter,
    setup_dict,
)


class FakeClient:
    """``MooncakeDistributedStore``'s per-key calls over a dict; counts calls per thread."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def _note(self, op: str, key: str) -> None:
        with self.lock:
            self.calls.append((op, key))
            self.threads.add(threading.current_thread().name)

    def put_from(self, key: str, ptr: int, size: int) -> int:
        self._note("put", key)
        self.objects[key] = ctypes.string_at(ptr, size)
        return 0

    def get_into(self, key: str, ptr: int, size: int) -> int:
        self._note("get", key)
        data = self.objects.get(key)
        if data is None or len(data) != size:
            return -1
        ctypes.memmove(ptr, data, size)
        return size

    def is_exist(self, key: str) -> int:
        self._note("exists", key)
        return 1 if key in self.objects else 0

    def remove(self, key: str) -> int:
        self._note("remove", key)
        return 0 if self.objects.pop(key, None) is not None else -1

    def close(self) -> None:
        pass


def test_bridge_over_the_python_connector_round_trips_per_key():
    fake = FakeClient()
    adapter = LMCacheMooncakeStoreL2Adapter({"num_workers": 3}, client=fake)
    try:
        l1 = L1(12)
        l1.fill_random(5)
        keys = okeys(6)
        res = store(adapter, keys, l1.objs[:6])
        assert res is not False and int(res) >= 0
        assert [op for op, _ in fake.calls].count("put") == 6  # one call per key, as the C++ connector
        assert lookup(adapter, keys + okeys(2, base=100), {}) == list(range(6))
        adapter.submit_unlock(keys)
        assert load(adapter, keys, l1.objs[6:]) == list(range(6))
        assert all(l1.data(6 + i) == l1.data(i) for i in range(6))
        fake.objects.pop(next(iter(fake.objects)))  # a key gone from the store: its bit is 0
        assert len(load(adapter, keys, l1.objs[6:])) == 5
        assert len(fake.threads) > 1 and all(t.startswith("mc-store-") for t in fake.threads)
    finally:
        adapter.close()


def test_setup_dict_forwards_mooncake_keys_as_strings():
    got = setup_dict({"type": "mooncake_store", "num_workers": 4, "master_server_address": "127.0.0.1:50051",
                      "global_segment_size": 1 << 20, "protocol": "tcp", "eviction": None})
    assert got == {"master_server_address": "127.0.0.1:50051", "master_server_addr": "127.0.0.1:50051",
                   "global_segment_size": str(1 << 20), "protocol": "tcp"}
