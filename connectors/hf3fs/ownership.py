"""One page index per data file: the service's data-dir lock, index identities, file stamps.

Two page indexes that map keys to slots of one data file hand the same slot to different
keys, and each one's readers then get the other's bytes. Three things rule that out:

* **One service per data dir.** ``kvconnect hf3fs-meta serve`` holds an exclusive ``flock``
  on ``{data dir}/meta.lock`` (its pid and host written in) for as long as it runs; a second
  service on the dir refuses to start, naming the dir and the holder. The kernel drops the
  lock with the holder's last descriptor, so ``kill -9`` of the holder frees the dir.
* **An identity per index**, the same across restarts: the service's is created at its
  first start in ``{data dir}/index.id``; a Redis index's in the key ``{metadata_key_prefix}:id``
  (``SET NX`` by its first client). An index without one (the in-process index, a service
  of an older version) has ``None``.
* **A stamp per data file**: ``{data file}.owner`` (JSON) names the index (and namespace)
  the file's slots belong to. A store opening a data file (each page-size lane) compares it
  with its own index's identity: the same, it uses the file; another, it refuses the file
  with a ``ConfigError`` naming both. A file without a stamp (new, or from before stamps)
  is adopted by the first identified index that opens it (created with ``O_EXCL``: of two
  at once, one wins and the other compares). An index without identity adopts nothing and
  refuses stamped files. The in-process index holds ``{file}.lock`` (``flock``) on its
  store's file while it runs: an adopter takes the same lock for the moment it stamps, so it
  never adopts a file an in-process index is writing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from kvconnect.connectors.base import ConfigError, KVStoreError

log = logging.getLogger("kvconnect.hf3fs")

LOCK_SUFFIX = ".lock"
STAMP_SUFFIX = ".owner"
DATA_DIR_LOCK = "meta.lock"
DATA_DIR_IDENTITY = "index.id"
ADOPT_WAIT_S = 2.0  # how long an adopter waits for a {file}.lock another adopter holds for a moment


class Locked(KVStoreError, OSError):
    """An exclusive lock is held by another process (``holder``: its pid and host, as it wrote them)."""

    def __init__(self, path: str, holder: str, message: str | None = None):
        self.path = path
        self.holder = holder
        super().__init__(message or f"{path} is locked by {holder}")


# ---------------------------------------------------------------------------------
# Exclusive locks (flock) that say who holds them
# ---------------------------------------------------------------------------------


def lock_exclusive(path: str | os.PathLike) -> int:
    """Take an exclusive ``flock`` on ``path`` (created), without waiting; the descriptor
    that holds it (``unlock`` to release; process exit, ``kill -9`` included, releases it
    too). The holder's pid and host are written into the file. ``Locked`` naming the holder
    if another open file holds it (another process, or another open in this one);
    ``OSError`` if the file cannot be created."""
    path = os.fspath(path)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise Locked(path, lock_holder(path)) from e
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except OSError:  # the lock holds without the note
        pass
    return fd


def lock_holder(path: str | os.PathLike) -> str:
    """Who holds the lock at ``path``, as the holder wrote it ("pid N on host H")."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            note = f.read(200).strip()
    except OSError:
        note = ""
    return note or "a process that has not written its pid yet"


def unlock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------
# The service's data dir
# ---------------------------------------------------------------------------------


def lock_data_dir(data_dir: str | os.PathLike) -> int:
    """The exclusive lock of a metadata service's data dir (``Locked`` with what to do if
    another service holds it)."""
    path = Path(data_dir) / DATA_DIR_LOCK
    try:
        return lock_exclusive(path)
    except Locked as e:
        raise Locked(e.path, e.holder,
                     f"--data-dir {data_dir} is in use by another metadata service ({e.holder}; "
                     f"lock {path}). One page index per data dir: two services over one journal would hand "
                     "the same pages of a data file to different keys. Stop that service first, or start "
                     "this one with another --data-dir (and give its engines another file_path_prefix)") from e


def new_identity(kind: str) -> str:
    return f"{kind}:{uuid.uuid4().hex}"


