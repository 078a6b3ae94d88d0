"""Conformance: the peer pool, a 3-node pool (two ``kvconnect peer serve`` subprocesses plus
the store under test), for both placements.

Mooncake's Transfer Engine listens on every interface whatever it is told, so the whole
suite runs inside a loopback-only network namespace made for it: the outer test creates
the namespace, re-runs this module inside it (with KVCONNECT_PEER_NS set) and checks that
every inner test passed. Its output lists the inner tests.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import pytest

from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance, page_bytes
from kvconnect.connectors.testing.netns import outer_test
from kvconnect.connectors.testing.peer import exec_in, skip_reason
from kvconnect.connectors.testing.processes import python, stop

INNER = os.environ.get("KVCONNECT_PEER_NS")
SEG_PAGES = 64  # pages each node lends


def _deps() -> str | None:
    return skip_reason("grpc", "mooncake.engine")


if not INNER:
    test_conformance_in_loopback_namespace = outer_test(__file__, "KVCONNECT_PEER_NS", _deps, prefix="kvp")

    def test_clear_keeps_reserved_blocks_out_of_reach():
        """A block reserved for a one-sided write (or quarantined after one failed) is not in
        the slot table; clearing the segment must not hand it out again while that write
        may still land in it."""
        from kvconnect.connectors.peer_rdma.segment import Segment, checksum_at

        seg = Segment(16 * PAGE, populate=False)
        try:
            reserved = seg.reserve(PAGE)  # in flight: never committed
            for i in range(8):
                off = seg.reserve(PAGE)
                assert seg.commit(f"k{i}", off, PAGE, checksum_at(seg.base + off, PAGE)) is not None
            assert sorted(k for k, _ in seg.clear()) == [f"k{i}" for i in range(8)] and seg.keys == 0
            assert seg.bytes_used == PAGE
            got = [seg.reserve(PAGE) for _ in range(15)]  # everything else is free again
            assert None not in got and reserved not in got and seg.reserve(PAGE) is None
            seg.release(reserved, PAGE)  # the write was settled: the block comes back once
            assert seg.reserve(PAGE) == reserved and seg.bytes_used == 16 * PAGE
        finally:
            seg.close()
else:
    SHM_DIR = tempfile.mkdtemp(prefix="kvp-conf-", dir="/dev/shm")  # the pool's shared segments

    @pytest.fixture(scope="module")
    def pool():
        """Two memory-only nodes; the first is the seed. Both lend from shared memory: stores
        with ``shared_segment`` copy their pages, the others move them with the engine."""
        procs, tmp = [], tempfile.mkdtemp(prefix="kvp-conf-")
        seed = "127.0.0.1:31998"
        try:
            for i in range(2):
                ready = os.path.join(tmp, f"ready{i}")
                procs.append(exec_in(INNER, [
                    python(), "-m", "kvconnect", "--log-level", "WARNING", "peer", "serve",
                    "--discovery-addr", seed, "--control-port", "31998" if i == 0 else "0",
                    "--global-segment-size", str(SEG_PAGES * PAGE), "--protocol", "tcp",
                    "--set", "heartbeat_interval=0.5", "--set", "member_ttl=3", "--set", "shared_segment=true",
                    "--set", f"shared_segment_dir={SHM_DIR}", "--ready-file", ready],
                    stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"node{i}.log"), "w")))
                deadline = time.monotonic() + 60
                while not os.path.exists(ready):
                    assert procs[-1].poll() is None, open(os.path.join(tmp, f"node{i}.log")).read()
                    assert time.monotonic() < deadline, "pool node did not start"
                    time.sleep(0.1)
            yield seed
        finally:
            for p in procs:
                stop(p)
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(SHM_DIR, ignore_errors=True)

    class _PeerBase(PageStoreConformance):
        store_name = "peer_rdma"
        placement = "local"

        @pytest.fixture(autouse=True)
        def _pool(self, pool):
            self.seed = pool

        def store_options(self):
            return {"discovery_addr": self.seed, "control_port": 0, "protocol": "tcp",
                    "global_segment_size": SEG_PAGES * PAGE, "placement": self.placement,
                    "heartbeat_interval": 0.5, "member_ttl": 3.0}

        def make_store(self):
            from kvconnect.connectors.registry import create_store

            store = create_store("peer_rdma", self.store_options())
            # a member that missed heartbeats on a loaded machine rejoins on its next one: wait
            # (bounded) for the whole pool rather than failing on a view caught in between
            deadline = time.monotonic() + 10
            while len(store.node.view.members) != 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            if len(store.node.view.members) != 3:
                ids = store.node.view.ids
                store.close()
                raise AssertionError(f"the pool never showed its 3 members within 10 s: {ids}")
            return store

    class TestPeerRdmaLocalPlacement(_PeerBase):
        """Writes land in the writer's segment; entries on the owners (2 of the 3 nodes)."""

        placement = "local"
        capacity_bytes = SEG_PAGES * PAGE

        def test_misses_say_why_not_found_mismatch_and_a_dead_holder(self, store):
            from kvconnect.connectors.buffers import HostBuffer
            from kvconnect.connectors.registry import create_store

            holder = create_store("peer_rdma", self.store_options())  # a fourth node, in this process
            try:
                keys = self.keys(16)
                assert self.write(holder, keys) == [True] * 16  # local placement: in the holder's segment
                assert self.read(store, keys)[0] == [True] * 16
                half = HostBuffer(2, PAGE // 2, 2)
                assert store.get_into(keys[:2], [half.page(0), half.page(1)]) == [False, False]
                assert self.read(store, self.keys(3, "never"))[0] == [False] * 3
                assert store.stats().misses["get"] == {"mismatch": 2, "not_found": 3}
                holder.node.close(leave=False)  # dies without a goodbye: still a member until member_ttl
                t0 = time.monotonic()
                ok, _ = self.read(store, keys)
                assert ok == [False] * 16 and time.monotonic() - t0 < 10
                by = store.stats().misses["get"]
                # pages the directory still names, on a node that does not answer: unavailable (the
                # entries the dead node's directory shard held are simply not found)
                assert by.get("unavailable", 0) >= 4 and by["mismatch"] == 2, by
                assert sum(by.values()) == 2 + 3 + 16, by
                # once the pool dropped the dead node, its pages are still told apart from pages
                # never stored: their entries at live directory owners say the holder is gone
                deadline = time.monotonic() + 15
                while len(store.node.view.members) != 3 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert len(store.node.view.members) == 3
                assert self.read(store, keys)[0] == [False] * 16
                after = store.stats().misses["get"]
                lost = after.get("unavailable", 0) - by.get("unavailable", 0)
                cold = after.get("not_found", 0) - by.get("not_found", 0)
                # about 3 in 4 keys have a live directory owner; the dead node's own shard is gone
                assert lost >= 6 and lost + cold == 16, (by, after)
            finally:
                holder.close()
                deadline = time.monotonic() + 15  # the pool forgets the dead node before the next test
                while len(store.node.view.members) != 3 and time.monotonic() < deadline:
                    time.sleep(0.2)

    def test_start_up_line_and_the_warning_when_rdma_runs_on_tcp(caplog):
        """protocol rdma (the default) on a machine without an RDMA NIC: the engine moves pages
        over TCP, and the log says so, loudly, once; the start-up line names the real transport."""
        import logging

        from kvconnect.connectors.registry import create_store
        from kvconnect.connectors.transfer_engine import rdma_devices

        if rdma_devices():
            pytest.skip(f"this machine has RDMA NICs ({rdma_devices()}): rdma runs as rdma")
        caplog.set_level(logging.INFO, logger="kvconnect")
        store = create_store("peer_rdma", {"discovery_addr": "127.0.0.1:1", "control_port": 0,
                                           "global_segment_size": 16 * PAGE, "auth_token": "t",
                                           "join_timeout": 0.1})
        try:
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                      and "protocol rdma" in r.getMessage()]
            assert len(warned) == 1 and "over TCP" in warned[0], warned
            (line,) = [r.getMessage() for r in caplog.records if r.name == "kvconnect"
                       and r.getMessage().startswith("kvconnect peer_rdma:")]
            assert f"node {store.node.node_id}, peers via 127.0.0.1:1 (1 members), auth on, " \
                   f"transport tcp (asked for rdma), lends {16 * PAGE} bytes" in line, line
        finally:
            store.close()

    def test_the_node_answers_the_standard_grpc_health_check():
        """grpc.health.v1.Health/Check, encoded by hand, with no token (probes carry none)."""
        import grpc

        from kvconnect.connectors import grpc_health
        from kvconnect.connectors.peer_rdma.rpc import SERVICE
        from kvconnect.connectors.registry import create_store

        store = create_store("peer_rdma", {"discovery_addr": "127.0.0.1:1", "control_port": 0, "protocol": "tcp",
                                           "global_segment_size": 16 * PAGE, "auth_token": "right",
                                           "join_timeout": 0.1})
        try:
            target = store.node.node_id
            assert grpc_health.check(target, timeout=10) == grpc_health.SERVING
            assert grpc_health.check(target, SERVICE, timeout=10) == grpc_health.SERVING
            with pytest.raises(grpc.RpcError) as e:
                grpc_health.check(target, "no.such.Service", timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            store.close()

    class TestPeerRdmaOwnerPlacement(_PeerBase):
        """Writes are one-sided TE writes into the key owner's segment; 2/3 of the reads are
        one-sided TE reads from the other two nodes."""

        placement = "owner"
        capacity_bytes = 3 * SEG_PAGES * PAGE

        def test_pages_spread_over_the_pool_and_read_remotely(self, store):
            keys = self.keys(48)
            assert self.write(store, keys) == [True] * 48
            ok, b = self.read(store, keys)
            assert ok == [True] * 48
            for i, k in enumerate(keys):
                assert b.read(i) == page_bytes(k)
            m = store.node.metrics()
            assert m["read_remote_hits"] > 0 and m["read_local_hits"] > 0, m
            assert m["pool_keys"] < 48  # the others hold the rest

        def test_remote_reads_are_staged_and_validated_before_the_copy(self, store):
            keys = self.keys(16)
            assert self.write(store, keys) == [True] * 16
            ok, b = self.read(store, keys)  # HostBuffer memory is never registered here
            assert ok == [True] * 16
            assert all(b.read(i) == page_bytes(k) for i, k in enumerate(keys))
            assert store.node.metrics()["staged_reads"] > 0

        def test_direct_reads_into_registered_caller_memory(self):
            from kvconnect.connectors.registry import create_store

            store = create_store("peer_rdma", {**self.store_options(), "direct_reads": True})
            try:
                self._direct(store)
            finally:
                store.close()

        def _direct(self, store):
            keys = self.keys(16)
            src, dst = self.buf(16), self.buf(16)
            store.register_memory(src.address, len(src.raw))
            store.register_memory(dst.address, len(dst.raw))
            for i, k in enumerate(keys):
                src.fill(i, page_bytes(k))
            before = store.node.metrics()["bounce_reads"]
            assert store.put_from(keys, [src.page(i) for i in range(16)]) == [True] * 16
            assert store.get_into(keys, [dst.page(i) for i in range(16)]) == [True] * 16
            assert all(dst.read(i) == page_bytes(k) for i, k in enumerate(keys))
            m = store.node.metrics()
            assert m["bounce_reads"] == before and m["staged_reads"] == 0 and m["read_remote_hits"] > 0

        def test_a_republish_from_before_a_clear_cannot_resurrect_entries(self, store):
            """Holders re-home their entries from a snapshot of their slots (after a view
            change); a snapshot taken before a clear must not bring the entries back on the
            owners when it arrives after the clear."""
            from kvconnect.connectors.peer_rdma.placement import owners

            keys = self.keys(48)  # placement hashes the keys: ~32 on the other nodes, >= 4 all but surely
            assert self.write(store, keys) == [True] * 48
            node = store.node
            stale = [(k, e) for k, e in zip(keys, node.reader.locate(keys, time.monotonic() + 5))
                     if e is not None and e[0] != node.node_id]  # held by the other nodes
            assert len(stale) >= 4
            store.clear()
            view = node.view
            per: dict[str, list] = {}
            for key, e in stale:
                for t in owners(key, view.ids, 1 + node.config.directory_replicas):
                    per.setdefault(t, []).append([key, e])
            for t, batch in per.items():  # the late re-publish, as the holders would send it
                if t == node.node_id:
                    node.directory.put([batch, True])
                else:
                    node.clients.call(t, "DirPut", [batch, True])
            assert store.exists(keys) == [False] * 48
            assert self.read(store, keys)[0] == [False] * 48

        def test_a_republish_racing_a_delete_cannot_resurrect_the_page(self, store):
            """The race behind the flaky delete (issue 26): a holder re-homes its entries from
            a snapshot of its slots after a view change (a store joined); a snapshot taken
            before a delete whose re-publish reaches an owner after the delete's DirDelete
            made the page readable again (its freed block keeps its bytes, so the published
            checksum still matched). Forced here: the delete completes, then the holders'
            re-publish arrives, as they send it, at every owner of the view."""
            from kvconnect.connectors.peer_rdma.placement import owners

            keys = self.keys(48)
            assert self.write(store, keys) == [True] * 48
            node = store.node
            entries = node.reader.locate(keys, time.monotonic() + 5)
            stale = [(k, e) for k, e in zip(keys, entries) if e is not None and e[0] != node.node_id]
            # held by the two pool nodes (owner placement hashes the keys: about two thirds of them;
            # 24 keys once gave 6, under a bound of 8 that was about the placement, not the race)
            assert len(stale) >= 4
            gone, kept = [k for k, _ in stale], [k for k in keys if k not in {k for k, _ in stale}]
            assert store.delete(gone) == [True] * len(gone)
            per: dict[str, list] = {}
            for key, e in stale:
                for t in owners(key, node.view.ids, 1 + node.config.directory_replicas):
                    per.setdefault(t, []).append([key, e])
            for t, batch in per.items():  # the late re-publish (put-if-absent, as re-homing sends it)
                if t == node.node_id:
                    assert node.directory.put([batch, True]) == [False] * len(batch)
                else:
                    assert node.clients.call(t, "DirPut", [batch, True]) == [False] * len(batch)
            assert store.exists(gone) == [False] * len(gone)
            assert self.read(store, gone)[0] == [False] * len(gone)
            ok, b = self.read(store, kept)  # the other pages are untouched
            assert ok == [True] * len(kept) and all(b.read(i) == page_bytes(k) for i, k in enumerate(kept))

        def test_a_rehoming_round_from_before_a_delete_cannot_resurrect_the_page(self, store):
            """The same race through this node's own re-homing round: its snapshot of the
            slots is taken, the delete of the pages it holds completes, then the round
            publishes the snapshot (to every owner, as a first round does). No owner may
            name the deleted pages afterwards."""
            keys = self.keys(48)
            assert self.write(store, keys) == [True] * 48
            node = store.node
            held = node.segment.items()  # the round's snapshot, before the delete
            mine = [k for k in keys if node.segment.lookup(k, touch=False) is not None]
            assert len(mine) >= 4  # owner placement: about a third of the keys (~16) are this node's
            assert store.delete(mine) == [True] * len(mine)
            node.rehoming.rehome(None, node.view, held=held)  # ... and its round runs after it
            # locate asks the owners (an entry naming this node is not filtered here)
            assert node.reader.locate(mine, time.monotonic() + 5, use_cache=False) == [None] * len(mine)
            assert store.exists(mine) == [False] * len(mine)
            assert self.read(store, mine)[0] == [False] * len(mine)
            rest = [k for k in keys if k not in set(mine)]
            ok, b = self.read(store, rest)
            assert ok == [True] * len(rest) and all(b.read(i) == page_bytes(k) for i, k in enumerate(rest))

        def test_each_transfer_lands_before_it_is_reported(self, store):
            """Transfers the engine cannot coalesce (destinations in reverse order) are each
            waited for and reported as landed with their bytes in place."""
            keys = self.keys(16)
            assert self.write(store, keys) == [True] * 16
            node = store.node
            entries = node.reader.locate(keys, time.monotonic() + 5)
            dst = self.buf(16)
            node.register_memory(dst.address, len(dst.raw))
            for holder in {e[0] for e in entries if e[0] != node.node_id}:
                idx = [i for i, e in enumerate(entries) if e[0] == holder]
                member = node.view.members[holder]
                spans = []
                p = node.transport.read_async(member.te_name, [dst.address + (15 - i) * PAGE for i in idx],
                                              [member.seg_base + entries[i][2] for i in idx], [PAGE] * len(idx))
                assert len(p.ids) == len(idx)
                assert node.transport.wait(p, lambda a, n: spans.append((a, n, dst.raw[a - dst.address:][:n]))) == 0
                assert sorted(a for a, _, _ in spans) == sorted(dst.address + (15 - i) * PAGE for i in idx)
                for a, n, got in spans:  # the bytes were there when the transfer was reported
                    i = 15 - (a - dst.address) // PAGE
                    assert n == PAGE and bytes(got) == page_bytes(keys[i])

    class TestPeerRdmaDiskTier:
        """The write-through disk tier: pages the segment evicted come back on demand."""

        def test_evicted_pages_are_promoted_from_disk(self, pool, tmp_path):
            from kvconnect.connectors.buffers import HostBuffer
            from kvconnect.connectors.registry import create_store

            store = create_store("peer_rdma", {
                "discovery_addr": pool, "control_port": 0, "protocol": "tcp", "global_segment_size": 16 * PAGE,
                "disk_path": str(tmp_path / "disk"), "disk_size": 256 * PAGE, "heartbeat_interval": 0.5,
                "member_ttl": 3.0})
            try:
                keys = [f"disk-{i}-{os.getpid()}" for i in range(48)]
                src = HostBuffer(48, PAGE, 2)
                for i, k in enumerate(keys):
                    src.fill(i, page_bytes(k))
                for i in range(0, 48, 8):
                    assert store.put_from(keys[i:i + 8], [src.page(j) for j in range(i, i + 8)]) == [True] * 8
                store.node.disk.flush()
                m = store.node.metrics()
                assert m["evictions"] >= 32 and m["pool_keys"] <= 16 and m["disk_keys"] == 48, m
                assert store.exists(keys) == [True] * 48
                dst = HostBuffer(48, PAGE, 2)
                for i in range(0, 48, 8):  # batches that fit the segment
                    assert store.get_into(keys[i:i + 8], [dst.page(j) for j in range(i, i + 8)]) == [True] * 8
                assert all(dst.read(i) == page_bytes(k) for i, k in enumerate(keys))
                assert store.node.metrics()["read_disk_hits"] >= 32
            finally:
                store.close()

    def test_every_rpc_checks_the_token(tmp_path):
        """A node with a token refuses calls without it (or with another) before any handler runs."""
        from kvconnect.connectors.peer_rdma.rpc import Clients, RpcError
        from kvconnect.connectors.registry import create_store

        store = create_store("peer_rdma", {"discovery_addr": "127.0.0.1:1", "control_port": 0, "protocol": "tcp",
                                           "global_segment_size": 16 * PAGE, "auth_token": "right",
                                           "join_timeout": 0.1})
        try:
            target = store.node.node_id
            for token in ("", "wrong"):
                c = Clients(token, 10.0)  # generous: a loaded 2-core machine, and the deadline is not under test
                try:
                    for method, req in (("Stats", []), ("DirGet", ["k"]), ("Heartbeat", [store.node.me.to_wire(), []]),
                                        ("Clear", [])):
                        with pytest.raises(RpcError) as e:
                            c.call(target, method, req)
                        assert e.value.code == "UNAUTHENTICATED", (method, e.value)
                finally:
                    c.close()
            c = Clients("right", 10.0)
            try:
                assert c.call(target, "Stats", [])["members"] == 1
            finally:
                c.close()
        finally:
            store.close()

    class TestPeerRdmaSharedSegment(_PeerBase):
        """Every node of this host lends from shared memory (``shared_segment``): the pages the
        other two nodes hold are copied from their files, checked against the published
        checksum, never moved by the engine. The whole conformance suite (reads racing
        overwrites, deletes and evictions included) runs on that path."""

        placement = "owner"
        capacity_bytes = 3 * SEG_PAGES * PAGE

        def store_options(self):
            return {**super().store_options(), "shared_segment": True, "shared_segment_dir": SHM_DIR}

        def test_same_host_pages_are_copied_not_transferred(self, store):
            keys = self.keys(48)
            assert self.write(store, keys) == [True] * 48
            ok, b = self.read(store, keys)
            assert ok == [True] * 48
            assert all(b.read(i) == page_bytes(k) for i, k in enumerate(keys))
            m = store.node.metrics()
            assert m["read_remote_hits"] > 0 and m["shared_reads"] == m["read_remote_hits"], m
            assert m["staged_reads"] == 0 and m["shared_segments_mapped"] == 2, m
            own = [p for p in os.listdir(SHM_DIR) if p.endswith(".mem")]
            assert len(own) == 3, own  # the two pool nodes' segments and the store's own

        def _with_holder(self, body):
            """``body(store, holder)``: a fourth node in this process, local placement (its
            pages stay in its own shared segment); the pool forgets it before the next test."""
            from kvconnect.connectors.registry import create_store

            # a read looks stale locations up once more only while a whole transfer still fits in
            # its budget (the first pass done within 3 x rpc_timeout): room for that on a loaded host
            store = create_store("peer_rdma", {**self.store_options(), "rpc_timeout": 2.0, "timeout": 20.0})
            holder = create_store("peer_rdma", {**self.store_options(), "placement": "local"})
            try:
                body(store, holder)
            finally:
                holder.close()
                deadline = time.monotonic() + 15
                while len(store.node.view.members) != 3 and time.monotonic() < deadline:
                    time.sleep(0.2)
                store.close()

        def test_a_rewritten_slot_is_a_miss_never_wrong_bytes(self):
            """Bytes changed under a published page (a slot reused behind the reader's back)
            fail the checksum after the copy: a miss, counted as stale and as corrupt."""
            import ctypes

            def body(store, holder):
                keys = self.keys(8)
                assert self.write(holder, keys) == [True] * 8
                slot = holder.node.segment.lookup(keys[3])
                ctypes.memset(holder.node.segment.base + slot.offset + 100, 0x58, 16)
                ok, b = self.read(store, keys)
                assert ok == [True, True, True, False, True, True, True, True]
                assert all(b.read(i) == page_bytes(k) for i, k in enumerate(keys) if i != 3)
                m = store.node.metrics()
                # the stale page is looked up afresh and copied once more (a location may have moved)
                assert m["shared_reads"] == 9 and m["read_stale"] == 2 and m["staged_reads"] == 0, m
                assert store.stats().misses["get"] == {"corrupt": 1}

            self._with_holder(body)

        def test_a_slot_rewritten_during_a_read_is_a_miss_never_torn(self, monkeypatch):
            """A thread keeps writing another key's bytes over a published page and then its own
            back while the store reads it from the holder's file (copied and hashed chunk by chunk,
            4 KiB chunks here so a page is several): every read returns the page's own bytes or
            misses it ("corrupt"), never a torn page or the other key's bytes."""
            import ctypes

            from kvconnect.connectors.peer_rdma.reads import Reader
            from kvconnect.connectors.testing.conformance import race

            assert Reader.fused_same_host  # the default: one pass, copying and hashing per step
            monkeypatch.setattr(Reader, "fused_chunk_bytes", 4096)

            def body(store, holder):
                keys = self.keys(8)
                assert self.write(holder, keys) == [True] * 8
                slot = holder.node.segment.lookup(keys[3])
                at = holder.node.segment.base + slot.offset
                own, other = page_bytes(keys[3]), page_bytes(keys[4])
                seen = {"hits": 0, "misses": 0}

                def rewrite(stop):
                    while not stop.is_set():
                        for half in (0, PAGE // 2):  # a torn page, then the other key's whole page
                            ctypes.memmove(at + half, other[half:], PAGE - half)
                        ctypes.memmove(at, own, PAGE)

                def read(stop):
                    while not stop.is_set():
                        ok, b = self.read(store, keys)
                        assert all(o for i, o in enumerate(ok) if i != 3), ok
                        assert all(b.read(i) == page_bytes(k) for i, (k, o) in enumerate(zip(keys, ok)) if o)
                        seen["hits" if ok[3] else "misses"] += 1

                assert race([rewrite, read], seconds=3) == []
                misses = seen["misses"]
                assert misses > 0, "the writer never raced a read: the test proved nothing"
                m = store.node.metrics()
                assert m["read_stale"] >= misses and m["staged_reads"] == 0, m

            self._with_holder(body)

        def test_a_holder_that_is_gone_is_unmapped_and_its_pages_are_misses(self):
            """The holder dies without a goodbye: its file and registry entry go with it; until
            the reader notices (it re-lists every 2 s) a hit is still the page's own bytes
            (checksummed), then the mapping is let go and its pages are misses, in bounded time."""

            def body(store, holder):
                keys = self.keys(16)
                assert self.write(holder, keys) == [True] * 16
                ok, b = self.read(store, keys)
                assert ok == [True] * 16 and all(b.read(i) == page_bytes(k) for i, k in enumerate(keys))
                assert store.node.metrics()["shared_segments_mapped"] == 1  # mapped on first use
                path = holder.node.shared_file.path
                holder.node.close(leave=False)
                assert not os.path.exists(path)
                deadline = time.monotonic() + 10
                while True:
                    t0 = time.monotonic()
                    ok, b = self.read(store, keys)
                    assert time.monotonic() - t0 < 10
                    assert all(b.read(i) == page_bytes(k) for i, (k, o) in enumerate(zip(keys, ok)) if o)
                    if store.node.metrics()["shared_segments_mapped"] == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                assert store.node.metrics()["shared_segments_mapped"] == 0
                assert self.read(store, keys)[0] == [False] * 16

            self._with_holder(body)

    def test_a_shared_segment_that_does_not_fit_is_a_clear_error(tmp_path):
        """shared_segment asks for global_segment_size in the directory's file system; one
        that has less free names the option and the shortfall, and leaves no file behind."""
        from kvconnect.connectors.errors import BackendUnavailable
        from kvconnect.connectors.registry import create_store

        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        with pytest.raises(BackendUnavailable, match="shared_segment: .* bytes free"):
            create_store("peer_rdma", {"discovery_addr": "127.0.0.1:1", "control_port": 0, "protocol": "tcp",
                                       "global_segment_size": 2 * free + (1 << 30), "join_timeout": 0.1,
                                       "shared_segment": True, "shared_segment_dir": str(tmp_path)})
        assert not list(tmp_path.glob("*.mem")) and not list(tmp_path.glob("*.json"))
