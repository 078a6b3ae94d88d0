"""kvconnect as an SGLang PD-disaggregation transfer backend (``--disaggregation-transfer-backend kvconnect``).

Registered by the ``sglang.srt.plugins`` entry point (``kvconnect.connectors.engines.sglang_pd_plugin``).
The classes build on SGLang's ``Common*`` classes, so the bootstrap server, its ``/route``
protocol, the request state machine (``KVPoll``), timeouts, heartbeats, abort notifications
and ``failure_exception`` are SGLang's own; kvconnect supplies the control messages between
one prefill rank and one decode rank and the data plane chosen by ``KVCONNECT_PD_CONFIG``
(a ``DataPlane`` strategy, ``kvconnect.connectors.engines.pd_planes``: the manager calls
its hooks and never asks which transport it has):

* ``direct``: decode registers its KV/aux/state buffers with prefill over ZMQ; prefill
  writes each chunk's pages one-sided into the slots decode pre-allocated (Transfer Engine),
  then the aux row, then tells decode ``Success``.
* ``relay`` (over any store with the ``shared`` capability): prefill does not wait for
  decode at all. It writes each chunk's pages into the store under the room's key space,
  then the aux row and a completion marker, then reports ``Success`` (the KV is in the
  store, its pages can be freed). Decode, whenever its request arrives, waits for the
  marker and reads the keys straight into its slots, then deletes them. Prefill deletes a
  room's keys after a failure and, if decode never took them, ``retain_s`` after publishing.

The ``Common*`` plumbing named above is SGLang 0.5.23's; on releases without it (0.5.17)
``kvconnect.connectors.engines.sglang_pd_compat`` supplies it, so this module is written once.

Supported topology: prefill and decode with the same attention TP, CP and PP sizes (any
such size; MLA, MHA and index-to-index state components). Other shapes fail the request
with a message saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional

import msgspec
import numpy as np

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
from sglang.srt.disaggregation.common.utils import FastQueue
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from kvconnect.connectors.auth import token_matches
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.pd_planes import DataPlane, open_data_plane
from kvconnect.connectors.engines.pd_transport import (
    ENV_CONFIG,
    BufferLayout,
    PDConfig,
    TransferFailed,
    load_pd_config,
    kv_dtype_tag,
)
from kvconnect.connectors.engines.common import RateLimitedLog
from kvconnect.connectors.engines.sglang_pd_compat import ABORT_TAG, ManagerBase, ReceiverBase, SenderBase, abort_room

logger = logging.getLogger(__name__)
_rate_limited = RateLimitedLog(logger, interval_s=10.0)

REG_TAG = b"KVC_REG"  # decode -> prefill: a decode rank's buffers (once per prefill rank)
META_TAG = b"KVC_META"  # decode -> prefill: one room's destination pages and aux row
STATUS_TAG = b"KVC_STATUS"  # prefill -> decode: [tag, room, status, prefill_rank, reason]
TAKEN_TAG = b"KVC_TAKEN"  # decode -> prefill: relay keys of a room were read (prefill stops tracking them)

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


@dataclasses.dataclass
class DecodeRegistration:
    session: str
    endpoint: str
    port: int
    kv_ptrs: List[int]
    kv_item_lens: List[int]
    aux_ptrs: List[int]
    aux_item_lens: List[int]
    state_ptrs: List[List[int]]
    state_item_lens: List[List[int]]
    tp_rank: int
    attn_tp_size: int
    rejection: Optional[str] = None


@dataclasses.dataclass
class TransferInfo:
    """One decode rank's destinations for one room (field names as SGLang's Common* read them)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    dst_kv_indices: np.ndarray
    dst_aux_index: Optional[int]
    dst_state_indices: List[List[int]]
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: Optional[int] = None


@dataclasses.dataclass
class TransferChunk:
    """One chunk queued for a transfer worker (SGLang's TransferKVChunk has no event fields before 0.5.23)."""

    room: int
    prefill_kv_indices: Any
    index_slice: slice
    is_last_chunk: bool
    prefill_aux_index: Optional[int]
    state_indices: Optional[List]
    num_kv_tokens: Optional[int] = None
    wait_event: Any = None
    indices_event: Any = None


