"""The HF3FS page index and its journal: recovery reproduces the state, torn tails are cut."""

from __future__ import annotations

import random

from connectors.hf3fs.index import CONFIRMED, EXISTS, INFLIGHT, NEW, NOSPACE, PageIndex
from connectors.hf3fs.wal import Journal, read_records

NS = "0:kv"


def state_of(ix: PageIndex) -> dict:
    sp = ix.spaces[NS]
    return {"index": dict(sp.index), "pending": {k: v[:2] for k, v in sp.pending.items()},
            "confirmed": sorted(s for s in range(sp.num_pages) if sp.state[s] == CONFIRMED),
            "gens": list(sp.gen), "crc": list(sp.crc)}


def random_ops(ix: PageIndex, rng: random.Random, n: int) -> None:
    keys = [f"k{i}".encode() for i in range(60)]
    for _ in range(n):
        r = rng.random()
        batch = rng.sample(keys, 5)
        if r < 0.6:
            st, sl, gn = ix.reserve(NS, batch)
            new = [i for i, s in enumerate(st) if s == NEW]
            confirm = bytes(1 if rng.random() < 0.8 else 0 for _ in new)
            if rng.random() < 0.9:  # sometimes the writer "dies" and never confirms
                ix.commit(NS, [batch[i] for i in new], [sl[i] for i in new], [gn[i] for i in new],
                          [rng.getrandbits(32) for _ in new], confirm)
        elif r < 0.8:
            ix.get(NS, batch)
        elif r < 0.97:
            ix.delete(NS, batch)
        else:
            ix.clear(NS)


def test_recovery_reproduces_state_from_snapshot_and_journal(tmp_path):
    rng = random.Random(5)
    j = Journal(tmp_path, fsync="never", snapshot_interval_s=1e9)
    ix = PageIndex(read_lease_s=0.0, journal=j)
    j.open(ix)
    ix.initialize(NS, 24, 4096)  # small: constant eviction
    random_ops(ix, rng, 300)
    j.snapshot()
    random_ops(ix, rng, 300)
    want = state_of(ix)
    assert ix.spaces[NS].evictions > 0
    j.close()

    j2 = Journal(tmp_path, fsync="never")
    ix2 = PageIndex(read_lease_s=0.0, journal=j2)
    rec = j2.open(ix2)
    assert rec["snapshot"] > 0 and rec["records"] > 0
    got = state_of(ix2)
    assert got["index"] == want["index"]
    assert got["pending"] == want["pending"]
    assert got["confirmed"] == want["confirmed"]
    assert got["gens"] == want["gens"] and got["crc"] == want["crc"]
    # the recovered index keeps working and never double-assigns a page
    random_ops(ix2, rng, 200)
    slots = list(ix2.spaces[NS].index.values()) + [v[0] for v in ix2.spaces[NS].pending.values()]
    assert len(slots) == len(set(slots))
    j2.close()


def test_torn_tail_is_cut_and_the_rest_replayed(tmp_path):
    j = Journal(tmp_path, fsync="never", snapshot_interval_s=1e9)
    ix = PageIndex(journal=j)
    j.open(ix)
    ix.initialize(NS, 8, 4096)
    st, sl, gn = ix.reserve(NS, [b"a", b"b"])
    ix.commit(NS, [b"a", b"b"], sl, gn, [1, 2], b"\x01\x01")
    seg = j.dir / f"wal.{j.seq:08d}.log"
    j.close()
    good = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x12\x34")  # a record header cut short by a crash
    records, valid, torn = read_records(seg)
    assert torn and valid == good and [r[0] for r in records] == ["init", "reserve", "confirm"]

    ix2 = PageIndex()
    j2 = Journal(tmp_path, fsync="never")
    j2.open(ix2)
    assert seg.stat().st_size == good
    assert ix2.exists(NS, [b"a", b"b", b"c"]) == b"\x01\x01\x00"
    assert ix2.get(NS, [b"b"])[2] == [2]
    j2.close()


def test_pending_reservation_survives_restart_and_can_be_confirmed(tmp_path):
    j = Journal(tmp_path, fsync="never")
    ix = PageIndex(journal=j)
    j.open(ix)
    ix.initialize(NS, 4, 4096)
    st, sl, gn = ix.reserve(NS, [b"x"])
    j.close()  # the service dies between the writer's reserve and its confirm
    ix2 = PageIndex()
    j2 = Journal(tmp_path, fsync="never")
    j2.open(ix2)
    assert ix2.reserve(NS, [b"x"])[0] == bytes([INFLIGHT])  # still reserved: no second page
    assert ix2.commit(NS, [b"x"], sl, gn, [0], b"\x01") == b"\x01"
    assert ix2.reserve(NS, [b"x"])[0] == bytes([EXISTS])
    j2.close()


def test_full_index_with_leased_pages_reports_no_space():
    clock = [0.0]
    ix = PageIndex(read_lease_s=5.0, clock=lambda: clock[0])
    ix.initialize(NS, 2, 4096)
    st, sl, gn = ix.reserve(NS, [b"a", b"b"])
    ix.commit(NS, [b"a", b"b"], sl, gn, [0, 0], b"\x01\x01")
    ix.get(NS, [b"a", b"b"])  # readers hold both pages
    assert ix.reserve(NS, [b"c"])[0] == bytes([NOSPACE])
    clock[0] = 6.0  # leases ran out: LRU eviction of "a" (touched first)
    st, sl2, _ = ix.reserve(NS, [b"c"])
    assert st == bytes([NEW]) and sl2 == [sl[0]]
    assert ix.exists(NS, [b"a", b"b"]) == b"\x00\x01"
