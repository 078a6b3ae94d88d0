"""The PD data planes as a strategy: everything that differs between ``direct`` and ``relay``.

``KVConnectKVManager`` (``kvconnect.connectors.engines.sglang_pd``) is the protocol layer:
SGLang's bootstrap, control messages, the request state machine, timeouts and aborts, the
same for every transport. It never asks which transport it has; at each point where the two
differ it calls one method of ``DataPlane`` (``open_data_plane`` picks the implementation
from ``KVCONNECT_PD_CONFIG``). A plane reaches back into the protocol layer only through
``PlaneHost``, so a third plane (or SGLang's own per-backend transports) plugs in by
implementing the interface, with no edit to the manager. No SGLang imports here.

* ``DirectPlane``: prefill waits for decode's destinations and writes pages one-sided into
  them (Transfer Engine); decode is done when prefill says ``Success``.
* ``RelayPlane``: prefill writes each room into a shared store (``StoreRelay``) with no
  decode in sight and concludes at once; decode waits for the room's marker, reads the keys
  into its slots, and tells prefill it took them. Keys are deleted after success, failure,
  abort, or ``retain_s`` after publishing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, ClassVar, Optional, Protocol, Sequence

import numpy as np

from kvconnect.connectors import transfer_engine
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.pd_transport import (
    BufferLayout,
    Deadlines,
    PDConfig,
    RelayKeys,
    RoomMismatch,
    StoreRelay,
    TransferFailed,
    aux_blocks,
    kv_blocks,
    room_namespace,
    state_blocks,
)

logger = logging.getLogger(__name__)


class PlaneHost(Protocol):
    """What a data plane may ask of the protocol layer (SGLang: ``KVConnectKVManager``)."""

    local_ip: str
    rank_port: int

    def kv_dtype_tag(self) -> str:
        """This side's KV dtype, as it appears in room namespaces."""

    def room_destinations(self, room: int) -> Optional[dict]:
        """Prefill: decode's destinations for ``room`` (session -> ``TransferInfo``), if any came."""

    def decode_registration(self, session: str) -> Any:
        """Prefill: a decode rank's registered buffers (``DecodeRegistration``), or None."""

    def conclude_success(self, room: int, targets: Optional[list] = None) -> None:
        """Prefill: the room's bytes are where decode will find them; tell ``targets`` (None: every
        decode rank that sent destinations)."""

    def mark_success(self, room: int) -> None:
        """The room is done on this side, nobody to tell."""

    def mark_failed(self, room: int, reason: str) -> None:
        """Fail the room on this side with ``reason``."""

    def room_live(self, room: int) -> bool:
        """The room is still wanted (known and not failed)."""

    def notify_taken(self, prefill_ip: str, prefill_port: int, room: int) -> None:
        """Decode: tell prefill the room's relay keys were read (it stops tracking them)."""


class DataPlane:
    """How a room's bytes move from prefill to decode (one per SGLang process).

    Every hook the protocol layer calls is here; the defaults are what a plane that needs no
    per-room bookkeeping does (``DirectPlane`` keeps most of them).
    """

    waits_for_decode: ClassVar[bool] = True
    """Prefill needs decode's destination slots before it moves a byte (direct), or not (relay)."""

    session_id: str
    """How decode names itself to prefill (registrations, destinations)."""

    # -- lifetime -----------------------------------------------------------------
    def start_prefill(self) -> None:
        """Prefill's manager is up: start the plane's own threads, if it has any."""

    def start_decode(self) -> None:
        """Decode's manager is up: start the plane's own threads, if it has any."""

    def close(self) -> None:
        raise NotImplementedError

    def leftovers(self) -> dict[str, Any]:
        """Per-room state still held (tests: empty once every room concluded)."""
        return {}

    # -- prefill ------------------------------------------------------------------
    def prefill_open(self, room: int, num_pages: int) -> None:
        """A prefill request of ``num_pages`` pages was initialised."""

    def prefill_send(self, chunk: Any, pages: np.ndarray) -> None:
        """Move one chunk (``TransferChunk``; ``pages`` its prefill page indices); on the last
        chunk, conclude the room through the host. Raises ``TransferFailed``."""
        raise NotImplementedError

    def prefill_published(self, room: int) -> bool:
        """The room already reached decode's side without decode's destinations (they are moot)."""
        return False

    def prefill_discard(self, room: int) -> None:
        """The room failed or was aborted: drop whatever the plane holds for it."""

    def prefill_closed(self, room: int, succeeded: bool) -> None:
        """Prefill's sender for the room was cleared."""
        if not succeeded:
            self.prefill_discard(room)

    def prefill_taken(self, room: int) -> None:
        """Decode says it read the room (a ``KVC_TAKEN`` message)."""

    def prefill_tick(self) -> None:
        """Periodic housekeeping on prefill (the janitor thread, every 0.2 s)."""

    # -- decode -------------------------------------------------------------------
    def decode_expect(self, room: int, bootstrap_infos: Sequence[dict], kv_indices: Any, aux_index: Optional[int],
                      state_indices: Optional[list]) -> None:
        """Decode sent its destinations for ``room`` to its prefill rank (``bootstrap_infos``)."""

    def decode_prefill_succeeded(self, room: int) -> bool:
        """Prefill said ``Success`` for ``room``: True if the bytes are in decode's slots now (the
        manager concludes the room), False if the plane still has work and concludes it itself."""
        return True

    def decode_forget(self, room: int, succeeded: bool) -> None:
        """Decode's receiver for the room was cleared: stop any work on it."""

    def decode_failure_detail(self, room: int) -> Optional[str]:
        """The plane's last error for a room that timed out (added to the failure reason)."""
        return None