class KVConnectKVManager(ManagerBase):
    """One per scheduler process: SGLang's control plane plus a kvconnect data plane.

    The protocol layer, the same for every transport: where the transports differ it calls
    the ``DataPlane`` (``pd_planes``) and never asks which one it has. It is the planes'
    ``PlaneHost`` and SGLang's manager (its hooks and request state); the jobs of one side
    are objects of their own: on prefill ``prefill_rooms`` (``PrefillRooms``: decode's control
    messages and the rooms they open or orphan) and ``transfers`` (``TransferWorkers``: each
    room's chunks, in order, to the plane); the bootstrap registration is
    ``register_with_bootstrap``.
    """

    kv_status_msg_tag = STATUS_TAG
    kv_status_msg_carries_reason = True
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False, **kwargs: Any):
        # Parse the config first: a bad KVCONNECT_PD_CONFIG fails startup, naming the key.
        self.pd_config: PDConfig = load_pd_config(os.environ.get(ENV_CONFIG))
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        cfg = self.pd_config
        self.layout = BufferLayout.from_kv_args(args)
        self._stopped = False
        self._threads: List[threading.Thread] = []
        self.context = EngineContext(
            engine="sglang-pd", tp_rank=int(getattr(self, "attn_tp_rank", 0) or 0),
            tp_size=int(getattr(self, "attn_tp_size", 1) or 1), pp_rank=int(getattr(self, "pp_rank", 0) or 0),
            pp_size=int(getattr(self, "pp_size", 1) or 1), dp_rank=int(getattr(self, "attn_dp_rank", 0) or 0),
            rank_replicated=bool(is_mla_backend), page_bytes=max(1, self.layout.page_bytes), device=_kv_device())
        # One interface; which data plane is the config's, never the store's.
        self.plane: DataPlane = open_data_plane(cfg, self.layout, self.context, self)
        self.session_id = self.plane.session_id
        if disaggregation_mode == DisaggregationMode.PREFILL:
            if cfg.timeout_s is not None:
                self.bootstrap_timeout = cfg.timeout_s
            self.prefill_rooms = PrefillRooms(self)
            self.transfers = TransferWorkers(self, cfg.workers)
            self.transfer_queues = self.transfers.queues  # SGLang's Common* size buffers by it
            for q in self.transfer_queues:
                self._spawn("_transfer_worker", self.transfers.run, q)
            self._spawn("_prefill_control_loop", self.prefill_rooms.control_loop)
            self._spawn("_prefill_janitor", self.prefill_rooms.janitor)
            self.plane.start_prefill()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            if cfg.timeout_s is not None:
                self.waiting_timeout = cfg.timeout_s
            self._spawn("_decode_control_loop", self._decode_control_loop)
            heartbeat = self._start_heartbeat_checker_thread()  # 0.5.17 returns None (its thread never stops)
            if heartbeat is not None:
                self._threads.append(heartbeat)
            self.plane.start_decode()

    def _spawn(self, name: str, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=f"kvconnect-pd-{name}")
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Stop worker threads and release the data plane (tests)."""
        self._stopped = True
        transfers = getattr(self, "transfers", None)
        if transfers is not None:
            transfers.stop()
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()
        self.plane.close()

    def _register_topology_row(self, url: str, payload: Dict) -> None:
        """Prefill: register this rank with the bootstrap server (SGLang 0.5.23's hook, called by
        ``register_to_bootstrap`` from ``__init__``), retried until accepted
        (``register_with_bootstrap``, within ``register_timeout_s``)."""
        self.bootstrap_registration = register_with_bootstrap(url, payload, self.pd_config.register_timeout_s)

    # =============================================================================
    # Decode side: messages to prefill
    # =============================================================================
    def build_receiver_registration_message(self) -> List[bytes]:
        layout = self.layout
        return [REG_TAG, _encode({
            "session": self.session_id, "endpoint": self.local_ip, "port": self.rank_port,
            "kv_ptrs": list(layout.kv_ptrs), "kv_item_lens": list(layout.kv_item_lens),
            "aux_ptrs": list(layout.aux_ptrs), "aux_item_lens": list(layout.aux_item_lens),
            "state_ptrs": [list(c) for c in layout.state_ptrs],
            "state_item_lens": [list(c) for c in layout.state_item_lens],
            "tp_rank": int(self.kv_args.engine_rank), "attn_tp_size": int(self.attn_tp_size),
            "token": self.pd_config.auth_token or "",
        })]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: Any, aux_index: Optional[int], state_indices: Optional[List],
                                        decode_prefix_len: Optional[int], is_dummy: bool, **kwargs: Any) -> List[bytes]:
        return [META_TAG, _encode({
            "room": int(bootstrap_room), "endpoint": self.local_ip, "port": self.rank_port,
            "session": self.session_id,
            "kv": b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
            "aux": None if is_dummy or aux_index is None else int(aux_index),
            "state": [] if is_dummy or not state_indices else [
                None if s is None else [int(x) for x in np.asarray(s).ravel()] for s in state_indices],
            "required": int(required_dst_info_num), "prefix": int(decode_prefix_len or 0),
            "dummy": bool(is_dummy), "token": self.pd_config.auth_token or "",
        })]

    # =============================================================================
    # Prefill side: SGLang's calls, to the objects that do the work
    # =============================================================================
    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                             num_kv_tokens: Optional[int] = None, **kwargs: Any) -> None:
        self.transfers.add(bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index, state_indices,
                           num_kv_tokens, **kwargs)

    def sender_opened(self, room: int) -> None:
        self.prefill_rooms.sender_opened(room)

    def sender_closed(self, room: int, succeeded: bool) -> None:
        self.prefill_rooms.sender_closed(room, succeeded)

    # =============================================================================
    # PlaneHost: what the data plane may ask of the protocol layer
    # =============================================================================
    def kv_dtype_tag(self) -> str:
        """This side's KV dtype in its room namespaces: a pair of another dtype shares no room."""
        return kv_dtype_tag(getattr(self.kv_args, "kv_cache_dtype_str", None))

    def room_destinations(self, room: int) -> Optional[dict]:
        return self.transfer_infos.get(room)

    def decode_registration(self, session: str) -> Any:
        return self.decode_kv_args_table.get(session)

    def conclude_success(self, room: int, targets: Optional[list] = None) -> None:
        self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets)

    def mark_success(self, room: int) -> None:
        self.update_status(room, KVPoll.Success)

    def mark_failed(self, room: int, reason: str) -> None:
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def room_live(self, room: int) -> bool:
        return self.request_status.get(room) not in (None, KVPoll.Failed)

    def notify_taken(self, prefill_ip: str, prefill_port: int, room: int) -> None:
        self._send_multipart_locked(NetworkAddress(prefill_ip, prefill_port).to_tcp(),
                                    [TAKEN_TAG, str(room).encode("ascii")])

    # =============================================================================
    # Decode side: status from prefill
    # =============================================================================
    def _decode_control_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            msg = recv()
            if not msg:
                continue
            try:
                if self.handle_abort_ack_message(msg):
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is None:
                    continue
                room, status, prefill_rank, reason = parsed
                if status == KVPoll.Success and not self.plane.decode_prefill_succeeded(room):
                    continue  # the plane still has work (relay: read the store) and concludes the room
                self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                          failure_reason=reason)
            except Exception:  # noqa: BLE001
                logger.exception("kvconnect PD: failed to handle a status message")


