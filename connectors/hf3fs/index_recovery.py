"""Recovery of the HF3FS page index from its journal (``kvconnect.connectors.hf3fs.wal``):
records applied in journal order before the index serves, then the state made safe for
readers and writers that lived across the restart.
"""

from __future__ import annotations

from array import array

from kvconnect.connectors.hf3fs.slots import CONFIRMED, FREE, RESERVED, Namespace


def replay(ix, kind: str, ns: str, fields: dict, now: float) -> None:
    """``ix``: the PageIndex. Apply one journal record (no journaling; called before serving)."""
    if kind == "init":
        if ns not in ix.spaces:
            ix.spaces[ns] = Namespace(ns, fields["num_pages"], fields["page_bytes"])
        return
    sp = ix.spaces.get(ns)
    if sp is None:
        return
    if kind == "reserve":
        deadline = now + ix.write_lease_s
        st, gen, pending = sp.state, sp.gen, sp.pending
        # Evictions and expiries before this record were journaled (delete / release);
        # a pending entry left on a slot reused here is dropped in finish_recovery.
        le = sp.lease_end
        for k, s, g in zip(fields["keys"], fields["slots"], fields["gens"]):
            gen[s] = g
            st[s] = RESERVED
            le[s] = deadline
            pending[k] = (s, g)
        if fields["slots"]:
            top = max(fields["slots"]) + 1
            if top > sp.fresh_next:
                sp.fresh_next = top
    elif kind == "confirm":
        st, crc, index, pending = sp.state, sp.crc, sp.index, sp.pending
        pop = pending.pop
        for k, s, g, c in zip(fields["keys"], fields["slots"], fields["gens"], fields["crcs"]):
            p = pop(k, None)
            if p != (s, g):
                if p is not None:
                    pending[k] = p
                continue
            st[s] = CONFIRMED
            crc[s] = c
            index[k] = s
    elif kind == "release":
        for k, s, g in zip(fields["keys"], fields["slots"], fields["gens"]):
            p = sp.pending.get(k)
            if p is not None and p[0] == s and p[1] == g:
                del sp.pending[k]
                sp.state[s] = FREE
    elif kind == "lease":
        st, gen, leased, crc = sp.state, sp.gen, sp.leased, sp.crc
        for s, g in zip(fields["slots"], fields["gens"]):
            crc[s] = 0
            gen[s] = g
            st[s] = RESERVED
            leased[s] = g
        if fields["slots"]:
            sp.fresh_next = max(sp.fresh_next, max(fields["slots"]) + 1)
    elif kind == "unlease":
        for s, g in zip(fields["slots"], fields["gens"]):
            if sp.leased.get(s) == g:
                del sp.leased[s]
                sp.state[s] = FREE
    elif kind == "put":
        st, crc, index, leased = sp.state, sp.crc, sp.index, sp.leased
        for k, s, g, c in zip(fields["keys"], fields["slots"], fields["gens"], fields["crcs"]):
            if leased.get(s) == g:
                del leased[s]
                st[s] = CONFIRMED
                crc[s] = c
                index[k] = s
    elif kind == "delete":
        for k in fields["keys"]:
            s = sp.index.pop(k, None)
            if s is not None:
                sp.state[s] = FREE
    elif kind == "clear":
        for s in sp.index.values():
            sp.state[s] = FREE
        sp.index.clear()
    else:
        raise ValueError(f"unknown journal record {kind!r}")

def finish(ix, now: float) -> None:
    """After loading: rebuild free lists and lease every used slot for one read lease.

    Readers that got a slot from the previous incarnation may still be reading it; no
    slot that ever held data is reused before their lease would have run out.
    """
    until = now + ix.read_lease_s
    for sp in ix.spaces.values():
        st, gen = sp.state, sp.gen
        sp.gen_top = max(sp.gen_top, max(gen, default=0))
        sp.pending = {k: v for k, v in sp.pending.items() if st[v[0]] == RESERVED and gen[v[0]] == v[1]}
        sp.leased = {s: g for s, g in sp.leased.items() if st[s] == RESERVED and gen[s] == g}
        owned = {v[0] for v in sp.pending.values()}.union(sp.leased)
        s = st.find(RESERVED)
        while 0 <= s:  # a reserved slot nobody owns any more is free
            if s not in owned:
                st[s] = FREE
            s = st.find(RESERVED, s + 1)
        sp.rebuild_free()
        used = sp.fresh_next
        sp.read_until = array("d", [until]) * used + array("d", bytes(8 * (sp.num_pages - used)))
        # a writer alive across the restart may still be writing its reserved or leased slots
        for s, _ in sp.pending.values():
            sp.lease_end[s] = now + ix.write_lease_s
        for s in sp.leased:
            sp.lease_end[s] = now + ix.write_lease_s
