"""KVConnectStorage through SGLang 0.5.23's attach / detach / re-attach cycle, and
``batch_exists`` that never claims a page the following load cannot bring in.

Real: SGLang's ``HiCacheController`` (built on CPU: its constructor, ``attach_storage_backend``,
``detach_storage_backend``, and its prefetch, prefetch-I/O and backup threads, which call
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` as a GPU server's do), SGLang's
``StorageBackendFactory`` (``dynamic``), ``HiCacheStorageConfig``, SGLang's MHA host pool over a
real CPU device pool (``make_cpu_host_pool``), and kvconnect's stores: ``hf3fs`` (POSIX files)
with its metadata service as a real process (``kvconnect hf3fs-meta serve``, durable across
backend instances), and ``memory`` through the shared test store (``SharedMemoryStore``: a
real ``MemoryStore`` that a second backend instance in this process reaches by name).

Not real, and why: the scheduler. The controller's GPU<->host copies and the radix tree need
a model on CUDA; the few scheduler lines that move a prefetch from the hit queue to the I/O
thread (``UnifiedRadixCache``: allocate host slots, ``prefetch_buffer.put``) are copied into
``prefetch()`` (``kvconnect.connectors.testing.hicache_controller``), and the controller is
handed a stand-in token allocator whose only use is ``get_kvcache()`` (the real CPU device pool). ``FaultyStore`` (kvconnect's fault-injecting
wrapper around the real store) stands in for a store whose service fails mid-run.

Left out here: Mooncake and the peer pool (their services run only inside a loopback network
namespace that a test module re-enters as a whole); the re-attach check runs over every
durable store's harness, ``mooncake`` included, in ``test_sglang_reattach_stores.py``.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch (installed by scripts/install.sh)")
pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")

from kvconnect.connectors.testing.hicache_controller import (  # noqa: E402
    attach,
    check_clear_empties_only_its_key_space,
    check_reattach_finds_every_page,
    controller,
    direct_backend,
    pages_at,
)
from kvconnect.connectors.testing.sglang import (  # noqa: E402
    fill_pages,
    make_cpu_host_pool,
    page_bytes,
    zero_pages,
)
from kvconnect.connectors.testing.stores import clear_spaces  # noqa: E402

SHARED = "kvconnect.connectors.testing.stores:SharedMemoryStore"
FAULTY = "kvconnect.connectors.testing.stores:FaultyStore"
STORES = ["memory", "hf3fs"]
PS = 4  # tokens per page


@pytest.fixture(autouse=True)
def _fresh_spaces():
    clear_spaces()
    yield
    clear_spaces()


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """The HF3FS metadata service, a real process with a token (one per module)."""
    pytest.importorskip("grpc", reason="the HF3FS metadata service needs grpcio")
    from kvconnect.connectors.testing.hf3fs import MetaProcess

    d = tmp_path_factory.mktemp("hf3fs-meta")
    token = d / "token"
    token.write_text("lifecycle-" + hashlib.sha256(str(d).encode()).hexdigest()[:16])
    m = MetaProcess(d / "meta", token, fsync="never").start()
    yield m
    m.stop()


@pytest.fixture
def store_extra(request, tmp_path):
    """The extra-config keys of one store, for every backend of a test: ``store_extra(**more)``."""
    name = request.param

    def make(**more):
        if name == "memory":
            opts = {"store": SHARED, "space": "lifecycle", "capacity": "16mb"}
        else:
            m = request.getfixturevalue("meta")
            opts = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "files" / "kv"), "file_size": "16mb",
                    "numjobs": 2, "entries": 8, "client": "posix", "client_timeout": 3,
                    "metadata_server_url": m.url, "auth_token_file": str(m.token_file)}
        opts.update(more)
        return opts

    make.name = name
    return make


def hashes(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).hexdigest() for i in range(n)]


# ---------------------------------------------------------------------------------
# Attach / detach / re-attach
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("store_extra", STORES, indirect=True)
def test_reattach_finds_every_page_written_before_the_detach(store_extra):
    """Pages a real controller backed up before ``detach_storage_backend`` (which closes the
    backend) are all found, byte-exact, after ``attach_storage_backend`` builds a new backend
    over the same store, and by a second engine's controller (``check_reattach_finds_every_page``;
    every durable store's harness: ``test_sglang_reattach_stores.py``). Real: everything but
    the scheduler's two lines in ``prefetch`` (module docstring)."""
    assert check_reattach_finds_every_page(store_extra, page_size=PS) == 2 * (6 + 7 + 8)