class PrefillRooms:
    """Prefill side: decode's control messages (registrations, room destinations, aborts,
    taken notices), the rooms with a live sender, and the janitor that fails the rooms decode
    named but this prefill never got."""

    def __init__(self, mgr: "KVConnectKVManager"):
        self.mgr = mgr
        self.live_senders: set = set()
        self.meta_seen: Dict[int, float] = {}  # room -> when decode's destinations first came

    def leftovers(self) -> Dict[str, int]:
        return {"_meta_seen": len(self.meta_seen), "_live_senders": len(self.live_senders)}

    def control_loop(self) -> None:
        """Decode's registrations, room destinations, aborts and taken notices, as they come."""
        m = self.mgr
        recv = m._make_worker_recv(m.server_socket)
        while not m._stopped:
            msg = recv()
            if not msg:
                continue
            try:
                if msg[0] == ABORT_TAG:
                    self._on_abort(msg)
                elif msg[0] in (REG_TAG, META_TAG):
                    d = _decode(msg[1])
                    if not token_matches(m.pd_config.auth_token, d.get("token")):
                        _rate_limited.warning("auth", "kvconnect PD: rejected a %s message from %s:%s: wrong or "
                                              "missing auth_token", msg[0].decode(), d.get("endpoint"), d.get("port"))
                        continue
                    (self._on_registration if msg[0] == REG_TAG else self._on_metadata)(d)
                elif msg[0] == TAKEN_TAG:
                    m.plane.prefill_taken(int(msg[1]))
                else:
                    logger.warning("kvconnect PD: dropping unknown control message %r", msg[0][:16])
            except Exception:  # noqa: BLE001 - one bad message must not stop the control thread
                logger.exception("kvconnect PD: failed to handle a control message")

    def _on_registration(self, d: dict) -> None:
        m = self.mgr
        reg = DecodeRegistration(
            session=d["session"], endpoint=d["endpoint"], port=int(d["port"]), kv_ptrs=d["kv_ptrs"],
            kv_item_lens=d["kv_item_lens"], aux_ptrs=d["aux_ptrs"], aux_item_lens=d["aux_item_lens"],
            state_ptrs=d["state_ptrs"], state_item_lens=d["state_item_lens"], tp_rank=d["tp_rank"],
            attn_tp_size=d["attn_tp_size"])
        mine = m.layout
        if tuple(reg.kv_item_lens) != mine.kv_item_lens:
            reg.rejection = (f"KV layout mismatch with decode {reg.session}: prefill has {len(mine.kv_item_lens)} "
                             f"buffers of page sizes {sorted(set(mine.kv_item_lens))}, decode "
                             f"{len(reg.kv_item_lens)} of {sorted(set(reg.kv_item_lens))}")
        elif tuple(reg.aux_item_lens) != mine.aux_item_lens:
            reg.rejection = (f"aux (metadata) buffer mismatch with decode {reg.session}: prefill rows "
                             f"{list(mine.aux_item_lens)}, decode rows {reg.aux_item_lens}")
        elif reg.attn_tp_size != m.attn_tp_size:
            reg.rejection = (f"kvconnect PD needs equal attention TP on prefill ({m.attn_tp_size}) and "
                             f"decode ({reg.attn_tp_size})")
        if reg.rejection:
            logger.error("kvconnect PD: %s", reg.rejection)
        m.decode_kv_args_table[reg.session] = reg

    def _on_metadata(self, d: dict) -> None:
        m = self.mgr
        room = int(d["room"])
        info = TransferInfo(
            room=room, endpoint=d["endpoint"], dst_port=int(d["port"]), session=d["session"],
            dst_kv_indices=np.frombuffer(d["kv"], dtype=np.int32), dst_aux_index=d["aux"],
            dst_state_indices=d["state"], required_dst_info_num=int(d["required"]), is_dummy=bool(d["dummy"]),
            decode_prefix_len=int(d["prefix"]))
        if m.plane.prefill_published(room):
            return  # already on decode's side without destinations (relay: decode reads the store)
        status = m.request_status.get(room)
        if status in (KVPoll.Failed, KVPoll.Success) and room in self.live_senders:
            if status == KVPoll.Failed:  # decode asked after we gave up: tell it now, not at its timeout
                with m.failure_lock:
                    reason = m.failure_records.get(room, "prefill failed this request")
                m.send_kv_status_message(targets=[(info.endpoint, info.dst_port)], bootstrap_room=room,
                                         status=KVPoll.Failed, failure_reason=reason)
            return
        self.meta_seen.setdefault(room, time.monotonic())
        infos = m.transfer_infos.setdefault(room, {})
        infos[info.session] = info
        if len(infos) == info.required_dst_info_num:
            m.resolve_kv_replica_factor(infos)
            m.req_to_decode_prefix_len[room] = next(
                (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len is not None), 0)
            m.update_status(room, KVPoll.WaitingForInput)

    def _on_abort(self, msg: List[bytes]) -> None:
        m = self.mgr
        room = abort_room(msg)
        if room is None:
            return
        status = m.request_status.get(room)
        if status is not None and status != KVPoll.Success:
            m.record_failure(room, "decode aborted the request")
            m.update_status(room, KVPoll.Failed)
        m.plane.prefill_discard(room)

    def sender_opened(self, room: int) -> None:
        self.live_senders.add(room)

    def sender_closed(self, room: int, succeeded: bool) -> None:
        m = self.mgr
        self.live_senders.discard(room)
        self.meta_seen.pop(room, None)
        m.plane.prefill_closed(room, succeeded)

    def janitor(self) -> None:
        """Bounded cleanup: the plane's (relay: unread keys), and decode destinations for rooms prefill never saw."""
        m = self.mgr
        while not m._stopped:
            time.sleep(0.2)
            try:
                m.plane.prefill_tick()
                now = time.monotonic()
                # Decode's destinations for a room this prefill never got: normally the gap is
                # milliseconds (the router posts to both at once). Answer well inside decode's
                # own timeout so it fails with the real reason, not a bare timeout.
                orphan_after = m.bootstrap_timeout / 2
                for room, seen in list(self.meta_seen.items()):
                    if room in self.live_senders or now - seen < orphan_after:
                        continue
                    self.meta_seen.pop(room, None)
                    targets = m._room_notify_targets(room)
                    m.transfer_infos.pop(room, None)
                    m.req_to_decode_prefix_len.pop(room, None)
                    m.request_status.pop(room, None)
                    with m.failure_lock:
                        m.failure_records.pop(room, None)
                    m.send_kv_status_message(
                        targets=targets, bootstrap_room=room, status=KVPoll.Failed,
                        failure_reason=(f"room mismatch: prefill {m.local_ip}:{m.rank_port} has no request "
                                        f"with bootstrap_room {room} (waited {orphan_after:.1f}s)"))
            except Exception:  # noqa: BLE001
                logger.exception("kvconnect PD: janitor pass failed")


