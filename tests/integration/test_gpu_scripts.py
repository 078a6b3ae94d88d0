"""What a GPU run executes under ``benchmarks/gpu/``, run on CPU first.

Mocked everywhere: the GPU (a ``nvidia-smi`` stand-in on PATH lists two H200s) and SGLang's server
(``kvconnect.connectors.testing.launch_server`` for ``run_e2e.sh`` and the drivers,
``kvconnect.connectors.testing.serving_engine`` for ``run_serving.sh``). Real: the scripts themselves
(bash, with their phases' own commands), the drivers and summarize.py as scripts, SGLang's storage
factory, host pool and L3 backends (``file``, ``hf3fs`` with its mock client), kvconnect's adapter, its
hf3fs store and metadata service, ``kvconnect bench serve`` with sglang_router, pip, tar and xz. Every
path a script would put under /tmp goes to a scratch folder (``GPU_TMP``) and every port is offset
to a free range (``PORT_OFFSET`` / ``--port-base``).

``run_e2e.sh``'s ``lmcache_*`` phases start a real ``lmcache server`` 0.5.6 (kvconnect's plugin over
hf3fs, or LMCache's ``fs`` adapter); the stand-in drives it with LMCache's own engine client, CPU KV in
place of SGLang's CUDA connector.

Not run here: ``prepare_serving.sh`` (it downloads wheels from PyPI; covered by ``bash -n`` and
shellcheck), the phases that need Mooncake's master binary or a CUDA Mooncake build (``kvc_mooncake*``
stores, ``pd:kvc_mooncake``) and SGLang's ``hf3fsref`` phase through the script (its page size is the
real model's; ``e2e_driver.py``'s ``blocks:`` wait it uses is run against SGLang's hf3fs backend below).
"""

from __future__ import annotations

import ast
import base64
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kvconnect.connectors.testing.processes import child_env, stop, wait_for
from kvconnect.connectors.testing.standin import MODULE as STANDIN
from kvconnect.connectors.testing.standin import cached, free_offset
from kvconnect.connectors.testing.standin import post_ok as _post_ok
from kvconnect.connectors.testing.standin import start as _standin

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
PAGE = 64                              # run_e2e.sh's --page-size
PAGE_BYTES = PAGE * 2 * 2 * 2 * 8 * 2  # the stand-in's page: 2 layers, K and V, 2 heads of 8, bfloat16
SCRIPTS = {"bundle.sh", "prepare_serving.sh", "run_e2e.sh", "run_serving.sh", "run_vllm.sh"}


# -- helpers ----------------------------------------------------------------------------------------------

