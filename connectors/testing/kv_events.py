"""A KV-event subscriber as a cache-aware router runs one: ZMQ SUB on a publisher's endpoint,
SGLang's ``KVEventBatch`` decoding, and replay requests through the publisher's ROUTER replay
socket for batches sent before the subscription took hold or lost on the way: at a gap in the
sequence numbers, and whenever the stream has been quiet for ``RESYNC_S``."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional


class EventSubscriber:
    """Every batch a publisher sends, in sequence order, each with the time it arrived.

    ``received``: ``(arrival time.monotonic(), event)`` per event; ``blocks``: the router's
    view (``kvconnect.connectors.engines.kv_events.ExternalBlocks``)."""

    RESYNC_S = 0.25
    """After this long without a batch, ask the replay socket for what came since the last one."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: Optional[str] = None):
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        from kvconnect.connectors.engines.kv_events import ExternalBlocks

        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.blocks = ExternalBlocks()
        self.received: list[tuple[float, Any]] = []
        self.next_seq = 0
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    def _take(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # seen already (a replay overlapping live traffic)
        batch = self._decode(payload)
        now = time.monotonic()
        with self._lock:
            self.blocks.apply(batch)
            self.received.extend((now, ev) for ev in batch.events)
            self.next_seq = seq + 1

    def _replay(self, upto: int) -> None:
        """Ask the publisher for batches ``next_seq`` .. ``upto`` (bounded wait)."""
        zmq = self._zmq
        req = self._ctx.socket(zmq.DEALER)
        try:
            req.connect(self._replay_endpoint)
            req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + 2.0  # the publisher serves replays between its batches
            while time.monotonic() < deadline:
                if not req.poll(50):
                    continue
                _, _topic, seq_b, payload = req.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    break
                if seq <= upto:
                    self._take(seq, payload)
            self.replays += 1
        finally:
            req.close(linger=0)

    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if not self._sub.poll(50):
                # quiet: ask for anything sent while the subscription was not up yet, or lost
                if self._replay_endpoint and time.monotonic() - idle_since > self.RESYNC_S:
                    self._replay(1 << 62)
                    idle_since = time.monotonic()
                continue
            idle_since = time.monotonic()
            _topic, seq_b, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.next_seq and self._replay_endpoint:
                self._replay(seq - 1)
            self._take(seq, payload)

    def snapshot(self) -> tuple[set, list]:
        with self._lock:
            return set(self.blocks.blocks), list(self.received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sub.close(linger=0)
