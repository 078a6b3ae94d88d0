"""A toy fifth store in one file: pages as files in a directory, and its test harness.

The walk-through of docs/adding_a_store.md: a ``StoreConfig`` (its options, validated and
documented), a ``PageStore`` that implements the five primitives and declares what it can
do, and a ``StoreHarness`` that gives the options of engine instances sharing it. Registered
with two entry points (``kvconnect.stores`` and ``kvconnect.harnesses``, both named ``toy``),
it runs through every engine suite and the conformance and capability checks
(tests/engines/test_toy_store.py, which puts this folder on the import path as a plugin
package's install would).

Every page is one file named by its key's SHA-256, holding a header (magic, length, BLAKE2b
of key and body) and the body. A write lands in a temporary file that is renamed into place
(atomic: a reader opens the old page or the new one, never half of one); a read checks the
header against its key and the body against the digest, and calls anything else a miss.
Processes on one host that name the same ``root`` share the pages (``shared``), which stay
after every process exits (``durable``), in pages of any size (``any_page_size``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconnect.connectors.base import Capability, Page, PageStore, StoreUsage, page_nbytes
from kvconnect.connectors.config import StoreConfig, field_doc
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.errors import ConfigError
from kvconnect.connectors.testing.harness import StoreHarness

HEADER = struct.Struct("<8sQ16s")  # magic, body length, blake2b(key + body)
MAGIC = b"kvctoy01"


@dataclass(frozen=True)
class ToyStoreConfig(StoreConfig):
    root: str = field(metadata=field_doc("directory of the page files (processes naming the same one share it)"))

    def __post_init__(self) -> None:
        if not self.root:
            raise ConfigError("root", "must name a directory", None, "store 'toy'")


class ToyStore(PageStore):
    """Pages as files under ``root``, one per key."""

    name = "toy"
    config_class = ToyStoreConfig
    capabilities = frozenset({Capability.SHARED, Capability.DURABLE, Capability.ANY_PAGE_SIZE})

    def __init__(self, config: ToyStoreConfig, context: EngineContext | None = None):
        super().__init__(context)
        self.config = config
        self.root = Path(config.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / hashlib.sha256(key.encode()).hexdigest()

    @staticmethod
    def _digest(key: str, body: bytes) -> bytes:
        return hashlib.blake2b(key.encode() + b"\0" + body, digest_size=16).digest()

    def _exists(self, keys: list[str]) -> list[bool]:
        return [self._path(k).exists() for k in keys]

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        out = []
        for key, page in zip(keys, pages):
            try:
                data = self._path(key).read_bytes()
            except FileNotFoundError:
                self._miss("not_found", 1)
                out.append(False)
                continue
            magic, n, digest = HEADER.unpack_from(data) if len(data) >= HEADER.size else (b"", -1, b"")
            body = data[HEADER.size:]
            if magic != MAGIC or n != len(body) or digest != self._digest(key, body):
                self._miss("corrupt", 1)
                out.append(False)
                continue
            if n != page_nbytes(page):
                self._miss("mismatch", 1)
                out.append(False)
                continue
            offset = 0
            for address, size in page:
                ctypes.memmove(address, body[offset:offset + size], size)
                offset += size
            out.append(True)
        return out

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        out = []
        for key, page in zip(keys, pages):
            path = self._path(key)
            if path.exists():  # idempotent: the first bytes stay
                out.append(True)
                continue
            body = b"".join(ctypes.string_at(address, size) for address, size in page)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(HEADER.pack(MAGIC, len(body), self._digest(key, body)) + body)
                os.replace(tmp, path)  # published only once every byte is there
                out.append(True)
            except OSError:
                Path(tmp).unlink(missing_ok=True)
                out.append(False)
        return out

    def _delete(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            try:
                self._path(key).unlink()
                out.append(True)
            except FileNotFoundError:
                out.append(False)
        return out

    def _clear(self) -> None:
        for path in self.root.iterdir():
            path.unlink(missing_ok=True)

    def _usage(self) -> StoreUsage:
        files = [p for p in self.root.iterdir() if not p.name.startswith(".")]
        return StoreUsage(keys=len(files), bytes_used=sum(p.stat().st_size for p in files))


class ToyHarness(StoreHarness):
    """The toy store has no services: every engine instance names the same directory."""

    store = "toy"

    def options(self, instance: int = 0) -> dict[str, Any]:
        return {"store": "toy", "root": str(self.workdir / "pages")}
