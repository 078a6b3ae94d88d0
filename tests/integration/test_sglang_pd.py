"""kvconnect as SGLang 0.5.23's PD transfer backend, on CPU.

Real components: SGLang's plugin loader and ``HookRegistry``, ``ServerArgs`` + ``publish``,
``get_kv_class``, ``start_disagg_service`` (the bootstrap server and its ``/route``),
``MHATokenToKVPool(device="cpu")`` as the KV memory, ``MetadataBuffers`` as aux rows, the
Mooncake Transfer Engine over TCP, and the real ``mooncake`` / ``hf3fs`` kvconnect stores.
Prefill and decode run as two processes in a loopback-only network namespace, driven the
way SGLang's schedulers drive senders and receivers (``connectors.engines.sglang_pd_testing``).

Stand-ins, because they cannot exist here: CPU memory for GPU KV memory (no GPU) and TCP
for RDMA (no NIC); the scheduler loop is replaced by the driver's poll loop (a real
``sglang serve`` needs a model and a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("sglang", reason="needs sglang (the CI venv has it)")
pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (the CI venv has it)")

from connectors.engines import sglang_pd_testing as pdt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    return pdt.plugin_dist_dir(str(tmp_path_factory.mktemp("entrypoints")))


def _run_python(code: str, env: dict, timeout: float = 180) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------
# Registration through SGLang's plugin loader
# ---------------------------------------------------------------------------------

PLUGIN_CHECK = """
    import json, logging
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import TransferBackend, KVClassType, get_kv_class
    from sglang.srt.disaggregation.common.conn import (CommonKVBootstrapServer, CommonKVManager,
        CommonKVReceiver, CommonKVSender)
    out = {"choices": list(DISAGG_TRANSFER_BACKEND_CHOICES)}
    try:
        b = TransferBackend("kvconnect")
    except ValueError as e:
        out["enum_error"] = str(e)
        print(json.dumps(out)); raise SystemExit(0)
    out["member"] = b.name
    out["mooncake_is_member"] = TransferBackend("mooncake") is TransferBackend.MOONCAKE
    classes = {t.value: get_kv_class(b, t) for t in KVClassType}
    out["classes"] = {k: f"{v.__module__}.{v.__qualname__}" for k, v in classes.items()}
    out["subclass_of_common"] = [issubclass(classes["manager"], CommonKVManager),
        issubclass(classes["sender"], CommonKVSender), issubclass(classes["receiver"], CommonKVReceiver),
        issubclass(classes["bootstrap_server"], CommonKVBootstrapServer)]
    # modules that did `from sglang.srt.disaggregation.utils import get_kv_class`
    from sglang.srt.disaggregation import prefill, decode
    from sglang.srt.managers import disagg_service
    out["bound_elsewhere"] = [m.get_kv_class(b, KVClassType.SENDER) is classes["sender"]
                              for m in (prefill, decode, disagg_service)]
    out["mooncake_sender"] = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER).__name__
    from sglang.srt.server_args import ServerArgs
    parser_ok = None
    import argparse
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                       "--disaggregation-transfer-backend", "kvconnect"])
    out["cli_value"] = ns.disaggregation_transfer_backend
    print(json.dumps(out))
