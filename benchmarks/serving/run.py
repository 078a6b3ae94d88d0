"""Run a serving plan: launch servers and router once, then each (workload, configuration) pair in turn.

A pair: start the configuration's services, empty every server's GPU and host caches, attach its L3
backend, drive the workload through the router, scrape the store counters, then the output check
(caches emptied again, a sample of the workload's prompts sent one at a time, so pages come back
from L3 where the configuration has one; their generated tokens must equal the baseline's), detach,
stop the services, delete their data. Every pair is appended to ``runs.jsonl`` as soon as it ends,
so a run cut short keeps what it measured; a pair that fails is recorded with its error and the
servers are relaunched if one died.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvconnect.connectors.config import parse_size

from . import client, workloads
from .cluster import DelayProxy, Router, SGLangServer, Services, bootstrap_ready, http, wait_until
from .configs import BASELINE, CONFIGS, PD, Config, Setup, pd_refusal
from .model import PROMPT_VOCAB, write_model_dir
from .workloads import Workload

# Loads whose offered rate is set from the measured capacity (W3 keeps the trace's own timing).
RATED = ("w1", "w2")
# A pair offered more than this share of the capacity measures a queue as much as a cache.
OVERLOAD_FRACTION = 0.9


@dataclass
class ServerSpec:
    """How the SGLang servers are launched (the same for every configuration of a profile)."""
    servers: int = 2
    gpus: tuple = ("0",)
    shape: str = "llama3-8b"
    model_path: Optional[str] = None          # a real model directory instead of the dummy one
    mem_fraction: float = 0.35
    max_total_tokens: int = 32768
    hicache_ratio: float = 1.2
    page_size: int = 64
    router_policy: str = "round_robin"
    extra_args: tuple = ()
    launch_timeout_s: float = 600.0
    server_module: str = "sglang.launch_server"
    kv_device: str = "cuda"                    # where the servers' KV lives (the PD relay's capability check)

    def args(self, profile: str, lmcache_config: Optional[Path] = None) -> list[str]:
        a = ["--page-size", str(self.page_size), "--mem-fraction-static", str(self.mem_fraction),
             "--max-total-tokens", str(self.max_total_tokens), "--disable-cuda-graph",
             "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--log-level", "info"]
        if self.model_path is None:
            a += ["--load-format", "dummy"]
        if profile == "hicache":
            a += ["--enable-hierarchical-cache", "--hicache-ratio", str(self.hicache_ratio),
                  "--hicache-write-policy", "write_through"]
        elif profile == "lmcache":   # LMCache is the tier below the GPU (SGLang's LMCRadixCache), no HiCache
            a += ["--enable-lmcache", "--lmcache-config-file", str(lmcache_config)]
        elif profile not in ("plain", "pd"):   # pd: Cluster adds each role's --disaggregation-* arguments
            raise ValueError(f"server profile {profile!r}: accepted values are hicache, lmcache, plain, pd")
        return a + list(self.extra_args)


@dataclass
class Plan:
    pairs: list                                # [(Workload, config name)], in the order they run
    spec: ServerSpec = field(default_factory=ServerSpec)
    workdir: Path = Path("/tmp/kvconnect-serve")
    out: Path = Path("benchmarks/results/serving")
    ports: dict = field(default_factory=dict)
    probe_prompts: int = 8
    probe_tokens: int = 16
    deadline: float = 0.0                      # time.time() after which no pair starts (0: none)
    l3_bytes_per_server: str = "16gb"
    l3_file_bytes: int = 32 << 30
    write_behind: str = "0"
    request_timeout_s: float = 600.0
    load_fraction: float = 0.7                 # W1/W2 offered at this share of the measured capacity (0: as given)
    capacity_requests: int = 128               # requests (or chat turns) in the capacity probe
    resume: bool = False                       # skip pairs already measured in out/runs.jsonl
    baseline: str = BASELINE                   # the capacity probe runs on its servers
    reference: str = BASELINE                  # the pair whose probe outputs the others must equal
    pd_decode_delay_s: float = 2.0             # PD configurations with late=True: decode's request this late
    lmcache_l1_gb: float = 8.0                 # lmcache_* configurations: the lmcache server's L1 (host memory)


class Cluster:
    """The launched servers and router of one profile."""

    def __init__(self, plan: Plan, setup: Setup, model_dir: Path):
        self.plan, self.setup, self.model_dir = plan, setup, model_dir
        self.profile: Optional[str] = None
        self.servers: list[SGLangServer] = []
        self.router: Optional[Router] = None
        self.launched_once = False
        self.pd: Optional[PD] = None
        self.proxy: Optional[DelayProxy] = None
        self.services: Optional[Services] = None
        self.bound: tuple = ()   # services that live as long as the servers (PD relay store, lmcache server)

    def env(self, i: int) -> dict:
        spec = self.plan.spec
        return {"CUDA_VISIBLE_DEVICES": str(spec.gpus[i % len(spec.gpus)]),
                "SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(self.setup.hf3fs_ref_config),
                "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(Path(self.setup.workdir) / "data" / "sglang_file"),
                "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}

    @property
    def url(self) -> str:
        return self.router.url

    def probe_urls(self) -> list[str]:
        """Where the output check sends its prompts: each server, or the router for PD (a PD server
        answers only a request the router paired with the other half)."""
        return [self.router.url] if self.pd else [s.url for s in self.servers]

    def ensure(self, profile: str, pd: Optional[PD] = None, services: tuple = ()) -> None:
        """Servers of ``profile`` (relaunched unless they run already); ``services``: those started
        before them that live as long as them (``Config.services_live_with_servers``)."""
        key = (profile, pd.key(self.setup) if pd else None, tuple(services))
        if (self.profile, self.pd.key(self.setup) if self.pd else None, self.bound) == key and \
                all(s.proc.alive() for s in self.servers):
            if pd and pd.late != self.pd.late:   # same servers; only the router (and proxy) change
                self._stop_router()
                self.pd = pd
                self._start_pd_router()
            return
        self.stop()
        self.bound = tuple(services)
        for name in services:   # the relay opens its store, SGLang connects to its lmcache server, at launch
            self.services.start(name)
        if pd is not None:
            self._launch_pd(profile, pd)
            return
        spec, log_dir = self.plan.spec, Path(self.setup.workdir) / "logs"
        args = spec.args(profile, self.setup.lmcache_mp_config)
        self.servers = [SGLangServer(i, self.plan.ports["server"] + i, self.model_dir, args, log_dir,
                                     self.env(i), module=spec.server_module) for i in range(spec.servers)]
        t0 = time.time()
        print(f"[serve] launching {spec.servers} SGLang servers ({profile}) ...", flush=True)
        rest = self.servers
        if not self.launched_once:
            # The first launch compiles kernels into the shared JIT caches; the others then reuse them
            # instead of compiling the same kernels concurrently.
            self.servers[0].start().wait_ready(spec.launch_timeout_s)
            rest = self.servers[1:]
            self.launched_once = True
        for s in rest:
            s.start()
        with ThreadPoolExecutor(max(1, len(rest))) as ex:
            list(ex.map(lambda s: s.wait_ready(spec.launch_timeout_s), rest))
        print(f"[serve] servers ready after {time.time() - t0:.0f} s", flush=True)
        self.router = Router(self.plan.ports["router"], [s.url for s in self.servers], spec.router_policy,
                             log_dir).start()
        self.profile = profile
        self.warm_up()

    def _launch_pd(self, profile: str, pd: PD) -> None:
        """1P1D: prefill (server 0) on the first GPU, decode (server 1) on the second, both with the
        configuration's transfer backend; the router once prefill's bootstrap server knows its rank."""
        import json

        spec, log_dir, ports = self.plan.spec, Path(self.setup.workdir) / "logs", self.plan.ports
        env = {"SGLANG_HOST_IP": "127.0.0.1", **pd.env}
        conf = pd.pd_config(self.setup)
        self.servers = []
        for i, role in enumerate(("prefill", "decode")):
            args = spec.args(profile) + ["--disaggregation-mode", role, "--disaggregation-transfer-backend",
                                         pd.backend, "--disaggregation-bootstrap-port", str(ports["pd_bootstrap"])]
            own = dict(env)
            if conf is not None:   # a relay serves its store's figures, one endpoint per server
                own["KVCONNECT_PD_CONFIG"] = json.dumps(
                    {**conf, "metrics_port": ports["kvc_metrics"] + i} if conf.get("transport") == "relay" else conf)
            self.servers.append(SGLangServer(i, ports["server"] + i, self.model_dir, args, log_dir,
                                             {**self.env(i), **own}, module=spec.server_module))
        t0 = time.time()
        print(f"[serve] launching PD prefill + decode ({pd.backend}, {(conf or {}).get('transport', '-')}) ...",
              flush=True)
        for s in self.servers:
            s.start()
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda s: s.wait_ready(spec.launch_timeout_s), self.servers))
        # /health says the HTTP server is up; decode's first request needs the bootstrap server to know
        # prefill's rank (a rank registered late answers 503 until then)
        wait_until(lambda: bootstrap_ready(ports["pd_bootstrap"]), spec.launch_timeout_s,
                   "prefill bootstrap server", self.servers[0].proc)
        print(f"[serve] PD servers ready after {time.time() - t0:.0f} s", flush=True)
        self.profile, self.pd = profile, pd
        self._start_pd_router()
        self.warm_up()

    def _start_pd_router(self) -> None:
        ports, log_dir = self.plan.ports, Path(self.setup.workdir) / "logs"
        prefill, decode = self.servers
        decode_url = decode.url
        if self.pd.late:
            self.proxy = DelayProxy(ports["pd_proxy"], decode.url, self.plan.pd_decode_delay_s, log_dir).start()
            decode_url = self.proxy.url
        self.router = Router(ports["router"], [], self.plan.spec.router_policy, log_dir,
                             pd=(prefill.url, ports["pd_bootstrap"], decode_url)).start()

    def _stop_router(self) -> None:
        if self.router:
            self.router.stop()
            self.router = None
        if self.proxy:
            self.proxy.stop()
            self.proxy = None

    def warm_up(self) -> None:
        """One long prompt per server first: the first prefill of a fresh process is far slower."""
        import random

        rng = random.Random(7)
        prompts = [[rng.randrange(1, PROMPT_VOCAB) for _ in range(4096)] for _ in self.servers]
        if self.pd:   # through the router: both halves of one request
            client.probe([self.router.url], prompts[:1], max_new_tokens=8)
        for s, p in zip([] if self.pd else self.servers, prompts):
            client.probe([s.url], [p], max_new_tokens=8)
        for s in self.servers:
            s.flush()
        if self.profile == "hicache":
            self.warm_up_storage_path(rng)

    def warm_up_storage_path(self, rng, tries: int = 30) -> None:
        """The first L3 lookup of a SGLang process builds SGLang's native page-hash extension (a
        C++ JIT build, 0.5.17) on its prefetch thread; that server's requests wait meanwhile (7-8 s
        on the H200 host, every request held for its prefetch timeout). Whichever configuration ran
        first paid it. Here SGLang's own ``file`` backend takes that cost: prompts go to every server
        until each answers in under a second, then it is detached and its files removed."""
        import shutil

        data = Path(self.setup.workdir) / "data" / "warm_up"
        t0 = time.time()
        for s in self.servers:
            s.attach("file", {"file_storage_path": str(data)})
        try:
            for _ in range(tries):
                prompts = [[rng.randrange(1, PROMPT_VOCAB) for _ in range(2048)] for _ in self.servers]
                res = client.probe([s.url for s in self.servers], prompts, max_new_tokens=1)
                if all(r.ok and r.latency < 1.0 for r in res):
                    break
            else:
                print(f"[serve] warning: L3 lookups still slow after {tries} warm-up prompts", flush=True)
        finally:
            for s in self.servers:
                s.detach()
                s.flush()
            shutil.rmtree(data, ignore_errors=True)
        print(f"[serve] L3 path warmed up in {time.time() - t0:.0f} s", flush=True)

    def stop(self) -> None:
        self._stop_router()
        for s in self.servers:
            s.stop()
        if self.bound and self.services is not None:
            self.services.stop_all()
        self.servers, self.profile, self.pd, self.bound = [], None, None, ()


def scrape(url: Optional[str]) -> dict:
    """Samples of a Prometheus endpoint, ``name{label="value",...}`` -> value (the exposition's own
    spelling, which the report's series lookups match)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not url:
        return {}
    status, text = http("GET", url, timeout=10)
    if status != 200:
        return {"_error": f"HTTP {status}"}
    out = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    except ValueError as e:   # a malformed exposition is a figure of its own, not a failed pair
        out["_error"] = f"unparsable metrics: {e}"[:200]
    return out


def since(after: dict, before: Optional[dict]) -> dict:
    """Counter samples ``after`` less ``before`` (cumulative series of a store that outlives the pair)."""
    if not before:
        return after
    return {k: v - before.get(k, 0.0) if isinstance(v, float) else v for k, v in after.items()}


def run_pair(cluster: Cluster, services: Services, workload: Workload, cfg: Config, plan: Plan,
             reference: dict, capacity: float = 0.0) -> tuple[dict, list]:
    setup = cluster.setup
    cluster.ensure(cfg.profile, cfg.pd, cfg.launch_services)
    record = {"workload": workload.name, "config": cfg.name, "kind": cfg.kind, "description": cfg.description,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    attached = []
    refusals = 0   # admin calls SGLang refused while not idle, retried (cluster.SGLangServer.admin_until_accepted)
    policy = workload.params.get("prefetch_policy") or None
    try:
        cfg.prepare(setup)
        for name in cfg.services:
            services.start(name)
        for s in cluster.servers:
            refusals += s.flush()
            if cfg.backend:
                extra = cfg.extra(setup, s.index)
                record.setdefault("extra_config", {k: v for k, v in extra.items() if "token" not in k})
                if policy:
                    record["prefetch_policy"] = policy
                refusals += s.attach(cfg.backend, extra, prefetch_policy=policy)
                attached.append(s)
        # a PD relay's store lives as long as its servers: this pair's figures are the difference
        before = {s.index: scrape(cfg.metrics_url(setup, s.index)) for s in cluster.servers} \
            if cfg.services_live_with_servers else {}
        results, wall = client.run(cluster.router.url, workload, desc=f"{workload.name}/{cfg.name}",
                                   timeout_s=plan.request_timeout_s)
        record["summary"] = client.summarize(results, wall)
        if capacity:
            offered = record["summary"]["offered_input_tps"]
            record["load"] = {"capacity_input_tps": capacity, "offered_input_tps": offered,
                              "offered_over_capacity": offered / capacity,
                              "overloaded": offered / capacity > OVERLOAD_FRACTION}
        record["store_metrics"] = {s.index: since(scrape(cfg.metrics_url(setup, s.index)), before.get(s.index))
                                   for s in cluster.servers}
        # the output check: idle servers, empty GPU and host caches, a sample of the prompts
        if cfg.backend:
            time.sleep(2.0)   # let write-through reach L3
        for s in cluster.servers:
            refusals += s.flush()
        probes = client.probe(cluster.probe_urls(), workload.sample(plan.probe_prompts), plan.probe_tokens)
        # the probe's pages all come from L3: the counters after it say which server read whose pages
        record["store_metrics_after_probe"] = {s.index: scrape(cfg.metrics_url(setup, s.index))
                                               for s in cluster.servers}
        record["probe"] = {
            "prompts": len(probes), "ok": sum(p.ok for p in probes),
            "storage_tokens": sum(p.cached_from.get("storage", 0) for p in probes),
            "host_tokens": sum(p.cached_from.get("host", 0) for p in probes),   # lmcache_*: LMCache's hits
            "outputs": [p.output for p in probes],
        }
        ref = reference.get(workload.name)
        if ref is not None:
            same = sum(a == b and a != "" for a, b in zip(ref, record["probe"]["outputs"]))
            record["probe"]["identical_to_baseline"] = same
            record["probe"]["mismatches"] = len(ref) - same
        return record, results
    except Exception as e:  # noqa: BLE001 - one failed pair must not end the run
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()[-3000:]
        dead = {s.index: s.proc.popen.returncode for s in cluster.servers
                if s.proc.popen is not None and s.proc.popen.poll() is not None}
        if dead:
            record["servers_exited"] = dead   # relaunched before the next pair
        return record, []
    finally:
        for s in attached:
            try:
                refusals += s.detach()
            except Exception as e:  # noqa: BLE001
                record.setdefault("cleanup_errors", []).append(str(e)[:300])
        record["admin_refusals"] = refusals
        if not cfg.services_live_with_servers:   # those stop with the servers (Cluster.stop)
            services.stop_all()
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")


def machine() -> dict:
    info = {"platform": platform.platform(), "cpus": os.cpu_count()}
    status_text = os.popen("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader "
                           "2>/dev/null").read().strip()
    if status_text:
        info["gpus"] = status_text.splitlines()
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def measure_capacity(cluster: Cluster, workload: Workload, plan: Plan) -> dict:
    """The prompt tokens/s the baseline's servers sustain on ``workload``: a saturating sample of it
    (``workloads.capacity_sample``) through the router, caches emptied before and after. A burst
    recomputes a little more than steady state would, so this errs low: the pairs then run further
    below capacity, never above it."""
    base = CONFIGS[plan.baseline]
    cluster.ensure(base.profile, base.pd, base.launch_services)
    for s in cluster.servers:
        s.flush()
    sample = workloads.capacity_sample(workload, plan.capacity_requests)
    results, wall = client.run(cluster.router.url, sample, desc=f"{workload.name}/capacity",
                               timeout_s=plan.request_timeout_s)
    for s in cluster.servers:
        s.flush()
    summary = client.summarize(results, wall)
    row = {"event": "capacity", "workload": workload.name, "requests": summary["requests"],
           "failed": summary["failed"], "served_input_tps": summary["input_tps"], "duration_s": summary["duration_s"],
           "fraction": plan.load_fraction, "params_before": workload.params}
    if summary["failed"] or summary["input_tps"] <= 0:
        row["error"] = f"{summary['failed']} of {summary['requests']} failed: {summary['errors'][:2]}"
    return row


def previous_runs(path: Path, reference_config: str = BASELINE) -> tuple[dict, dict, list]:
    """What a resumed run keeps from ``path`` (a runs.jsonl): the capacity events by workload, the
    baseline's probe outputs by workload, and the measured pair records (all since the last start)."""
    if not path.exists():
        return {}, {}, []
    capacity, reference, records = {}, {}, []
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("event") == "start":
            capacity, reference, records = {}, {}, []
        elif row.get("event") == "capacity":
            capacity[row["workload"]] = row
        elif "summary" in row:
            records.append(row)
            if row["config"] == reference_config and "probe" in row:
                reference[row["workload"]] = row["probe"]["outputs"]
    return capacity, reference, records


def execute(plan: Plan) -> list[dict]:
    """Run every pair of ``plan``; returns the pair records (also in ``plan.out/runs.jsonl``).

    Before the first pair of W1 or W2 (with ``load_fraction`` > 0) the capacity probe runs on the
    baseline and the load is rebuilt to offer ``load_fraction`` of it; the probe's event is written
    to runs.jsonl, so a resumed run offers the same load. With ``resume``, pairs already measured
    in ``plan.out/runs.jsonl`` are kept and skipped.
    """
    plan.out.mkdir(parents=True, exist_ok=True)
    setup = Setup(plan.workdir, plan.ports, plan.spec.servers, plan.l3_bytes_per_server, plan.l3_file_bytes,
                  plan.write_behind)
    setup.write_hf3fs_ref_config()
    setup.write_lmcache_mp_config()
    model_dir = Path(plan.spec.model_path) if plan.spec.model_path else \
        write_model_dir(Path(plan.workdir) / f"model-{plan.spec.shape}", plan.spec.shape)
    # the Mooncake store process lends what the peer pools lend in all (every server's share), so
    # the shared stores compare at one capacity
    services = Services(plan.workdir, plan.ports,
                        mooncake_segment=plan.spec.servers * parse_size(plan.l3_bytes_per_server),
                        lmcache_l1_gb=plan.lmcache_l1_gb, l3_file_bytes=plan.l3_file_bytes)
    cluster = Cluster(plan, setup, model_dir)
    cluster.services = services
    runs_path, reqs_path = plan.out / "runs.jsonl", plan.out / "requests.jsonl.gz"
    capacity, reference, done = previous_runs(runs_path, plan.reference) if plan.resume else ({}, {}, [])
    measured = {(r["workload"], r["config"]) for r in done}

    def append(row: dict) -> None:
        with open(runs_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    if plan.resume and runs_path.exists():
        append({"event": "resume", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "kept": sorted(f"{w}:{c}" for w, c in measured)})
    else:
        append({"event": "start", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
                "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(plan.spec).items()},
                "workloads": {w.name: w.params for w, _ in plan.pairs},
                "pairs": [[w.name, c] for w, c in plan.pairs]})
    loads: dict = {}        # workload name -> the load its pairs run (rescaled once its capacity is known)
    records = list(done)
    try:
        for workload, name in plan.pairs:
            if (workload.name, name) in measured:
                print(f"[serve] {workload.name}/{name}: measured in an earlier run, kept", flush=True)
                continue
            if workload.name not in loads:
                loads[workload.name] = workload
                if plan.load_fraction > 0 and workload.name in RATED:
                    cap = capacity.get(workload.name)
                    if cap is None:
                        cap = measure_capacity(cluster, workload, plan)
                        if "error" not in cap:
                            cap["offered_input_tps"] = cap["served_input_tps"] * plan.load_fraction
                            cap["params"] = workloads.at_load(workload, cap["offered_input_tps"]).params
                        append(cap)
                        capacity[workload.name] = cap
                        _print_capacity(cap)
                    if "params" in cap:
                        loads[workload.name] = workloads.from_params(workload.name, cap["params"])
            load = loads[workload.name]
            cfg = CONFIGS[name]
            cap_tps = (capacity.get(workload.name) or {}).get("served_input_tps", 0.0)
            need = (load.requests[-1].at if load.requests else 60.0) + 45.0
            refusal = pd_refusal(cfg, setup, plan.spec.kv_device) if cfg.pd else None
            if plan.deadline and time.time() + need > plan.deadline:
                rec = {"workload": workload.name, "config": name, "skipped": f"deadline ({need:.0f} s needed)"}
                print(f"[serve] skip {workload.name}/{name}: deadline", flush=True)
            elif refusal:   # the relay's store cannot serve KV where it lives: what the manager would refuse
                rec = {"workload": workload.name, "config": name, "skipped": refusal, "refused": True}
                print(f"[serve] skip {workload.name}/{name}: {refusal}", flush=True)
            else:
                rec, results = run_pair(cluster, services, load, cfg, plan, reference, cap_tps)
                if name == plan.reference and "probe" in rec:
                    reference[workload.name] = rec["probe"]["outputs"]
                with gzip.open(reqs_path, "at") as f:
                    for r in results:
                        f.write(json.dumps({"workload": workload.name, "config": name, **r.row()}) + "\n")
                _print_pair(rec)
            records.append(rec)
            append(rec)
    finally:
        cluster.stop()
        services.stop_all()
    return records


def _print_capacity(cap: dict) -> None:
    if "error" in cap:
        print(f"[serve] {cap['workload']}: capacity probe FAILED ({cap['error']}); the load runs as given", flush=True)
        return
    print(f"[serve] {cap['workload']}: capacity {cap['served_input_tps']:.0f} prompt tok/s ({cap['requests']} requests "
          f"in {cap['duration_s']:.0f} s); offering {cap['fraction']:.2f} of it: {cap['offered_input_tps']:.0f} tok/s, "
          f"rate {cap['params']['rate']} req/s", flush=True)


def _print_pair(rec: dict) -> None:
    if "error" in rec:
        print(f"[serve] {rec['workload']}/{rec['config']}: FAILED {rec['error']}", flush=True)
        return
    s, p = rec["summary"], rec["probe"]
    load = rec.get("load")
    at = f", {load['offered_over_capacity']:.2f} of capacity{' (OVERLOADED)' if load['overloaded'] else ''}" \
        if load else ""
    by = s.get("ttft_by_source", {})
    split = ", ".join(f"{k} {v['requests']} at {v['ttft_p50_s']:.3f} s" for k, v in by.items())
    print(f"[serve] {rec['workload']}/{rec['config']}: {s['ok']}/{s['requests']} ok, TTFT p50 {s['ttft_p50_s']:.3f} s "
          f"p99 {s['ttft_p99_s']:.3f} s, input {s['input_tps']:.0f} tok/s{at}, storage-hit share "
          f"{s['storage_hit_share']:.2f}; TTFT p50 by prefix source: {split}; probe {p['ok']}/{p['prompts']} ok, "
          f"{p.get('mismatches', '-')} mismatches, {p['storage_tokens']} tokens from L3", flush=True)
