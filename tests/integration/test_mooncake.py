"""Mooncake store against a real ``mooncake_master`` in a loopback-only network namespace.

* direct (registered, zero-copy) and staged paths move the same objects, byte-exact;
* an unreachable master fails construction within ``setup_timeout``, naming the address;
* killing the master mid-load: every call returns within the deadline (misses, no
  exception), restarting it: the same store object serves again;
* two processes: one contributes a segment and writes a real SGLang host pool's pages
  through the SGLang HiCache adapter, the other (no segment) reads them byte-exact.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvconnect.connectors.base import BackendUnavailable
from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.testing.mooncake import MasterProcess
from kvconnect.connectors.testing.processes import child_env, free_port
from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.conformance import PAGE, check_page, page_bytes
from kvconnect.connectors.testing.mooncake import INNER, outer_test
from kvconnect.connectors.testing.mooncake import mooncake_cluster, store_options  # noqa: F401 - fixture
from kvconnect.connectors.testing.mooncake import buffer_pages as _pages, filled_buffer as _filled
from kvconnect.connectors.testing.mooncake import kill_under_load as _kill_under_load, random_keys as _keys
from kvconnect.connectors.testing.mooncake import restored_mooncake_timeouts, sigstopped as _stopped

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_mooncake_timeouts():
    with restored_mooncake_timeouts():
        yield






def _put_until_stored(s, keys: list[str], buf: HostBuffer) -> None:
    """A segment of a process killed by an earlier test stays mounted until the master's
    client_ttl (10 s) expires; a put placed there fails: retry until all pages land."""
    deadline = time.monotonic() + 30
    ok = s.put_from(keys, _pages(buf))
    while not all(ok) and time.monotonic() < deadline:
        time.sleep(0.5)
        ok = s.put_from(keys, _pages(buf))
    assert all(ok)


@pytest.fixture
def store(mooncake_cluster):  # noqa: F811
    """A store whose reads all go through Mooncake (its own-segment fast path is tested below)."""
    s = create_store("mooncake", store_options(mooncake_cluster, local_copy=False))
    try:
        yield s
    finally:
        s.close()


def test_direct_and_staged_paths_share_objects(store):
    keys = _keys(24)
    src = _filled(keys)
    store.register_memory(src.address, len(src.raw))
    dst = HostBuffer(24, PAGE, 2)
    store.register_memory(dst.address, len(dst.raw))

    assert store.put_from(keys, _pages(src)) == [True] * 24
    ok = store.get_into(keys, _pages(dst))
    assert ok == [True] * 24
    assert all(dst.read(i) == src.read(i) for i in range(24))
    extra = store.stats().extra
    assert extra["direct_pages"] == 48 and extra["staged_pages"] == 0

    plain = HostBuffer(24, PAGE, 2)  # not registered: staged, same objects
    assert store.get_into(keys, _pages(plain)) == [True] * 24
    assert all(check_page(k, plain.read(i)) == 0 for i, k in enumerate(keys))
    assert store.stats().extra["staged_pages"] == 24


def test_direct_put_keeps_first_bytes_and_size_mismatch_is_miss(store):
    keys = _keys(4)
    first, second = _filled(keys, gen=1), _filled(keys, gen=2)
    for b in (first, second):
        store.register_memory(b.address, len(b.raw))
    assert store.put_from(keys, _pages(first)) == [True] * 4
    assert store.put_from(keys, _pages(second)) == [True] * 4  # idempotent: not rewritten
    out = HostBuffer(4, PAGE, 2)
    store.register_memory(out.address, len(out.raw))
    assert store.get_into(keys, _pages(out)) == [True] * 4
    assert [check_page(k, out.read(i)) for i, k in enumerate(keys)] == [1] * 4

    small, big = HostBuffer(1, PAGE // 2, 2), HostBuffer(1, 2 * PAGE, 2)
    for b in (small, big):
        store.register_memory(b.address, len(b.raw))
    assert store.get_into(keys[:1], [small.page(0)]) == [False]
    assert store.get_into(keys[:1], [big.page(0)]) == [False]


def test_staged_io_mode_never_hands_caller_memory_to_mooncake(mooncake_cluster):  # noqa: F811
    s = create_store("mooncake", store_options(mooncake_cluster, io_mode="staged", local_copy=False))
    try:
        keys = _keys(8)
        src = _filled(keys)
        s.register_memory(src.address, len(src.raw))
        assert s.put_from(keys, _pages(src)) == [True] * 8
        dst = HostBuffer(8, PAGE, 2)
        s.register_memory(dst.address, len(dst.raw))
        assert s.get_into(keys, _pages(dst)) == [True] * 8
        assert all(dst.read(i) == src.read(i) for i in range(8))
        extra = s.stats().extra
        assert extra["direct_pages"] == 0 and extra["staged_pages"] == 16
        assert extra["staging_in_use"] == 0
    finally:
        s.close()


def test_delete_waits_for_a_readers_lease_instead_of_tearing_it(store):
    """A remove right after a read is refused by the master (-706) until the lease
    lapses; ``delete`` waits for it and then succeeds; the read saw whole bytes."""
    keys = _keys(2)
    src = _filled(keys)  # keep the buffer alive: pages are raw addresses into it
    assert store.put_from(keys, _pages(src)) == [True, True]
    out = HostBuffer(2, PAGE, 2)
    assert store.get_into(keys, _pages(out)) == [True, True]
    t0 = time.monotonic()
    assert store.delete(keys) == [True, True]
    assert time.monotonic() - t0 > 0.1, "removed while the read's lease was held"
    assert store.exists(keys) == [False, False]
    assert [check_page(k, out.read(i)) for i, k in enumerate(keys)] == [0, 0]


def test_unreachable_master_fails_within_setup_timeout(mooncake_cluster):  # noqa: F811
    opts = store_options(mooncake_cluster, master_server_address="127.0.0.1:1", setup_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as e:
        create_store("mooncake", opts)
    took = time.monotonic() - t0
    assert took < 4, f"setup took {took:.1f}s with setup_timeout=2"
    assert "127.0.0.1:1" in str(e.value)


def test_segment_that_cannot_be_allocated_is_named_in_the_error(mooncake_cluster):  # noqa: F811
    """Mooncake fails such a setup with the same code as an unreachable master: the error must
    point at the segment size too, not only at the master."""
    opts = store_options(mooncake_cluster, global_segment_size="64tb", setup_timeout=5)
    with pytest.raises(BackendUnavailable) as e:
        create_store("mooncake", opts)
    msg = str(e.value)
    assert "global_segment_size=70368744177664" in msg and mooncake_cluster.master.address in msg


def test_prefer_local_segment_keeps_pages_in_the_writers_segment(mooncake_cluster, tmp_path):  # noqa: F811
    """With ``prefer_local_segment`` every page lands in the writer's own segment although a
    bigger segment exists (without it Mooncake spreads them: ~80% to the bigger one here):
    another process reads them byte-exact, and once the writer leaves, all of them are gone.
    Own master, so the shared cluster's placement is left as the other tests expect it."""
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                           log_path=tmp_path / "master-local.log").start()
    opts = dict(master_server_address=master.address)
    big = create_store("mooncake", store_options(mooncake_cluster, global_segment_size="256mb", **opts))
    writer = create_store("mooncake", store_options(mooncake_cluster, prefer_local_segment=True, **opts))
    reader = create_store("mooncake", store_options(mooncake_cluster, global_segment_size=0, **opts))
    try:
        src, dst = HostBuffer(16, 64 << 10, 2), HostBuffer(16, 64 << 10, 2)
        for i in range(16):
            src.fill(i, os.urandom(64 << 10))
        keys = [f"local-{i}" for i in range(16)]
        assert writer.put_from(keys, [src.page(i) for i in range(16)]) == [True] * 16
        assert reader.get_into(keys, [dst.page(i) for i in range(16)]) == [True] * 16
        assert all(dst.read(i) == src.read(i) for i in range(16))
        writer.close()
        deadline = time.monotonic() + 10
        while any(reader.exists(keys)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.exists(keys) == [False] * 16, "some pages were not in the writer's segment"
    finally:
        for st in (writer, reader, big):
            st.close()
        master.kill()


def test_local_copy_reads_own_segment_pages_itself_and_others_through_mooncake(mooncake_cluster,  # noqa: F811
                                                                               tmp_path):
    """``local_copy``: of one batch, the pages in the reader's own segment are copied by
    kvconnect (counted), the pages in another process's segment come through Mooncake;
    all byte-exact. The copy holds Mooncake's read lease: a remove right after it waits
    for the lease. A store that could not finish its copy within lease_ttl/2 reports
    misses. Own master, so placement is only these stores'."""
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                           log_path=tmp_path / "master-copy.log").start()
    opts = dict(master_server_address=master.address, prefer_local_segment=True)
    mine = create_store("mooncake", store_options(mooncake_cluster, **opts))
    other = create_store("mooncake", store_options(mooncake_cluster, **opts))
    late = create_store("mooncake", store_options(mooncake_cluster, lease_ttl=1e-9, **opts))
    try:
        assert mine.stats().extra["local_copy_endpoint"]
        own_keys, other_keys = _keys(16, "mine"), _keys(8, "other")
        own_src, other_src = _filled(own_keys), _filled(other_keys)
        mine.register_memory(own_src.address, len(own_src.raw))
        assert mine.put_from(own_keys, _pages(own_src)) == [True] * 16
        assert other.put_from(other_keys, _pages(other_src)) == [True] * 8
        keys = [k for pair in zip(own_keys, other_keys) for k in pair] + own_keys[8:]  # interleaved
        dst = HostBuffer(len(keys), PAGE, 2)
        mine.register_memory(dst.address, len(dst.raw))
        before = mine.stats().extra
        assert mine.get_into(keys, _pages(dst)) == [True] * len(keys)
        assert [check_page(k, dst.read(i)) for i, k in enumerate(keys)] == [0] * len(keys)
        extra = mine.stats().extra
        assert extra["local_copy_pages"] - before["local_copy_pages"] == 16
        assert extra["direct_pages"] - before["direct_pages"] == 8  # only the other process's pages
        assert extra["local_copy_late"] == 0

        t0 = time.monotonic()
        assert mine.delete(own_keys[:2]) == [True, True]
        assert time.monotonic() - t0 > 0.1, "removed while the local copy's lease was held"

        late_keys = _keys(4, "late")
        late_src = _filled(late_keys)
        assert late.put_from(late_keys, _pages(late_src)) == [True] * 4
        out = HostBuffer(4, PAGE, 2)
        assert late.get_into(late_keys, _pages(out)) == [False] * 4
        assert late.stats().extra["local_copy_late"] == 4
    finally:
        for st in (mine, other, late):
            st.close()
        master.kill()


