"""KV events for the shared store, checked as a router sees them.

SGLang's HiCache adapter (real host pools on CPU) publishes ``BlockStored`` / ``BlockRemoved``
with medium ``EXTERNAL`` through SGLang's own ``ZmqEventPublisher``; a ZMQ subscriber decodes
them as a router would (``connectors/testing/kv_events.py``) and the test compares its view
with the store's contents: every put and removal (deletes, clears, evictions) seen within 1 s,
and no event naming a page the store does not hold.
"""

from __future__ import annotations

import hashlib
import random
import time

import pytest

pytest.importorskip("sglang.srt.disaggregation.kv_events")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvconnect.connectors.base import Capability, ConfigError, Unsupported  # noqa: E402
from kvconnect.connectors.engines.kv_events import block_hash, prefix_block_hashes  # noqa: E402
from kvconnect.connectors.memory import MemoryStore, MemoryStoreConfig  # noqa: E402
from kvconnect.connectors.testing.kv_events import EventSubscriber  # noqa: E402
from kvconnect.connectors.testing.sglang import (  # noqa: E402
    fill_pages, make_cpu_host_pool, storage_config, storage_page_keys)

WITHIN_S = 1.0
EVENTS = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "bind": True, "topic": "kvc",
          "replay_endpoint": "tcp://127.0.0.1:*"}


def _backend(host, extra: dict):
    cfg = storage_config(extra_config={"kv_events": EVENTS, **extra}, layout=host.layout)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


def _subscribe(b) -> EventSubscriber:
    src = b._events.source()
    sub = EventSubscriber(src["endpoint"], src["topic"], src.get("replay_endpoint"))
    time.sleep(0.2)  # the SUB connection; anything earlier comes back through the replay socket
    return sub


def _in_store(b, keys) -> set[int]:
    present = b.kv.store.exists(keys)
    return {block_hash(k) for k, p in zip(keys, present) if p}


def _settled(sub, b, keys, within: float = WITHIN_S) -> tuple[set, set]:
    """The subscriber's view once it matches the store, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        want = _in_store(b, keys)
        seen, _ = sub.snapshot()
        if seen == want or time.monotonic() > deadline:
            return seen, want
        time.sleep(0.02)


def _arrival(received, kind: str, h: int, after: float):
    for t, ev in received:
        if t >= after and type(ev).__name__ == kind and h in ev.block_hashes:
            return t
    return None


@pytest.mark.parametrize("store", ["memory", "hf3fs"])
def test_a_router_sees_every_put_and_removal_within_1s_and_nothing_else(store, tmp_path):
    host = make_cpu_host_pool("page_first", page_size=4)
    page = host.get_dummy_flat_data_page().nbytes
    capacity_pages = 12
    if store == "memory":
        extra = {"store": "memory", "capacity": capacity_pages * page}
    else:  # the in-process index: its LRU evictions are this process's to report
        extra = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "kv"), "file_size": capacity_pages * page,
                 "entries": 8, "numjobs": 1}
    b = _backend(host, extra)
    assert b.kv.store.supports(Capability.EVICTION_EVENTS)
    sub = _subscribe(b)
    evicted_at: dict[int, float] = {}
    b.kv.store.add_eviction_listener(lambda keys: evicted_at.update((block_hash(k), time.monotonic()) for k in keys))
    rng = random.Random(5)
    tokens = [rng.randrange(1000) for _ in range(4 * 40)]
    keys = storage_page_keys(tokens, 4)  # SGLang's own L3 keys of one prompt's pages
    idx = host.alloc(8 * host.page_size)
    fill_pages(host, idx, seed=1)
    puts, removals = [], []  # (block hash, time the call returned)
    try:
        for step in range(10):
            start = rng.randrange(0, len(keys) - 8)
            batch = keys[start:start + 8]
            info = HiCacheStorageExtraInfo(prefix_keys=keys[:start] or None)
            ok = b.batch_set_v1(batch, idx, info)
            now = time.monotonic()
            puts += [(block_hash(k), now) for k, o in zip(batch, ok) if o]
            if step % 3 == 2:
                victims = rng.sample(keys, 6)
                gone = b.batch_delete(victims)
                now = time.monotonic()
                removals += [(block_hash(k), now) for k, g in zip(victims, gone) if g]
            seen, want = _settled(sub, b, keys)
            assert seen == want, f"step {step}: router has {len(seen - want)} pages the store lacks, " \
                                 f"misses {len(want - seen)}"
        assert evicted_at, "the workload should overflow the store"
        _, received = sub.snapshot()
        late = [h for h, t in puts if h not in evicted_at and not _arrival(received, "BlockStored", h, t - WITHIN_S)]
        assert not late
        for h, t in removals + [(h, t) for h, t in evicted_at.items()]:
            arrived = _arrival(received, "BlockRemoved", h, t - 0.5)
            assert arrived is not None and arrived - t <= WITHIN_S, f"removal of {h} not seen within 1 s"
        assert all(ev.medium == "EXTERNAL" for _, ev in received)
        stored = [ev for _, ev in received if type(ev).__name__ == "BlockStored"]
        assert all(ev.block_size == 4 for ev in stored)
        # the router tells which leading pages of the prompt the store holds from the events alone
        hashes = prefix_block_hashes(tokens, 4)
        assert hashes == [block_hash(k) for k in keys]
        present = b.kv.store.exists(keys)
        lead = next((i for i, p in enumerate(present) if not p), len(keys))
        assert sub.blocks.cached_pages(hashes) == lead
        b.clear()  # SGLang's /clear_hicache_storage_backend
        seen, want = _settled(sub, b, keys)
        assert seen == want == set()
    finally:
        sub.close()
        b.close()


def test_pages_one_engine_loads_are_announced_by_it_too(tmp_path):
    """Two engines over one in-process HF3FS index (one process, one data file): the second
    one's loads of the first one's pages are in its own events; the index's evictions are in both."""
    prefix = str(tmp_path / "kv")
    hosts = [make_cpu_host_pool("page_first", page_size=4) for _ in range(2)]
    page = hosts[0].get_dummy_flat_data_page().nbytes
    extra = {"store": "hf3fs", "file_path_prefix": prefix, "file_size": 16 * page, "numjobs": 1, "entries": 8}
    a, b = (_backend(h, extra) for h in hosts)
    subs = [_subscribe(x) for x in (a, b)]
    keys = [hashlib.sha256(f"load:{i}".encode()).hexdigest() for i in range(8)]
    try:
        ia = hosts[0].alloc(8 * 4)
        fill_pages(hosts[0], ia, seed=3)
        assert a.batch_set_v1(keys, ia) == [True] * 8
        ib = hosts[1].alloc(8 * 4)
        assert b.batch_get_v1(keys[:5], ib[:20]) == [True] * 5
        assert _settled(subs[0], a, keys)[0] == {block_hash(k) for k in keys}
        deadline = time.monotonic() + WITHIN_S
        while subs[1].snapshot()[0] != {block_hash(k) for k in keys[:5]} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert subs[1].snapshot()[0] == {block_hash(k) for k in keys[:5]}
        # a's writes overflow the file: the index evicts its least recently used pages (not the
        # ones b's reads still lease); both engines' events follow the store
        more = [hashlib.sha256(f"more:{i}".encode()).hexdigest() for i in range(16)]
        for i in range(0, 16, 8):
            assert a.batch_set_v1(more[i:i + 8], ia) == [True] * 8
        every = keys + more
        assert len(_in_store(a, every)) == 16 and a._events.counts["evicted"] == 8
        assert _settled(subs[0], a, every)[0] == _in_store(a, every)
        b_view = {block_hash(k) for k in keys[:5]} & _in_store(b, every)
        deadline = time.monotonic() + WITHIN_S
        while subs[1].snapshot()[0] != b_view and time.monotonic() < deadline:
            time.sleep(0.02)
        assert subs[1].snapshot()[0] == b_view
        assert b._events.counts["evicted"] == 8  # b's listener heard the index too
    finally:
        for s in subs:
            s.close()
        a.close()
        b.close()


