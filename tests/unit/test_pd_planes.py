"""The PD data planes are a strategy: the manager (``sglang_pd``) calls ``DataPlane`` hooks and
never asks which transport it has; a third plane plugs in with no edit to the manager.

Read from the source (no SGLang import: it takes seconds), plus a relay room driven through
the interface with a stand-in for the manager.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvconnect.connectors.engines import pd_planes
from kvconnect.connectors.engines.pd_planes import DataPlane, PlaneHost, RelayPlane, open_data_plane
from kvconnect.connectors.engines.pd_transport import BufferLayout, PDConfig, StoreRelay

MANAGER = Path(pd_planes.__file__).with_name("sglang_pd.py")
TRANSPORT_WORDS = {"relay", "direct", "is_relay", "transport", "StoreRelay", "DirectPlane", "RelayPlane"}


def _manager_tree() -> ast.Module:
    return ast.parse(MANAGER.read_text())


def _is_transport_test(node: ast.AST) -> bool:
    """Does a condition look at the transport (a name, attribute or string naming one)?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in TRANSPORT_WORDS:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in TRANSPORT_WORDS:
            return True
        if isinstance(sub, ast.Constant) and sub.value in ("relay", "direct"):
            return True
        if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "isinstance":
            return True
    return False


def test_the_manager_has_no_branch_on_the_transport():
    tree = _manager_tree()
    branches = []
    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        branches += [f"line {t.lineno}: {ast.unparse(t)}" for t in tests if _is_transport_test(t)]
    assert not branches, "the manager branches on the transport:\n" + "\n".join(branches)
    # nor does it hold or import a concrete plane
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"StoreRelay", "DirectPlane", "RelayPlane", "PLANES"}, names & {"StoreRelay", "DirectPlane"}


def test_every_plane_call_in_the_manager_is_part_of_the_interface():
    used = set()
    for node in ast.walk(_manager_tree()):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "plane":
            used.add(node.attr)
    declared = {n for n in dir(DataPlane) if not n.startswith("_")} | set(DataPlane.__annotations__)
    assert used, "the manager never calls its plane?"
    assert used <= declared, f"not on DataPlane: {sorted(used - declared)}"


def test_the_manager_implements_the_host_the_planes_use():
    tree = _manager_tree()
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVConnectKVManager")
    methods = {n.name for n in manager.body if isinstance(n, ast.FunctionDef)}
    wanted = {n for n, v in vars(PlaneHost).items() if callable(v) and not n.startswith("_")}
    assert wanted and wanted <= methods, f"PlaneHost methods the manager lacks: {sorted(wanted - methods)}"
    # and the planes ask nothing else of it
    asked = {n.attr for n in ast.walk(ast.parse(Path(pd_planes.__file__).read_text()))
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "host"}
    assert asked and asked <= wanted | {"local_ip", "rank_port"}, sorted(asked - wanted)


class ToyPlane(DataPlane):
    """A third plane: only what it must implement; every other hook keeps its default."""

    waits_for_decode = True

    def __init__(self, config, layout, context, host):
        self.host, self.session_id, self.sent = host, "toy", []

    def prefill_send(self, chunk, pages):
        self.sent.append((chunk.room, list(pages)))
        if chunk.is_last_chunk:
            self.host.conclude_success(chunk.room)

    def close(self):
        pass


class FakeHost:
    """Stands in for the manager: records what the plane asks of it."""

    local_ip, rank_port = "10.0.0.1", 7000

    def __init__(self):
        self.calls: list[tuple] = []
        self.done = threading.Event()
        self.live = True

    def kv_dtype_tag(self):
        return "bf16"

    def room_destinations(self, room):
        return None

    def decode_registration(self, session):
        return None

    def conclude_success(self, room, targets=None):
        self.calls.append(("conclude_success", room, targets))

    def mark_success(self, room):
        self.calls.append(("mark_success", room))
        self.done.set()

    def mark_failed(self, room, reason):
        self.calls.append(("mark_failed", room, reason))
        self.done.set()

    def room_live(self, room):
        return self.live

    def notify_taken(self, ip, port, room):
        self.calls.append(("notify_taken", ip, port, room))


