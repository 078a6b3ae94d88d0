"""Pages moved through Mooncake by the two memory paths of the store (see
``kvconnect.connectors.mooncake.store``): *direct* between registered caller memory and the
cluster, *staged* through extents of the store's own registered staging buffer; and where
a put places its replicas (``replica_num``, ``prefer_local_segment``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvconnect.connectors.base import Page, page_nbytes
from kvconnect.connectors.buffers import gather_into, scatter
from kvconnect.connectors.mooncake import errors as mc_errors
from kvconnect.connectors.transfer_engine import RegisteredRegions, StagingMemory

log = logging.getLogger("kvconnect.mooncake")


class Transfers:
    """Registered caller memory, the staging buffer, and gets/puts through either."""

    def __init__(self, store, replicate_config: type):  # the MooncakeStore this is part of
        self.store = store
        self.config = c = store.config
        self.session = store.session
        self.replicate = replicate_config()
        self.replicate.replica_num = c.replica_num
        self.regions = RegisteredRegions()  # registered caller memory
        self.staging = StagingMemory(c.staging_size, register=lambda addr, n: self.session.check_rc(
            "register staging buffer", self.session.client.register_buffer(addr, n)))

    def start(self) -> None:
        """Once the session is set up: the segment to prefer, the staging buffer."""
        if self.config.prefer_local_segment:  # the segment name is known only once set up
            self.replicate.preferred_segment = self.session.client.get_hostname()
        self.staging.prepare()

    def register(self, address: int, nbytes: int) -> None:
        if self.regions.covers(address, nbytes):
            return
        self.session.check_rc("register_buffer", self.session.client.register_buffer(address, nbytes))
        self.regions.add(address, nbytes)

    def get(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._by_path(keys, pages, self._get_direct, self._get_staged)

    def put(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self._by_path(keys, pages, self._put_direct, self._put_staged)

    def _split(self, pages: list[Page]) -> tuple[list[int] | None, list[int]]:
        """(pages for the direct path, pages for the staged path); None: all direct."""
        regions = self.regions
        if self.config.io_mode == "staged" or not regions:
            return [], list(range(len(pages)))
        spans = regions.spans
        if len(spans) == 1:  # the usual case (one host pool): no search
            lo, hi = spans[0]
            if all(lo <= a and a + n <= hi for p in pages for a, n in p):
                return None, []
        direct, staged = [], []
        for i, p in enumerate(pages):
            (direct if regions.covers_page(p) else staged).append(i)
        return (None if not staged else direct), staged

    def _by_path(self, keys: list[str], pages: list[Page], direct_op: Callable, staged_op: Callable) -> list[bool]:
        """One result per key: the pages ``_split`` finds registered go through ``direct_op``
        (all of them when it says None), the others through ``staged_op``."""
        out = [False] * len(keys)
        direct, staged = self._split(pages)
        if direct is None or direct:
            direct_op(keys, pages, direct, out)
        if staged:
            staged_op(keys, pages, staged, out)
        return out

    # -- direct ---------------------------------------------------------------------------
    def _direct_args(self, keys: list[str], pages: list[Page],
                     idx: list[int] | None) -> tuple[list[str], list[list[int]], list[list[int]], list[int]]:
        """Keys, per-page segment addresses and sizes of the pages at ``idx`` (None: all),
        and the indices themselves."""
        if idx is None:
            ks, ps, idx = keys, pages, list(range(len(pages)))
        else:
            ks, ps = [keys[i] for i in idx], [pages[i] for i in idx]
        self.store.figures.add(direct_pages=len(idx))
        return ks, [[a for a, _ in p] for p in ps], [[n for _, n in p] for p in ps], idx

    def _get_direct(self, keys: list[str], pages: list[Page], idx: list[int] | None, out: list[bool]) -> None:
        ks, ptrs, sizes, idx = self._direct_args(keys, pages, idx)
        client = self.session.client
        res = self.session.call("batch_get_into_multi_buffers", client.batch_get_into_multi_buffers,
                                ks, ptrs, sizes)
        if res is None or len(res) != len(idx):
            return
        self.session.note_codes(res)
        for j, i in enumerate(idx):
            # bytes read must be the whole page: a shorter object is a size mismatch (a miss)
            out[i] = res[j] == sum(sizes[j])

    def _put_direct(self, keys: list[str], pages: list[Page], idx: list[int] | None, out: list[bool]) -> None:
        ks, ptrs, sizes, idx = self._direct_args(keys, pages, idx)
        client = self.session.client

        def remove_poisoned(res: list[int] | None) -> None:
            # An abandoned put may have read caller memory after the caller reused it:
            # what it published cannot be trusted.
            written = [k for k, rc in zip(ks, res or []) if rc == 0]
            if written:
                try:
                    client.batch_remove(written, True)
                    self.store.figures.add(poisoned_removed=len(written))
                except Exception as e:  # noqa: BLE001
                    log.error("mooncake: cannot remove %d keys of an abandoned put: %s", len(written), e)

        res = self.session.call("batch_put_from_multi_buffers", client.batch_put_from_multi_buffers,
                                ks, ptrs, sizes, self.replicate, on_abandoned_done=remove_poisoned)
        self._put_results(res, idx, out)

    def _put_results(self, res: list[int] | None, idx: list[int], out: list[bool]) -> None:
        if res is None or len(res) != len(idx):
            return
        self.session.note_codes(res)
        for j, i in enumerate(idx):
            # 0: written; OBJECT_ALREADY_EXISTS: stored before, bytes kept (idempotent put)
            out[i] = res[j] == 0 or mc_errors.outcome(res[j]) is mc_errors.Outcome.EXISTS

    # -- staged ---------------------------------------------------------------------------
    def _staged_chunks(self, pages: list[Page], idx: list[int]) -> list[list[int]]:
        """Batches whose pages fit in half the staging buffer (others can stage meanwhile)."""
        limit = max(self.staging.nbytes // 2, 1)
        chunks: list[list[int]] = [[]]
        size = 0
        for i in idx:
            n = page_nbytes(pages[i])
            if chunks[-1] and size + n > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += n
        return chunks

    def _get_staged(self, keys: list[str], pages: list[Page], idx: list[int], out: list[bool]) -> None:
        self.store.figures.add(staged_pages=len(idx))
        client = self.session.client
        for chunk in self._staged_chunks(pages, idx):
            sizes = [page_nbytes(pages[i]) for i in chunk]
            total = sum(sizes)
            base = self.staging.acquire(total, time.monotonic() + self.config.op_timeout)
            if base is None:
                continue  # staging exhausted for the whole deadline: misses
            release = self.staging.releaser(base)

            ptrs, pos = [], base
            for n in sizes:
                ptrs.append(pos)
                pos += n
            res = self.session.call("batch_get_into", client.batch_get_into, [keys[i] for i in chunk],
                                    ptrs, sizes, on_abandoned_done=release)
            if res is not None and len(res) == len(chunk):
                self.session.note_codes(res)
                for j, i in enumerate(chunk):
                    if res[j] == sizes[j]:
                        scatter(ptrs[j], pages[i])
                        out[i] = True
                release(None)
            elif res is not None:
                release(None)
            # res None: released by call() (failed/cancelled) or when the abandoned call ends

    def _put_staged(self, keys: list[str], pages: list[Page], idx: list[int], out: list[bool]) -> None:
        self.store.figures.add(staged_pages=len(idx))
        client = self.session.client
        for chunk in self._staged_chunks(pages, idx):
            sizes = [page_nbytes(pages[i]) for i in chunk]
            base = self.staging.acquire(sum(sizes), time.monotonic() + self.config.op_timeout)
            if base is None:
                continue
            release = self.staging.releaser(base)

            ptrs, pos = [], base
            for i, n in zip(chunk, sizes):
                gather_into(pages[i], pos)
                ptrs.append(pos)
                pos += n
            res = self.session.call("batch_put_from", client.batch_put_from, [keys[i] for i in chunk],
                                    ptrs, sizes, self.replicate, on_abandoned_done=release)
            if res is not None:
                release(None)
            self._put_results(res, chunk, out)

    def release_all(self) -> list[int]:
        """Forget the registered regions; the start addresses of every registered buffer
        (caller memory and staging) for the client to unregister."""
        return self.regions.clear() + self.staging.addresses
