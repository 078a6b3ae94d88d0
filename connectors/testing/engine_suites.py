"""One suite per engine integration, each run over every registered store harness.

Each suite is a class of tests over a ``store_harness`` fixture (``harness_fixture()``, see
``kvconnect.connectors.testing.harness``); a test module subclasses the suites it runs::

    from kvconnect.connectors.testing.engine_suites import HiCacheSuite
    from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

    store_harness = harness_fixture(namespace_run=True)
    test_in_loopback_namespace = in_harness_namespace(__file__)

    class TestHiCache(HiCacheSuite):
        pass

Every suite moves real bytes through the engine's real classes and the store as its harness
runs it: the writer is engine instance 0, the reader instance 1 where the store claims
``shared`` (another store client, so the bytes crossed the store), else the writer itself.

NEW_READER: the reader starts after the write and asks again for up to ``SEEN_WITHIN_S``
until it sees the pages. A store without ``any_page_size`` (HF3FS keeps a file per page size)
learns of page sizes that other clients opened only every few seconds once it knows one: the
store's documented behaviour, bounded, not what these suites test.

* ``HiCacheSuite``: SGLang 0.5.23's ``StorageBackendFactory`` builds kvconnect's backend
  (``--hicache-storage-backend dynamic``) over a real CPU host KV pool; pages go through
  ``batch_set_v1`` / ``batch_exists`` / ``batch_get_v1`` as SGLang's cache controller calls them;
  ``clear()`` empties the engine's key space and nothing else; on a ``durable`` store, SGLang's
  real ``HiCacheController`` (on CPU) detaches and re-attaches the backend and finds every page
  written before the detach.
* ``LMCacheL2Suite``: LMCache 0.5.6's plugin factory builds the L2 adapter from the
  ``--l2-adapter`` JSON; LMCache ``TensorMemoryObj`` buffers are stored, looked up (and
  locked) and loaded through the adapter's task interface.
* ``PDRelaySuite``: the PD backend's relay data plane (``StoreRelay``), prefill's instance
  writing a room (KV blocks, aux row, marker) from one KV buffer set, decode's reading it
  into other slots of another; a store without ``shared`` is refused naming the capability.

* ``VLLMSuite``: vLLM 0.32 (CPU, its own environment) with kvconnect's connector, in a child
  process under the harness's namespace (so its module needs no namespace run:
  ``harness_fixture(child_clients=True)``); tokens of store hits equal a cold run's. About 20 s
  a store: the built-in stores run their own deeper vLLM tests (tests/integration/test_vllm.py),
  a new store runs this.
"""

from __future__ import annotations

import hashlib

import pytest

from kvconnect.connectors.base import Capability

PAGE_GEOMETRY = {"page_size": 4, "layers": 2, "host_pages": 16, "mamba": False}


SEEN_WITHIN_S = 10.0


def seen(ask, want, within: float = SEEN_WITHIN_S):
    """``ask()`` until it returns ``want`` or ``within`` seconds pass; its last answer (NEW_READER)."""
    import time

    deadline = time.monotonic() + within
    while True:
        got = ask()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def _keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def reader_instance(harness) -> int:
    """The engine instance that reads back: another one where the store is shared."""
    return 1 if Capability.SHARED in harness.claims else 0


def in_process(harness) -> None:
    if not harness.in_process:
        pytest.skip(f"{harness.label}'s clients run only inside its namespace (in_harness_namespace)")


