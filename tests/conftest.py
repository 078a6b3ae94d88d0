import os
import sys
from pathlib import Path

# Tests run against the checkout (also when the package is installed editable).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402

# The shared suites are plain modules imported by the test files: rewrite their asserts too,
# so a failing check shows the values (a flaky store failure must be diagnosable from CI logs).
pytest.register_assert_rewrite("kvconnect.connectors.testing.conformance", "kvconnect.connectors.testing.mooncake")

from kvconnect.connectors.testing.redis_cluster import (  # noqa: E402
    Durability, RedisHA, RedisProcess, free_port, redis_skip_reason)

# Redis fixtures (real redis-server / redis-sentinel on 127.0.0.1; skipped where not installed):
# ``redis_server`` (one per module), ``redis_url`` ((url, key prefix) unique to the test),
# ``redis_ha`` (primary + replica + 3 sentinels, password ``ha.password``, as docs/hf3fs_ha.md).
REDIS_SKIP = redis_skip_reason()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
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
    if REDIS_SKIP:
        pytest.skip(REDIS_SKIP)
    with RedisHA(workdir=tmp_path_factory.mktemp("ha"), password="kvc-" + os.urandom(6).hex()) as ha:
        yield ha


def pytest_configure(config):
    config.addinivalue_line("markers", "namespace_only: a store-harness test that runs only inside its module's "
                                       "loopback namespace (in_harness_namespace runs it there)")


def pytest_collection_modifyitems(config, items):
    """Outside a harness namespace run, deselect the tests that run only inside it: the
    module's outer test runs them there and fails if any of them fails."""
    from kvconnect.connectors.testing.harness import inside_harness_namespace

    if inside_harness_namespace():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("namespace_only") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
