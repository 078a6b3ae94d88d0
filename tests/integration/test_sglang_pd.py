"""kvconnect as SGLang's PD transfer backend, on CPU (SGLang 0.5.23; the same tests pass on 0.5.17).

Real components: SGLang's plugin loader and ``HookRegistry``, ``ServerArgs`` + ``publish``,
``get_kv_class``, ``start_disagg_service`` (the bootstrap server and its ``/route``),
``MHATokenToKVPool(device="cpu")`` as the KV memory, ``MetadataBuffers`` as aux rows, the
Mooncake Transfer Engine over TCP, and the real ``mooncake`` / ``hf3fs`` kvconnect stores.
Prefill and decode run as two processes in a loopback-only network namespace, driven the
way SGLang's schedulers drive senders and receivers (``kvconnect.connectors.testing.pd``).

Stand-ins, because they cannot exist here: CPU memory for GPU KV memory (no GPU) and TCP
for RDMA (no NIC); the scheduler loop is replaced by the driver's poll loop (a real
``sglang serve`` needs a model and a GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("sglang", reason="needs sglang (the CI venv has it)")
pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda (the CI venv has it)")

from kvconnect.connectors.testing import pd as pdt  # noqa: E402

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
    try:
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    except ImportError:  # SGLang 0.5.17 keeps the choices in server_args
        from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES
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
    import os
    for role in ("prefill", "decode"):  # examples/pd/*.sh as SGLang's own parser reads them
        ns = p.parse_args(json.loads(os.environ["KVC_EXAMPLE_" + role.upper()]))
        out["example_" + role] = [ns.disaggregation_mode, ns.disaggregation_transfer_backend]
    print(json.dumps(out))
"""


def example_argv(script: str) -> list[str]:
    """The ``sglang.launch_server`` arguments of an examples/pd script: server.sh's shared ones
    (its ``launch_server`` function), then the script's own ($MODEL -> a dummy path)."""

    def words_after(name: str, marker: str) -> list[str]:
        text = open(os.path.join(ROOT, "examples", "pd", name)).read()
        command = text.split(marker, 1)[1].replace("\\\n", " ").split("\n", 1)[0]
        return [w.strip('"').replace("$MODEL", "dummy") for w in command.split() if w != '"$@"']

    return words_after("server.sh", "python -m sglang.launch_server") + words_after(script, "\nlaunch_server")


