"""``hf3fs``: KV pages at fixed offsets of one file per rank, indexed by a metadata service.

Layout: page ``slot`` of a data file lies at ``slot * page_bytes``; the file is
``{file_path_prefix}.{rank}.bin`` (``.0.bin`` for MLA, whose KV every rank shares and
rank 0 writes) plus ``.{pool}`` for side pools, exactly SGLang's naming. A whole page (all
its segments, e.g. K and V) is one contiguous slot, moved with one vectored syscall.

Write: reserve slots for the batch (one metadata call), write the pages in parallel on
``numjobs`` workers, then confirm (one call) — a key becomes visible only after its bytes
landed. Read: look the batch up (one call; leases the slots against reuse), read in
parallel, and accept a page only if it still belongs to its key: either the read finished
within the read lease, or a ``validate`` call confirms the (slot, generation) is unchanged;
with ``checksums`` the page's CRC32 must match too.

Context from the engine adapter (``create_store("hf3fs", options, rank=..., ...)``):
``rank`` (TP rank), ``is_mla`` (rank-replicated KV), ``is_writer`` (default: not MLA or
rank 0), ``tp_size``, ``pool`` (``"kv"``, ``"mamba"``, ...) and ``page_bytes`` (the
engine's bytes per page; otherwise the first page written or the service's record fixes it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from connectors.base import ConfigError, Page, PageStore, StoreUsage
from connectors.hf3fs.client import LocalMetadata, MetadataClient, MetadataError
from connectors.hf3fs.config import HF3FSConfig, merged_options, parse_meta_url
from connectors.hf3fs.files import PosixFile, UsrbioFile, crc_of, on_3fs_mount, segment_views
from connectors.hf3fs.index import EXISTS, INFLIGHT, NEW

log = logging.getLogger("kvconnect.hf3fs")

# Fraction of a lease a client trusts: the service's clock started it a little after ours.
LEASE_TRUST = 0.8


class _LocalIndexes:
    """One in-process index per data file per process, guarded by an exclusive flock so a
    second process cannot use the same file without a metadata service."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, list] = {}  # path -> [LocalMetadata, lock fd, refs]

    def acquire(self, path: str) -> LocalMetadata:
        key = os.path.realpath(path)
        with self._lock:
            entry = self._by_path.get(key)
            if entry is None:
                lock_path = key + ".lock"
                try:
                    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:
                    raise ConfigError("file_path_prefix", f"cannot create {lock_path!r}: {e.strerror}") from e
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    raise ConfigError(
                        "metadata_server_url",
                        f"data file {path!r} is used by another process with its own in-process index; "
                        "processes sharing a file need a metadata service (kvconnect hf3fs-meta serve)") from e
                entry = self._by_path[key] = [LocalMetadata(), fd, 0]
            entry[2] += 1
            return entry[0]

    def release(self, path: str) -> None:
        key = os.path.realpath(path)
        with self._lock:
            entry = self._by_path.get(key)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] <= 0:
                del self._by_path[key]
                os.close(entry[1])


_LOCAL = _LocalIndexes()


