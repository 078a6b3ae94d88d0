"""The SGLang base classes kvconnect's PD backend builds on, for SGLang 0.5.23 and 0.5.17.

SGLang 0.5.23's ``Common*`` classes carry the request plumbing every transfer backend
shares: the tagged prefill->decode status message and its decoding, ``conclude_transfer``,
``apply_prefill_status``, and ``send``/``poll``/``send_metadata``/``clear`` built on the
backend hooks ``add_transfer_request`` and ``build_receiver_{registration,metadata}_message``.
SGLang 0.5.17's ``Common*`` classes stop short of that: each backend (mooncake, nixl)
writes its own. ``sglang_pd`` is written against the 0.5.23 plumbing; where it is missing
this module supplies it once, as thin subclasses of 0.5.17's ``Common*`` classes, with the
0.5.23 behaviour ``sglang_pd`` relies on (Failed is terminal, ``failure_exception`` raises
the recorded reason). Where SGLang has the plumbing, the bases are SGLang's own classes,
untouched. Detection is by feature (``hasattr``/``getattr``), never by version string.

What 0.5.17 does not have and is not emulated (SGLang features kvconnect does not use):
deferred decode KV release (``ABORT_ACK``; decode frees an aborted room's pages at once,
as 0.5.17 does for every backend), the ``prefill_complete`` allocation policy, staging
buffers and tracing.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as _conn
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)

# 0.5.17 sends the same ABORT frames ([b"ABORT", room, decode_ip, decode_port]) from
# CommonKVReceiver._send_abort_notification, without naming the tag or a parser class.
ABORT_TAG: bytes = getattr(_conn, "ABORT_TAG", b"ABORT")
_AbortNotification = getattr(_conn, "AbortNotification", None)

HAS_COMMON_PLUMBING = hasattr(_conn.CommonKVManager, "conclude_transfer")


def abort_room(msg: List[bytes]) -> Optional[int]:
    """The room of an ABORT control message (None when malformed)."""
    if _AbortNotification is not None:
        note = _AbortNotification.from_zmq(msg)
        return None if note is None else note.room
    try:
        return int(msg[1].decode("ascii"))
    except (IndexError, ValueError, UnicodeDecodeError):
        logger.warning("kvconnect PD: malformed ABORT message %r", msg[:2])
        return None


class _Accepted:
    status_code = 200
    text = "OK"


def recorded_registrations(register: Any) -> List[Tuple[str, Any]]:
    """Run ``register`` (SGLang 0.5.17's ``register_to_bootstrap``, which builds the URL and payload
    and PUTs them inline, five tries in ~15 s and then only an error in the log) with its module's
    ``requests.put`` answered 200 by a recorder; the (url, payload) pairs it would have sent."""
    calls: List[Tuple[str, Any]] = []
    real = _conn.requests

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def put(url: str, json: Any = None, **kwargs: Any) -> _Accepted:
            calls.append((url, json))
            return _Accepted()

    _conn.requests = Recorder()
    try:
        register()
    finally:
        _conn.requests = real
    return calls


if HAS_COMMON_PLUMBING:
    ManagerBase = _conn.CommonKVManager
    SenderBase = _conn.CommonKVSender
    ReceiverBase = _conn.CommonKVReceiver
else:

    class ManagerBase(_conn.CommonKVManager):  # type: ignore[no-redef]
        """0.5.17's CommonKVManager plus the status plumbing of later releases."""

        DEFAULT_PREFILL_FAILURE_REASON = "Failed to get kvcache from prefill instance, it might be dead"

        def register_to_bootstrap(self) -> None:
            """0.5.17 registers inline; 0.5.23 hands URL and payload to ``_register_topology_row``,
            which kvconnect's manager implements with the retries the start-up race needs. Here
            0.5.17's own code builds them (its PUT recorded, not sent) and the hook sends them."""
            hook = getattr(self, "_register_topology_row", None)
            if hook is None:
                super().register_to_bootstrap()
                return
            for url, payload in recorded_registrations(super().register_to_bootstrap):
                hook(url, payload)

        kv_status_msg_tag: Optional[bytes] = None
        kv_status_msg_carries_reason = False

        def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
            # 0.5.17 would let a late Success promote a Failed room (max()), and let any
            # status re-create a cleared room that a later request may reuse.
            current = self.request_status.get(bootstrap_room)
            if current is None:
                if status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                    self.request_status[bootstrap_room] = status
                return
            if status == KVPoll.Failed:
                self.request_status[bootstrap_room] = KVPoll.Failed
            elif current != KVPoll.Failed:
                self.request_status[bootstrap_room] = max(current, status)

        def _room_notify_targets(self, bootstrap_room: int) -> List[Tuple[str, int]]:
            targets: List[Tuple[str, int]] = []
            for info in list((self.transfer_infos.get(bootstrap_room) or {}).values()):
                target = (info.endpoint, info.dst_port)
                if not info.is_dummy and target not in targets:
                    targets.append(target)
            return targets

        def _prefill_unique_rank(self) -> int:
            return (self.attn_tp_rank * (self.pp_size * self.attn_cp_size)
                    + self.pp_rank * self.attn_cp_size + self.attn_cp_rank)

        def parse_kv_status_message(self, msg: List[bytes]) -> Optional[Tuple[int, int, int, Optional[str]]]:
            if self.kv_status_msg_tag is not None:
                if not msg or msg[0] != self.kv_status_msg_tag:
                    return None
                msg = msg[1:]
            try:
                room, status, rank = (int(part.decode("ascii")) for part in msg[:3])
            except (ValueError, UnicodeDecodeError):
                logger.warning("kvconnect PD: dropping an unparsable prefill status message")
                return None
            reason = msg[3].decode("utf-8", errors="replace") if len(msg) > 3 and msg[3] else None
            return room, status, rank, reason

        def send_kv_status_message(self, *, targets: List[Tuple[str, int]], bootstrap_room: int, status: KVPoll,
                                   failure_reason: Optional[str] = None) -> None:
            parts = [str(bootstrap_room).encode("ascii"), str(int(status)).encode("ascii"),
                     str(self._prefill_unique_rank()).encode("ascii")]
            if self.kv_status_msg_carries_reason:
                parts.append((failure_reason or "").encode("utf-8"))
            if self.kv_status_msg_tag is not None:
                parts.insert(0, self.kv_status_msg_tag)
            for endpoint, port in targets or []:
                na = NetworkAddress(endpoint, port)
                try:
                    self._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)
                except Exception as e:  # noqa: BLE001 - decode then fails by its own timeout
                    logger.warning("kvconnect PD: could not send status %s of room %s to %s: %r",
                                   status, bootstrap_room, na.to_tcp(), e)

        def conclude_transfer(self, *, bootstrap_room: int, status: KVPoll,
                              targets: Optional[List[Tuple[str, int]]] = None,
                              failure_reason: Optional[str] = None) -> Optional[KVPoll]:
            if bootstrap_room not in self.request_status:
                return None  # cleared: concluding would re-create it for a later request
            if status == KVPoll.Success:
                with self.failure_lock:
                    recorded = self.failure_records.get(bootstrap_room)
                if recorded is not None:
                    status, failure_reason = KVPoll.Failed, recorded
                elif self.request_status.get(bootstrap_room) == KVPoll.Failed:
                    status = KVPoll.Failed
                    failure_reason = failure_reason or "Room marked Failed before the transfer ended"
            if status == KVPoll.Failed:
                with self.failure_lock:  # keep the first root cause
                    failure_reason = self.failure_records.setdefault(
                        bootstrap_room, failure_reason or "KV transfer failed")
            if targets is None:
                targets = self._room_notify_targets(bootstrap_room)
            self.update_status(bootstrap_room, status)
            self.send_kv_status_message(targets=targets, bootstrap_room=bootstrap_room, status=status,
                                        failure_reason=failure_reason)
            return status

        def conclude_failure(self, *, bootstrap_room: int, failure_reason: str,
                             targets: Optional[List[Tuple[str, int]]] = None) -> Optional[KVPoll]:
            return self.conclude_transfer(bootstrap_room=bootstrap_room, status=KVPoll.Failed, targets=targets,
                                          failure_reason=failure_reason)

        def apply_prefill_status(self, *, bootstrap_room: int, status: int, prefill_rank: int,
                                 failure_reason: Optional[str] = None) -> None:
            if bootstrap_room not in self.request_status:
                return  # late status for a cleared room
            if status == KVPoll.Success:
                done = self.prefill_response_tracker.setdefault(bootstrap_room, set())
                done.add(prefill_rank)
                expected = self.required_prefill_response_num_table.get(bootstrap_room)
                if expected is not None and len(done) >= expected:
                    self.update_status(bootstrap_room, KVPoll.Success)
            elif status == KVPoll.Failed:
                self.record_failure(bootstrap_room, failure_reason or self.DEFAULT_PREFILL_FAILURE_REASON)
                self.update_status(bootstrap_room, KVPoll.Failed)

        def handle_abort_ack_message(self, msg: List[bytes]) -> bool:
            return False  # no deferred decode KV release (ABORT_ACK) in this release

        def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Any:
            return socket.recv_multipart

    class SenderBase(_conn.CommonKVSender):  # type: ignore[no-redef]
        """0.5.17's CommonKVSender plus send/poll/clear/failure_exception of later releases."""

        def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int,
                     req_has_disagg_prefill_dp_rank: bool = False, dest_tp_ranks: Optional[List[int]] = None,
                     pp_rank: Optional[int] = None):
            self._early_send_wait_event: Optional[object] = None  # set by 0.5.17's early-send path
            self._transfer_start_time: Optional[float] = None
            super().__init__(mgr, bootstrap_addr, bootstrap_room,
                             [mgr.attn_tp_rank] if dest_tp_ranks is None else dest_tp_ranks,
                             mgr.pp_rank if pp_rank is None else pp_rank, req_has_disagg_prefill_dp_rank)
            if mgr.request_status.get(bootstrap_room) == KVPoll.Bootstrapping:
                self.init_time = time.time()  # the bootstrap timeout's clock (dummy CP ranks have none)

        def send(self, kv_indices: Any, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None,
                 indices_event: Optional[object] = None) -> None:
            if self.conclude_state in (KVPoll.Success, KVPoll.Failed):
                return
            kv_indices, index_slice, is_last_chunk, skip = self._prepare_send_indices(kv_indices, state_indices)
            if skip:
                return
            if self._transfer_start_time is None:
                self._transfer_start_time = time.perf_counter()
            wait_event, self._early_send_wait_event = self._early_send_wait_event, None
            self.kv_mgr.add_transfer_request(
                self.bootstrap_room, kv_indices, index_slice, is_last_chunk,
                aux_index=self.aux_index if is_last_chunk else None,
                state_indices=state_indices if is_last_chunk else None, num_kv_tokens=num_kv_tokens,
                wait_event=wait_event, indices_event=indices_event)
            self._record_transfer_indices(kv_indices, state_indices)

        def poll(self) -> KVPoll:
            if self.conclude_state is not None:
                return self.conclude_state
            status = self.kv_mgr.request_status.get(self.bootstrap_room, KVPoll.Failed)
            if status == KVPoll.Bootstrapping:
                status = self._check_bootstrap_timeout() or status
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
                if status == KVPoll.Success and self._transfer_start_time is not None \
                        and getattr(self.kv_mgr, "reports_transfer_latency", False):
                    self._transfer_metric.transfer_latency_s = time.perf_counter() - self._transfer_start_time
            return status

        def clear(self) -> None:
            if self.conclude_state is None:
                status = self.kv_mgr.request_status.get(self.bootstrap_room)
                if status in (KVPoll.Success, KVPoll.Failed):
                    self.conclude_state = status
            super().clear()

        def failure_exception(self) -> None:
            _raise_recorded_failure(self)

    class ReceiverBase(_conn.CommonKVReceiver):  # type: ignore[no-redef]
        """0.5.17's CommonKVReceiver plus registration, send_metadata, poll and clear of later releases."""

        def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
            super().__init__(mgr, bootstrap_addr, bootstrap_room)
            mgr.prefill_response_tracker.setdefault(bootstrap_room, set())

        def _register_kv_args(self) -> bool:
            if self.bootstrap_infos is None:
                return False
            message = self.kv_mgr.build_receiver_registration_message()
            return all(self._send_bootstrap_message(info, message, "_register_kv_args")
                       for info in self.bootstrap_infos)

        def _send_bootstrap_message(self, bootstrap_info: Dict, message: List[bytes], operation: str) -> bool:
            import zmq

            try:
                sock, lock = self._connect_to_bootstrap_server(bootstrap_info)
                with lock:
                    sock.send_multipart(message)
            except zmq.ZMQError:
                self.kv_mgr.record_failure(self.bootstrap_room, f"{operation} to prefill {bootstrap_info.get('rank_ip')}:"
                                           f"{bootstrap_info.get('rank_port')} failed")
                self.conclude_state = KVPoll.Failed
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return False
            return True

        def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                          state_indices: Optional[List] = None, decode_prefix_len: Optional[int] = None) -> None:
            if getattr(self, "bootstrap_infos", None) is None:
                self.kv_mgr.record_failure(self.bootstrap_room, "Could not fetch prefill parallel info from "
                                           f"bootstrap_addr: {self.bootstrap_addr}")
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return
            for info in self.bootstrap_infos:
                message = self.kv_mgr.build_receiver_metadata_message(
                    bootstrap_room=self.bootstrap_room, required_dst_info_num=self.required_dst_info_num,
                    kv_indices=kv_indices, aux_index=aux_index, state_indices=state_indices,
                    decode_prefix_len=decode_prefix_len, is_dummy=info["is_dummy"])
                if not self._send_bootstrap_message(info, message, "send_metadata"):
                    return
            self.init_time = time.time()  # the waiting timeout's clock

        def poll(self) -> KVPoll:
            if self.conclude_state is not None:
                return self.conclude_state
            status = self.kv_mgr.check_status(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
            elif status == KVPoll.WaitingForInput:
                timeout = self._check_waiting_timeout()
                if timeout is not None:
                    return timeout
            return status

        def clear(self) -> None:
            self._clear()

        def _clear(self) -> None:
            if self.conclude_state is None:
                status = self.kv_mgr.request_status.get(self.bootstrap_room)
                self.conclude_state = status if status in (KVPoll.Success, KVPoll.Failed) else KVPoll.Failed
            super().clear()
            self.kv_mgr.addr_to_rooms_tracker[self.bootstrap_addr].discard(self.bootstrap_room)

        def failure_exception(self) -> None:
            _raise_recorded_failure(self)

    def _raise_recorded_failure(req: Any) -> None:
        """Later releases' failure_exception: clear the room, raise its recorded root cause."""
        req.conclude_state = KVPoll.Failed
        req.clear()
        with req.kv_mgr.failure_lock:
            reason = req.kv_mgr.failure_records.pop(req.bootstrap_room, None)
        raise _conn.KVTransferError(req.bootstrap_room, reason or "Failed due to an unknown reason from another rank",
                                    is_from_another_rank=reason is None)
