"""Durability of the page index: an append-only journal plus periodic snapshots.

Files in the data directory:

* ``wal.NNNNNNNN.log``: journal segments. Each record is ``<u32 length><u32 crc32>`` then
  the payload (kind, namespace, arrays, newline-joined keys). Records are appended with one
  ``write()`` while the index lock is held, before the RPC that caused them is answered.
* ``snapshot.NNNNNNNN``: the whole index as it was when segment ``NNNNNNNN`` was opened
  (written to a temporary file, fsynced, renamed). Older segments and snapshots are removed
  once a newer snapshot is on disk.
* ``meta.lock``: held (``flock``) by the one journal open on the dir, so a second service on
  it refuses to start; ``index.id``: the index's identity, created at the first start
  (``ownership.py``: data files are stamped with it).

Recovery loads the newest valid snapshot and replays the segments from its number on; a
torn record at the end of the last segment (a crash mid-append) is cut off.

fsync policy (``--fsync``):

* ``interval`` (default): a background thread fdatasyncs the journal every
  ``fsync_interval_s`` (50 ms). A confirmed key survives ``kill -9`` of the service
  always (the record is in the kernel before the reply); a power loss or kernel crash can
  lose the last interval.
* ``always``: group commit: an RPC is answered only after an fdatasync covering its
  records (concurrent RPCs share one fdatasync).
* ``never``: no fsync (tests, tmpfs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path

from kvconnect.connectors.hf3fs.index import Namespace, PageIndex
from kvconnect.connectors.hf3fs.ownership import data_dir_identity, lock_data_dir, unlock

log = logging.getLogger(__name__)

_REC = struct.Struct("<II")  # payload length, crc32(payload)
_HEAD = struct.Struct("<BHI")  # kind, namespace length, item count
KINDS = {"init": 1, "reserve": 2, "confirm": 3, "release": 4, "delete": 5, "clear": 6, "lease": 7, "unlease": 8,
         "put": 9}
_SLOTS = ("reserve", "confirm", "release", "lease", "unlease", "put")  # kinds with slot and generation arrays
_CRCS = ("confirm", "put")
_KEYLESS = ("lease", "unlease")
KIND_NAMES = {v: k for k, v in KINDS.items()}
SNAP_MAGIC = b"KVCSNAP1"
FSYNC_POLICIES = ("interval", "always", "never")


def _encode(kind: str, ns: str, f: dict) -> bytes:
    nsb = ns.encode()
    if kind == "init":
        body = struct.pack("<qq", f["num_pages"], f["page_bytes"])
        n = 0
    elif kind == "clear":
        body, n = b"", 0
    elif f.get("wire") is not None:
        # the caller holds this record's arrays and keys already laid out as below (a Put
        # request's body): no re-encoding
        body, n = f["wire"], len(f["keys"])
    else:
        n = len(f["slots"]) if kind in _KEYLESS else len(f["keys"])
        parts = []
        if kind in _SLOTS:
            parts.append(array("q", f["slots"]).tobytes())
            parts.append(array("q", f["gens"]).tobytes())
        if kind in _CRCS:
            parts.append(array("I", f["crcs"]).tobytes())
        if kind not in _KEYLESS:
            parts.append(b"\n".join(f["keys"]))
        body = b"".join(parts)
    payload = _HEAD.pack(KINDS[kind], len(nsb), n) + nsb + body
    return _REC.pack(len(payload), zlib.crc32(payload)) + payload


def _decode(payload: bytes) -> tuple[str, str, dict]:
    code, nslen, n = _HEAD.unpack_from(payload)
    kind = KIND_NAMES[code]
    off = _HEAD.size
    ns = payload[off:off + nslen].decode()
    off += nslen
    f: dict = {}
    if kind == "init":
        f["num_pages"], f["page_bytes"] = struct.unpack_from("<qq", payload, off)
        return kind, ns, f
    if kind == "clear":
        return kind, ns, f
    if kind in _SLOTS:
        a = array("q")
        a.frombytes(payload[off:off + 8 * n])
        f["slots"] = a.tolist()
        off += 8 * n
        a = array("q")
        a.frombytes(payload[off:off + 8 * n])
        f["gens"] = a.tolist()
        off += 8 * n
    if kind in _CRCS:
        a = array("I")
        a.frombytes(payload[off:off + 4 * n])
        f["crcs"] = a.tolist()
        off += 4 * n
    if kind not in _KEYLESS:
        f["keys"] = payload[off:].split(b"\n") if n else []
    return kind, ns, f


def read_records(path: Path) -> tuple[list[tuple[str, str, dict]], int, bool]:
    """Records of one segment, the byte length of its valid prefix, and whether it was torn."""
    data = path.read_bytes()
    out, off, size = [], 0, len(data)
    while off + _REC.size <= size:
        length, crc = _REC.unpack_from(data, off)
        end = off + _REC.size + length
        if end > size:
            break
        payload = data[off + _REC.size:end]
        if zlib.crc32(payload) != crc:
            break
        out.append(_decode(payload))
        off = end
    return out, off, off != size


class Journal:
    """The index's journal: ``record()`` is called by ``PageIndex`` under its lock."""

    def __init__(self, data_dir: str | os.PathLike, fsync: str = "interval", fsync_interval_s: float = 0.05,
                 snapshot_interval_s: float = 60.0, snapshot_bytes: int = 32 << 20):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.dir = Path(data_dir)
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self.snapshot_bytes = snapshot_bytes
        self.seq = 0
        self.fd = -1
        self.segment_bytes = 0
        self.appended = 0  # total bytes appended (all segments)
        self.synced = 0  # total bytes known fdatasynced
        self._sync_lock = threading.Lock()  # one fdatasync at a time
        self._sync_cv = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.index: PageIndex | None = None
        self.last_snapshot = time.monotonic()
        self.recovery: dict = {}
        self.identity: str | None = None  # the index's identity (index.id), once open
        self._lock_fd = -1  # meta.lock, held while open

    # ------------------------------------------------------------------ appends
    def record(self, kind: str, ns: str, **fields) -> None:
        rec = _encode(kind, ns, fields)
        view = memoryview(rec)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.segment_bytes += len(rec)
        self.appended += len(rec)

    def commit(self) -> None:
        """Return once what was appended so far is as durable as the policy promises."""
        if self.fsync != "always":
            return
        target = self.appended
        while self.synced < target:
            if self._sync_lock.acquire(blocking=False):
                try:
                    upto, fd = self.appended, self.fd
                    os.fdatasync(fd)
                    with self._sync_cv:
                        self.synced = max(self.synced, upto)
                        self._sync_cv.notify_all()
                finally:
                    self._sync_lock.release()
            else:
                with self._sync_cv:
                    if self.synced < target:
                        self._sync_cv.wait(0.05)

    # ------------------------------------------------------------------ recovery
    def open(self, index: PageIndex) -> dict:
        """Lock the dir (``ownership.Locked`` if another journal holds it), load the newest
        snapshot, replay the journal, start a new segment, start threads."""
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_data_dir(self.dir)
        try:
            self.identity = data_dir_identity(self.dir)
            return self._open(index, t0)
        except BaseException:
            self.close()
            raise

    def _open(self, index: PageIndex, t0: float) -> dict:
        self.index = index
        snaps = sorted(self._numbered("snapshot"), reverse=True)
        snap_seq = 0
        for seq, path in snaps:
            try:
                self._load_snapshot(index, path)
                snap_seq = seq
                break
            except (ValueError, OSError, struct.error) as e:
                log.error("hf3fs-meta: snapshot %s unusable (%s); trying an older one", path, e)
                index.spaces.clear()
        segments = sorted(s for s in self._numbered("wal") if s[0] >= snap_seq)
        now = time.monotonic()
        replayed = 0
        for i, (seq, path) in enumerate(segments):
            records, good, torn = read_records(path)
            for kind, ns, f in records:
                index.replay(kind, ns, f, now)
            replayed += len(records)
            if torn:
                if i == len(segments) - 1:
                    log.warning("hf3fs-meta: cutting a torn record at byte %d of %s", good, path)
                    with open(path, "r+b") as fh:
                        fh.truncate(good)
                else:
                    log.error("hf3fs-meta: %s is damaged after byte %d; later records skipped", path, good)
        index.finish_recovery(time.monotonic())
        last = max([snap_seq] + [s for s, _ in segments] + [0])
        self._open_segment(last + 1)
        keys = sum(len(sp.index) for sp in index.iter_spaces())
        self.recovery = {"snapshot": snap_seq, "segments": len(segments), "records": replayed,
                         "keys": keys, "seconds": round(time.monotonic() - t0, 3)}
        self.journal_start()
        return self.recovery

    def journal_start(self) -> None:
        if self.fsync == "interval":
            self._spawn(self._fsync_loop, "hf3fs-meta-fsync")
        self._spawn(self._snapshot_loop, "hf3fs-meta-snapshot")

    def _spawn(self, fn, name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _numbered(self, prefix: str) -> list[tuple[int, Path]]:
        pat = re.compile(rf"^{prefix}\.(\d{{8}})(\.log)?$")
        out = []
        for p in self.dir.iterdir():
            m = pat.match(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return out

    def _open_segment(self, seq: int) -> None:
        path = self.dir / f"wal.{seq:08d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        old = self.fd
        self.fd, self.seq, self.segment_bytes = fd, seq, 0
        self._fsync_dir()
        if old >= 0:
            # acked records of the old segment stay as durable as the policy promised
            if self.fsync != "never":
                os.fdatasync(old)
                self.synced = self.appended
            os.close(old)

    def _fsync_dir(self) -> None:
        if self.fsync == "never":
            return
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ------------------------------------------------------------------ background
    def _fsync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            self._sync_now()

    def _sync_now(self) -> None:
        if self.synced >= self.appended:
            return
        with self._sync_lock:
            upto, fd = self.appended, self.fd
            try:
                os.fdatasync(fd)
            except OSError:  # segment rotated and closed under us: the next round covers it
                return
            self.synced = max(self.synced, upto)

    def _snapshot_loop(self) -> None:
        while not self._stop.wait(1.0):
            due = (time.monotonic() - self.last_snapshot >= self.snapshot_interval_s
                   or self.segment_bytes >= self.snapshot_bytes)
            if due and self.segment_bytes > 0:
                try:
                    self.snapshot()
                except Exception:  # noqa: BLE001 - keep serving; the journal still has everything
                    log.exception("hf3fs-meta: snapshot failed")

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> Path:
        """Write the whole index; then drop the journal segments it replaces."""
        index = self.index
        assert index is not None
        with index.lock:
            with self._sync_lock:
                self._open_segment(self.seq + 1)
            seq = self.seq
            captured = [
                (sp.name, sp.num_pages, sp.page_bytes, sp.fresh_next, sp.gen.tobytes(), bytes(sp.state),
                 sp.crc.tobytes(), list(sp.index.keys()), array("q", sp.index.values()).tobytes(),
                 list(sp.pending.items()), array("q", sp.leased.keys()).tobytes(),
                 array("q", sp.leased.values()).tobytes())
                for sp in index.iter_spaces()
            ]
        self.last_snapshot = time.monotonic()
        path = self.dir / f"snapshot.{seq:08d}"
        tmp = path.with_name(path.name + ".tmp")
        header, blobs = [], []
        for name, num_pages, page_bytes, fresh, gen, state, crc, keys, slots, pending, ls, lg in captured:
            pk = [k for k, _ in pending]
            ps = array("q", [v[0] for _, v in pending]).tobytes()
            pg = array("q", [v[1] for _, v in pending]).tobytes()
            parts = [gen, state, crc, slots, b"\n".join(keys), ps, pg, b"\n".join(pk), ls, lg]
            header.append({"name": name, "num_pages": num_pages, "page_bytes": page_bytes,
                           "fresh_next": fresh, "keys": len(keys), "pending": len(pk),
                           "sizes": [len(p) for p in parts]})
            blobs.extend(parts)
        head = json.dumps({"seq": seq, "namespaces": header}).encode()
        crc = zlib.crc32(head)
        with open(tmp, "wb") as f:
            f.write(SNAP_MAGIC + struct.pack("<I", len(head)) + head)
            for b in blobs:
                f.write(b)
                crc = zlib.crc32(b, crc)
            f.write(struct.pack("<I", crc))
            f.flush()
            if self.fsync != "never":
                os.fsync(f.fileno())
        os.replace(tmp, path)
        self._fsync_dir()
        for s, p in self._numbered("wal"):
            if s < seq:
                p.unlink(missing_ok=True)
        for s, p in self._numbered("snapshot"):
            if s < seq:
                p.unlink(missing_ok=True)
        return path

    @staticmethod
    def _load_snapshot(index: PageIndex, path: Path) -> None:
        data = path.read_bytes()
        if data[:8] != SNAP_MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack_from("<I", data, 8)
        head = data[12:12 + hlen]
        (crc_stored,) = struct.unpack_from("<I", data, len(data) - 4)
        body = memoryview(data)[12 + hlen:len(data) - 4]
        if zlib.crc32(body, zlib.crc32(head)) != crc_stored:
            raise ValueError("checksum mismatch")
        doc = json.loads(head)
        off = 0
        for h in doc["namespaces"]:
            parts = []
            for size in h["sizes"]:
                parts.append(bytes(body[off:off + size]))
                off += size
            gen, state, crc, slots_b, keys_b, ps_b, pg_b, pk_b = parts[:8]
            ls_b, lg_b = parts[8:] or (b"", b"")  # snapshots before write leases have none
            sp = Namespace(h["name"], h["num_pages"], h["page_bytes"])
            sp.fresh_next = h["fresh_next"]
            sp.gen = array("q")
            sp.gen.frombytes(gen)
            sp.state = bytearray(state)
            sp.crc = array("I")
            sp.crc.frombytes(crc)
            keys = keys_b.split(b"\n") if h["keys"] else []
            slots = array("q")
            slots.frombytes(slots_b)
            sp.index = OrderedDict(zip(keys, slots.tolist()))
            pk = pk_b.split(b"\n") if h["pending"] else []
            ps, pg = array("q"), array("q")
            ps.frombytes(ps_b)
            pg.frombytes(pg_b)
            for k, s, g in zip(pk, ps, pg):
                sp.pending[k] = (s, g)
            ls, lg = array("q"), array("q")
            ls.frombytes(ls_b)
            lg.frombytes(lg_b)
            sp.leased = dict(zip(ls.tolist(), lg.tolist()))
            index.spaces[sp.name] = sp

    def close(self) -> None:
        """Stop the threads, sync and close the segment, release the dir. Idempotent."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        try:
            if self.fd >= 0:
                try:
                    if self.fsync != "never":
                        os.fdatasync(self.fd)
                finally:
                    os.close(self.fd)
                    self.fd = -1
        finally:
            if self._lock_fd >= 0:
                unlock(self._lock_fd)
                self._lock_fd = -1

