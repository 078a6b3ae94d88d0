"""The processes of a serving run: SGLang servers, ``sglang_router`` and the stores' services.

Every process runs in its own session (``kill -- -PID`` stops its whole tree), logs to
``<workdir>/logs/<name>.log`` and listens on 127.0.0.1. SGLang servers are launched once per
server profile and switch L3 backends at run time through SGLang's admin API
(``PUT/DELETE /hicache/storage-backend``), which needs ``--admin-api-key``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

# kvconnect's command line as a module, so the run needs no console script on PATH.
KVCONNECT_CLI = [sys.executable, "-m", "kvconnect.connectors.cli"]


class Process:
    """A child process in its own session, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: Optional[dict] = None):
        self.name, self.argv = name, [str(a) for a in argv]
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = env or {}
        self.popen: Optional[subprocess.Popen] = None

    def start(self) -> "Process":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **self.env}, start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            end = time.time() + wait
            while time.time() < end:
                self.popen.poll()   # reap the leader: a zombie still counts as a member of its group
                try:
                    os.killpg(self.popen.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.popen = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Optional[dict] = None, headers: Optional[dict] = None,
         timeout: float = 30.0) -> tuple[int, str]:
    """One HTTP call; (status, body text). Connection failures are status 0."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


def wait_until(check, timeout_s: float, what: str, proc: Optional[Process] = None, every_s: float = 0.5) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if check():
            return
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{what}: process {proc.name} exited; log tail:\n{proc.tail()}")
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s" + (f"; log tail:\n{proc.tail()}" if proc else ""))


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


# What SGLang 0.5.17-0.5.23 answers (HTTP 400) to an attach or detach while its scheduler is not fully idle.
BUSY_REFUSAL = "scheduler is not idle"


class SGLangServer:
    """One ``sglang.launch_server`` with an admin key, so its L3 backend can be switched."""

    def __init__(self, index: int, port: int, model_dir: Path, args: Sequence[str], log_dir: Path,
                 env: Optional[dict] = None, admin_key: Optional[str] = None,
                 module: str = "sglang.launch_server"):
        self.index, self.port = index, port
        self.admin_key = admin_key or secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", module, "--model-path", str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), "--admin-api-key", self.admin_key, *args]
        self.proc = Process(f"sglang{index}", argv, log_dir, env)

    def start(self) -> "SGLangServer":
        self.proc.start()
        return self

    def wait_ready(self, timeout_s: float) -> None:
        wait_until(lambda: http("GET", f"{self.url}/health", timeout=5)[0] == 200, timeout_s,
                   f"SGLang server {self.index}", self.proc, every_s=1.0)

    def admin(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 120.0) -> tuple[int, str]:
        return http(method, f"{self.url}{path}", body, {"Authorization": f"Bearer {self.admin_key}"}, timeout)

    def flush(self, timeout_s: float = 60.0) -> int:
        """Empty the GPU radix tree and the host pool (L2); L3 is untouched. Retried while busy (the
        only reason SGLang gives for a failed flush is pending requests)."""
        return self.admin_until_accepted("flush", "POST", "/flush_cache", None, timeout_s, retry_on=("",))

    def admin_until_accepted(self, what: str, method: str, path: str, body: Optional[dict] = None,
                             timeout_s: float = 120.0, retry_on: tuple = (BUSY_REFUSAL,)) -> int:
        """An admin call SGLang may refuse while busy, retried until it is accepted; returns the refusals.

        SGLang rejects an attach or detach until ``Scheduler.is_fully_idle()`` holds, which lags the last
        response by a scheduler loop or more: "Reject detach: scheduler is not idle. #queue-req=0
        #running-req=0" can come with nothing queued or running. Only that refusal (and a connection
        that failed while the server lives) is retried; any other answer is the engine's verdict and
        raised at once with its own message, as is the last refusal after ``timeout_s``.
        """
        t0, refusals = time.time(), 0
        while True:
            status, text = self.admin(method, path, body, timeout=300)
            if status == 200:
                return refusals
            busy = (status == 400 and any(m in text for m in retry_on)) or (status == 0 and self.proc.alive())
            if not busy or time.time() - t0 >= timeout_s or not self.proc.alive():
                waited = f" after {refusals + 1} tries in {time.time() - t0:.1f} s" if refusals else ""
                raise RuntimeError(f"{what} on server {self.index}: HTTP {status}{waited}: {text.strip()[:500]}")
            refusals += 1
            time.sleep(min(0.1 * 2 ** min(refusals, 4), 1.0))

    def attach(self, backend: str, extra: dict, write_policy: str = "write_through",
               prefetch_policy: Optional[str] = None, timeout_s: float = 120.0) -> int:
        body = {"hicache_storage_backend": backend, "hicache_storage_backend_extra_config_json": json.dumps(extra),
                "hicache_write_policy": write_policy}
        if prefetch_policy:
            body["hicache_storage_prefetch_policy"] = prefetch_policy
        return self.admin_until_accepted(f"attach {backend}", "PUT", "/hicache/storage-backend", body, timeout_s)

    def detach(self, timeout_s: float = 120.0) -> int:
        return self.admin_until_accepted("detach", "DELETE", "/hicache/storage-backend", None, timeout_s)

    def stop(self) -> None:
        self.proc.stop()


class Router:
    """``python -m sglang_router.launch_router`` in front of the servers; with ``pd`` = (prefill URL,
    its bootstrap port, decode URL), ``--pd-disaggregation --prefill URL PORT --decode URL``."""

    def __init__(self, port: int, worker_urls: Sequence[str], policy: str, log_dir: Path,
                 pd: Optional[tuple] = None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        workers = ["--pd-disaggregation", "--prefill", pd[0], str(pd[1]), "--decode", pd[2]] if pd else \
            ["--worker-urls", *worker_urls]
        self.proc = Process("router", [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                       "--port", str(port), "--policy", policy, "--log-level", "warn", *workers],
                            log_dir)

    def start(self, timeout_s: float = 120.0) -> "Router":
        self.proc.start()
        wait_until(lambda: http("GET", f"{self.url}/health", timeout=5)[0] == 200, timeout_s, "router", self.proc)
        return self

    def stop(self) -> None:
        self.proc.stop()


def bootstrap_ready(port: int) -> bool:
    """A prefill server's bootstrap server knows every rank (what decode asks before its first
    request: ``/route`` with all ranks -1 answers 200, not 503)."""
    return http("GET", f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                       "&target_pp_rank=-1", timeout=5)[0] == 200


class DelayProxy:
    """``benchmarks.serving.delay_proxy`` between the router and a decode server: every ``/generate``
    reaches decode ``delay_s`` late (the decode-arrives-late case), the rest passes through."""

    def __init__(self, port: int, target: str, delay_s: float, log_dir: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.proc = Process("decode_proxy", [sys.executable, "-m", "kvconnect.benchmarks.serving.delay_proxy",
                                             "--port", str(port), "--target", target, "--delay-s", str(delay_s)],
                            log_dir)

    def start(self, timeout_s: float = 60.0) -> "DelayProxy":
        self.proc.start()
        wait_until(lambda: port_open(self.port), timeout_s, "decode proxy", self.proc, every_s=0.2)
        return self

    def stop(self) -> None:
        self.proc.stop(grace_s=5)


def lmcache_healthy(http_port: int) -> bool:
    """An ``lmcache server``'s HTTP API says ``is_healthy`` (its L1 and L2 adapters are up)."""
    status, text = http("GET", f"http://127.0.0.1:{http_port}/status", timeout=3)
    try:
        return status == 200 and bool(json.loads(text).get("is_healthy"))
    except ValueError:
        return False


