"""``EngineContext``: what an engine integration tells a store about the process it runs in.

Every integration builds one (SGLang HiCache from its ``HiCacheStorageConfig``, the LMCache
server, the PD backend from its ``KVArgs``) and the factory hands it to the store as one
object (``create_store(..., context=ctx)``). A store reads what it has a use for: the HF3FS
store names its data file and metadata namespace after the rank (a shared file for
rank-replicated KV), the Mooncake store picks its RDMA device by TP rank; the in-process
store reads nothing.

Rank-replicated KV (MLA: every TP rank holds the same bytes) is written by one rank and
read by all. The rule is SGLang's ``is_storage_writer``: a rank writes unless its KV is
rank-replicated and its TP rank differs from its decode-context-parallel rank (rank 0
without DCP). ``EngineContext.is_writer`` is that rule, the only copy of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvconnect.connectors.errors import ConfigError


@dataclass(frozen=True)
class EngineContext:
    """One engine process: its parallel ranks, the pool a store serves, where pages live."""

    engine: str = ""
    """Which integration: ``"sglang-hicache"``, ``"lmcache"``, ``"sglang-pd"``."""
    model: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    """Tensor parallel."""
    pp_rank: int = 0
    pp_size: int = 1
    """Pipeline parallel."""
    cp_rank: int = 0
    cp_size: int = 1
    """Attention context parallel."""
    dcp_rank: int = 0
    dcp_size: int = 1
    """Decode context parallel (MLA)."""
    dp_rank: int = 0
    """Attention data parallel rank (SGLang gives storage the rank, not the size)."""
    rank_replicated: bool = False
    """The KV is the same on every TP rank (MLA): one rank writes it, all read it."""
    pool: str = "kv"
    """The pool the store serves first (``kv``; side pools: ``mamba``, ``swa``, ...)."""
    page_bytes: int | None = None
    """Bytes of one page of that pool, when the engine knows it up front."""
    device: str = "cpu"
    """Where the engine's pages live: ``"cpu"`` (host memory) or a GPU kind (``"cuda"``,
    ...); a store must be able to reach that memory."""
    cross_rank_lookups: bool = False
    """One process looks up the pages of every rank (vLLM's scheduler; each rank's key space
    names its rank): a store that keeps per-rank files or namespaces keeps one for all ranks."""

    def __post_init__(self) -> None:
        if self.dp_rank < 0:
            raise ConfigError("dp_rank", f"must be >= 0, got {self.dp_rank}", where="engine context")
        for name in ("tp", "pp", "cp", "dcp"):
            rank, size = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if size < 1 or not 0 <= rank < size:
                raise ConfigError(f"{name}_rank", f"{rank} is outside [0, {name}_size={size})",
                                  where=f"engine context ({self.engine or 'no engine'})")
        if self.page_bytes is not None and self.page_bytes <= 0:
            raise ConfigError("page_bytes", f"must be > 0, got {self.page_bytes}", where="engine context")

    # -- the writer rule ----------------------------------------------------------------
    @property
    def writer_rank(self) -> int:
        """The TP rank that writes rank-replicated KV (SGLang: ``tp_rank == dcp_rank``)."""
        return self.dcp_rank

    @property
    def is_writer(self) -> bool:
        """Whether this process writes its pool's pages: always for per-rank KV, the writer
        rank only for rank-replicated KV."""
        return not self.rank_replicated or self.tp_rank == self.writer_rank

    @property
    def data_rank(self) -> int:
        """The TP rank whose bytes this process's pages are: its own, or the writer's for
        rank-replicated KV (a store keeping per-rank files shares one for them)."""
        return self.writer_rank if self.rank_replicated else self.tp_rank

    # -- where pages live ---------------------------------------------------------------
    @property
    def on_device(self) -> bool:
        """Pages are accelerator memory, not host memory."""
        return not self.device.startswith("cpu")

    # -- identity -------------------------------------------------------------------------
    @property
    def rank_index(self) -> int:
        """A number unique to this process among the engine's ranks (dp, pp, cp, tp order)."""
        return (((self.dp_rank * self.pp_size + self.pp_rank) * self.cp_size + self.cp_rank)
                * self.tp_size + self.tp_rank)

    @property
    def sharing_ranks(self) -> int:
        """How many processes read what one writes: the TP ranks for rank-replicated KV."""
        return self.tp_size if self.rank_replicated else 1

    def for_pool(self, pool: str, **changes: Any) -> "EngineContext":
        """The context of a side pool of the same process (``rank_replicated`` may differ:
        Mamba state is TP-sharded even where the KV is replicated)."""
        return dataclasses.replace(self, pool=pool, **changes)

    def describe(self) -> str:
        ranks = f"tp{self.tp_rank}/{self.tp_size}"
        for name in ("pp", "cp", "dcp"):
            if getattr(self, f"{name}_size") > 1:
                ranks += f" {name}{getattr(self, f'{name}_rank')}/{getattr(self, f'{name}_size')}"
        if self.dp_rank:
            ranks += f" dp{self.dp_rank}"
        kind = "replicated, " + ("writer" if self.is_writer else "reader") if self.rank_replicated else "per-rank"
        return f"{self.engine or 'engine'} {self.model} [{self.pool}] {ranks} ({kind}) on {self.device}"