@pytest.mark.failure_injection
@pytest.mark.parametrize("call_mode,op_timeout", [("worker", 1.5), ("inline", 5.0)])
def test_master_killed_mid_load_returns_misses_in_time_then_recovers(mooncake_cluster, tmp_path,  # noqa: F811
                                                                     call_mode, op_timeout):
    """Kill -9 the master while 3 threads put/get/exist; every call returns (no exception)
    within op_timeout + 1 s and reads miss; restart the master on the same port: the same
    store object (same process) writes and reads byte-exact again. Worker: calls are
    abandoned at op_timeout. Inline: Mooncake's client takes up to ~4.5 s to give up on a
    dead master whatever its RPC timeouts (measured 4.3-4.5 s with op_timeout 1.5 and 5), so
    inline is tested at the default op_timeout, 5 s."""
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                           log_path=tmp_path / "master2.log").start()
    s = create_store("mooncake", store_options(mooncake_cluster, master_server_address=master.address,
                                               op_timeout=op_timeout, reconnect_interval=0.3,
                                               call_mode=call_mode))
    try:
        warm = _keys(16, "warm")
        src = _filled(warm)
        s.register_memory(src.address, len(src.raw))
        assert s.put_from(warm, _pages(src)) == [True] * 16

        stop = threading.Event()
        killed_at: list[float] = []
        calls: list[tuple[float, float, str, bool]] = []  # start, seconds, op, any hit
        errors: list[BaseException] = []

        def load(seed: int) -> None:
            rng = random.Random(seed)
            dst = HostBuffer(16, PAGE, 2)
            s.register_memory(dst.address, len(dst.raw))
            try:
                while not stop.is_set():
                    op = rng.choice(["get", "put", "exists"])
                    t0 = time.monotonic()
                    if op == "get":
                        r = s.get_into(warm, _pages(dst))
                        for i, hit in enumerate(r):
                            if hit:
                                assert dst.read(i) == src.read(i)
                    elif op == "put":
                        ks = _keys(4, f"load{seed}")
                        pb = _filled(ks)
                        r = s.put_from(ks, _pages(pb))
                    else:
                        r = s.exists(warm)
                    calls.append((t0, time.monotonic() - t0, op, any(r)))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        killed_at.append(_kill_under_load(master, load, stop, warm=1.0, after=op_timeout + 4.5,
                                          join=op_timeout + 10))
        assert not errors, errors[0]
        after = [c for c in calls if c[0] > killed_at[0] + 0.2]
        assert after, "no calls after the kill"
        slowest = max(c[1] for c in calls)
        assert slowest <= op_timeout + 1.0, f"a call took {slowest:.2f}s (op_timeout {op_timeout}s)"
        assert not any(c[3] for c in after if c[0] > killed_at[0] + op_timeout + 0.5), \
            "hits while the master was dead"
        assert s.stats().extra["healthy"] is False
        st = s.stats()  # the health gauge and misses by cause: the master, not the keys
        assert st.up is False
        down = st.misses["get"].get("unavailable", 0) + st.misses["get"].get("deadline", 0)
        assert down >= 16 and down + st.misses["get"].get("not_found", 0) == st.get_pages - st.get_hits, st.misses

        master.start()
        fresh = _keys(8, "after")
        b = _filled(fresh)
        deadline = time.monotonic() + 30
        ok = [False]
        while time.monotonic() < deadline:
            ok = s.put_from(fresh, _pages(b))
            if all(ok):
                break
            time.sleep(0.5)
        assert all(ok), "store did not recover after the master came back"
        out = HostBuffer(8, PAGE, 2)
        assert s.get_into(fresh, _pages(out)) == [True] * 8
        assert all(check_page(k, out.read(i)) == 0 for i, k in enumerate(fresh))
        assert s.stats().extra["healthy"] is True and s.stats().up is True
    finally:
        s.close()
        master.kill()


