"""Node processes in network namespaces for the peer pool's tests.

Mooncake's Transfer Engine listens on every interface whatever it is told, so every
process that runs a pool node runs inside a network namespace the test created
(``kvconnect.connectors.peer_rdma.netns``). Everything is removed on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvconnect.connectors.peer_rdma.netns import Bridge, loopback_ns, netns_available  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def skip_reason(*modules: str) -> str | None:
    """Why a peer-pool test cannot run here (a module missing, no network namespaces), or None."""
    import importlib.util

    for mod in modules:
        if importlib.util.find_spec(mod) is None:
            return f"needs {mod} (installed by scripts/install.sh)"
    return netns_available()


def exec_in(ns: str, argv: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1",
               GLOG_minloglevel="2", MC_LOG_LEVEL="ERROR")
    env.update(kw.pop("env", {}))
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=str(ROOT), env=env, **kw)


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM (a clean leave), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Worker:
    """A pool node in a namespace, driven by JSON lines over its stdin/stdout
    (``tests/integration/peer_rdma_worker.py``)."""

    def __init__(self, ns: str, options: dict, host_pool: dict | None = None, name: str = "w",
                 log_dir: Path | None = None):
        self.ns, self.name = ns, name
        self.log = open((log_dir or Path("/tmp")) / f"{name}-{os.getpid()}.log", "w")
        spec = json.dumps({"options": options, "host_pool": host_pool, "name": name})
        self.proc = exec_in(ns, [PY, "-u", str(ROOT / "tests" / "integration" / "peer_rdma_worker.py"), spec],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        ready = self._recv(300)
        self.node_id = ready["node_id"]

    def _recv(self, timeout: float) -> dict:
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    return json.loads(line)
        raise RuntimeError(f"worker {self.name} did not answer (rc={self.proc.poll()}); log: {self.log.name}")

    def call(self, op: str, timeout: float = 120, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        rep = self._recv(timeout)
        if "error" in rep:
            raise RuntimeError(f"worker {self.name} {op}: {rep['error']}")
        return rep

    def kill9(self) -> None:
        # the worker runs under `ip netns exec`, which execs: the pid is the python process
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        stop(self.proc)
        self.log.close()


def wait_for(predicate, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return value
        time.sleep(interval)