class TransferWorkers:
    """Prefill side: the chunks SGLang hands over, in order per room (one room, one queue), to
    the data plane on ``workers`` threads; a failed chunk fails its request."""

    def __init__(self, mgr: "KVConnectKVManager", workers: int):
        self.mgr = mgr
        self.queues = [FastQueue() for _ in range(workers)]

    def stop(self) -> None:
        for q in self.queues:
            q.put(None)

    def add(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
            aux_index: Optional[int] = None, state_indices: Optional[List] = None,
            num_kv_tokens: Optional[int] = None, **kwargs: Any) -> None:
        m = self.mgr
        if bootstrap_room not in m.request_status or m.check_status(bootstrap_room) == KVPoll.Failed:
            return
        queue = self.queues[bootstrap_room % len(self.queues)]  # one room, one queue: in order
        queue.put(TransferChunk(
            room=bootstrap_room, prefill_kv_indices=kv_indices, index_slice=index_slice,
            is_last_chunk=is_last_chunk, prefill_aux_index=aux_index, state_indices=state_indices,
            num_kv_tokens=num_kv_tokens, wait_event=kwargs.get("wait_event"),
            indices_event=kwargs.get("indices_event")))

    def run(self, queue: FastQueue) -> None:
        """One worker: the chunks of its queue until ``stop``."""
        m = self.mgr
        while not m._stopped:
            chunk = queue.get()
            if chunk is None:
                return
            room = chunk.room
            try:
                if room not in m.request_status or m.check_status(room) == KVPoll.Failed:
                    m.plane.prefill_discard(room)
                    continue
                for event in (chunk.wait_event, chunk.indices_event):
                    if event is not None:  # GPU: the forward pass / index copy must finish first
                        event.synchronize()
                pages = chunk.prefill_kv_indices
                if hasattr(pages, "cpu"):
                    pages = pages.cpu().numpy()
                pages = np.asarray(pages, dtype=np.int64)
                m.plane.prefill_send(chunk, pages)
            except TransferFailed as e:
                m.conclude_failure(bootstrap_room=room, failure_reason=f"kvconnect {m.pd_config.transport}: {e}")
                m.plane.prefill_discard(room)
            except Exception as e:  # noqa: BLE001 - fail the request, keep the worker alive
                logger.exception("kvconnect PD: transfer of room %s crashed", room)
                m.conclude_failure(bootstrap_room=room, failure_reason=f"kvconnect transfer error: {e!r}")
                m.plane.prefill_discard(room)


