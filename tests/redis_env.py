"""Pytest fixtures over ``connectors.hf3fs.redis_testing`` (real ``redis-server`` /
``redis-sentinel`` processes on 127.0.0.1, ports chosen free).

* ``redis_server``: one standalone server for a test module (no persistence);
* ``redis_url``: its ``redis://`` URL with a key prefix of its own per test (``metadata_key_prefix``
  is returned beside it), so tests never see each other's namespaces;
* ``redis_ha``: a primary, a replica and three sentinels for a test module (tests that
  share it use key prefixes of their own; failure tests start their own sets), every node
  and sentinel with the password ``HA_PASSWORD``, as docs/hf3fs_ha.md deploys them.

Import the fixtures into a test module (``from tests.redis_env import redis_server  # noqa``);
everything skips where the servers or the client are not installed.
"""

from __future__ import annotations

import os

import pytest

from connectors.hf3fs.redis_testing import Durability, RedisHA, RedisProcess, free_port, redis_skip_reason

SKIP = redis_skip_reason()
HA_PASSWORD = "kvc-" + os.urandom(6).hex()
needs_redis = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if SKIP:
        pytest.skip(SKIP)
    srv = RedisProcess("127.0.0.1", free_port(), tmp_path_factory.mktemp("redis"),
                       Durability("volatile", appendonly=False)).start()
    yield srv
    srv.terminate()


@pytest.fixture
def redis_url(redis_server):
    """(url, key prefix) unique to the test."""
    return f"redis://127.0.0.1:{redis_server.port}", f"kvc-test-{os.urandom(4).hex()}"


@pytest.fixture(scope="module")
def redis_ha(tmp_path_factory):
    if SKIP:
        pytest.skip(SKIP)
    with RedisHA(workdir=tmp_path_factory.mktemp("ha"), password=HA_PASSWORD) as ha:
        yield ha