def open_data_plane(config: PDConfig, layout: BufferLayout, context: EngineContext, host: PlaneHost) -> DataPlane:
    """The data plane ``config.transport`` names, bound to ``host``."""
    return PLANES[config.transport](config, layout, context, host)


# ---------------------------------------------------------------------------------
# direct: one-sided writes into decode's pre-allocated slots
# ---------------------------------------------------------------------------------


class DirectPlane(DataPlane):
    """One-sided writes into decode's pre-allocated slots, over this process's Transfer Engine."""

    waits_for_decode = True

    def __init__(self, config: PDConfig, layout: BufferLayout, context: EngineContext | None, host: PlaneHost):
        self.config = config
        self.layout = layout
        self.host = host
        self.engine = transfer_engine.EngineClient(host.local_ip, config.protocol, config.device,
                                                   user="PD direct plane")
        self.session_id = self.engine.name
        self.engine.register_many(layout.regions())

    def write(self, session: str, blocks: Sequence[tuple[int, int, int]]) -> None:
        """One-sided writes ``(local_src, remote_dst, nbytes)``; raises ``TransferFailed``."""
        self.engine.write_sync(session, blocks, self.config.max_batch)

    def prefill_send(self, chunk: Any, pages: np.ndarray) -> None:
        room, host = chunk.room, self.host
        infos = host.room_destinations(room)
        if not infos:
            raise TransferFailed(f"no decode destinations for room {room}")
        targets = []
        for info in list(infos.values()):
            if info.is_dummy:
                continue
            reg = host.decode_registration(info.session)
            if reg is None:
                raise TransferFailed(f"decode {info.session} sent destinations before registering its buffers")
            if reg.rejection:
                raise TransferFailed(reg.rejection)
            dst = np.asarray(info.dst_kv_indices[chunk.index_slice], dtype=np.int64)
            if dst.size != pages.size or (chunk.is_last_chunk and info.dst_kv_indices.size != chunk.index_slice.stop):
                raise RoomMismatch(
                    f"room mismatch: decode allocated {info.dst_kv_indices.size} pages for room {room}, "
                    f"prefill sends pages {chunk.index_slice.start}..{chunk.index_slice.start + pages.size}"
                    f"{' (last chunk)' if chunk.is_last_chunk else ''}")
            blocks = kv_blocks(self.layout, reg.kv_ptrs, pages, dst)
            if chunk.is_last_chunk:
                if info.dst_aux_index is None or chunk.prefill_aux_index is None:
                    raise TransferFailed(f"room {room}: no aux row to send")
                blocks += aux_blocks(self.layout, reg.aux_ptrs, chunk.prefill_aux_index, info.dst_aux_index)
                if chunk.state_indices:
                    blocks += state_blocks(self.layout, reg.state_ptrs, chunk.state_indices, info.dst_state_indices)
            if blocks:
                self.write(info.session, blocks)
            targets.append((info.endpoint, info.dst_port))
        if chunk.is_last_chunk:
            if targets:
                host.conclude_success(room, targets)
            else:  # every destination is a dummy rank (MLA fan-in): nothing to write
                host.mark_success(room)

    def close(self) -> None:
        self.engine.close()


