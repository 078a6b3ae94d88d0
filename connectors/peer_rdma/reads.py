"""Reads: a node's own pages are a local copy (seqlock-checked); others are located on
their directory owners (one batched ``DirGet`` per owner, recent answers cached) and read
one-sidedly, one batch per holder, through registered staging chunks (validated, then
copied out) or, with ``direct_reads``, straight into registered caller pages; a holder on
this host that lends from shared memory (``shared_segment``) is copied from directly. A page counts
as read only when the xxh3-64 of the bytes received equals the published checksum: an
evicted, reused, rewritten or torn slot is a miss, never wrong bytes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from kvconnect.connectors.base import Page, page_nbytes
from kvconnect.connectors.buffers import scatter, scatter_many
from kvconnect.connectors.peer_rdma.directory import CSUM, HOLDER, HOLDER_GONE, LEN, OFF, RESIDENT, live_holder
from kvconnect.connectors.peer_rdma.membership import Member
from kvconnect.connectors.peer_rdma.rpc import RpcError
from kvconnect.connectors.peer_rdma.segment import (HASH_CHUNK, Slot, checksum_at, checksum_pages,
                                                    copy_checksum_pages)


class Reader:
    """The node's reads, and the locations it learned (``location_cache_ttl``)."""

    # Same-host copies: True copies a page 1 MiB at a time and hashes each step while it is in
    # cache (one pass over memory); False copies every page, then hashes every page (two passes).
    # 1 GiB on a 16-core H100 node, one pass over two alternating (l3_floor_peer_chunks_8k.json,
    # ``kvconnect bench l3_floor --tokens 8192 --peer-chunks 64k,256k,1m,4m``): 1 MiB steps 1.20x
    # (23.7 against 19.8 GiB/s), 4 MiB 1.11x, 256 KiB 0.73x (0.63x in an earlier run, which made
    # two passes the default until then), 64 KiB 0.22x. The benchmark still times both. A page's
    # checksum does not depend on the step (a streaming xxh3-64 of its bytes in order).
    fused_same_host = True
    fused_chunk_bytes = HASH_CHUNK  # 1 << 20: bytes copied then hashed per step of the one pass

    def __init__(self, node):  # the PeerNode this is part of
        self.node = node
        self._loc_cache: OrderedDict[str, tuple[list, float]] = OrderedDict()
        self._lclock = threading.Lock()

    def forget(self, prefix_or_keys: str | list[str]) -> None:
        """Drop cached locations: of these keys, or of every key starting with a prefix."""
        with self._lclock:
            keys = prefix_or_keys if isinstance(prefix_or_keys, list) else \
                [k for k in self._loc_cache if k.startswith(prefix_or_keys)]
            for k in keys:
                self._loc_cache.pop(k, None)

    def locate(self, keys: list[str], deadline: float, use_cache: bool = True,
                ask_replicas: bool = False, gone: set[int] | None = None) -> list[list | None]:
        """Directory entries of ``keys`` (None: not found), asking owners then replicas;
        ``gone`` (if given) gets the indices whose only entries named holders that left.

        A key the primary owner does not know is asked of the next owner when the view
        changed recently (entries may still be moving) or ``ask_replicas`` (reads: the
        caller believes the page exists, so a second round trip for it is worth it).
        """
        view = self.node.view
        out: list[list | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if use_cache and self.node.config.location_cache_ttl > 0:
            now = time.monotonic()
            rest = []
            with self._lclock:
                for i in todo:
                    hit = self._loc_cache.pop(keys[i], None)
                    if hit is not None and hit[1] > now and live_holder(hit[0], view) is not None:
                        out[i] = hit[0]
                    else:
                        rest.append(i)
            todo = rest
        n = 1 + self.node.config.directory_replicas
        owner_lists = {i: self.node.dir_owners(keys[i], view) for i in todo}
        recent = ask_replicas or \
            time.monotonic() - view.changed_at < 3 * self.node.config.heartbeat_interval + self.node.config.member_ttl
        for rank in range(n):
            if not todo:
                break
            per: dict[str, list[int]] = {}
            for i in todo:
                ol = owner_lists[i]
                if rank < len(ol):
                    per.setdefault(ol[rank], []).append(i)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            timeout = min(self.node.config.rpc_timeout, remaining)
            remote = {t: [keys[i] for i in idx] for t, idx in per.items() if t != self.node.node_id}
            answers: dict[str, Any] = self.node.clients.fan_out(remote, "DirGet", timeout) if remote else {}
            if self.node.node_id in per:
                answers[self.node.node_id] = self.node.directory.get([keys[i] for i in per[self.node.node_id]])
            nxt = []
            for t, idx in per.items():
                ans = answers.get(t)
                if isinstance(ans, RpcError) or ans is None:
                    self.node.count(rpc_failures=1)
                    nxt.extend(idx)  # owner unreachable: ask the next replica
                    continue
                for i, e in zip(idx, ans):
                    if isinstance(e, list) and live_holder(e, view) is not None:
                        out[i] = e
                        continue
                    if gone is not None and (e == HOLDER_GONE or isinstance(e, list)):
                        gone.add(i)  # stored once, its holder left (here or at the owner)
                    if recent:
                        nxt.append(i)  # entries may still be moving after a view change
            todo = nxt
        if gone:  # a live entry found at another owner wins
            gone.difference_update(i for i, e in enumerate(out) if e is not None)
        return out

    def cache_locations(self, keys: list[str], entries: list) -> None:
        ttl = self.node.config.location_cache_ttl
        if ttl <= 0:
            return
        until = time.monotonic() + ttl
        with self._lclock:
            for k, e in zip(keys, entries):
                if e is not None and e[HOLDER] != self.node.node_id:
                    self._loc_cache[k] = (e, until)
            while len(self._loc_cache) > 65536:
                self._loc_cache.popitem(last=False)

    def exists(self, keys: list[str]) -> list[bool]:
        t0 = time.perf_counter()
        out = [self.node.segment.lookup(k, touch=False) is not None for k in keys]
        if self.node.disk is not None:
            out = [o or self.node.disk.contains(k) is not None for o, k in zip(out, keys)]
        todo = [i for i, o in enumerate(out) if not o]
        if todo:
            deadline = time.monotonic() + self.node.config.timeout
            sub = [keys[i] for i in todo]
            found = self.locate(sub, deadline, use_cache=False)
            # an entry naming this node for a page it no longer holds is stale
            found = [None if e is not None and e[HOLDER] == self.node.node_id else e for e in found]
            self.cache_locations(sub, found)
            for i, e in zip(todo, found):
                out[i] = e is not None
        self.node.count(exists_requests=len(keys), exists_hits=sum(out))
        self.node.timed("exists", t0)
        return out

    def get_into(self, keys: list[str], pages: list[Page], why: dict[int, str] | None = None) -> list[bool]:
        """``why`` (if given) gets the miss cause of keys that did not read (``MISS_CAUSES``);
        a key absent from it was not found."""
        why = {} if why is None else why
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.node.config.timeout
        out = [False] * len(keys)
        sizes = [page_nbytes(p) for p in pages]
        remote: list[int] = []
        promoted = []
        disk_hits = 0
        local: list[tuple[int, Slot]] = []
        for i, (k, slot) in enumerate(zip(keys, self.node.segment.lookup_many(keys))):
            if slot is None and self.node.disk is not None and self.node.disk.contains(k) is not None:
                slot = self.node.holder.promote_from_disk(k)
                if slot is not None:
                    promoted.append((k, slot))
                    disk_hits += 1
            if slot is None:
                remote.append(i)
            elif slot.length == sizes[i]:
                local.append((i, slot))
            else:
                why[i] = "mismatch"
        got = self.node.segment.read_many([keys[i] for i, _ in local], [pages[i] for i, _ in local],
                                     [s for _, s in local])
        for (i, _), ok in zip(local, got):
            out[i] = ok
        local_hits = sum(got)
        if promoted:  # resident again: owners point readers back at memory
            self.node.announcer.publish(promoted)
            self.node.announcer.flush()
        if remote:
            self._get_remote(keys, pages, sizes, remote, out, deadline, why)
        hits = sum(out)
        nbytes = sum(s for s, o in zip(sizes, out) if o)
        self.node.count(read_requests=len(keys), read_hits=hits, read_local_hits=local_hits,
                   read_disk_hits=disk_hits, read_remote_hits=hits - local_hits,
                   read_misses=len(keys) - hits, bytes_read=nbytes)
        self.node.timed("get", t0)
        return out

    def _get_remote(self, keys, pages, sizes, idx: list[int], out: list[bool], deadline: float,
                    why: dict[int, str], retry: bool = True) -> None:
        gone: set[int] = set()
        entries = self.locate([keys[i] for i in idx], deadline, ask_replicas=True, gone=gone)
        for j in gone:  # lost with a holder that left, not never stored
            why[idx[j]] = "unavailable"
        view = self.node.view
        by_holder: dict[str, list[tuple[int, list]]] = {}
        promote: dict[str, list[int]] = {}
        for i, e in zip(idx, entries):
            if e is not None and e[LEN] != sizes[i]:
                why[i] = "mismatch"
            if e is None or e[LEN] != sizes[i] or e[HOLDER] == self.node.node_id:
                continue
            why[i] = "unavailable"  # until a read says otherwise: holder gone, promote or transfer failed
            if not e[RESIDENT]:
                promote.setdefault(e[HOLDER], []).append(i)
                continue
            by_holder.setdefault(e[HOLDER], []).append((i, e))
        if promote:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                answers = self.node.clients.fan_out({h: [keys[i] for i in ii] for h, ii in promote.items()},
                                               "Promote", min(self.node.config.rpc_timeout * 2, remaining))
                for h, ii in promote.items():
                    ans = answers.get(h)
                    if isinstance(ans, RpcError) or ans is None:
                        continue
                    for i, e in zip(ii, ans):
                        if e is not None and e[LEN] == sizes[i]:
                            by_holder.setdefault(h, []).append((i, e))
        jobs = []
        for holder, items in by_holder.items():
            member = view.members.get(holder)
            if member is None:
                continue
            if len(by_holder) == 1:
                self._read_from(member, items, pages, out, why)
            else:
                jobs.append(self.node.io.submit(self._read_from, member, items, pages, out, why))
        for j in jobs:
            j.result()
        if retry and self.node.config.location_cache_ttl > 0:
            # a location cached by exists() may have gone stale: look those up afresh once
            again = [i for i, e in zip(idx, entries) if e is not None and not out[i]]
            if again and deadline - time.monotonic() > self.node.config.rpc_timeout + self.node.config.transfer_timeout:
                with self._lclock:
                    for i in again:
                        self._loc_cache.pop(keys[i], None)
                self._get_remote(keys, pages, sizes, again, out, deadline, why, retry=False)

    def _read_from(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool],
                   why: dict[int, str]) -> None:
        """One holder's pages: one-sided reads, then checksum validation per page.

        By default the engine reads into registered staging chunks and a page is copied into
        the caller's memory only after it validated. A transfer that failed or timed out may
        still land later (a blackholed peer's data arrives after the engine gave up): its
        chunk is retired, so late bytes can never reach memory the caller reuses.
        ``direct_reads`` reads straight into registered caller pages instead (zero-copy,
        without that guarantee).
        """
        same_host = self.node.same_host
        if same_host is not None and same_host.present():
            items = self._read_same_host(same_host, member, items, pages, out, why)
            if not items:
                return
        if self.node.config.direct_reads:
            reg = self.node.transport.page_registered
            direct = [it for it in items if reg(pages[it[0]])]
            if direct:
                self._read_direct(member, direct, pages, out, why)
            items = [it for it in items if not reg(pages[it[0]])]
            if not items:
                return
            self.node.count(bounce_reads=len(items))
        self._read_staged(member, items, pages, out, why)

    def _read_same_host(self, same_host, member: Member, items: list[tuple[int, list]], pages, out: list[bool],
                        why: dict[int, str]) -> list[tuple[int, list]]:
        """Copies the pages of a holder whose shared segment this process mapped straight into
        the caller's pages (copy threads), hashing each chunk of a page right after it landed;
        a page whose bytes do not hash to its published checksum (a slot evicted, reused or
        rewritten during the copy) is a miss. Returns the items it could not copy (not in a
        published segment: the Transfer Engine moves them)."""
        near, rest, srcs = [], [], []
        for it in items:
            src = same_host.source(member.te_name, member.seg_base + it[1][OFF], it[1][LEN])
            if src is None:
                rest.append(it)
            else:
                near.append(it)
                srcs.append(src)
        if not near:
            return rest
        dst = [pages[i] for i, _ in near]
        if self.fused_same_host:
            sums = copy_checksum_pages(srcs, dst, self.fused_chunk_bytes)
        else:
            scatter_many(srcs, dst)
            sums = checksum_pages(dst)
        self._check(near, sums, out, why)
        self.node.count(shared_reads=len(near))
        return rest

    def _validate(self, items: list[tuple[int, list]], pages, out: list[bool], why: dict[int, str]) -> None:
        """Checks pages copied straight into caller memory against their published checksums."""
        self._check(items, checksum_pages([pages[i] for i, _ in items]), out, why)

    def _check(self, items: list[tuple[int, list]], sums: list[int], out: list[bool], why: dict[int, str]) -> None:
        """Each page is read only if the digest of its bytes in caller memory is its published
        checksum: one that does not match is a miss ("corrupt", counted in ``read_stale``)."""
        stale = 0
        for (i, e), got in zip(items, sums):
            ok = got == e[CSUM]
            out[i] = ok
            if not ok:
                stale += 1
                why[i] = "corrupt"
        if stale:
            self.node.count(read_stale=stale)

    def _read_staged(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool],
                     why: dict[int, str]) -> None:
        staging = self.node.staging
        self.node.count(staged_reads=len(items))
        cap = staging.arena_bytes
        groups: list[list[tuple[tuple[int, list], int]]] = []
        used = cap
        for item in items:
            n = item[1][LEN]
            if n > cap:
                continue  # larger than a staging chunk: a miss
            if used + n > cap:
                groups.append([])
                used = 0
            groups[-1].append((item, used))
            used += n
        base = member.seg_base
        deadline = time.monotonic() + self.node.config.transfer_timeout
        g = 0
        while g < len(groups):
            # start as many chunks as we can borrow (all of them when the pool is idle) ...
            wave = []
            while g < len(groups):
                addr = staging.acquire(cap, time.monotonic() if wave else deadline)
                if addr is None:
                    break
                grp = groups[g]
                g += 1
                local = [addr + o for _, o in grp]
                remote = [base + e[OFF] for (_, e), _ in grp]
                lengths = [e[LEN] for (_, e), _ in grp]
                try:
                    bid = self.node.transport.read_async(member.te_name, local, remote, lengths)
                except Exception:  # noqa: BLE001 - a data-plane error is a miss
                    bid = 0
                wave.append((grp, addr, bid, time.monotonic()))
            if not wave:
                for grp in groups[g:]:
                    why.update({i: "deadline" for (i, _), _ in grp})
                return  # no staging memory within the deadline: misses
            # ... then validate and copy out each page as soon as its transfer landed, while the
            # engine moves the next ones (only the last page's validation is not overlapped)
            for grp, addr, bid, t0 in wave:
                stale = [0]
                landed = self._stage_out(grp, addr, pages, out, stale, why)
                rc = self.node.transport.wait(bid, landed, deadline) if bid else -1
                if rc != 0:
                    staging.retire(addr)
                    timed_out = time.monotonic() - t0 >= self.node.config.transfer_timeout * 0.9
                    self.node.count(**{"read_timeouts" if timed_out else "read_failures": 1})
                    if timed_out:
                        why.update({i: "deadline" for (i, _), _ in grp if not out[i]})
                else:
                    staging.release(addr)
                if stale[0]:
                    self.node.count(read_stale=stale[0])

    @staticmethod
    def _stage_out(grp, addr: int, pages, out: list[bool], stale: list[int], why: dict[int, str]):
        """``landed`` callback of a staging chunk: the pages a completed transfer covers (one
        transfer = whole pages back to back) are checksummed, and copied out only if valid."""
        at = {addr + o: k for k, (_, o) in enumerate(grp)}

        def landed(lo: int, n: int) -> None:
            k, end = at[lo], lo + n
            while k < len(grp) and addr + grp[k][1] < end:
                (i, e), o = grp[k]
                if checksum_at(addr + o, e[LEN]) == e[CSUM]:
                    scatter(addr + o, pages[i])
                    out[i] = True
                else:
                    stale[0] += 1
                    why[i] = "corrupt"
                k += 1

        return landed

    PIPELINE_CHUNK = 64 << 20  # direct reads: bytes per async chunk (validation overlaps the next ones)

    def _read_direct(self, member: Member, items: list[tuple[int, list]], pages, out: list[bool],
                     why: dict[int, str]) -> None:
        """Reads straight into registered caller pages. A large batch is split into chunks that
        are all started at once; each chunk is validated as soon as it landed, while the
        engine moves the next ones (checksumming overlaps the transfer)."""
        chunks: list[list[tuple[int, list]]] = [[]]
        size = 0
        for item in items:
            if size >= self.PIPELINE_CHUNK:
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += item[1][LEN]
        base = member.seg_base

        def lists(chunk):
            local, remote, lengths = [], [], []
            for i, e in chunk:
                off = base + e[OFF]
                for a, n in pages[i]:
                    local.append(a)
                    remote.append(off)
                    lengths.append(n)
                    off += n
            return local, remote, lengths

        if len(chunks) == 1:
            if self.node.transfer(member, *lists(chunks[0])):
                self._validate(chunks[0], pages, out, why)
            return
        t0 = time.monotonic()
        ids = []
        for chunk in chunks:
            try:
                ids.append(self.node.transport.read_async(member.te_name, *lists(chunk)))
            except Exception:  # noqa: BLE001 - a data-plane error is a miss
                ids.append(0)
        for chunk, bid in zip(chunks, ids):  # wait for every chunk: nothing lands after we return
            rc = self.node.transport.wait(bid) if bid else -1
            if rc == 0:
                self._validate(chunk, pages, out, why)
            elif time.monotonic() - t0 >= self.node.config.transfer_timeout * 0.9:
                self.node.count(read_timeouts=1)
                why.update({i: "deadline" for i, _ in chunk})
            else:
                self.node.count(read_failures=1)

