"""A real ``mooncake_master`` inside a loopback-only network namespace, for tests and benchmarks.

* ``MasterProcess``: the ``mooncake_master`` ELF shipped in the Mooncake wheel, listening
  on 127.0.0.1 only; ``kill()`` / ``start()`` again for failure tests.
* ``MooncakeCluster``: namespace + master (+ segment holders, + ``kvconnect mooncake-store``
  processes), removed by ``close()``. Mooncake keeps process-wide I/O threads in the
  namespace where they started, so Mooncake *clients* run in processes started inside the
  namespace (``exec_prefix()``), never in a process that moves between namespaces.
* pytest: a module that talks to Mooncake runs in its own pytest process inside a
  namespace made for it. ``outer_test(__file__)`` is the module's one test in the normal
  run: it makes the namespace and re-runs the module there with ``KVCONNECT_MOONCAKE_NS``
  set (``INNER`` is then true, and the ``mooncake_cluster`` fixture starts a master in that
  namespace with 500 ms leases).
* ``python -m kvconnect.connectors.testing.mooncake holder --master H:P --segment 1gb``:
  a process that only contributes a memory segment, until stdin closes or it is terminated.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kvconnect.connectors.buffers import HostBuffer
from kvconnect.connectors.testing.conformance import PAGE, page_bytes
from kvconnect.connectors.testing.netns import Netns, netns_available
from kvconnect.connectors.testing.netns import outer_test as netns_outer_test
from kvconnect.connectors.testing.processes import child_env
from kvconnect.connectors.transfer_engine import mooncake_timeouts

NS_ENV = "KVCONNECT_MOONCAKE_NS"
INNER = bool(os.environ.get(NS_ENV))
LEASE_TTL_MS = 500


def master_binary() -> str:
    """The ``mooncake_master`` ELF inside the installed ``mooncake`` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'mooncake' package is not installed (pip install \"kvconnect[mooncake]\")")
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the mooncake wheel")
    return str(path)


def mooncake_skip_reason() -> str | None:
    """Why Mooncake tests cannot run here (the wheel missing, no namespaces), or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine is not installed (pip install \"kvconnect[mooncake]\")"
    why = netns_available()
    if why:
        return why
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        return f"mooncake.store does not import (install libibverbs1): {probe.stderr.strip()[-300:]}"
    return None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class MasterProcess:
    """A real ``mooncake_master`` on 127.0.0.1 inside ``netns`` (or the current namespace)."""

    def __init__(self, netns: Netns | None, *, rpc_port: int = 50051, metrics_port: int = 9003,
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

    ``inside_current=True``: the calling process already runs in a loopback-only namespace
    made for it (the inner side of ``outer_test``); otherwise a namespace is made here and
    the master started in it.
    """

    def __init__(self, *, lease_ttl_ms: int = 500, log_dir: str | os.PathLike | None = None,
                 inside_current: bool = False, netns: Netns | None = None):
        """``netns``: run in this namespace (the caller's, left in place by ``close()``)."""
        self._own_netns = netns is None and not inside_current
        self.netns = netns if netns is not None else (None if inside_current else Netns("kvc-mc"))
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
        cmd = self.exec_prefix() + [sys.executable, "-m", "kvconnect.connectors.testing.mooncake", "holder",
                                    "--master", (master or self.master).address, "--segment", segment]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=child_env(), start_new_session=True)
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
            sys.executable, "-m", "kvconnect", "mooncake-store", "--master", (master or self.master).address,
            "--segment", segment, "-o", "protocol=tcp", "-o", "local_hostname=127.0.0.1",
            "-o", "metadata_server=P2PHANDSHAKE", "-o", "local_buffer_size=16mb", "-o", "staging_size=16mb"]
        if shared_segment_dir:
            cmd += ["-o", "shared_segment=true", "-o", f"shared_segment_dir={shared_segment_dir}"]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=child_env(), start_new_session=True)
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
        if self.netns and self._own_netns:
            self.netns.delete()


@contextmanager
def cluster_for_test(log_dir: str | os.PathLike, *, holder: str | None = None,
                     **over: Any) -> Iterator[tuple[MooncakeCluster, dict]]:
    """A cluster in a namespace of its own for one test or module, and the options of a
    store on it (``store_options(cluster, **over)``); ``holder``: a segment holder of that
    size too. Skips the test where Mooncake cannot run here."""
    import pytest

    why = mooncake_skip_reason()
    if why:
        pytest.skip(why)
    cluster = MooncakeCluster(lease_ttl_ms=LEASE_TTL_MS, log_dir=log_dir)
    try:
        if holder:
            cluster.start_holder(holder)
        yield cluster, store_options(cluster, **over)
    finally:
        cluster.close()