class HiCacheSuite:
    """SGLang HiCache L3 backend (``connectors/engines/sglang_hicache.py``) over the harness's store."""

    def test_hicache_pages_round_trip_through_sglang(self, store_harness):
        pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
        from kvconnect.connectors.testing.ranks import RankEngine

        in_process(store_harness)
        spec = {"name": "suite", "model": f"suite/{store_harness.label}", "mla": False, "tp_rank": 0, "tp_size": 1,
                **PAGE_GEOMETRY}
        writer = RankEngine(store_harness.store, store_harness.options(0), spec)
        reader = writer
        try:
            keys = _keys(f"hicache-{store_harness.label}", 6)
            w = writer.write("kv", keys, seed=5)
            assert w["ok"] == [True] * 6
            if reader_instance(store_harness):
                reader = RankEngine(store_harness.store, store_harness.options(1), spec)  # started later: NEW_READER
            assert seen(lambda: reader.backend.batch_exists(keys + _keys("absent", 2)), 6) == 6
            r = reader.read("kv", keys)
            assert r["ok"] == [True] * 6 and r["digests"] == w["digests"]
            assert reader.read("kv", _keys("absent", 2))["ok"] == [False, False]
            assert writer.stats()["adapter_errors"] == {} and reader.stats()["adapter_errors"] == {}
        finally:
            writer.backend.close()
            if reader is not writer:
                reader.backend.close()


    def test_hicache_reattach_finds_every_page_written_before_the_detach(self, store_harness):
        """Durable stores: pages SGLang's real ``HiCacheController`` backed up before
        ``detach_storage_backend`` are all found, byte-exact, after ``attach_storage_backend``
        and by a second engine's controller (``check_reattach_finds_every_page``)."""
        pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
        if Capability.DURABLE not in store_harness.claims:
            pytest.skip(f"{store_harness.label} is not durable: its pages live with the instance that wrote them")
        from kvconnect.connectors.testing.hicache_controller import check_reattach_finds_every_page

        in_process(store_harness)
        assert check_reattach_finds_every_page(lambda: dict(store_harness.options(0))) == 2 * (6 + 7 + 8)


    def test_hicache_clear_empties_the_engines_key_space_and_nothing_else(self, store_harness):
        """``clear()`` of one engine rank's backend removes its key space only: another
        tenant's, TP rank 1's and another model's pages on the same store survive, byte-exact
        (``check_clear_empties_only_its_key_space``)."""
        pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
        from kvconnect.connectors.base import PageStore
        from kvconnect.connectors.registry import store_class
        from kvconnect.connectors.testing.hicache_controller import check_clear_empties_only_its_key_space

        if store_class(store_harness.store)._clear_prefix is PageStore._clear_prefix:
            pytest.skip(f"{store_harness.store} cannot remove a key space (no _clear_prefix): the adapter's "
                        f"clear() answers False")
        in_process(store_harness)
        check_clear_empties_only_its_key_space(lambda **more: {**store_harness.options(0), **more})


class LMCacheL2Suite:
    """LMCache L2 plugin (``connectors/engines/lmcache_l2.py``) over the harness's store."""

    def test_lmcache_chunks_round_trip_through_the_l2_adapter(self, store_harness):
        pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="needs lmcache")
        from kvconnect.connectors.testing.lmcache_adapter import L1, load, lookup, make_adapter, okeys, store

        in_process(store_harness)
        src, dst = L1(4), L1(4)
        src.fill_random(7)
        writer = make_adapter(store_harness.options(0), src)
        reader = writer
        try:
            keys = okeys(4, model=f"suite/{store_harness.label}")
            result = store(writer, keys, src.objs)
            assert result.is_successful(), result
            if reader_instance(store_harness):
                reader = make_adapter(store_harness.options(1), dst)  # started later: NEW_READER
            # a lookup names its object group's layout, as LMCache's prefetch does: a reader that
            # never stored learns the chunks' dtype from it
            import torch
            from lmcache.v1.distributed.api import MemoryLayoutDesc

            layout = {0: MemoryLayoutDesc(shapes=[torch.Size([src.size])], dtypes=[torch.uint8])}
            found = seen(lambda: lookup(reader, keys + okeys(1, model="suite/absent"), layout), [0, 1, 2, 3])
            assert found == [0, 1, 2, 3]
            assert load(reader, keys, dst.objs) == [0, 1, 2, 3]
            assert [dst.data(i) for i in range(4)] == [src.data(i) for i in range(4)]
            reader.submit_unlock(keys)
        finally:
            writer.close()
            if reader is not writer:
                reader.close()


