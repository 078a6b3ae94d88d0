"""Network namespaces: several hosts on one machine, and a fence around Mooncake processes.

Mooncake's Transfer Engine and store client listen on every interface whatever address
they are given, so every process of a test that runs Mooncake code runs inside a
namespace made for it: ``Netns`` (only ``lo``, up) or ``Bridge`` (namespaces joined by
veth pairs on a bridge that lives in a namespace of its own; addresses ``10.77.<net>.<i>``
exist only inside them). Needs root and iproute2; ``delete()`` / ``close()`` kill what
still runs inside and remove the namespaces.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def netns_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def delete_namespace(name: str) -> None:
    """Kill whatever still runs in namespace ``name``, then delete it. A test process that
    crashed (a segfault skips its fixtures' teardown) leaves its helper processes in the
    namespace; deleting only the name would leave them running, invisible."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), 9)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    _ip("netns", "del", name, check=False)


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # Python 3.11 has no os.setns
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class Netns:
    """A network namespace with only ``lo`` (up); ``delete()`` removes it and its processes."""

    def __init__(self, prefix: str = "kvc"):
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        self._saved: list[int] = []
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.name}"

    def enter(self) -> None:
        """Move the calling thread into the namespace (nestable with ``leave``)."""
        saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
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
        delete_namespace(self.name)

    def __enter__(self) -> "Netns":
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def __repr__(self) -> str:
        return f"<Netns {self.name}>"


@contextmanager
def loopback_ns(prefix: str = "kvc") -> Iterator[Netns]:
    """A ``Netns`` for the duration of a ``with`` block."""
    ns = Netns(prefix)
    try:
        yield ns
    finally:
        ns.delete()


class Bridge:
    """``n`` namespaces on one bridge: node i has address 10.77.<net>.<i+1>."""

    def __init__(self, n: int, net: int | None = None):
        self.tag = f"kvb{secrets.token_hex(3)}"
        self.net = net if net is not None else 100 + os.getpid() % 150
        self.hub = f"{self.tag}hub"
        self.names = [f"{self.tag}n{i}" for i in range(n)]
        self.addrs = [f"10.77.{self.net}.{i + 1}" for i in range(n)]

    def __enter__(self) -> "Bridge":
        try:
            for ns in [self.hub, *self.names]:
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

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        """Partition node i from everyone (its cable is pulled: packets vanish, no reset)."""
        _ip("-n", self.hub, "link", "set", f"v{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"v{i}", "up")

    def close(self) -> None:
        for ns in [*self.names, self.hub]:
            delete_namespace(ns)

    def __exit__(self, *exc) -> None:
        self.close()


def outer_test(module_file: str, env_var: str, skip_reason: Callable[[], str | None], *, prefix: str = "kvc",
               timeout: float = 280):
    """A pytest test that re-runs the test module ``module_file`` inside a fresh loopback-only
    namespace, with ``env_var`` set to the namespace's name (the module's inner tests run
    when it is set), and asserts every inner test passed. Mooncake keeps process-wide I/O
    threads in the namespace it started in, so a module that talks to Mooncake runs in a
    pytest process of its own, started inside the namespace. A marker expression the outer
    run was given (``-m failure_injection``) selects the inner tests too."""
    import pytest

    from kvconnect.connectors.testing.processes import child_env

    def test_in_loopback_namespace(tmp_path, request):
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        markexpr = request.config.getoption("markexpr", "")
        ns = Netns(prefix)
        try:
            cmd = ns.exec_prefix() + [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rA",
                                      "--basetemp", str(tmp_path / "inner"), str(Path(module_file).resolve())]
            if markexpr:
                cmd += ["-m", markexpr]
            proc = subprocess.Popen(cmd, env=child_env({env_var: ns.name}), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                output, _ = proc.communicate()
                pytest.fail(f"inner run timed out after {timeout}s:\n{output[-6000:]}")
        finally:
            ns.delete()
        print(output)
        assert proc.returncode == 0, output[-6000:]
        assert "PASSED" in output

    return test_in_loopback_namespace
