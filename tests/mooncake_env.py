"""Fixtures for tests against a real ``mooncake_master`` in a loopback-only netns.

Import the fixtures into a test module (``from tests.mooncake_env import mooncake_cluster``).
The module-scoped cluster creates ``kvc-mc-<random>``, starts ``mooncake_master`` there
(127.0.0.1, leases of 500 ms so deletes in tests do not wait 10 s), and moves the pytest
thread into the namespace for the module's tests (threads and processes they start
inherit it). Teardown moves the thread back, kills the master and its helpers, and
deletes the namespace.
"""

from __future__ import annotations

import importlib.util

import pytest

from connectors.mooncake.testing import MooncakeCluster, netns_supported

LEASE_TTL_MS = 500


def mooncake_skip_reason() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine is not installed (pip install \"kvconnect[mooncake]\")"
    try:
        import mooncake.store  # noqa: F401 - needs libibverbs.so.1
    except ImportError as e:
        return f"mooncake.store does not import ({e}); install libibverbs1"
    ok, why = netns_supported()
    return None if ok else why


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory):
    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = MooncakeCluster(lease_ttl_ms=LEASE_TTL_MS, log_dir=tmp_path_factory.mktemp("mooncake"))
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
        "reconnect_interval": 0.5,
    }
    opts.update(over)
    return opts
