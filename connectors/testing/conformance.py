"""One conformance suite for every ``PageStore``, in-tree or not.

A store's test module subclasses ``PageStoreConformance`` and provides ``make_store`` (and
``store_options`` for the config tests); pytest collects the inherited tests::

    from kvconnect.connectors.testing.conformance import PageStoreConformance

    class TestMyStore(PageStoreConformance):
        store_name = "mine"                 # registry name, or "" for a store built directly
        capacity_bytes = 1 << 20            # what make_store configured (None: no eviction test)

        def make_store(self):
            return MyStore(MyStoreConfig(capacity=self.capacity_bytes))

        def store_options(self):
            return {"capacity": self.capacity_bytes}

Class attributes switch checks, as flags to object_store's integration functions do:

* ``capacity_bytes``: the capacity ``make_store`` configured, for the eviction test (None:
  the store cannot be made small enough, the test is skipped with that reason).
* ``store_name``: registry name, for the config-error checks.

Pages carry a self-describing header (key id, generation, body checksum) so any read
can be checked to belong to its key and to be untorn, whatever threads did meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import struct
import threading
import time
from typing import Callable, Sequence

import pytest

from kvconnect.connectors.base import MAX_KEY_BYTES, InvalidKey, PageStore, StoreClosed, UnknownConfigKey
from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.registry import create_store
from kvconnect.namespace import count_hits

PAGE = 16 * 1024  # bytes per page (2 segments of 8 KiB)
HDR = struct.Struct("<32sQ")  # sha256(key), generation


def page_bytes(key: str, gen: int = 0, size: int = PAGE) -> bytes:
    """Deterministic page content for (key, generation): header + pseudo-random body."""
    head = HDR.pack(hashlib.sha256(key.encode()).digest(), gen)
    seed = hashlib.blake2b(f"{key}/{gen}".encode(), digest_size=8).digest()
    body = (seed * ((size - HDR.size - 16) // 8 + 1))[: size - HDR.size - 16]
    body = bytes(b ^ (i & 0xFF) for i, b in enumerate(body[:256])) + body[256:]
    digest = hashlib.blake2b(head + body, digest_size=16).digest()
    return head + body + digest


def check_page(key: str, data: bytes) -> int:
    """Generation of a page read for ``key``; raises AssertionError on foreign or torn bytes."""
    head, body, digest = data[: HDR.size], data[HDR.size: -16], data[-16:]
    assert hashlib.blake2b(head + body, digest_size=16).digest() == digest, f"torn page for {key}"
    khash, gen = HDR.unpack(head)
    assert khash == hashlib.sha256(key.encode()).digest(), f"read returned another key's bytes for {key}"
    assert data == page_bytes(key, gen, len(data)), f"wrong bytes for {key} gen {gen}"
    return gen


def race(workers: Sequence[Callable[[threading.Event], None]], seconds: float,
         join_s: float = 60) -> list[BaseException]:
    """Run each worker on a thread of its own for ``seconds``, then set the event it was
    given (a worker returns once it is set) and join them; returns what the workers raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(worker: Callable[[threading.Event], None]) -> None:
        try:
            worker(stop)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(join_s)
    return errors