def data_dir_identity(data_dir: str | os.PathLike) -> str:
    """The identity of the index kept in ``data_dir``: read from ``index.id``, created (and
    made durable) at the first start. Call with the dir's lock held."""
    path = Path(data_dir) / DATA_DIR_IDENTITY
    try:
        ident = path.read_text(encoding="utf-8").strip()
        if ident:
            return ident
    except FileNotFoundError:
        pass
    ident = new_identity("hf3fs-meta")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(ident + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    log.info("hf3fs-meta: new page index identity %s (%s)", ident, path)
    return ident


# ---------------------------------------------------------------------------------
# Data file stamps
# ---------------------------------------------------------------------------------


def read_stamp(data_file: str) -> dict | None:
    """The stamp of ``data_file`` (None: none). A stamp being written (empty or half a
    line, for a moment) is read again; one that stays unreadable is a ``ConfigError``."""
    path = data_file + STAMP_SUFFIX
    deadline = time.monotonic() + 1.0
    while True:
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError("file_path_prefix", f"cannot read the stamp {path!r} of data file {data_file!r}: "
                                                  f"{e.strerror}") from e
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and isinstance(doc.get("index"), str) and doc["index"]:
                return doc
        except ValueError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError("file_path_prefix", f"{path!r} (the stamp of data file {data_file!r}) is not a stamp "
                                                  "kvconnect wrote: move it away if the file is no index's")
        time.sleep(0.01)


def _write_stamp(data_file: str, doc: dict) -> bool:
    """Create the stamp (``O_EXCL``); False if one exists already."""
    path = data_file + STAMP_SUFFIX
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps(doc, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _foreign(data_file: str, stamp: dict, identity: str | None, ns: str, index: str) -> ConfigError:
    mine = f"{identity!r}" if identity else "an index without identity (in-process, or an older service)"
    by = stamp.get("adopted_via")
    of = f"index {stamp['index']!r}" + (f", namespace {stamp.get('namespace')!r}" if stamp.get("namespace") else "") \
        + (f", adopted through {by}" if by else "")
    return ConfigError(
        "file_path_prefix",
        f"data file {data_file!r} belongs to another page index ({of}; stamp {data_file + STAMP_SUFFIX!r}); this "
        f"store's index is {mine} ({index}), namespace {ns!r}. Two indexes over one file hand the same pages to "
        "different keys, so the file is refused. Give each index its own file_path_prefix, or point "
        "metadata_server_url at the file's index; if that index is gone for good (its --data-dir or Redis keys "
        f"deleted), delete {data_file + STAMP_SUFFIX!r} and the next index to open the file adopts it (its pages "
        "are lost either way)")


def claim(data_file: str, identity: str | None, ns: str, *, lock_path: str, index: str) -> str:
    """Check (or take) ``data_file`` for the index ``identity`` under namespace ``ns``.

    Returns ``"stamped"`` (the file is this index's), ``"adopted"`` (it had no stamp and now
    names this index) or ``"unstamped"`` (an index without identity and a file without
    stamp). Raises ``ConfigError`` for a file of another index or namespace, or (adopting)
    one an in-process index holds (``lock_path``). ``index`` describes this store's index
    in messages (its URL)."""
    stamp = read_stamp(data_file)
    if identity is None:
        if stamp is not None:
            raise _foreign(data_file, stamp, identity, ns, index)
        return "unstamped"
    if stamp is not None:
        if stamp["index"] == identity and stamp.get("namespace", ns) == ns:
            return "stamped"
        raise _foreign(data_file, stamp, identity, ns, index)
    # Adopt. Hold the lock an in-process index holds for its store's file while it runs, so
    # none is writing the file now and none starts until the stamp is there.
    deadline = time.monotonic() + ADOPT_WAIT_S
    while True:
        try:
            fd = lock_exclusive(lock_path)
            break
        except Locked as e:
            stamp = read_stamp(data_file)  # another adopter, done meanwhile
            if stamp is not None:
                return claim(data_file, identity, ns, lock_path=lock_path, index=index)
            if time.monotonic() > deadline:
                raise ConfigError(
                    "metadata_server_url",
                    f"data file {data_file!r} is in use by a process with its own in-process index ({e.holder}; "
                    f"lock {lock_path!r}): an index of its own beside it would hand its pages to other keys. Stop "
                    "that process or give this store another file_path_prefix") from e
            time.sleep(0.02)
        except OSError as e:
            raise ConfigError("file_path_prefix", f"cannot create {lock_path!r}: {e.strerror}") from e
    try:
        doc = {"index": identity, "namespace": ns, "adopted_via": index, "adopted_at": round(time.time(), 3),
               "adopted_by": f"pid {os.getpid()} on host {socket.gethostname()}"}
        try:
            won = _write_stamp(data_file, doc)
        except OSError as e:
            raise ConfigError("file_path_prefix", f"cannot write the stamp {data_file + STAMP_SUFFIX!r}: "
                                                  f"{e.strerror}") from e
        if not won:
            return claim(data_file, identity, ns, lock_path=lock_path, index=index)
        log.info("hf3fs: data file %s adopted by page index %s (namespace %s)", data_file, identity, ns)
        return "adopted"
    finally:
        unlock(fd)
