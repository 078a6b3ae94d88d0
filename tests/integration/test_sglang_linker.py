"""kvconnect's SGLang unified-cache linker inside real SGLang 0.5.23 pieces, on CPU.

Real: SGLang's ``ServerArgs`` with the linker flags, ``create_unified_cache_linker`` (backend
``dynamic``, loading ``kvconnect.connectors.engines.sglang_linker`` from the config JSON), the
``UnifiedRadixCache`` and its ``UnifiedCacheLinkerWrapper`` (match -> lookup, init_load_back ->
load, write-through -> offload, ``check_hicache_events`` -> offload commits, the layer counter),
device pools ``MHATokenToKVPool`` / ``MLATokenToKVPool`` / ``SWAKVPool`` on ``device="cpu"``, the
HiCache adapter on a real ``MHATokenToKVPoolHost``, kvconnect's memory store shared by name
(every registered store: ``test_sglang_linker_stores.py``).

Not real, and why: the model's forward (no GPU): computed KV is bytes drawn from each page's
SGLang storage hash (``connectors/testing/linker.py``). Two servers sharing a store are two
caches in one process.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (installed by scripts/install.sh)")
pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")

from kvconnect.connectors.base import Capability, ConfigError, UnknownConfigKey  # noqa: E402
from kvconnect.connectors.testing.linker import MODEL, LinkedServer, page_content  # noqa: E402
from kvconnect.connectors.testing.stores import SharedMemoryStore, clear_spaces  # noqa: E402

SHARED = "kvconnect.connectors.testing.stores:SharedMemoryStore"
RAISING = "kvconnect.connectors.testing.stores:RaisingStore"
FAULTY = "kvconnect.connectors.testing.stores:FaultyStore"
GATED = f"{__name__}:GatedStore"


@pytest.fixture(autouse=True)
def _spaces():
    clear_spaces()
    yield
    clear_spaces()


def prompt(n_tokens: int, tag: int) -> list:
    import random

    rng = random.Random(tag)
    return [rng.randrange(1, 30000) for _ in range(n_tokens)]


def assert_pages_are_computed_bytes(server: LinkedServer, result) -> None:
    nbytes = server.page_nbytes()
    for page, h in enumerate(result.page_hashes):
        assert server.page_bytes(result.slots, page) == page_content(h, nbytes), f"page {page}"


# ---------------------------------------------------------------------------------
# A prompt in the store: loaded, not recomputed
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_prompt_in_the_store_loads_with_no_recomputed_page(kind):
    """Server A computes and offloads a prompt; server B (its own cache and pools, the same
    store) loads every full page through SGLang's tree and recomputes none; B's KV bytes
    are the bytes A computed. A prompt sharing only a prefix loads that prefix. (Every
    registered store: ``test_sglang_linker_stores.py``.)"""
    store_extra = {"store": SHARED, "space": "linker", "capacity": "16mb"}
    a = LinkedServer(store_extra, kind=kind)
    b = LinkedServer(store_extra, kind=kind)
    try:
        tokens = prompt(4 * 6 + 3, 1)
        first = a.prefill(tokens)
        assert (first.loaded_tokens, first.computed_pages) == (0, 6)
        assert a.linker.counts["offloaded_pages"] == 6

        from prometheus_client import REGISTRY

        before = REGISTRY.get_sample_value("kvconnect_linker_loaded_pages_total")
        second = b.prefill(tokens)
        assert (second.device_hit_tokens, second.loaded_tokens, second.computed_pages) == (0, 24, 0)
        assert not second.load_failed
        assert_pages_are_computed_bytes(b, second)
        assert REGISTRY.get_sample_value("kvconnect_linker_loaded_pages_total") - before == 6
        assert b.linker.counts["offloaded_pages"] == 0  # already stored: not written again

        branch = tokens[:12] + prompt(8, 2)
        c = LinkedServer(store_extra, kind=kind)
        third = c.prefill(branch)
        c.close()
        assert (third.loaded_tokens, third.computed_pages) == (12, 2)
    finally:
        a.close()
        b.close()


EVENTS = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "bind": True, "topic": "kvc",
          "replay_endpoint": "tcp://127.0.0.1:*"}


def test_kv_events_name_the_pages_offloaded_and_loaded_within_a_second():
    """``kv_events`` on the linker: server A's offload of a prompt's 6 pages reaches a router's
    ZMQ subscriber as ``BlockStored`` (medium EXTERNAL) of exactly those pages' block hashes
    within 1 s; server C, loading the prompt from the store, announces the same pages on its own
    publisher. No event names a page the store does not hold. ``layer_groups`` > 1 with events is
    refused naming the key."""
    from kvconnect.connectors.engines.kv_events import block_hash
    from kvconnect.connectors.testing.kv_events import EventSubscriber

    store_extra = {"store": SHARED, "space": "linker-events", "capacity": "16mb"}

    def subscribe(server):
        src = server.linker._events.source()
        sub = EventSubscriber(src["endpoint"], src["topic"], src.get("replay_endpoint"))
        time.sleep(0.2)  # the SUB connection; anything earlier comes back through the replay socket
        return sub

    def seen_within(sub, want: set, within: float = 1.0) -> set:
        deadline = time.monotonic() + within
        while True:
            seen, received = sub.snapshot()
            if seen == want or time.monotonic() > deadline:
                assert all(ev.medium == "EXTERNAL" for _, ev in received if hasattr(ev, "medium"))
                return seen
            time.sleep(0.02)

    a = LinkedServer({**store_extra, "kv_events": EVENTS})
    c = LinkedServer({**store_extra, "kv_events": EVENTS})
    sub_a, sub_c = subscribe(a), subscribe(c)
    try:
        tokens = prompt(4 * 6 + 3, 7)
        first = a.prefill(tokens)
        want = {block_hash(h) for h in first.page_hashes}
        assert len(want) == 6 and a.linker.counts["offloaded_pages"] == 6
        assert seen_within(sub_a, want) == want
        kv = a.linker.linked["kv"].store
        assert all(kv.exists(list(first.page_hashes)))  # every announced page is in the store
        assert seen_within(sub_c, set(), 0.2) == set()  # C has done nothing yet
        loaded = c.prefill(tokens)
        assert (loaded.loaded_tokens, loaded.computed_pages) == (24, 0)
        assert seen_within(sub_c, want) == want
    finally:
        sub_a.close()
        sub_c.close()
        a.close()
        c.close()
    with pytest.raises(ConfigError, match="kv_events"):
        LinkedServer({**store_extra, "kv_events": EVENTS, "layer_groups": 3})


def test_hybrid_swa_pool_set_is_its_own_key_space():
    """FULL + SWA layers (``SWAKVPool``): the FULL pages and the SWA pages are two pools of
    the linker, under two key spaces; a second server loads the FULL prefix and only the
    SWA window's trailing pages, and recomputes nothing."""
    extra = {"store": SHARED, "space": "swa"}
    a = LinkedServer(extra, kind="swa", page_size=1, layers=3, swa_layers=(1,), sliding_window=8)
    b = LinkedServer(extra, kind="swa", page_size=1, layers=3, swa_layers=(1,), sliding_window=8)
    try:
        spaces = {n: p.store.keyspace for n, p in a.linker.linked.items()}
        assert set(spaces) == {"kv", "swa"} and spaces["kv"].prefix != spaces["swa"].prefix
        tokens = prompt(22, 3)
        a.prefill(tokens)
        assert a.linker.counts["offloaded_pages"] == 44  # 22 FULL pages + 22 SWA pages
        result = b.prefill(tokens)
        assert (result.loaded_tokens, result.computed_pages, result.load_failed) == (22, 0, False)
        assert b.linker.counts["loaded_pages"] == 22 + 8  # FULL prefix + the 8-token SWA window
        assert_pages_are_computed_bytes(b, result)
        # Without its SWA window the FULL pages alone restore nothing.
        swa_view = b.linker.linked["swa"].store
        swa_view.clear()
        third = LinkedServer(extra, kind="swa", page_size=1, layers=3, swa_layers=(1,), sliding_window=8)
        again = third.prefill(tokens, offload=False)
        assert (again.loaded_tokens, again.computed_pages) == (0, 22)
    finally:
        a.close()
        b.close()


