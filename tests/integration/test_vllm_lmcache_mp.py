"""Real vLLM 0.32 (CPU) through LMCache's multi-process mode onto a kvconnect store.

Real: ``lmcache server`` 0.5.6 (``--supported-transfer-mode engine_driven``: the CPU path,
where the vLLM worker packs KV into CPU buffers and commits them over ZMQ) with kvconnect's
``--l2-adapter`` plugin; vLLM's ``LMCacheMPConnector`` (which hands off to LMCache's own
client); two vLLM processes. ``--l2-store-policy skip_l1`` drops a chunk from LMCache's L1
once the kvconnect store holds it, so the second process's hit is served by the store: the
adapter's ``get_hits`` count it, and vLLM reports the external hit tokens.
"""

from __future__ import annotations

import pytest

from kvconnect.connectors.testing.harness import harness_class
from kvconnect.connectors.testing.lmcache import Server
from kvconnect.connectors.testing.vllm import VLLMProcess, prompts, vllm_skip_reason

pytestmark = pytest.mark.skipif(vllm_skip_reason() is not None, reason=vllm_skip_reason() or "")

CHUNK = 64  # LMCache chunk, a multiple of vLLM's CPU block (32)


def mp_config(server: Server) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port,
                                          "lmcache.mp.mq_timeout": 60}}


@pytest.mark.parametrize("store", ["memory", "hf3fs"])
def test_vllm_lmcache_mp_server_serves_hits_from_the_kvconnect_store(model, tmp_path, store):  # noqa: F811
    """The store as its harness runs it, in the one ``lmcache server`` process (the two
    stores whose clients may run in this namespace)."""
    with harness_class(store)(tmp_path / "harness") as harness:
        _serve_hits(model, harness.options(0), tmp_path)


def _serve_hits(model, params: dict, tmp_path) -> None:
    server = Server(params, tmp_path / "server.log", "--chunk-size", str(CHUNK),
                    "--supported-transfer-mode", "engine_driven", "--l2-store-policy", "skip_l1")
    try:
        server.wait_healthy()
        ps = prompts(4, words=320)
        with VLLMProcess(model, tmp_path / "a.log", mp_config(server)) as a:
            cold = a.generate(ps)
            assert cold["external_hits"] == 0
            # LMCache stores after the step: one more (unrelated) request drives it.
            a.generate(prompts(5, n=1, words=40), max_tokens=1)
        stored = server.adapter_status()["store_stats"]["put_written"]
        assert stored > 0, server.log()[-3000:]
        with VLLMProcess(model, tmp_path / "b.log", mp_config(server)) as b:
            hit = b.generate(ps)
        # LMCache supplies every prompt token but the last (it keeps a trailing partial chunk too).
        assert hit["external_hits"] == sum(n - 1 for n in hit["prompt_tokens"]) > 0, hit
        assert hit["local_hits"] == 0
        assert hit["tokens"] == cold["tokens"]
        st = server.adapter_status()
        assert st["store_stats"]["get_hits"] > 0 and st["errors"] == {}
    finally:
        server.stop()
