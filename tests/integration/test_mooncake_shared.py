"""Same-host shared segments: a standalone ``kvconnect mooncake-store`` process with
``shared_segment`` lends its memory from /dev/shm; engines on the host copy pages from it.

Everything real: ``mooncake_master`` and the store process (``python -m kvconnect
mooncake-store``) in a loopback-only namespace, engine-side stores (no segment of their
own) in this test process.

* the conformance suite against an engine-side store: every read is a shared-memory copy
  (counted), including the reads racing overwrites and deletes;
* byte-exact against the Transfer Engine path (a reader with ``local_copy`` off);
* kill -9 of the store process: its pages are misses at once (never its stale bytes as
  hits), no exception; the next store process sweeps the dead one's files and serves.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvconnect.connectors.testing.mooncake import INNER, outer_test

if not INNER:
    test_in_loopback_namespace = outer_test(__file__)
else:
    from kvconnect.connectors.buffers import HostBuffer
    from kvconnect.connectors.testing.mooncake import MasterProcess
    from kvconnect.connectors.testing.processes import free_port
    from kvconnect.connectors.registry import create_store
    from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance, check_page, page_bytes
    from kvconnect.connectors.testing.mooncake import mooncake_cluster, store_options  # noqa: F401 - fixture

    def _start_holder(cluster, directory: str, segment: str = "128mb", master=None) -> subprocess.Popen:
        return cluster.start_store_process(segment, shared_segment_dir=directory, master=master)

    @pytest.fixture(scope="module")
    def shm_dir():
        d = f"/dev/shm/kvc-test-{secrets.token_hex(4)}"
        yield d
        shutil.rmtree(d, ignore_errors=True)

    @pytest.fixture(scope="module")
    def holder(mooncake_cluster, shm_dir):  # noqa: F811
        p = _start_holder(mooncake_cluster, shm_dir)
        yield p
        if p.poll() is None:
            p.terminate()
            p.wait(15)

    def _engine_options(cluster, shm_dir, **over):
        return store_options(cluster, global_segment_size=0, shared_segment_dir=shm_dir, **over)

    class TestEngineReadingASharedSegment(PageStoreConformance):
        store_name = "mooncake"
        capacity_bytes = None

        @pytest.fixture(autouse=True)
        def _cluster(self, mooncake_cluster, shm_dir, holder):  # noqa: F811
            self.cluster, self.shm_dir = mooncake_cluster, shm_dir

        def store_options(self):
            return _engine_options(self.cluster, self.shm_dir)

        def make_store(self):
            return create_store("mooncake", self.store_options())

        def test_reads_are_shared_memory_copies(self, store):
            keys = self.keys(24)
            assert all(self.write(store, keys))
            ok, b = self.read(store, keys)
            assert ok == [True] * 24
            assert [check_page(k, b.read(i)) for i, k in enumerate(keys)] == [0] * 24
            assert store.stats().extra["shared_copy_pages"] >= 24

    def test_shared_copy_matches_the_transfer_engine_path(mooncake_cluster, shm_dir, holder):  # noqa: F811
        shm = create_store("mooncake", _engine_options(mooncake_cluster, shm_dir))
        tcp = create_store("mooncake", _engine_options(mooncake_cluster, shm_dir, local_copy=False))
        try:
            entry = json.loads(next(Path(shm_dir).glob("*.json")).read_text())
            assert entry["pid"] == holder.pid and Path(entry["path"]).exists()
            n, size = 32, 256 << 10
            src, a, b = (HostBuffer(n, size, 4) for _ in range(3))
            for i in range(n):
                src.fill(i, os.urandom(size))
            for st, buf in ((shm, src), (shm, a), (tcp, src), (tcp, b)):
                st.register_memory(buf.address, len(buf.raw))
            keys = [f"shared-{secrets.token_hex(6)}-{i}" for i in range(n)]
            assert shm.put_from(keys, [src.page(i) for i in range(n)]) == [True] * n
            assert shm.get_into(keys, [a.page(i) for i in range(n)]) == [True] * n
            assert tcp.get_into(keys, [b.page(i) for i in range(n)]) == [True] * n
            assert all(a.read(i) == src.read(i) == b.read(i) for i in range(n))
            assert shm.stats().extra["shared_copy_pages"] == n and shm.stats().extra["direct_pages"] == n  # puts
            assert tcp.stats().extra["shared_copy_pages"] == 0 and tcp.stats().extra["direct_pages"] == n
        finally:
            shm.close()
            tcp.close()

    def test_killed_store_process_pages_are_misses_then_a_new_one_serves(mooncake_cluster, shm_dir,  # noqa: F811
                                                                          tmp_path):
        """Own master and store process, killed with -9 after its pages were read once: the
        reader's next get of them returns misses within op_timeout (its mapping still holds
        the old bytes, but the holder is gone, so they are not served), and never raises. A
        new store process removes the dead one's file and registry entry, and serves."""
        master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                               log_path=tmp_path / "master-kill.log").start()
        sub = f"{shm_dir}-kill"
        first = _start_holder(mooncake_cluster, sub, segment="64mb", master=master)
        reader = create_store("mooncake", _engine_options(mooncake_cluster, sub, op_timeout=3,
                                                          master_server_address=master.address))
        second = None
        try:
            dead_entry = next(Path(sub).glob("*.json"))
            dead_file = json.loads(dead_entry.read_text())["path"]
            keys = [f"kill-{secrets.token_hex(6)}-{i}" for i in range(8)]
            src, dst = HostBuffer(8, PAGE, 2), HostBuffer(8, PAGE, 2)
            for i, k in enumerate(keys):
                src.fill(i, page_bytes(k))
            assert reader.put_from(keys, [src.page(i) for i in range(8)]) == [True] * 8
            assert reader.get_into(keys, [dst.page(i) for i in range(8)]) == [True] * 8
            assert reader.stats().extra["shared_copy_pages"] == 8
            assert all(dst.read(i) == src.read(i) for i in range(8))
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
            dst = HostBuffer(8, PAGE, 2)
            t0 = time.monotonic()
            ok = reader.get_into(keys, [dst.page(i) for i in range(8)])
            took = time.monotonic() - t0
            assert ok == [False] * 8, "pages of a dead store process were served"
            assert took < 3 + 1.0, f"get took {took:.1f}s"
            # the master still lists the dead process's replicas (until its client_ttl): they
            # were found in the reader's mapping, copied, and dropped for the dead holder
            assert reader.stats().extra["shared_copy_holder_gone"] == 8

            second = _start_holder(mooncake_cluster, sub, segment="64mb", master=master)
            assert not Path(dead_file).exists() and not dead_entry.exists(), "dead store's files not swept"
            fresh = [f"after-{secrets.token_hex(6)}-{i}" for i in range(8)]
            for i, k in enumerate(fresh):
                src.fill(i, page_bytes(k))
            deadline = time.monotonic() + 30  # the dead segment stays mounted until client_ttl
            ok = [False]
            while not all(ok) and time.monotonic() < deadline:
                ok = reader.put_from(fresh, [src.page(i) for i in range(8)])
                if not all(ok):
                    time.sleep(0.5)
            assert all(ok)
            got = HostBuffer(8, PAGE, 2)
            time.sleep(2.1)  # readers look for newly published segments every 2 s
            before = reader.stats().extra["shared_copy_pages"]
            assert reader.get_into(fresh, [got.page(i) for i in range(8)]) == [True] * 8
            assert [check_page(k, got.read(i)) for i, k in enumerate(fresh)] == [0] * 8
            assert reader.stats().extra["shared_copy_pages"] - before == 8
            assert reader.stats().extra["shared_segments_mapped"] == 1  # the dead one's was let go

            # a store process that exits cleanly removes its entry; readers let go of its
            # memory at their next look (every 2 s), not only when a copy finds it gone
            second.terminate()
            second.wait(15)
            assert not list(Path(sub).glob("*.json")) and not list(Path(sub).glob("*.mem"))
            time.sleep(2.1)
            reader.get_into(fresh[:1], [got.page(0)])
            assert reader.stats().extra["shared_segments_mapped"] == 0
        finally:
            reader.close()
            for p in (first, second):
                if p is not None and p.poll() is None:
                    p.terminate()
                    p.wait(15)
            shutil.rmtree(sub, ignore_errors=True)
            master.kill()