@pytest.mark.failure_injection
@pytest.mark.parametrize("call_mode", ["worker", "inline"])
def test_segment_holder_killed_reads_miss_in_time(mooncake_cluster, call_mode):  # noqa: F811
    """Pages live in another process's segment; kill -9 that process: reads of its pages
    return misses within op_timeout (never an exception, never a hang; inline: the
    refused connection fails the transfer, measured 1.0 s)."""
    holder = mooncake_cluster.start_holder("64mb")
    op_timeout = 2.0
    s = create_store("mooncake", store_options(mooncake_cluster, global_segment_size=0, op_timeout=op_timeout,
                                               reconnect_interval=0.3, call_mode=call_mode))
    try:
        keys = _keys(8, "remote")
        src = _filled(keys)
        s.register_memory(src.address, len(src.raw))
        _put_until_stored(s, keys, src)  # lands in the holder: we contribute nothing
        dst = HostBuffer(8, PAGE, 2)
        s.register_memory(dst.address, len(dst.raw))
        assert s.get_into(keys, _pages(dst)) == [True] * 8
        holder.kill()
        holder.wait(10)
        worst = 0.0
        for _ in range(4):
            dst.zero(0)
            t0 = time.monotonic()
            ok = s.get_into(keys, _pages(dst))
            worst = max(worst, time.monotonic() - t0)
            assert ok == [False] * 8
        assert worst <= op_timeout + 1.0, f"a read took {worst:.2f}s"
        assert s.exists(keys[:1]) in ([False], [True])  # answers (the master may not have noticed yet)
    finally:
        s.close()


