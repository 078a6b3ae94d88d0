"""``KeySpace``: what a bare page hash does not say.

SGLang page keys are prefix-chained SHA-256 hashes of token ids; LMCache keys are chunk
hashes. Neither names the model, KV layout, page geometry, dtype, rank or tenant, so two
engines with different models (or two TP ranks of one model) would read each other's
bytes. A store key is ``keyspace.key(page_hash)``: the page hash under a digest of every
field that changes what the bytes mean.

MLA (and any rank-replicated KV): every rank holds the same KV, so the rank is left out of
the key. Which rank writes it is the engine's business (``kvconnect.connectors.context.
EngineContext.is_writer``), not the key's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

KEY_VERSION = "kvc1"


UNNAMED_MODEL = "<unnamed>"


def model_key(name: str | None) -> str:
    """The ``KeySpace.model`` of an engine's model name: an engine that gives none gets
    ``UNNAMED_MODEL``, and a real name starting with ``<`` one more ``<``, so that no named
    model ever shares a key space with the unnamed one (the mapping is one-to-one)."""
    if not name:
        return UNNAMED_MODEL
    return "<" + name if name.startswith("<") else name


@dataclass(frozen=True)
class KeySpace:
    """The identity of a page's bytes beyond its token hash.

    Attributes:
        model: served model name (e.g. ``"Qwen/Qwen3-32B"``).
        weights: optional weights fingerprint (revision, checksum) to tell apart fine-tunes
            served under one name.
        layout: host KV layout the bytes are in (``page_first``, ``layer_first``, ...), or a
            store-neutral name when the bytes are layout-independent.
        page_size: tokens per page.
        dtype: the *logical* KV dtype (``bfloat16``, ``float8_e4m3fn``, ...): what the bytes
            mean, not the ``uint8`` fp8 KV is stored in (``kvconnect.namespace.dtypes``), so an
            fp8 engine never reads bf16 pages, nor an ``e5m2`` one ``e4m3`` pages.
        kv_scales: the quantization scales stored inside the pages, by format (``mxfp8``,
            ``nvfp4``, ...); ``""`` when the pages carry none (bf16, per-tensor fp8). Left out of
            the identity when empty, so keys of unscaled spaces stay what they were.
        geometry: page geometry, e.g. ``"mha:L32:H8:D128"``; anything that changes the bytes.
        tp_rank/tp_size, pp_rank/pp_size, cp_rank/cp_size: parallel ranks.
        rank_replicated: KV identical on every TP rank (MLA): rank left out of the key.
        pool: which pool the page belongs to (``kv``, ``mamba``, ``swa``, ``indexer``, ...).
        tenant: the tenant; different tenants never share pages.
        salt: a per-request cache salt (LMCache's ``cache_salt``) within the tenant. Tenant and
            salt are separate fields of the digested identity, never joined into one string,
            so no (tenant, salt) pair can name another pair's key space (``a`` + salt ``b/``
            and ``a/b`` with no salt used to be one key space). Without a salt the identity,
            hence every key, is what it was before the field existed.
    """

    model: str
    layout: str = "page_first"
    page_size: int = 1
    dtype: str = "bfloat16"
    kv_scales: str = ""
    geometry: str = ""
    weights: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    rank_replicated: bool = False
    pool: str = "kv"
    tenant: str = ""
    salt: str = ""
    _prefix: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("KeySpace.model is required")
        for name in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"KeySpace: {name}_rank={rank} outside [0, {name}_size={size})")
        if self.page_size < 1:
            raise ValueError("KeySpace.page_size must be >= 1")
        object.__setattr__(self, "_prefix", self._compute_prefix())

    def identity(self) -> dict[str, Any]:
        """The fields that go into the key (rank left out for rank-replicated KV)."""
        d = asdict(self)
        d.pop("_prefix", None)
        if not self.salt:
            del d["salt"]  # keys of unsalted spaces stay as they were
        if not self.kv_scales:
            del d["kv_scales"]  # likewise for spaces without stored scales
        if self.rank_replicated:
            d["tp_rank"] = None
            d["tp_size"] = None
        return d

    def _compute_prefix(self) -> str:
        canon = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return f"{KEY_VERSION}-" + hashlib.blake2b(canon.encode(), digest_size=10).hexdigest()

    @property
    def prefix(self) -> str:
        """Key prefix for this space: stable across processes and hosts."""
        return self._prefix

    def key(self, page_hash: str) -> str:
        return f"{self._prefix}-{page_hash}"

    def keys(self, page_hashes: list[str]) -> list[str]:
        p = self._prefix + "-"
        return [p + h for h in page_hashes]

    def for_pool(self, pool: str, **changes: Any) -> "KeySpace":
        """The key space of a side pool (mamba, swa, indexer, ...) of the same engine rank."""
        return replace(self, pool=pool, **changes)

    def describe(self) -> str:
        ranks = "replicated" if self.rank_replicated else f"tp{self.tp_rank}/{self.tp_size}"
        if self.pp_size > 1:
            ranks += f" pp{self.pp_rank}/{self.pp_size}"
        if self.cp_size > 1:
            ranks += f" cp{self.cp_rank}/{self.cp_size}"
        tenant = (f" tenant={self.tenant}" if self.tenant else "") + (f" salt={self.salt}" if self.salt else "")
        return (f"{self.model} [{self.pool}] {self.layout} page={self.page_size} {self.dtype}"
                f"{'+' + self.kv_scales + ' scales' if self.kv_scales else ''} "
                f"{self.geometry} {ranks}{tenant} -> {self._prefix}")