def test_stores_that_cannot_report_evictions_refuse_listeners_and_bad_config_names_the_key():
    from kvconnect.connectors.testing.stores import SharedMemoryConfig, SharedMemoryStore

    with pytest.raises(Unsupported, match="reporting evictions"):
        SharedMemoryStore(SharedMemoryConfig(space="x")).add_eviction_listener(lambda keys: None)
    m = MemoryStore(MemoryStoreConfig(capacity=64))
    got: list = []
    remove = m.add_eviction_listener(got.extend)
    src = bytearray(b"x" * 40)
    from kvconnect.connectors.buffers import buffer_address

    page = [(buffer_address(src), 40)]
    assert m.put_from(["a"], [page]) == [True] and m.put_from(["b"], [page]) == [True]
    assert got == ["a"]
    remove()
    m.put_from(["c"], [page])
    assert got == ["a"]
    host = make_cpu_host_pool("page_first")
    for bad, match in [({"publisher": "kafka"}, r"'kv_events.publisher'.*accepted: null, zmq"),
                       ("{not json", r"'kv_events': not JSON"),
                       ({"hwm": "lots"}, r"'kv_events'.*accepted: .*endpoint")]:
        with pytest.raises(ConfigError, match=match):
            StorageBackendFactory.create_backend(
                "dynamic", storage_config(extra_config={"store": "memory", "kv_events": bad}), host)


def test_an_endpoint_in_use_fails_the_attach_naming_the_key():
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        host = make_cpu_host_pool("page_first")
        cfg = storage_config(extra_config={"store": "memory", "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{port}", "bind": True}})
        b = StorageBackendFactory.create_backend("dynamic", cfg, host)
        with pytest.raises(ConfigError, match=r"'kv_events': cannot publish on 'tcp://127.0.0.1:\d+'"):
            b.register_mem_pool_host(host)
        b.close()
    finally:
        sock.close(linger=0)


