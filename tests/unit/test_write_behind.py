"""``WriteBehind`` on its own, over the in-process memory store: staged bytes, shedding, and a close
that races submits from several threads (no page answered True is lost, no copy outlives the buffer)."""

from __future__ import annotations

import ctypes
import threading

import pytest

from kvconnect.connectors.engines.write_behind import WriteBehind
from kvconnect.connectors.registry import create_store

PAGE = 4096


def _buffer(n: int, seed: int):
    buf = ctypes.create_string_buffer(bytes((seed + i) % 251 for i in range(n * PAGE)), n * PAGE)
    return buf, [[(ctypes.addressof(buf) + i * PAGE, PAGE)] for i in range(n)]


def _read(store, keys):
    out = ctypes.create_string_buffer(len(keys) * PAGE)
    ok = store.get_into(keys, [[(ctypes.addressof(out) + i * PAGE, PAGE)] for i in range(len(keys))])
    raw = out.raw                                        # one copy: .raw copies the whole buffer
    return ok, [raw[i * PAGE:(i + 1) * PAGE] for i in range(len(keys))]


def test_pages_of_two_segments_are_stored_whole_and_a_wrong_size_is_refused():
    store = create_store("memory", {"capacity": "1mb"})
    wb = WriteBehind(store, 8 * PAGE, PAGE)
    buf, pages = _buffer(2, 3)
    base = ctypes.addressof(buf)
    split = [[(base, 1000), (base + 1000, PAGE - 1000)], [(base + PAGE, PAGE)]]
    assert wb.submit(["a", "b"], split) == [True, True]
    assert wb.submit(["c"], [[(base, PAGE - 1)]]) == [False]
    assert wb.flush(10)
    ok, got = _read(store, ["a", "b", "c"])
    assert ok == [True, True, False] and got[:2] == [buf.raw[:PAGE], buf.raw[PAGE:]]
    assert wb.stats() == {"staged": 2, "written": 2, "failed": 0, "shed": 1, "slots": 8, "pending": 0}
    wb.close()
    assert wb.submit(["d"], pages[:1]) == [False]   # closed: refused, never copied


def test_close_racing_submits_keeps_every_page_it_accepted():
    import time

    store = create_store("memory", {"capacity": "256mb"})
    wb = WriteBehind(store, 16 * PAGE, PAGE)
    accepted: dict[str, bytes] = {}
    lock = threading.Lock()
    done = threading.Event()

    def writer(t: int) -> None:
        buf, pages = _buffer(4, t)
        r = taken = 0
        stop = time.monotonic() + 60
        # bounded by pages accepted, not by rounds: a buffer that sheds most submits must still
        # take the 64 pages the close waits for
        while not done.is_set() and taken < 1000 and time.monotonic() < stop:
            keys = [f"t{t}-r{r}-{i}" for i in range(4)]
            ok = wb.submit(keys, pages)
            raw = buf.raw
            with lock:
                accepted.update({k: raw[i * PAGE:(i + 1) * PAGE] for i, (k, o) in enumerate(zip(keys, ok)) if o})
            taken += sum(ok)
            if not any(ok):
                time.sleep(0.0005)                        # full: let the write-back thread drain it
            r += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    end = time.monotonic() + 30
    while time.monotonic() < end:                     # close once some pages were taken,
        with lock:
            if len(accepted) >= 64:
                break
        time.sleep(0.001)
    wb.close(30)                                      # while the writers still submit
    done.set()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    s = wb.stats()
    assert s["pending"] == 0 and s["failed"] == 0
    assert s["written"] == s["staged"] == len(accepted) >= 64
    ok, got = _read(store, list(accepted))
    assert all(ok) and got == list(accepted.values())


def test_a_budget_smaller_than_a_page_is_an_error():
    with pytest.raises(ValueError, match="hold no"):
        WriteBehind(create_store("memory", {}), PAGE - 1, PAGE)
