"""The PD role driver: one SGLang PD role (prefill or decode) on CPU, driven the way SGLang's
schedulers drive it, and the store services its relay runs over.

``python -m kvconnect.connectors.testing.pd SPEC.json`` runs one process of a
two-process PD transfer: real SGLang 0.5.23 (or 0.5.17) classes (``ServerArgs`` + ``publish``, the
plugin loader, ``get_kv_class``, ``start_disagg_service``'s bootstrap server, an
``MHATokenToKVPool`` on ``device="cpu"`` standing in for device KV memory, the real
``MetadataBuffers`` as aux rows), and the transfer backend named in the spec (``kvconnect``,
or SGLang's own ``mooncake`` as the benchmark reference). Used by
``tests/integration/test_sglang_pd.py`` and ``benchmarks/pd.py``; ``pair`` starts both roles
in one loopback-only network namespace, ``store_service`` a shared store for the relay.

Page content is a pure function of ``(seed, room, position)``, so decode checks every
byte it received, in exactly the slots it asked for, and that no other slot changed.
The spec is a JSON object (see ``_defaults``); results go to ``spec["result"]`` as JSON.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from kvconnect.connectors.testing.netns import Netns, loopback_ns
from kvconnect.connectors.testing.processes import child_env, import_root

UNTOUCHED = 0xEE  # decode fills its KV pool with this; slots nobody asked for must keep it


def _defaults() -> dict[str, Any]:
    return {
        "role": "prefill", "backend": "kvconnect", "bootstrap_port": 18998, "http_port": 30000,
        "layers": 2, "heads": 2, "head_dim": 16, "page_size": 4, "dtype": "bfloat16", "pool_pages": 512,
        "aux_slots": 128, "rooms": [], "seed": 1, "result": "result.json", "deadline_s": 60.0,
        "stop_file": None, "progress_file": None, "chunk_sleep_s": 0.0, "verify": True, "state": False,
        "aux_room_override": None, "load_plugins": True, "waves": None, "alloc": "random",
        "bootstrap_delay_s": 0.0,
    }


def _view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def page_pattern(seed: int, room: int, npages: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng([seed, room % (1 << 63), 1]).integers(0, 256, (npages, page_bytes), dtype=np.uint8)


def aux_pattern(seed: int, room: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, room % (1 << 63), 2]).integers(0, 256, nbytes, dtype=np.uint8)


def state_pattern(seed: int, room: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng([seed, room % (1 << 63), 3]).integers(0, 256, nbytes, dtype=np.uint8)


def _publish_single_rank(server_args: Any) -> None:
    """Publish this process as the only scheduler rank, without torch.distributed."""
    from sglang.srt import runtime_context as rc

    if hasattr(rc, "SpawnRanks"):  # SGLang 0.5.23: ranks are published with the config
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
        # The only group handle the PD classes read is pp_group (used when pp_size > 1).
        rc.get_parallel().override_permanently(pp_group=None)
        return
    # SGLang 0.5.17 reads ranks from initialised process groups: pin what one rank has.
    rc.publish(server_args, role="scheduler")
    rc.get_parallel()._overrides.update(
        attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, dcp_size=1, dcp_rank=0,
        attn_dp_size=1, attn_dp_rank=0, pp_group=None)
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.layers import dp_attention

    dp_attention._ATTN_DP_SIZE, dp_attention._ATTN_DP_RANK = 1, 0  # CommonKVManager asks dp_attention directly
    conn.get_pp_group = lambda: None  # ... and sglang.srt.distributed for the prefill's pp group


class Node:
    def __init__(self, spec: dict[str, Any]):
        self.spec = {**_defaults(), **spec}
        s = self.spec
        import torch

        if s["load_plugins"]:
            from sglang.srt.plugins import load_plugins

            load_plugins()  # the real loader: our entry point adds the kvconnect backend
        from sglang.srt.disaggregation.utils import KVClassType, MetadataBuffers, TransferBackend, get_kv_class
        from sglang.srt.server_args import ServerArgs

        self.KVClassType, self.get_kv_class = KVClassType, get_kv_class
        if s["backend"] == "mooncake_tcp":  # SGLang's CLI alias: mooncake with the TCP transport forced
            os.environ.setdefault("MC_FORCE_TCP", "1")
            s["backend"] = "mooncake"
        self.server_args = ServerArgs(
            model_path="dummy", device="cpu", host="127.0.0.1", port=s["http_port"],
            disaggregation_mode=s["role"], disaggregation_transfer_backend=s["backend"],
            disaggregation_bootstrap_port=s["bootstrap_port"])
        _publish_single_rank(self.server_args)
        from sglang.srt.runtime_context import get_disagg

        self.backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        dtype = getattr(torch, s["dtype"])
        self.pool = MHATokenToKVPool(s["pool_pages"] * s["page_size"], s["page_size"], dtype, s["heads"],
                                     s["head_dim"], s["layers"], "cpu", False, start_layer=0,
                                     end_layer=s["layers"], enable_alt_stream=False)
        self.meta = MetadataBuffers(s["aux_slots"], hidden_size=32, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)
        kv_ptrs, kv_lens, kv_item_lens = self.pool.get_contiguous_buf_infos()  # what get_kv_transfer_buf_infos returns for MHA
        self.kv = list(zip(kv_ptrs, kv_lens, kv_item_lens))
        self.page_bytes = sum(kv_item_lens)
        aux_ptrs, aux_lens, aux_item_lens = self.meta.get_buf_infos()
        self.aux = list(zip(aux_ptrs, aux_lens, aux_item_lens))
        self.room_col = aux_ptrs.index(self.meta.bootstrap_room.data_ptr())
        kv_args = get_kv_class(self.backend, KVClassType.KVARGS)()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = s["layers"]
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = kv_ptrs, kv_lens, kv_item_lens
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = list(range(s["layers"])) * 2
        kv_args.kv_head_num = s["heads"]
        kv_args.total_kv_head_num = s["heads"]
        kv_args.page_size = s["page_size"]
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = aux_ptrs, aux_lens, aux_item_lens
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        from sglang.srt.disaggregation.base.conn import StateType

        self.state = None
        if s["state"]:  # one index-to-index state component (Mamba-like slots)
            self.state = torch.zeros((64, 96), dtype=torch.uint8)
            kv_args.state_types = [StateType.MAMBA]
            kv_args.state_data_ptrs = [[self.state.data_ptr()]]
            kv_args.state_data_lens = [[self.state.nbytes]]
            kv_args.state_item_lens = [[self.state[0].nbytes]]
            kv_args.state_layer_ids = [[0]]
            kv_args.state_dim_per_tensor = [[96]]
        else:
            kv_args.state_types = []
            kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], []
            kv_args.state_layer_ids, kv_args.state_dim_per_tensor = [], []
        self.kv_args = kv_args
        if s["role"] == "prefill":
            from sglang.srt.managers.disagg_service import start_disagg_service

            # SGLang's own: get_kv_class(..., BOOTSTRAP_SERVER); 0.5.17 takes the ServerArgs, 0.5.23 reads the context
            args = [self.server_args] if inspect.signature(start_disagg_service).parameters else []
            if s["bootstrap_delay_s"]:
                # SGLang starts the bootstrap server in its server process (the tokenizer manager) while
                # the scheduler process builds the manager, which registers with it: the bootstrap
                # server may come up after the manager's first attempts. Here it comes this late, from
                # a thread, while the manager below registers.
                server_class = get_kv_class(self.backend, KVClassType.BOOTSTRAP_SERVER)
                self.bootstrap_server = None

                def late() -> None:
                    time.sleep(s["bootstrap_delay_s"])
                    self.bootstrap_started_t = time.time()
                    self.bootstrap_server = server_class(host="127.0.0.1", port=s["bootstrap_port"])

                threading.Thread(target=late, daemon=True, name="late-bootstrap-server").start()
            else:
                self.bootstrap_server = start_disagg_service(*args)
        else:
            for ptr, n, _ in self.kv:
                _view(ptr, n)[:] = UNTOUCHED
        from sglang.srt.disaggregation.utils import DisaggregationMode

        if self.backend.value == "mooncake":  # the reference: SGLang's own backend needs its shared engine
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                maybe_init_shared_mooncake_transfer_engine,
            )

            extra = {"server_args": self.server_args} if "server_args" in inspect.signature(
                maybe_init_shared_mooncake_transfer_engine).parameters else {}  # 0.5.17 takes them
            maybe_init_shared_mooncake_transfer_engine(gpu_id=0, **extra)
        mode = DisaggregationMode.PREFILL if s["role"] == "prefill" else DisaggregationMode.DECODE
        self.mgr = get_kv_class(self.backend, KVClassType.MANAGER)(kv_args, mode, self.server_args, False)
        self.rng = np.random.default_rng(s["seed"] + (7 if s["role"] == "decode" else 0))
        self.reset_allocator()
        self.relay_rooms: list[tuple[int, int, str, int]] = []
        self.first_wave = True

    # -- helpers -----------------------------------------------------------------
    def reset_allocator(self) -> None:
        """All slots free again (between benchmark waves). ``random`` scatters pages (worst case)."""
        pages = np.arange(1, self.spec["pool_pages"], dtype=np.int64)  # page 0 is SGLang's padding page
        if self.spec["alloc"] == "random":
            pages = self.rng.permutation(pages)
        self.free_pages = list(pages)
        self.free_aux = list(self.rng.permutation(np.arange(self.spec["aux_slots"])))
        self.free_state = list(self.rng.permutation(np.arange(64)))

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self.free_pages):
            raise RuntimeError(f"pool exhausted: need {n} pages, {len(self.free_pages)} free")
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return np.asarray(out, dtype=np.int64)

    def write_pages(self, room: int, pages: np.ndarray) -> None:
        pattern = page_pattern(self.spec["seed"], room, pages.size, self.page_bytes)
        off = 0
        for ptr, n, item in self.kv:
            _view(ptr, n).reshape(-1, item)[pages] = pattern[:, off:off + item]
            off += item

    def check_pages(self, room: int, pages: np.ndarray) -> bool:
        pattern = page_pattern(self.spec["seed"], room, pages.size, self.page_bytes)
        off, ok = 0, True
        for ptr, n, item in self.kv:
            ok &= bool(np.array_equal(_view(ptr, n).reshape(-1, item)[pages], pattern[:, off:off + item]))
            off += item
        return ok

    def untouched_ok(self, used: np.ndarray) -> bool:
        for ptr, n, item in self.kv:
            rows = _view(ptr, n).reshape(-1, item)
            mask = np.ones(rows.shape[0], dtype=bool)  # SGLang pools hold one padding page more
            mask[used] = False
            if not np.all(rows[mask] == UNTOUCHED):
                return False
        return True

    def aux_expected(self, room: int, stamp: int) -> list[np.ndarray]:
        total = sum(item for _, _, item in self.aux)
        pattern, rows, off = aux_pattern(self.spec["seed"], room, total), [], 0
        for j, (_, _, item) in enumerate(self.aux):
            row = pattern[off:off + item].copy()
            if j == self.room_col:
                row[:8] = np.frombuffer(np.uint64(stamp).tobytes(), dtype=np.uint8)
            rows.append(row)
            off += item
        return rows

    def write_aux(self, room: int, slot: int, stamp: int) -> None:
        for (ptr, n, item), row in zip(self.aux, self.aux_expected(room, stamp)):
            _view(ptr, n).reshape(-1, item)[slot] = row

    def check_aux(self, room: int, slot: int) -> bool:
        ok = all(np.array_equal(_view(ptr, n).reshape(-1, item)[slot], row)
                 for (ptr, n, item), row in zip(self.aux, self.aux_expected(room, room)))
        return ok and int(self.meta.bootstrap_room[slot, 0]) == room  # SGLang's own check in pop_transferred

    def _stop_requested(self) -> bool:
        f = self.spec["stop_file"]
        return bool(f) and os.path.exists(f)

    # -- roles ---------------------------------------------------------------------
    def run_prefill(self, rooms: list[dict]) -> dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.spec
        Sender = self.get_kv_class(self.backend, self.KVClassType.SENDER)
        # SGLang 0.5.17's own senders take the scheduler's dest_tp_ranks and pp_rank as well
        extra = {"dest_tp_ranks": [0], "pp_rank": 0} if "dest_tp_ranks" in inspect.signature(Sender).parameters else {}
        reqs = {}
        for r in rooms:
            room = int(r["room"])
            reqs[room] = {"spec": r, "sender": Sender(mgr=self.mgr, bootstrap_addr=f"127.0.0.1:{s['bootstrap_port']}",
                                                      bootstrap_room=room, req_has_disagg_prefill_dp_rank=False,
                                                      **extra),
                          "state": "bootstrap", "sent": 0, "t_first_send": None}
        results: dict[str, Any] = {}
        deadline = time.monotonic() + s["deadline_s"]
        while reqs and time.monotonic() < deadline:
            for room, q in list(reqs.items()):
                snd, r = q["sender"], q["spec"]
                st = int(snd.poll())
                if q["state"] == "bootstrap":
                    if st == KVPoll.Failed:
                        results[str(room)] = self._failure(snd)
                        del reqs[room]
                    elif st == KVPoll.WaitingForInput:
                        npages = int(r["npages"])
                        q["pages"] = self.alloc(npages)
                        self.write_pages(room, q["pages"])
                        q["aux"] = int(self.free_aux.pop())
                        snd.init(npages, q["aux"])
                        q["state"] = "sending"
                    elif st not in (KVPoll.Bootstrapping,):
                        raise RuntimeError(f"room {room}: unexpected poll state {st} before init")
                elif q["state"] == "sending":
                    if st == KVPoll.Failed:
                        results[str(room)] = self._failure(snd)
                        del reqs[room]
                        continue
                    chunk = int(r.get("chunk_pages", 8))
                    lo = q["sent"]
                    hi = min(lo + chunk, q["pages"].size)
                    last = hi == q["pages"].size
                    state_idx = None
                    if last:  # SGLang writes the aux row (metadata_buffers.set_buf) before the last send
                        stamp = r.get("aux_room", room) if s["aux_room_override"] is None else s["aux_room_override"]
                        self.write_aux(room, q["aux"], int(stamp))
                        if self.state is not None:
                            slot = int(self.free_state.pop())
                            self.state[slot] = torch_from(state_pattern(s["seed"], room, self.state.shape[1]))
                            state_idx = [[slot]]
                    if q["t_first_send"] is None:
                        q["t_first_send"] = time.time()
                    if snd.should_send_kv_chunk(hi - lo, last):
                        snd.send(q["pages"][lo:hi].astype(np.int32), state_idx)
                    q["sent"] = hi
                    if s["progress_file"] and lo == 0:
                        open(s["progress_file"], "a").write(f"{room}\n")
                    if last:
                        q["state"] = "inflight"
                    elif r.get("chunk_sleep_s", s["chunk_sleep_s"]):
                        time.sleep(r.get("chunk_sleep_s", s["chunk_sleep_s"]))
                else:
                    if st == KVPoll.Success:
                        results[str(room)] = {"status": "success", "t_first_send": q["t_first_send"],
                                              "t_done": time.time(),
                                              "metric_bytes": snd.get_transfer_metric().transfer_total_bytes}
                        snd.clear()
                        del reqs[room]
                    elif st == KVPoll.Failed:
                        results[str(room)] = self._failure(snd)
                        del reqs[room]
            time.sleep(0.001)
        for room in reqs:
            results[str(room)] = {"status": "stuck", "state": reqs[room]["state"]}
        return results

    def run_decode(self, rooms: list[dict]) -> dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        s = self.spec
        Receiver = self.get_kv_class(self.backend, self.KVClassType.RECEIVER)
        addr = f"127.0.0.1:{s['bootstrap_port']}"
        deadline = time.monotonic() + s["deadline_s"]
        while not self.mgr.try_ensure_parallel_info(addr):  # SGLang: /route with all ranks -1
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefill bootstrap server {addr} never became ready")
            time.sleep(0.2)
        reqs = {}
        for r in rooms:
            room = int(r.get("decode_room", r["room"]))
            rcv = Receiver(mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=room)
            rcv.init(0)
            infos = getattr(rcv, "bootstrap_infos", None)
            if _store_relay(self.mgr) is not None and infos:
                self.relay_rooms.append((room, int(r.get("decode_npages", r["npages"])),
                                         infos[0]["rank_ip"], int(infos[0]["rank_port"])))
            reqs[room] = {"spec": r, "rcv": rcv, "state": "prealloc", "t_created": time.time()}
        results: dict[str, Any] = {}
        used: list[np.ndarray] = []
        while reqs and time.monotonic() < deadline:
            for room, q in list(reqs.items()):
                rcv, r = q["rcv"], q["spec"]
                st = int(rcv.poll())
                if st == KVPoll.Failed:
                    results[str(room)] = {**self._failure(rcv), "t_failed": time.time(), "t_created": q["t_created"]}
                    del reqs[room]
                    continue
                if q["state"] == "prealloc" and st == KVPoll.WaitingForInput:
                    q["pages"] = self.alloc(int(r.get("decode_npages", r["npages"])))
                    used.append(q["pages"])
                    q["aux"] = int(self.free_aux.pop())
                    state_idx = None
                    if self.state is not None:
                        q["state_slot"] = int(self.free_state.pop())
                        state_idx = [[q["state_slot"]]]
                    q["t_send_metadata"] = time.time()
                    rcv.send_metadata(q["pages"].astype(np.int32), q["aux"], state_idx)
                    q["state"] = "waiting"
                elif q["state"] == "waiting" and st == KVPoll.Success:
                    out = {"status": "success", "t_done": time.time(), "t_send_metadata": q["t_send_metadata"]}
                    if s["verify"]:
                        out["pages_ok"] = self.check_pages(room, q["pages"])
                        out["aux_ok"] = self.check_aux(room, q["aux"])
                        if self.state is not None:
                            out["state_ok"] = bool(np.array_equal(
                                self.state[q["state_slot"]].numpy(),
                                state_pattern(s["seed"], room, self.state.shape[1])))
                    rcv.clear()
                    results[str(room)] = out
                    del reqs[room]
            time.sleep(0.001)
        for room in reqs:
            results[str(room)] = {"status": "stuck", "state": reqs[room]["state"]}
        if s["verify"] and self.first_wave:
            results["_untouched_ok"] = self.untouched_ok(np.concatenate(used) if used else np.empty(0, np.int64))
        self.first_wave = False
        return results

    @staticmethod
    def _failure(obj: Any) -> dict[str, Any]:
        try:
            obj.failure_exception()
        except Exception as e:  # noqa: BLE001 - recorded for the test
            return {"status": "failed", "error": f"{type(e).__name__}: {e}", "t_failed": time.time()}
        return {"status": "failed", "error": "failure_exception() did not raise"}

    def leftovers(self) -> dict[str, Any]:
        """What the manager still holds (must be empty once every room concluded)."""
        m = self.mgr
        out = {"request_status": len(m.request_status), "failure_records": len(m.failure_records)}
        if hasattr(m, "transfer_infos"):
            out["transfer_infos"] = len(m.transfer_infos)
        rooms = getattr(m, "prefill_rooms", None)  # kvconnect's prefill manager: its rooms' tables
        if rooms is not None:
            out.update(rooms.leftovers())
        plane = getattr(m, "plane", None)  # kvconnect's manager (SGLang's own backends have none)
        if plane is not None:
            out.update(plane.leftovers())  # the plane's per-room tables (relay: and its store's stats)
        relay = _store_relay(m)
        if self.relay_rooms:  # every key a relayed room could have used, still in the store?
            from kvconnect.connectors.engines.pd_transport import room_namespace

            rooms = []
            counts = [1] * len(m.layout.state_ptrs)  # the driver sends one state item per component
            for room, npages, ip, port in self.relay_rooms:
                ns = room_namespace(m.pd_config.key_prefix, ip, port, room)
                keys = relay.keys(ns, npages, counts)
                rooms.append((relay.room(keys), keys.all()))
            # Cleanup runs in the background (a store may keep a leased key a while): wait for it,
            # bounded, then look once (an exists() probe may itself renew a Mooncake lease).
            end = time.monotonic() + 40
            while not relay.cleaner.idle and time.monotonic() < end:
                time.sleep(0.1)
            out["cleaner_idle"] = relay.cleaner.idle
            from kvconnect.connectors.views import exists_many

            out["store_keys_left"] = sum(sum(found) for found in exists_many(rooms))
        return out


def _store_relay(mgr: Any) -> Any:
    """The ``StoreRelay`` under a kvconnect manager's relay plane, or None (direct, SGLang's own)."""
    return getattr(getattr(mgr, "plane", None), "relay", None)


def torch_from(arr: np.ndarray):  # noqa: ANN201 - small helper
    import torch

    return torch.from_numpy(arr)


def _write_result(path: str, out: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    logging.basicConfig(level=os.environ.get("KVCONNECT_PD_LOGLEVEL", "WARNING"),
                        format=f"[{spec.get('role')}] %(levelname)s %(name)s: %(message)s")
    out: dict[str, Any] = {"role": spec.get("role")}
    try:
        t_start = time.time()
        node = Node(spec)
        out["ready_t"] = time.time()
        out["start_t"] = t_start
        if getattr(node.mgr, "bootstrap_registration", None):  # kvconnect's prefill manager
            out["registration"] = {**node.mgr.bootstrap_registration,
                                   "bootstrap_started_t": getattr(node, "bootstrap_started_t", None)}
        waves = node.spec["waves"] or [node.spec["rooms"]]
        out["waves"] = []
        barrier = node.spec.get("barrier_dir")
        for k, rooms in enumerate(waves):
            flag = None
            if barrier and k and node.spec["role"] == "prefill":
                # wave k starts once decode finished wave k-1 (a relay prefill never waits otherwise)
                flag = os.path.join(barrier, f"decode_done_{k - 1}")
            elif barrier and node.spec["role"] == "decode" and k in node.spec.get("decode_after_prefill", ()):
                flag = os.path.join(barrier, f"prefill_done_{k}")  # decode arrives after prefill finished
            end = time.monotonic() + node.spec["deadline_s"]
            while flag and not os.path.exists(flag) and time.monotonic() < end:
                time.sleep(0.02)
            node.reset_allocator()
            run = node.run_prefill if node.spec["role"] == "prefill" else node.run_decode
            out["waves"].append(run(rooms))
            out["rooms"] = out["waves"][0]
            _write_result(spec["result"], out)  # partial results survive a kill in a later wave
            if barrier:
                open(os.path.join(barrier, f"{node.spec['role']}_done_{k}"), "w").close()
        # Let concluding messages (aborts, late statuses, janitor passes) land before counting.
        time.sleep(float(spec.get("settle_s", 0.5)))
        out["leftovers"] = node.leftovers()
        if node.spec["role"] == "prefill" and node.spec["stop_file"]:
            end = time.monotonic() + node.spec["deadline_s"]
            while not node._stop_requested() and time.monotonic() < end:  # keep /route up for decode
                time.sleep(0.05)
            m = node.mgr
            if _store_relay(m) is not None:  # unread relay rooms expire after retain_s
                end = time.monotonic() + m.pd_config.retain_s + 5
                while m.plane.deadlines.entries and time.monotonic() < end:
                    time.sleep(0.1)
            out["leftovers_at_stop"] = node.leftovers()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    _write_result(spec["result"], out)
    sys.stdout.flush()
    os._exit(0)  # SGLang's daemon threads (bootstrap server, heartbeats) must not keep us alive


# ---------------------------------------------------------------------------------
# Orchestration (tests, benchmarks): both roles in one loopback-only network namespace
# ---------------------------------------------------------------------------------


def plugin_dist_dir(root: str) -> str | None:
    """Where the ``sglang.srt.plugins`` entry point comes from.

    If kvconnect is installed (``pip install -e .``), its own entry point is used and this
    returns None. Otherwise a minimal ``*.dist-info`` carrying pyproject.toml's declaration
    is written under ``root``, for PYTHONPATH: the same metadata pip would install.
    """
    from importlib.metadata import entry_points

    if any(ep.name == "kvconnect" for ep in entry_points(group="sglang.srt.plugins")):
        return None
    import tomllib

    with open(os.path.join(import_root(), "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["sglang.srt.plugins"]
    dist = os.path.join(root, "kvconnect_entrypoints-0.0.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: kvconnect-entrypoints\nVersion: 0.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return root


def node_env(pd_config: dict | None, extra_path: str | None, **env: str) -> dict[str, str]:
    out = child_env()
    out["PYTHONPATH"] = os.pathsep.join(p for p in (import_root(), extra_path, os.environ.get("PYTHONPATH")) if p)
    if pd_config is not None:
        out["KVCONNECT_PD_CONFIG"] = json.dumps(pd_config)
    out.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    # three misses, not two: a prefill starved for two 3 s health timeouts on a loaded 2-core machine
    # must not be declared dead (decode would fail the next wave's rooms); a killed one refuses at once
    out.setdefault("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "3")
    out.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    out.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # the namespace has only loopback
    out.setdefault("LMCACHE_TRACK_USAGE", "false")
    out.update(env)
    return out


class Pair:
    """A prefill and a decode process (``Node``) started in namespace ``ns``."""

    def __init__(self, ns: Netns, workdir: str, common: dict, prefill: dict, decode: dict, env: dict[str, str]):
        self.ns, self.workdir, self.env = ns, workdir, env
        self.stop_file = os.path.join(workdir, "stop")
        self.progress_file = os.path.join(workdir, "progress")
        self.specs = {}
        for role, own in (("prefill", prefill), ("decode", decode)):
            spec = {**common, **own, "role": role, "result": os.path.join(workdir, f"{role}.json"),
                    "barrier_dir": workdir}
            if role == "prefill":
                spec.setdefault("stop_file", self.stop_file)
                spec.setdefault("progress_file", self.progress_file)
            self.specs[role] = spec
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}
        self.role_env: dict[str, dict[str, str]] = {}  # per-role environment overrides

    def start(self, role: str, delay_s: float = 0.0) -> None:
        path = os.path.join(self.workdir, f"{role}.spec.json")
        with open(path, "w") as f:
            json.dump(self.specs[role], f)
        self.logs[role] = os.path.join(self.workdir, f"{role}.log")
        cmd = self.ns.exec_prefix() + [sys.executable, "-m", "kvconnect.connectors.testing.pd", path]
        env = {**self.env, **self.role_env.get(role, {})}
        with open(self.logs[role], "w") as log:
            self.procs[role] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def kill(self, role: str) -> None:
        p = self.procs[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def wait(self, role: str, timeout: float) -> dict[str, Any]:
        try:
            self.procs[role].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(role)
            raise AssertionError(f"{role} did not finish within {timeout}s; log tail:\n{self.tail(role)}")
        return self.result(role)

    def result(self, role: str) -> dict[str, Any]:
        path = self.specs[role]["result"]
        if not os.path.exists(path):
            raise AssertionError(f"{role} wrote no result; log tail:\n{self.tail(role)}")
        with open(path) as f:
            res = json.load(f)
        if res.get("error"):
            raise AssertionError(f"{role} failed: {res['error']}\n{res.get('traceback', '')}\n{self.tail(role)}")
        return res

    def progress(self, role: str) -> str:
        """Each finished wave's room statuses from ``role``'s partial result, for a failure message."""
        try:
            with open(self.specs[role]["result"]) as f:
                res = json.load(f)
        except (OSError, ValueError):
            return f"{role}: no result yet"
        waves = [{k: v.get("status") if isinstance(v, dict) else v for k, v in w.items()}
                 for w in res.get("waves", [])]
        return f"{role}: error={res.get('error')!r} waves={waves}"

    def tail(self, role: str, n: int = 4000) -> str:
        try:
            with open(self.logs[role]) as f:
                return f.read()[-n:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        open(self.stop_file, "w").close()
        for role in list(self.procs):
            try:
                self.procs[role].wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(role)


@contextlib.contextmanager
def pair(common: dict, prefill: dict, decode: dict, pd_config: dict | None, extra_path: str | None,
         ns: Netns | None = None, **env: str):
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcpd-"))
        ns = ns or stack.enter_context(loopback_ns("kvcpd"))
        p = Pair(ns, workdir, common, prefill, decode, node_env(pd_config, extra_path, **env))
        try:
            yield p
        finally:
            for role in list(p.procs):
                if p.procs[role].poll() is None:
                    p.kill(role)


# ---------------------------------------------------------------------------------
# Store services for the relay: ``store_service(name, ...)`` yields ``(netns, store_options,
# outage)`` from the store's test harness (kvconnect.connectors.testing.harness);
# ``outage()`` kills the store's services (master, metadata service) for outage tests.
# ---------------------------------------------------------------------------------


class StoreUnavailable(Exception):
    """The store's service cannot run here (reason in the message)."""