def _mamba_linker(space: str):
    """kvconnect's linker over a hybrid FULL (MLA) + Mamba model's real CPU pools
    (``HybridLinearKVPool``, ``HybridReqToTokenPool`` with a ``MambaPool``), the pool group
    assembled by SGLang's own ``resolve_hybrid_device_pool_group``, built by SGLang's factory."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    from kvconnect.connectors.testing.linker import LINKER_CONFIG, publish_runtime

    server_args = publish_runtime(4)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=4,
                                    state_size=4, conv_kernel=4)
    req_pool = HybridReqToTokenPool(size=8, mamba_size=8, mamba_spec_state_size=0, max_context_len=1024,
                                    device="cpu", enable_memory_saver=False,
                                    cache_params=Mamba2CacheParams(shape=shape, layers=[1]), mamba_layer_ids=[1],
                                    enable_mamba_extra_buffer=False, enable_overlap_schedule=False)
    kv = HybridLinearKVPool(256, torch.bfloat16, 4, 1, 16, [0, 2], "cpu", req_pool.mamba_pool, use_mla=True,
                            kv_lora_rank=16, qk_rope_head_dim=8)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, page_size=4,
                             token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(256, 4, torch.bfloat16, "cpu",
                                                                                    kv, False),
                             tree_components=(ComponentType.FULL, ComponentType.MAMBA))
    linker = create_unified_cache_linker(
        server_args, params, backend="dynamic",
        config={**LINKER_CONFIG, "linker_extra_config": {"store": SHARED, "space": space}},
        components={ComponentType.FULL, ComponentType.MAMBA})
    return linker, kv.full_kv_pool, req_pool.mamba_pool.mamba_cache


def _mamba_state(cache, slot: int) -> bytes:
    return b"".join(t[:, slot].contiguous().view(torch.uint8).numpy().tobytes()
                    for t in (cache.temporal, *cache.conv))


def test_hybrid_mamba_state_is_its_own_key_space_and_restores_at_node_ends():
    """FULL (MLA) + Mamba: the Mamba state is a TP-sharded key space of its own; a lookup
    stops only where a state was offloaded (a node's last page), and a load brings back the
    KV pages and the state byte for byte, as SGLang's wrapper calls the linker."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    from kvconnect.connectors.testing.sglang import storage_page_keys

    writer, kv_a, mamba_a = _mamba_linker("mamba")
    reader, kv_b, mamba_b = _mamba_linker("mamba")
    try:
        spaces = {n: p.store.keyspace for n, p in writer.linked.items()}
        assert set(spaces) == {"kv", "mamba"} and not spaces["mamba"].rank_replicated
        keys = storage_page_keys(prompt(12, 12), 4)
        gen = torch.Generator().manual_seed(3)
        slots = torch.arange(16, 24, dtype=torch.int64)  # the first two pages' device slots
        for buf in kv_a.kv_buffer:
            buf[slots] = torch.randn(buf[slots].shape, generator=gen).to(buf.dtype)
        for t in (mamba_a.temporal, *mamba_a.conv):
            t[:, 3] = torch.randn(t[:, 3].shape, generator=gen).to(t.dtype)
        # One node of two pages: its KV and the state at its end.
        assert writer.offload([PoolTransfer(name=PoolName.KV, device_indices=slots, keys=keys[:2]),
                               PoolTransfer(name=PoolName.MAMBA, device_indices=torch.tensor([3]), keys=[keys[1]],
                                            hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        deadline = time.monotonic() + 10
        while writer.num_completed_offloads() == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert writer.pop_completed_offload()

        lookup = [PoolTransfer(name=PoolName.KV, keys=keys),
                  PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert reader.lookup("r", lookup) == [2]  # page 1 alone has no state to resume from

        dst = torch.arange(40, 48, dtype=torch.int64)
        assert reader.load("r", [PoolTransfer(name=PoolName.KV, device_indices=dst, keys=keys[:2]),
                                 PoolTransfer(name=PoolName.MAMBA, device_indices=torch.tensor([5]),
                                              keys=[keys[1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert reader.finish_layer_wise_loading(reader.start_layer_wise_loading())
        for a, b in zip(kv_a.kv_buffer, kv_b.kv_buffer):
            assert torch.equal(a[slots].view(torch.uint8), b[dst].view(torch.uint8))
        assert _mamba_state(mamba_b, 5) == _mamba_state(mamba_a, 3)
    finally:
        writer.close()
        reader.close()


def test_keys_are_salted_with_extra_key_and_cache_salt():
    """SGLang's tree hashes pages with the request's ``extra_key`` and ``cache_salt``: the
    same tokens under another salt or extra key find nothing; under the same ones, every page."""
    extra = {"store": SHARED, "space": "salted"}
    a, b = LinkedServer(extra), LinkedServer(extra)
    try:
        tokens = prompt(16, 4)
        a.prefill(tokens, cache_salt="tenant-a", extra_key="lora-1")
        assert b.prefill(tokens, cache_salt="tenant-b", extra_key="lora-1", offload=False).loaded_tokens == 0
        assert b.prefill(tokens, cache_salt="tenant-a", extra_key="lora-2", offload=False).loaded_tokens == 0
        assert b.prefill(tokens, offload=False).loaded_tokens == 0
        same = b.prefill(tokens, cache_salt="tenant-a", extra_key="lora-1", offload=False)
        assert (same.loaded_tokens, same.computed_pages) == (16, 0)
        assert_pages_are_computed_bytes(b, same)
    finally:
        a.close()
        b.close()


def test_mla_pages_leave_the_rank_out_and_the_writer_rank_offloads():
    """MLA KV is rank-replicated: its key space leaves the TP rank out (every rank reads the
    one copy) and this single rank (TP rank 0) is its writer."""
    server = LinkedServer({"store": SHARED, "space": "mla"}, kind="mla")
    try:
        pool = server.linker.linked["kv"]
        assert pool.store.keyspace.rank_replicated and pool.is_writer
        assert pool.store.keyspace.identity()["tp_rank"] is None
        assert pool.store.keyspace.geometry.startswith("mla:L3:D12:")
    finally:
        server.close()


# ---------------------------------------------------------------------------------
# Pages shared with the HiCache adapter
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_are_shared_with_the_hicache_adapter_on_a_layer_first_host_pool(kind):
    """The linker's KV pages are the HiCache adapter's pages of a ``layer_first`` host pool of
    the same model and geometry: each path reads, byte for byte, what the other wrote; a
    ``page_first`` host pool orders a page's bytes otherwise and is another key space."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconnect.connectors.testing.sglang import make_cpu_host_pool, page_bytes, storage_config, \
        storage_page_keys

    extra = {"store": SHARED, "space": "both"}

    def hicache(layout):
        host = make_cpu_host_pool(layout=layout, page_size=4, layer_num=3, head_num=2, head_dim=8,
                                  mla=kind == "mla")
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra_config=extra, model_name=MODEL, layout=layout, is_mla_model=kind == "mla"),
            host)
        backend.register_mem_pool_host(host)
        return host, backend

    linker_server = LinkedServer(extra, kind=kind)
    host, backend = hicache("layer_first")
    try:
        assert backend.kv.keyspace.prefix == linker_server.linker.linked["kv"].store.keyspace.prefix
        written = linker_server.prefill(prompt(16, 5))
        idx = host.alloc(16)
        assert all(backend.batch_get_v1(written.page_hashes, idx))
        nbytes = linker_server.page_nbytes()
        for page, h in enumerate(written.page_hashes):
            assert page_bytes(host, int(idx[page * 4])) == page_content(h, nbytes)

        # HiCache writes, the linker loads.
        tokens = prompt(12, 6)
        keys = storage_page_keys(tokens, 4)
        idx2 = host.alloc(12)
        for page, h in enumerate(keys):
            raw = torch.frombuffer(bytearray(page_content(h, nbytes)), dtype=torch.uint8)
            host.set_from_flat_data_page(int(idx2[page * 4]), raw.view(host.dtype))
        assert all(backend.batch_set_v1(keys, idx2))
        reader = LinkedServer(extra, kind=kind)
        result = reader.prefill(tokens, offload=False)
        reader.close()
        assert (result.loaded_tokens, result.computed_pages) == (12, 0)
        assert_pages_are_computed_bytes(reader, result)

        other_host, other = hicache("page_first")
        assert other.kv.keyspace.prefix != backend.kv.keyspace.prefix
        r = other.batch_exists_v2(written.page_hashes, [PoolTransfer(name=PoolName.KV, keys=written.page_hashes)])
        assert r.kv_hit_pages == 0
        other.close()
    finally:
        backend.close()
        linker_server.close()


# ---------------------------------------------------------------------------------
# Host staging (what a GPU server uses with a store that cannot write device memory)
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("writer, reader, groups", [("host", "off", 1), ("off", "host", 1), ("host", "host", 2)])
def test_staged_and_direct_pages_are_the_same_pages(writer, reader, groups):
    """``"staging": "host"`` moves pages through host buffers (one indexed copy per device
    buffer) instead of letting the store write the pools: the same key space and the same
    bytes, so a staged writer's pages load on a direct reader and the other way round."""
    extra = {"store": SHARED, "space": f"staging-{writer}-{reader}-{groups}", "layer_groups": groups}
    a = LinkedServer({**extra, "staging": writer})
    b = LinkedServer({**extra, "staging": reader})
    try:
        assert (a.linker.staged, b.linker.staged) == (writer == "host", reader == "host")
        assert a.linker.linked["kv"].store.prefix == b.linker.linked["kv"].store.prefix
        tokens = prompt(20, 14)
        a.prefill(tokens)
        result = b.prefill(tokens)
        assert (result.loaded_tokens, result.computed_pages, result.load_failed) == (20, 0, False)
        assert_pages_are_computed_bytes(b, result)
    finally:
        a.close()
        b.close()


def test_a_staged_load_that_outlives_its_deadline_fails_and_never_touches_the_slots(tmp_path):
    """With host staging a hanging read fails its batch at ``load_timeout_s`` (SGLang aborts
    the request at once, no hang), and the pages the store delivers afterwards are dropped:
    the request's device slots keep what they held."""
    flag = tmp_path / "slow"
    extra = {"store": FAULTY, "inner": SHARED, "inner_options": {"space": "deadline"}, "hang_on": ["get_into"],
             "hang_s": 2.0, "fault_flag": str(flag), "staging": "host", "load_timeout_s": 0.3}
    a, b = LinkedServer(extra), LinkedServer(extra)
    try:
        tokens = prompt(16, 15)
        a.prefill(tokens)
        flag.write_text("")
        t0 = time.monotonic()
        result = b.prefill(tokens, offload=False)
        assert time.monotonic() - t0 < 1.5
        assert result.loaded_tokens == 16 and result.load_failed
        assert b.linker.counts["failed_loads"] == 1
        time.sleep(2.2)  # the read returns; its pages must not land
        assert b.linker.counts["loads"] == 0
        assert all(b.page_bytes(result.slots, p) == bytes(b.page_nbytes()) for p in range(4))
    finally:
        a.linker.store.release()
        b.linker.store.release()
        a.close()
        b.close()


class RegisteringStore(SharedMemoryStore):
    """A shared memory store that, like an RDMA store, reads only into registered memory."""

    capabilities = SharedMemoryStore.capabilities | {Capability.NEEDS_REGISTERED_MEMORY}


def test_staging_refuses_a_store_that_needs_registered_memory():
    with pytest.raises(ConfigError) as err:
        LinkedServer({"store": f"{__name__}:RegisteringStore", "staging": "host"})
    assert "staging" in str(err.value) and "registered" in str(err.value)


# ---------------------------------------------------------------------------------
# Layer-wise load
# ---------------------------------------------------------------------------------


class GatedStore(SharedMemoryStore):
    """A shared memory store whose reads after the first wait for ``gate`` (module state)."""

    gate = threading.Event()
    reads = 0

    def _get_into(self, keys, pages):
        type(self).reads += 1
        if type(self).reads > 1:
            type(self).gate.wait(10)
        return super()._get_into(keys, pages)


def test_layer_wise_load_releases_each_layer_group_as_it_lands():
    """With ``layer_groups`` 3 each page is three keys; the forward's wait on layer 0 returns
    while the store still holds back the later groups, and the load completes byte-exact."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvconnect.connectors.testing.sglang import storage_page_keys

    extra = {"store": GATED, "space": "layers", "layer_groups": 3}
    writer = LinkedServer(extra)
    reader = LinkedServer(extra)
    GatedStore.gate.clear()
    GatedStore.reads = 0
    try:
        assert writer.linker.linked["kv"].store.keyspace.geometry.endswith(":LG3")
        tokens = prompt(16, 7)
        writer.prefill(tokens)
        req = Req("layer-wise", "", tokens, SamplingParams())
        res = reader.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
        assert res.host_hit_length == 16
        req.last_node = res.last_device_node
        reader.cache.init_load_back(InitLoadBackParams(best_match_node=res.last_host_node, host_hit_length=16,
                                                       req=req))
        slots = reader.cache.linker.private_load_indices[req.rid]
        counter = reader.linker.layer_done_counter
        index = reader.cache.ready_to_load_host_cache()
        counter.set_consumer(index)
        counter.wait_until(0)
        futures = counter.futures[index]
        time.sleep(0.1)
        assert futures[0].done() and not futures[2].done()
        GatedStore.gate.set()
        assert reader.cache.finish_external_linker_loads([req]) == []
        nbytes = reader.page_nbytes()
        hashes = storage_page_keys(tokens, 4)
        for page, h in enumerate(hashes):
            assert reader.page_bytes(slots, page) == page_content(h, nbytes)
    finally:
        GatedStore.gate.set()
        writer.close()
        reader.close()


# ---------------------------------------------------------------------------------
# A dead or hanging store
# ---------------------------------------------------------------------------------


def test_a_raising_store_is_a_miss_and_nothing_raises_into_sglang():
    server = LinkedServer({"store": RAISING})
    try:
        result = server.prefill(prompt(16, 8))
        assert (result.loaded_tokens, result.computed_pages) == (0, 4)
        assert server.linker.counts["failed_offloads"] == 1
        assert server.linker._errors.as_dict()["lookup"] >= 1
    finally:
        server.close()


def test_a_hanging_lookup_is_a_miss_within_its_timeout():
    """A store whose ``exists`` blocks 3 s: the lookup (on SGLang's scheduler thread) misses
    after ``lookup_timeout_s``, and the next one misses at once while the first is stuck."""
    server = LinkedServer({"store": FAULTY, "hang_on": ["exists"], "hang_s": 3.0, "lookup_timeout_s": 0.2})
    try:
        t0 = time.monotonic()
        first = server.prefill(prompt(16, 9), offload=False)
        t1 = time.monotonic()
        second = server.prefill(prompt(16, 10), offload=False)
        t2 = time.monotonic()
        assert first.loaded_tokens == second.loaded_tokens == 0
        assert t1 - t0 < 1.5 and t2 - t1 < 0.5
        assert server.linker.counts["lookup_timeouts"] == 2
    finally:
        server.linker.store.release()
        server.close()


def test_a_store_that_dies_between_lookup_and_load_fails_the_batch_not_the_engine(tmp_path):
    """Reads start failing after the lookup found the pages: the load batch fails, SGLang's
    ``finish_external_linker_loads`` marks the request aborted, and no exception escapes."""
    flag = tmp_path / "dead"
    extra = {"store": FAULTY, "inner": SHARED, "inner_options": {"space": "dies"}, "raise_on": ["get_into"],
             "fault_flag": str(flag)}
    a, b = LinkedServer(extra), LinkedServer(extra)
    try:
        tokens = prompt(16, 11)
        a.prefill(tokens)
        flag.write_text("")
        result = b.prefill(tokens, offload=False)
        assert result.loaded_tokens == 16 and result.load_failed
        assert b.linker.counts["failed_loads"] == 1
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, key", [
    ({"store": SHARED, "layer_groups": 0}, "layer_groups"),
    ({"store": SHARED, "lookup_timeout_s": "fast"}, "lookup_timeout_s"),
    ({"store": SHARED, "staging": "gpu"}, "staging"),
    ({"store": SHARED, "load_timeout_s": 0}, "load_timeout_s"),
    ({"store": SHARED, "no_such_option": 1}, "no_such_option"),
])
def test_a_bad_linker_config_names_the_key(extra, key):
    with pytest.raises((ConfigError, UnknownConfigKey)) as err:
        LinkedServer(extra)
    assert key in str(err.value)


# ---------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------


def test_bench_linker_quick_writes_its_ratios(tmp_path):
    """``kvconnect bench linker --quick``: both readers load the same pages of one key space
    (the benchmark asserts it) and the JSON holds a linker / HiCache ratio per variant."""
    import json

    from kvconnect.connectors.cli import main

    out = tmp_path / "linker.json"
    assert main(["bench", "linker", "--quick", "--reps", "2", "--batch", "16", "--out", str(out)]) == 0
    ratios = {r["metric"]: r for r in json.loads(out.read_text())["ratios"]}
    assert set(ratios) == {"load/memory", "load/memory/median", "load/memory/linker_lg4",
                           "load/memory/linker_lg4/median", "load/memory/linker_staged",
                           "load/memory/linker_staged/median"}
    assert all(r["ours"] > 0 and r["reference"] > 0 for r in ratios.values())


# ---------------------------------------------------------------------------------
# Rank-replicated MLA over two TP rank processes
# ---------------------------------------------------------------------------------


def test_mla_tp2_ranks_share_one_copy_rank0_writes_both_load(tmp_path):
    """Two TP rank processes of one MLA server (gloo; SGLang's tree reduces lookups and
    offload commits across them) over the HF3FS store with its metadata service: the rank is
    left out of the key, only rank 0 writes, and after the device tree is emptied both ranks
    load every page of the prompt, byte for byte, rank 1 reading what rank 0 wrote."""
    import json
    import subprocess
    import sys

    pytest.importorskip("grpc", reason="the HF3FS metadata service needs grpcio")
    from kvconnect.connectors.testing.hf3fs import MetaProcess
    from kvconnect.connectors.testing.processes import child_env, free_port

    meta = MetaProcess(tmp_path / "meta").start()
    try:
        extra = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "files" / "kv"), "file_size": "16mb",
                 "numjobs": 2, "entries": 8, "client": "posix", "metadata_server_url": meta.url}
        port = free_port()
        cmd = [sys.executable, "-m", "kvconnect.connectors.testing.linker", "--world", "2", "--init-port", str(port),
               "--extra", json.dumps(extra), "--tokens", json.dumps(prompt(4 * 5, 13))]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=child_env(HF_HUB_OFFLINE="1"), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        meta.stop()
    r0, r1 = outs
    assert (r0["is_writer"], r1["is_writer"]) == (True, False)
    assert r0["rank_in_key"] is None and r1["rank_in_key"] is None
    assert r0["first"] == r1["first"] == [0, 5]
    assert (r0["put_pages"], r1["put_pages"]) == (5, 0)
    for r in (r0, r1):
        assert r["second"] == [20, 0] and not r["failed"] and all(r["bytes_same"]) and len(r["bytes_same"]) == 5
