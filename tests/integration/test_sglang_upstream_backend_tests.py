"""SGLang 0.5.23's own HiCache storage-backend tests, pointed at kvconnect.

Upstream files (the ``sglang==0.5.23`` wheel, ``sglang/srt/mem_cache/storage/``), adapted here:

* ``mooncake_store/test_mooncake_store.py``: ``test_single_operation`` and
  ``test_batch_operation`` with the four configs of its ``__main__`` (MHA TP 1, MLA TP 1,
  MHA rank 1 of TP 4, MLA rank 3 of TP 8). Its host pool offers only
  ``get_page_buffer_meta`` and ``get_ksize_per_token``; its single test moves bytes given as
  addresses and sizes (``set`` / ``get`` with ``target_location`` / ``target_sizes``).
* ``aibrix_kvcache/unit_test.py``: ``AIBrixKVCacheStorageTest.test_with_page_size`` (page
  sizes 1 and 2): the legacy tensor ``batch_set`` / ``batch_get`` / ``batch_exists`` over a
  real ``layer_first`` MHA host pool, including the prefix count of a partial key list.
* ``tensorcast_store/test_tensorcast_store.py``: its three tests of what any backend owes
  SGLang's controller, not of Tensorcast's own planner: ``test_exists_single_item_and_empty_call_behavior``,
  ``test_batch_get_v1_and_batch_set_v1_empty_calls_skip_session_rpc`` and
  ``test_worker_callbacks_survive_get_and_backup_failures`` (the controller's
  ``_page_get_zero_copy`` / ``_page_set_zero_copy`` over a backend whose store fails).

Each runs against every registered kvconnect store and variant, as its harness
(``kvconnect.connectors.testing.harness``) runs it: ``memory``; ``hf3fs`` on POSIX files with
its in-process index and with a real metadata service process (``kvconnect hf3fs-meta
serve``, variant ``service``); ``mooncake`` against a real ``mooncake_master`` and segment
holder; ``peer_rdma`` joining a real seed node over TCP. The module re-runs itself inside a
loopback-only network namespace (``in_harness_namespace``), where the ``store_harness``
fixture starts each store's services and every case runs (10 cases x 5 stores).

What was changed, and why:

* The backend is kvconnect, built the way SGLang builds ``--hicache-storage-backend dynamic``
  (``StorageBackendFactory.create_backend("dynamic", config, pool)``), instead of
  ``MooncakeStore(config)`` / ``AibrixKVCacheStorage(config, pool)``; the storage config's
  ``extra_config`` names kvconnect and the store (upstream passes none).
* Upstream runs its cases from ``__main__`` (``test_batch_operation(config)`` takes its
  config as an argument pytest cannot supply); here they are parametrized pytest cases.
* ``torch.allclose(..., atol=1e-6)`` / ``torch.equal`` become byte comparisons (stricter).
* Upstream never closes its backends; here each is closed after its case (several Mooncake
  clients share this process).
* MLA on TP rank 3 of 8: SGLang's cache controller never writes from that rank
  (``backup_skip``: for MLA, ``HiCacheStorageConfig.is_storage_writer`` is TP rank 0 only);
  kvconnect's non-writer answers ``batch_set_v1`` with success and writes nothing (asserted).
  The case sends the same ``batch_set_v1`` through a rank-0 backend over the same store too,
  as SGLang's writer rank does, then runs upstream's exists / get checks on rank 3. With the
  ``memory`` store (one process's memory) that config is refused at construction
  (``MissingCapability`` 'shared': rank 3, its own process in SGLang, could never read what rank
  0 wrote), and the memory case of that config asserts that refusal instead; so does
  ``hf3fs``'s with its in-process index (each process indexes its own files), whose refusal
  names the metadata service to configure.
* The AIBrix test's ``HiCacheStorageConfig(...)`` lacks fields 0.5.23 requires (``pp_rank``,
  ``pp_size``, ``attn_cp_*``, ``enable_storage_metrics``): given their single-rank values. Its
  positional ``MHATokenToKVPool(...)`` / ``MHATokenToKVPoolHost(...)`` calls no longer match
  0.5.23 (``ValueError: Invalid MHA geometry: ... head_num=64``): the same pool
  (``layer_first``, float16, 1 head of 128, 64 layers) comes from ``make_cpu_host_pool``. Its
  ``torch.distributed`` environment and AIBrix metrics summary are AIBrix's own: dropped.
* The Tensorcast tests run over a fake Tensorcast session (calls recorded, results and
  failures scripted): here the real store is asked, its own call counters (``stats()``) stand
  for the session's recorded calls, a page missing from the store for the session's
  ``existence_mask`` with a missing fragment, and ``FaultyStore`` (kvconnect's fault-injecting
  wrapper around the real store, raising ``BackendUnavailable`` from ``get_into`` /
  ``put_from``) for the session's ``get_error`` / ``put_error`` (one backend for both
  callbacks, where upstream builds one per failure). Their host pool, a
  Tensorcast-registered pool of two-token pages, is a real ``page_first`` MHA pool of
  two-token pages.
* Upstream's mock pool is ``MinimalHostPool`` (``kvconnect.connectors.testing.sglang``), the
  same class, kept once for these tests and the adapter's own.

Not adapted, and why: ``simm/test_simm.py`` (its single test is the Mooncake one; its batch
test passes pool *data* as host indices and its mock pool hands out offsets, not addresses:
it cannot run against any backend); ``eic/test_unit.py`` (the EIC client alone, no
``HiCacheStorage``); the other tests of ``tensorcast_store/test_tensorcast_store.py`` and
``test_tensorcast_host_allocator.py`` (Tensorcast's fragment registration, identities, scratch
and allocator, checked against the RPCs its session records); ``hf3fs/test_hf3fs_utils.py``
(HF3FS's C++ copy helpers).

Mocked: only upstream's own mock host pool (the Mooncake test's; a real pool needs model
geometry upstream did not give), and the failures of the Tensorcast callback test
(``FaultyStore`` raising around the real store). Everything else is real: SGLang's storage factory and config,
SGLang's MHA host pool, kvconnect's stores, the HF3FS metadata service, Mooncake's master and
client, the peer pool's seed node.
"""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch", reason="needs torch (installed by scripts/install.sh)")
pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvconnect.connectors.base import Capability  # noqa: E402
from kvconnect.connectors.errors import MissingCapability  # noqa: E402
from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace  # noqa: E402
from kvconnect.connectors.testing.sglang import HICACHE_EXTRA_CONFIG, MinimalHostPool, make_cpu_host_pool  # noqa: E402