class PageStoreConformance:
    store_name: str = ""
    capacity_bytes: int | None = None
    segments: int = 2
    threads: int = 8

    # -- to provide -------------------------------------------------------------
    def make_store(self) -> PageStore:
        raise NotImplementedError

    def store_options(self) -> dict:
        """Valid options for ``create_store(store_name, ...)``."""
        raise NotImplementedError

    # -- fixtures ---------------------------------------------------------------
    @pytest.fixture
    def store(self):
        s = self.make_store()
        try:
            yield s
        finally:
            s.close()

    def buf(self, n: int) -> HostBuffer:
        return HostBuffer(n, PAGE, self.segments)

    def keys(self, n: int, tag: str = "") -> list[str]:
        salt = random.getrandbits(48)
        return [hashlib.sha256(f"{tag}{salt}-{i}".encode()).hexdigest() for i in range(n)]

    def write(self, store: PageStore, keys: list[str], gen: int = 0) -> list[bool]:
        b = self.buf(len(keys))
        for i, k in enumerate(keys):
            b.fill(i, page_bytes(k, gen))
        return store.put_from(keys, [b.page(i) for i in range(len(keys))])

    def read(self, store: PageStore, keys: list[str]) -> tuple[list[bool], HostBuffer]:
        b = self.buf(len(keys))
        ok = store.get_into(keys, [b.page(i) for i in range(len(keys))])
        return ok, b

    # -- round trip ---------------------------------------------------------------
    def test_empty_batches(self, store):
        assert store.exists([]) == []
        assert store.get_into([], []) == []
        assert store.put_from([], []) == []
        assert store.delete([]) == []

    def test_round_trip_multi_segment_bytes(self, store):
        keys = self.keys(32)
        assert self.write(store, keys) == [True] * 32
        assert store.exists(keys) == [True] * 32
        ok, b = self.read(store, keys)
        assert ok == [True] * 32
        for i, k in enumerate(keys):
            assert b.read(i) == page_bytes(k), f"page {i} differs"

    def test_miss_is_false(self, store):
        present = self.keys(2, "p")
        self.write(store, present)
        absent = self.keys(2, "a")
        ok, b = self.read(store, [present[0], absent[0], present[1], absent[1]])
        assert ok == [True, False, True, False]
        assert b.read(0) == page_bytes(present[0]) and b.read(2) == page_bytes(present[1])

    def test_size_mismatch_is_miss(self, store):
        k = self.keys(1)
        self.write(store, k)
        small = HostBuffer(1, PAGE // 2, 1)
        assert store.get_into(k, [small.page(0)]) == [False]
        big = HostBuffer(1, PAGE * 2, 1)
        assert store.get_into(k, [big.page(0)]) == [False]
        ok, b = self.read(store, k)  # the stored page is intact
        assert ok == [True] and b.read(0) == page_bytes(k[0])

    def test_put_is_idempotent_and_keeps_first_bytes(self, store):
        keys = self.keys(4)
        assert self.write(store, keys, gen=1) == [True] * 4
        assert self.write(store, keys, gen=2) == [True] * 4
        ok, b = self.read(store, keys)
        assert ok == [True] * 4
        assert [check_page(k, b.read(i)) for i, k in enumerate(keys)] == [1] * 4

    def test_prefix_hits(self, store):
        keys = self.keys(10)
        self.write(store, keys[:6])
        self.write(store, keys[7:8])
        present = store.exists(keys)
        assert present == [True] * 6 + [False, True, False, False]
        assert count_hits(present) == 6
        # SGLang 0.5.23 batch_exists_v2: the longest prefix whose last N pages all exist.
        assert count_hits(present, "trailing_pages", 3) == 6
        assert count_hits(present, "trailing_pages", 1) == 8
        assert count_hits(present[6:], "trailing_pages") == 0  # present is the window

    def test_delete_and_clear(self, store):
        keys = self.keys(6)
        self.write(store, keys)
        assert store.delete(keys[:2] + self.keys(1, "x")) == [True, True, False]
        assert store.exists(keys) == [False, False] + [True] * 4
        ok, _ = self.read(store, keys[:2])
        assert ok == [False, False]
        assert self.write(store, keys[:1], gen=5) == [True]  # re-put after delete writes anew
        ok, b = self.read(store, keys[:1])
        assert ok == [True] and check_page(keys[0], b.read(0)) == 5
        store.clear()
        assert store.exists(keys) == [False] * 6

    def test_stats_count_calls(self, store):
        keys = self.keys(3)
        self.write(store, keys)
        self.read(store, keys + self.keys(1, "m"))
        s = store.stats()
        assert s.put_pages == 3 and s.put_written == 3
        assert s.get_pages == 4 and s.get_hits == 3
        assert s.get_bytes == 3 * PAGE

    # -- errors ----------------------------------------------------------------
    def test_batch_argument_errors(self, store):
        keys = self.keys(2)
        b = self.buf(1)
        with pytest.raises(ValueError):
            store.put_from(keys, [b.page(0)])
        with pytest.raises(ValueError):
            store.get_into(keys[:1], [[]])

    BAD_KEYS = [b"bytes-key", "", "a\nb", "a\x00b", "bad-\udc80", "k" * (MAX_KEY_BYTES + 1), 7, None]

    def test_keys_that_break_the_key_contract_are_refused(self, store):
        """One key contract for every store (``kvconnect.connectors.base``): a bad key in a
        batch raises ``InvalidKey`` from every call, before the store is touched; the good
        keys of the store are unaffected."""
        good = self.keys(1)
        assert self.write(store, good) == [True]
        b = self.buf(2)
        for bad in self.BAD_KEYS:
            batch = [good[0], bad]
            for call in (lambda: store.exists(batch), lambda: store.delete(batch),
                         lambda: store.get_into(batch, [b.page(0), b.page(1)]),
                         lambda: store.put_from(batch, [b.page(0), b.page(1)])):
                with pytest.raises(InvalidKey):
                    call()
        with pytest.raises(InvalidKey):
            store.clear_prefix("a\nb")
        ok, r = self.read(store, good)  # refused before the store was called: nothing deleted
        assert ok == [True] and r.read(0) == page_bytes(good[0])

    def test_non_ascii_and_long_keys_round_trip(self, store):
        keys = ["ключ-é-" + self.keys(1)[0], "k" * 200 + self.keys(1)[0]]
        assert self.write(store, keys) == [True, True]
        ok, r = self.read(store, keys)
        assert ok == [True, True] and [r.read(i) for i in range(2)] == [page_bytes(k) for k in keys]
        assert store.delete(keys) == [True, True] and store.exists(keys) == [False, False]

    def test_closed_store_raises(self):
        s = self.make_store()
        s.close()
        s.close()  # idempotent
        with pytest.raises(StoreClosed):
            s.exists(["a"])

    def test_unknown_config_key_is_named(self):
        if not self.store_name:
            pytest.skip("store has no registry name")
        opts = dict(self.store_options())
        opts["no_such_option"] = 1
        with pytest.raises(UnknownConfigKey) as e:
            create_store(self.store_name, opts)
        assert "no_such_option" in str(e.value)

    # -- concurrency -------------------------------------------------------------
    def test_concurrent_writers_and_readers(self, store):
        """Many threads write and read overlapping keys: every hit holds that key's bytes."""
        keys = self.keys(64)
        errors: list[BaseException] = []
        hits = [0]
        deadline = time.monotonic() + 20

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(30):
                    if time.monotonic() > deadline:
                        return
                    batch = rng.sample(keys, 8)
                    if rng.random() < 0.5:
                        assert all(self.write(store, batch))
                    else:
                        ok, b = self.read(store, batch)
                        for i, (k, hit) in enumerate(zip(batch, ok)):
                            if hit:
                                assert check_page(k, b.read(i)) == 0
                                hits[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(self.threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors[0]
        assert hits[0] > 0
        ok, b = self.read(store, keys)
        for i, k in enumerate(keys):
            if ok[i]:
                check_page(k, b.read(i))

    def test_reads_racing_overwrite_and_delete(self, store):
        """Writers delete and rewrite keys with new generations while readers read:
        a read is a miss or an untorn page of its own key, never anything else."""
        keys = self.keys(16)
        self.write(store, keys)
        reads = [0, 0]

        def churn(seed: int, stop: threading.Event) -> None:
            rng = random.Random(seed)
            gen = 1
            while not stop.is_set():
                batch = rng.sample(keys, 4)
                store.delete(batch)
                self.write(store, batch, gen=gen)
                gen += 1

        def reader(seed: int, stop: threading.Event) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                batch = rng.sample(keys, 8)
                ok, b = self.read(store, batch)
                for i, (k, hit) in enumerate(zip(batch, ok)):
                    reads[1 if hit else 0] += 1
                    if hit:
                        check_page(k, b.read(i))

        workers = [functools.partial(churn, i) for i in range(2)]
        workers += [functools.partial(reader, 100 + i) for i in range(4)]
        errors = race(workers, seconds=3, join_s=60)
        assert not errors, errors[0]
        assert reads[1] > 0, "no read hit while churning"

    # -- capacity -------------------------------------------------------------
    def test_eviction_under_capacity_pressure(self, store):
        if self.capacity_bytes is None:
            pytest.skip("store capacity is not configurable small enough for this test")
        n = (self.capacity_bytes // PAGE) * 3
        keys = self.keys(n)
        for i in range(0, n, 16):
            assert all(self.write(store, keys[i:i + 16]))
        present = store.exists(keys)
        assert sum(present) < n, "nothing was evicted"
        assert sum(present) * PAGE <= self.capacity_bytes
        assert all(present[-8:]), "the most recent pages were evicted"
        ok, b = self.read(store, keys)
        assert any(ok)
        for i, k in enumerate(keys):
            if ok[i]:
                check_page(k, b.read(i))
        s = store.stats()
        if s.bytes_used is not None:
            assert s.bytes_used <= self.capacity_bytes


# ---------------------------------------------------------------------------------
# Capabilities: each claim a harness's store makes, proven
# ---------------------------------------------------------------------------------


class CapabilityChecks:
    """Proofs of the capabilities a store claims, over a ``store_harness`` fixture (a started
    ``kvconnect.connectors.testing.harness.StoreHarness``; ``harness_fixture()`` makes one per
    registered store). A capability the store does not claim is skipped as "not claimed".

    * ``shared``: a second process (engine instance 1) reads, byte for byte, what the first
      (instance 0, still running) wrote;
    * ``durable``: the pages survive the writer's exit and a restart of the store's services
      (``harness.restart()``), and a new process reads them;
    * ``any_page_size``: one batch of pages of many sizes round-trips, then each size again;
    * ``zero_copy``: pages written from and read into memory registered with ``register_memory``
      round-trip (the path a zero-copy store takes; that no copy happens is the store's own test);
    * ``eviction_events``: a store bounded to 64 pages (``harness.sized_options``) and
      written 192 reports exactly the keys it no longer holds;
    * ``device_memory``: needs an accelerator, which a CPU run has not (a store claims it only
      where one is usable: ``capabilities_of`` checks).
    """

    @contextlib.contextmanager
    def _worker(self, harness, instance: int, tag: str):
        """A store client process of engine instance ``instance``, closed on leaving."""
        from kvconnect.connectors.testing.peer import Worker

        opts = dict(harness.options(instance))
        worker = Worker(harness.netns, opts, name=f"{harness.label}-{tag}", log_dir=harness.workdir,
                        store=opts.pop("store"))
        try:
            yield worker
        finally:
            worker.close()

    def _claimed(self, harness, cap: str) -> None:
        if cap not in {c.value for c in harness.claims}:
            pytest.skip(f"{harness.label} does not claim {cap}")

    def _claimed_keys(self, harness, cap: str, n: int = 8) -> list[str]:
        """Keys of a check of ``cap`` (skipped where the store does not claim it)."""
        self._claimed(harness, cap)
        return [f"{cap}-{harness.label}-{i}" for i in range(n)]

    @contextlib.contextmanager
    def _store_here(self, harness, cap: str, options: dict | None = None):
        """A store built in this process from ``options`` (default ``options(0)``), for a check of
        ``cap``; skipped where the store does not claim it or its clients cannot run here."""
        self._claimed(harness, cap)
        if not harness.in_process:
            pytest.skip(f"{harness.label}'s clients run only inside its namespace")
        store = create_store(None, options or harness.options(0))
        try:
            yield store
        finally:
            store.close()

    def test_claims_are_capabilities(self, store_harness):
        from kvconnect.connectors.base import Capability

        assert store_harness.claims <= set(Capability)
        assert all(isinstance(c, Capability) for c in store_harness.claims)

    def test_shared_a_second_process_reads_the_pages(self, store_harness):
        keys = self._claimed_keys(store_harness, "shared")
        with self._worker(store_harness, 0, "writer") as a:
            w = a.call("write", keys=keys, seed=11)
            assert w["ok"] == [True] * 8
            with self._worker(store_harness, 1, "reader") as b:  # while the writer still runs
                assert b.call("exists", keys=keys)["ok"] == [True] * 8
                r = b.call("read", keys=keys, digests=w["digests"])
                assert r["ok"] == [True] * 8 and r["wrong"] == [], r
                absent = b.call("read", keys=[k + "-absent" for k in keys[:2]], digests=w["digests"][:2])
                assert absent["ok"] == [False, False]

    def test_durable_pages_survive_writer_exit_and_service_restart(self, store_harness):
        keys = self._claimed_keys(store_harness, "durable")
        with self._worker(store_harness, 0, "writer") as a:
            w = a.call("write", keys=keys, seed=12)
        assert w["ok"] == [True] * 8
        store_harness.restart()
        with self._worker(store_harness, 1, "after-restart") as b:
            r = b.call("read", keys=keys, digests=w["digests"])
        assert r["ok"] == [True] * 8 and r["wrong"] == [], (store_harness.restart_keeps, r)

    def test_any_page_size_round_trips_pages_of_many_sizes(self, store_harness):
        with self._store_here(store_harness, "any_page_size") as store:
            sizes = [4096, 12288, 65536, 16384 + 512, 8192, 98304]
            keys = [f"sizes-{store_harness.label}-{n}" for n in sizes]
            bufs = [HostBuffer(1, n, 1) for n in sizes]
            for k, b in zip(keys, bufs):
                b.fill(0, page_bytes(k, 0, b.page_bytes))
            assert store.put_from(keys, [b.page(0) for b in bufs]) == [True] * len(sizes)
            out = [HostBuffer(1, n, 1) for n in sizes]
            assert store.get_into(keys, [b.page(0) for b in out]) == [True] * len(sizes)
            assert all(check_page(k, b.read(0)) == 0 for k, b in zip(keys, out))
            for k, n in zip(keys, sizes):  # one size per call too
                b = HostBuffer(1, n, 1)
                assert store.get_into([k], [b.page(0)]) == [True] and b.read(0) == page_bytes(k, 0, n)

    def test_zero_copy_round_trips_through_registered_memory(self, store_harness):
        with self._store_here(store_harness, "zero_copy") as store:
            keys = [f"zc-{store_harness.label}-{i}" for i in range(8)]
            src, dst = HostBuffer(8, PAGE, 2), HostBuffer(8, PAGE, 2)
            store.register_memory(src.address, len(src.raw))
            store.register_memory(dst.address, len(dst.raw))
            for i, k in enumerate(keys):
                src.fill(i, page_bytes(k))
            assert store.put_from(keys, [src.page(i) for i in range(8)]) == [True] * 8
            assert store.get_into(keys, [dst.page(i) for i in range(8)]) == [True] * 8
            assert all(dst.read(i) == page_bytes(k) for i, k in enumerate(keys))

    def test_eviction_events_name_the_keys_that_went(self, store_harness):
        self._claimed(store_harness, "eviction_events")
        capacity = 64 * PAGE
        opts = store_harness.sized_options(capacity)
        if opts is None:
            pytest.skip(f"{store_harness.label} cannot be bounded to {capacity} bytes")
        with self._store_here(store_harness, "eviction_events", opts) as store:
            evicted: list[str] = []
            lock = threading.Lock()

            def heard(keys: list[str]) -> None:
                with lock:
                    evicted.extend(keys)

            store.add_eviction_listener(heard)
            keys = [f"evict-{store_harness.label}-{i}" for i in range(3 * 64)]
            buf = HostBuffer(16, PAGE, 2)
            for i in range(0, len(keys), 16):
                for j, k in enumerate(keys[i:i + 16]):
                    buf.fill(j, page_bytes(k))
                assert store.put_from(keys[i:i + 16], [buf.page(j) for j in range(16)]) == [True] * 16
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with lock:
                    gone = set(evicted)
                present = store.exists(keys)
                if gone and gone == {k for k, p in zip(keys, present) if not p}:
                    break
                time.sleep(0.1)
            assert gone, "nothing was reported evicted"
            assert gone <= set(keys)
            assert gone == {k for k, p in zip(keys, store.exists(keys)) if not p}, "reported keys differ from the absent"

    def test_device_memory_needs_an_accelerator(self, store_harness):
        self._claimed(store_harness, "device_memory")
        pytest.skip("device_memory is proven on a GPU node (none here)")
