"""Pages shared between vLLM and SGLang HiCache, byte for byte.

When a page is shared (docs/vllm.md, "Sharing pages with SGLang"): same model name, same
tenant and salt, SGLang's page hash (what the vLLM connector uses), vLLM block size = SGLang
page size, same KV dtype, same per-rank geometry (layers, KV heads, head dim) and ranks, an
MHA model, and the vLLM connector's ``page_layout`` = the SGLang host layout
(``layer_first`` or ``page_first``): then both adapters use one key space and one byte order.

Real: vLLM 0.32 on CPU (two processes) with the native connector, SGLang 0.5.23's storage
factory and a real ``MHATokenToKVPoolHost`` (layer_first) on CPU with kvconnect's HiCache
adapter, one ``hf3fs`` store (POSIX files + the real metadata service). The KV bytes come
from vLLM (SGLang cannot run the model here): vLLM A prefills; SGLang finds A's pages under
its own hashes (``get_hash_str``), reads them into its host pool, the store's copies are
deleted and SGLang writes them back from its pool; vLLM B then loads the SGLang-written
pages (vLLM reports the hits) and generates the tokens of a cold run.
"""

from __future__ import annotations

import pytest

from kvconnect.connectors.testing.vllm import VLLMProcess, connector_config, vllm_skip_reason

pytestmark = pytest.mark.skipif(vllm_skip_reason() is not None, reason=vllm_skip_reason() or "")

BLOCK = 32
MODEL_NAME = "tiny-llama"


def test_sglang_written_pages_are_read_by_vllm_byte_exact(model, tmp_path):  # noqa: F811
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvconnect.connectors.testing.sglang import make_cpu_host_pool, page_bytes
    from kvconnect.connectors.engines.vllm_pages import PageGeometry
    from kvconnect.connectors.testing.vllm import prompt_text
    from kvconnect.connectors.registry import create_store
    from kvconnect.connectors.testing.hf3fs import MetaProcess

    meta = MetaProcess(tmp_path / "meta").start()
    try:
        opts = {"file_path_prefix": str(tmp_path / "kv"), "file_size": "256mb", "numjobs": 2, "entries": 8,
                "metadata_server_url": meta.url}
        ktc = connector_config({"store": "hf3fs", **opts, "model_name": MODEL_NAME, "page_layout": "layer_first"})
        prompt = prompt_text(77, 300)
        with VLLMProcess(model, tmp_path / "a.log", ktc) as a:
            cold = a.generate([prompt])
        ids = cold["prompt_ids"][0]
        n = (len(ids) - 1) // BLOCK

        # SGLang, with its own hash function, host pool and factory, over the same store.
        keys = get_hash_str(ids, None, page_size=BLOCK)[:n]
        host = make_cpu_host_pool("layer_first", page_size=BLOCK, layer_num=2, head_num=2, head_dim=64,
                                  dtype="bfloat16", host_tokens=BLOCK * (n + 2))
        extra = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
                 "class_name": "KVConnectStorage", "interface_v1": 1, "store": "hf3fs", **opts}
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                   is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name=MODEL_NAME, extra_config=extra)
        sg = StorageBackendFactory.create_backend("dynamic", cfg, host)
        sg.register_mem_pool_host(host)
        sg.on_host_pools_registered()
        try:
            assert sg.batch_exists(keys) == n > 0  # vLLM's pages, found under SGLang's keys
            idx = host.alloc(n * BLOCK)
            assert sg.batch_get_v1(keys, idx) == [True] * n
            in_pool = [page_bytes(host, idx[i * BLOCK]) for i in range(n)]

            # The same pages as the vLLM connector keys them, read raw from the store.
            geo = PageGeometry(layers=2, kv_heads=2, head_dim=64, block_size=BLOCK, dtype="bfloat16",
                               itemsize=2, layout="layer_first")
            skeys = geo.keyspace(model=MODEL_NAME).keys(keys)
            raw = create_store("hf3fs", opts)
            try:
                def read_raw() -> list[bytes]:
                    bufs = [torch.empty(geo.page_nbytes, dtype=torch.uint8) for _ in skeys]
                    assert raw.get_into(skeys, [[(b.data_ptr(), geo.page_nbytes)] for b in bufs]) == [True] * n
                    return [b.numpy().tobytes() for b in bufs]

                vllm_written = read_raw()
                assert vllm_written == in_pool and len(set(in_pool)) == n  # byte-exact, distinct pages
                assert raw.delete(skeys) == [True] * n
                assert sg.batch_exists(keys) == 0
                assert sg.batch_set_v1(keys, idx) == [True] * n  # SGLang writes from its host pool
                assert read_raw() == vllm_written
            finally:
                raw.close()
        finally:
            sg.close()

        with VLLMProcess(model, tmp_path / "b.log", ktc) as b:
            hit = b.generate([prompt])
            rep = b.worker_report()
        assert hit["external_hits"] == n * BLOCK and hit["local_hits"] == 0
        assert rep["loaded_pages"] == n and rep["load_error_pages"] == 0
        assert hit["tokens"] == cold["tokens"]
    finally:
        meta.stop()
