"""Page identities beside a data file: what makes a stale index entry a miss.

A page index that fails over to an asynchronous replica (``redis_index.py``) can come
back behind: it may map key A to slot 7 while, before the failover, slot 7 was given to
key B and B's bytes were written there. Reading slot 7 for A must then be a miss. So every
slot has a 16-byte record in a sidecar file ``{data file}.ids``:
``<u64 hash of the key><u64 generation of the slot>``, all zeros while no page is complete.

* Write (a seqlock): zero the records of the batch's slots, write the pages, then write
  their records. A page whose write failed keeps a zero record.
* Read: read the records, read the pages, read the records again; a page is a hit only
  if both reads of its record equal the identity its index entry names (the key's hash and
  the generation the index gave the slot). A slot rewritten during the read changes its
  record (zeroed first), so a torn page is a miss too.

What it costs: 16 bytes per page of disk (a 1 TiB file of 512 KiB pages: 32 MiB), the
key's digest (``key_digest``: SGLang's hex keys are read, others hashed), and per run of
adjacent slots two 16-byte-per-page ``pwrite`` calls on a write and two ``pread`` calls on
a read (measured in ``benchmarks/hf3fs_ha.py``, figures in docs/hf3fs_ha.md).

What it does not cover: two writers of one slot at the same moment (only possible when two
primaries both hand it out, a split brain that ``WAIT`` / ``min-replicas-to-write`` rule
out): enable ``checksums`` to have every byte checked as well.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct

log = logging.getLogger("kvconnect.hf3fs")

REC = 16
_GEN = struct.Struct("<Q")
ZERO = bytes(REC)


def key_digest(key: bytes) -> bytes:
    """16 bytes that stand for ``key``: the first half of a SHA-256 key given as 64 hex
    characters (SGLang's page keys: already a hash, so read, not hashed again), else a
    16-byte BLAKE2b of the key."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key[:32].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            pass
    return hashlib.blake2b(key, digest_size=16).digest()


def key_digests(keys) -> bytes:
    """``key_digest`` of every key, back to back; one ``bytes.fromhex`` for a batch of hex keys."""
    if keys and set(map(len, keys)) == {64}:  # C loops: ~30 us less per 128 keys than a generator
        try:
            return bytes.fromhex(b"".join([k[:32] for k in keys]).decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            pass
    return b"".join([key_digest(k) for k in keys])


def ident(key: bytes, gen: int, digest: bytes | None = None) -> bytes:
    """The record a page of ``key`` written in a slot of generation ``gen`` carries (never zero)."""
    h = (digest or key_digest(key))[:8]
    if h == bytes(8):
        h = b"\x01" + h[1:]
    return h + _GEN.pack(gen & 0xFFFFFFFFFFFFFFFF)


def idents(keys, gens) -> list[bytes]:
    """``ident`` of each (key, generation), the keys' digests taken in one pass and the
    records laid out by numpy in one buffer (half the time of one ``ident`` per key: about
    40 of the ~100 us the check costs a 128-page batch, measured in benchmarks/hf3fs_verify.py)."""
    n = len(keys)
    d = key_digests(keys)
    try:
        import numpy as np

        rec = np.empty((n, REC), np.uint8)
        rec[:, :8] = np.frombuffer(d, np.uint8).reshape(n, 16)[:, :8]
        rec[:, 8:] = np.array(gens, np.uint64).astype("<u8").view(np.uint8).reshape(n, 8)
    except (ImportError, OverflowError, ValueError, TypeError):  # a generation outside u64: one at a time
        return [ident(k, g, d[16 * i:16 * i + 16]) for i, (k, g) in enumerate(zip(keys, gens))]
    zero = ~rec[:, :8].any(axis=1)
    if zero.any():
        rec[zero, 0] = 1  # as ident: never an all-zero record
    blob = rec.tobytes()
    return [blob[i:i + REC] for i in range(0, REC * n, REC)]


def _runs(slots: list[int]) -> list[tuple[int, list[int]]]:
    """(first slot, [item index, ...]) per run of adjacent slots, in slot order."""
    n = len(slots)
    if n and slots[-1] - slots[0] == n - 1 and slots == list(range(slots[0], slots[0] + n)):
        return [(slots[0], list(range(n)))]  # the common case (the free list hands out runs): one C compare
    order = sorted(range(len(slots)), key=slots.__getitem__)
    runs: list[tuple[int, list[int]]] = []
    prev = None
    for i in order:
        s = slots[i]
        if prev is not None and s == prev + 1:
            runs[-1][1].append(i)
        elif prev is None or s != prev:  # the same slot twice: read once per run anyway
            runs.append((s, [i]))
        else:
            runs[-1][1].append(i)
        prev = s
    return runs


class PageIds:
    """The ``.ids`` sidecar of one data file (lane): 16 bytes per slot, grown, never shrunk.

    ``mapped`` (local file systems, where the data file is read through a mapping too): the
    file's blocks are allocated up front (so a store into the mapping cannot meet a full
    disk: no SIGBUS) and records are read and written in a shared mapping, no system call;
    the I/O workers that read the records around their pages then never wait to take the GIL
    back after one. Elsewhere (3FS, network file systems): ``pread`` / ``pwrite``."""

    def __init__(self, path: str, num_pages: int, mapped: bool = False):
        from kvconnect.connectors.hf3fs.files import open_data_file

        self.path = path
        self.fd = open_data_file(path, num_pages * REC)
        self._map = None
        if mapped and num_pages > 0:
            import mmap

            try:
                os.posix_fallocate(self.fd, 0, num_pages * REC)
            except OSError as e:  # no fallocate here (or no room): system calls, no mapping
                log.info("hf3fs: %s not preallocated (%s): records by pread/pwrite", path, e)
            else:
                self._map = mmap.mmap(self.fd, num_pages * REC, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def _put(self, off: int, blob: bytes) -> None:
        if self._map is not None and off + len(blob) <= len(self._map):
            self._map[off:off + len(blob)] = blob
        else:
            os.pwrite(self.fd, blob, off)

    def _get(self, off: int, n: int) -> bytes:
        if self._map is not None:
            return self._map[off:off + n]
        return os.pread(self.fd, n, off)

    def _write(self, slots: list[int], recs: list[bytes]) -> None:
        for first, idx in _runs(slots):
            if len(idx) > 1 and slots[idx[-1]] - first + 1 != len(idx):  # repeated slots: one by one
                for i in idx:
                    self._put(slots[i] * REC, recs[i])
                continue
            self._put(first * REC, b"".join([recs[i] for i in idx]))

    def clear(self, slots: list[int]) -> None:
        """Mark slots as being written (before their pages are)."""
        self._write(slots, [ZERO] * len(slots))

    def publish(self, slots: list[int], recs: list[bytes]) -> None:
        """Name the pages now complete in ``slots`` (after they were written)."""
        self._write(slots, recs)

    def _records(self, runs, slots: list[int]) -> list[bytes]:
        """One blob per run: the records of its slots, first to last."""
        return [self._get(first * REC, (max(map(slots.__getitem__, idx)) - first + 1) * REC) for first, idx in runs]

    def read(self, slots: list[int]) -> list[bytes]:
        """The record of each slot (``ZERO`` where the file is shorter)."""
        out = [ZERO] * len(slots)
        runs = _runs(slots)
        for (first, idx), blob in zip(runs, self._records(runs, slots)):
            for i in idx:
                rec = blob[(slots[i] - first) * REC:(slots[i] - first + 1) * REC]
                if len(rec) == REC:
                    out[i] = rec
        return out

    def checked_read(self, slots: list[int], want: list[bytes], read) -> list:
        """``read()`` (per item: read in full or not) between two reads of the slots'
        records. Per item: ``read``'s answer where the record was ``want[i]`` both times,
        else None (another page, or the slot rewritten during the read)."""
        runs = _runs(slots)
        before = self._records(runs, slots)
        ok: list = list(read())
        after = self._records(runs, slots)
        for (first, idx), b, a in zip(runs, before, after):
            if b == a and len(b) == len(idx) * REC and b == b"".join([want[i] for i in idx]):
                continue  # the whole run as expected (the common case): one comparison
            for i in idx:
                o = (slots[i] - first) * REC
                if not (b[o:o + REC] == a[o:o + REC] == want[i]) and ok[i]:
                    ok[i] = None
        return ok

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self._map is not None:
            self._map.flush()
            self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