@pytest.mark.parametrize("store_extra", STORES, indirect=True)
def test_requests_during_detach_attach_cycles_are_served_or_miss(store_extra):
    """Threads calling ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` on whatever backend
    the controller holds (an old one may be closed under them) while the main thread detaches and
    re-attaches five times: no call raises, every call answers a list (or count) of the right
    size, every page reported loaded holds exactly its bytes, and after the last attach all the
    pages are there. Real: the controller's attach / detach and its threads; the request threads
    call the backend as the controller's prefetch and backup threads do."""
    host = make_cpu_host_pool("page_first", page_size=PS, host_tokens=PS * 120)
    cc = controller(host, store_extra())
    n = 16
    keys = hashes(n, "cycle")
    src = host.alloc(n * PS)
    fill_pages(host, src, seed=42)
    want = pages_at(host, src)
    assert cc.storage_backend.batch_set_v1(keys, src) == [True] * n
    readers = [host.alloc(n * PS) for _ in range(3)]
    stop = threading.Event()
    errors: list[BaseException] = []
    seen = {"hits": 0, "misses": 0, "calls": 0, "bad_bytes": 0}
    lock = threading.Lock()

    def reader(idx, seed):
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                b = cc.storage_backend
                if b is None:
                    time.sleep(0.001)
                    continue
                lo = rng.randrange(n)
                ks = keys[lo:lo + rng.randrange(1, 6)]
                hit = b.batch_exists(ks)
                assert isinstance(hit, int) and 0 <= hit <= len(ks)
                zero_pages(host, idx[: len(ks) * PS])
                ok = b.batch_get_v1(ks, idx[: len(ks) * PS])
                assert isinstance(ok, list) and len(ok) == len(ks)
                got = pages_at(host, idx[: len(ks) * PS])
                with lock:
                    seen["calls"] += 1
                    for i, good in enumerate(ok):
                        if good:
                            seen["hits"] += 1
                            seen["bad_bytes"] += got[i] != want[lo + i]
                        else:
                            seen["misses"] += 1
            except BaseException as e:  # noqa: BLE001 - the assertion is that none happens
                errors.append(e)
                return

    def writer():
        rng = random.Random(7)
        while not stop.is_set():
            try:
                b = cc.storage_backend
                if b is None:
                    time.sleep(0.001)
                    continue
                lo = rng.randrange(n)
                ks = keys[lo:lo + 4]
                ok = b.batch_set_v1(ks, src[lo * PS:(lo + len(ks)) * PS])
                assert isinstance(ok, list) and len(ok) == len(ks)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    threads = [threading.Thread(target=reader, args=(r, i)) for i, r in enumerate(readers)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            time.sleep(0.1)
            t0 = time.monotonic()
            cc.detach_storage_backend()
            assert time.monotonic() - t0 < 15  # the controller's own threads poll at 1 s
            time.sleep(0.05)
            attach(cc, store_extra())
        time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert seen["calls"] > 0 and seen["hits"] > 0 and seen["bad_bytes"] == 0, seen
    fresh = host.alloc(n * PS)
    assert cc.storage_backend.batch_exists(keys) == n
    assert cc.storage_backend.batch_get_v1(keys, fresh) == [True] * n
    assert pages_at(host, fresh) == want
    cc.detach_storage_backend()


@pytest.mark.parametrize("case", ["hf3fs", "hanging-memory"])
def test_close_returns_quickly_with_gets_in_flight(case, tmp_path, request):
    """``close()`` (what ``detach_storage_backend`` calls) returns in under 2 s while four
    threads are inside ``batch_get_v1``; those calls then end with hits or misses, never an
    exception, and a hit holds its bytes. ``hf3fs``: the real store, reads of 32 pages each in
    a loop. ``hanging-memory``: ``FaultyStore`` over the shared memory store, whose reads block
    for 30 s (a service that stopped answering) until released after the close."""
    if case == "hf3fs":
        m = request.getfixturevalue("meta")
        extra = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "files" / "kv"), "file_size": "64mb",
                 "numjobs": 2, "entries": 8, "client": "posix", "client_timeout": 3,
                 "metadata_server_url": m.url, "auth_token_file": str(m.token_file)}
    else:
        extra = {"store": FAULTY, "inner": SHARED, "inner_options": {"space": "hang"}, "hang_on": ["get_into"],
                 "hang_s": 30}
    host = make_cpu_host_pool("page_first", page_size=PS, layer_num=4, head_num=4, head_dim=64,
                              host_tokens=PS * 200)
    n = 32
    keys = hashes(n, "close")
    src = host.alloc(n * PS)
    fill_pages(host, src, seed=5)
    want = pages_at(host, src)
    writer = direct_backend(host, extra if case == "hf3fs" else {"store": SHARED, "space": "hang"})
    assert writer.batch_set_v1(keys, src) == [True] * n
    b = direct_backend(host, extra)
    dests = [host.alloc(n * PS) for _ in range(4)]
    inside = threading.Barrier(5)
    errors: list[BaseException] = []
    results: list[tuple[list, list]] = []

    def load(idx):
        try:
            inside.wait(10)
            for _ in range(1000):
                ok = b.batch_get_v1(keys, idx)
                assert isinstance(ok, list) and len(ok) == n
                results.append((ok, pages_at(host, idx)))
                if not any(ok):
                    return  # closed: misses from now on
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load, args=(d,)) for d in dests]
    for t in threads:
        t.start()
    inside.wait(10)
    time.sleep(0.2)  # every thread is inside a read (hanging: blocked in it)
    t0 = time.monotonic()
    b.close()
    took = time.monotonic() - t0
    if case != "hf3fs":
        assert b.store.calls["get_into"] >= 4 and all(t.is_alive() for t in threads)
        b.store.release()
    for t in threads:
        t.join(30)
    assert took < 2.0, f"close() took {took:.2f} s with reads in flight"
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    assert b.store.closed  # released by close(), or by the last call out of it
    for ok, got in results:
        for i, good in enumerate(ok):
            if good:
                assert got[i] == want[i]
    assert b.batch_get_v1(keys, dests[0]) == [False] * n and b.batch_exists(keys) == 0  # closed: misses
    writer.close()


