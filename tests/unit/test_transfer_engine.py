"""The Transfer Engine's ground floor: registered-region lookups and staging memory."""

from __future__ import annotations

import threading
import time

from kvconnect.connectors.transfer_engine import (EngineClient, Pending, RegisteredRegions, StagingMemory,
                                                  apply_engine_defaults)


def test_regions_answer_which_pages_lie_in_registered_memory():
    r = RegisteredRegions()
    assert not r and not r.covers(100, 1)
    r.add(1000, 100)
    r.add(0, 10)
    assert r.covers(1000, 100) and r.covers(1050, 50) and not r.covers(1050, 51) and r.covers(0, 10)
    assert r.covers_page([(0, 4), (1010, 10)]) and not r.covers_page([(0, 4), (20, 1)])
    assert r.nbytes == 110 and sorted(r.clear()) == [0, 1000] and not r


def test_one_arena_extents_merge_and_waits_are_bounded():
    registered = []
    sb = StagingMemory(1 << 20, register=lambda a, n: registered.append((a, n)))
    sb.prepare()
    assert len(registered) == 1 and registered[0][1] == 1 << 20
    base = registered[0][0]
    a = sb.acquire(300 << 10, time.monotonic() + 1)
    b = sb.acquire(300 << 10, time.monotonic() + 1)
    c = sb.acquire(300 << 10, time.monotonic() + 1)
    assert None not in (a, b, c) and len({a, b, c}) == 3 and a == base
    t0 = time.monotonic()
    assert sb.acquire(300 << 10, time.monotonic() + 0.2) is None  # full: bounded wait
    assert 0.15 < time.monotonic() - t0 < 2
    threading.Timer(0.1, sb.release, args=(b,)).start()
    d = sb.acquire(300 << 10, time.monotonic() + 2)  # woken by the release
    assert d == b
    release = sb.releaser(d)
    release(None)
    release(None)  # a second call (an abandoned call's completion) does nothing
    for addr in (a, c):
        sb.release(addr)
    assert sb.in_use == 0
    assert sb.acquire(1 << 20, time.monotonic() + 0.1) == base  # free extents merged back into one
    assert sb.acquire(2 << 20, time.monotonic() + 0.1) is None  # larger than the buffer
    assert len(registered) == 1
    sb.close()


def test_chunks_are_made_when_needed_and_a_retired_one_is_replaced():
    registered = []
    chunk = 1 << 20
    sb = StagingMemory(2 * chunk, register=lambda a, n: registered.append(a), arena_bytes=chunk)
    assert registered == []  # nothing made before it is needed
    x = sb.acquire(chunk, time.monotonic())
    y = sb.acquire(chunk, time.monotonic())
    assert len(registered) == 2 and {x, y} == set(registered)
    assert sb.acquire(chunk, time.monotonic()) is None  # 0 s: no wait
    sb.retire(x)  # a late transfer may still land in it: never handed out again
    z = sb.acquire(chunk, time.monotonic())
    assert z is not None and z not in (x, y) and len(registered) == 3 and sb.retired == 1
    sb.release(y)
    assert sb.acquire(chunk, time.monotonic()) == y
    assert sb.addresses == registered
    sb.close()


def test_engine_defaults_keep_a_users_own_values(monkeypatch):
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "7")
    monkeypatch.delenv("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", raising=False)
    apply_engine_defaults()
    import os

    assert os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "7"
    assert os.environ["MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"] == "65535"


def test_wait_polls_each_transfer_once_finished_never_again_and_times_out():
    """EngineClient.wait against a scripted engine: a finished batch id is freed by the engine,
    so polling it again would be a use-after-free; a transfer still pending at the timeout
    is given up (-2) and polled later only to free it."""
    class Engine:
        def __init__(self, script):
            self.script = {b: list(s) for b, s in script.items()}
            self.freed = set()

        def transfer_check_status(self, bid):
            assert bid not in self.freed, f"batch {bid} polled after the engine freed it"
            seq = self.script[bid]
            st = seq.pop(0) if len(seq) > 1 else seq[0]
            if st in (1, -1):
                self.freed.add(bid)
            return st

    t = object.__new__(EngineClient)
    t.timeout, t._orphans = 0.3, []
    t._olock = threading.Lock()

    def pending(ids):
        p = Pending(time.monotonic())
        p.ids = list(ids)
        p.spans = [(1000 * b, 10 * b) for b in ids]
        return p

    landed = []
    t.engine = Engine({1: [0, 0, 1], 2: [0, 1], 3: [1]})
    assert t.wait(pending([1, 2, 3]), lambda a, n: landed.append((a, n))) == 0
    assert landed == [(1000, 10), (2000, 20), (3000, 30)]
    assert t.engine.freed == {1, 2, 3}

    landed.clear()
    t.engine = Engine({1: [0, -1], 2: [0, 0, 0, 1]})
    assert t.wait(pending([1, 2]), lambda a, n: landed.append((a, n))) == -1
    assert landed == [(2000, 20)] and t.engine.freed == {1, 2}  # the failure waited for the rest

    landed.clear()
    t.engine = Engine({1: [1], 2: [0], 3: [0]})  # 2 and 3 never finish
    t0 = time.monotonic()
    assert t.wait(pending([1, 2, 3]), lambda a, n: landed.append((a, n))) == -2
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 0.1
    assert landed == [(1000, 10)] and t._orphans == [2, 3]
    t.engine.script[2] = [1]  # a late completion: the next wait frees it
    assert t.wait(pending([])) == 0
    assert t._orphans == [3] and 2 in t.engine.freed

    p = pending([])
    p.failed = True  # nothing could be started
    assert not p and t.wait(p) == -1