def test_hung_peer_abandoned_staged_read_never_writes_caller_memory(mooncake_cluster):  # noqa: F811
    """SIGSTOP the process that holds the pages: a read hangs in Mooncake past op_timeout.
    The caller gets misses on time; later calls short-circuit; after SIGCONT the abandoned
    transfer finishes into its quarantined staging extent, never into the caller's buffer,
    and the store recovers."""
    holder = mooncake_cluster.start_holder("64mb")
    op_timeout = 1.5
    s = create_store("mooncake", store_options(mooncake_cluster, global_segment_size=0, io_mode="staged",
                                               op_timeout=op_timeout, reconnect_interval=0.3,
                                               call_mode="worker"))  # abandons the call at op_timeout
    try:
        keys = _keys(8, "hung")
        src = _filled(keys)
        _put_until_stored(s, keys, src)
        dst = HostBuffer(8, PAGE, 2)
        with _stopped(holder.pid):
            t0 = time.monotonic()
            ok = s.get_into(keys, _pages(dst))
            took = time.monotonic() - t0
            assert ok == [False] * 8
            assert took <= op_timeout + 1.0, f"read took {took:.2f}s"
            extra = s.stats().extra
            print("after hung read:", {k: extra[k] for k in ("abandoned_running", "staging_in_use", "timeouts")})
            # a stopped peer cannot answer: the transfer hangs inside Mooncake
            assert extra["abandoned_running"] == 1 and extra["timeouts"] >= 1
            assert extra["staging_in_use"] > 0, "the abandoned call's extent was released early"
            t0 = time.monotonic()
            assert s.get_into(keys[:1], [dst.page(0)]) == [False]
            assert time.monotonic() - t0 < 0.5, "a call while a hung call runs was not short-circuited"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (s.stats().extra["abandoned_running"] or
                                               s.stats().extra["staging_in_use"]):
            time.sleep(0.2)
        extra = s.stats().extra
        assert extra["abandoned_running"] == 0 and extra["staging_in_use"] == 0
        assert all(b == 0 for b in dst.raw), "a late transfer wrote into memory the caller got back as a miss"
        deadline = time.monotonic() + 30
        ok = [False]
        while time.monotonic() < deadline and not all(ok):
            ok = s.get_into(keys, _pages(dst))
            time.sleep(0.2)
        assert all(ok), "store did not recover after the peer resumed"
        assert all(check_page(k, dst.read(i)) == 0 for i, k in enumerate(keys))
    finally:
        s.close()
        if holder.poll() is None:
            holder.kill()