def store_options(cluster: MooncakeCluster, **over) -> dict:
    """Options of a ``mooncake`` store that contributes a small segment of its own (its
    ``master_metrics``: the cluster master's metrics port)."""
    opts = {
        "master_server_address": cluster.master.address,
        "master_metrics": f"127.0.0.1:{cluster.master.metrics_port}",
        "metadata_server": "P2PHANDSHAKE",
        "local_hostname": "127.0.0.1",
        "protocol": "tcp",
        "global_segment_size": "64mb",
        "local_buffer_size": "16mb",
        "staging_size": "16mb",
        "setup_timeout": 15,
        "op_timeout": 5,
        "lease_wait": 2 * LEASE_TTL_MS / 1000,
        "lease_ttl": LEASE_TTL_MS / 1000,
        "reconnect_interval": 0.5,
    }
    if "master_server_address" in over:  # another master: its metrics port is not known here
        opts["master_metrics"] = ""
    opts.update(over)
    return opts


# ---------------------------------------------------------------------------------
# pytest: run a module inside a loopback-only namespace of its own
# ---------------------------------------------------------------------------------


def outer_test(module_file: str, timeout: float = 280):
    """The test that re-runs ``module_file`` inside a fresh loopback-only namespace
    (``INNER`` is true there)."""
    return netns_outer_test(module_file, NS_ENV, mooncake_skip_reason, prefix="kvc-mc", timeout=timeout)


def _cluster_fixture():
    import pytest

    @pytest.fixture(scope="module")
    def mooncake_cluster(tmp_path_factory):
        """A master in the namespace ``outer_test`` made (inner runs only)."""
        if not INNER:
            pytest.skip("runs only inside its loopback namespace (outer_test)")
        cluster = MooncakeCluster(lease_ttl_ms=LEASE_TTL_MS, log_dir=tmp_path_factory.mktemp("mooncake"),
                                  inside_current=True)
        try:
            yield cluster
        finally:
            cluster.close()

    return mooncake_cluster


def __getattr__(name: str):
    # The fixture needs pytest; made on first use so importing this module does not.
    if name == "mooncake_cluster":
        return _cluster_fixture()
    raise AttributeError(name)


def _holder_main(argv: list[str]) -> int:
    import argparse

    from kvconnect.connectors.config import parse_size

    p = argparse.ArgumentParser(prog="python -m kvconnect.connectors.testing.mooncake holder")
    p.add_argument("--master", required=True)
    p.add_argument("--segment", default="1gb")
    p.add_argument("--metadata", default="P2PHANDSHAKE")
    args = p.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore

    # A plain Mooncake client with Mooncake's own settings (not kvconnect's raised TCP queue
    # limits): with those raised on the lending side too, one get of 8192 segments from it
    # failed as a whole under load (LEASE_EXPIRED), where the holder at Mooncake's defaults
    # serves it (test_one_batch_of_more_segments_than_mooncake_queues_per_peer).
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


# Helpers of the Mooncake store's integration tests (transfers, failure injection, lookups), shared
# by their modules.

def random_keys(n: int, tag: str = "") -> list[str]:
    """``n`` distinct page keys, salted per call so tests never share objects on a master."""
    salt = random.getrandbits(48)
    return [hashlib.sha256(f"{tag}{salt}-{i}".encode()).hexdigest() for i in range(n)]


def filled_buffer(keys: list[str], gen: int = 0) -> HostBuffer:
    """A host buffer of conformance pages, one per key (``page_bytes(key, gen)``)."""
    b = HostBuffer(len(keys), PAGE, 2)
    for i, k in enumerate(keys):
        b.fill(i, page_bytes(k, gen))
    return b


def buffer_pages(b: HostBuffer) -> list:
    return [b.page(i) for i in range(b.num_pages)]



@contextmanager
def restored_mooncake_timeouts() -> Iterator[None]:
    """An inline store sets Mooncake's timeout variables process-wide: the body's changes are
    undone, so later tests start from Mooncake's defaults again (wrap it in an autouse fixture)."""
    names = list(mooncake_timeouts(1.0))
    saved = {n: os.environ.get(n) for n in names}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def kill_under_load(master, load, stop: threading.Event, *, warm: float, after: float, join: float,
                     threads: int = 3) -> float:
    """``load(i)`` on ``threads`` threads; ``master`` killed (-9) ``warm`` s in, ``stop`` set
    ``after`` s later; every thread must end within ``join`` s. The time of the kill."""
    running = [threading.Thread(target=load, args=(i,)) for i in range(threads)]
    for t in running:
        t.start()
    time.sleep(warm)
    master.kill()
    killed = time.monotonic()
    time.sleep(after)
    stop.set()
    for t in running:
        t.join(join)
    assert not any(t.is_alive() for t in running), "a call hung"
    return killed


@contextmanager
def sigstopped(pid: int, timeout: float = 10):
    """``pid`` SIGSTOPped for the ``with`` body, SIGCONT after (also on failure). The body starts
    once every thread is stopped: SIGSTOP is asynchronous, and a thread busy on another
    (virtual) CPU can still answer a request until it takes the signal."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:  # thread ended meanwhile
                    pass
            if states and all(st in "tT" for st in states):
                break
            assert time.monotonic() < deadline, f"process {pid} not stopped after {timeout}s: {states}"
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
