"""connectors/rpc.py: what a control plane says about its token at start, and the connection
bounds every gRPC listener gets (the floods themselves: the hf3fs and peer control-plane tests)."""

from __future__ import annotations

import logging
import resource

from kvconnect.connectors import rpc


def test_loopback_without_a_token_is_said_at_info_and_beyond_loopback_is_a_warning(caplog):
    log = logging.getLogger("kvconnect.test.rpc")
    with caplog.at_level(logging.INFO, logger="kvconnect.test.rpc"):
        assert rpc.warn_if_open("svc", "127.0.0.1", None, log) is False
        assert rpc.warn_if_open("svc", "127.0.0.1", "tok", log) is False
        assert rpc.warn_if_open("svc", "0.0.0.0", None, log) is True
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(levels) == 2, levels
    assert levels[0][0] == logging.INFO and "every user of this host" in levels[0][1] and "127.0.0.1" in levels[0][1]
    assert levels[1][0] == logging.WARNING and "NO auth token" in levels[1][1]


def test_connection_limit_keeps_a_reserve_below_the_open_file_limit(monkeypatch):
    for soft, want in ((1024, 704), (4096, 3072), (200, 16), (65536, 49152)):
        monkeypatch.setattr(resource, "getrlimit", lambda _r, s=soft: (s, s))
        assert rpc.connection_limit() == want
        opts = dict(rpc.server_options())
        assert opts["grpc.max_allowed_incoming_connections"] == want
        assert opts["grpc.server_handshake_timeout_ms"] == rpc.HANDSHAKE_TIMEOUT_MS
    monkeypatch.setattr(resource, "getrlimit", lambda _r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert rpc.connection_limit() is None
    assert "grpc.max_allowed_incoming_connections" not in dict(rpc.server_options())


def test_a_service_raises_its_soft_open_file_limit_to_the_hard_limit():
    """What ``hf3fs-meta serve`` does at start (a flood at a 1,024 soft limit then finds the
    hard limit's descriptors; the flood at a hard limit of 1,024 is the control-plane test's)."""
    import subprocess
    import sys

    import pytest

    from kvconnect.connectors.testing.processes import child_env

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise to")
    code = ("import resource; from kvconnect.connectors import rpc; n = rpc.raise_nofile_limit(); "
            "print(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], env=child_env({}), capture_output=True, text=True,
                         timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
    assert out.returncode == 0, out.stderr
    raised, now = map(int, out.stdout.split())
    assert raised == now and now == (hard if hard != resource.RLIM_INFINITY else 1 << 20), out.stdout