def register_with_bootstrap(url: str, payload: Dict, bound: float) -> Dict[str, float]:
    """Prefill: put this rank's ``payload`` to the bootstrap server at ``url``, retried until
    accepted for ``bound`` seconds; how many attempts and how long it took.

    SGLang's server process starts the bootstrap server (its tokenizer manager) while the
    scheduler process builds this manager; either may come first. SGLang tries five times
    in about 15 s, then logs an error and goes on: a bootstrap server that came up later
    never learns of this rank, answers decode's ``/route`` with 503 for ever, and every
    request fails while both servers report healthy. Here a refused connection or a
    non-200 answer is retried every 0.25-2 s for ``register_timeout_s``; then, or at once
    on HTTP 400 (the server's verdict on an inconsistent layout), the scheduler fails at
    start naming the URL.
    """
    import requests

    t0, attempts, last = time.monotonic(), 0, ""
    while True:
        attempts += 1
        try:
            response = requests.put(url, json=payload, timeout=5)
            if response.status_code == 200:
                if attempts > 1:
                    logger.info("kvconnect PD: registered with the bootstrap server %s after %d attempts "
                                "in %.1f s", url, attempts, time.monotonic() - t0)
                return {"attempts": attempts, "waited_s": time.monotonic() - t0}
            last = f"HTTP {response.status_code}: {response.text.strip()[:300]}"
            if response.status_code == 400:
                break
        except requests.RequestException as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 >= bound:
            break
        time.sleep(min(0.25 * 2 ** min(attempts - 1, 3), 2.0))
    raise RuntimeError(f"kvconnect PD: prefill could not register with the bootstrap server {url} "
                       f"({attempts} attempts in {time.monotonic() - t0:.1f} s; register_timeout_s={bound:g}); "
                       f"last answer: {last}")