class PDRelaySuite:
    """The PD transfer backend's relay (``connectors/engines/pd_transport.py``) over the harness's store."""

    LAYERS, PAGES, ITEM, AUX = 2, 16, 256, 96

    def _buffers(self, np):
        kv = [np.zeros(self.PAGES * self.ITEM, dtype=np.uint8) for _ in range(2 * self.LAYERS)]
        aux = np.zeros(8 * self.AUX, dtype=np.uint8)
        return kv, aux

    def _layout(self, kv, aux):
        from kvconnect.connectors.engines.pd_transport import BufferLayout

        return BufferLayout(tuple(b.ctypes.data for b in kv), tuple(b.nbytes for b in kv), (self.ITEM,) * len(kv),
                            (aux.ctypes.data,), (aux.nbytes,), (self.AUX,))

    def test_pd_relay_moves_a_room_or_refuses_an_unshared_store(self, store_harness):
        np = pytest.importorskip("numpy")
        from kvconnect.connectors.engines.pd_transport import PDConfig, StoreRelay
        from kvconnect.connectors.errors import MissingCapability

        in_process(store_harness)
        kv_p, aux_p = self._buffers(np)
        kv_d, aux_d = self._buffers(np)
        rng = np.random.default_rng(3)
        for b in kv_p + [aux_p]:
            b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)

        def relay(instance: int, kv, aux) -> StoreRelay:
            return StoreRelay(PDConfig(transport="relay", store=store_harness.options(instance), timeout_s=20),
                              self._layout(kv, aux))

        if Capability.SHARED not in store_harness.claims:
            with pytest.raises(MissingCapability) as e:
                relay(0, kv_p, aux_p)
            assert e.value.capability == "shared" and e.value.store == store_harness.store
            return
        prefill = relay(0, kv_p, aux_p)
        try:
            decode = relay(1, kv_d, aux_d)
            try:
                room, npages = 4242, 5
                src, dst = np.array([1, 3, 4, 9, 12]), np.array([0, 2, 7, 8, 15])
                keys = prefill.keys(f"kvcpd.suite.{store_harness.label}.{room}", npages)
                prefill.put_blocks(keys, src, list(range(keys.nblocks)))
                prefill.put_tail(keys, aux_row=2, state_indices=None, room=room)
                dkeys = decode.keys(keys.namespace, npages)
                assert decode.markers_present([dkeys]) == [True]
                decode.read(dkeys, room, dst, aux_row=5, state_indices=None)
                for p_buf, d_buf in zip(kv_p, kv_d):
                    pages_p, pages_d = p_buf.reshape(self.PAGES, self.ITEM), d_buf.reshape(self.PAGES, self.ITEM)
                    assert (pages_d[dst] == pages_p[src]).all()
                    untouched = np.setdiff1d(np.arange(self.PAGES), dst)
                    assert not pages_d[untouched].any(), "a slot decode did not ask for was written"
                assert bytes(aux_d[5 * self.AUX:6 * self.AUX]) == bytes(aux_p[2 * self.AUX:3 * self.AUX])
                assert not decode.markers_present([decode.keys(keys.namespace + "x", npages)])[0]
            finally:
                decode.close()
        finally:
            prefill.close()


class VLLMSuite:
    """vLLM's native connector (``connectors/engines/vllm_native.py``) over a ``store_harness``
    (``harness_fixture(child_clients=True)``: vLLM runs in a child process): one real vLLM process (vLLM's own environment,
    ``VLLM_PY``) under the harness's namespace generates cold, empties its own prefix cache,
    and generates again: every full block but the last token's comes from the store, and the
    greedy tokens are the cold run's."""

    BLOCK = 32

    @pytest.fixture(scope="class")
    def vllm_model(self, tmp_path_factory):
        from kvconnect.connectors.testing.vllm import make_tiny_model

        return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")

    def test_vllm_generates_the_same_tokens_from_store_hits(self, store_harness, vllm_model):
        from kvconnect.connectors.testing.processes import MOONCAKE_QUIET_ENV
        from kvconnect.connectors.testing.vllm import VLLMProcess, connector_config, prompts, vllm_skip_reason

        why = vllm_skip_reason()
        if why:
            pytest.skip(why)

        ps = prompts(9, n=1)
        ktc = connector_config(dict(store_harness.options(0)))
        with VLLMProcess(vllm_model, store_harness.workdir / "vllm.log", ktc, ns=store_harness.netns,
                         env=MOONCAKE_QUIET_ENV) as v:
            cold = v.generate(ps)
            assert v.call("reset")["reset"]
            hit = v.generate(ps)
            rep = v.worker_report()
        usable = sum((n - 1) // self.BLOCK * self.BLOCK for n in hit["prompt_tokens"])
        assert cold["external_hits"] == 0 and hit["local_hits"] == 0
        assert hit["external_hits"] == usable > 0, hit
        assert hit["tokens"] == cold["tokens"]
        assert rep["loaded_pages"] == usable // self.BLOCK and rep["errors"] == {}, rep
