"""The HF3FS page index and its journal: recovery reproduces the state, torn tails are cut."""

from __future__ import annotations

import random

from kvconnect.connectors.hf3fs.index import (CONFIRMED, EXISTS, FREE, INFLIGHT, NEW, NOSPACE, PUT_DUP, PUT_LOST, PUT_OK,
                                    PageIndex)
from kvconnect.connectors.hf3fs.wal import Journal, read_records

NS = "0:kv"


def state_of(ix: PageIndex) -> dict:
    sp = ix.spaces[NS]
    return {"index": dict(sp.index), "pending": {k: v[:2] for k, v in sp.pending.items()}, "leased": dict(sp.leased),
            "confirmed": sorted(s for s in range(sp.num_pages) if sp.state[s] == CONFIRMED),
            "gens": list(sp.gen), "crc": list(sp.crc)}


def random_ops(ix: PageIndex, rng: random.Random, n: int, held: list | None = None) -> int:
    """Random writers (reserve/commit and lease/put), readers, deletes and clears. ``held``:
    (slot, gen) leased and not yet put, carried across calls (and restarts). Returns the
    number of keys stored by put."""
    keys = [f"k{i}".encode() for i in range(60)]
    held = [] if held is None else held
    stored = 0
    for _ in range(n):
        r = rng.random()
        batch = rng.sample(keys, 5)
        if r < 0.15:
            sl, gn = ix.lease(NS, 3, rng.randrange(3))
            held.extend(zip(sl, gn))
        elif r < 0.3 and held:
            rng.shuffle(held)
            use, held[:] = held[:3], held[3:]
            if rng.random() < 0.2:
                ix.unlease(NS, [s for s, _ in use], [g for _, g in use])
                continue
            st = ix.put(NS, batch[:len(use)], [s for s, _ in use], [g for _, g in use],
                        [rng.getrandbits(32) for _ in use])
            held.extend(u for u, x in zip(use, st) if x == PUT_DUP)  # still the writer's
            stored += st.count(PUT_OK)
        elif r < 0.6:
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
    return stored


def test_recovery_reproduces_state_from_snapshot_and_journal(tmp_path):
    rng = random.Random(5)
    j = Journal(tmp_path, fsync="never", snapshot_interval_s=1e9)
    clock = [0.0]
    ix = PageIndex(read_lease_s=0.0, journal=j, clock=lambda: clock[0])
    j.open(ix)
    ix.initialize(NS, 24, 4096)  # small: constant eviction
    held: list = []
    stored = random_ops(ix, rng, 300, held)
    j.snapshot()
    stored += random_ops(ix, rng, 300, held)
    clock[0] += 100  # dead writers' reservations and leases expire (journaled releases)
    ix.delete(NS, list(ix.spaces[NS].index)[:10])
    held[:] = zip(*ix.lease(NS, 2))  # a writer holds a lease across the restart
    want = state_of(ix)
    assert stored > 0
    assert ix.spaces[NS].evictions > 0
    j.close()

    j2 = Journal(tmp_path, fsync="never")
    ix2 = PageIndex(read_lease_s=0.0, journal=j2)
    rec = j2.open(ix2)
    assert rec["snapshot"] > 0 and rec["records"] > 0
    got = state_of(ix2)
    assert got["index"] == want["index"]
    assert got["pending"] == want["pending"]
    assert got["leased"] == want["leased"] and len(want["leased"]) > 0
    assert got["confirmed"] == want["confirmed"]
    assert got["gens"] == want["gens"] and got["crc"] == want["crc"]
    # the recovered index keeps working and never double-assigns a page
    random_ops(ix2, rng, 200, held)  # writers alive across the restart keep their leases
    sp = ix2.spaces[NS]
    slots = list(sp.index.values()) + [v[0] for v in sp.pending.values()] + list(sp.leased)
    assert len(slots) == len(set(slots))
    assert sp.evictions > 0 and any(k for k in sp.index)
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


# ---------------------------------------------------------------------------------
# Write leases: lease slots ahead, put keys onto them in one call
# ---------------------------------------------------------------------------------


def test_lease_put_round_trip_dup_retry_and_foreign_slot():
    ix = PageIndex()
    ix.initialize(NS, 16, 4096)
    sl, gn = ix.lease(NS, 3)
    assert len(sl) == 3 and len(set(sl)) == 3 and ix.usage(NS)["leased"] == 3
    assert ix.validate(NS, sl, gn) == b"\x00" * 3  # leased pages are nobody's data yet
    assert ix.put(NS, [b"a", b"b"], sl[:2], gn[:2], [7, 8]) == bytes([PUT_OK, PUT_OK])
    assert ix.get(NS, [b"a", b"b"]) == (sl[:2], gn[:2], [7, 8])
    assert ix.put(NS, [b"a"], sl[:1], gn[:1], [7]) == bytes([PUT_OK])  # a retried call
    # a stored key: DUP, and the slot stays the writer's (put it under another key later)
    assert ix.put(NS, [b"a"], sl[2:], gn[2:], [9]) == bytes([PUT_DUP])
    assert ix.get(NS, [b"a"])[0] == sl[:1] and ix.usage(NS)["leased"] == 1
    assert ix.put(NS, [b"c"], [sl[2]], [gn[2] + 1], [0]) == bytes([PUT_LOST])  # wrong generation
    assert ix.put(NS, [b"d"], [sl[0]], [gn[0]], [0]) == bytes([PUT_LOST])  # a slot that is not leased
    assert ix.put(NS, [b"c", b"e"], [sl[2], sl[2]], gn[2:] * 2, [0, 0]) == bytes([PUT_OK, PUT_LOST])
    assert ix.exists(NS, [b"c", b"d", b"e"]) == b"\x01\x00\x00"
    assert ix.usage(NS)["leased"] == 0 and ix.usage(NS)["keys"] == 3