class KVConnectKVSender(SenderBase):
    """Prefill side of one request."""

    def __init__(self, mgr: KVConnectKVManager, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any):
        # 0.5.23 passes req_has_disagg_prefill_dp_rank; older releases dest_tp_ranks, pp_rank.
        has_dp = kwargs.pop("req_has_disagg_prefill_dp_rank", False)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=has_dp)
        mgr.sender_opened(bootstrap_room)
        if not mgr.plane.waits_for_decode and self.conclude_state is None:
            # The plane needs nothing from decode (relay): compute and publish right away.
            mgr.update_status(bootstrap_room, KVPoll.WaitingForInput)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
        super().init(num_kv_indices, aux_index)
        self.kv_mgr.plane.prefill_open(self.bootstrap_room, num_kv_indices)

    def send(self, kv_indices: Any, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None,
             *args: Any, **kwargs: Any) -> None:
        super().send(kv_indices, state_indices=state_indices, num_kv_tokens=num_kv_tokens,
                     indices_event=kwargs.get("indices_event"))

    def clear(self) -> None:
        room = self.bootstrap_room
        succeeded = self.kv_mgr.request_status.get(room) == KVPoll.Success or self.conclude_state == KVPoll.Success
        super().clear()
        self.kv_mgr.sender_closed(room, succeeded)


