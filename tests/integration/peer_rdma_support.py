"""Network namespaces and node processes for the peer pool's tests.

Mooncake's Transfer Engine listens on every interface whatever it is told, so every
process that runs a pool node runs inside a network namespace the test created:
``loopback_ns`` (only ``lo``) or ``Bridge`` (namespaces joined by veth pairs on a bridge
that lives in a namespace of its own; addresses 10.77.<net>.<i> exist only there).
Everything is removed on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable


def netns_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def _tag() -> str:
    return f"kvp{os.getpid() % 100000}"


@contextmanager
def loopback_ns(name: str | None = None):
    """A namespace with only ``lo`` up; yields its name."""
    name = name or f"{_tag()}lo"
    _ip("netns", "del", name, check=False)
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        _ip("netns", "del", name, check=False)


class Bridge:
    """``n`` namespaces on one bridge: node i has address 10.77.<net>.<i+1>."""

    def __init__(self, n: int, net: int | None = None):
        self.tag = _tag()
        self.net = net if net is not None else 100 + os.getpid() % 150
        self.hub = f"{self.tag}hub"
        self.names = [f"{self.tag}n{i}" for i in range(n)]
        self.addrs = [f"10.77.{self.net}.{i + 1}" for i in range(n)]

    def __enter__(self) -> "Bridge":
        try:
            for ns in [self.hub, *self.names]:
                _ip("netns", "del", ns, check=False)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("link", "add", f"v{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, i: int) -> None:
        """Partition node i from everyone (its cable is pulled: packets vanish, no reset)."""
        _ip("-n", self.hub, "link", "set", f"v{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"v{i}", "up")

    def close(self) -> None:
        for ns in [*self.names, self.hub]:
            _ip("netns", "del", ns, check=False)

    def __exit__(self, *exc) -> None:
        self.close()


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
        ready = self._recv(120)
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
