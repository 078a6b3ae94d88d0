"""The model both CPU stand-ins for SGLang's server serve, and how they reach an L3 backend.

Pages are keyed like SGLang's (chained hashes of page tokens); a computed page's bytes are derived
from its key; generated tokens are a digest of every page's bytes, so a wrong or torn page read from
a store changes the output, as wrong KV does on a GPU. The backend is built by SGLang's own storage
factory on a real host pool and called the way SGLang's HiCacheController calls it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

VOCAB = 128000
# SGLang's HiCacheController: these backends (and ``dynamic`` ones with ``interface_v1``) get the
# zero-copy v1 calls, the others the generic page copies
ZERO_COPY_BACKENDS = {"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm", "mori", "tensorcast", "seaweedfs"}


def page_keys(ids: list[int], page: int, spare_last: bool = False) -> list[str]:
    """Chained page hashes of the full pages of ``ids`` (of all tokens but the last with
    ``spare_last``, as SGLang caches them)."""
    keys, prior = [], b""
    usable = (max(0, len(ids) - 1) if spare_last else len(ids)) // page
    for i in range(usable):
        prior = hashlib.sha256(prior + json.dumps(ids[i * page:(i + 1) * page]).encode()).digest()
        keys.append(prior.hex())
    return keys


def page_bytes(key: str, nbytes: int) -> bytes:
    """The bytes a computed page holds: derived from its key."""
    return (hashlib.sha256(key.encode()).digest() * (nbytes // 32 + 1))[:nbytes]


def output_tokens(digest: bytes, n: int) -> list[int]:
    return [int.from_bytes(hashlib.sha256(digest + j.to_bytes(4, "little")).digest()[:4], "little") % VOCAB + 1
            for j in range(n)]


def attach_backend(host: Any, backend: str, extra: dict, model_name: str, page_first: bool) -> tuple[Any, bool]:
    """(backend, zero_copy): SGLang's storage factory on ``host``, as its runtime attach does."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=page_first,
                               model_name=model_name, extra_config=dict(extra))
    b = StorageBackendFactory.create_backend(backend, cfg, host)
    b.register_mem_pool_host(host)
    return b, backend in ZERO_COPY_BACKENDS or (backend == "dynamic" and bool(extra.get("interface_v1")))


def read_into_host(host: Any, backend: Any, zero_copy: bool, keys: list[str], idx: Any, page: int) -> list[bool]:
    """Load ``keys`` into the host pool pages at ``idx``; per key, whether it loaded."""
    if zero_copy:
        return list(backend.batch_get_v1(keys, idx))
    data = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) or []
    ok = []
    for i, flat in enumerate(data):
        if flat is None:
            break
        host.set_from_flat_data_page(int(idx[i * page]), flat)
        ok.append(True)
    return ok + [False] * (len(keys) - len(ok))


def write_from_host(host: Any, backend: Any, zero_copy: bool, keys: list[str], idx: Any, page: int) -> None:
    """Store the host pool pages at ``idx`` under ``keys``."""
    if zero_copy:
        backend.batch_set_v1(keys, idx)
    else:
        backend.batch_set(keys, [host.get_data_page(int(idx[i * page])) for i in range(len(keys))])