@contextlib.contextmanager
def store_service(name: str, workdir: str, ns: Netns | None = None,
                  segment: str = "1gb") -> Iterator[tuple[Netns, dict, Callable[[], None]]]:
    """Store ``name`` as its test harness runs it, in its first configuration that claims
    ``shared`` (the relay's need), its services holding ``segment`` bytes, inside ``ns`` (a
    loopback-only namespace made here if None): (netns, store options, outage)."""
    from pathlib import Path

    from kvconnect.connectors.base import Capability
    from kvconnect.connectors.config import parse_size
    from kvconnect.connectors.testing.harness import harness_class

    cls = harness_class(name)
    why = cls.skip_reason()
    if why:
        raise StoreUnavailable(why)
    with contextlib.ExitStack() as stack:
        ns = ns or stack.enter_context(loopback_ns("kvcpd"))
        for variant in cls.variants:
            harness = cls(Path(workdir) / f"{name}{variant}", variant, netns=ns, capacity=parse_size(segment))
            try:
                harness.start()
            except (RuntimeError, TimeoutError) as e:
                raise StoreUnavailable(f"{name} services did not start: {e}") from e
            stack.callback(harness.stop)
            if Capability.SHARED in harness.claims:
                opts = dict(harness.options(0))
                opts.pop("store")
                yield ns, opts, harness.outage
                return
        raise StoreUnavailable(f"no configuration of {name}'s harness claims shared")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