def test_external_block_hashes_are_the_ones_sglangs_radix_cache_publishes_for_the_prompt():
    """The mapping docs/kv_events.md states: an unsalted prompt's pages carry the block hashes
    SGLang's own radix cache publishes for them on GPU; a salted prompt's are its storage chain's,
    which ``prefix_block_hashes`` computes from the tokens and the salt."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    tokens = list(range(500, 532))
    tree = RadixCache.create_simulated(page_size=4, enable_kv_cache_events=True)
    tree.take_events()
    tree.insert(InsertParams(key=RadixKey(array("l", tokens)), value=torch.arange(len(tokens))))
    gpu = [h for ev in tree.take_events() if type(ev).__name__ == "BlockStored" for h in ev.block_hashes]

    host = make_cpu_host_pool("page_first", page_size=4)
    b = _backend(host, {"store": "memory"})
    sub = _subscribe(b)
    try:
        plain = storage_page_keys(tokens, 4)
        salted = storage_page_keys(tokens, 4, cache_salt="user-7")
        idx = host.alloc(len(plain) * 4)
        fill_pages(host, idx, seed=2)
        assert b.batch_set_v1(plain, idx) == [True] * len(plain)
        assert b.batch_set_v1(salted, idx) == [True] * len(salted)
        seen, want = _settled(sub, b, plain + salted)
        assert seen == want
        _, received = sub.snapshot()
        external = [h for _, ev in received if type(ev).__name__ == "BlockStored" for h in ev.block_hashes]
        assert external[:len(plain)] == gpu == prefix_block_hashes(tokens, 4)
        assert external[len(plain):] == prefix_block_hashes(tokens, 4, cache_salt="user-7")
        assert not set(external[len(plain):]) & set(gpu)
        assert sub.blocks.cached_pages(prefix_block_hashes(tokens + [1, 2], 4)) == len(plain)
    finally:
        sub.close()
        b.close()


def test_evictions_by_a_metadata_service_are_found_by_the_audit(tmp_path):
    """HF3FS with ``kvconnect hf3fs-meta serve`` (a real process): the service evicts, out of
    the engine's sight (no ``eviction_events``); the audit looks the announced pages up again
    and retracts those gone, within one audit round (1 s) plus delivery."""
    from kvconnect.connectors.testing.hf3fs import MetaProcess

    meta = MetaProcess(tmp_path / "meta").start()
    host = make_cpu_host_pool("page_first", page_size=4)
    page = host.get_dummy_flat_data_page().nbytes
    b = _backend(host, {"store": "hf3fs", "file_path_prefix": str(tmp_path / "kv"), "file_size": 8 * page,
                        "entries": 8, "numjobs": 1, "metadata_server_url": meta.url})
    sub = _subscribe(b)
    try:
        assert not b.kv.store.supports(Capability.EVICTION_EVENTS)
        keys = [hashlib.sha256(f"svc:{i}".encode()).hexdigest() for i in range(16)]
        idx = host.alloc(8 * 4)
        fill_pages(host, idx, seed=4)
        assert b.batch_set_v1(keys[:8], idx) == [True] * 8
        assert _settled(sub, b, keys)[0] == {block_hash(k) for k in keys[:8]}
        assert b.batch_set_v1(keys[8:], idx) == [True] * 8  # the file holds 8 pages: the service evicts
        in_store = _in_store(b, keys)
        assert len(in_store) == 8 and in_store != {block_hash(k) for k in keys[:8]}
        seen, want = _settled(sub, b, keys, within=1.0 + 1.5)  # one audit round, then delivery
        assert seen == want == in_store
        assert b._events.counts["evicted"] >= 8 - len(in_store & {block_hash(k) for k in keys[:8]})
    finally:
        sub.close()
        b.close()
        meta.stop()


def test_write_behind_pages_are_announced_once_their_background_write_landed():
    host = make_cpu_host_pool("page_first", page_size=4)
    b = _backend(host, {"store": "memory", "write_behind": "1mb"})
    sub = _subscribe(b)
    try:
        keys = [hashlib.sha256(f"wb:{i}".encode()).hexdigest() for i in range(6)]
        idx = host.alloc(6 * 4)
        fill_pages(host, idx, seed=9)
        assert b.batch_set_v1(keys, idx) == [True] * 6  # staged
        assert b._write_behind.flush(5.0)
        seen, want = _settled(sub, b, keys)
        assert seen == want == {block_hash(k) for k in keys}
    finally:
        sub.close()
        b.close()


def test_a_router_that_subscribes_late_gets_the_earlier_events_through_the_replay_socket():
    from kvconnect.connectors.engines.kv_events import StoreEvents

    events = StoreEvents.create(EVENTS)
    try:
        keys = [hashlib.sha256(f"late:{i}".encode()).hexdigest() for i in range(6)]
        events.stored(keys[:3])
        time.sleep(0.3)  # published before anyone listened
        src = events.source()
        sub = EventSubscriber(src["endpoint"], src["topic"], src["replay_endpoint"])
        time.sleep(0.2)
        events.stored(keys[3:])
        deadline = time.monotonic() + WITHIN_S
        while sub.snapshot()[0] != {block_hash(k) for k in keys} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sub.snapshot()[0] == {block_hash(k) for k in keys} and sub.replays >= 1
        sub.close()
    finally:
        events.close()