def test_a_third_plane_plugs_in_without_touching_the_manager(monkeypatch):
    monkeypatch.setitem(pd_planes.PLANES, "direct", ToyPlane)  # as a new transport would register itself
    host = FakeHost()
    plane = open_data_plane(PDConfig(transport="direct"), None, None, host)
    assert isinstance(plane, ToyPlane) and plane.session_id == "toy"
    chunk = SimpleNamespace(room=5, is_last_chunk=True)
    plane.prefill_send(chunk, np.arange(3))
    assert host.calls == [("conclude_success", 5, None)]
    # the defaults: no bookkeeping, decode done when prefill says Success
    assert not plane.prefill_published(5) and plane.decode_prefill_succeeded(5)
    assert plane.decode_failure_detail(5) is None and plane.leftovers() == {}
    plane.prefill_closed(5, False)
    plane.decode_forget(5, True)


def _buffers(pages: int, page_bytes: int, rows: int, row_bytes: int, fill: int):
    kv = np.full(pages * page_bytes, fill, dtype=np.uint8)
    aux = np.full(rows * row_bytes, fill, dtype=np.uint8)
    layout = BufferLayout(kv_ptrs=(kv.ctypes.data,), kv_lens=(kv.nbytes,), kv_item_lens=(page_bytes,),
                          aux_ptrs=(aux.ctypes.data,), aux_lens=(aux.nbytes,), aux_item_lens=(row_bytes,))
    return kv, aux, layout


def test_a_relay_room_through_the_interface():
    """Prefill writes a room with no decode in sight and concludes; decode reads it into its slots,
    concludes, tells prefill; prefill stops tracking it. One in-process store for both sides."""
    from kvconnect.connectors.registry import create_store

    page, row = 256, 32
    cfg = PDConfig(transport="relay", store={"store": "memory"}, key_bytes=2 * page, poll_interval_s=0.005)
    src_kv, src_aux, src_layout = _buffers(16, page, 4, row, 0)
    src_kv[:] = np.arange(src_kv.size) % 251
    src_aux[:] = 7
    dst_kv, dst_aux, dst_layout = _buffers(16, page, 4, row, 0)
    store = create_store("memory", {})
    pre_host, dec_host = FakeHost(), FakeHost()
    pre = RelayPlane(cfg, src_layout, None, pre_host, relay=StoreRelay(cfg, src_layout, store=store))
    dec = RelayPlane(cfg, dst_layout, None, dec_host, relay=StoreRelay(cfg, dst_layout, store=store))
    dec.start_decode()
    try:
        assert not pre.waits_for_decode and pre.session_id == "10.0.0.1:7000"
        room, src_pages, dst_pages = 42, np.array([3, 4, 5, 9, 10]), np.array([0, 1, 2, 7, 8])
        pre.prefill_open(room, 5)
        pre.prefill_send(SimpleNamespace(room=room, index_slice=slice(0, 3), is_last_chunk=False,
                                         prefill_aux_index=None, state_indices=None), src_pages[:3])
        assert pre_host.calls == []
        pre.prefill_send(SimpleNamespace(room=room, index_slice=slice(3, 5), is_last_chunk=True,
                                         prefill_aux_index=1, state_indices=None), src_pages[3:])
        assert pre_host.calls == [("conclude_success", room, None)]
        assert pre.prefill_published(room) and pre.leftovers()["relay_unread_rooms"] == 1

        infos = [{"rank_ip": pre_host.local_ip, "rank_port": pre_host.rank_port}]
        dec.decode_expect(room, infos, dst_pages, 2, None)
        assert not dec.decode_prefill_succeeded(room)  # the plane concludes the room itself
        assert dec_host.done.wait(5), dec_host.calls
        assert dec_host.calls[0] == ("mark_success", room)
        for s, d in zip(src_pages, dst_pages):
            assert np.array_equal(dst_kv[d * page:(d + 1) * page], src_kv[s * page:(s + 1) * page])
        assert np.all(dst_aux[2 * row:3 * row] == 7) and np.all(dst_aux[:2 * row] == 0)
        end = time.monotonic() + 5
        while ("notify_taken", "10.0.0.1", 7000, room) not in dec_host.calls and time.monotonic() < end:
            time.sleep(0.01)
        assert ("notify_taken", "10.0.0.1", 7000, room) in dec_host.calls
        pre.prefill_taken(room)  # what the manager does with decode's KVC_TAKEN
        assert not pre.prefill_published(room)
        assert {k: v for k, v in dec.leftovers().items() if k != "store_stats"} == \
            {"_relay_out": 0, "_relay_in": 0, "relay_unread_rooms": 0}
    finally:
        dec.close()
        pre.close()
