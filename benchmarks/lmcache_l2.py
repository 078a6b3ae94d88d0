"""LMCache L2 benchmark: kvconnect stores as ``lmcache server`` L2 plugins vs LMCache's own
adapters, through ``lmcache bench l2`` (LMCache 0.5.6), in one run.

* ``hf3fs`` (kvconnect HF3FS store, POSIX client, in-process index) vs LMCache's built-in
  ``fs`` adapter (Python, a file per chunk) and vs its ``fs_native`` adapter (C++ workers,
  ``lmcache.lmcache_fs``), all writing under the same directory (the target: hf3fs >= 1.0x);
* ``memory`` (kvconnect in-process store) vs LMCache's ``mock`` adapter (an in-memory dict
  of cloned tensors, bandwidth limit set far above memcpy);
* ``mooncake`` (a real ``mooncake_master`` in a loopback-only network namespace, TCP) vs
  LMCache's ``mooncake_store`` on the same master, lending the same segment: LMCache's own
  ``NativeConnectorL2Adapter`` (what its ``mooncake_store`` factory returns) over a Python
  rendering of its C++ connector, the same per-key ``RealClient`` calls on 4 workers
  (``kvconnect.connectors.testing.lmcache_mooncake_store``; the C++ connector is not in the
  wheel, see below), and the Mooncake client by itself on that master (``figures.mooncake_client``:
  per key on 4 threads, what the C++ connector does, and batch calls): the bound on
  ``mooncake_store``;
* ``peer_rdma`` (one pool node, TCP): figures only here; its counterpart ``p2p`` needs two
  servers (``--remote``).

Time to first chunk (``--ttfc``, on by default, also in ``--quick``): per system, the adapter
LMCache's factory builds from the same JSON, one prompt's chunks stored, then LMCache's
lookup-and-lock of the whole prompt and one load task per chunk in prompt order: the time from
the lookup's submission to the first chunk in L1 and to the whole prompt (``figures.ttfc``,
ratios ``<ours>_vs_<ref>.ttfc.*``, > 1: kvconnect is faster).

Remote reads between two ``lmcache server`` processes (``--remote``, on by default in the full
run): kvconnect ``peer_rdma`` (both servers in one pool, TCP) vs LMCache's ``p2p`` (a
``lmcache coordinator``; each server's P2P controller adds a ``p2p`` L2 adapter per peer, reading
the peer's L1 over the ``mooncake_te`` transfer channel, TCP), in one loopback-only network
namespace per system. Server A stores S prompts through LMCache's engine client; server B, whose
L1 has none of them, looks each one up (LMCache's lookup prefetches the hits from L2 into L1:
the time until a whole prompt's chunks are ready to load) and retrieves it, checksums compared
with A's. The engine client's prefetch-status polls run every 1 ms (as shipped it sleeps 50 ms
between them, which is where a ~55 ms lookup comes from, for any L2: measured too, as
``stock_client_l1_lookup_s``); the same lookup once B's L1 holds the prompt is the floor of
LMCache's server path, and ``l2_part_s`` (lookup minus floor) the L2 adapter's share;
``remote.bound``: the most any L2 adapter could gain over ``p2p`` on that path.

LMCache's ``mooncake_store`` and ``hf3fs`` adapters need C++ extensions
(``lmcache.lmcache_mooncake``, ``lmcache.lmcache_hf3fs``) that LMCache's PyPI wheel does not
ship (its sdist builds them only against Mooncake's ``mooncake-store`` headers and
``libmooncake_store``, and 3FS's ``libhf3fs_api_shared``, none of which any wheel ships): each
run tries to create both through LMCache's own adapter factory (``mooncake_store`` on the run's
``mooncake_master`` when ``mooncake`` runs) and records the error it gets in the JSON
(``figures.lmcache_native``, and the notes); ``hf3fs`` is compared with ``fs_native`` and ``fs``
instead, ``mooncake_store`` as above.

Each system runs the same ``lmcache bench l2`` invocation (store -> lookup -> load of the
same keys, round trip verified) in its own process; systems alternate (in reverse order every
other repeat, after one untimed run on each freshly started cluster) and repeat; the best round
per metric is kept (``figures.per_system``), and each repeat's figures too (``figures.per_repeat``;
``figures.per_repeat_ratios``: each pair's ratio within every repeat and their median).
``--stores mooncake_local``: kvconnect's ``mooncake`` with ``prefer_local_segment`` (puts into the
segment the LMCache server lends), against ``mooncake_store`` as well. Results:
benchmarks/results/lmcache_l2.json.

Every ``lmcache bench l2`` process stores the same keys with the same bytes (its keys and fill
pattern follow from the key index alone), and a Mooncake cluster keeps what a run put into the
segment holder after the run ends. Mooncake answers a put of a key it already holds with success
and moves no bytes, so a run would time free puts for every key an earlier run of the same
system left there. Before each run on a Mooncake cluster (warm-up included) the benchmark
therefore removes every object from it (``clear_mooncake``; ``--between-runs keep``: the old
behaviour, objects left in place).

    .venv/bin/python -m kvconnect.benchmarks.lmcache_l2 [--quick] [--dir DIR] [--stores memory,hf3fs,...] [--remote on|off]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is benchmarks/, whose mooncake.py would shadow the mooncake package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from kvconnect.benchmarks.harness import BenchResult  # noqa: E402

LMCACHE_BIN = str(Path(sys.executable).with_name("lmcache"))
PLUGIN = {"type": "plugin", "module_path": "kvconnect.connectors.engines.lmcache_l2", "class_name": "KVConnectL2Adapter"}
# Best round of a run (LMCache reports per-round min/max): on a shared box the round
# averages mostly measure the neighbours.
METRICS = [("Store", "store_MBps"), ("Load", "load_MBps"), ("Lookup", "lookup_keys_per_s")]
PAIRS = [("hf3fs", "fs"), ("hf3fs", "fs_native"), ("memory", "mock"), ("mooncake", "mooncake_store"),
         ("mooncake_local", "mooncake_store")]
# kvconnect's mooncake with prefer_local_segment: the LMCache server puts chunks into the segment it
# lends (a memcpy) instead of wherever the master places them (over the transport); LMCache's
# connector calls put_from with Mooncake's default ReplicateConfig and has no such option
VARIANTS = {"mooncake_local": ("mooncake", {"prefer_local_segment": True})}
# LMCache's mooncake_store: its NativeConnectorL2Adapter over a Python rendering of its C++
# connector (kvconnect.connectors.testing.lmcache_mooncake_store), on the mooncake run's master
MOONCAKE_STORE = {"type": "plugin", "module_path": "kvconnect.connectors.testing.lmcache_mooncake_store",
                  "class_name": "LMCacheMooncakeStoreL2Adapter"}
MOONCAKE_KEYS = ("master_server_address", "metadata_server", "local_hostname", "protocol", "global_segment_size",
                 "local_buffer_size")
REFERENCE = {"mooncake_store": "LMCache 0.5.6 'mooncake_store' (its NativeConnectorL2Adapter; connector in Python, "
                               "the C++ one is not in the wheel)"}
REPEATED = {x for pair in PAIRS for x in pair}  # compared pairs repeat; figures-only systems run once
MOONCAKE_SYSTEMS = {"mooncake", "mooncake_store", *VARIANTS}  # on the run's Mooncake cluster


def _env() -> dict[str, str]:
    return dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1",
                PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def run_bench(adapter: dict, shape: dict, prefix: list[str] | None = None, timeout: float = 240) -> dict:
    """One ``lmcache bench l2`` run; returns ``{metric: value}`` (raises if it failed)."""
    cmd = (prefix or []) + [
        LMCACHE_BIN, "bench", "l2", "--l2-adapter", json.dumps(adapter), "--num-keys", str(shape["keys"]),
        "--in-flight", str(shape["in_flight"]), "--data-size-kb", str(shape["size_kb"]),
        "--rounds", str(shape["rounds"]), "--warmup-rounds", "1", "--lookup-max-hit-rate", "1.0",
        "--no-skip-verify", "--format", "json"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    out = p.stdout
    start = out.find('{\n  "title"')
    if p.returncode != 0 or start < 0 or "data verified OK" not in out:
        raise RuntimeError(f"lmcache bench l2 failed (rc {p.returncode}) for {adapter.get('type')}:\n"
                           f"{(out + p.stderr)[-3000:]}")
    doc = json.loads(out[start:out.rindex("}") + 1])
    ops = {v["operation"]: v for k, v in doc["metrics"].items() if k.startswith("op_")}
    figures = {}
    for op, name in METRICS:
        o = ops[op]
        if o["total_success"] != o["total_keys"]:
            raise RuntimeError(f"{adapter}: {op} {o['total_success']}/{o['total_keys']} succeeded")
        if op == "Lookup":
            figures[name] = o["keys_per_round"] / (o["duration_min_ms"] / 1000) if o["duration_min_ms"] else 0.0
        else:
            figures[name] = o["throughput_max_mbps"]
    return figures


_CLEAR = r"""
import json, sys
from kvconnect.connectors.testing.lmcache_mooncake_store import open_client
client = open_client(json.loads(sys.argv[1]))
try:
    print("CLEARED", client.remove_all(True))