# Every registered store and variant, as its harness runs it, all inside the module's own
# loopback-only namespace (the run of ``test_in_loopback_namespace`` below).
store_harness = harness_fixture(namespace_run=True)


@pytest.fixture
def store_extra(store_harness) -> dict:
    """kvconnect's keys of the extra config for this run's store."""
    return {**HICACHE_EXTRA_CONFIG, **store_harness.options(0)}


@pytest.fixture
def make_backend(store_extra):
    """SGLang's factory for ``dynamic``; every backend made is closed after the test."""
    made = []

    def make(config: HiCacheStorageConfig, host, extra: dict | None = None):
        config.extra_config = dict(extra or store_extra)
        b = StorageBackendFactory.create_backend("dynamic", config, host)
        made.append(b)
        b.register_mem_pool_host(host)
        return b

    yield make
    for b in made:
        b.close()


def _bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------
# mooncake_store/test_mooncake_store.py
# ---------------------------------------------------------------------------------


def make_hicache_storage_config(*, is_mla_model: bool, tp_rank: int, tp_size: int) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla_model, enable_storage_metrics=False, is_page_first_layout=True, model_name=None)


def generate_batch_query_keys(kv_num: int):
    return ["test_" + str(uuid.uuid4()) for _ in range(kv_num)]


def create_mock_host_kv_cache(buffer_size, entries_per_page=2, page_elements=1, dtype=torch.float32):
    buffer = torch.randn(buffer_size, dtype=dtype)
    return MinimalHostPool(buffer, entries_per_page, page_elements), buffer


def test_single_operation(make_backend):
    """Upstream: set / exists / get of one key given as an address and a size in the mock
    pool's buffer. Mocked: the host pool (upstream's own mock)."""
    buffer_size = 1024 * 1024 * 16
    value_elements = 1024
    mock_host_kv_cache, buffer = create_mock_host_kv_cache(buffer_size, entries_per_page=2,
                                                           page_elements=value_elements)
    store = make_backend(make_hicache_storage_config(is_mla_model=False, tp_rank=0, tp_size=1), mock_host_kv_cache)

    value_size = value_elements * buffer.element_size()
    key = str(uuid.uuid4())
    set_slice = buffer[:value_elements]
    get_slice = buffer[value_elements: 2 * value_elements]
    assert _bytes(set_slice) != _bytes(get_slice)

    assert store.set(key, target_location=set_slice.data_ptr(), target_sizes=value_size) is True
    assert store.exists(key)
    assert store.get(key, target_location=get_slice.data_ptr(), target_sizes=value_size) is True
    assert _bytes(get_slice) == _bytes(set_slice)


