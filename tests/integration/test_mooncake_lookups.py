"""Lookups (``exists``: one ``batch_is_exist`` RPC to the master, no transfer) of a Mooncake
store in ``call_mode="worker"`` run on the caller's thread, with no hand-off to a worker,
where Mooncake's own bounds lie within ``op_timeout``: the store sets ``MC_RPC_TIMEOUT_MS``
and ``MC_RPC_CONNECT_TIMEOUT_MS`` to ``op_timeout`` / 2 (unless the user set them), and from
``op_timeout`` >= 5 s (Mooncake's client gives up on a killed master after ~4.5 s whatever
its RPC timeouts). Below that, lookups stay on a worker, abandoned at ``op_timeout``.

Real ``mooncake_master`` processes in a loopback-only namespace: a stalled master
(``SIGSTOP``) and a killed one (``kill -9``) turn lookups into misses within ``op_timeout`` +
1 s, the store unhealthy, and the next lookups short-circuit."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvconnect.connectors.registry import create_store
from kvconnect.connectors.testing.mooncake import INNER, MasterProcess, outer_test
from kvconnect.connectors.testing.mooncake import mooncake_cluster, store_options  # noqa: F401 - fixture
from kvconnect.connectors.transfer_engine import RPC_TIMEOUTS, mooncake_timeouts
from kvconnect.connectors.testing.mooncake import buffer_pages as _pages, filled_buffer as _filled
from kvconnect.connectors.testing.mooncake import kill_under_load as _kill_under_load, random_keys as _keys
from kvconnect.connectors.testing.mooncake import restored_mooncake_timeouts, sigstopped as _stopped


@pytest.fixture(autouse=True)
def _restore_mooncake_timeouts():
    with restored_mooncake_timeouts():
        yield


class _Threads:
    """The client's ``batch_is_exist``, recording the thread each call ran on."""

    def __init__(self, client):
        self._client, self.idents = client, []

    def batch_is_exist(self, keys):
        self.idents.append(threading.get_ident())
        return self._client.batch_is_exist(keys)

    def __getattr__(self, name):
        return getattr(self._client, name)


def _stored(cluster, log_path, ports: tuple[int, int], op_timeout: float):
    """A master of its own (RPC and metrics ``ports``), a worker-mode store on it whose lookups
    run on the caller's thread, and 8 pages stored: ``(master, store, keys, pages)``."""
    master = MasterProcess(None, rpc_port=ports[0], metrics_port=ports[1], lease_ttl_ms=500,
                           log_path=log_path).start()
    s = create_store("mooncake", store_options(cluster, master_server_address=master.address,
                                               op_timeout=op_timeout, reconnect_interval=0.3, call_mode="worker"))
    try:
        assert s.session.lookups_on_caller
        keys = _keys(8, log_path.stem)
        src = _filled(keys)
        s.register_memory(src.address, len(src.raw))
        assert s.put_from(keys, _pages(src)) == [True] * 8
    except BaseException:
        s.close()
        master.kill()
        raise
    return master, s, keys, src


@pytest.mark.parametrize("op_timeout,on_caller", [(5.0, True), (1.5, False)])
def test_worker_mode_lookups_run_on_the_caller_where_mooncake_bounds_them(mooncake_cluster, op_timeout,  # noqa: F811
                                                                          on_caller):
    """op_timeout 5: the RPC timeouts are set to 2.5 s and lookups run on the calling thread;
    op_timeout 1.5: on a worker (a killed master would hold a caller ~4.5 s). Gets and puts
    run on a worker either way; every answer is the same."""
    progress = os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC")
    s = create_store("mooncake", store_options(mooncake_cluster, op_timeout=op_timeout, call_mode="worker"))
    try:
        assert {n: os.environ[n] for n in RPC_TIMEOUTS} == {n: mooncake_timeouts(op_timeout)[n] for n in RPC_TIMEOUTS}
        assert os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC") == progress  # transfer timeouts untouched
        assert s.session.lookups_on_caller is on_caller and s.stats().extra["lookups_on_caller"] is on_caller
        spy = s.session.client = _Threads(s.session.client)
        keys = _keys(8, "where")
        src = _filled(keys)
        s.register_memory(src.address, len(src.raw))
        assert s.put_from(keys[:5], _pages(src)[:5]) == [True] * 5
        assert s.exists(keys) == [True] * 5 + [False] * 3
        assert s.exists(keys[:5]) == [True] * 5
        assert (spy.idents == [threading.get_ident()] * 2) is on_caller
        assert s.stats().extra["abandoned"] == 0
    finally:
        s.close()