def mooncake_master_binary() -> str:
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec and spec.submodule_search_locations:
            cand = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine (it ships the binary)")


class Services:
    """The stores' side processes, started by name and stopped together."""

    def __init__(self, workdir: Path, ports: dict, mooncake_segment: int = 32 << 30, lmcache_l1_gb: float = 8.0,
                 l3_file_bytes: int = 32 << 30):
        self.workdir, self.ports = Path(workdir), ports
        self.mooncake_segment = mooncake_segment  # bytes the standalone Mooncake store process lends
        self.lmcache_l1_gb = lmcache_l1_gb        # the lmcache server's L1
        self.l3_file_bytes = l3_file_bytes        # kvconnect's hf3fs file behind the lmcache server
        self.log_dir = self.workdir / "logs"
        self.running: dict[str, Process] = {}

    def data(self, name: str) -> Path:
        p = self.workdir / "data" / name
        p.mkdir(parents=True, exist_ok=True)
        return p

    def _start(self, name: str, argv: Sequence[str], ready, timeout_s: float = 60.0, env: Optional[dict] = None):
        proc = Process(name, argv, self.log_dir, env).start()
        self.running[name] = proc
        wait_until(ready, timeout_s, name, proc)

    def start(self, name: str) -> None:
        if name in self.running:
            return
        p = self.ports
        if name == "kvc_meta":
            self._start(name, [*KVCONNECT_CLI, "hf3fs-meta", "serve", "--host", "127.0.0.1", "--port", p["kvc_meta"],
                               "--data-dir", self.data("kvc_meta")], lambda: port_open(p["kvc_meta"]))
        elif name == "mini_3fs_meta":
            self._start(name, [sys.executable, "-m", "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
                               "--host", "127.0.0.1", "--port", p["mini_3fs_meta"]],
                        lambda: port_open(p["mini_3fs_meta"]))
        elif name == "mooncake_master":
            self._start(name, [mooncake_master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={p['mooncake_master']}",
                               "--metrics_host=127.0.0.1", f"--metrics_port={p['mooncake_metrics']}"],
                        lambda: port_open(p["mooncake_master"]))
        elif name in ("mooncake_store", "mooncake_store_shm"):
            self.start("mooncake_master")
            shared = "true" if name == "mooncake_store_shm" else "false"
            self._start(name, [*KVCONNECT_CLI, "mooncake-store", "--master", f"127.0.0.1:{p['mooncake_master']}",
                               "--segment", str(self.mooncake_segment), "-o", "protocol=tcp", "-o", "local_hostname=127.0.0.1",
                               "-o", f"shared_segment={shared}",
                               "--metrics-port", p["mooncake_store_metrics"]],
                        lambda: port_open(p["mooncake_store_metrics"]), timeout_s=180)
        elif name == "peer_seed":
            ready = self.data("peer_seed") / "ready"
            ready.unlink(missing_ok=True)
            self._start(name, [*KVCONNECT_CLI, "peer", "serve", "--discovery-addr", f"127.0.0.1:{p['peer_seed']}",
                               "--bind-host", "127.0.0.1", "--local-hostname", "127.0.0.1", "--protocol", "tcp",
                               "--global-segment-size", "1gb", "--ready-file", ready],
                        lambda: ready.exists() and ready.stat().st_size > 0)
        elif name in ("lmcache_kvc_hf3fs", "lmcache_fs"):
            self._start(name, [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
                               "--port", p["lmcache_mp"], "--chunk-size", "256", "--l1-size-gb", self.lmcache_l1_gb,
                               "--eviction-policy", "LRU", "--http-host", "127.0.0.1", "--http-port", p["lmcache_http"],
                               "--disable-metrics", "--l2-adapter", self.lmcache_l2(name)],
                        lambda: lmcache_healthy(p["lmcache_http"]), timeout_s=180,
                        env={"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"})
        else:
            raise ValueError(f"unknown service {name!r}")

    def lmcache_l2(self, name: str) -> str:
        """The ``--l2-adapter`` JSON of the lmcache server ``name``: kvconnect's plugin over the hf3fs
        store (files shared through the metadata service, which the configuration also starts), or
        LMCache's own ``fs``."""
        from kvconnect.connectors.testing.lmcache import plugin_json

        if name == "lmcache_fs":
            return json.dumps({"type": "fs", "base_path": str(self.data("lmcache_fs"))})
        self.start("kvc_meta")
        return plugin_json({"store": "hf3fs", "file_path_prefix": str(self.data("lmcache_kvc") / "lmcache"),
                            "file_size": self.l3_file_bytes, "numjobs": 16, "entries": 16,
                            "metadata_server_url": f"http://127.0.0.1:{self.ports['kvc_meta']}",
                            "metrics_port": self.ports["lmcache_kvc_metrics"]})

    def stop_all(self) -> None:
        for name in reversed(list(self.running)):
            self.running.pop(name).stop(grace_s=10)
        shutil.rmtree(self.workdir / "data", ignore_errors=True)
