"""The CPU stand-in for SGLang's server (``kvconnect.connectors.testing.launch_server``) with
``--enable-lmcache``, against a real ``lmcache server``, as ``benchmarks/gpu/run_e2e.sh`` would run
SGLang's ``LMCRadixCache`` against one."""

from __future__ import annotations

import json
import random
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kvconnect.connectors.testing.processes import free_port, stop, wait_for
from kvconnect.connectors.testing.standin import cached, free_offset
from kvconnect.connectors.testing.standin import post_ok as _post_ok
from kvconnect.connectors.testing.standin import start as _standin

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base",
                    reason="needs lmcache (pip install \"kvconnect[lmcache]\")")
pytest.importorskip("grpc", reason="the HF3FS metadata service needs grpcio")

from kvconnect.connectors.testing.hf3fs import MetaProcess  # noqa: E402
from kvconnect.connectors.testing.lmcache import Server, l2_writes  # noqa: E402


def _generate(port: int, ids: list[int], timeout: float = 60) -> dict:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _lmcache_standin(tmp_path: Path, name: str, rpc_port: int) -> tuple[subprocess.Popen, int]:
    """The stand-in with ``--enable-lmcache``, its YAML naming the server as SGLang's may (``tcp://`` host)."""
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(f"mp_host: tcp://127.0.0.1\nmp_port: {rpc_port}\n")
    port = free_offset([30000], rpc_port) + 30000
    return _standin(tmp_path, port, "--enable-lmcache", "--lmcache-config-file", str(cfg), "--us-per-token",
                    "1000"), port


@pytest.mark.timeout(180)
def test_standin_lmcache_hits_the_lmcache_server_across_restarts(tmp_path):
    """The stand-in with ``--enable-lmcache``, as SGLang's ``LMCRadixCache``: GPU prefix first, then
    LOOKUP/RETRIEVE at a standalone ``lmcache server``, STORE after the response. Mocked: the GPU and
    the model (the stand-in stands for SGLang; its KV bytes derive from the tokens, its output tokens
    are a digest of the KV it holds). Real: the ``lmcache server`` with kvconnect's L2 plugin over
    kvconnect's hf3fs store (files under tmp_path, its index in a real metadata service process, so
    the store outlives the server), LMCache's engine client and protocol (CPU KV shared over POSIX
    SHM, whose checksums after a RETRIEVE must be those of the KV the prompt should have). A cold
    prompt misses, again it is a device hit, after a flush an LMCache hit with the cold output; after
    restarting both servers (a fresh LMCache L1) it is an LMCache hit from the L2, still with the cold
    output; an unseen prompt misses. A stand-in whose server is not listening answers a cold prompt
    in bounded time, with the same output."""
    rnd = random.Random(7)
    prompt, unseen = ([rnd.randrange(1, 120000) for _ in range(600)] for _ in range(2))
    lm_tokens, gpu_tokens = 512, cached(600)  # LMCache's two 256-token chunks; the stand-in's 9 pages
    meta = MetaProcess(tmp_path / "meta").start()
    params = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "kv"), "file_size": "64mb", "numjobs": 2,
              "entries": 8, "metadata_server_url": meta.url}
    servers, standins = [], []

    def details(r: dict) -> tuple:
        d = r["meta_info"]["cached_tokens_details"]
        return r["meta_info"]["cached_tokens"], d and (d["device"], d["host"], d["storage"], d["storage_backend"])

    try:
        servers.append(Server(params, tmp_path / "lmcache-a.log"))
        servers[0].wait_healthy()
        proc, port = _lmcache_standin(tmp_path, "a", servers[0].port)
        standins.append(proc)
        cold = _generate(port, prompt)
        assert details(cold) == (0, None) and len(cold["output_ids"]) == 8
        again = _generate(port, prompt)
        assert details(again) == (gpu_tokens, (gpu_tokens, 0, 0, "lmcache"))
        assert again["output_ids"] == cold["output_ids"]
        flush = urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache", method="POST")
        assert wait_for(lambda: _post_ok(flush), 30, 0.1)  # 400 until the STORE is done
        hit = _generate(port, prompt)
        assert details(hit) == (lm_tokens, (0, lm_tokens, 0, "lmcache")), hit
        assert hit["output_ids"] == cold["output_ids"]
        # the hit skipped 512 tokens of simulated prefill (1 ms each)
        assert hit["meta_info"]["e2e_latency"] < cold["meta_info"]["e2e_latency"] - 0.3
        assert wait_for(lambda: l2_writes(servers[0]) >= 2, 30, 0.2)  # both chunks reached the hf3fs store
        assert servers[0].adapter_status()["store_stats"]["put_failed"] == 0

        stop(standins.pop())
        assert servers[0].stop() is not None
        servers.append(Server(params, tmp_path / "lmcache-b.log"))  # a new process: its L1 is empty
        servers[1].wait_healthy()
        proc, port = _lmcache_standin(tmp_path, "b", servers[1].port)
        standins.append(proc)
        restarted = _generate(port, prompt)
        assert details(restarted) == (lm_tokens, (0, lm_tokens, 0, "lmcache")), restarted
        assert restarted["output_ids"] == cold["output_ids"]
        other = _generate(port, unseen)
        assert details(other) == (0, None) and other["output_ids"] != cold["output_ids"]
        stop(standins.pop())

        dead = free_port()  # nothing listens there
        proc, port = _lmcache_standin(tmp_path, "dead", dead)
        standins.append(proc)
        t0 = time.monotonic()
        lone = _generate(port, prompt, timeout=20)
        assert time.monotonic() - t0 < 15
        assert details(lone) == (0, None) and lone["output_ids"] == cold["output_ids"]
    finally:
        for p in standins:
            stop(p)
        for s in servers:
            s.stop()
        meta.stop()