def test_two_writers_of_one_key_with_leases_get_one_page():
    ix = PageIndex()
    ix.initialize(NS, 8, 4096)
    s1, g1 = ix.lease(NS, 1)
    s2, g2 = ix.lease(NS, 1)
    assert s1 != s2
    # both wrote their page for key "k"; the first put wins, the second keeps its slot
    assert ix.put(NS, [b"k"], s1, g1, [1]) == bytes([PUT_OK])
    assert ix.put(NS, [b"k"], s2, g2, [2]) == bytes([PUT_DUP])
    assert ix.get(NS, [b"k"]) == (s1, g1, [1])
    # a key reserved (in flight) by a writer on the Reserve path is not taken either
    st, rs, rg = ix.reserve(NS, [b"r"])
    assert st == bytes([NEW]) and ix.put(NS, [b"r"], s2, g2, [0]) == bytes([PUT_DUP])
    assert ix.commit(NS, [b"r"], rs, rg, [0], b"\x01") == b"\x01"
    # the loser gives its slot back: no page leaked, none assigned twice
    assert ix.unlease(NS, s2, g2) == b"\x01" and ix.unlease(NS, s2, g2) == b"\x00"
    u = ix.usage(NS)
    assert u["keys"] == 2 and u["leased"] == 0 and u["reserved"] == 0 and u["free"] == 6
    assert ix.spaces[NS].state[s2[0]] == FREE


def test_expired_lease_returns_its_slots_and_a_late_put_is_refused():
    clock = [0.0]
    ix = PageIndex(write_lease_s=1.0, clock=lambda: clock[0])
    ix.initialize(NS, 2, 4096)
    sl, gn = ix.lease(NS, 2)
    assert ix.lease(NS, 1) == ([], [])  # nothing free: a lease never evicts
    clock[0] = 5.0  # the writer died holding both
    s2, g2 = ix.lease(NS, 2)
    assert sorted(s2) == sorted(sl) and min(g2) > max(gn)  # back, under new generations
    assert ix.usage(NS)["expired"] == 2
    assert ix.put(NS, [b"late"], sl[:1], gn[:1], [0]) == bytes([PUT_LOST])
    assert ix.exists(NS, [b"late"]) == b"\x00"
    assert ix.put(NS, [b"new"], s2[:1], g2[:1], [0]) == bytes([PUT_OK])


def test_lease_takes_only_free_slots_and_at_most_a_sixteenth_ahead():
    ix = PageIndex(read_lease_s=0.0)
    ix.initialize(NS, 64, 4096)
    sl, _ = ix.lease(NS, 2, 1000)
    assert len(sl) == 2 + 64 // 16
    st, rs, rg = ix.reserve(NS, [b"k%d" % i for i in range(64 - len(sl))])
    ix.commit(NS, [b"k%d" % i for i in range(len(rs))], rs, rg, [0] * len(rs), b"\x01" * len(rs))
    assert ix.lease(NS, 1, 8) == ([], [])  # full: no key is evicted for a lease
    assert ix.usage(NS)["keys"] == 64 - len(sl) and ix.spaces[NS].evictions == 0
    assert ix.reserve(NS, [b"x"])[0] == bytes([NEW]) and ix.spaces[NS].evictions == 1  # Reserve evicts


def test_leases_survive_restart_and_keep_their_slots(tmp_path):
    j = Journal(tmp_path, fsync="never")
    ix = PageIndex(journal=j)
    j.open(ix)
    ix.initialize(NS, 8, 4096)
    a, ga = ix.lease(NS, 2)
    j.snapshot()  # one lease in the snapshot, one only in the journal
    b, gb = ix.lease(NS, 2)
    assert ix.put(NS, [b"x"], a[:1], ga[:1], [3]) == bytes([PUT_OK])
    j.close()  # kill: the writer holding a[1:] and b lives on
    ix2 = PageIndex()
    j2 = Journal(tmp_path, fsync="never")
    j2.open(ix2)
    assert ix2.get(NS, [b"x"]) == (a[:1], ga[:1], [3])
    assert sorted(ix2.spaces[NS].leased) == sorted(a[1:] + b)
    fresh, _ = ix2.lease(NS, 8)
    assert not set(fresh) & set(a + b)  # never handed to another writer
    assert ix2.put(NS, [b"y", b"z"], [a[1], b[0]], [ga[1], gb[0]], [0, 0]) == bytes([PUT_OK, PUT_OK])
    j2.close()