@pytest.mark.failure_injection
def test_worker_mode_lookup_on_the_caller_with_a_stalled_master_misses_at_the_rpc_timeout(
        mooncake_cluster, tmp_path):  # noqa: F811
    """op_timeout 5, SIGSTOP the master: a lookup on the caller's thread answers misses (no
    exception) at Mooncake's RPC timeout (2.5 s), the store turns unhealthy and the next
    lookup short-circuits; after SIGCONT the same store finds the pages again."""
    op_timeout = 5.0
    master, s, keys, _src = _stored(mooncake_cluster, tmp_path / "master-stop.log", (50071, 9023), op_timeout)
    try:
        with _stopped(master.proc.pid):
            t0 = time.monotonic()
            assert s.exists(keys) == [False] * 8
            took = time.monotonic() - t0
            print(f"lookup with a stopped master: {took:.2f}s")
            assert 1.0 < took <= op_timeout + 1.0, f"lookup took {took:.2f}s"
            extra = s.stats().extra
            assert extra["healthy"] is False and extra["abandoned"] == 0 and extra["unavailable"] > 0
            t0 = time.monotonic()
            assert s.exists(keys[:1]) == [False]
            assert time.monotonic() - t0 < 0.2, "the next lookup was not short-circuited"
        deadline = time.monotonic() + 30
        found = [False]
        while time.monotonic() < deadline and not all(found):
            time.sleep(0.3)
            found = s.exists(keys)
        assert found == [True] * 8, "store did not recover after the master resumed"
    finally:
        s.close()
        master.kill()


@pytest.mark.failure_injection
def test_worker_mode_lookups_on_the_caller_with_a_killed_master_miss_in_time(mooncake_cluster,  # noqa: F811
                                                                             tmp_path):
    """op_timeout 5, kill -9 the master while 3 threads look up: every lookup returns misses
    (no exception) within op_timeout + 1 s, the store turns unhealthy (the lookups' own
    RPC_FAIL codes trip it: no get or put needed), and lookups short-circuit until a probe
    passes."""
    op_timeout = 5.0
    master, s, keys, _src = _stored(mooncake_cluster, tmp_path / "master-kill.log", (50072, 9024), op_timeout)
    try:
        calls: list[tuple[float, float, list]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def lookups(_: int) -> None:
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    r = s.exists(keys)
                    calls.append((t0, time.monotonic() - t0, r))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        killed = _kill_under_load(master, lookups, stop, warm=0.5, after=op_timeout + 2, join=op_timeout + 10)
        assert not errors, errors[0]
        assert any(c[2] == [True] * 8 for c in calls if c[0] < killed), "no hits before the kill"
        slowest = max(c[1] for c in calls)
        print(f"slowest lookup: {slowest:.2f}s of {len(calls)}")
        assert slowest <= op_timeout + 1.0, f"a lookup took {slowest:.2f}s"
        late = [c for c in calls if c[0] > killed + 0.2]
        assert late and all(c[2] == [False] * 8 for c in late), "hits after the master was killed"
        extra = s.stats().extra
        assert extra["healthy"] is False and extra["abandoned"] == 0 and extra["short_circuited"] > 0
    finally:
        s.close()
        master.kill()


# The outer run has one test: re-running this module inside its own namespace.
if not INNER:
    for _name in [n for n in globals() if n.startswith("test_")]:
        del globals()[_name]
    test_in_loopback_namespace = pytest.mark.failure_injection(outer_test(__file__))  # runs the marked ones with -m