BATCH_CONFIGS = [(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)]


@pytest.mark.parametrize("mla,tp_rank,tp_size", BATCH_CONFIGS,
                         ids=[f"{'mla' if m else 'mha'}-rank{r}of{s}" for m, r, s in BATCH_CONFIGS])
def test_batch_operation(make_backend, store_harness, mla, tp_rank, tp_size):
    """Upstream: batch_set_v1 of 13 pages, batch_exists, batch_get_v1 into 13 other pages,
    byte-exact. MLA on a rank that is not SGLang's storage writer: the writer rank's backend
    (same store) writes too, as in SGLang; on the process-local ``memory`` store that config is
    refused (see the module docstring). Mocked: the host pool (upstream's own mock)."""
    config = make_hicache_storage_config(is_mla_model=mla, tp_rank=tp_rank, tp_size=tp_size)
    buffer_size = 1024 * 1024 * 16
    value_elements = 256
    kv_num = 13
    entries_per_page = 1 if mla else 2
    mock_host_kv_cache, buffer = create_mock_host_kv_cache(buffer_size, entries_per_page=entries_per_page,
                                                           page_elements=value_elements)
    if Capability.SHARED not in store_harness.claims and mla and tp_size > 1:
        with pytest.raises(MissingCapability) as e:
            make_backend(config, mock_host_kv_cache)
        assert e.value.store == store_harness.store and e.value.capability == "shared"
        assert f"all {tp_size} TP ranks, each its own process, read it" in str(e.value)
        return
    store = make_backend(config, mock_host_kv_cache)

    keys = generate_batch_query_keys(kv_num)
    set_slices = [buffer[i * value_elements: (i + 1) * value_elements] for i in range(kv_num * entries_per_page)]
    set_indices = torch.arange(kv_num)

    assert all(store.batch_set_v1(keys, set_indices))
    if not config.is_storage_writer:
        assert store.batch_exists(keys) == 0  # a non-writer rank wrote nothing
        writer = make_backend(make_hicache_storage_config(is_mla_model=mla, tp_rank=0, tp_size=tp_size),
                              mock_host_kv_cache)
        assert all(writer.batch_set_v1(keys, set_indices))

    assert store.batch_exists(keys) == kv_num

    n = kv_num * entries_per_page
    get_slices = [buffer[(n + i) * value_elements: (n + i + 1) * value_elements] for i in range(n)]
    assert all(_bytes(a) != _bytes(b) for a, b in zip(set_slices, get_slices))
    get_indices = torch.arange(kv_num, 2 * kv_num)
    assert all(store.batch_get_v1(keys, get_indices))
    for i in range(n):
        assert _bytes(get_slices[i]) == _bytes(set_slices[i]), f"page {i // entries_per_page}, segment {i}"


# ---------------------------------------------------------------------------------
# aibrix_kvcache/unit_test.py
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2])
def test_with_page_size(make_backend, page_size):
    """Upstream: legacy tensor batch_set / batch_get of 4 pages of a real layer_first MHA host
    pool's flat page shape, batch_exists of all keys and of the last two, byte-exact. Nothing
    mocked (upstream's own pool construction no longer runs on 0.5.23: see the docstring)."""
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="test")
    batch_size = 2
    head_num = 1
    layer_num = 64
    head_dim = 128
    mem_pool = make_cpu_host_pool("layer_first", page_size=page_size, layer_num=layer_num, head_num=head_num,
                                  head_dim=head_dim, dtype="float16")
    query_length = batch_size * 2
    partial = batch_size
    kv = make_backend(config, mem_pool)
    target_shape = (2, layer_num, page_size, head_num, head_dim)
    assert mem_pool.get_dummy_flat_data_page().numel() == torch.Size(target_shape).numel()  # the flat page
    rand_tensor = [torch.rand(target_shape, dtype=torch.float16) for _ in range(query_length)]
    keys = ["hash" + str(i) for i in range(query_length)]
    partial_keys = keys[batch_size:query_length]
    assert kv.batch_exists(keys) == 0
    assert kv.batch_set(keys, rand_tensor)
    get_tensor = [torch.rand(target_shape, dtype=torch.float16).flatten() for _ in range(query_length)]
    kv.batch_get(keys, get_tensor)
    for i in range(query_length):
        assert _bytes(get_tensor[i]) == _bytes(rand_tensor[i])
    assert kv.batch_exists(keys) == query_length
    assert kv.batch_exists(partial_keys) == partial
    partial_get_tensor = [torch.rand(target_shape, dtype=torch.float16).flatten() for _ in range(partial)]
    kv.batch_get(partial_keys, partial_get_tensor)
    for i in range(partial):
        assert _bytes(partial_get_tensor[i]) == _bytes(rand_tensor[i + partial])


