"""``kvconnect.connectors.config``: typed store configs fail at construction, naming key and accepted values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from kvconnect.connectors.base import ConfigError, UnknownConfigKey
from kvconnect.connectors.config import Size, StoreConfig, describe_config, field_doc, parse_config, parse_size

# every bad value refused naming its key: part of the failure-injection suite (docs/operations.md)
pytestmark = pytest.mark.failure_injection


@dataclass(frozen=True)
class DemoConfig(StoreConfig):
    path: str  # required
    capacity: Size = field(default=1 << 20, metadata=field_doc("bytes"))
    protocol: Literal["tcp", "rdma"] = "tcp"
    durable: bool = False
    workers: int = 4
    timeout_s: float = 5.0
    peers: list[str] = field(default_factory=list)
    label: Optional[str] = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be >= 1")


def parse(**opts):
    return parse_config(DemoConfig, {"path": "/x", **opts}, where="store 'demo'")


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("4096", 4096), ("4gb", 4 << 30), ("4GB", 4 << 30), ("512 MiB", 512 << 20),
    ("1.5g", int(1.5 * (1 << 30))), ("16k", 16 << 10), ("2tb", 2 << 40), ("7b", 7), (0, 0), (8.0, 8),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected
    assert parse(capacity=text).capacity == expected


@pytest.mark.parametrize("bad", ["4 parsecs", "gb", "-1gb", "", True, [4], -5, 1.5])
def test_bad_size_names_key_and_accepted_form(bad):
    with pytest.raises(ConfigError) as e:
        parse(capacity=bad)
    assert e.value.key == "capacity"
    msg = str(e.value)
    assert "'capacity'" in msg and "store 'demo'" in msg
    if bad not in (-5,):
        assert "4gb" in msg  # the accepted form is spelled out


def test_literal_accepts_choices_case_insensitively_and_names_them_on_error():
    assert parse(protocol="rdma").protocol == "rdma"
    assert parse(protocol="RDMA").protocol == "rdma"
    with pytest.raises(ConfigError) as e:
        parse(protocol="udp")
    assert e.value.key == "protocol"
    assert "'tcp'" in str(e.value) and "'rdma'" in str(e.value) and "'udp'" in str(e.value)


def test_unknown_key_is_an_error_listing_accepted_keys():
    with pytest.raises(UnknownConfigKey) as e:
        parse(capacty="1gb")  # typo
    msg = str(e.value)
    assert "'capacty'" in msg and "unknown key" in msg
    for key in ("capacity", "protocol", "durable", "workers", "path"):
        assert f"'{key}'" in msg
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


def test_required_key_missing_names_it():
    with pytest.raises(ConfigError) as e:
        parse_config(DemoConfig, {"capacity": "1mb"})
    assert e.value.key == "path"
    assert "'path'" in str(e.value) and "required" in str(e.value)


@pytest.mark.parametrize("value,expected", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), ("False", False), ("yes", True),
    ("off", False), ("1", True),
])
def test_bool_coercion(value, expected):
    assert parse(durable=value).durable is expected


@pytest.mark.parametrize("bad", ["maybe", 2, 1.0, [True], "tru"])
def test_bool_error_names_key_and_accepted_values(bad):
    with pytest.raises(ConfigError) as e:
        parse(durable=bad)
    assert e.value.key == "durable"
    assert "'durable'" in str(e.value) and "'true'" in str(e.value) and "'false'" in str(e.value)


@pytest.mark.parametrize("value,expected", [(8, 8), ("8", 8), (" 12 ", 12), (3.0, 3)])
def test_int_coercion(value, expected):
    assert parse(workers=value).workers == expected


@pytest.mark.parametrize("bad", ["eight", True, 2.5, "2.5", None, [1]])
def test_int_error_names_key(bad):
    with pytest.raises(ConfigError) as e:
        parse(workers=bad)
    assert e.value.key == "workers"
    assert "'workers'" in str(e.value)


def test_float_str_list_optional():
    c = parse(timeout_s="0.5", peers="a:1, b:2,", label=None)
    assert c.timeout_s == 0.5 and c.peers == ["a:1", "b:2"] and c.label is None
    assert parse(peers=["x"]).peers == ["x"]
    with pytest.raises(ConfigError) as e:
        parse(timeout_s="soon")
    assert e.value.key == "timeout_s"
    with pytest.raises(ConfigError) as e:
        parse(path=3)
    assert e.value.key == "path"
    with pytest.raises(ConfigError) as e:
        parse(protocol=None)  # not Optional
    assert e.value.key == "protocol"


def test_post_init_check_becomes_config_error():
    with pytest.raises(ConfigError) as e:
        parse(workers=0)
    assert "workers must be >= 1" in str(e.value)


def test_options_must_be_a_mapping():
    with pytest.raises(ConfigError):
        parse_config(DemoConfig, ["path", "/x"])  # type: ignore[arg-type]


def test_ignore_skips_keys_the_caller_consumed():
    c = parse_config(DemoConfig, {"path": "/x", "backend_name": "kvconnect"}, ignore={"backend_name"})
    assert c.path == "/x"


def test_describe_config_rows():
    rows = {r[0]: r for r in describe_config(DemoConfig)}
    assert rows["path"][2] == "required"
    assert rows["capacity"][1] == "size" and rows["capacity"][2] == repr(1 << 20) and rows["capacity"][3] == "bytes"
    assert rows["peers"][2] == "[]"


# -- bounds every store gets from the one parser -------------------------------------

HF3FS = {"file_path_prefix": "/tmp/kvc-never-created/h", "file_size": "1gb", "numjobs": 2, "entries": 4}


def _refused(store: str, opts: dict) -> ConfigError:
    from kvconnect.connectors.registry import store_class

    with pytest.raises(ConfigError) as e:
        store_class(store).config_from_options(opts)
    return e.value


@pytest.mark.parametrize("store, opts, key, accepted", [
    ("hf3fs", {**HF3FS, "client_timeout": "inf"}, "client_timeout", "finite number 0..1e+09"),
    ("hf3fs", {**HF3FS, "client_timeout": "nan"}, "client_timeout", "finite number 0..1e+09"),
    ("hf3fs", {**HF3FS, "client_timeout": float("inf")}, "client_timeout", "finite number"),
    ("peer_rdma", {"rpc_timeout": "-inf"}, "rpc_timeout", "finite number"),
    ("peer_rdma", {"control_port": 70000}, "control_port", "-1..65535"),
    ("peer_rdma", {"control_port": -2}, "control_port", "-1..65535"),
    ("peer_rdma", {"discovery_addr": "127.0.0.1:70000"}, "discovery_addr", "1..65535"),
    ("peer_rdma", {"discovery_addr": "127.0.0.1:0"}, "discovery_addr", "1..65535"),
    ("peer_rdma", {"bounce_buffer_size": 0}, "bounce_buffer_size", "size > 0"),
    ("memory", {"capacity": 1e30}, "capacity", "1 PiB"),
    ("memory", {"capacity": "2048tb"}, "capacity", "1 PiB"),
    ("memory", {"capacity": 0}, "capacity", "bytes"),
    ("hf3fs", {**HF3FS, "numjobs": 100000}, "numjobs", "1..1024"),
    ("hf3fs", {**HF3FS, "entries": 0}, "entries", "1..65536"),
    ("hf3fs", {**HF3FS, "file_size": "1024tb", "page_bytes": 4096}, "file_size", "at most 134217728 pages"),
    ("mooncake", {"master_server_address": "127.0.0.1:50051", "op_timeout": "inf"}, "op_timeout", "finite"),
])
def test_out_of_range_values_are_refused_naming_key_and_range(store, opts, key, accepted):
    err = _refused(store, opts)
    assert err.key == key
    assert accepted in str(err), str(err)


def test_a_huge_file_without_a_known_page_size_is_refused_when_the_size_is_known(tmp_path):
    """The index of a 1024 TB file of 4 KiB pages would need ~11 TB of memory: the store
    refuses the file when its page size becomes known (ConfigError naming file_size),
    instead of the index allocating it."""
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.registry import create_store

    opts = {**HF3FS, "file_path_prefix": str(tmp_path / "h"), "file_size": "1024tb"}
    with pytest.raises(ConfigError, match="file_size") as e:
        create_store("hf3fs", opts, context=EngineContext(page_bytes=4096))
    assert e.value.key == "file_size"


def test_bare_post_init_errors_name_their_key():
    with pytest.raises(ConfigError) as e:
        parse(workers=0)
    assert e.value.key == "workers"


def test_ports_and_ranges_accept_their_bounds():
    from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig

    for port in (-1, 0, 65535):
        assert parse_config(PeerRdmaConfig, {"control_port": port}).control_port == port
    assert parse_size("1024tb") == 1 << 50  # the largest size


@pytest.mark.parametrize("argv", [["hf3fs-meta", "serve", "--data-dir", "/nonexistent/d", "--port", "70000"],
                                  ["peer", "serve", "--metrics-port", "65536"],
                                  ["peer", "serve", "--control-port", "70000"]])
def test_command_line_ports_are_bounded(argv):
    import subprocess
    import sys

    from kvconnect.connectors.testing.processes import child_env

    out = subprocess.run([sys.executable, "-m", "kvconnect", *argv], capture_output=True, text=True, timeout=60,
                         env=child_env())
    assert out.returncode != 0
    assert "65535" in out.stderr, out.stderr[-2000:]
