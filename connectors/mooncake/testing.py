"""A real ``mooncake_master`` inside a loopback-only network namespace (tests, benchmark, demo).

Some Mooncake listeners bind every interface whatever address they are given (the
embedded HTTP metadata server, the Transfer Engine's handshake and data sockets), so
every Mooncake process of a test runs inside a network namespace that has nothing but
``lo``. Needs root (``ip netns``) and ``iproute2``.

* ``LoopbackNetns``: ``ip netns add kvc-mc-<random>`` + ``lo`` up; ``exec_prefix()`` runs a
  program inside it; ``run(fn)`` runs ``fn`` on a short-lived thread moved into it with
  ``setns(2)`` (Python 3.11 has no ``os.setns``: libc's, through ctypes); ``delete()``.
* ``MasterProcess``: the ``mooncake_master`` ELF shipped in the wheel, listening on
  127.0.0.1 only; ``kill()`` / ``start()`` again for failure tests.
* ``MooncakeCluster``: namespace + master (+ segment holders), removed by ``close()``.
  Mooncake keeps process-wide I/O threads in the namespace where they started, so Mooncake
  *clients* run in processes started inside the namespace (``exec_prefix()``), never in a
  process that moves between namespaces.
* ``python -m kvconnect.connectors.mooncake.testing holder --master H:P --segment 1gb``: a process
  that only contributes a memory segment, until stdin closes or it is terminated.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def netns_supported() -> tuple[bool, str]:
    """(usable, why not): root, ``ip`` present, and a test namespace can be created."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if not shutil.which("ip"):
        return False, "iproute2 ('ip') is not installed"
    return True, ""


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class LoopbackNetns:
    """A network namespace with only ``lo`` (up), removed by ``delete()``."""

    def __init__(self, prefix: str = "kvc-mc"):
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        self._saved: list[int] = []
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, timeout=10)
        try:
            subprocess.run(self.exec_prefix() + ["ip", "link", "set", "lo", "up"], check=True,
                           capture_output=True, timeout=10)
        except BaseException:
            self.delete()
            raise

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.name}"

    def enter(self) -> None:
        """Move the calling thread into the namespace (nestable with ``leave``)."""
        saved = os.open(f"/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(self.path, os.O_RDONLY)
        try:
            _setns(target)
        except BaseException:
            os.close(saved)
            raise
        finally:
            os.close(target)
        self._saved.append(saved)

    def leave(self) -> None:
        saved = self._saved.pop()
        try:
            _setns(saved)
        finally:
            os.close(saved)

    def run(self, fn: Callable[..., T], *args: Any, timeout: float = 30) -> T:
        """``fn(*args)`` on a fresh thread inside the namespace; returns its result."""
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                self.enter()
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{fn!r} did not finish within {timeout}s in netns {self.name}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def delete(self) -> None:
        from kvconnect.connectors.peer_rdma.netns import delete_namespace  # one teardown for every test namespace

        delete_namespace(self.name)

    def __enter__(self) -> "LoopbackNetns":
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


def master_binary() -> str:
    """The ``mooncake_master`` ELF inside the installed ``mooncake`` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'mooncake' package is not installed (pip install \"kvconnect[mooncake]\")")
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the mooncake wheel")
    return str(path)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MasterProcess:
    """A real ``mooncake_master`` on 127.0.0.1 inside ``netns`` (or the current namespace)."""

    def __init__(self, netns: LoopbackNetns | None, *, rpc_port: int = 50051, metrics_port: int = 9003,
                 lease_ttl_ms: int = 10000, log_path: str | os.PathLike | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.netns = netns
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.args = [master_binary(), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
                     "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}",
                     f"--default_kv_lease_ttl={lease_ttl_ms}", *extra_args]
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self, timeout: float = 20) -> "MasterProcess":
        prefix = self.netns.exec_prefix() if self.netns else []
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(prefix + self.args, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        probe = (lambda: self.netns.run(_port_open, self.rpc_port)) if self.netns else (
            lambda: _port_open(self.rpc_port))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} "
                                   f"(log: {self.log_path})")
            if probe():
                return self
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"mooncake_master did not listen on {self.address} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL (the crash case) and reap."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)


class MooncakeCluster:
    """A master (+ optional segment holders) in a loopback-only namespace; ``close()``
    removes everything.

    ``netns=None`` creates a namespace ``kvc-mc-<random>`` and starts the master in it
    (through ``ip netns exec``); pass ``inside_current=True`` instead when the calling
    process already runs in a loopback-only namespace made for it (the inner side of a
    test that re-ran itself under ``ip netns exec``).

    Mooncake keeps process-wide I/O threads that open their sockets in the namespace they
    were created in, so one process uses Mooncake in one namespace for its whole life:
    clients live in processes started inside the namespace, never in a process that
    moves between namespaces.
    """

    def __init__(self, *, lease_ttl_ms: int = 500, log_dir: str | os.PathLike | None = None,
                 inside_current: bool = False):
        self.netns = None if inside_current else LoopbackNetns()
        self.holders: list[subprocess.Popen] = []
        try:
            log = Path(log_dir) / "mooncake_master.log" if log_dir else None
            self.master = MasterProcess(self.netns, lease_ttl_ms=lease_ttl_ms, log_path=log).start()
        except BaseException:
            self.close()
            raise

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the cluster's namespace."""
        return self.netns.exec_prefix() if self.netns else []

    def start_holder(self, segment: str = "256mb", timeout: float = 30,
                     master: MasterProcess | None = None) -> subprocess.Popen:
        """A process that contributes ``segment`` bytes of memory to the store (of ``master``,
        default the cluster's)."""
        cmd = self.exec_prefix() + [sys.executable, "-m", "kvconnect.connectors.mooncake.testing", "holder",
                                    "--master", (master or self.master).address, "--segment", segment]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                                         + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=env, start_new_session=True)
        self.holders.append(p)
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if line.startswith(b"READY") or not line:
                break
        if not line.startswith(b"READY"):
            raise RuntimeError(f"segment holder did not start: {line!r}")
        return p

    def start_store_process(self, segment: str = "256mb", *, shared_segment_dir: str | None = None,
                            master: MasterProcess | None = None, timeout: float = 60) -> subprocess.Popen:
        """A ``kvconnect mooncake-store`` process lending ``segment`` bytes (from shared memory
        in ``shared_segment_dir``, published there, if given), stopped by ``close()``."""
        cmd = self.exec_prefix() + [
            sys.executable, "-m", "kvconnect.connectors.cli", "mooncake-store", "--master", (master or self.master).address,
            "--segment", segment, "-o", "protocol=tcp", "-o", "local_hostname=127.0.0.1",
            "-o", "metadata_server=P2PHANDSHAKE", "-o", "local_buffer_size=16mb", "-o", "staging_size=16mb"]
        if shared_segment_dir:
            cmd += ["-o", "shared_segment=true", "-o", f"shared_segment_dir={shared_segment_dir}"]
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env, start_new_session=True)
        self.holders.append(p)
        ready = "kvconnect mooncake-store: contributing"
        lines: list[str] = []

        def read() -> None:
            for line in p.stdout:  # type: ignore[union-attr]
                lines.append(line)
                if line.startswith(ready):
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not any(x.startswith(ready) for x in lines):
            p.kill()
            raise RuntimeError(f"kvconnect mooncake-store did not start: {lines[-5:]}")
        if shared_segment_dir:  # published right after setup
            deadline = time.monotonic() + 10
            while not any(Path(shared_segment_dir).glob("*.json")) and time.monotonic() < deadline:
                time.sleep(0.05)
        return p

    def close(self) -> None:
        for p in self.holders:
            try:
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
            except Exception:  # noqa: BLE001
                p.kill()
        self.holders.clear()
        if getattr(self, "master", None):
            self.master.kill()
        if self.netns:
            self.netns.delete()


def _holder_main(argv: list[str]) -> int:
    import argparse

    from kvconnect.connectors.config import parse_size

    p = argparse.ArgumentParser(prog="python -m kvconnect.connectors.mooncake.testing holder")
    p.add_argument("--master", required=True)
    p.add_argument("--segment", default="1gb")
    p.add_argument("--metadata", default="P2PHANDSHAKE")
    args = p.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", args.metadata, parse_size(args.segment), 16 << 20, "tcp", "", args.master)
    if rc != 0:
        print(f"FAILED setup rc={rc}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: (s.close(), os._exit(0)))
    print("READY", flush=True)
    sys.stdin.read()  # until the parent closes stdin or terminates us
    s.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "holder":
        sys.exit(_holder_main(sys.argv[2:]))
    print(__doc__)