# ---------------------------------------------------------------------------------
# tensorcast_store/test_tensorcast_store.py
# ---------------------------------------------------------------------------------

FAULTY = "kvconnect.connectors.testing.stores:FaultyStore"


def _registered_store(make_backend, extra: dict | None = None):
    """Upstream's ``_registered_store``: a backend over a pool of two-token pages, registered."""
    host = make_cpu_host_pool("page_first", page_size=2, host_tokens=16)
    return make_backend(make_hicache_storage_config(is_mla_model=False, tp_rank=0, tp_size=1), host, extra), host


def _calls(backend) -> tuple[int, int, int]:
    s = backend.store.stats()
    return s.exists_calls, s.get_calls, s.put_calls


def test_exists_single_item_and_empty_call_behavior(make_backend):
    """Upstream: ``exists`` of one key asks the store once a call; a key the store does not
    hold in full is False; ``batch_exists([])`` is 0 without a call."""
    store, host = _registered_store(make_backend)
    idx = host.alloc(2)
    assert store.batch_set_v1(["one"], idx) == [True]
    before = _calls(store)[0]
    assert store.exists("one") is True
    assert _calls(store)[0] == before + 1
    assert store.exists("two") is False  # upstream: the session's mask loses a fragment
    assert _calls(store)[0] == before + 2
    assert store.batch_exists([]) == 0
    assert _calls(store)[0] == before + 2


def test_batch_get_v1_and_batch_set_v1_empty_calls_skip_session_rpc(make_backend):
    """Upstream: empty ``batch_get_v1`` / ``batch_set_v1`` answer ``[]`` and never reach the store."""
    store, _ = _registered_store(make_backend)
    empty_indices = torch.empty(0, dtype=torch.int64)
    before = _calls(store)
    assert store.batch_get_v1([], empty_indices) == []
    assert store.batch_set_v1([], empty_indices) == []
    assert _calls(store) == before


def test_worker_callbacks_survive_get_and_backup_failures(make_backend, store_extra):
    """Upstream: SGLang's controller's prefetch (``_page_get_zero_copy``) and backup
    (``_page_set_zero_copy``) callbacks over a backend whose store fails answer 0 pages / False,
    nothing raised. Real: the controller's own methods; the store fails through ``FaultyStore``."""
    from types import SimpleNamespace

    from sglang.srt.managers.cache_controller import HiCacheController

    inner = {k: v for k, v in store_extra.items() if k not in HICACHE_EXTRA_CONFIG}
    faulty = {**HICACHE_EXTRA_CONFIG, "store": FAULTY, "inner": inner.pop("store"), "inner_options": inner,
              "raise_on": ["get_into", "put_from"]}
    indices = torch.tensor([0, 1], dtype=torch.int64)
    operation = SimpleNamespace(request_id="worker-operation")

    store, _ = _registered_store(make_backend, faulty)  # upstream: two stores, one failing each way
    get_controller = object.__new__(HiCacheController)
    get_controller.storage_backend = store
    assert get_controller._page_get_zero_copy(operation, ["page"], indices) == 0

    put_controller = object.__new__(HiCacheController)
    put_controller.storage_backend = store
    assert put_controller._page_set_zero_copy(["page"], indices) is False
    assert store.store.calls["get_into"] == 1 and store.store.calls["put_from"] == 1


# This module again, inside a loopback-only namespace where each harness starts its store's
# services (None in that run).
test_in_loopback_namespace = in_harness_namespace(__file__)