def shims(tmp_path: Path) -> Path:
    """A bin folder for PATH: ``python3`` is this interpreter (the project's venv), ``nvidia-smi`` a
    stand-in that lists two H200s."""
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    (b / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (b / "nvidia-smi").write_text(
        '#!/bin/sh\nif [ "$1" = -L ]; then\n  echo "GPU 0: NVIDIA H200 stand-in (UUID: GPU-0)"\n'
        '  echo "GPU 1: NVIDIA H200 stand-in (UUID: GPU-1)"\nelse\n  echo "name, memory.total [MiB]"\n'
        '  echo "NVIDIA H200 stand-in, 143771 MiB"\n  echo "NVIDIA H200 stand-in, 143771 MiB"\nfi\n')
    for f in b.iterdir():
        f.chmod(0o755)
    return b


def script_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = child_env()
    env["PATH"] = f"{shims(tmp_path)}:{env['PATH']}"
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below ``root``."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in out and alive(c):
                out[c] = cmd[c]
                todo.append(c)
    return out


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], tag: str = "py3-none-any") -> Path:
    """A wheel with a correct RECORD (sha256 and size per file)."""
    dist = f"{name}-{version}.dist-info"
    entries = dict(files)
    entries[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    entries[f"{dist}/WHEEL"] = (f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                f"{'true' if tag.endswith('any') else 'false'}\nTag: {tag}\n").encode()
    record = []
    for path, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in entries.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return whl


def make_tar(path: Path, files: dict[str, bytes], mode: str = "w:xz", executable: tuple = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o755 if name in executable else 0o644, time.time()
            t.addfile(info, io.BytesIO(data))
    return path


def fake_lmcache_sdist(path: Path) -> Path:
    """A tar.gz with empty files named as LMCache 0.5.6's CUDA sources (build_lmcache_cuda_ops.SOURCES)."""
    tree = ast.parse((GPU / "build_lmcache_cuda_ops.py").read_text())
    sources = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "SOURCES")
    return make_tar(path, {f"lmcache-0.5.6/csrc/cuda/{s}": b"" for s in sources}, mode="w:gz")


def run(cmd, env, cwd, timeout) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p


# -- static checks ----------------------------------------------------------------------------------------

def test_every_shell_script_parses_and_lints():
    """``bash -n`` on every script (nothing mocked), plus shellcheck (warnings and errors) where it is
    installed. The list of scripts is fixed here so that a new one gets a test."""
    found = {p.name for p in GPU.glob("*.sh")}
    assert found == SCRIPTS
    for name in sorted(found):
        p = subprocess.run(["bash", "-n", str(GPU / name)], capture_output=True, text=True)
        assert (p.returncode, p.stderr) == (0, ""), name
    sc = shutil.which("shellcheck")
    if sc:
        p = subprocess.run([sc, "-S", "warning", "-e", "SC2155", *(str(GPU / n) for n in sorted(found))],
                           capture_output=True, text=True)
        assert (p.returncode, p.stdout) == (0, ""), p.stdout


def test_slim_sglang_kernel_drops_the_optional_extensions(tmp_path):
    """``slim_sglang_kernel.py`` on a synthetic sglang-kernel wheel (nothing mocked; the .so files are
    stand-in bytes): the four optional extension sets go, everything else keeps its bytes, RECORD lists
    exactly the kept files with their original hashes, and the file name is unchanged."""
    big = os.urandom(1 << 20)
    files = {
        "sgl_kernel/__init__.py": b"from sgl_kernel import common_ops\n",
        "sgl_kernel/flash_ops.abi3.so": big,                       # FA3: dropped
        "sgl_kernel/flash_ops_wrapper.py": b"# kept: only the .so goes\n",
        "sgl_kernel/infllm_ops.abi3.so": b"\x7fELF infllm",         # dropped
        "sgl_kernel/infllm_ops_v2.cpython-312-x86_64-linux-gnu.so": b"\x7fELF infllm2",  # dropped
        "sgl_kernel/flashmla_ops.abi3.so": b"\x7fELF flashmla",     # dropped
        "sgl_kernel/sm100/common_ops.abi3.so": b"\x7fELF sm100",    # dropped unless --keep-sm100
        "sgl_kernel/sm100/__init__.py": b"",
        "sgl_kernel/sm90/common_ops.abi3.so": b"\x7fELF sm90",      # kept: H100/H200
        "sgl_kernel/sm90/__init__.py": b"",
        "sgl_kernel/other/flash_ops.abi3.so": b"\x7fELF nested",    # kept: not the top-level FA3
    }
    dropped = {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/infllm_ops.abi3.so",
               "sgl_kernel/infllm_ops_v2.cpython-312-x86_64-linux-gnu.so", "sgl_kernel/flashmla_ops.abi3.so"}
    src = make_wheel(tmp_path / "in", "sglang_kernel", "0.4.5", files, tag="cp310-abi3-manylinux2014_x86_64")
    with zipfile.ZipFile(src) as z:
        record_in = {line.split(",")[0]: line for line in z.read("sglang_kernel-0.4.5.dist-info/RECORD")
                     .decode().splitlines()}

    for keep_sm100, out_dir in ((False, tmp_path / "slim"), (True, tmp_path / "slim100")):
        args = [sys.executable, str(GPU / "slim_sglang_kernel.py"), str(src), str(out_dir)]
        p = subprocess.run(args + (["--keep-sm100"] if keep_sm100 else []), capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        gone = dropped | (set() if keep_sm100 else {"sgl_kernel/sm100/common_ops.abi3.so",
                                                    "sgl_kernel/sm100/__init__.py"})
        out = out_dir / src.name
        with zipfile.ZipFile(out) as z:
            assert z.testzip() is None
            names = set(z.namelist())
            assert names == (set(files) - gone) | {f"sglang_kernel-0.4.5.dist-info/{f}"
                                                   for f in ("METADATA", "WHEEL", "RECORD")}
            for n in set(files) - gone:
                assert z.read(n) == files[n], n
            record = z.read("sglang_kernel-0.4.5.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in record} == names
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            assert line == record_in[path]
            if digest:
                with zipfile.ZipFile(out) as z:
                    data = z.read(path)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                    b"=").decode() and int(size) == len(data)
        for n in gone:
            assert f"dropped {n} (" in p.stdout
        assert out.stat().st_size < src.stat().st_size - (1 << 19)   # the 1 MiB of random bytes went


# -- the drivers against stand-in servers ----------------------------------------------------------------

@pytest.mark.timeout(240)
def test_e2e_driver_waits_flushes_and_replays_against_sglang_hf3fs(tmp_path):
    """``e2e_driver.py run`` and ``replay`` against the stand-in server with SGLang's own hf3fs backend
    (mock client: a file on disk), waiting with ``blocks:`` as run_e2e.sh's hf3fsref phase does.
    Mocked: the GPU and SGLang's scheduler (the stand-in writes back to L3 1 s after each response and
    refuses ``/flush_cache`` until then, as SGLang does with write-backs in flight). Real: the driver,
    SGLang's HiCacheHF3FS and host pool. The first run gives up waiting for L3 (0.2 s) and must retry the
    flush; the second waits until the file's allocated blocks show the pages; a replay after a flush
    reads every recorded prompt back from L3."""
    data = tmp_path / "hf3fs"
    data.mkdir()
    cfg = tmp_path / "hf3fs.json"
    cfg.write_text(json.dumps({"file_path_prefix": str(data / "hicache"), "file_size": 64 << 20, "numjobs": 2,
                               "entries": 8}))
    port = free_offset([30000], 1) + 30000
    proc = _standin(tmp_path, port, "--hicache-storage-backend", "hf3fs", "--hicache-storage-backend-extra-config",
                    '{"use_mock_hf3fs_client": true}', "--write-back-delay-s", "1.0", "--us-per-token", "200",
                    env={"SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(cfg)})
    try:
        url, out, rec = f"http://127.0.0.1:{port}", tmp_path / "results.jsonl", tmp_path / "prompts.jsonl"
        common = [sys.executable, str(GPU / "e2e_driver.py")]
        wait = ["--wait", f"blocks:{data}/hicache*", "--page-bytes", str(PAGE_BYTES // 2), "--objects-per-page", "2"]
        deadline = str(time.time() + 200)
        for plan, timeout, seed_base in (("w256,512,1024", "0.2", "1000"), ("2048", "10", "5000")):
            p = subprocess.run([*common, "run", "--url", url, "--out", str(out), "--tag", "llama:hf3fsref",
                                "--deadline", deadline, "--plan", plan, "--wait-timeout", timeout, "--seed-base",
                                seed_base, "--record", str(rec), *wait], capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stderr
        req = urllib.request.Request(url + "/flush_cache", method="POST")
        assert wait_for(lambda: _post_ok(req), 30, 0.2)
        p = subprocess.run([*common, "replay", "--url", url, "--out", str(out), "--tag", "llama:restart_hf3fsref",
                            "--deadline", deadline, "--ids-from", str(rec), "--label", "L3_replay"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    finally:
        stop(proc)
    rows = rows_of(out)
    gens = [r for r in rows if r["event"] == "gen"]
    assert all(r["status"] == 200 and r["meta"]["e2e_latency"] > 0 and r["e2e_client_s"] > 0 for r in gens)
    assert [r["label"] for r in gens] == [
        "warmup_256_1_cold", *(f"{n}_r1_{ph}" for n in (512, 1024) for ph in ("1_cold", "2_gpu_hit", "3_L3_hit",
                                                                            "4_gpu_hit_again")),
        *(f"2048_r1_{ph}" for ph in ("1_cold", "2_gpu_hit", "3_L3_hit", "4_gpu_hit_again")),
        *(f"{n}_L3_replay{s}" for n in (512, 1024, 2048) for s in ("", "_gpu_hit"))]
    where = {"1_cold": None, "2_gpu_hit": "device", "3_L3_hit": "storage", "4_gpu_hit_again": "device",
             "L3_replay": "storage", "L3_replay_gpu_hit": "device"}
    for r in gens:
        if r["label"].startswith("warmup"):
            continue
        src = where[r["label"].split("_", 1)[1].removeprefix("r1_")]
        d = r["meta"]["cached_tokens_details"]
        if src is None:
            assert r["meta"]["cached_tokens"] == 0 and d is None, r
        else:
            assert d[src] == r["meta"]["cached_tokens"] == cached(r["n"]), r
            assert d["storage_backend"] == "HiCacheHF3FS"
    # one prompt, one output token, however its KV got there; different prompts, different tokens
    by_seed: dict[int, set] = {}
    for r in gens:
        by_seed.setdefault(r["seed"], set()).add(tuple(r["output_ids"]))
    assert all(len(v) == 1 for v in by_seed.values()) and len({next(iter(v)) for v in by_seed.values()}) == 4
    # an L3 hit skips the simulated prefill (200 us a token): faster than the cold one, by the server's clock
    t = {r["label"]: r["meta"]["e2e_latency"] for r in gens}
    for n in (512, 1024, 2048):
        assert t[f"{n}_r1_3_L3_hit"] < t[f"{n}_r1_1_cold"] and t[f"{n}_r1_1_cold"] > n * 200e-6
    waits = [r for r in rows if r["event"] == "wait_l3"]
    assert [w["ok"] for w in waits] == [False, False, True]
    assert waits[2]["now"] - waits[2]["before"] >= waits[2]["want_new"] == 2 * (cached(2048) // PAGE)
    notes = [r["msg"] for r in rows if r["event"] == "note"]
    assert notes == ["512_r1: L3 write-back incomplete; flushing anyway",
                     "1024_r1: L3 write-back incomplete; flushing anyway"]
    flushes = [r for r in rows if r["event"] == "flush"]
    ok = [f for f in flushes if f.get("status") == 200]
    assert len(ok) == 3 and ok[0]["attempt"] >= 1 and ok[2]["attempt"] == 0
    assert "HTTP Error 400" in flushes[0]["error"]
    # the recorded prompts are the driver's seeded ones, and the replay sent exactly those
    recorded = rows_of(rec)
    assert [(r["prefix"], r["n"]) for r in recorded] == [("512_r1", 512), ("1024_r1", 1024), ("2048_r1", 2048)]
    for r in recorded:
        rnd = random.Random(r["seed"])
        assert r["ids"] == [rnd.randrange(1, 120000) for _ in range(r["n"])]
    # every page went to the hf3fs file as two 4 KiB objects (K and V)
    pages = sum(cached(n) // PAGE for n in (256, 512, 1024, 2048))
    assert sum(f.stat().st_blocks * 512 for f in data.glob("hicache*")) == pages * PAGE_BYTES


def test_pd_driver_records_failed_requests_and_goes_on(tmp_path):
    """``pd_driver.py`` with the prefill server down: each request is recorded with its error, every
    level still gets its wave line (0 ok), and summarize.py reads the result. Mocked: the decode server
    (the stand-in's PD decode half, giving up on a room after 1 s). Real: the driver, summarize.py."""
    off = free_offset([30000, 30001, 8998], 3)
    decode = _standin(tmp_path, 30001 + off, "--disaggregation-mode", "decode", "--pd-timeout-s", "1")
    out = tmp_path / "pd.jsonl"
    try:
        p = subprocess.run([sys.executable, str(GPU / "pd_driver.py"), "--prefill", f"http://127.0.0.1:{30000 + off}",
                            "--decode", f"http://127.0.0.1:{30001 + off}", "--bootstrap-port", str(8998 + off),
                            "--tokens", "256", "--levels", "1,2", "--new-tokens", "4", "--timeout", "30",
                            "--out", str(out), "--tag", "pd:kvc_peer_rdma"], capture_output=True, text=True,
                           timeout=120)
    finally:
        stop(decode)
    assert p.returncode == 0, p.stderr
    rows = rows_of(out)
    assert [r["event"] for r in rows] == ["pd_warmup", "pd_req", "pd_wave", "pd_req", "pd_req", "pd_wave"]
    for r in rows:
        if r["event"] == "pd_wave":
            assert (r["ok"], r["ttft_median_s"], r["input_tok_s"]) == (0, None, 0.0) and r["n"] == r["concurrency"]
        else:
            assert r["prefill_status"] is None and r["decode_status"] == 500 and r["ttft_s"] is None
            assert r["error"].startswith("prefill: ConnectionRefusedError") and r["output_ids"] == []
    q = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(out), "--out", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=60)
    assert q.returncode == 0, q.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["figures"]["pd"]["kvc_peer_rdma|c2"]["ok"] == 0 and doc["ratios"] == []


def _expected_e2e_ratios(rows: list[dict]) -> dict[str, float]:
    """summarize.py's ratios for one results file, computed here from its rows."""
    l3, cold, waves = {}, {}, {}
    for r in rows:
        if r.get("event") == "pd_wave":
            waves[(r["tag"][3:], r["concurrency"])] = r
        if r.get("event") != "gen" or r["label"].startswith("warmup"):
            continue
        store = re.sub(r"_(A|B|Bwarm)$", "", r["tag"].split(":")[1].removeprefix("cross_"))
        if r["label"].endswith("_1_cold"):
            cold.setdefault(r["n"], []).append(r["meta"]["e2e_latency"])
        elif r["label"].endswith("_3_L3_hit"):
            l3.setdefault((store, r["n"]), []).append(r["meta"]["e2e_latency"])
    out = {}
    for (store, n), v in l3.items():
        out[f"{store}_llama-8b_{n}_l3_over_cold"] = round(statistics.median(v) / statistics.median(cold[n]), 4)
        if store != "file":
            out[f"{store}_llama-8b_{n}_vs_file"] = round(statistics.median(l3[("file", n)]) / statistics.median(v), 4)
    for (tr, c), w in waves.items():
        if tr != "mooncake_ref":
            ref = waves[("mooncake_ref", c)]
            out[f"pd_{tr}_c{c}_ttft_vs_mooncake"] = round(ref["ttft_median_s"] / w["ttft_median_s"], 4)
            out[f"pd_{tr}_c{c}_input_tok_s_vs_mooncake"] = round(w["input_tok_s"] / ref["input_tok_s"], 4)
    return out


E2E_PORTS = [30000, 30001, 9400, 9401, 18000, 8998, 50051, 9003, 9310, 31998]


def run_e2e_phases(tmp_path: Path, ports: list[int], seed: int, phases: list[str], timeout: int,
                   **env: str) -> tuple[str, Path, Path]:
    """``run_e2e.sh PHASES`` with the stand-in server on free ports; every phase must report ok.
    Returns the log, the script's GPU_TMP and its OUT."""
    gtmp, out, cwd = tmp_path / "t", tmp_path / "out", tmp_path / "checkout"
    cwd.mkdir()
    env = script_env(tmp_path, GPU_TMP=str(gtmp), OUT=str(out), PORT_OFFSET=str(free_offset(ports, seed)),
                     SGLANG_SERVER_MODULE=STANDIN, DEADLINE_S="500", KVC_STANDIN_ARGS="--us-per-token 50", **env)
    p = run(["bash", str(GPU / "run_e2e.sh"), *phases], env, cwd, timeout)
    log = p.stdout + p.stderr
    for ph in phases:
        assert f"=== phase {ph} ok" in log, log[-4000:]
    return log, gtmp, out


@pytest.mark.timeout(360)
def test_run_e2e_store_restart_cross_and_pd_phases(tmp_path):
    """``run_e2e.sh llama:file llama:kvc_hf3fs llama:restart_kvc_hf3fs llama:cross_kvc_hf3fs pd:mooncake_ref
    pd:kvc_peer_rdma stop``, each phase as on the GPU machine, with the stand-in as
    ``SGLANG_SERVER_MODULE``. Mocked: the GPU, SGLang's server (the stand-in, with SGLang's file backend
    and kvconnect's adapter behind it), and PD's KV transfer (the stand-in pair hands page digests over
    its bootstrap port, whatever the transport). Real: the script, e2e_driver.py (run and replay, waits
    on ``files:`` and the adapter's ``/metrics``), pd_driver.py, kvconnect's hf3fs store and metadata
    service (the restart and the second server read the first one's pages), summarize.py on the result."""
    phases = ["llama:file", "llama:kvc_hf3fs", "llama:restart_kvc_hf3fs", "llama:cross_kvc_hf3fs",
              "pd:mooncake_ref", "pd:kvc_peer_rdma", "stop"]
    log, gtmp, out = run_e2e_phases(tmp_path, E2E_PORTS, 2, phases, 330, PLAN="w256,512,1024", PD_LEVELS="1,3")
    assert (gtmp / "sglogs" / "phases_done").read_text().split() == phases
    # everything the script started is gone: servers, the metadata service
    pids = [int(f.read_text()) for f in (gtmp / "sglogs").glob("*.pid")] + [int(x) for x in re.findall(
        r"metadata service pid (\d+)", log)]
    assert len(pids) >= 9 and not [x for x in pids if alive(x)]

    rows = rows_of(out / "results.jsonl")
    servers = ["llama_file", "llama_kvc_hf3fs", "llama_kvc_hf3fs_restart", "llama_kvc_hf3fs_A", "llama_kvc_hf3fs_B",
               "pd_mooncake_ref_prefill", "pd_mooncake_ref_decode", "pd_kvc_peer_rdma_prefill",
               "pd_kvc_peer_rdma_decode"]
    assert [r["name"] for r in rows if r["event"] == "launch"] == servers
    assert [r["ok"] for r in rows if r["event"] == "wait"] == [True] * len(servers)
    gens = [r for r in rows if r["event"] == "gen"]
    count = {}
    for r in gens:
        count[r["tag"]] = count.get(r["tag"], 0) + 1
    assert count == {"llama:file": 9, "llama:kvc_hf3fs": 9, "llama:restart_kvc_hf3fs": 4,
                     "llama:cross_kvc_hf3fs_A": 8, "llama:cross_kvc_hf3fs_Bwarm": 1, "llama:cross_kvc_hf3fs_B": 4}
    for r in gens:
        assert r["status"] == 200 and r["meta"]["prompt_tokens"] == r["n"] and r["meta"]["e2e_latency"] > 0, r
        d, label = r["meta"]["cached_tokens_details"], r["label"]
        if label.endswith("_cold"):
            assert d is None, r
        elif label.endswith(("_L3_hit", "_L3_after_restart", "_L3_cross_instance")):
            # from L3: the restarted server and server B hold none of these prompts on their "GPU"
            assert d["storage"] == cached(r["n"]) and d["device"] == 0, r
        else:
            assert d["device"] == cached(r["n"]) and d["storage"] == 0, r
    backends = {r["tag"]: r["meta"]["cached_tokens_details"]["storage_backend"] for r in gens
                if r["meta"]["cached_tokens_details"]}
    assert backends["llama:file"] == "HiCacheFile" and backends["llama:cross_kvc_hf3fs_B"] == "KVConnectStorage"
    assert sorted(r["n"] for r in gens if r["label"].endswith("L3_cross_instance")) == [512, 1024]
    outputs: dict[tuple, set] = {}
    for r in gens:
        outputs.setdefault((r["n"], r["seed"]), set()).add(tuple(r["output_ids"]))
    assert all(len(v) == 1 for v in outputs.values())
    # L3 progress was seen (file count, the adapter's put counter) before each flush
    waits = [r for r in rows if r["event"] == "wait_l3"]
    assert len(waits) == 6 and all(w["ok"] and w["now"] - w["before"] >= w["want_new"] for w in waits)
    assert [w["want_new"] for w in waits] == [cached(512) // PAGE, cached(1024) // PAGE] * 3
    # the store's own read counters around each kvconnect L3 hit: the prompt's pages and bytes
    for b in (r for r in rows if r["event"] == "l3_breakdown"):
        n = int(b["label"].split("_")[0])
        assert b["store_get_bytes"] == cached(n) // PAGE * PAGE_BYTES and b["store_get_s"] >= 0, b
        if "store_get_pages" in b:
            assert b["store_get_pages"] == cached(n) // PAGE
    assert len([r for r in rows if r["event"] == "l3_breakdown"]) == 8

    # PD: every request answered by both halves, same tokens over both transports
    for tr in ("mooncake_ref", "kvc_peer_rdma"):
        mine = [r for r in rows if r.get("tag") == f"pd:{tr}"]
        reqs = [r for r in mine if r["event"] == "pd_req"]
        assert [r["concurrency"] for r in reqs] == [1, 3, 3, 3]
        assert [r["seed"] for r in reqs] == [1000, 3000, 3001, 3002]
        assert len({r["room"] for r in mine if "room" in r}) == 5
        for r in reqs + [x for x in mine if x["event"] == "pd_warmup"]:
            assert (r["prefill_status"], r["decode_status"], r["completion_tokens"], r["prompt_tokens"]) == (
                200, 200, 8, 8192) and 0 < r["ttft_s"] <= r["e2e_s"] and len(r["output_ids"]) == 8, r
        waves = [r for r in mine if r["event"] == "pd_wave"]
        assert [(w["concurrency"], w["ok"], w["n"]) for w in waves] == [(1, 1, 1), (3, 3, 3)]
        for w in waves:
            assert abs(w["input_tok_s"] - w["ok"] * 8192 / w["wall_s"]) < 1e-3 * w["input_tok_s"]
            assert 0 < w["ttft_median_s"] <= w["ttft_max_s"]
    pd_out = {}
    for r in rows:
        if r["event"] == "pd_req":
            pd_out.setdefault(r["seed"], set()).add(tuple(r["output_ids"]))
    assert all(len(v) == 1 for v in pd_out.values()) and len(pd_out) == 4

    # summarize.py on this run: exit 0 (outputs agree), the ratios the rows give
    p = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(out / "results.jsonl"), "--out",
                        str(tmp_path / "gpu_e2e.json")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "gpu_e2e.json").read_text())
    got = {r["metric"]: r["ratio"] for r in doc["ratios"]}
    assert got == _expected_e2e_ratios(rows)
    assert {"kvc_hf3fs_llama-8b_1024_vs_file", "file_llama-8b_512_l3_over_cold",
            "pd_kvc_peer_rdma_c3_ttft_vs_mooncake"} <= set(got)
    assert doc["figures"]["output_check"]["mismatches"] == {}
    assert doc["figures"]["output_check"]["l3_generations_checked"] == 10
    assert doc["figures"]["pd_output_check"] == {"prompts": 4, "mismatches": {}}
    with tarfile.open(out / "logs.tgz") as t:
        assert {f"./{s}.log" for s in servers} | {"./meta.log"} <= set(t.getnames())


LMCACHE_PORTS = [30000, 9400, 18000, 5556, 9480]


@pytest.mark.timeout(300)
def test_run_e2e_lmcache_in_front_phases(tmp_path):
    """``run_e2e.sh llama:lmcache_kvc_hf3fs llama:restart_lmcache_kvc_hf3fs llama:lmcache_fs
    llama:restart_lmcache_fs stop``: SGLang with ``--enable-lmcache`` in front of a standalone ``lmcache
    server`` whose L2 is kvconnect's plugin over hf3fs (+ metadata service) or LMCache's own ``fs``
    adapter; the restart phases restart both, so their hits come from the L2. Mocked: the GPU and
    SGLang's server (the stand-in in its LMCache mode: LMCache's own engine client with CPU KV instead of
    SGLang's CUDA connector). Real: the script, e2e_driver.py (waits on the plugin's ``/metrics`` and on
    the fs adapter's files), ``lmcache server`` 0.5.6 with both L2s, kvconnect's hf3fs store and
    metadata service, summarize.py on the result."""
    phases = ["llama:lmcache_kvc_hf3fs", "llama:restart_lmcache_kvc_hf3fs", "llama:lmcache_fs",
              "llama:restart_lmcache_fs", "stop"]
    log, gtmp, out = run_e2e_phases(tmp_path, LMCACHE_PORTS, 5, phases, 280, PLAN="w512,512,1024", LMC_L1_GB="0.25")
    assert log.count("lmcache server up (lmcache_kvc_hf3fs") == 2 and log.count("lmcache server up (lmcache_fs") == 2
    pids = [int(f.read_text()) for f in (gtmp / "sglogs").glob("*.pid")]
    assert pids and not [x for x in pids if alive(x)]

    rows = rows_of(out / "results.jsonl")
    gens = [r for r in rows if r["event"] == "gen"]
    by_tag: dict[str, list] = {}
    for r in gens:
        assert r["status"] == 200 and r["meta"]["prompt_tokens"] == r["n"], r
        by_tag.setdefault(r["tag"], []).append(r)
    for store in ("lmcache_kvc_hf3fs", "lmcache_fs"):
        first, again = by_tag[f"llama:{store}"], by_tag[f"llama:restart_{store}"]
        # warm-up + (cold, GPU hit, LMCache hit after the flush, GPU hit) per prompt; after the restart two
        # fresh prompts, then each recorded prompt from the L2 and once more from the GPU
        assert [r["label"] for r in first] == ["warmup_512_1_cold"] + [
            f"{n}_r1_{x}" for n in (512, 1024) for x in ("1_cold", "2_gpu_hit", "3_L3_hit", "4_gpu_hit_again")], first
        assert [r["label"] for r in again] == ["512_L2_after_restart_cold_first_1", "512_L2_after_restart_cold_first_2",
                                               "512_L2_after_restart", "512_L2_after_restart_gpu_hit",
                                               "1024_L2_after_restart", "1024_L2_after_restart_gpu_hit"]
        for r in first + again:
            d = r["meta"]["cached_tokens_details"]
            if "cold" in r["label"]:
                assert r["meta"]["cached_tokens"] == 0 and d is None, r
            elif r["label"].endswith(("_3_L3_hit", "_L2_after_restart")):
                # LMCache's whole chunks of the cached tokens (all but the last), none on the "GPU"
                assert d["device"] == 0 and d["host"] == (r["n"] - 1) // 256 * 256 > 0, r
            else:
                assert d["device"] > 0, r
        outputs: dict[int, set] = {}
        for r in first + again:
            if "cold_first" not in r["label"] and not r["label"].startswith("warmup"):
                outputs.setdefault(r["n"], set()).add(tuple(r["output_ids"]))
        assert sorted(outputs) == [512, 1024] and all(len(v) == 1 for v in outputs.values()), outputs
    # the driver saw the L2 hold each prompt's chunks before flushing: the plugin's put counter, fs's files
    waits = [r for r in rows if r["event"] == "wait_l3"]
    assert [(w["tag"], w["want_new"]) for w in waits] == [("llama:lmcache_kvc_hf3fs", 1), ("llama:lmcache_kvc_hf3fs", 3),
                                                          ("llama:lmcache_fs", 1), ("llama:lmcache_fs", 3)]
    assert all(w["ok"] for w in waits), waits
    # the plugin's read counters: nothing read from the store while LMCache's L1 held the prompt, the
    # prompt's chunks after the restart emptied it
    bd = {(b["tag"], b["label"]): b for b in rows if b["event"] == "l3_breakdown"}
    assert {k: v["store_get_bytes"] for k, v in bd.items() if k[0] == "llama:lmcache_kvc_hf3fs"} == {
        ("llama:lmcache_kvc_hf3fs", "512_r1_3_L3_hit"): 0, ("llama:lmcache_kvc_hf3fs", "1024_r1_3_L3_hit"): 0}
    restarted = [v for k, v in bd.items() if k[0] == "llama:restart_lmcache_kvc_hf3fs"]
    assert len(restarted) == 2 and all(v["store_get_bytes"] > 0 for v in restarted), restarted
    # the lmcache server's own account of each hit (its log): the chunks came from L1 after the flush, from
    # the L2 after the restart, and were retrieved into the engine's KV
    lm = {(b["tag"], b["label"]): b for b in rows if b["event"] == "lmcache_breakdown"}
    for r in gens:
        b, chunks = lm[(r["tag"], r["label"])], (r["n"] - 1) // 256
        if r["label"].endswith("_3_L3_hit"):
            assert (b["prefetch_keys_l1"], b["prefetch_keys_l2"], b["retrieved_tokens"]) == (chunks, 0, chunks * 256), b
        elif r["label"].endswith("_L2_after_restart"):
            assert (b["prefetch_keys_l1"], b["prefetch_keys_l2"], b["retrieved_tokens"]) == (0, chunks, chunks * 256), b
            assert len(b["prefetch_ms"]) == len(b["retrieve_s"]) == 1, b
        elif "cold" in r["label"]:
            assert b["retrieved_tokens"] == 0 and b["prefetch_keys_l2"] == 0, b

    p = subprocess.run([sys.executable, str(GPU / "summarize.py"), str(out / "results.jsonl"), "--out",
                        str(tmp_path / "gpu_lmcache.json"), "--machine", "CPU stand-in"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "gpu_lmcache.json").read_text())
    got = {r["metric"]: r for r in doc["ratios"]}
    cold = {n: statistics.median(r["meta"]["e2e_latency"] for r in gens if r["label"] == f"{n}_r1_1_cold")
            for n in (512, 1024)}
    for n in (512, 1024):
        l2 = {s: statistics.median(r["meta"]["e2e_latency"] for r in by_tag[f"llama:restart_{s}"]
                                   if r["label"] == f"{n}_L2_after_restart") for s in ("lmcache_kvc_hf3fs", "lmcache_fs")}
        for s, v in l2.items():
            assert got[f"{s}_llama-8b_{n}_l2_restart_over_cold"]["ratio"] == round(v / cold[n], 4)
        assert got[f"lmcache_kvc_hf3fs_llama-8b_{n}_l2_restart_vs_lmcache_fs"]["ratio"] == round(
            l2["lmcache_fs"] / l2["lmcache_kvc_hf3fs"], 4)
    assert doc["params"]["machine"] == "CPU stand-in" and doc["figures"]["output_check"]["mismatches"] == {}
    with tarfile.open(out / "logs.tgz") as t:
        assert {"./lmcache.log", "./meta.log", "./llama_lmcache_fs_restart.log"} <= set(t.getnames())


@pytest.mark.timeout(240)
def test_install_phases_unpack_the_carried_folders(tmp_path):
    """The install phases of ``run_serving.sh`` (install1, install2, install5) and ``run_e2e.sh`` (diag,
    install1-5), both made of ``bundle.sh``'s steps, on synthetic carried folders: tiny wheels, tar.xz archives with a fake ``mooncake``
    package and ``mooncake_master`` or a stand-in for LMCache's bundle, a JIT cache tarball. Mocked: the wheels' and archives' contents and
    ``nvidia-smi``. Real: the scripts, pip (--no-index --target), xz/tar, the import checks (the fake
    mooncake modules shadow the installed ones through the scripts' PYTHONPATH) and the entry point of
    the dist-info install4 writes."""
    cwd = tmp_path / "checkout"
    make_wheel(cwd / ".gpuwheels1", "gpufake", "0.1", {"gpufake/__init__.py": b"VALUE = 41\n"})
    make_wheel(cwd / ".gpuserve1", "peerfake", "0.2", {"peerfake/__init__.py": b"VALUE = 42\n"})
    make_wheel(cwd / ".gpuwheels2", "gpufake2", "0.3", {"gpufake2/__init__.py": b"VALUE = 43\n"})
    make_tar(cwd / ".gpuserve2" / "site2.tar.xz", {"./site2mod.py": b"VALUE = 44\n"})
    mooncake = {"mooncake/__init__.py": b"", "mooncake/store.py": b"KIND = 'host'\n",
                "mooncake/engine.py": b"", "mooncake/mooncake_master": b"#!/bin/sh\necho master\n",
                "ibv/libibverbs.so.1": b"\x7fELF"}
    make_tar(cwd / ".gpumc" / "mc312.tar.xz", mooncake)   # mooncake_master without its x bit: the phase sets it
    make_tar(cwd / ".gpumccuda" / "mccuda312.tar.xz", {**mooncake, "mooncake/store.py": b"KIND = 'cuda'\n",
                                                       "ibv/libcudart.so.12": b"\x7fELF"})
    make_tar(cwd / ".gpujitcache" / "jitcache.tgz", {"jitcache/triton/kernel.bin": b"cubin"}, mode="w:gz")
    make_tar(cwd / ".gpulmc" / "site4.tar.xz", {"./lmcfake.py": b"VALUE = 45\n"})
    fake_lmcache_sdist(cwd / ".gpulmcsrc" / "lmcache-0.5.6.tar.gz")

    s_tmp, s_out = tmp_path / "serving_tmp", tmp_path / "serving_out"
    env = script_env(tmp_path, GPU_TMP=str(s_tmp), OUT=str(s_out), WRITE_PROBE_MB="8")
    p = run(["bash", str(GPU / "run_serving.sh"), "install1", "install2"], env, cwd, 200)
    log = p.stdout + p.stderr
    assert "install1 done" in log and "install2 done" in log and "FAILED" not in log, log
    assert (s_tmp / "site1" / "gpufake" / "__init__.py").read_text() == "VALUE = 41\n"
    assert (s_tmp / "site1" / "peerfake" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (s_tmp / "site1" / "gpufake-0.1.dist-info" / "RECORD").is_file()
    assert (s_tmp / "site2" / "site2mod.py").read_text() == "VALUE = 44\n"
    master = s_tmp / "site3" / "mooncake" / "mooncake_master"
    assert master.read_bytes() == mooncake["mooncake/mooncake_master"] and os.access(master, os.X_OK)
    assert (s_tmp / "jitcache" / "triton" / "kernel.bin").read_bytes() == b"cubin"
    # install2 dates site1/site2 back so that JIT caches stay newer than the headers they were built from
    assert time.localtime((s_tmp / "site1" / "gpufake" / "__init__.py").stat().st_mtime).tm_year == 2000
    assert time.localtime((s_tmp / "site2" / "site2mod.py").stat().st_mtime).tm_year == 2000
    diag = (s_out / "diag.txt").read_text()
    assert "NVIDIA H200 stand-in, 143771 MiB" in diag and re.search(r"Python 3\.\d+", diag)
    for medium in ("/tmp", "/dev/shm"):
        assert re.search(rf"^{medium}: 8388608 bytes .* copied", diag, re.M), diag

    e_tmp, e_out = tmp_path / "e2e_tmp", tmp_path / "e2e_out"
    env = script_env(tmp_path, GPU_TMP=str(e_tmp), OUT=str(e_out))
    phases = ["diag", "install1", "install2", "install3", "install4"]
    p = run(["bash", str(GPU / "run_e2e.sh"), *phases], env, cwd, 200)
    log = p.stdout + p.stderr
    for ph in phases:
        assert f"=== phase {ph} ok" in log, log
    assert (e_tmp / "sglogs" / "phases_done").read_text().split() == phases
    assert f"installed 1 wheels from .gpuwheels1 into {e_tmp}/site1" in log
    assert f"installed 1 wheels from .gpuwheels2 into {e_tmp}/site2" in log
    assert (e_tmp / "site2" / "gpufake2" / "__init__.py").read_text() == "VALUE = 43\n"
    assert "NVIDIA H200 stand-in" in (e_out / "diag.txt").read_text()
    # install4 replaced install3's Mooncake with the CUDA one and declared kvconnect's PD plugin
    site3 = e_tmp / "site3"
    assert (site3 / "mooncake" / "store.py").read_text() == "KIND = 'cuda'\n"
    assert (site3 / "ibv" / "libcudart.so.12").is_file() and os.access(site3 / "mooncake" / "mooncake_master",
                                                                        os.X_OK)
    from importlib.metadata import distributions

    dists = [d for d in distributions(path=[str(site3)]) if d.metadata["Name"] == "kvconnect"]
    assert len(dists) == 1 and dists[0].version == "0.0.0+gpu"
    eps = [e for e in dists[0].entry_points if e.group == "sglang.srt.plugins"]
    assert [(e.name, e.value) for e in eps] == [("kvconnect", "kvconnect.connectors.engines.sglang_pd_plugin:register")]
    assert callable(eps[0].load())
    assert (e_tmp / "jitcache" / "triton" / "kernel.bin").read_bytes() == b"cubin"
    # install5 (on its own: LMCache imports Mooncake's engine where one is installed, and these fake ones
    # have none): LMCache's bundle in site4, first on the path, and whether its CUDA ops load in diag.txt
    # the same from run_serving.sh, for its lmcache_* configurations
    for script, phase_ok in (("run_e2e.sh", "=== phase install5 ok"), ("run_serving.sh", "=== install5")):
        l_tmp, l_out = tmp_path / f"lmc_tmp_{script}", tmp_path / f"lmc_out_{script}"
        p = run(["bash", str(GPU / script), "install5"], script_env(tmp_path, GPU_TMP=str(l_tmp), OUT=str(l_out)),
                cwd, 200)
        log = p.stdout + p.stderr
        assert phase_ok in log and "installed lmcache into" in log and "FAILED" not in log, (script, log)
        assert (l_tmp / "site4" / "lmcfake.py").read_text() == "VALUE = 45\n"
        diag = (l_out / "diag.txt").read_text()
        # the wheel's CUDA ops cannot load here, so install5 tried to build them from the source archive, and
        # the build says why it cannot (no CUDA on this machine)
        assert "lmcache.cuda_ops: ImportError" in diag and re.search(
            r"build_lmcache_cuda_ops: (nvcc not found|torch .* sees no CUDA GPU)", diag), (script, diag)


def test_build_lmcache_cuda_ops_says_why_it_cannot_build(tmp_path):
    """build_lmcache_cuda_ops.py refuses with exit status 2 and the reason: a missing archive, one without
    LMCache's sources or with some missing, and on this machine (no GPU) the missing nvcc or CUDA. Mocked:
    the archives' contents (empty files with LMCache 0.5.6's names)."""
    full = fake_lmcache_sdist(tmp_path / "full.tar.gz")
    part = make_tar(tmp_path / "part.tar.gz", {"lmcache-0.5.6/csrc/cuda/pybind.cpp": b""}, mode="w:gz")
    other = make_tar(tmp_path / "other.tar.gz", {"other-1.0/setup.py": b""}, mode="w:gz")
    script = [sys.executable, str(GPU / "build_lmcache_cuda_ops.py")]
    for args, reason in ((["--sdist", str(tmp_path / "nope.tar.gz")], "no such file"),
                         (["--sdist", str(other)], "no csrc/ folder"),
                         (["--sdist", str(part)], "csrc/cuda lacks mem_kernels.cu, mp_mem_kernels.cu"),
                         (["--sdist", str(full)], r"nvcc not found|sees no CUDA GPU")):
        p = subprocess.run(script + args, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and re.search(reason, p.stderr), (args, p.stderr)


def test_every_script_prints_its_usage_and_its_env():
    """``-h`` on every shell script prints the header (its phases and the environment it reads) and
    exits 0; run_serving.sh and run_e2e.sh with no phase print it too and fail. Nothing mocked."""
    for name, words in {"run_serving.sh": ("install1", "BUNDLE_DIR", "SERVE_ARGS", "DEADLINE_S"),
                        "run_e2e.sh": ("install5", "BUNDLE_DIR", "LMCACHE_TAR", "LMC_L1_GB", "PLAN"),
                        "prepare_serving.sh": ("BUNDLE_DIR", ".gpuwheels1"),
                        "run_vllm.sh": ("VLLM_SPEC", "VLLM_VENV")}.items():
        p = subprocess.run(["bash", str(GPU / name), "-h"], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and all(w in p.stdout for w in words), (name, p.stdout)
        assert not p.stdout.startswith("#") and "set -" not in p.stdout, name
    for name in ("run_serving.sh", "run_e2e.sh"):
        p = subprocess.run(["bash", str(GPU / name)], capture_output=True, text=True, timeout=30)
        assert p.returncode != 0 and "Env" in p.stdout, name
    for name in ("e2e_driver.py", "pd_driver.py", "summarize.py", "slim_sglang_kernel.py", "build_lmcache_cuda_ops.py"):
        p = subprocess.run([sys.executable, str(GPU / name), "--help"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.strip(), name


def test_install_phases_read_the_bundle_from_BUNDLE_DIR(tmp_path):
    """The bundle in a folder of its own (``BUNDLE_DIR``), the scripts run from elsewhere: run_serving.sh
    install2 and run_e2e.sh install2, the latter unpacking prepare_serving.sh's ``site2.tar.xz`` where
    there is no ``.gpuwheels2`` folder. Mocked: the archives' contents. Real: the scripts, xz/tar."""
    bundle, elsewhere = tmp_path / "bundle", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_tar(bundle / ".gpuserve2" / "site2.tar.xz", {"./site2mod.py": b"VALUE = 44\n"})
    make_tar(bundle / ".gpumc" / "mc312.tar.xz", {"mooncake/__init__.py": b"", "mooncake/store.py": b"",
                                                  "mooncake/engine.py": b"", "mooncake/mooncake_master": b"#!/bin/sh\n"})
    for name, phase_ok in (("run_serving.sh", "install2 done"), ("run_e2e.sh", "=== phase install2 ok")):
        gtmp = tmp_path / f"{name}_tmp"
        env = script_env(tmp_path, GPU_TMP=str(gtmp), OUT=str(tmp_path / f"{name}_out"), BUNDLE_DIR=str(bundle))
        p = run(["bash", str(GPU / name), "install2"], env, elsewhere, 120)
        log = p.stdout + p.stderr
        assert phase_ok in log and "FAILED" not in log, log
        assert (gtmp / "site2" / "site2mod.py").read_text() == "VALUE = 44\n"


SERVE_PORTS = [30000, 30001, 31000, 18000, 18010, 50051, 9003, 9310, 31998, 9400, 9401, 32998, 31900]


def _serve_env(tmp_path: Path, name: str, pairs: str, **extra: str) -> tuple[dict, Path, Path]:
    gtmp, out = tmp_path / f"{name}_tmp", tmp_path / f"{name}_out"
    base = free_offset(SERVE_PORTS, hash(name) & 0xFFFF)
    args = (f"--quick --server-module kvconnect.connectors.testing.serving_engine --servers 2 --pairs {pairs} "
            f"--port-base {base}")
    return script_env(tmp_path, GPU_TMP=str(gtmp), OUT=str(out), SERVE_ARGS=args, **extra), gtmp, out


@pytest.mark.timeout(300)
def test_run_serving_start_wait_copies_the_results(tmp_path):
    """``run_serving.sh start wait stop`` with ``SERVE_ARGS`` pointing ``kvconnect bench serve`` at the CPU
    stand-in server (``--quick``, two servers, w1:l2_only and w1:kvc_memory). Mocked: the GPU and SGLang's
    server (serving_engine). Real: the script, the benchmark, sglang_router, kvconnect's adapter and
    memory store. ``wait`` returns when the benchmark ends and copies what it wrote into $OUT."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    env, gtmp, out = _serve_env(tmp_path, "a", "w1:l2_only,w1:kvc_memory", DEADLINE_S="280")
    p = run(["bash", str(GPU / "run_serving.sh"), "start", "wait", "stop"], env, cwd, 290)
    log = p.stdout + p.stderr
    assert "serving benchmark started" in log and "benchmark finished" in log, log[-3000:]
    serve = gtmp / "serve"
    bench_pid = int((serve / "pid").read_text())
    assert not alive(bench_pid)
    for f in ("runs.jsonl", "serving.json", "requests.jsonl.gz"):
        assert (out / f).read_bytes() == (serve / "out" / f).read_bytes(), f
    runs = rows_of(out / "runs.jsonl")
    assert runs[0]["event"] == "start"
    pairs = {(r["workload"], r["config"]): r for r in runs if "config" in r and "summary" in r}
    assert set(pairs) == {("w1", "l2_only"), ("w1", "kvc_memory")}
    for r in pairs.values():
        s = r["summary"]
        assert s["failed"] == 0 and s["ok"] == s["requests"] > 0 and s["ttft_p50_s"] > 0
        assert r["probe"]["ok"] == r["probe"]["prompts"] > 0
    assert pairs[("w1", "kvc_memory")]["probe"]["storage_tokens"] > 0
    assert pairs[("w1", "kvc_memory")]["probe"]["mismatches"] == 0
    with gzip.open(out / "requests.jsonl.gz", "rt") as f:
        assert sum(1 for _ in f) == sum(r["summary"]["requests"] for r in pairs.values())
    doc = json.loads((out / "serving.json").read_text())
    names = {r["metric"] for r in doc["ratios"]}
    assert "w1_kvc_memory_ttft_p50_over_baseline" in names
    assert set(doc["figures"]["w1"]) == {"l2_only", "kvc_memory"}
    if (serve / "out" / "serving.png").exists():
        assert (out / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench_log = (out / "bench.log").read_text()
    assert "[serve] w1/kvc_memory: " in bench_log and "it/s]" not in bench_log
    assert re.search(r"\[\d+s\] \[serve\] w1/l2_only: \d+/\d+ ok", p.stdout)   # wait's progress lines
    with tarfile.open(out / "server_logs.tgz") as t:
        assert {"./sglang0.log", "./sglang1.log", "./router.log"} <= set(t.getnames())


@pytest.mark.timeout(180)
def test_run_serving_stop_kills_everything_it_started(tmp_path):
    """``run_serving.sh start``, then ``stop`` while the benchmark is running (servers and router up).
    Mocked: the GPU and SGLang's server (serving_engine). Real: the script, the benchmark, its servers and
    sglang_router. ``stop`` lets the benchmark stop them for STOP_GRACE_S (2 s here), then kills every
    process carrying the run's marker; afterwards none of the processes below the benchmark lives."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    env, gtmp, out = _serve_env(tmp_path, "b", "w1:l2_only,w1:kvc_memory,w2:l2_only", STOP_GRACE_S="2")
    p = run(["bash", str(GPU / "run_serving.sh"), "start"], env, cwd, 60)
    assert "serving benchmark started" in p.stdout, p.stdout + p.stderr
    bench = int((gtmp / "serve" / "pid").read_text())
    seen: dict[int, str] = {}

    def running():
        seen.update(descendants(bench))
        return alive(bench) and any("sglang_router" in c for c in seen.values()) and sum(
            "serving_engine" in c for c in seen.values()) >= 2
    try:
        assert wait_for(running, 150, 0.5), (gtmp / "serve" / "bench.log").read_text()[-3000:]
        seen.update(descendants(bench))
        p = run(["bash", str(GPU / "run_serving.sh"), "stop"], env, cwd, 60)
        log = p.stdout + p.stderr
        assert "=== stop" in log and "FAILED" not in log, log
        left = {pid: c for pid, c in seen.items() if alive(pid)}
        assert not alive(bench) and not left, left
    finally:
        for pid in [bench, *seen]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (out / "bench.log").read_text().count("[serve] launching 2 SGLang servers") == 1


def test_run_vllm_installs_and_runs_the_bench_with_the_venv_python(tmp_path):
    """``run_vllm.sh`` with ``VLLM_VENV`` pointing at a stand-in venv whose ``pip`` and ``python`` record
    their arguments (no network, no vLLM). Mocked: pip, vLLM's interpreter. Real: the script, and the
    ``kvconnect bench vllm`` command line it builds, checked against the real CLI's options and the systems
    benchmarks/vllm.py knows. Without VLLM_SPEC it stops before installing anything."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    for tool in ("pip", "python"):
        (venv / "bin" / tool).write_text(
            f'#!/bin/sh\necho "{tool} $* | VLLM_PY=$KVCONNECT_VLLM_PYTHON" >> "{calls}"\n')
        (venv / "bin" / tool).chmod(0o755)
    env = script_env(tmp_path, VLLM_VENV=str(venv), VLLM_GPU_OUT=str(tmp_path / "vllm_gpu.json"))
    env.pop("VLLM_SPEC", None)
    p = run(["bash", str(GPU / "run_vllm.sh")], env, tmp_path, 60)
    assert p.returncode != 0 and "set VLLM_SPEC" in p.stderr and not calls.exists()

    p = run(["bash", str(GPU / "run_vllm.sh")], {**env, "VLLM_SPEC": "vllm==9.9.9"}, tmp_path, 60)
    assert p.returncode == 0, p.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("pip install vllm==9.9.9 ") and "mooncake-transfer-engine-non-cuda==0.3.13.post1" in lines[0]
    assert lines[1].startswith("pip install --no-deps lmcache==0.5.6 ")
    assert lines[2].startswith(f"pip install --no-deps -e {ROOT} ")
    bench, _, vllm_py = lines[3].partition(" | VLLM_PY=")
    assert vllm_py == str(venv / "bin" / "python")
    argv = bench.split()
    assert argv[:5] == ["python", "-m", "kvconnect.connectors.cli", "bench", "vllm"]
    opts = dict(zip(argv[5::2], argv[6::2]))
    assert opts["--out"] == str(tmp_path / "vllm_gpu.json") and opts["--prompts"] == "32"
    helptext = subprocess.run([sys.executable, "-m", "kvconnect.connectors.cli", "bench", "vllm", "--help"],
                              capture_output=True, text=True, timeout=60).stdout
    assert all(o in helptext for o in opts)
    tree = ast.parse((ROOT / "benchmarks" / "vllm.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_system")
    known = {c.comparators[0].value for c in ast.walk(fn) if isinstance(c, ast.Compare)
             and isinstance(c.left, ast.Name) and c.left.id == "name" and isinstance(c.comparators[0], ast.Constant)}
    systems = opts["--systems"].split(",")
    assert len(systems) == 7 and set(systems) <= known, set(systems) - known
