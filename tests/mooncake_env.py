"""Running Mooncake tests against a real ``mooncake_master`` in a loopback-only netns.

Mooncake clients open listeners on every interface and keep process-wide I/O threads
bound to the network namespace they started in, so a test module that talks to Mooncake
runs in its own pytest process inside a namespace made for it:

* outer (the normal pytest run): ``outer_test(__file__)`` is the module's one test; it
  creates ``kvc-mc-<random>`` (only ``lo``, up), re-runs the module there with
  ``ip netns exec ... python -m pytest`` and ``KVCONNECT_MOONCAKE_NS`` set, prints the
  inner report and asserts every inner test passed; the namespace is deleted after.
* inner (``INNER`` true): the module's real tests; ``mooncake_cluster`` starts
  ``mooncake_master`` on 127.0.0.1 in that namespace (leases of 500 ms, so a delete in a
  test waits half a second, not 10) and kills it after the module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors.mooncake.testing import LoopbackNetns, MooncakeCluster, netns_supported

ROOT = Path(__file__).resolve().parents[1]
NS_ENV = "KVCONNECT_MOONCAKE_NS"
INNER = bool(os.environ.get(NS_ENV))
LEASE_TTL_MS = 500


def mooncake_skip_reason() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine is not installed (pip install \"kvconnect[mooncake]\")"
    ok, why = netns_supported()
    if not ok:
        return why
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0:
        return f"mooncake.store does not import (install libibverbs1): {probe.stderr.strip()[-300:]}"
    return None


def outer_test(module_file: str, timeout: float = 280):
    """The test that re-runs ``module_file`` inside a fresh loopback-only namespace."""

    def test_in_loopback_namespace(tmp_path):
        reason = mooncake_skip_reason()
        if reason:
            pytest.skip(reason)
        ns = LoopbackNetns()
        try:
            env = dict(os.environ, **{NS_ENV: ns.name, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            cmd = ns.exec_prefix() + [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rA",
                                      "--basetemp", str(tmp_path / "inner"), str(Path(module_file).relative_to(ROOT))]
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
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


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory):
    if not INNER:
        pytest.skip("runs only inside its loopback namespace (see tests/mooncake_env.py)")
    cluster = MooncakeCluster(lease_ttl_ms=LEASE_TTL_MS, log_dir=tmp_path_factory.mktemp("mooncake"),
                              inside_current=True)
    try:
        yield cluster
    finally:
        cluster.close()


def store_options(cluster: MooncakeCluster, **over) -> dict:
    """Options of a store that contributes a small segment of its own."""
    opts = {
        "master_server_address": cluster.master.address,
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
    opts.update(over)
    return opts