def test_plugin_loader_registers_kvconnect(plugin_path):
    """The real ``load_plugins()`` makes ``kvconnect`` a CLI choice, an enum member and a get_kv_class key."""
    env = pdt.node_env(None, plugin_path, KVC_EXAMPLE_PREFILL=json.dumps(example_argv("prefill.sh")),
                       KVC_EXAMPLE_DECODE=json.dumps(example_argv("decode.sh")))
    out = _run_python(PLUGIN_CHECK, env)
    assert "kvconnect" in out["choices"]
    assert out["member"] == "KVCONNECT" and out["mooncake_is_member"]
    assert out["classes"]["manager"] == "kvconnect.connectors.engines.sglang_pd.KVConnectKVManager"
    assert out["classes"]["sender"] == "kvconnect.connectors.engines.sglang_pd.KVConnectKVSender"
    assert out["classes"]["receiver"] == "kvconnect.connectors.engines.sglang_pd.KVConnectKVReceiver"
    assert out["classes"]["bootstrap_server"] == "kvconnect.connectors.engines.sglang_pd.KVConnectKVBootstrapServer"
    assert out["classes"]["kvargs"] == "sglang.srt.disaggregation.base.conn.KVArgs"
    assert out["subclass_of_common"] == [True] * 4
    assert out["bound_elsewhere"] == [True] * 3
    assert out["mooncake_sender"] == "MooncakeKVSender"
    assert out["cli_value"] == "kvconnect"
    assert out["example_prefill"] == ["prefill", "kvconnect"]
    assert out["example_decode"] == ["decode", "kvconnect"]


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
        from kvconnect.connectors.engines import sglang_pd_plugin as p
        p.register(); p.register()
        heavy = [m for m in ("mooncake.engine", "kvconnect.connectors.engines.sglang_pd", "kvconnect.connectors.engines.pd_transport")
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
    from kvconnect.connectors.base import ConfigError
    from kvconnect.connectors.engines.pd_transport import load_pd_config

    with pytest.raises(ConfigError, match="transport.*'direct', 'relay'"):
        load_pd_config('{"transport": "nfs"}')
    with pytest.raises(ConfigError, match="tiemout_s"):
        load_pd_config('{"tiemout_s": 3}')
    with pytest.raises(ConfigError, match="'store'.*relay needs a store"):
        load_pd_config('{"transport": "relay"}')
    assert load_pd_config(None).transport == "direct"


# ---------------------------------------------------------------------------------
# Two processes: byte-exact transfers, then failures
# ---------------------------------------------------------------------------------

GEOMETRY = {"layers": 3, "heads": 2, "head_dim": 16, "page_size": 4, "dtype": "bfloat16",
            "pool_pages": 1024, "aux_slots": 96, "state": True}
TIMEOUT_S = 10.0  # KVCONNECT_PD_CONFIG timeout_s: the bound of the room-mismatch and outage cases
HEARTBEAT_BOUND_S = 15.0  # heartbeat 2 s x 3 refused calls, plus a loaded 2-core machine
BASE = 7_000_000_000_000


def byte_exact_rooms(n: int = 24) -> list[dict]:
    # varied lengths and chunk sizes: single-chunk rooms, many small chunks, ragged last chunks
    return [{"room": BASE + 7919 * i, "npages": 3 + (i * 7) % 31, "chunk_pages": 1 + (i * 5) % 9} for i in range(n)]


MISMATCH_ROOMS = [
    # decode was routed another room id than prefill (router bug): both sides must give up
    {"room": BASE + 1, "decode_room": BASE + 2, "npages": 6, "chunk_pages": 2},
    # decode allocated more pages than prefill sends
    {"room": BASE + 3, "npages": 8, "decode_npages": 9, "chunk_pages": 3},
    # a normal room in the same wave still succeeds
    {"room": BASE + 4, "npages": 5, "chunk_pages": 5},
]
SLOW_ROOMS = [{"room": BASE + 100 + i, "npages": 40, "chunk_pages": 2, "chunk_sleep_s": 0.15} for i in range(4)]


@contextlib.contextmanager
def transport_setup(transport: str, workdir: str):
    """(netns, KVCONNECT_PD_CONFIG, outage) for a transport; relay stores are really started."""
    cfg = {"transport": "direct" if transport == "peer_rdma" else "relay", "timeout_s": TIMEOUT_S, "retain_s": 15.0}
    if transport == "peer_rdma":
        cfg["protocol"] = "tcp"
        with pdt.loopback_ns("kvcpd") as ns:
            yield ns, cfg, None
        return
    cfg["key_bytes"] = 4096 if transport == "mooncake" else None  # several pages per key vs one (hf3fs)
    cfg["call_bytes"] = 12288  # a room moves in several store calls (GPU rooms: 64 MiB of 1 GiB per call)
    with pdt.store_service(transport, workdir) as (ns, opts, outage):
        cfg["store"] = {"store": transport, **opts}
        yield ns, cfg, outage


def run_scenario(transport: str, last_wave: str, plugin_path: str, workdir: str, port: int) -> dict:
    """Wave 1: 24 rooms byte-exact. Wave 2: room mismatches. Wave 3: prefill SIGKILL or store outage."""
    waves = [byte_exact_rooms(), MISMATCH_ROOMS, SLOW_ROOMS]
    common = {**GEOMETRY, "waves": waves, "deadline_s": 120, "bootstrap_port": port, "http_port": port + 1}
    if transport != "peer_rdma":
        common["decode_after_prefill"] = [0]  # relay: decode's requests arrive after prefill finished wave 1
    with transport_setup(transport, workdir) as (ns, cfg, outage):
        with pdt.pair(common, {}, {}, cfg, plugin_path, ns=ns) as p:
            p.start("prefill")
            p.start("decode")
            slow = {str(r["room"]) for r in SLOW_ROOMS}
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:  # until prefill sends wave 3's first chunks
                if os.path.exists(p.progress_file) and slow & set(open(p.progress_file).read().split()):
                    break
                if p.procs["prefill"].poll() is not None:
                    raise AssertionError(f"prefill exited before wave 3 sent a chunk\n{p.progress('prefill')}\n"
                                         f"{p.progress('decode')}\n{p.tail('prefill')}\n{p.tail('decode')}")
                time.sleep(0.05)
            else:
                raise AssertionError(f"wave 3 never started\n{p.progress('prefill')}\n{p.progress('decode')}\n"
                                     f"{p.tail('prefill')}\n{p.tail('decode')}")
            time.sleep(0.5)  # some chunks (relay: some keys) have landed
            t_fault = time.time()
            if last_wave == "kill_prefill":
                p.kill("prefill")
            else:
                outage()
            dec = p.wait("decode", 120)
            if last_wave != "kill_prefill":
                p.stop()
            pre = p.result("prefill")
    return {"pre": pre, "dec": dec, "t_fault": t_fault, "transport": transport, "last_wave": last_wave}


SCENARIOS = [("peer_rdma", "kill_prefill"), ("mooncake", "outage"), ("hf3fs", "kill_prefill")]
_results: dict = {}


@pytest.fixture(scope="module", params=SCENARIOS, ids=[f"{t}-{w}" for t, w in SCENARIOS])
def scenario(request, plugin_path, tmp_path_factory):
    transport, last_wave = request.param
    port = 19011 + 10 * SCENARIOS.index(request.param)
    try:
        return run_scenario(transport, last_wave, plugin_path, str(tmp_path_factory.mktemp(transport)), port)
    except pdt.StoreUnavailable as e:
        pytest.fail(f"{transport} store service did not start: {e}")


def test_pages_and_aux_rows_arrive_byte_exact(scenario):
    """24 concurrent rooms, chunked sends, pages scattered at random in both pools."""
    dec, pre = scenario["dec"]["waves"][0], scenario["pre"]["waves"][0]
    for r in byte_exact_rooms():
        d = dec[str(r["room"])]
        assert d["status"] == "success", d
        assert d["pages_ok"] and d["aux_ok"] and d["state_ok"], (r, d)
        assert pre[str(r["room"])]["status"] == "success", pre[str(r["room"])]
    assert dec["_untouched_ok"], "a KV slot decode did not ask for was written"
    if scenario["transport"] != "peer_rdma":  # the relay does not need decode while prefill sends
        last_prefill = max(p["t_done"] for p in pre.values())
        first_decode = min(d["t_send_metadata"] for k, d in dec.items() if not k.startswith("_"))
        assert first_decode > last_prefill, "decode should have started after prefill finished"


def test_room_mismatch_fails_within_the_bound(scenario):
    dec, pre = scenario["dec"]["waves"][1], scenario["pre"]["waves"][1]
    relay = scenario["transport"] != "peer_rdma"
    wrong_id, wrong_size, normal = MISMATCH_ROOMS
    d = dec[str(wrong_id["decode_room"])]
    assert d["status"] == "failed" and "room mismatch" in d["error"], d
    assert d["t_failed"] - d.get("t_created", d["t_failed"]) < TIMEOUT_S + 5
    p = pre[str(wrong_id["room"])]
    if relay:  # prefill published without waiting for decode; its keys expire after retain_s
        assert p["status"] == "success", p
    else:
        assert p["status"] == "failed" and "Bootstrapping" in p["error"], p
    d = dec[str(wrong_size["room"])]
    assert d["status"] == "failed" and "room mismatch" in d["error"] and "9" in d["error"], d
    assert dec[str(normal["room"])]["status"] == "success" and dec[str(normal["room"])]["pages_ok"]


def test_fault_mid_transfer_fails_within_the_bound(scenario):
    """Prefill SIGKILLed mid-transfer, or the store backend killed: every room Failed, in bounded time."""
    dec = scenario["dec"]["waves"][2]
    bound = HEARTBEAT_BOUND_S if scenario["last_wave"] == "kill_prefill" else TIMEOUT_S + 12
    for r in SLOW_ROOMS:
        d = dec[str(r["room"])]
        assert d["status"] == "failed", d
        assert d["t_failed"] - scenario["t_fault"] < bound, (d, bound)
        if scenario["last_wave"] == "kill_prefill":
            assert "Lost connection with prefill" in d["error"] or "timed out" in d["error"], d
        else:
            assert "store" in d["error"] or "timed out" in d["error"], d


def test_nothing_leaks(scenario):
    """Manager tables empty on both sides; no relay key left in the store (decode checks every key)."""
    left = scenario["dec"]["leftovers"]
    assert left["request_status"] == 0 and left["failure_records"] == 0, left
    if scenario["transport"] != "peer_rdma" and scenario["last_wave"] != "outage":
        assert left["store_keys_left"] == 0, left
    if scenario["last_wave"] == "outage":  # prefill survived: its tables must be empty too
        pleft = scenario["pre"]["leftovers_at_stop"]
        assert all(v == 0 for k, v in pleft.items() if k != "store_stats"), pleft


def test_control_messages_need_the_shared_token(plugin_path):
    """With auth_token set, prefill ignores a decode that does not present it: no write, both sides Failed."""
    rooms = [{"room": BASE + 500 + i, "npages": 4, "chunk_pages": 2} for i in range(2)]
    common = {**GEOMETRY, "rooms": rooms, "deadline_s": 60, "bootstrap_port": 19071, "http_port": 19072}
    cfg = {"transport": "direct", "protocol": "tcp", "timeout_s": 4}
    with pdt.pair(common, {}, {}, cfg, plugin_path) as p:
        p.role_env = {"prefill": {"KVCONNECT_PD_TOKEN": "s3cret"}, "decode": {"KVCONNECT_PD_TOKEN": "guess"}}
        p.start("prefill")
        p.start("decode")
        dec = p.wait("decode", 90)
        p.stop()
        pre = p.wait("prefill", 30)
        log = p.tail("prefill", 200_000)
    for r in rooms:
        assert dec["rooms"][str(r["room"])]["status"] == "failed", dec["rooms"]
        assert pre["rooms"][str(r["room"])]["status"] == "failed", pre["rooms"]
    assert "wrong or missing auth_token" in log
    assert dec["rooms"]["_untouched_ok"], "prefill wrote into decode memory without the token"


# ---------------------------------------------------------------------------------
# Bootstrap start-up race
# ---------------------------------------------------------------------------------

# SGLang's registration makes five attempts, 1 + 2 + 4 + 8 s apart with jitter (11-15 s in all),
# then logs an error and never registers; the bootstrap server here comes up after that window.
LATE_BOOTSTRAP_S = 17.0


def test_prefill_registers_with_a_bootstrap_server_that_comes_up_late(plugin_path):
    """The start-up race: SGLang's server process starts the bootstrap server while its scheduler
    process builds the manager, which registers at once. Here the bootstrap server (SGLang's class
    through ``get_kv_class``) starts 17 s after the manager began registering, past SGLang's own
    retry window, after which a stock prefill stays unregistered and decode's ``/route`` answers 503
    for ever ("bootstrap server never became ready"). kvconnect's manager keeps trying: it
    registers once the server listens and decode gets every byte of every room."""
    rooms = [{"room": BASE + 700 + 13 * i, "npages": 3 + 4 * i, "chunk_pages": 2} for i in range(4)]
    common = {**GEOMETRY, "rooms": rooms, "deadline_s": 90, "bootstrap_port": 19081, "http_port": 19082}
    cfg = {"transport": "direct", "protocol": "tcp", "timeout_s": TIMEOUT_S}
    with pdt.pair(common, {"bootstrap_delay_s": LATE_BOOTSTRAP_S}, {}, cfg, plugin_path) as p:
        p.start("prefill")
        p.start("decode")
        dec = p.wait("decode", 150)
        p.stop()
        pre = p.wait("prefill", 30)
    reg = pre["registration"]
    assert reg["attempts"] > 5 and reg["waited_s"] > 15.0, reg   # more, and longer, than SGLang's own tries
    assert reg["bootstrap_started_t"] - pre["start_t"] >= LATE_BOOTSTRAP_S
    for r in rooms:
        d = dec["rooms"][str(r["room"])]
        assert d["status"] == "success" and d["pages_ok"] and d["aux_ok"] and d["state_ok"], (r, d)
        assert pre["rooms"][str(r["room"])]["status"] == "success", pre["rooms"]
    assert dec["rooms"]["_untouched_ok"], "a KV slot decode did not ask for was written"


def test_bootstrap_server_listens_before_it_returns_and_fails_on_a_held_port():
    """SGLang's bootstrap server returns before its thread listens and only logs a port it cannot
    bind (the prefill then runs with no bootstrap server). kvconnect's listens when its constructor
    returns, and raises naming the address when the port is held."""
    import socket
    import urllib.request

    from kvconnect.connectors.engines.sglang_pd import KVConnectKVBootstrapServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"could not listen on 127.0.0.1:{port}"):
            KVConnectKVBootstrapServer("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = KVConnectKVBootstrapServer("127.0.0.1", port)
    try:   # no wait: the first request right after the constructor is answered
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200 and r.read() == b"OK"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                    "&target_tp_rank=-1&target_pp_rank=-1", timeout=5) as r:
            raise AssertionError(f"an empty bootstrap server answered {r.status}")
    except urllib.error.HTTPError as e:
        assert e.code == 503 and b"not fully registered" in e.read()
    finally:
        server.close()


def test_sglang_0517_registration_goes_through_the_retrying_hook():
    """SGLang 0.5.17 PUTs its registration inline (five tries, then only a log line); the compat
    layer runs 0.5.17's own code with that PUT recorded and hands URL and payload to the hook the
    0.5.23 path uses. The recorder answers only ``put`` and restores SGLang's module afterwards."""
    from sglang.srt.disaggregation.common import conn

    from kvconnect.connectors.engines.sglang_pd_compat import recorded_registrations

    real = conn.requests

    def register_like_0517():   # the shape of 0.5.17's CommonKVManager.register_to_bootstrap
        assert conn.requests.get is real.get   # everything but put is SGLang's own
        for attempt in range(5):
            response = conn.requests.put("http://127.0.0.1:1/route", json={"rank_port": 7 + attempt}, timeout=5)
            if response.status_code == 200:
                return
        raise AssertionError("the recorder did not accept the registration")

    assert recorded_registrations(register_like_0517) == [("http://127.0.0.1:1/route", {"rank_port": 7})]
    assert conn.requests is real