def test_inline_stopped_master_fails_get_and_put_at_the_rpc_timeout(mooncake_cluster, tmp_path):  # noqa: F811
    """call_mode=inline, op_timeout 5: SIGSTOP the master; a get (one store) and a put
    (another) each fail (misses / failed writes, no exception) when Mooncake's RPC timeout
    (op_timeout / 2, set by the store) expires: measured 2.5 s; RPC_TIMEOUT turns the store
    unhealthy, so its next call short-circuits. SIGCONT: the same stores write and read
    byte-exact."""
    op_timeout = 5.0
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                           log_path=tmp_path / "master-stop.log").start()
    opts = store_options(mooncake_cluster, master_server_address=master.address, op_timeout=op_timeout,
                         reconnect_interval=0.3, call_mode="inline")
    reader, writer = create_store("mooncake", opts), create_store("mooncake", opts)
    try:
        assert os.environ["MC_RPC_TIMEOUT_MS"] == "2500"
        keys, fresh = _keys(8, "mstop"), _keys(8, "mstop-put")
        src, src2 = _filled(keys), _filled(fresh)
        dst = HostBuffer(8, PAGE, 2)
        for st, b in ((writer, src), (writer, src2), (reader, dst)):
            st.register_memory(b.address, len(b.raw))
        assert writer.put_from(keys, _pages(src)) == [True] * 8
        with _stopped(master.proc.pid):
            for st, op in ((reader, "get"), (writer, "put")):
                t0 = time.monotonic()
                ok = st.get_into(keys, _pages(dst)) if op == "get" else st.put_from(fresh, _pages(src2))
                took = time.monotonic() - t0
                print(f"inline {op} with a stopped master: {took:.2f}s")
                assert ok == [False] * 8
                assert 1.0 < took <= op_timeout + 1.0, f"{op} took {took:.2f}s"
                t0 = time.monotonic()
                assert st.exists(keys[:1]) == [False]
                assert time.monotonic() - t0 < 0.2, "the next call was not short-circuited"
                extra = st.stats().extra
                assert extra["unavailable"] > 0 and extra["healthy"] is False and extra["abandoned"] == 0
            assert all(b == 0 for b in dst.raw)
        # new keys: the master may still run the failed put's queued request once resumed,
        # leaving those keys unfinished for a while (a miss, never other bytes: below)
        again = _keys(8, "mstop-again")
        src3 = _filled(again)
        writer.register_memory(src3.address, len(src3.raw))
        deadline = time.monotonic() + 30
        ok = [False]
        while time.monotonic() < deadline and not all(ok):
            time.sleep(0.3)
            ok = writer.put_from(again, _pages(src3))
        assert all(ok), "store did not recover after the master resumed"
        assert reader.get_into(keys, _pages(dst)) == [True] * 8
        assert all(dst.read(i) == src.read(i) for i in range(8))
        assert reader.get_into(again, _pages(dst)) == [True] * 8
        assert all(dst.read(i) == src3.read(i) for i in range(8))
        for i in range(8):
            dst.zero(i)
        hits = reader.get_into(fresh, _pages(dst))
        print("keys of the put that failed while the master was stopped, read after:", hits)
        assert all(dst.read(i) == (src2.read(i) if hit else bytes(len(src2.read(i)))) for i, hit in enumerate(hits))
    finally:
        reader.close()
        writer.close()
        master.kill()


