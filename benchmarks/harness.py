"""Common benchmark harness: warm-up, repeats, medians, machine facts, JSON results.

Every benchmark writes ``<results>/<name>.json`` holding the machine, the
parameters, the raw figures and a ``ratios`` list of
``{"metric", "ours", "reference", "ratio", "reference_system"}`` where
``ratio = ours / reference``, oriented so that higher is better unless the metric name says
otherwise (e.g. ``*_seconds_lower_is_better``). ``<results>`` is ``$KVCONNECT_RESULTS_DIR``,
else ``benchmarks/results/`` in a checkout (where the recorded runs live), else
``./kvconnect-results`` (an installed package never writes into site-packages).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

def _results_dir() -> Path:
    if os.environ.get("KVCONNECT_RESULTS_DIR"):
        return Path(os.environ["KVCONNECT_RESULTS_DIR"])
    checkout = Path(__file__).resolve().parent / "results"
    return checkout if checkout.is_dir() else Path.cwd() / "kvconnect-results"


RESULTS_DIR = _results_dir()
GiB = 1 << 30


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        # the same host gives the same value in every run (str hash() is salted per process)
        "hostname_hash": hex(zlib.crc32(platform.node().encode()) & 0xFFFF),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - informational
        pass
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return info


def measure(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` + ``repeats`` times; seconds per run and their median."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"seconds": times, "median_s": statistics.median(times), "min_s": min(times)}


def gib_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / seconds if seconds > 0 else float("inf")


@dataclass
class BenchResult:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def ratio(self, metric: str, ours: float, reference: float, reference_system: str,
              higher_is_better: bool = True) -> dict[str, Any]:
        """Record ``ours / reference`` (or its inverse when lower is better: ratio > 1 = we win)."""
        if higher_is_better:
            r = ours / reference if reference else float("inf")
        else:
            r = reference / ours if ours else float("inf")
        row = {"metric": metric, "ours": ours, "reference": reference, "ratio": round(r, 4),
               "reference_system": reference_system}
        self.ratios.append(row)
        return row

    def print_ratios(self) -> None:
        print(f"\n== {self.name}: ratios (ours / reference; > 1 means kvconnect is better) ==")
        w = max((len(r["metric"]) for r in self.ratios), default=10)
        for r in self.ratios:
            print(f"  {r['metric']:<{w}}  ours {r['ours']:>10.4g}  ref {r['reference']:>10.4g}  "
                  f"ratio {r['ratio']:>7.3f}  vs {r['reference_system']}")

    def write(self, path: Path | None = None) -> Path:
        path = path or RESULTS_DIR / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"name": self.name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine_info(), "params": self.params, "limits": self.limits,
               "figures": self.figures, "ratios": self.ratios, "notes": self.notes}
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"results written to {path}")
        return path

    def finish(self, out: str | Path | None = None) -> Path:
        """The end of a run: the ratios printed, the results written to ``out`` (default:
        benchmarks/results/NAME.json); returns the path written."""
        self.print_ratios()
        return self.write(Path(out) if out else None)


def systems_arg(ap: Any, value: str, accepted: tuple[str, ...]) -> list[str]:
    """The systems a comma-separated ``--systems`` names; ``ap.error`` for any not ``accepted``."""
    systems = [s for s in value.split(",") if s]
    unknown = set(systems) - set(accepted)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)} (accepted: {', '.join(accepted)})")
    return systems


def run_worker(exec_prefix: list[str], module: str, args: list[str], timeout: float, cwd: Path) -> dict[str, Any]:
    """``python -m <module> --worker <args>`` under ``exec_prefix`` (e.g. a namespace's): its
    ``# `` stderr lines echoed, the JSON of its ``RESULT `` stdout line returned; a worker that
    prints none fails with the last lines of its stderr (Mooncake's I/W/E log lines dropped).

    One OpenMP thread: torch's idle OpenMP workers spin after each tensor op and, on a small
    machine, starve Mooncake's transfer threads (the same for every system)."""
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", GLOG_minloglevel="2",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(cwd)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    cmd = list(exec_prefix) + [sys.executable, "-m", module, "--worker", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stderr.splitlines():
        if line.startswith("# "):
            print(line[2:], flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"benchmark worker failed (rc {proc.returncode}):\n"
                       + "\n".join([ln for ln in proc.stderr.splitlines()
                                    if ln[:1] not in "IWE" or "Error" in ln][-40:]))


def load_limits() -> dict[str, Any]:
    """Machine limits from the last ``limits`` run (empty if never run)."""
    p = RESULTS_DIR / "limits.json"
    if p.exists():
        return json.loads(p.read_text()).get("figures", {})
    return {}
