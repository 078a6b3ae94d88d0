"""SGLang names that moved between releases (0.5.10 - 0.5.23), found once.

Importing this module never fails: without sglang (or torch) ``SGLANG_IMPORT_ERROR`` holds
why, and ``HiCacheStorage`` is a stand-in so the adapter module still imports (building the
adapter then raises ``MissingDependency``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, List, Optional, Sequence


try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: F401

    SGLANG_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as _e:  # sglang (or torch) not installed: the module still imports
    SGLANG_IMPORT_ERROR = _e
    torch = None  # type: ignore[assignment]

    class HiCacheStorage:  # type: ignore[no-redef]
        """Stand-in so this module imports without sglang; constructing raises."""


def first_attr(modules: Sequence[str], name: str) -> Any:
    for m in modules:
        try:
            mod = importlib.import_module(m)
        except Exception:  # noqa: BLE001 - a module missing or failing in this version
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


_POOL_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",      # 0.5.17 - 0.5.23
    "sglang.srt.mem_cache.memory_pool_host",     # 0.5.10
)
PoolName = first_attr(_POOL_MODULES, "PoolName")
PoolHitPolicy = first_attr(_POOL_MODULES, "PoolHitPolicy")
PoolTransferResult = first_attr(_POOL_MODULES, "PoolTransferResult")

KV = PoolName.KV if PoolName is not None else "kv"


def host_pool_classes() -> tuple[Any, Any]:
    """(MHATokenToKVPoolHost, MLATokenToKVPoolHost) of the installed sglang."""
    mha = first_attr(("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host",
                       "sglang.srt.mem_cache.memory_pool_host"), "MHATokenToKVPoolHost")
    mla = first_attr(("sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host",
                       "sglang.srt.mem_cache.memory_pool_host"), "MLATokenToKVPoolHost")
    return mha, mla


def storage_metrics_class() -> Any:
    return first_attr(("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"),
                       "StorageMetrics")


def pool_result(kv_hit_pages: int, hits: dict, restorable: Optional[List[int]]) -> Any:
    """A ``PoolTransferResult``; 0.5.17's has no ``restorable_prefix_pages``."""
    fields = {f.name for f in dataclasses.fields(PoolTransferResult)}
    if "restorable_prefix_pages" in fields:
        return PoolTransferResult(kv_hit_pages, hits, restorable)
    return PoolTransferResult(kv_hit_pages, hits)


def pool_name(pool_name: Any) -> str:
    return str(getattr(pool_name, "value", pool_name))