class HF3FSStore(PageStore):
    """Pages in files (3FS via usrbio, or any POSIX filesystem) plus a page index."""

    name = "hf3fs"
    config_class = HF3FSConfig
    zero_copy = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **context: Any) -> "HF3FSStore":
        """Options overlaid on SGLang's hf3fs JSON (``config_path`` / $SGLANG_HICACHE_HF3FS_CONFIG_PATH)."""
        from connectors.config import parse_config

        config = parse_config(cls.config_class, merged_options(options), where=f"store {cls.name!r}")
        return cls(config, **context)

    def __init__(self, config: HF3FSConfig, *, rank: int = 0, is_mla: bool = False, is_writer: bool | None = None,
                 tp_size: int = 1, pool: str = "kv", page_bytes: int | None = None,
                 metadata: MetadataClient | None = None, **_ignored: Any):
        super().__init__()
        self.config = config
        self.rank = int(rank)
        self.is_mla = bool(is_mla)
        self.file_rank = 0 if self.is_mla else self.rank
        self.is_writer = (not self.is_mla or self.rank == 0) if is_writer is None else bool(is_writer)
        self.pool = str(pool or "kv")
        self.ns = f"{self.file_rank}:{self.pool}"
        suffix = "" if self.pool == "kv" else f".{self.pool}"
        self.path = f"{config.file_path_prefix}.{self.file_rank}.bin{suffix}"
        self._bind_lock = threading.Lock()
        self.page_bytes = 0
        self.num_pages = 0
        self.read_lease_s = 0.0
        self.write_lease_s = 0.0
        self._local_path: str | None = None
        self._file = None
        self._executor: ThreadPoolExecutor | None = None
        self.validations = 0
        self.rejected_reads = 0
        self._owns_meta = metadata is None

        # Metadata first: a wrong token or a dead service fails the start, before any file.
        if metadata is not None:
            self.meta = metadata
        elif config.metadata_server_url:
            from connectors.hf3fs.client import AuthError, RemoteMetadata

            remote = RemoteMetadata(parse_meta_url(config.metadata_server_url), config.token(),
                                    timeout=config.client_timeout, retries=config.meta_retries)
            try:
                remote.connect()
                remote.initialize(self.ns, 0, 0)  # authenticated round trip
            except AuthError as e:
                remote.close()
                raise ConfigError("auth_token", str(e)) from e
            except MetadataError as e:
                remote.close()
                from connectors.base import BackendUnavailable

                raise BackendUnavailable("hf3fs", f"{e} (config key 'metadata_server_url')") from e
            except BaseException:
                remote.close()
                raise
            self.meta = remote
        else:
            if self.is_mla and tp_size > 1:
                raise ConfigError("metadata_server_url", "an MLA model with tp_size > 1 needs a metadata service: "
                                  "every rank reads the pages rank 0 writes")
            self.meta = _LOCAL.acquire(self.path)
            self._local_path = self.path
        try:
            self._file = self._open_file()
            self._executor = ThreadPoolExecutor(max_workers=config.numjobs, thread_name_prefix="hf3fs-io")
            bytes_hint = config.page_bytes or page_bytes
            if bytes_hint:
                self._bind(int(bytes_hint))
            else:
                self._lookup_layout()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ setup
    def _open_file(self):
        client = self.config.client
        if self.config.use_mock_hf3fs_client:
            client = "posix"
        if client == "auto":
            client = "usrbio" if on_3fs_mount(self.path) else "posix"
        if client == "usrbio":
            return ("usrbio", None)  # opened at bind time: its staging buffers need page_bytes
        return ("posix", PosixFile(self.path, 0))

    def _bind(self, page_bytes: int) -> None:
        """Fix the page geometry (once): register the namespace and size the file."""
        with self._bind_lock:
            if self.page_bytes:
                return
            cfg = self.config
            num_pages = cfg.file_size // page_bytes
            if num_pages < 1:
                raise ConfigError("file_size", f"{cfg.file_size} bytes hold no page of {page_bytes} bytes",
                                  "a file_size of at least one page")
            try:
                info = self.meta.initialize(self.ns, num_pages, page_bytes)
            except MetadataError as e:
                from connectors.base import BackendUnavailable

                raise BackendUnavailable("hf3fs", str(e)) from e
            self._adopt(info)

    def _adopt(self, info) -> None:
        kind, f = self._file
        if kind == "usrbio":
            f = UsrbioFile(self.path, info.num_pages * info.page_bytes, info.page_bytes, self.config.entries,
                           self.config.numjobs, self.config.client_timeout)
            self._file = (kind, f)
        else:
            try:
                f.grow(info.num_pages * info.page_bytes)
            except OSError as e:
                raise ConfigError("file_size", f"cannot size {self.path!r}: {e.strerror}") from e
        self.read_lease_s = info.read_lease_s
        self.write_lease_s = info.write_lease_s
        self.num_pages = info.num_pages
        self.page_bytes = info.page_bytes
        log.info("hf3fs: %s (%s client) holds %d pages of %d bytes, namespace %s", self.path, kind,
                 info.num_pages, info.page_bytes, self.ns)

    def _lookup_layout(self) -> bool:
        """Adopt the geometry another process registered (readers that never wrote)."""
        if self.page_bytes:
            return True
        try:
            info = self.meta.initialize(self.ns, 0, 0)
        except MetadataError:
            return False
        if info.page_bytes:
            with self._bind_lock:
                if not self.page_bytes:
                    self._adopt(info)
        return bool(self.page_bytes)

    @property
    def file(self):
        return self._file[1]

    # ------------------------------------------------------------------ I/O fan-out
    def _fan_out(self, fn, items: list, *args) -> list[bool]:
        """Run ``fn(chunk, *args)`` over ``entries``-sized chunks on the workers, the first
        chunk on the calling thread; results in item order. Waits for every chunk: no I/O
        into caller memory is ever left running when a call returns."""
        e = self.config.entries
        chunks = [items[i:i + e] for i in range(0, len(items), e)]
        futs = [self._executor.submit(fn, c, *args) for c in chunks[1:]]
        out = list(fn(chunks[0], *args)) if chunks else []
        for f in futs:
            out.extend(f.result())
        return out

    def _read_chunk(self, chunk: list, checks: bool) -> list[bool]:
        f = self.file
        items = [(slot * self.page_bytes, segment_views(page)) for slot, page, _ in chunk]
        ok = f.read_batch(items)
        if checks:
            ok = [o and crc_of(v) == crc for o, (_, v), (_, _, crc) in zip(ok, items, chunk)]
        return ok

    def _write_chunk(self, chunk: list, deadline: float, checks: bool) -> list:
        f = self.file
        items = [(slot * self.page_bytes, segment_views(page)) for slot, page in chunk]
        crcs = [crc_of(v) for _, v in items] if checks else [0] * len(items)
        ok = f.write_batch(items, deadline)
        return list(zip(ok, crcs))

    # ------------------------------------------------------------------ primitives
    @staticmethod
    def _encode(keys: list[str]) -> list[bytes]:
        out = [k.encode() for k in keys]
        for k in out:
            if b"\n" in k or not k:
                raise ValueError(f"hf3fs: keys must be non-empty and free of newlines, got {k!r}")
        return out

    def _exists(self, keys: list[str]) -> list[bool]:
        try:
            return [bool(b) for b in self.meta.exists(self.ns, self._encode(keys))]
        except MetadataError as e:
            self._note_error("exists", e)
            return [False] * len(keys)

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        if not self.page_bytes and not self._lookup_layout():
            return out
        pb = self.page_bytes
        want = [i for i, p in enumerate(pages) if sum(s for _, s in p) == pb]
        if not want:
            return out
        kb = self._encode([keys[i] for i in want])
        t0 = time.monotonic()
        try:
            slots, gens, crcs = self.meta.get(self.ns, kb)
        except MetadataError as e:
            self._note_error("get", e)
            return out
        hits = [j for j, s in enumerate(slots) if s >= 0]
        if not hits:
            return out
        checks = self.config.checksums
        ok = self._fan_out(self._read_chunk, [(slots[j], pages[want[j]], crcs[j]) for j in hits], checks)
        if time.monotonic() - t0 > self.read_lease_s * LEASE_TRUST:
            # the read outlived its lease: the slot may have been reused; ask
            idx = [h for h, o in zip(range(len(hits)), ok) if o]
            if idx:
                self.validations += 1
                try:
                    still = self.meta.validate(self.ns, [slots[hits[h]] for h in idx], [gens[hits[h]] for h in idx])
                except MetadataError as e:
                    self._note_error("validate", e)
                    still = bytes(len(idx))
                for h, v in zip(idx, still):
                    if not v:
                        ok[h] = False
                        self.rejected_reads += 1
        for h, j in enumerate(hits):
            out[want[j]] = bool(ok[h])
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        n = len(keys)
        if not self.is_writer:
            return [True] * n  # MLA: the writer rank stores these very bytes
        out = [False] * n
        if not self.page_bytes:
            try:
                self._bind(sum(s for _, s in pages[0]))
            except Exception as e:  # noqa: BLE001 - a store that cannot lay out fails writes
                self._note_error("layout", e)
                return out
        pb = self.page_bytes
        want = [i for i, p in enumerate(pages) if sum(s for _, s in p) == pb]
        if not want:
            return out
        kb = self._encode([keys[i] for i in want])
        t0 = time.monotonic()
        try:
            status, slots, gens = self.meta.reserve(self.ns, kb)
        except MetadataError as e:
            self._note_error("reserve", e)
            return out
        new = []
        for j, st in enumerate(status):
            if st == NEW:
                new.append(j)
            elif st == EXISTS or st == INFLIGHT:
                out[want[j]] = True  # stored, or being stored now by another writer of these bytes
        if not new:
            return out
        deadline = t0 + self.write_lease_s * LEASE_TRUST
        checks = self.config.checksums
        res = self._fan_out(self._write_chunk, [(slots[j], pages[want[j]]) for j in new], deadline, checks)
        if self.config.fsync_data and any(o for o, _ in res):
            try:
                self.file.sync()
            except OSError as e:
                self._note_error("fsync", e)
                res = [(False, c) for _, c in res]
        try:
            done = self.meta.commit(self.ns, [kb[j] for j in new], [slots[j] for j in new],
                                    [gens[j] for j in new], [c for _, c in res], bytes(1 if o else 0 for o, _ in res))
        except MetadataError as e:
            self._note_error("confirm", e)  # reservations expire; the pages stay invisible
            return out
        for h, j in enumerate(new):
            out[want[j]] = bool(res[h][0] and done[h])
        return out

    def _delete(self, keys: list[str]) -> list[bool]:
        try:
            return [bool(b) for b in self.meta.delete(self.ns, self._encode(keys))]
        except MetadataError as e:
            self._note_error("delete", e)
            return [False] * len(keys)

    def _clear(self) -> None:
        try:
            self.meta.clear(self.ns)
        except MetadataError as e:
            self._note_error("clear", e)

    def _usage(self) -> StoreUsage:
        try:
            u = self.meta.usage(self.ns)
        except MetadataError:
            u = {}
        keys = u.get("keys")
        return StoreUsage(keys=keys, bytes_used=None if keys is None else keys * self.page_bytes,
                          capacity_bytes=self.num_pages * self.page_bytes, evictions=u.get("evictions"),
                          extra={"file": self.path, "client": self._file[0] if self._file else None,
                                 "namespace": self.ns, "validations": self.validations,
                                 "rejected_reads": self.rejected_reads, "reserved": u.get("reserved")})

    def _note_error(self, op: str, e: Exception) -> None:
        self.record_error()
        log.warning("hf3fs: %s failed, treated as a miss: %s", op, e)

    # ------------------------------------------------------------------ lifecycle
    def _release(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._file is not None and self._file[1] is not None:
            self._file[1].close()
        self._file = None
        if self._local_path is not None:
            _LOCAL.release(self._local_path)
            self._local_path = None
        elif self._owns_meta and getattr(self, "meta", None) is not None:
            self.meta.close()

    def _close(self) -> None:
        self._release()
