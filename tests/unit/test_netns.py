"""Test namespaces are torn down with whatever still runs in them (a crashed test leaks nothing)."""

from __future__ import annotations

import subprocess
import time

import pytest

from kvconnect.connectors.testing.netns import loopback_ns, netns_available

pytestmark = pytest.mark.skipif(netns_available() is not None, reason=str(netns_available()))


def test_processes_left_in_a_namespace_are_killed_with_it():
    with loopback_ns() as ns:
        # what a segfaulted test leaves behind: a helper started in the namespace, never stopped
        leaked = subprocess.Popen(ns.exec_prefix() + ["sleep", "120"], start_new_session=True)
        deadline = time.monotonic() + 5
        while not subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True, text=True).stdout.split():
            assert time.monotonic() < deadline, "the helper never entered the namespace"
            time.sleep(0.05)
    try:
        assert leaked.wait(5) == -9
    finally:
        if leaked.poll() is None:
            leaked.kill()
    assert ns.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_thread_runs_inside_and_the_namespace_has_only_loopback():
    import socket

    with loopback_ns() as ns:
        names = ns.run(lambda: [n for _, n in socket.if_nameindex()])
        assert names == ["lo"]
