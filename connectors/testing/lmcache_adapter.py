"""LMCache's L2 adapter interface driven in-process: LMCache ``TensorMemoryObj`` buffers (an L1
stand-in carved from one CPU tensor, as the server's L1 is), adapters built by LMCache's own
plugin factory from the ``--l2-adapter`` JSON, and the store / lookup-and-lock / load calls
waited for on the adapter's event fds, as LMCache's server waits for them.

Imports lmcache and torch (``pip install "kvconnect[lmcache]"``).
"""

from __future__ import annotations

import argparse
import select
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from kvconnect.connectors.testing.lmcache import plugin_json

CHUNK = 64 * 1024
WAIT_S = 20.0


class L1:
    """A CPU buffer carved into LMCache ``TensorMemoryObj``s, as the server's L1 is."""

    def __init__(self, n: int, size: int = CHUNK):
        self.buf = torch.zeros(n * size, dtype=torch.uint8)
        self.size = size
        self.objs = []
        for i in range(n):
            raw = self.buf[i * size:(i + 1) * size]
            meta = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.uint8, address=i * size,
                                     phy_size=size, fmt=MemoryFormat.KV_2LTD, ref_count=1)
            self.objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))

    def desc(self) -> L1MemoryDesc:
        return L1MemoryDesc(ptr=self.buf.data_ptr(), size=self.buf.numel(), align_bytes=1)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.buf.copy_(torch.randint(0, 256, (self.buf.numel(),), dtype=torch.uint8, generator=g))

    def data(self, i: int) -> bytes:
        return bytes(self.objs[i].byte_array)


def make_adapter(params: dict, l1: L1 | None = None):
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[plugin_json(params)]))
    return create_l2_adapter(cfg.adapters[0], l1_memory_desc=(l1 or L1(1)).desc())


def okeys(n: int, *, model: str = "m", kv_rank: int = 0, group: int = 0, salt: str = "", base: int = 0):
    return [ObjectKey(chunk_hash=(base + i).to_bytes(32, "big"), model_name=model, kv_rank=kv_rank,
                      object_group_id=group, cache_salt=salt) for i in range(n)]


def wait_fd(fd: int, deadline: float) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(max(0, deadline - time.monotonic()) * 1000):
        consume_fd(fd)


def wait_store(adapter, tid: int, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = adapter.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
        assert not done, f"unexpected store results {done}"
        wait_fd(adapter.get_store_event_fd(), min(deadline, time.monotonic() + 0.2))
    raise AssertionError(f"store task {tid} did not complete in {timeout}s")


def wait_result(query, fd: int, tid: int, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = query(tid)
        if r is not None:
            return r
        wait_fd(fd, min(deadline, time.monotonic() + 0.2))
    raise AssertionError(f"task {tid} did not complete in {timeout}s")


def lookup(adapter, keys, *args) -> list[int]:
    tid = adapter.submit_lookup_and_lock_task(keys, *args)
    bm = wait_result(adapter.query_lookup_and_lock_result, adapter.get_lookup_and_lock_event_fd(), tid)
    return bm.get_indices_list()


def load(adapter, keys, objs) -> list[int]:
    tid = adapter.submit_load_task(keys, objs)
    bm = wait_result(adapter.query_load_result, adapter.get_load_event_fd(), tid)
    return bm.get_indices_list()


def store(adapter, keys, objs):
    return wait_store(adapter, adapter.submit_store_task(keys, objs))