class KVConnectKVReceiver(ReceiverBase):
    """Decode side of one request."""

    def __init__(self, mgr: KVConnectKVManager, bootstrap_addr: Any, bootstrap_room: Optional[int] = None,
                 *args: Any, **kwargs: Any):
        super().__init__(mgr, str(bootstrap_addr), bootstrap_room)

    def init(self, prefill_dp_rank: int = 0, *args: Any, **kwargs: Any) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or getattr(self, "prefill_info", None) is None:
            return
        info, mgr = self.prefill_info, self.kv_mgr
        reason = None
        if info.attn_tp_size != mgr.attn_tp_size or info.pp_size != mgr.pp_size or info.attn_cp_size != 1:
            reason = (f"kvconnect PD supports equal attention TP/PP and CP=1 on both sides; prefill has "
                      f"tp={info.attn_tp_size} pp={info.pp_size} cp={info.attn_cp_size}, decode "
                      f"tp={mgr.attn_tp_size} pp={mgr.pp_size}")
        elif not self.bootstrap_infos or len(self.bootstrap_infos) != 1:
            reason = f"kvconnect PD expected one prefill rank per decode rank, got {len(self.bootstrap_infos or [])}"
        if reason:
            mgr.record_failure(self.bootstrap_room, reason)
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
        mgr = self.kv_mgr
        super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
        if self.conclude_state == KVPoll.Failed:
            return
        if mgr.request_status.get(self.bootstrap_room) == KVPoll.Failed:
            return
        mgr.plane.decode_expect(self.bootstrap_room, self.bootstrap_infos, kv_indices, aux_index, state_indices)

    def _check_waiting_timeout(self) -> Optional[int]:
        result = super()._check_waiting_timeout()
        if result == KVPoll.Failed:
            detail = self.kv_mgr.plane.decode_failure_detail(self.bootstrap_room)
            if detail:
                with self.kv_mgr.failure_lock:
                    base = self.kv_mgr.failure_records.get(self.bootstrap_room, "timed out")
                self.kv_mgr.record_failure(self.bootstrap_room, f"{base}; last {self.kv_mgr.pd_config.transport} "
                                           f"error: {detail}")
        return result

    def _clear(self) -> None:
        room = self.bootstrap_room
        succeeded = self.kv_mgr.request_status.get(room) == KVPoll.Success or self.conclude_state == KVPoll.Success
        super()._clear()
        if room is not None:
            self.kv_mgr.plane.decode_forget(room, succeeded)


class KVConnectKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, its ``/route`` unchanged (router, Rust registry), listening
    before its constructor returns.

    SGLang's starts its server thread and returns at once; a port that thread cannot bind is
    only logged there, and the prefill server then runs healthy without a bootstrap server
    (every decode request waits on a route that never comes). Here the constructor waits until
    the socket listens and raises, naming the address, if the thread died first.
    """

    listen_timeout_s = 60.0

    def run(self) -> None:
        super().run()
        end = time.monotonic() + self.listen_timeout_s
        while True:
            runner = getattr(self, "_runner", None)
            if runner is not None and runner.addresses:
                return
            if not self.thread.is_alive():
                raise RuntimeError(f"kvconnect PD: the bootstrap server could not listen on {self.host}:{self.port} "
                                   "(SGLang logged why above; another process may hold the port)")
            if time.monotonic() > end:
                raise RuntimeError(f"kvconnect PD: the bootstrap server on {self.host}:{self.port} was not "
                                   f"listening after {self.listen_timeout_s:.0f} s")
            time.sleep(0.01)


def _kv_device() -> str:
    """The device SGLang's KV lives on (``cpu`` or a GPU kind): where the data plane reads
    and writes pages."""
    try:
        from sglang.srt.runtime_context import get_device

        return str(get_device().device or "cpu")
    except Exception:  # noqa: BLE001 - releases without it run on GPUs
        return "cuda"


KV_CLASSES = {
    "manager": KVConnectKVManager,
    "sender": KVConnectKVSender,
    "receiver": KVConnectKVReceiver,
    "bootstrap_server": KVConnectKVBootstrapServer,
}