# ---------------------------------------------------------------------------------
# relay: a shared store between the two sides, a completion marker per room
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class RelayRoomOut:
    """Prefill side of one relayed room."""

    keys: RelayKeys
    src_pages: np.ndarray
    written_blocks: int = 0


@dataclasses.dataclass
class RelayRoomIn:
    """Decode side of one relayed room: where its bytes go."""

    room: int
    keys: RelayKeys
    dst_pages: np.ndarray
    aux_row: int
    state_indices: Optional[list]
    prefill_ip: str
    prefill_port: int
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    inflight: bool = False
    cancelled: bool = False
    not_before: float = 0.0
    last_error: Optional[str] = None


class RelayPlane(DataPlane):
    """The relay's protocol: which rooms each side tracks, when it reads, cleans up, concludes.
    The bytes move through ``StoreRelay`` (``self.relay``)."""

    waits_for_decode = False

    def __init__(self, config: PDConfig, layout: BufferLayout, context: EngineContext | None, host: PlaneHost,
                 relay: StoreRelay | None = None):
        self.config = config
        self.host = host
        self.relay = relay if relay is not None else StoreRelay(config, layout, context)
        self.session_id = f"{host.local_ip}:{host.rank_port}"
        self.rooms_out: dict[int, RelayRoomOut] = {}  # prefill: rooms being written
        self.deadlines = Deadlines()  # prefill: published rooms decode has not taken yet
        self.rooms_in: dict[int, RelayRoomIn] = {}  # decode: rooms waiting for their marker
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(config.workers, thread_name_prefix="kvconnect-pd")
        # Notices that must not delay the read path ("keys taken" to prefill).
        self._notices = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvconnect-pd-notices")

    def _namespace(self, ip: str, port: int, room: int) -> str:
        return room_namespace(self.config.key_prefix, ip, port, room, self.host.kv_dtype_tag())

    def start_decode(self) -> None:
        t = threading.Thread(target=self._reader, daemon=True, name="kvconnect-pd-_relay_reader")
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._notices.shutdown(wait=False, cancel_futures=True)
        self.relay.close()

    def leftovers(self) -> dict[str, Any]:
        st = self.relay.store.stats()  # where relay time goes (benchmark diagnostics)
        return {"_relay_out": len(self.rooms_out), "_relay_in": len(self.rooms_in),
                "relay_unread_rooms": len(self.deadlines.entries),
                "store_stats": {k: getattr(st, k) for k in ("put_calls", "put_bytes", "put_seconds", "get_calls",
                                                            "get_bytes", "get_seconds", "exists_calls")}}

    # -- prefill ------------------------------------------------------------------
    def prefill_open(self, room: int, num_pages: int) -> None:
        keys = self.relay.keys(self._namespace(self.host.local_ip, self.host.rank_port, room), num_pages)
        self.rooms_out[room] = RelayRoomOut(keys, np.full(num_pages, -1, dtype=np.int64))

    def prefill_send(self, chunk: Any, pages: np.ndarray) -> None:
        room = chunk.room
        out = self.rooms_out.get(room)
        if out is None:
            raise TransferFailed(f"room {room} was not initialised")
        sl = chunk.index_slice
        if sl.stop > out.src_pages.size or pages.size != sl.stop - sl.start:
            raise RoomMismatch(f"room {room}: chunk {sl.start}..{sl.stop} outside the {out.src_pages.size} pages sent")
        out.src_pages[sl] = pages
        keys = out.keys
        # Blocks span chunk boundaries: write a block once all its pages were computed
        # (earlier chunks' pages stay allocated on prefill until the room concludes).
        upto = keys.nblocks if chunk.is_last_chunk else sl.stop // keys.block_pages
        self.relay.put_blocks(keys, out.src_pages, list(range(out.written_blocks, upto)))
        out.written_blocks = max(out.written_blocks, upto)
        if not chunk.is_last_chunk:
            return
        if chunk.prefill_aux_index is None:
            raise TransferFailed(f"room {room}: no aux row to send")
        self.relay.put_tail(keys, chunk.prefill_aux_index, chunk.state_indices, room)
        self.deadlines.add(room, time.monotonic() + self.config.retain_s, keys)
        self.rooms_out.pop(room, None)
        # The KV is durable in the store: prefill may free its pages. Decode (if it already
        # sent its destinations) gets a hint to read now instead of at its next poll.
        self.host.conclude_success(room)

    def prefill_published(self, room: int) -> bool:
        return room in self.deadlines  # decode reads the store by itself

    def prefill_discard(self, room: int) -> None:
        out = self.rooms_out.pop(room, None)
        keys = out.keys if out is not None else self.deadlines.pop(room)
        if keys is not None:
            self.relay.discard(keys)

    def prefill_closed(self, room: int, succeeded: bool) -> None:
        if not succeeded:
            self.prefill_discard(room)
        else:
            self.rooms_out.pop(room, None)

    def prefill_taken(self, room: int) -> None:
        self.deadlines.pop(room)

    def prefill_tick(self) -> None:
        for keys in self.deadlines.due():  # unread keys: retain_s after publishing
            self.relay.discard(keys)

    # -- decode -------------------------------------------------------------------
    def decode_expect(self, room: int, bootstrap_infos: Sequence[dict], kv_indices: Any, aux_index: Optional[int],
                      state_indices: Optional[list]) -> None:
        target = bootstrap_infos[0]
        prefill_ip, prefill_port = target["rank_ip"], int(target["rank_port"])
        dst = np.asarray(kv_indices, dtype=np.int64)
        counts = [0 if s is None else int(np.asarray(s).size) for s in (state_indices or [])]
        keys = self.relay.keys(self._namespace(prefill_ip, prefill_port, room), int(dst.size), counts)
        entry = RelayRoomIn(room, keys, dst, int(aux_index), state_indices, prefill_ip, prefill_port)
        with self._lock:
            self.rooms_in[room] = entry
        self._wake.set()

    def decode_prefill_succeeded(self, room: int) -> bool:
        self._wake.set()  # marker written: read now
        return False

    def decode_forget(self, room: int, succeeded: bool) -> None:
        """Stop reading (waiting out a read in flight) and drop unread keys."""
        with self._lock:
            entry = self.rooms_in.pop(room, None)
        if entry is None:
            return
        with entry.lock:  # a read in flight is writing into slots the scheduler is about to free
            entry.cancelled = True
        if not succeeded:
            self.relay.discard(entry.keys)

    def decode_failure_detail(self, room: int) -> Optional[str]:
        with self._lock:
            entry = self.rooms_in.get(room)
        if entry is not None and entry.last_error:
            return entry.last_error
        if self.relay.store_errors:
            return f"store {self.relay.store.name!r}: {self.relay.store_errors[-1]}"
        return None

    def _reader(self) -> None:
        while not self._stopped:
            with self._lock:
                idle = not self.rooms_in
            self._wake.wait(0.5 if idle else self.config.poll_interval_s)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                waiting = [e for e in self.rooms_in.values() if not e.inflight and e.not_before <= now]
            if not waiting:
                continue
            present = self.relay.markers_present([e.keys for e in waiting])
            for entry, ready in zip(waiting, present):
                if ready:
                    entry.inflight = True
                    self._executor.submit(self._read, entry)

    def _read(self, entry: RelayRoomIn) -> None:
        room = entry.room
        with entry.lock:
            if entry.cancelled or not self.host.room_live(room):
                return
            try:
                self.relay.read(entry.keys, room, entry.dst_pages, entry.aux_row, entry.state_indices)
            except RoomMismatch as e:
                self._fail(entry, str(e))
                return
            except TransferFailed as e:
                entry.last_error = str(e)  # maybe a store hiccup: retry until the room's timeout
                entry.not_before = time.monotonic() + 0.05
                entry.inflight = False
                return
            except Exception as e:  # noqa: BLE001
                logger.exception("kvconnect PD: relay read of room %s crashed", room)
                self._fail(entry, f"kvconnect relay read error: {e!r}")
                return
            with self._lock:
                self.rooms_in.pop(room, None)
            self.host.mark_success(room)
        self.relay.discard(entry.keys)  # background: a store may hold the keys while a lease lasts
        self._notices.submit(self._taken, entry)

    def _taken(self, entry: RelayRoomIn) -> None:
        try:
            self.host.notify_taken(entry.prefill_ip, entry.prefill_port, entry.room)
        except Exception as e:  # noqa: BLE001 - prefill's retain_s deadline cleans up anyway
            logger.debug("kvconnect PD: could not tell prefill room %s was taken: %r", entry.room, e)

    def _fail(self, entry: RelayRoomIn, reason: str) -> None:
        with self._lock:
            self.rooms_in.pop(entry.room, None)
        self.host.mark_failed(entry.room, f"kvconnect relay: {reason}")
        self.relay.discard(entry.keys)


PLANES: dict[str, type[DataPlane]] = {"direct": DirectPlane, "relay": RelayPlane}