def test_inline_stopped_holder_bounded_by_mooncake_and_never_writes_late(mooncake_cluster, tmp_path):  # noqa: F811
    """call_mode=inline, op_timeout 5, direct (zero-copy) pages: SIGSTOP the process that
    holds them. Mooncake drops a lane that makes no progress for MC_TCP_PROGRESS_TIMEOUT_SEC
    (1 s) and fails the transfers waiting behind it one lane-full at a time (~2 s per 4
    transfers): an 8-page get (16 transfers) fails after 7.0-7.5 s (measured), past
    op_timeout, which worker mode would bound; a put fails after 2-3.5 s. Both return
    misses / failed writes, no exception; the call has ended when it returns, so after
    SIGCONT nothing writes into the caller's buffer; then bytes read back exactly.
    Own master with client_ttl 60 s: the stall outlasts the default 10 s, after which the
    master would unmount the holder's segment and its pages would be gone."""
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=500,
                           log_path=tmp_path / "master-holder.log", extra_args=("--client_ttl=60",)).start()
    holder = mooncake_cluster.start_holder("64mb", master=master)
    op_timeout = 5.0
    s = create_store("mooncake", store_options(mooncake_cluster, global_segment_size=0, op_timeout=op_timeout,
                                               reconnect_interval=0.3, call_mode="inline",
                                               master_server_address=master.address))
    try:
        keys = _keys(8, "hstop")
        src = _filled(keys)
        s.register_memory(src.address, len(src.raw))
        _put_until_stored(s, keys, src)
        dst = HostBuffer(8, PAGE, 2)
        s.register_memory(dst.address, len(dst.raw))
        with _stopped(holder.pid):
            t0 = time.monotonic()
            ok = s.get_into(keys, _pages(dst))
            took_get = time.monotonic() - t0
            time.sleep(0.4)  # past reconnect_interval (a slow call turns the store unhealthy)
            fresh = _keys(8, "hstop-put")
            t0 = time.monotonic()
            put_ok = s.put_from(fresh, _pages(_filled(fresh)))
            took_put = time.monotonic() - t0
            print(f"inline with a stopped holder: get {took_get:.2f}s, put {took_put:.2f}s")
            assert ok == [False] * 8 and put_ok == [False] * 8
            assert took_get <= 10.0, f"get took {took_get:.2f}s"
            assert took_put <= op_timeout + 1.0, f"put took {took_put:.2f}s"
            assert s.stats().extra["abandoned_running"] == 0
        time.sleep(1.0)
        assert all(b == 0 for b in dst.raw), "bytes landed in a buffer the caller got back as misses"
        deadline = time.monotonic() + 30
        ok = [False]
        while time.monotonic() < deadline and not all(ok):
            time.sleep(0.3)
            ok = s.get_into(keys, _pages(dst))
        assert all(ok), f"store did not recover after the holder resumed: {ok}, {s.stats().extra}"
        assert all(dst.read(i) == src.read(i) for i in range(8))
        assert s.exists(fresh) == [False] * 8  # the failed put published nothing
    finally:
        s.close()
        if holder.poll() is None:
            holder.kill()
        master.kill()


def _worker(cluster, *args: str) -> subprocess.Popen:
    """``mooncake_worker.py`` (next to this file) as a process in the cluster's namespace."""
    return subprocess.Popen(cluster.exec_prefix() + [sys.executable, str(Path(__file__).with_name("mooncake_worker.py")),
                                                     *args, "--master", cluster.master.address],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=child_env(), text=True)


def _line(p: subprocess.Popen, prefix: str, timeout: float = 120) -> dict:
    box: dict = {}

    def read() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            if line.startswith(prefix):
                box["v"] = json.loads(line[len(prefix):])
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if "v" not in box:
        p.kill()
        raise AssertionError(f"worker gave no {prefix.strip()} line; stderr:\n{p.stderr.read()[-3000:]}")
    return box["v"]


