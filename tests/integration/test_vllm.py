"""Real vLLM 0.32 (CPU) generating tokens with kvconnect's native connector.

Real: ``vllm.LLM`` over a tiny random-weight Llama built here (nothing downloaded), the
connector loaded out of tree (``kv_connector_module_path``), the real stores: ``memory``,
``hf3fs`` (POSIX files + the real metadata service shared by two vLLM processes) and
``peer_rdma`` (two vLLM processes, each a pool node, in a loopback-only network namespace;
the second reads the first's memory through the Mooncake Transfer Engine over TCP).

Each test checks what vLLM itself reports: ``vllm:external_prefix_cache_hits`` (tokens the
connector supplied), and that the greedy tokens of a store hit equal those of a cold run.
A store that starts failing mid-run (``FaultyStore`` with a ``fault_flag``: lookups still answer,
loads raise) turns into load errors that vLLM recomputes, with the same tokens.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvconnect.connectors.testing.vllm import VLLMProcess, connector_config, flag_fail, prompts, vllm_skip_reason

pytestmark = pytest.mark.skipif(vllm_skip_reason() is not None, reason=vllm_skip_reason() or "")

BLOCK = 32


def usable_tokens(reply: dict) -> int:
    """Tokens a store can supply: full blocks before the prompt's last token."""
    return sum((n - 1) // BLOCK * BLOCK for n in reply["prompt_tokens"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_hit(cold: dict, hit: dict) -> None:
    assert cold["external_hits"] == 0
    assert hit["external_hits"] == usable_tokens(hit) > 0, hit
    assert hit["local_hits"] == 0
    assert hit["tokens"] == cold["tokens"]


def check_failure_recomputed(vllm: VLLMProcess, flag: Path, ps: list[str], cold: dict) -> None:
    """With loads failing, vLLM is promised the pages, fails to load them, recomputes."""
    before = vllm.worker_report()
    flag.touch()
    try:
        assert vllm.call("reset")["reset"]
        out = vllm.generate(ps)
    finally:
        flag.unlink()
    after = vllm.worker_report()
    assert out["tokens"] == cold["tokens"]
    assert after["load_error_pages"] - before["load_error_pages"] == usable_tokens(out) // BLOCK
    assert after["loaded_pages"] == before["loaded_pages"]
    assert after["errors"].get("vllm.load", 0) > before["errors"].get("vllm.load", 0)


def test_memory_store_hit_and_failure_in_one_vllm(model, tmp_path):
    flag = tmp_path / "fail"
    ktc = connector_config(flag_fail("memory", {"capacity": "256mb"}, flag))
    ps = prompts(1)
    with VLLMProcess(model, tmp_path / "vllm.log", ktc) as v:
        cold = v.generate(ps)                   # empty store: computed, then saved
        assert v.call("reset")["reset"]         # vLLM's own prefix cache emptied
        hit = v.generate(ps)
        check_hit(cold, hit)
        rep = v.worker_report()
        assert rep["saved_pages"] == rep["loaded_pages"] == usable_tokens(hit) // BLOCK
        check_failure_recomputed(v, flag, ps, cold)


def test_hf3fs_two_vllm_processes_share_one_metadata_service(model, tmp_path):
    from kvconnect.connectors.testing.hf3fs import MetaProcess

    meta = MetaProcess(tmp_path / "meta").start()
    try:
        opts = {"file_path_prefix": str(tmp_path / "kv"), "file_size": "256mb", "numjobs": 2, "entries": 8,
                "metadata_server_url": meta.url}
        flag = tmp_path / "fail"
        ps = prompts(2)
        with VLLMProcess(model, tmp_path / "a.log", connector_config({"store": "hf3fs", **opts})) as a:
            cold = a.generate(ps)
            assert a.worker_report()["saved_pages"] == usable_tokens(cold) // BLOCK
            with VLLMProcess(model, tmp_path / "b.log", connector_config(flag_fail("hf3fs", opts, flag))) as b:
                hit = b.generate(ps)            # prefilled by A: a store hit in B
                check_hit(cold, hit)
                check_failure_recomputed(b, flag, ps, cold)
                # The metadata service dies: lookups are misses, B computes, same tokens.
                meta.kill9()
                assert b.call("reset")["reset"]
                down = b.generate(ps)
                assert down["external_hits"] == 0 and down["tokens"] == cold["tokens"]
    finally:
        meta.stop()


def test_peer_rdma_second_vllm_reads_the_first_ones_memory(model, tmp_path):
    from kvconnect.connectors.testing.netns import loopback_ns
    from kvconnect.connectors.testing.peer import skip_reason

    why = skip_reason("mooncake")
    if why:
        pytest.skip(why)
    port = free_port()
    base = {"discovery_addr": f"127.0.0.1:{port}", "protocol": "rdma", "local_hostname": "127.0.0.1",
            "global_segment_size": "64mb", "bounce_buffer_size": "16mb"}
    env = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    flag = tmp_path / "fail"
    ps = prompts(3)
    with loopback_ns() as ns:
        with VLLMProcess(model, tmp_path / "a.log", connector_config({"store": "peer_rdma", **base,
                                                                        "control_port": port}),
                         ns=ns, env=env) as a:
            cold = a.generate(ps)               # pages in A's own segment
            b_opts = {**base, "control_port": 0}
            with VLLMProcess(model, tmp_path / "b.log", connector_config(flag_fail("peer_rdma", b_opts, flag)),
                             ns=ns, env=env) as b:
                hit = b.generate(ps)            # read from A's memory over the Transfer Engine
                check_hit(cold, hit)
                st = b.worker_report()["store_stats"]
                assert st["get_hits"] == usable_tokens(hit) // BLOCK
                check_failure_recomputed(b, flag, ps, cold)
    assert os.path.exists(tmp_path / "b.log")


@pytest.mark.parametrize("ktc, message", [
    ({**connector_config({"store": "memory"}), "kv_load_failure_policy": "fail"},
     "config key 'kv_load_failure_policy'.*accepted: 'recompute'"),
    (connector_config({"store": "hf3fs", "file_path_prefix": "/tmp/x", "file_size": "1gb", "numjobs": 1,
                       "entries": 1, "num_jobs": 2}),
     "config key 'num_jobs': unknown key.*'numjobs'"),
], ids=["failure-policy", "unknown-store-option"])
def test_bad_config_stops_vllm_at_start_naming_the_key(model, tmp_path, ktc, message):
    import re

    with pytest.raises(RuntimeError) as e:
        VLLMProcess(model, tmp_path / "vllm.log", ktc).close()
    assert re.search(message, str(e.value)), str(e.value)[-2000:]


def test_mooncake_store_second_vllm_reads_what_the_first_wrote(model, tmp_path):
    """A real ``mooncake_master`` in a loopback netns; both vLLM processes are store clients
    lending a segment; B reads A's pages through the Transfer Engine (TCP)."""
    from kvconnect.connectors.testing.mooncake import MooncakeCluster
    from kvconnect.connectors.testing.mooncake import mooncake_skip_reason

    why = mooncake_skip_reason()
    if why:
        pytest.skip(why)
    cluster = MooncakeCluster(lease_ttl_ms=500, log_dir=tmp_path)
    try:
        opts = {"master_server_address": cluster.master.address, "metadata_server": "P2PHANDSHAKE",
                "local_hostname": "127.0.0.1", "protocol": "tcp", "global_segment_size": "64mb",
                "local_buffer_size": "16mb", "staging_size": "16mb", "setup_timeout": 15, "op_timeout": 5}
        ns = cluster.netns.name
        env = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
        ps = prompts(6)
        with VLLMProcess(model, tmp_path / "a.log", connector_config({"store": "mooncake", **opts}),
                         ns=ns, env=env) as a:
            cold = a.generate(ps)
            assert a.worker_report()["saved_pages"] == usable_tokens(cold) // BLOCK
            with VLLMProcess(model, tmp_path / "b.log", connector_config({"store": "mooncake", **opts}),
                             ns=ns, env=env) as b:
                hit = b.generate(ps)
                check_hit(cold, hit)
    finally:
        cluster.close()


_RANKS_CHECK = """
import json
from types import SimpleNamespace as NS
import torch
from kvconnect.connectors.errors import MissingCapability
from kvconnect.connectors.engines.vllm_native import KVConnectConnector, KVConnectorRole

def config(store, tp, pp=1):
    spec = NS(num_kv_heads=2, head_size=16, block_size=32, dtype=torch.bfloat16, use_mla=False)
    vc = NS(kv_transfer_config=NS(kv_load_failure_policy="recompute", kv_connector_extra_config={"store": store}),
            model_config=NS(served_model_name="tiny", model="tiny", get_total_num_hidden_layers=lambda: 2),
            parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp), cache_config=NS(cache_dtype="auto"))
    return vc, NS(kv_cache_groups=[NS(kv_cache_spec=spec)])

out = {}
for tp in (1, 2):
    vllm_config, kv_cache_config = config("memory", tp)
    try:
        KVConnectConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        out[f"memory-tp{tp}"] = "ok"
    except MissingCapability as e:
        out[f"memory-tp{tp}"] = str(e)
vllm_config, kv_cache_config = config("kvconnect.connectors.testing.stores:SharedMemoryStore", 2)
ctx = KVConnectConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config).store.context
out["shared-tp2"] = [ctx.tp_rank, ctx.tp_size, ctx.pp_size, ctx.cross_rank_lookups]
print("RESULT " + json.dumps(out))
"""


def test_tp2_hands_the_ranks_to_a_shared_store_and_refuses_memory(tmp_path):
    """The connector itself in vLLM's environment (no engine started): with TP 2 its store gets
    the ranks in its EngineContext and must be shared; ``memory`` is refused naming the capability."""
    import json
    import subprocess

    from kvconnect.connectors.testing.processes import child_env
    from kvconnect.connectors.testing.vllm import REPO_ROOT, VLLM_PY

    r = subprocess.run([str(VLLM_PY), "-c", _RANKS_CHECK], cwd=str(REPO_ROOT), env=child_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["memory-tp1"] == "ok"
    assert "'memory' does not have the capability 'shared'" in out["memory-tp2"] and "TP 2" in out["memory-tp2"]
    assert out["shared-tp2"] == [0, 2, 1, True]