"""


def test_plugin_loader_registers_kvconnect(plugin_path):
    """The real ``load_plugins()`` makes ``kvconnect`` a CLI choice, an enum member and a get_kv_class key."""
    env = pdt.node_env(None, plugin_path)
    out = _run_python(PLUGIN_CHECK, env)
    assert "kvconnect" in out["choices"]
    assert out["member"] == "KVCONNECT" and out["mooncake_is_member"]
    assert out["classes"]["manager"] == "connectors.engines.sglang_pd.KVConnectKVManager"
    assert out["classes"]["sender"] == "connectors.engines.sglang_pd.KVConnectKVSender"
    assert out["classes"]["receiver"] == "connectors.engines.sglang_pd.KVConnectKVReceiver"
    assert out["classes"]["bootstrap_server"] == "connectors.engines.sglang_pd.KVConnectKVBootstrapServer"
    assert out["classes"]["kvargs"] == "sglang.srt.disaggregation.base.conn.KVArgs"
    assert out["subclass_of_common"] == [True] * 4
    assert out["bound_elsewhere"] == [True] * 3
    assert out["mooncake_sender"] == "MooncakeKVSender"
    assert out["cli_value"] == "kvconnect"


def test_without_the_plugin_kvconnect_is_rejected(plugin_path):
    """Control: with the plugin filtered out (SGLANG_PLUGINS), SGLang knows no 'kvconnect'."""
    env = pdt.node_env(None, plugin_path, SGLANG_PLUGINS="some_other_plugin")
    code = PLUGIN_CHECK.replace('    out["cli_value"]', '    out["cli_value_unused"]')
    out = _run_python(code.split("    from sglang.srt.server_args import ServerArgs")[0]
                      + "    print(json.dumps(out))\n", env)
    assert "kvconnect" not in out["choices"]
    assert "enum_error" in out


def test_plugin_is_harmless_and_never_raises():
    """register() is idempotent, imports no transport, and swallows its own failures."""
    code = """
        import json, sys
        from connectors.engines import sglang_pd_plugin as p
        p.register(); p.register()
        heavy = [m for m in ("mooncake.engine", "connectors.engines.sglang_pd", "connectors.engines.pd_transport")
                 if m in sys.modules]
        from sglang.srt.disaggregation.utils import TransferBackend
        members = [m.value for m in TransferBackend].count("kvconnect")
        def boom(): raise RuntimeError("simulated")
        p._add_cli_choice = boom
        p.register()   # must log, not raise
        print(json.dumps({"heavy": heavy, "members": members}))
    """
    out = _run_python(code, pdt.node_env(None, None))
    assert out == {"heavy": [], "members": 1}


def test_bad_config_fails_at_manager_start_naming_the_key():
    from connectors.base import ConfigError
    from connectors.engines.pd_transport import load_pd_config

    with pytest.raises(ConfigError, match="transport.*peer_rdma"):
        load_pd_config('{"transport": "nfs"}')
    with pytest.raises(ConfigError, match="tiemout_s"):
        load_pd_config('{"tiemout_s": 3}')
    assert load_pd_config(None).transport == "peer_rdma"


# ---------------------------------------------------------------------------------
# Two processes, byte-exact
# ---------------------------------------------------------------------------------

GEOMETRY = {"layers": 3, "heads": 2, "head_dim": 16, "page_size": 4, "dtype": "bfloat16",
            "pool_pages": 1024, "aux_slots": 96, "state": True}


def _rooms(n: int, base: int = 7_000_000_000_000) -> list[dict]:
    # varied lengths and chunk sizes: single-chunk rooms, many small chunks, ragged last chunks
    return [{"room": base + 7919 * i, "npages": 3 + (i * 7) % 31, "chunk_pages": 1 + (i * 5) % 9} for i in range(n)]


def transport_config(transport: str, stores: dict | None = None, **over) -> dict:
    cfg = {"transport": transport, "timeout_s": 30, "key_bytes": 4096}
    if transport == "peer_rdma":
        cfg["protocol"] = "tcp"
    else:
        cfg["store"] = dict(stores[transport]) if stores else {}
    cfg.update(over)
    return cfg


def _assert_clean(res: dict) -> None:
    left = res["leftovers"]
    assert all(v == 0 for k, v in left.items() if k != "relay_unread_rooms"), left


@pytest.mark.parametrize("transport", ["peer_rdma"])
def test_pages_and_aux_rows_arrive_byte_exact(transport, plugin_path, pd_stores):
    rooms = _rooms(24)
    common = {**GEOMETRY, "rooms": rooms, "deadline_s": 90, "bootstrap_port": 19011, "http_port": 31011}
    cfg = transport_config(transport, pd_stores)
    with pdt.pair(common, {}, {}, cfg, plugin_path, ns=pd_stores.get("_ns")) as p:
        p.start("prefill")
        p.start("decode")
        dec = p.wait("decode", 150)
        p.stop()
        pre = p.wait("prefill", 30)
    for r in rooms:
        d = dec["rooms"][str(r["room"])]
        assert d["status"] == "success", d
        assert d["pages_ok"] and d["aux_ok"] and d["state_ok"], (r, d)
        assert pre["rooms"][str(r["room"])]["status"] == "success"
    assert dec["rooms"]["_untouched_ok"], "a slot decode did not ask for was written"
    _assert_clean(dec)
    _assert_clean(pre)


@pytest.fixture
def pd_stores():
    """Per-transport store options (filled in by the relay tests' fixtures)."""
    return {}
