"""connectors/engines/common.py: option splitting, guarded calls, rate-limited logging."""

from __future__ import annotations

import logging

import pytest

from kvconnect.connectors.base import ConfigError, UnknownConfigKey, UnknownStore
from kvconnect.connectors.engines.common import (
    ErrorCounter,
    RateLimitedLog,
    build_store,
    guarded,
    safe_call,
    split_engine_options,
)


def test_split_drops_engine_keys_and_separates_adapter_keys():
    eo = split_engine_options(
        {"store": "memory", "capacity": "1mb", "backend_name": "x", "tenant": "t", "model_fingerprint": "rev1",
         "metrics_port": "9100", "queue": 4},
        where="test", ignore=("backend_name",), engine_keys=("queue",))
    assert eo.store == "memory" and eo.store_options == {"capacity": "1mb"}
    assert (eo.tenant, eo.model_fingerprint, eo.metrics_port, eo.extra) == ("t", "rev1", 9100, {"queue": 4})


def test_split_module_class_store_and_nested_options():
    eo = split_engine_options({"store": "pkg.mod:Cls", "store_options": {"a": 1}, "b": 2}, where="test")
    assert eo.store_options == {"a": 1, "b": 2, "module_path": "pkg.mod", "class_name": "Cls"}
    with pytest.raises(ConfigError, match="'a'.*both inline"):
        split_engine_options({"store": "memory", "store_options": {"a": 1}, "a": 2}, where="test")
    with pytest.raises(ConfigError, match="'metrics_port'"):
        split_engine_options({"store": "memory", "metrics_port": 70000}, where="test")
    with pytest.raises(ConfigError, match="'tenant'"):
        split_engine_options({"store": "memory", "tenant": 3}, where="test")


def test_build_store_errors_name_key_and_accepted_values():
    store, _ = build_store({"store": "memory", "capacity": 4096}, where="test")
    assert store.config.capacity == 4096
    store.close()
    with pytest.raises(UnknownStore, match="'memory'"):
        build_store({"store": "nope"}, where="test")
    with pytest.raises(ConfigError, match="'store'.*is required"):
        build_store({}, where="test")
    with pytest.raises(ConfigError, match="'store'.*'nosuch.mod:X'.*cannot import"):
        build_store({"store": "nosuch.mod:X"}, where="test")
    with pytest.raises(UnknownConfigKey) as e:
        build_store({"store": "memory", "cap": 1}, where="test", engine_keys=("queue",))
    assert "'cap'" in str(e.value) and "'capacity'" in str(e.value) and "'queue'" in str(e.value)


def test_guarded_turns_exceptions_into_sized_misses():
    class Adapter:
        def __init__(self):
            self._errors = ErrorCounter()
            self._rlog = RateLimitedLog(logging.getLogger("test.guarded"), interval_s=60)

        @guarded(lambda self, keys: [False] * len(keys))
        def get(self, keys):
            raise RuntimeError("backend down")

        @guarded(lambda self, keys: 0)
        def ok(self, keys):
            return len(keys)

    a = Adapter()
    assert a.get(["a", "b", "c"]) == [False, False, False]
    assert a.ok(["a"]) == 1
    assert a._errors.as_dict() == {"get": 1}
    errors = ErrorCounter()
    assert safe_call(lambda: 1 / 0, default=list, what="div", errors=errors) == []
    assert errors.total == 1


def test_rate_limited_log_suppresses_and_counts(caplog):
    rlog = RateLimitedLog(logging.getLogger("test.rlog"), interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.rlog"):
        assert rlog.warning("k", "first") is True
        assert rlog.warning("k", "again") is False
        assert rlog.warning("other", "different kind") is True
    assert [r.getMessage() for r in caplog.records] == ["first", "different kind"]
    rlog.interval_s = 0
    with caplog.at_level(logging.WARNING, logger="test.rlog"):
        assert rlog.warning("k", "later") is True
    assert "1 similar messages suppressed" in caplog.records[-1].getMessage()


def test_stack_dumps_only_when_asked_and_a_bad_interval_is_ignored(tmp_path, monkeypatch, caplog):
    import time

    from kvconnect.connectors.engines.common import STACKS_DIR_ENV, STACKS_EVERY_ENV, start_stack_dumps, stop_stack_dumps

    monkeypatch.delenv(STACKS_EVERY_ENV, raising=False)
    assert start_stack_dumps() is None
    monkeypatch.setenv(STACKS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(STACKS_EVERY_ENV, "soon")
    assert start_stack_dumps() is None and STACKS_EVERY_ENV in caplog.text
    monkeypatch.setenv(STACKS_EVERY_ENV, "0.1")
    handle = start_stack_dumps()
    time.sleep(0.45)
    stop_stack_dumps(handle)
    (dump,) = tmp_path.glob("stacks-*.log")
    text = dump.read_text()
    assert text.count("--- ") >= 2 and "Thread MainThread:" in text
    assert "test_stack_dumps_only_when_asked" in text  # this test's own frame, sleeping
    time.sleep(0.25)
    assert dump.read_text() == text                     # stopped: nothing more is written
