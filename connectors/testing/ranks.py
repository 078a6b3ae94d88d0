"""Several SGLang rank processes sharing one store, each as SGLang builds its L3 backend.

Every process is one TP rank of one or more engines. For each engine it builds a real
SGLang host KV pool on CPU (MHA: per-rank KV; MLA: rank-replicated KV) and a real
``MambaPoolHost`` side pool (TP-sharded state even under MLA), the storage config SGLang
gives that rank, and kvconnect's backend through SGLang's own
``StorageBackendFactory.create_backend("dynamic", ...)``, then registers the pools as
``HiCacheController.attach_storage_backend`` does (``register_mem_pool_host``,
``register_mem_host_pool_v2`` for every pool, ``on_host_pools_registered``).

``RankProcess`` starts ``python -m kvconnect.connectors.testing.ranks SPEC`` (inside a
network namespace when given one) and drives it with JSON lines: ``write`` / ``read`` pages
of a pool (through ``batch_set_v1`` / ``batch_get_v1`` for KV and the v2 calls for side
pools, exactly as SGLang's controller calls them), ``exists``, ``delete``, ``clear``,
``stats``. Page bytes are a pure function of (engine, rank, seed): a read that returns
another rank's or another engine's bytes shows as a digest mismatch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kvconnect.connectors.testing.processes import JsonWorker, python, serve_json_lines


class RankProcess(JsonWorker):
    """One SGLang rank process (``engines``: ``[{"name", "model", "mla", "tp_rank", "tp_size", ...}]``)."""

    def __init__(self, name: str, store: str, options: dict, engines: list[dict], *,
                 prefix: list[str] | None = None, log_dir: Path | None = None):
        spec = json.dumps({"store": store, "options": options, "engines": engines})
        super().__init__([python(), "-u", "-m", "kvconnect.connectors.testing.ranks", spec], name=name,
                         log_dir=log_dir, prefix=prefix)

    def write(self, engine: str, pool: str, keys: list[str], seed: int) -> dict:
        return self.call("write", engine=engine, pool=pool, keys=keys, seed=seed)

    def read(self, engine: str, pool: str, keys: list[str]) -> dict:
        return self.call("read", engine=engine, pool=pool, keys=keys)


# ---------------------------------------------------------------------------------
# The rank process
# ---------------------------------------------------------------------------------


class RankEngine:
    """One engine's backend on this rank, with its KV and Mamba host pools."""

    def __init__(self, store: str, options: dict, spec: dict):
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        from kvconnect.connectors.testing.sglang import make_cpu_host_pool, make_cpu_mamba_pool, storage_config

        self.spec = spec
        layout = spec.get("layout", "page_first")
        self.kv = make_cpu_host_pool(layout, page_size=spec.get("page_size", 4), layer_num=spec.get("layers", 2),
                                     head_num=2, head_dim=16, mla=bool(spec.get("mla")),
                                     host_tokens=spec.get("host_pages", 64) * spec.get("page_size", 4))
        self.mamba = make_cpu_mamba_pool(slots=spec.get("host_pages", 64)) if spec.get("mamba", True) else None
        config = storage_config(
            extra_config={"store": store, **options}, model_name=spec["model"], layout=layout,
            tp_rank=spec["tp_rank"], tp_size=spec["tp_size"], is_mla_model=bool(spec.get("mla")),
            **{k: spec[k] for k in ("pp_rank", "pp_size", "dp_rank", "dcp_rank", "dcp_size") if k in spec})
        self.backend = StorageBackendFactory.create_backend("dynamic", config, self.kv)
        self.backend.register_mem_pool_host(self.kv)
        self.backend.register_mem_host_pool_v2(self.kv, PoolName.KV)
        if self.mamba is not None:
            self.backend.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
        self.backend.on_host_pools_registered()
        self.PoolName = PoolName

    def _pool(self, pool: str) -> Any:
        return self.kv if pool == "kv" else self.mamba

    def _alloc(self, pool: str, n: int) -> Any:
        host = self._pool(pool)
        idx = host.alloc(n * host.page_size)
        if idx is None:
            raise RuntimeError(f"{pool} host pool full")
        return idx

    def _digests(self, pool: str, idx: Any) -> list[str]:
        from kvconnect.connectors.testing.sglang import page_bytes

        host = self._pool(pool)
        return [hashlib.blake2b(page_bytes(host, int(idx[i * host.page_size])), digest_size=16).hexdigest()
                for i in range(len(idx) // host.page_size)]

    def write(self, pool: str, keys: list[str], seed: int) -> dict:
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        from kvconnect.connectors.testing.sglang import fill_pages

        host = self._pool(pool)
        idx = self._alloc(pool, len(keys))
        try:
            fill_pages(host, idx, seed)
            digests = self._digests(pool, idx)
            if pool == "kv":
                ok = list(self.backend.batch_set_v1(keys, idx))
            else:
                ok = list(self.backend.batch_set_v2([PoolTransfer(self.PoolName.MAMBA, idx, keys=keys)])
                          [self.PoolName.MAMBA])
            return {"ok": ok, "digests": digests}
        finally:
            host.free(idx)

    def read(self, pool: str, keys: list[str]) -> dict:
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        from kvconnect.connectors.testing.sglang import zero_pages

        host = self._pool(pool)
        idx = self._alloc(pool, len(keys))
        try:
            zero_pages(host, idx)
            if pool == "kv":
                ok = list(self.backend.batch_get_v1(keys, idx))
            else:
                ok = list(self.backend.batch_get_v2([PoolTransfer(self.PoolName.MAMBA, idx, keys=keys)])
                          [self.PoolName.MAMBA])
            return {"ok": ok, "digests": self._digests(pool, idx)}
        finally:
            host.free(idx)

    def stats(self) -> dict:
        s = self.backend.kvconnect_stats()
        return {"store": s["store"], "adapter_errors": s["adapter_errors"], "keyspaces": s["keyspaces"]}


def rank_main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(sys.argv[1])
    engines: dict[str, RankEngine] = {}

    def ready() -> dict:
        for e in spec["engines"]:
            engines[e["name"]] = RankEngine(spec["store"], spec["options"], e)
        return {"engines": sorted(engines)}

    serve_json_lines(ready, {
        "write": lambda engine, pool, keys, seed: engines[engine].write(pool, keys, seed),
        "read": lambda engine, pool, keys: engines[engine].read(pool, keys),
        "exists": lambda engine, keys: {"hits": engines[engine].backend.batch_exists(keys)},
        "delete": lambda engine, keys: {"deleted": engines[engine].backend.batch_delete(keys)},
        "clear": lambda engine: {"cleared": engines[engine].backend.clear()},
        "stats": lambda engine: engines[engine].stats(),
    }, on_exit=lambda: [e.backend.close() for e in engines.values()])


if __name__ == "__main__":
    rank_main()