@pytest.mark.parametrize("store_extra", STORES, indirect=True)
def test_clear_empties_the_engines_key_space_and_nothing_else(store_extra):
    """``clear()`` removes every page of the engine's key space; another tenant's pages, TP
    rank 1's pages and another model's pages on the same store survive, byte-exact
    (``check_clear_empties_only_its_key_space``; every store's harness: the HiCache suite).
    Real: the factory-built backends over the real store (``memory``: one ``MemoryStore``
    reached by four backends through the shared test store)."""
    check_clear_empties_only_its_key_space(store_extra, page_size=PS)


# ---------------------------------------------------------------------------------
# batch_exists never over-reports
# ---------------------------------------------------------------------------------


def _reported_not_loaded() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvconnect_hicache_reported_not_loaded_pages_total") or 0.0


@pytest.mark.parametrize("store_extra", STORES, indirect=True)
def test_batch_exists_never_over_reports(store_extra, tmp_path):
    """Property, 2 x 1500 lookups (fixed seeds): whenever ``batch_exists`` reports N leading
    hits, the following ``batch_get_v1`` of those N pages loads all N byte-exact, or (where a
    race made that impossible) answers misses, never raises, and every reported page it did
    not load is counted: the backend's ``reported_not_loaded_pages`` and the Prometheus counter
    ``kvconnect_hicache_reported_not_loaded_pages_total`` grow by exactly that many.

    Phase 1, a quiet store: nothing deletes or evicts, so there is no race and 0 over-reports
    are allowed. Then each race once, on purpose: a reported page deleted, and the store
    failing, between the lookup and the load. Phase 2, under fire from other threads: a
    second engine (same key space, its own store client) writes random pages into a store of
    24 pages' capacity (evicting) and deletes random pages, and the reader's store fails (``FaultyStore`` around the real store:
    ``exists`` and ``get_into`` raise while a flag file exists, toggled every ~2 ms). Every
    page ever written under a key holds the same bytes, so any loaded page is checked against
    them. Real: the stores (memory: one ``MemoryStore`` of 24 pages shared by name; hf3fs: 24
    pages of file and the metadata service process), the factory-built backends, SGLang's host
    pool. Mocked: only the failures (``FaultyStore``)."""
    host = make_cpu_host_pool("page_first", page_size=PS, host_tokens=PS * 200)
    page = len(page_bytes(host, 0))
    universe = 48
    keys = hashes(universe, "prop")
    src = host.alloc(universe * PS)
    fill_pages(host, src, seed=3)
    want = pages_at(host, src)
    cap = 24 * page
    if store_extra.name == "memory":
        inner = store_extra(capacity=cap)
    else:
        inner = store_extra(file_size=cap)
    flag = tmp_path / "faults-on"
    other = direct_backend(host, inner)  # the second engine: writes, deletes, evicts
    inner_store = inner.pop("store")
    reader = direct_backend(host, {"store": FAULTY, "inner": inner_store, "inner_options": inner,
                                   "raise_on": ["exists", "get_into"], "fault_flag": str(flag)})
    dest = host.alloc(8 * PS)
    t_start = time.monotonic()

    def lookups(rng, count):
        stats = {"reported": 0, "loaded": 0, "raced": 0, "raced_pages": 0}
        for _ in range(count):
            lo = rng.randrange(universe)
            ks = [keys[(lo + j) % universe] for j in range(rng.randrange(1, 9))]
            n = reader.batch_exists(ks)
            assert isinstance(n, int) and 0 <= n <= len(ks)
            if not n:
                continue
            stats["reported"] += n
            before, prom_before = reader.kvconnect_stats()["reported_not_loaded_pages"], _reported_not_loaded()
            zero_pages(host, dest[: n * PS])
            ok = reader.batch_get_v1(ks[:n], dest[: n * PS])
            assert isinstance(ok, list) and len(ok) == n
            got = pages_at(host, dest[: n * PS])
            for i, good in enumerate(ok):
                if good:
                    assert got[i] == want[keys.index(ks[i])], "a page reported loaded holds other bytes"
            lead = 0
            while lead < n and ok[lead]:
                lead += 1
            counted = reader.kvconnect_stats()["reported_not_loaded_pages"] - before
            assert counted == n - lead, (n, ok, counted)
            assert _reported_not_loaded() - prom_before == n - lead
            if lead == n:
                stats["loaded"] += 1
            else:
                stats["raced"] += 1
                stats["raced_pages"] += n - lead
        return stats

    # phase 1: quiet store (16 of the keys written, nothing evicts, deletes or fails)
    assert other.batch_set_v1(keys[:16], src[: 16 * PS]) == [True] * 16
    quiet = lookups(random.Random(11), 1500)
    assert quiet["raced"] == 0 and quiet["loaded"] > 0, quiet

    # the two races, made to happen: a page deleted, and the store failing, between lookup and load
    for race in ("deleted", "failed"):
        ks = keys[:4]
        assert reader.batch_exists(ks) == 4
        before, prom_before = reader.kvconnect_stats()["reported_not_loaded_pages"], _reported_not_loaded()
        if race == "deleted":
            assert other.batch_delete(ks[2:3]) == [True]
        else:
            flag.touch()
        ok = reader.batch_get_v1(ks, dest[: 4 * PS])
        flag.unlink(missing_ok=True)
        lead = 2 if race == "deleted" else 0
        assert ok[:lead] == [True] * lead and not ok[lead], (race, ok)
        assert pages_at(host, dest[: lead * PS]) == want[:lead]
        assert reader.kvconnect_stats()["reported_not_loaded_pages"] - before == 4 - lead
        assert _reported_not_loaded() - prom_before == 4 - lead
        assert other.batch_set_v1(ks, src[: 4 * PS]) == [True] * 4

    # phase 2: under fire
    stop = threading.Event()
    errors: list[BaseException] = []

    def chaos(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                i = rng.randrange(universe)
                j = min(universe, i + rng.randrange(1, 5))
                if rng.random() < 0.75:
                    ok = other.batch_set_v1(keys[i:j], src[i * PS:j * PS])
                else:
                    ok = other.batch_delete(keys[i:j])
                assert isinstance(ok, list) and len(ok) == j - i
                time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def faults():
        rng = random.Random(5)
        while not stop.is_set():
            if rng.random() < 0.2:
                flag.touch()
            else:
                flag.unlink(missing_ok=True)
            time.sleep(0.002)
        flag.unlink(missing_ok=True)

    threads = [threading.Thread(target=chaos, args=(s,)) for s in (21, 22)] + [threading.Thread(target=faults)]
    for t in threads:
        t.start()
    try:
        fire = lookups(random.Random(12), 1500)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert fire["reported"] > 0 and fire["loaded"] > 0, fire
    assert reader.store.calls["exists"] > 0 and reader.kvconnect_stats()["adapter_errors"], "no fault injected"
    print(f"\n{store_extra.name}: quiet {quiet}; under fire {fire}; "
          f"{time.monotonic() - t_start:.1f} s")
    assert time.monotonic() - t_start < 60
    reader.close()
    other.close()
