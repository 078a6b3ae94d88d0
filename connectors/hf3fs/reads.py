"""The hf3fs store's reads: a lane's pages looked up in the index (one call, which leases
their slots against reuse), read on the store's workers, and accepted only while they still
belong to their keys: read within the read lease, or confirmed by a ``validate`` call;
with ``checksums`` the CRC32 must match, with ``verify_pages`` the page's identity record.
"""

from __future__ import annotations

import logging
import time

from kvconnect.connectors.base import Page
from kvconnect.connectors.hf3fs.client import MetadataError
from kvconnect.connectors.hf3fs.lanes import LEASE_TRUST, Lane
from kvconnect.connectors.hf3fs.pageid import idents as page_idents

log = logging.getLogger("kvconnect.hf3fs")


class Reader:
    """The store's read protocol, and what its checks rejected."""

    def __init__(self, store):  # the HF3FSStore this is part of
        self.store = store
        self.config = store.config
        self.validations = 0  # reads that outlived their lease and asked the index
        self.rejected_reads = 0  # pages whose slot was reused meanwhile
        self.stale_reads = 0  # pages whose identity record did not match the index (verify_pages)

    def read(self, lane: Lane, keys: list[str], pages: list[Page]) -> list[bool]:
        """One lane's pages: looked up (leased), read, and accepted only if still theirs."""
        store = self.store
        out = [False] * len(keys)
        kb = store._encode(keys)
        t0 = time.monotonic()
        try:
            slots, gens, crcs = store.meta.get(lane.ns, kb)
        except MetadataError as e:
            store._note_error("get", e)
            store._miss("unavailable", len(keys))
            return out
        hits = [j for j, s in enumerate(slots) if s >= 0]
        if not hits:
            return out
        ids = ([None] * len(hits) if lane.ids is None else
               page_idents([kb[j] for j in hits], [gens[j] for j in hits]))
        ok = store.io.read(lane, [(slots[j], pages[j], crcs[j], ids[h]) for h, j in enumerate(hits)],
                          self.config.checksums)
        stale = [h for h, o in enumerate(ok) if o is None]
        if stale:
            # The index named a slot that holds another page: a stale entry (a failover to a
            # replica that was behind). Drop it, so the key can be written again.
            self.stale_reads += len(stale)
            log.warning("hf3fs: %d page(s) of %s failed their identity check: stale index entries, dropped",
                        len(stale), lane.ns)
            try:
                store.meta.forget(lane.ns, [kb[hits[h]] for h in stale], [slots[hits[h]] for h in stale],
                                 [gens[hits[h]] for h in stale])
            except MetadataError as e:
                store._note_error("forget", e)
        if time.monotonic() - t0 > lane.read_lease_s * LEASE_TRUST:
            # The read outlived its lease: the slot may have been reused meanwhile. Ask.
            idx = [h for h, o in enumerate(ok) if o]
            if idx:
                self.validations += 1
                try:
                    still = store.meta.validate_keys(lane.ns, [kb[hits[h]] for h in idx], [slots[hits[h]] for h in idx],
                                                    [gens[hits[h]] for h in idx])
                except MetadataError as e:
                    store._note_error("validate", e)
                    still = bytes(len(idx))
                for h, v in zip(idx, still):
                    if not v:
                        ok[h] = False
                        self.rejected_reads += 1
        for h, j in enumerate(hits):
            out[j] = bool(ok[h])
        # the index named these pages but their bytes failed the checksum, identity or lease check
        store._miss("corrupt", sum(1 for o in ok if not o))
        return out