def test_two_processes_sglang_host_pool_byte_exact(mooncake_cluster):  # noqa: F811
    pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
    writer = _worker(mooncake_cluster, "writer", "--pages", "24")
    try:
        w = _line(writer, "READY ")
        assert w["ok"] == [True] * 24
        assert w["stats"]["direct_pages"] > 0, "writer did not use the zero-copy path"
        reader = _worker(mooncake_cluster, "reader", "--keys", json.dumps(w["keys"]))
        r = _line(reader, "RESULT ")
        reader.wait(30)
        assert r["hits"] == 24
        assert r["ok"] == [True] * 24
        assert r["digests"] == w["digests"]
        assert len(set(w["digests"])) == 24
        assert r["stats"]["direct_pages"] > 0 and r["stats"]["staged_pages"] == 0
    finally:
        writer.stdin.close()  # type: ignore[union-attr]
        try:
            writer.wait(30)
        except subprocess.TimeoutExpired:
            writer.kill()


def test_one_batch_of_more_segments_than_mooncake_queues_per_peer(mooncake_cluster, tmp_path):  # noqa: F811
    """8192 segments in one put and one get, all crossing TCP to another process. Mooncake's
    TCP transport queues 1024 + 1024 transfers per peer by default and fails the rest at once
    (measured: most of such a batch came back TRANSFER_FAIL); kvconnect raises both limits
    before its engine starts (connectors/transfer_engine.py), so every page lands.
    Own master with Mooncake's default 10 s read lease: on a loaded 2-core machine one get of
    8192 segments outlasted the shared cluster's 0.5 s lease (LEASE_EXPIRED, the whole batch a
    miss), which is not what this test is about."""
    master = MasterProcess(None, rpc_port=free_port(), metrics_port=free_port(), lease_ttl_ms=10000,
                           log_path=tmp_path / "master-wide.log").start()
    mooncake_cluster.start_holder("160mb", master=master)
    s = create_store("mooncake", store_options(mooncake_cluster, global_segment_size=0,
                                               master_server_address=master.address, lease_ttl=10, lease_wait=20))
    try:
        n = 4096  # pages of 2 segments
        keys = _keys(n, "wide")
        src, dst = _filled(keys), HostBuffer(n, PAGE, 2)
        s.register_memory(src.address, len(src.raw))
        s.register_memory(dst.address, len(dst.raw))
        _put_until_stored(s, keys, src)
        assert s.stats().extra["staged_pages"] == 0, "the pages did not take the direct (zero-copy) path"
        assert s.get_into(keys, _pages(dst)) == [True] * n
        assert bytes(dst.raw) == bytes(src.raw)
    finally:
        s.close()
        master.kill()


def test_start_that_fails_after_setup_closes_the_client(mooncake_cluster, monkeypatch):  # noqa: F811
    """A start that fails after the client joined the cluster (here: the endpoint probe of
    local_copy raises) closes the real Mooncake client and its call threads before the error
    goes up; a store started next works."""
    from kvconnect.connectors.mooncake.local_replicas import LocalReplicas

    closed = []
    real_import = __import__("kvconnect.connectors.mooncake.store", fromlist=["_import_mooncake"])._import_mooncake

    def spying_import():
        client_class, replicate = real_import()

        class Spy(client_class):
            def close(self):
                closed.append(True)
                return super().close()
        return Spy, replicate

    def probe_fails(self, _replicate):
        self.session.call("probe", lambda: None)  # the call threads are running by now
        raise RuntimeError("endpoint probe failed")

    monkeypatch.setattr("kvconnect.connectors.mooncake.store._import_mooncake", spying_import)
    monkeypatch.setattr(LocalReplicas, "_find_own_endpoint", probe_fails)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="endpoint probe"):
        create_store("mooncake", store_options(mooncake_cluster, local_copy=True))
    assert closed == [True]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and {t.name for t in threading.enumerate()} - before:
        time.sleep(0.05)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("kvc-mooncake")} - before
    monkeypatch.undo()
    with create_store("mooncake", store_options(mooncake_cluster)) as s:
        keys = _keys(2)
        b = _filled(keys)
        _put_until_stored(s, keys, b)
        out = HostBuffer(2, PAGE, 2)
        assert s.get_into(keys, _pages(out)) == [True, True]
        assert [out.read(i) for i in range(2)] == [page_bytes(k) for k in keys]


# The outer run has one test: re-running this module inside its own namespace.
if not INNER:
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]
    test_in_loopback_namespace = pytest.mark.failure_injection(outer_test(__file__))  # runs the marked ones with -m