@pytest.mark.timeout(120)
def test_standin_lmcache_chunk_that_arrives_wrong_changes_the_output(tmp_path, monkeypatch, capsys):
    """The stand-in's LMCache engine in this process, against a real ``lmcache server`` (its L1 only):
    a prompt STOREd with other bytes in one layer (as if the server handed back another chunk's KV)
    is still an LMCache hit, but the RETRIEVEd chunks' checksums differ from the expected ones: the
    mismatch is logged and the output digest differs from the one the right KV gives. Mocked: the
    GPU and the model. Real: the server, LMCache's engine client, its SHM transfers and checksums."""
    from kvconnect.connectors.testing.launch_server import LMCacheEngine, LMCacheTier, parser

    server = Server(None, tmp_path / "lmcache.log")
    engine = None
    try:
        server.wait_healthy()
        cfg = tmp_path / "mp.yaml"
        cfg.write_text(f"mp_host: 127.0.0.1\nmp_port: {server.port}\n")
        engine = LMCacheEngine(parser().parse_args(["--enable-lmcache", "--lmcache-config-file", str(cfg),
                                                    "--page-size", "64", "--us-per-token", "0"]))
        # connected before the first prompt: a request waits at most CONNECT_WAIT_S (3 s) for the
        # first connection, which a loaded machine can exceed; this test is about the bytes
        engine.tier.first_connect.join(60)
        assert engine.tier.client is not None, "the stand-in did not connect to the lmcache server"
        rnd = random.Random(11)
        right, wrong = ([rnd.randrange(1, 120000) for _ in range(600)] for _ in range(2))
        truth = LMCacheTier.chunk_bytes
        monkeypatch.setattr(engine.tier, "chunk_bytes",
                            lambda key, layer, n: truth(key + "/other" * (layer == 1), layer, n))
        _, cold_wrong = engine.prefill(wrong)  # STOREd with layer 1 of each chunk wrong
        assert wait_for(lambda: engine.flush() is None, 30, 0.1)
        monkeypatch.undo()
        _, cold_right = engine.prefill(right)
        assert wait_for(lambda: engine.flush() is None, 30, 0.1)
        capsys.readouterr()
        counts, hit_right = engine.prefill(right)
        assert counts == {"device": 0, "host": 512, "storage": 0} and hit_right == cold_right
        assert "arrived wrong" not in capsys.readouterr().out
        counts, hit_wrong = engine.prefill(wrong)
        assert counts == {"device": 0, "host": 512, "storage": 0} and hit_wrong != cold_wrong
        assert "token ranges [(0, 256), (256, 512)] arrived wrong" in capsys.readouterr().out
    finally:
        if engine is not None:
            engine.close()
        server.stop()
