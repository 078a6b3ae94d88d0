"""The hf3fs store's writes: slots reserved for a lane's batch (one index call), the pages
written on the store's workers within the write lease, then committed (one call): a key
becomes visible only after its bytes landed.
"""

from __future__ import annotations

import time

from kvconnect.connectors.base import Page
from kvconnect.connectors.hf3fs.client import MetadataError
from kvconnect.connectors.hf3fs.index import EXISTS, INFLIGHT, NEW
from kvconnect.connectors.hf3fs.lanes import LEASE_TRUST, Lane
from kvconnect.connectors.hf3fs.pageid import idents as page_idents


class Writer:
    """The store's write protocol."""

    def __init__(self, store):  # the HF3FSStore this is part of
        self.store = store
        self.config = store.config

    def write(self, lane: Lane, keys: list[str], pages: list[Page]) -> list[bool]:
        """One lane's pages: slots reserved, pages written, then committed (visible)."""
        store = self.store
        out = [False] * len(keys)
        kb = store._encode(keys)
        t0 = time.monotonic()
        try:
            status, slots, gens = store.meta.reserve(lane.ns, kb)
        except MetadataError as e:
            store._note_error("reserve", e)
            return out
        new = []
        for j, st in enumerate(status):
            if st == NEW:
                new.append(j)
            elif st == EXISTS or st == INFLIGHT:
                out[j] = True  # stored, or being stored right now by another writer of these bytes
        if not new:
            return out
        deadline = t0 + lane.write_lease_s * LEASE_TRUST
        if store.stripes > 1:
            new.sort(key=lambda j: slots[j] % store.stripes)  # a worker's chunk mostly in one file
        ids = ([None] * len(new) if lane.ids is None else
               page_idents([kb[j] for j in new], [gens[j] for j in new]))
        res = store.io.write(lane, [(slots[j], pages[j], ids[h]) for h, j in enumerate(new)], deadline,
                            self.config.checksums)
        if self.config.fsync_data and any(o for o, _ in res):
            try:
                lane.file.sync()
                if lane.ids is not None:
                    lane.ids.sync()
            except OSError as e:
                store._note_error("fsync", e)
                res = [(False, c) for _, c in res]
        try:
            done = store.meta.commit(lane.ns, [kb[j] for j in new], [slots[j] for j in new], [gens[j] for j in new],
                                    [c for _, c in res], bytes(1 if o else 0 for o, _ in res))
        except MetadataError as e:
            store._note_error("confirm", e)  # the reservations expire; the pages stay invisible
            return out
        for h, j in enumerate(new):
            out[j] = bool(res[h][0] and done[h])
        return out
