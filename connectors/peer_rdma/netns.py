"""Network namespaces for running several pool nodes on one machine (tests, examples, benchmark).

Mooncake's Transfer Engine listens on every interface whatever it is told, so processes
that run pool nodes here run inside namespaces made for them: ``loopback_ns`` (only
``lo``) or ``Bridge`` (namespaces joined by veth pairs on a bridge that lives in a
namespace of its own; addresses 10.77.<net>.<i> exist only inside them). Needs root and
iproute2; everything is removed on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager


def netns_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 'ip' is not installed"
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
        delete_namespace(name)


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
            delete_namespace(ns)

    def __exit__(self, *exc) -> None:
        self.close()