finally:
    client.close()
"""


def child_line(prefix: list[str], code: str, args: list[str], marker: str,
               timeout: float) -> tuple[str | None, int, str]:
    """Runs ``code`` in a Python child inside ``prefix``'s namespace; (the rest of its first stdout
    line starting with ``marker`` and a space, or None; its exit code; its rc and the tail of what
    it printed, for an error)."""
    p = subprocess.run(prefix + [sys.executable, "-c", code, *args], env=_env(), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(marker + " ")), None)
    return (None if line is None else line[len(marker) + 1:], p.returncode,
            f"rc {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")


def lending_nothing(params: dict) -> dict:
    """A Mooncake client setup on the cluster of ``params`` that lends no memory (its objects land
    in the cluster's segment holder)."""
    setup = {k: str(params[k]) for k in MOONCAKE_KEYS if k in params}
    setup.update(global_segment_size="0", local_buffer_size=str(16 << 20))
    return setup


def clear_mooncake(params: dict, prefix: list[str]) -> int:
    """Remove every object from the Mooncake cluster of ``params`` (force: leases ignored), from
    a client in ``prefix``'s namespace that lends no memory; the number removed."""
    removed, rc, out = child_line(prefix, _CLEAR, [json.dumps(lending_nothing(params))], "CLEARED", 120)
    if rc != 0 or removed is None:
        raise RuntimeError(f"clearing the Mooncake cluster failed ({out})")
    return int(removed)


class Systems:
    """Adapter JSON (and command prefix) per system; starts what a system needs."""

    def __init__(self, work: Path, shape: dict, stack: ExitStack, notes: list[str], clear: bool = True):
        self.work, self.shape, self.stack, self.notes = work, shape, stack, notes
        self.clear_between = clear
        self.cleared: list[int] = []  # objects removed before each run on the Mooncake cluster
        self.harnesses: dict = {}
        self.total_bytes = (shape["rounds"] + 1) * shape["keys"] * shape["in_flight"] * shape["size_kb"] * 1024

    def spec(self, name: str) -> tuple[dict, list[str]]:
        data = self.work / "data"
        data.mkdir(exist_ok=True)
        size = f"{max(64, 2 * self.total_bytes // (1 << 20))}mb"
        if name == "fs":
            return {"type": "fs", "base_path": str(data / "fs")}, []
        if name == "fs_native":  # LMCache's C++ file adapter (lmcache.lmcache_fs), its defaults
            return {"type": "fs_native", "base_path": str(data / "fs_native")}, []
        if name == "mock":
            return {"type": "mock", "max_size_gb": 2 * self.total_bytes / (1 << 30) + 0.1,
                    "mock_bandwidth_gb": 10000}, []
        from kvconnect.connectors.config import parse_size

        if name == "mooncake_store":  # on the same master, lending the same segment as kvconnect's
            params, prefix = self.spec("mooncake")
            mc = {k: params["adapter_params"][k] for k in MOONCAKE_KEYS}
            return {**MOONCAKE_STORE, "adapter_params": {k: str(parse_size(v)) if k.endswith("_size") else str(v)
                                                         for k, v in mc.items()}}, prefix
        if name in VARIANTS:
            base, over = VARIANTS[name]
            params, prefix = self.spec(base)
            return {**params, "adapter_params": {**params["adapter_params"], **over}}, prefix
        harness = self.harness(name)
        params = harness.sized_options(parse_size(size)) or harness.options(0)
        return {**PLUGIN, "adapter_params": params}, harness.exec_prefix()

    def clear(self, name: str) -> None:
        """Before a run of ``name``: an empty Mooncake cluster (nothing an earlier run stored)."""
        if self.clear_between and name in MOONCAKE_SYSTEMS:
            adapter, prefix = self.spec("mooncake")
            self.cleared.append(clear_mooncake(adapter["adapter_params"], prefix))

    def harness(self, name: str):
        """A kvconnect store, as its test harness runs it (one per run)."""
        from kvconnect.connectors.testing.harness import harness_class

        if name not in self.harnesses:
            cls = harness_class(name)
            why = cls.skip_reason()
            if why:
                raise RuntimeError(f"{name}: {why}")
            self.harnesses[name] = self.stack.enter_context(cls(self.work / "data" / name))
        return self.harnesses[name]


TTFC_REPEATS = 5  # timed lookup-and-loads per system (after one untimed)


def ttfc_child(specs: dict[str, dict], chunks: int, chunk_kb: int) -> dict:
    """Inside the systems' namespace, per system: the adapter from LMCache's own factory (the
    ``--l2-adapter`` JSON, as ``lmcache server`` builds it) over an L1 stand-in; one prompt's
    ``chunks`` chunks stored; then, timed, LMCache's lookup-and-lock of the whole prompt and,
    once it answers, one load task per chunk in prompt order (as a layer-by-layer consumer
    would start on the first chunk): the time to the lookup's answer, to the first chunk in
    L1 and to the whole prompt, bytes verified, keys unlocked after each round."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    from kvconnect.connectors.testing.lmcache_adapter import L1, okeys, wait_fd, wait_result, wait_store

    out: dict = {}
    for name, adapter_json in specs.items():
        l1 = L1(2 * chunks, chunk_kb * 1024)
        l1.fill_random(7)
        layout = {0: MemoryLayoutDesc(shapes=[torch.Size([chunk_kb * 1024])], dtypes=[torch.uint8])}
        cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(adapter_json)]))
        ad = create_l2_adapter(cfg.adapters[0], l1_memory_desc=l1.desc())
        try:
            keys, src, dst = okeys(chunks, base=1 << 20), l1.objs[:chunks], l1.objs[chunks:]
            stored = wait_store(ad, ad.submit_store_task(keys, src))
            if stored is False or int(stored) < 0:
                raise RuntimeError(f"{name}: the prompt's store task failed: {stored}")
            lookup_s, first_s, whole_s = [], [], []
            for rnd in range(TTFC_REPEATS + 1):
                for o in dst:
                    o.tensor.zero_()
                t0 = time.perf_counter()
                tid = ad.submit_lookup_and_lock_task(keys, layout)
                hits = wait_result(ad.query_lookup_and_lock_result, ad.get_lookup_and_lock_event_fd(), tid)
                t1 = time.perf_counter()
                if hits.get_indices_list() != list(range(chunks)):
                    raise RuntimeError(f"{name}: lookup found {hits.get_indices_list()} of {chunks} chunks")
                pending: dict = {}
                first = None

                def collect() -> None:  # the load results in so far (each is handed out once)
                    nonlocal first
                    for t in list(pending):
                        res = ad.query_load_result(t)
                        if res is not None:
                            if res.get_indices_list() != [0]:
                                raise RuntimeError(f"{name}: chunk {pending[t]} did not load")
                            del pending[t]
                            first = first or time.perf_counter()

                for i, (k, o) in enumerate(zip(keys, dst)):  # results collected between submissions
                    pending[ad.submit_load_task([k], [o])] = i
                    collect()
                deadline = time.monotonic() + 30
                while pending and time.monotonic() < deadline:
                    wait_fd(ad.get_load_event_fd(), time.monotonic() + 0.05)
                    collect()
                t2 = time.perf_counter()
                if pending:
                    raise RuntimeError(f"{name}: {len(pending)} load tasks unanswered in 30 s")
                ad.submit_unlock(keys)
                if any(l1.data(chunks + i) != l1.data(i) for i in range(chunks)):
                    raise RuntimeError(f"{name}: loaded bytes differ from the stored ones")
                if rnd:  # the first round warms the path (threads, file handles, connections)
                    lookup_s.append(t1 - t0)
                    first_s.append(first - t0)
                    whole_s.append(t2 - t0)
        finally:
            ad.close()
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        out[name] = {"chunks": chunks, "chunk_kb": chunk_kb, "rounds": TTFC_REPEATS,
                     "lookup_s_median": med(lookup_s), "first_chunk_s_median": med(first_s),
                     "whole_prompt_s_median": med(whole_s), "first_chunk_s_min": min(first_s)}
    return out


def run_ttfc(specs: dict[str, tuple[dict, list[str]]], chunks: int, chunk_kb: int, data: Path) -> dict:
    """``ttfc_child`` once per command prefix (each namespace's systems in one process)."""
    groups: dict[tuple, dict] = {}
    for name, (adapter, prefix) in specs.items():
        groups.setdefault(tuple(prefix), {})[name] = adapter
    out: dict = {}
    for prefix, group in groups.items():
        _clean(data)
        os.sync()
        p = subprocess.run(list(prefix) + [sys.executable, str(Path(__file__).resolve()), "--ttfc-child",
                                           json.dumps(group), "--ttfc-shape", f"{chunks},{chunk_kb}"],
                           env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("TTFC ")]
        if p.returncode != 0 or not line:
            err = (p.stdout + p.stderr)[-1500:]
            out.update({n: {"error": err} for n in group})
            continue
        out.update(json.loads(line[-1][len("TTFC "):]))
    return out


REMOTE_SEQS, REMOTE_TOKENS = 16, 1024  # 16 prompts x 4 chunks of 512 KiB (EngineClient's KV: 1024 tokens)
POLL_S = 0.001  # prefetch-status polls of the remote driver (LMCache's bench client: 0.05 s)


def remote_child(system: str, work: Path, params: dict | None) -> dict:
    """Inside the namespace: servers A and B (and a coordinator for p2p); A stores, B reads."""
    from kvconnect.connectors.testing.lmcache import EngineClient, Server, wait_for
    from kvconnect.connectors.testing.processes import child_env, free_port

    work.mkdir(parents=True, exist_ok=True)
    procs, servers, clients = [], [], []
    out: dict = {"system": system}
    try:
        if system == "p2p":
            cport = free_port()
            procs.append(subprocess.Popen([LMCACHE_BIN, "coordinator", "--host", "127.0.0.1", "--port", str(cport)],
                                          env=child_env(), stdout=open(work / "coordinator.log", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
            for name in ("a", "b"):
                servers.append(Server(None, work / f"{name}.log", "--coordinator-url", f"http://127.0.0.1:{cport}",
                                      "--p2p-advertise-url", f"127.0.0.1:{free_port()}",
                                      "--p2p-transfer-engine", "mooncake_te", l1_size_gb=0.5))
        else:
            servers = [Server(params, work / "a.log", "--l2-store-policy", "skip_l1", l1_size_gb=0.5),
                       Server(params, work / "b.log", l1_size_gb=0.5)]
        a, b = servers
        a.wait_healthy()
        b.wait_healthy()
        if system == "p2p":
            wait_for(lambda: a.status().get("p2p_peer_count") == 1 and b.status().get("p2p_peer_count") == 1,
                     60, "p2p peers registered")
        ca, cb = EngineClient(a, REMOTE_TOKENS), EngineClient(b, REMOTE_TOKENS)
        clients += [ca, cb]
        stored = {seq: ca.store_sequence(seq) for seq in range(REMOTE_SEQS)}
        chunks = sum(len(v) for v in stored.values())
        if system != "p2p":
            wait_for(lambda: a.adapter_status()["store_stats"]["put_written"] >= chunks, 60, "A's L2 stores")
        first, load, floor, stock, bad = [], [], [], [], 0
        for seq in range(REMOTE_SEQS):
            # B's first lookup: L2 lookup + prefetch into B's L1, polled every 1 ms
            hit, total, t_first = cb.hit_chunks_timed(seq, POLL_S)
            t1 = time.perf_counter()
            got = cb.retrieve_sequence(seq, POLL_S)  # its own lookup (an L1 hit now) + RETRIEVE
            load.append(time.perf_counter() - t1)
            first.append(t_first)
            again = cb.hit_chunks_timed(seq, POLL_S)  # the same lookup once B's L1 holds the prompt
            floor.append(again[2])
            t3 = time.perf_counter()
            stock_hit = cb.hit_chunks(seq)  # LMCache's bench client as it is: 50 ms between status polls
            stock.append(time.perf_counter() - t3)
            bad += again[:2] != (hit, total) or stock_hit != (hit, total)
            bad += (hit, total) != (len(stored[seq]), len(stored[seq])) or got != stored[seq]
        nbytes = chunks * 512 * 1024
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        out.update({"prompts": REMOTE_SEQS, "chunks": chunks, "bytes": nbytes, "mismatched_prompts": bad,
                    "poll_s": POLL_S,
                    "lookup_prefetch_s_median": med(first),
                    "retrieve_s_median": med(load),
                    "l1_lookup_s_median": med(floor),
                    "stock_client_l1_lookup_s_median": med(stock),
                    "remote_load_MBps": nbytes / (1 << 20) / (sum(first) + sum(load)),
                    "lookup_prefetch_MBps": nbytes / (1 << 20) / sum(first),
                    "lookup_prefetch_prompts_per_s": len(first) / sum(first),
                    "l2_part_s_median": med([f - fl for f, fl in zip(first, floor)])})
        st = b.status()
        out["b_l2_adapters"] = [{k: v for k, v in ad.items() if k in ("type", "store", "store_stats", "errors",
                                                                       "peer_mq_server_url")}
                                for ad in st["storage_manager"]["l2_adapters"]]
    finally:
        for c in clients:
            c.close()
        for srv in servers:
            srv.stop()
        for pr in procs:
            pr.terminate()
            pr.wait(10)
    return out


def run_remote(system: str, work: Path, stack: ExitStack) -> dict:
    """``remote_child`` in a loopback-only namespace of its own (peer_rdma: the pool's)."""
    params, prefix = None, []
    if system == "peer_rdma":
        from kvconnect.connectors.testing.harness import harness_class

        cls = harness_class("peer_rdma")
        why = cls.skip_reason()
        if why:
            raise RuntimeError(why)
        h = stack.enter_context(cls(work / "pool"))
        params, prefix = {**h.options(0), "global_segment_size": "64mb"}, h.exec_prefix()
    else:
        from kvconnect.connectors.testing.netns import Netns, netns_available

        why = netns_available()
        if why:
            raise RuntimeError(why)
        ns = Netns("kvc-p2p")
        stack.callback(ns.delete)
        prefix = ns.exec_prefix()
    p = subprocess.run(prefix + [sys.executable, str(Path(__file__).resolve()), "--remote-child", system,
                                 "--dir", str(work / system), "--child-params", json.dumps(params)],
                       env=_env(), capture_output=True, text=True, timeout=400, cwd=ROOT)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("REMOTE ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"remote {system} (rc {p.returncode}): {(p.stdout + p.stderr)[-2500:]}")
    return json.loads(line[-1][len("REMOTE "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (tests): hf3fs vs fs and fs_native only, once")
    p.add_argument("--dir", default=None, help="directory for the fs adapter and the hf3fs file (default: a temp dir)")
    p.add_argument("--stores", default=None,
                   help="kvconnect stores to run (default: memory,hf3fs,mooncake,peer_rdma; --quick: hf3fs); "
                        "also mooncake_local: mooncake with prefer_local_segment")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each compared system, alternating (default 2, --quick 1); "
                        "peer_rdma (figures only) runs once")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/lmcache_l2.json)")
    p.add_argument("--remote", choices=("on", "off"), default=None,
                   help="peer_rdma vs LMCache p2p between two servers (default: on, --quick: off)")
    p.add_argument("--between-runs", choices=("clear", "keep"), default="clear",
                   help="before each run on a Mooncake cluster remove every object from it (default), or keep "
                        "what earlier runs stored (their puts of the same keys then move no bytes)")
    p.add_argument("--ttfc", choices=("on", "off"), default="on",
                   help="time to first chunk of a lookup-and-load of a whole prompt, per system (default on)")
    p.add_argument("--ttfc-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ttfc-shape", default="16,1024", help=argparse.SUPPRESS)
    p.add_argument("--remote-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-params", default="null", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ttfc_child:
        chunks, chunk_kb = (int(x) for x in args.ttfc_shape.split(","))
        print("TTFC " + json.dumps(ttfc_child(json.loads(args.ttfc_child), chunks, chunk_kb)))
        return 0
    if args.remote_child:
        print("REMOTE " + json.dumps(remote_child(args.remote_child, Path(args.dir), json.loads(args.child_params))))
        return 0

    shape = ({"keys": 8, "in_flight": 1, "size_kb": 512, "rounds": 2} if args.quick
             else {"keys": 16, "in_flight": 2, "size_kb": 1024, "rounds": 4})
    stores = (args.stores or ("hf3fs" if args.quick else "memory,hf3fs,mooncake,peer_rdma")).split(",")
    refs = list(dict.fromkeys(ref for ours, ref in PAIRS if ours in stores))
    repeats = args.repeats or (1 if args.quick else 2)
    res = BenchResult("lmcache_l2", params={**shape, "stores": stores, "references": refs, "repeats": repeats,
                                             "between_runs": args.between_runs, "quick": args.quick,
                                             "lmcache": _lmcache_version(),
                                             "command": " ".join(["kvconnect", "bench", "lmcache_l2"] + list(
                                                 sys.argv[1:] if argv is None else argv))})
    res.notes += [
        "each system: one `lmcache bench l2` process (store, lookup, load of the same keys; round trip "
        "verified); systems alternate, in reverse order every other repeat, after one untimed run on each "
        "freshly started cluster (namespace); compared pairs repeat; per metric the best round over all runs "
        "(LMCache's per-round max MB/s; keys per round / min lookup round time)",
        "hf3fs, fs and fs_native write under the same directory, no fsync on any (fs: tmp file + rename; fs_native: "
        "a file per chunk from 4 C++ worker threads, its defaults; hf3fs: "
        "pwritev into one sparse file, in-process page index); each run starts after os.sync() and on an "
        "empty directory; store throughput on this shared disk swings with the kernel's dirty-page "
        "throttling (seen here: 0.3-4 GB/s for the same buffered writes), hence the repeats",
        "the machine is shared with other work: see machine.loadavg",
    ]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvc-lmc-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    best: dict[str, dict[str, float]] = {}
    per_repeat: dict[str, list] = {}  # system -> its figures per repeat (None: that repeat failed)
    t0 = time.monotonic()
    with ExitStack() as stack:
        systems = Systems(work, shape, stack, res.notes, clear=args.between_runs == "clear")
        specs = {}
        for name in refs + stores:
            try:
                specs[name] = systems.spec(name)
            except Exception as e:  # noqa: BLE001 - an unavailable optional system is a note
                res.notes.append(f"{name}: not run ({type(e).__name__}: {e})")
                print(f"[lmcache_l2] {name}: not run: {e}")
        order = list(dict.fromkeys([n for pair in PAIRS for n in pair[::-1] if n in specs] + list(specs)))
        native = probe_native(work, specs, "hf3fs" in stores or "mooncake" in stores)
        for name, got in native.items():
            res.notes.append(f"LMCache '{got['adapter']}': " + (
                "loads (not compared by this benchmark)" if got["loads"] else
                f"cannot load from the installed wheel: {got['error']} (cause: {got['cause']})"))
            print(f"[lmcache_l2] {res.notes[-1]}")
        warmed: set[tuple] = set()
        for name in order:  # a cluster just started (a namespace's master, pool): one untimed run on it first
            adapter, prefix = specs[name]
            if prefix and tuple(prefix) not in warmed:
                warmed.add(tuple(prefix))
                try:
                    systems.clear(name)
                    run_bench(adapter, shape, prefix)
                except Exception as e:  # noqa: BLE001 - the timed runs report it
                    print(f"[lmcache_l2] {name}: warm-up failed: {str(e)[-300:]}")
        for rep in range(repeats):
            for name in (order if rep % 2 == 0 else order[::-1]):  # no system always first or last
                if rep and name not in REPEATED:
                    continue
                adapter, prefix = specs[name]
                _clean(work / "data")
                os.sync()  # every run starts with no dirty pages: writeback throttling hits all alike
                try:
                    systems.clear(name)
                    figs = run_bench(adapter, shape, prefix)
                except Exception as e:  # noqa: BLE001
                    res.notes.append(f"{name} repeat {rep}: failed: {str(e)[-500:]}")
                    print(f"[lmcache_l2] {name}: FAILED: {str(e)[-1500:]}")
                    per_repeat.setdefault(name, []).append(None)
                    continue
                per_repeat.setdefault(name, []).append(figs)
                print(f"[lmcache_l2] {name:9s} " + "  ".join(f"{k} {v:10.1f}" for k, v in figs.items()))
                b = best.setdefault(name, {})
                for k, v in figs.items():
                    b[k] = max(b.get(k, 0.0), v)
        client: dict = {}
        if "mooncake_store" in specs:  # the Mooncake client itself, same master, same segment
            systems.clear("mooncake_store")
            client = run_client(specs["mooncake_store"], shape)
            print(f"[lmcache_l2] mooncake client: {json.dumps(client)[:600]}")
        ttfc: dict[str, dict] = {}
        if args.ttfc == "on" and specs:
            ttfc = run_ttfc(specs, 8 if args.quick else 16, shape["size_kb"], work / "data")
            for name, got in ttfc.items():
                if "error" in got:
                    res.notes.append(f"ttfc {name}: failed: {got['error'][-500:]}")
                print(f"[lmcache_l2] ttfc {name}: " + json.dumps(got)[:400])
        remote: dict[str, dict] = {}
        if (args.remote or ("off" if args.quick else "on")) == "on":
            for rep in range(repeats):  # alternating; per system the run with the higher remote_load_MBps
                for name in ("p2p", "peer_rdma"):
                    try:
                        with ExitStack() as one:  # this run's namespace / pool go when it ends
                            got = run_remote(name, work / "remote" / str(rep), one)
                    except Exception as e:  # noqa: BLE001 - a remote system that cannot run is a finding
                        res.notes.append(f"remote {name} repeat {rep}: not run: {str(e)[-600:]}")
                        remote.setdefault(name, {"error": str(e)[-1500:]})
                        continue
                    print(f"[lmcache_l2] remote {name}: " + json.dumps({k: v for k, v in got.items()
                                                                        if k != "b_l2_adapters"})[:700])
                    runs = remote.get(name, {}).get("runs", []) + [got["remote_load_MBps"]]
                    if got["remote_load_MBps"] >= remote.get(name, {}).get("remote_load_MBps", 0.0):
                        remote[name] = got
                    remote[name]["runs"] = runs
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    res.figures = {"per_system": best, "per_repeat": per_repeat,
                   "per_repeat_ratios": repeat_ratios(per_repeat), "lmcache_native": native, "mooncake_client": client, "ttfc": ttfc,
                   "remote": remote,
                   "seconds": round(time.monotonic() - t0, 1)}
    ours, ref = remote.get("peer_rdma", {}), remote.get("p2p", {})
    if "remote_load_MBps" in ours and "remote_load_MBps" in ref:
        res.notes.append("remote: B's first lookup of each of A's prompts (LMCache looks up L2 and prefetches the "
                         "hits into L1) then its retrieve; remote_load_MBps = bytes / (lookups + retrieves); "
                         "lookup_prefetch_s = time until a whole prompt's chunks are in B's L1; "
                         "l1_lookup_s: the same lookup once they are in B's L1 (no L2 involved): the floor "
                         "of LMCache's lookup path and its engine client, which bounds both systems")
        for metric in ("remote_load_MBps", "lookup_prefetch_MBps"):
            res.ratio(f"peer_rdma_vs_p2p.{metric}", ours[metric], ref[metric], "LMCache 0.5.6 'p2p' (mooncake_te, TCP)")
        # Amdahl: p2p's prompt time with its L2 part taken away, the most any L2 adapter could gain
        total = ref["lookup_prefetch_s_median"] + ref["retrieve_s_median"]
        res.figures["remote"]["bound"] = {
            "p2p_prompt_s_median": total, "p2p_l2_part_s_median": ref["l2_part_s_median"],
            "max_remote_load_ratio_any_l2": round(total / max(total - ref["l2_part_s_median"], 1e-9), 3)}
        for metric in ("lookup_prefetch_s_median", "l2_part_s_median"):
            res.ratio(f"peer_rdma_vs_p2p.{metric}", ours[metric], ref[metric], "LMCache 0.5.6 'p2p' (mooncake_te, TCP)",
                      higher_is_better=False)
        res.notes.append("remote: the driver is LMCache's own engine client (lmcache bench server's) with its "
                         "QUERY_PREFETCH_STATUS polled every 1 ms; as shipped it sleeps 50 ms between polls, "
                         "so every lookup it times reads ~55 ms whatever the L2 "
                         "(stock_client_l1_lookup_s: the stock client on a prompt already in L1); "
                         "l2_part_s = lookup_prefetch_s - l1_lookup_s per prompt (median): the share of the "
                         "lookup that the L2 adapter's lookup and load take; the rest is LMCache's server path; "
                         "per system the better of the alternating runs (runs: each one's remote_load_MBps)")
    for ours, ref in PAIRS:
        label = REFERENCE.get(ref, f"LMCache 0.5.6 '{ref}' L2 adapter")
        if ours in best and ref in best:
            for _, metric in METRICS:
                res.ratio(f"{ours}_vs_{ref}.{metric}", best[ours][metric], best[ref][metric], label)
        t_ours, t_ref = ttfc.get(ours, {}), ttfc.get(ref, {})
        for metric in ("first_chunk_s_median", "whole_prompt_s_median"):
            if metric in t_ours and metric in t_ref:
                res.ratio(f"{ours}_vs_{ref}.ttfc.{metric}", t_ours[metric], t_ref[metric], label,
                          higher_is_better=False)
    per_key = {"store_MBps": "per_key_store_MBps", "load_MBps": "per_key_load_MBps",
               "lookup_keys_per_s": "per_key_lookup_keys_per_s"}
    if "mooncake" in best and "per_key_store_MBps" in client:
        for metric, theirs in per_key.items():
            res.ratio(f"mooncake_vs_mooncake_client.{metric}", best["mooncake"][metric], client[theirs],
                      "the Mooncake client itself on the same master, one call per key on 4 threads (what "
                      "mooncake_store's C++ connector does): the bound on mooncake_store")
    batch = {"mooncake": ("batch_store_MBps", "batch calls, the master placing each chunk in any mounted segment"),
             "mooncake_local": ("batch_local_store_MBps", "batch calls into its own segment (preferred_segment)")}
    for ours, (theirs, how) in batch.items():
        if ours in best and theirs in client:
            res.ratio(f"{ours}_vs_mooncake_client_batch.store_MBps", best[ours]["store_MBps"], client[theirs],
                      f"the Mooncake client itself on the same master, {how}: the ceiling of {ours}'s stores "
                      "(its best of 3 rounds of 32 chunks, one call each, vs LMCache's best round)")
    if "mooncake_store" in specs:
        res.notes.append(
            "mooncake_store: LMCache's adapter needs lmcache.lmcache_mooncake (C++, built against Mooncake's "
            "mooncake-store headers and libmooncake_store, neither in the PyPI wheels; see lmcache_native): "
            "measured instead as LMCache's own NativeConnectorL2Adapter (what its factory returns) over a "
            "Python rendering of the connector (kvconnect.connectors.testing.lmcache_mooncake_store): the same "
            "per-key RealClient calls (put_from / get_into / isExist on 4 worker threads) through the Mooncake "
            "wheel's client, set up from the same JSON on the same master, lending the same segment size as "
            "kvconnect's; figures.mooncake_client: that client by itself on that master (per key on 4 threads, "
            "and batch calls), the bound on any adapter made of those calls")
    if ttfc:
        res.notes.append("ttfc: per system, one prompt's chunks (16 x size_kb; --quick 8) stored through the "
                         "adapter LMCache's factory builds, then 5 timed rounds (after 1 untimed) of LMCache's "
                         "lookup-and-lock of the whole prompt and, once it answers, one load task per chunk in "
                         "prompt order: first_chunk_s = from the lookup's submission to the first chunk in L1, "
                         "whole_prompt_s = to the last; medians; bytes verified each round; ratio > 1: kvconnect "
                         "is faster")
    for pair, metrics in res.figures["per_repeat_ratios"].items():
        print(f"[lmcache_l2] per repeat {pair}: " + "; ".join(
            f"{m} {' '.join(f'{r:.2f}' for r in v['per_repeat'])} (median {v['median']:.2f})"
            for m, v in metrics.items()))
    if res.figures["per_repeat_ratios"]:
        res.notes.append("per_repeat: each system's figures in each repeat (systems alternate, a pair's two "
                         "runs back to back); per_repeat_ratios: ours / theirs within each repeat, and their "
                         "median (the ratios above compare the best round over all repeats)")
    if MOONCAKE_SYSTEMS & set(specs):
        res.notes.append(
            "Mooncake cluster between runs: " + (
                f"every object removed before each run and before figures.mooncake_client (objects removed each time: "
                f"{systems.cleared}); every "
                "`lmcache bench l2` process stores the same keys with the same bytes, and Mooncake answers a put "
                "of a key it holds with success without moving bytes, so objects an earlier run left in the "
                "segment holder would make a later run's puts of them free" if args.between_runs == "clear" else
                "objects kept (--between-runs keep): a run's puts of keys an earlier run of the same system left "
                "in the segment holder succeed without moving bytes"))
    if "mooncake_local" in specs:
        res.notes.append("mooncake_local: kvconnect's mooncake with prefer_local_segment=true (Mooncake's "
                         "preferred_segment: this process's own segment while it has room), so a store is a "
                         "copy into the segment the LMCache server lends instead of a transfer to wherever the "
                         "master places it; LMCache's connector calls put_from with Mooncake's default "
                         "ReplicateConfig (no preferred segment); figures.mooncake_client's *_local_store_MBps: "
                         "the client itself with that placement")
    res.finish(args.out)
    missing = [s for s in ["hf3fs", "fs", "fs_native"] if s in refs + stores and s not in best]
    return 1 if missing else 0


# Creates each adapter through LMCache's own config parser and factory (what `lmcache server`
# and `lmcache bench l2` do at start) and reports, per adapter, whether it loads and if not why.
_PROBE = r"""
import json, sys
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
out = {}
for name, spec in json.loads(sys.argv[1]).items():
    got = {"adapter": spec["type"], "config": spec, "loads": False, "error": None, "cause": None}
    try:
        adapter = create_l2_adapter(get_l2_adapter_config_class(spec["type"]).from_dict(spec))
        got["loads"] = True
        adapter.close()
    except Exception as e:
        got["error"] = f"{type(e).__name__}: {e}"
        c = e.__cause__ or e.__context__
        got["cause"] = f"{type(c).__name__}: {c}" if c else None
    out[name] = got
print("PROBE " + json.dumps(out))
"""


def probe_native(work: Path, specs: dict, wanted: bool) -> dict:
    """LMCache's C++-backed counterparts of ``mooncake`` and ``hf3fs``: do they load here?"""
    if not wanted:
        return {}
    mnt = work / "lmcache_hf3fs"
    (mnt / "kv").mkdir(parents=True, exist_ok=True)
    probes = {"lmcache_hf3fs": {"type": "hf3fs", "mount_point": str(mnt), "base_paths": str(mnt / "kv")}}
    prefix: list[str] = []
    mc = {"master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
          "local_hostname": "127.0.0.1", "protocol": "tcp"}
    if "mooncake" in specs:  # the run's own mooncake_master, from inside its namespace
        (adapter, prefix) = specs["mooncake"]
        mc.update({k: adapter["adapter_params"][k] for k in mc if k in adapter["adapter_params"]})
    probes["mooncake_store"] = {"type": "mooncake_store", **{k: str(v) for k, v in mc.items()},
                                "global_segment_size": str(64 << 20), "local_buffer_size": str(16 << 20)}
    try:
        p = subprocess.run(prefix + [sys.executable, "-c", _PROBE, json.dumps(probes)], env=_env(),
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith("PROBE "))
        return json.loads(line[len("PROBE "):])
    except Exception as e:  # noqa: BLE001 - the probe itself failing is a finding too
        return {n: {"adapter": s["type"], "config": s, "loads": False, "error": f"probe failed: {e}",
                    "cause": None} for n, s in probes.items()}


_CLIENT = r"""
import json, sys
from kvconnect.connectors.testing.lmcache_mooncake_store import client_throughput
shape = json.loads(sys.argv[2])
print("CLIENT " + json.dumps(client_throughput(json.loads(sys.argv[1]), shape["keys"] * shape["in_flight"],
                                               shape["size_kb"] * 1024)))
"""


def run_client(spec: tuple[dict, list[str]], shape: dict) -> dict:
    """``client_throughput`` with mooncake_store's setup, inside the run's Mooncake namespace."""
    adapter, prefix = spec
    try:
        figures, _, out = child_line(prefix, _CLIENT, [json.dumps(adapter["adapter_params"]), json.dumps(shape)],
                                  "CLIENT", 300)
        return {"error": out} if figures is None else json.loads(figures)
    except Exception as e:  # noqa: BLE001 - a failed measurement is a finding
        return {"error": f"{type(e).__name__}: {e}"}


def repeat_ratios(per_repeat: dict[str, list]) -> dict[str, dict]:
    """Per compared pair and metric: ours / theirs of each repeat (the two ran back to back in
    that repeat) and the median of those ratios; a repeat where either failed is left out."""
    out: dict[str, dict] = {}
    for ours, ref in PAIRS:
        a, b = per_repeat.get(ours, []), per_repeat.get(ref, [])
        if not a or not b:
            continue
        pair = out[f"{ours}_vs_{ref}"] = {}
        for _, metric in METRICS:
            runs = [round(x[metric] / y[metric], 3) for x, y in zip(a, b) if x and y and y[metric]]
            if runs:
                pair[metric] = {"per_repeat": runs, "median": sorted(runs)[len(runs) // 2] if len(runs) % 2 else
                                round((sorted(runs)[len(runs) // 2 - 1] + sorted(runs)[len(runs) // 2]) / 2, 3)}
    return out


def _clean(data: Path) -> None:
    """Fresh data per run: no system reads another's (or its own earlier) files."""
    if data.exists():
        for child in data.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def _lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
