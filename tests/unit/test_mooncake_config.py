"""Mooncake store: configuration (our keys, SGLang's MOONCAKE_* variables and config file),
the error-code map, the staging buffer and the deadline runner. No master needed."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvconnect.connectors.base import BackendUnavailable, ConfigError, UnknownConfigKey
from kvconnect.connectors.config import parse_config
from kvconnect.connectors import transfer_engine
from kvconnect.connectors.mooncake import calls
from kvconnect.connectors.mooncake import errors as E
from kvconnect.connectors.mooncake.config import MooncakeConfig, merged_options
from kvconnect.connectors.registry import create_store


def cfg(options=None, env=None) -> MooncakeConfig:
    return parse_config(MooncakeConfig, merged_options(options, environ=env or {}), where="store 'mooncake'")


def test_sglang_environment_variables_are_read():
    c = cfg(env={"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_PROTOCOL": "tcp",
                 "MOONCAKE_TE_META_DATA_SERVER": "http://127.0.0.1:8080/metadata",
                 "MOONCAKE_LOCAL_HOSTNAME": "node7", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
                 "MOONCAKE_LOCAL_BUFFER_SIZE": "0", "MOONCAKE_DEVICE": "mlx5_0,mlx5_1"})
    assert c.master_server_address == "10.0.0.1:50051"
    assert c.protocol == "tcp" and c.local_hostname == "node7"
    assert c.metadata_server == "http://127.0.0.1:8080/metadata"
    assert c.global_segment_size == 4 << 30 and c.local_buffer_size == 0
    assert c.rdma_devices() == "mlx5_0,mlx5_1"


def test_defaults_match_sglang():
    c = cfg({"master_server_address": "127.0.0.1:50051"})
    assert (c.metadata_server, c.local_hostname, c.protocol, c.global_segment_size) == \
        ("P2PHANDSHAKE", "localhost", "rdma", 4 << 30)


def test_precedence_env_then_file_then_options(tmp_path):
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "file:1", "protocol": "rdma", "global_segment_size": "1gb",
                             "master_metrics_port": 9003, "check_server": False}))  # SGLang-only keys: accepted
    env = {"MOONCAKE_MASTER": "env:1", "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_LOCAL_HOSTNAME": "envhost",
           "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(f)}
    c = cfg(env=env)
    assert c.master_server_address == "file:1"  # file beats env
    assert c.protocol == "rdma" and c.global_segment_size == 1 << 30
    assert c.local_hostname == "envhost"  # env fills what the file lacks
    c = cfg({"master_server_address": "opt:2", "config_path": str(f)}, env={"MOONCAKE_MASTER": "env:1"})
    assert c.master_server_address == "opt:2"  # explicit options beat both


@pytest.mark.parametrize("options, error, named", [
    ({}, ConfigError, ["master_server_address", "MOONCAKE_MASTER"]),
    ({"master_server_address": "h:1", "protocol": "udp"}, ConfigError, ["protocol", "'tcp'", "'rdma'"]),
    ({"master_server_address": "h:1", "global_segment_size": "4 potatoes"}, ConfigError,
     ["global_segment_size", "4gb"]),
    ({"master_server_address": "nohostport"}, ConfigError, ["host:port"]),
    ({"master_server_address": "h:1", "standalone_storage": True}, ConfigError, ["standalone_storage"]),
    ({"master_server_address": "h:1", "segment_size": "1gb"}, UnknownConfigKey, ["segment_size", "global_segment_size"]),
    ({"master_server_address": "h:1", "op_timeout": 0}, ConfigError, ["op_timeout"]),
    ({"master_server_address": "h:1", "prefer_local_segment": True, "global_segment_size": 0}, ConfigError,
     ["prefer_local_segment", "global_segment_size"]),
])
def test_bad_config_names_key_and_accepted_values(options, error, named):
    with pytest.raises(error) as e:
        cfg(options)
    assert all(word in str(e.value) for word in named), str(e.value)


def test_unreadable_config_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError) as e:
        cfg({"master_server_address": "h:1", "config_path": str(bad)})
    assert "config_path" in str(e.value)


def test_config_errors_come_from_the_registry_before_connecting():
    with pytest.raises(UnknownConfigKey):
        create_store("mooncake", {"master_server_address": "127.0.0.1:1", "bogus": 1})
    with pytest.raises(ConfigError):
        create_store("mooncake", {"master_server_address": "127.0.0.1:1", "io_mode": "sometimes"})


def test_device_map_by_tp_rank():
    devices = json.dumps({"0": "mlx5_0", "1": "mlx5_1"})
    assert cfg({"master_server_address": "h:1", "device_name": devices, "tp_rank": 1}).rdma_devices() == "mlx5_1"
    assert cfg({"master_server_address": "h:1", "device_name": devices, "tp_rank": 5}).rdma_devices() == ""
    with pytest.raises(ConfigError):
        cfg({"master_server_address": "h:1", "device_name": "{oops"})


def test_every_error_code_is_classified():
    assert E.outcome(-706) is E.Outcome.LEASED
    assert E.outcome(-704) is E.Outcome.MISS
    assert E.outcome(-705) is E.Outcome.EXISTS
    assert E.outcome(-707) is E.Outcome.TRANSIENT
    assert E.outcome(-900) is E.Outcome.UNAVAILABLE
    assert E.outcome(-12345) is E.Outcome.INTERNAL and "UNKNOWN" in E.code_name(-12345)
    assert all(isinstance(o, E.Outcome) for _, o in E.CODES.values())
    with pytest.raises(BackendUnavailable) as e:
        E.raise_for("register_buffer", -900, master="10.0.0.1:50051")
    assert "10.0.0.1:50051" in str(e.value) and "RPC_FAIL" in str(e.value)
    with pytest.raises(E.MooncakeError) as e:
        E.raise_for("remove", -706)
    assert e.value.code_name == "OBJECT_HAS_LEASE"


def test_runner_returns_results_and_errors_and_reuses_one_thread():
    r = calls.DeadlineRunner(4, "t")
    try:
        assert r.run(lambda a, b: a + b, (2, 3), 1.0) == (calls.DONE, 5)
        status, exc = r.run(lambda: 1 / 0, (), 1.0)
        assert status == calls.RAISED and isinstance(exc, ZeroDivisionError)
        # a caller calling in sequence always meets the same worker (LIFO)
        idents = {r.run(threading.get_ident, (), 1.0)[1] for _ in range(50)}
        assert len(idents) == 1 and threading.get_ident() not in idents
    finally:
        r.close()


def test_runner_abandons_at_the_deadline_and_cleans_up_after_the_late_return():
    r = calls.DeadlineRunner(2, "t")
    gate = threading.Event()
    late: list = []
    try:
        t0 = time.monotonic()
        status, value = r.run(lambda: (gate.wait(10), "late")[1], (), 0.2, late.append)
        took = time.monotonic() - t0
        assert (status, value) == (calls.ABANDONED, None)
        assert 0.15 <= took < 1.0
        assert r.abandoned == 1 and late == []
        # the other worker still serves; with both busy a call gets BUSY within its deadline
        assert r.run(lambda: "ok", (), 1.0) == (calls.DONE, "ok")
        block = threading.Event()
        threading.Thread(target=r.run, args=(block.wait, (10,), 5.0), daemon=True).start()
        time.sleep(0.1)
        t0 = time.monotonic()
        assert r.run(lambda: "never", (), 0.2) == (calls.BUSY, None)
        assert time.monotonic() - t0 < 1.0
        block.set()
        gate.set()
        deadline = time.monotonic() + 5
        while r.abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.abandoned == 0 and late == ["late"]
        assert r.run(lambda: "again", (), 1.0) == (calls.DONE, "again")
    finally:
        r.close()


def test_runner_deadline_race_cleans_up_exactly_the_abandoned_calls():
    """Calls that end right at their deadline: each is either answered (DONE) or
    abandoned, never both, and on_late runs once for every abandoned call only."""
    r = calls.DeadlineRunner(3, "t")
    late: list = []
    outcomes = []
    try:
        for i in range(200):
            timeout = (0.0005, 0.002, 0.5)[i % 3]  # mostly late, a race, in time
            status, value = r.run(lambda i=i: (time.sleep(0.002), i)[1], (), timeout, late.append)
            outcomes.append((i, status, value))
        deadline = time.monotonic() + 5
        while r.abandoned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.abandoned == 0
        done = [i for i, st, v in outcomes if st == calls.DONE and v == i]
        gone = [i for i, st, v in outcomes if st == calls.ABANDONED and v is None]
        busy = [i for i, st, v in outcomes if st == calls.BUSY and v is None]  # all workers still late
        assert len(done) + len(gone) + len(busy) == 200
        assert done and gone
        assert sorted(late) == gone
    finally:
        r.close()


def test_runner_close_ends_idle_workers():
    r = calls.DeadlineRunner(2, "closing")
    r.run(lambda: None, (), 1.0)
    r.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("closing-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name.startswith("closing-") for t in threading.enumerate())
    assert r.run(lambda: None, (), 0.1) == (calls.BUSY, None)


def test_call_mode_from_options_and_environment_and_bad_values_name_the_key():
    assert cfg({"master_server_address": "h:1"}).call_mode == "worker"
    assert cfg({"master_server_address": "h:1", "call_mode": "inline"}).call_mode == "inline"
    assert cfg(env={"MOONCAKE_MASTER": "h:1", "MOONCAKE_CALL_MODE": "INLINE"}).call_mode == "inline"
    assert cfg({"master_server_address": "h:1", "call_mode": "worker"},
               env={"MOONCAKE_CALL_MODE": "inline"}).call_mode == "worker"  # explicit option wins
    with pytest.raises(ConfigError) as e:
        cfg({"master_server_address": "h:1", "call_mode": "thread"})
    assert "call_mode" in str(e.value) and "'worker'" in str(e.value) and "'inline'" in str(e.value)


def test_inline_timeouts_follow_op_timeout():
    t = transfer_engine.mooncake_timeouts(5.0)
    assert t["MC_RPC_TIMEOUT_MS"] == "2500" and t["MC_RPC_CONNECT_TIMEOUT_MS"] == "2500"
    assert t["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "1"
    assert "MC_TCP_STATUS_TIMEOUT_SEC" not in t  # a short one takes a slow peer for a legacy one
    assert transfer_engine.mooncake_timeouts(20.0)["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "9"
    assert transfer_engine.mooncake_timeouts(0.1)["MC_RPC_TIMEOUT_MS"] == "200"  # floor: an RPC needs some time


def test_run_inline_answers_like_the_runner_on_the_calling_thread():
    assert calls.run_inline(lambda a, b: (a + b, threading.get_ident()), (2, 3)) == \
        (calls.DONE, (5, threading.get_ident()))
    status, exc = calls.run_inline(lambda: 1 / 0, ())
    assert status == calls.RAISED and isinstance(exc, ZeroDivisionError)
