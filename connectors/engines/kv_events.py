"""KV-cache events for the shared store: SGLang's ``BlockStored`` / ``BlockRemoved`` with
medium ``EXTERNAL``, published through SGLang's own event publisher.

Cache-aware routers (sglang-router, llm-d, Dynamo) learn where a prefix lives from the events
each server publishes for its GPU and host tiers. ``StoreEvents`` adds the tier behind them:
the pages an engine put into a kvconnect store, the pages it loaded from it (put there by
another engine), and their removals: the engine's own deletes and clears, and the store's
evictions (``add_eviction_listener``, where the store has ``Capability.EVICTION_EVENTS``; else
an audit thread looks the announced pages up again and retracts those gone).

Block hashes are SGLang's: a page's L3 key is its 64-hex storage hash, and its event block
hash is ``hash_str_to_int64`` of that key (the first 16 hex digits as a signed int64), which
is what SGLang publishes for the same page on GPU and CPU for requests without ``extra_key`` /
``cache_salt``. ``prefix_block_hashes(token_ids, page_size, ...)`` computes them from a prompt
on the router side, salted requests included (docs/kv_events.md).

API (the HiCache adapter and the unified-cache linker both use it; bare page hashes, i.e.
SGLang's keys, not store keys)::

    events = StoreEvents.create(config, dp_rank=ctx.dp_rank)  # config: --kv-events-config's JSON
    events.watch(kv_view, block_size=page_size)   # the KV view: its evictions become removals
    ok = events.put(view.put_from, page_hashes, pages, parent=prefix_key)  # put, then announce
    ok = events.get(view.get_into, page_hashes, pages)  # load; pages loaded announced once
    token = events.begin(page_hashes)             # or around a put / load made some other way:
    events.stored(page_hashes, ok, parent=prefix_key, token=token)  # ... after a put
    events.loaded(page_hashes, ok, token=token)   # ... after a load
    events.removed(page_hashes, gone)             # after a delete; gone: which were present
    events.cleared()                              # after the view's clear(): every page announced
    events.close()                                # publishes what is pending, stops the publisher

A page the store evicts while a put or load of it is in flight (between ``begin`` and
``stored`` / ``loaded``) is not announced by that call: no event names a page the store lost.
Every method is thread-safe, raises nothing of its own (``put`` / ``get`` pass on what the store
call raised) and never blocks on the network: events queue under a lock and a publisher thread
sends one ``KVEventBatch`` every ``flush_s`` (50 ms). Pages announced and not
removed are remembered (up to ``track`` of them, least recently announced forgotten first) so
a load does not announce a page twice and a clear can name what it removed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

from kvconnect.connectors.base import Capability, ConfigError, PageStore
from kvconnect.connectors.engines.common import guarded

log = logging.getLogger("kvconnect.kv_events")

MEDIUM = "EXTERNAL"
"""SGLang's ``StorageMedium.EXTERNAL``: a shared pool every server can load from."""

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5560"
"""Where the publisher binds when the config names no endpoint (loopback: see docs/kv_events.md)."""

CONFIG_KEY = "kv_events"


def block_hash(page_hash: str) -> int:
    """The event block hash of a SGLang page hash (SGLang's ``hash_str_to_int64``); a key that
    is not hex (a caller's own legacy keys) is hashed with SHA-256 first."""
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    try:
        return hash_str_to_int64(page_hash)
    except ValueError:
        return hash_str_to_int64(hashlib.sha256(page_hash.encode()).hexdigest())


def _nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


_never_raises = guarded(_nothing)
"""An event method: a failure is counted and logged (rate-limited), never raised into the engine."""


def prefix_block_hashes(token_ids: Sequence[int], page_size: int, *, extra_key: Optional[str] = None,
                        cache_salt: Optional[str] = None) -> list[int]:
    """Router side: the block hashes this module publishes for a prompt's full pages, in order
    (SGLang's storage hash chain, seeded by ``extra_key`` / ``cache_salt`` as SGLang seeds it).
    The prompt's first ``n`` pages are in the shared store when the first ``n`` of these are."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    full = len(token_ids) // page_size * page_size
    if not full:
        return []
    key = RadixKey(array("l", list(token_ids[:full])), extra_key=extra_key, cache_salt=cache_salt)
    return [block_hash(h) for h in get_storage_hash_str(key, None, page_size=page_size)]


def events_config(value: Any, *, where: str) -> Optional[str]:
    """The ``kv_events`` option (SGLang's ``--kv-events-config`` schema, as a dict or JSON
    string; None / ``{}`` / ``""``: off) as the JSON SGLang's publisher factory takes. The
    endpoint defaults to ``DEFAULT_ENDPOINT``, bound (not connected)."""
    if value in (None, "", {}, False):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(CONFIG_KEY, f"not JSON: {e}", "a --kv-events-config object, e.g. "
                              '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5560"}', where) from None
    if not isinstance(value, dict):
        raise ConfigError(CONFIG_KEY, f"expected an object, got {type(value).__name__}",
                          "a --kv-events-config object", where)
    value = dict(value)
    value.setdefault("publisher", "zmq")
    if "endpoint" not in value:
        value["endpoint"] = DEFAULT_ENDPOINT
        value.setdefault("bind", True)
    from pydantic import ValidationError
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventsConfig

    try:
        cfg = KVEventsConfig.model_validate(value)
    except ValidationError as e:
        fields = sorted(KVEventsConfig.model_fields)
        raise ConfigError(CONFIG_KEY, str(e).replace("\n", " "), ", ".join(fields), where) from None
    known = sorted(EventPublisherFactory._registry)
    if cfg.publisher not in known:
        raise ConfigError(f"{CONFIG_KEY}.publisher", f"unknown publisher {cfg.publisher!r}", ", ".join(known), where)
    return cfg.model_dump_json()


class StoreEvents:
    """One engine rank's store events (see module docstring)."""

    def __init__(self, publisher: Any, *, track: int = 1 << 18, flush_s: float = 0.05,
                 audit_s: float = 1.0, audit_batch: int = 4096):
        """``audit_s`` / ``audit_batch``: on a store that does not report its evictions, every
        ``audit_s`` the ``audit_batch`` least recently checked announced pages are looked up
        and those gone are removed (``watch``)."""
        self._publisher = publisher
        self._track = track
        self._flush_s = flush_s
        self._audit_s = audit_s
        self._audit_batch = audit_batch
        self._lock = threading.Lock()
        self._seq = 0  # announcements so far: an audit removes only what it saw announced
        # block hash -> (page hash, announcement seq), least recently announced or checked first
        self._announced: "OrderedDict[int, tuple[str, int]]" = OrderedDict()
        self._pending: list = []
        self._inflight: dict[int, int] = {}  # block hash -> puts / loads of it in flight
        self._lost: set[int] = set()  # in flight and evicted meanwhile
        self._block_size = 0
        self._unwatch: list = []
        self.counts = {"stored": 0, "removed": 0, "evicted": 0, "batches": 0}
        self._wake = threading.Event()
        self._stopping = False
        self._stopped = threading.Event()
        self._auditor: Optional[threading.Thread] = None
        self.audits = 0
        self._thread = threading.Thread(target=self._run, name="kvconnect-kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, config: Any, *, dp_rank: int = 0, where: str = "kvconnect kv events",
               **kwargs: Any) -> Optional["StoreEvents"]:
        """Events published as ``config`` says (``events_config``), on the port of DP rank
        ``dp_rank`` (SGLang's per-replica offset), or None when ``config`` turns them off."""
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory

        text = events_config(config, where=where)
        if text is None:
            return None
        try:
            publisher = EventPublisherFactory.create(text, attn_dp_rank=dp_rank)
        except Exception as e:  # noqa: BLE001 - a port in use, an endpoint ZMQ cannot parse
            endpoint = json.loads(text).get("endpoint")
            raise ConfigError(CONFIG_KEY, f"cannot publish on {endpoint!r} (DP rank {dp_rank}): {e}",
                              "a free tcp:// or ipc:// endpoint", where) from e
        return cls(publisher, **kwargs)

    def source(self) -> Optional[dict]:
        """Where a subscriber on this host connects (SGLang's ``describe_local_source``:
        ``endpoint``, ``topic``, ``replay_endpoint``, ``block_size``), None if not bound here."""
        return self._publisher.describe_local_source(self._block_size)

    # -- what the engine did --------------------------------------------------------------
    def watch(self, view: PageStore, *, block_size: int) -> bool:
        """Take the store's evictions of ``view``'s pages as removals: as it reports them
        (``Capability.EVICTION_EVENTS``: True), else found by an audit thread that looks the
        announced pages up, ``audit_batch`` every ``audit_s`` (False)."""
        self._block_size = int(block_size)
        log.info("kvconnect: KV events (medium %s) published on %s", MEDIUM, self.source())
        if view.supports(Capability.EVICTION_EVENTS):
            self._unwatch.append(view.add_eviction_listener(self.evicted))
            return True
        log.info("kvconnect: store %r evicts out of this process's sight: announced pages are looked up "
                 "again, %d every %.1f s", getattr(view, "inner", view).name, self._audit_batch, self._audit_s)
        self._auditor = threading.Thread(target=self._audit_loop, args=(view,), name="kvconnect-kv-events-audit",
                                         daemon=True)
        self._auditor.start()
        return False

    def _audit_loop(self, view: PageStore) -> None:
        while not self._stopped.wait(self._audit_s):
            try:
                self.audit(view)
            except Exception as e:  # noqa: BLE001 - a store down now: the next round asks again
                log.debug("kvconnect: KV event audit failed: %s", e)

    def audit(self, view: PageStore) -> int:
        """One round: look up the least recently checked announced pages; those gone are
        removed (``BlockRemoved``), the others checked again last. How many were gone."""
        with self._lock:
            picked = []
            for h, (page, seq) in self._announced.items():
                if len(picked) >= self._audit_batch:
                    break
                if h not in self._inflight:
                    picked.append((h, page, seq))
        if not picked:
            return 0
        present = view.exists([page for _, page, _ in picked])
        gone = []
        with self._lock:
            for (h, page, seq), there in zip(picked, present):
                entry = self._announced.get(h)
                if entry is None or entry[1] != seq:
                    continue  # removed or announced again meanwhile: not this round's to judge
                if there or h in self._inflight:
                    self._announced.move_to_end(h)
                else:
                    gone.append(h)
            self.audits += 1
        self._remove(gone, "evicted")
        return len(gone)

    def put(self, put_from: Any, page_hashes: Sequence[str], pages: Sequence[Any],
            parent: Optional[str] = None) -> list[bool]:
        """``put_from(page_hashes, pages)``, then ``stored`` of what it stored; its result."""
        token = self.begin(page_hashes)
        ok: Optional[list] = None
        try:
            ok = put_from(page_hashes, pages)
        finally:
            self.stored(page_hashes, ok if ok is not None else [False] * len(page_hashes), parent, token=token)
        return ok

    def get(self, get_into: Any, page_hashes: Sequence[str], pages: Sequence[Any]) -> list[bool]:
        """``get_into(page_hashes, pages)``, then ``loaded`` of what it loaded; its result."""
        token = self.begin(page_hashes)
        ok: Optional[list] = None
        try:
            ok = get_into(page_hashes, pages)
        finally:
            self.loaded(page_hashes, ok if ok is not None else [False] * len(page_hashes), token=token)
        return ok

    @_never_raises
    def begin(self, page_hashes: Sequence[str]) -> Optional[list[int]]:
        """Note a put or load of these pages in flight: an eviction meanwhile un-announces it."""
        hashes = [block_hash(h) for h in page_hashes]
        with self._lock:
            for h in hashes:
                self._inflight[h] = self._inflight.get(h, 0) + 1
        return hashes

    def _end(self, token: Optional[list[int]]) -> set[int]:
        """The pages of ``token`` evicted while it was in flight (under the lock)."""
        lost = set()
        for h in token or ():
            if h in self._lost:
                lost.add(h)
            n = self._inflight.get(h, 0) - 1
            if n > 0:
                self._inflight[h] = n
            else:
                self._inflight.pop(h, None)
                self._lost.discard(h)
        return lost

    @_never_raises
    def stored(self, page_hashes: Sequence[str], ok: Optional[Sequence[bool]] = None,
               parent: Optional[str] = None, *, token: Optional[list[int]] = None) -> None:
        """Pages the store now holds (``ok[i]``: page ``i``'s put succeeded), in chain order;
        ``parent``: the page hash before the first (SGLang's ``prefix_keys[-1]``), if known;
        ``token``: ``begin``'s, when the put was announced to it."""
        self._announce(page_hashes, ok, parent, token)

    @_never_raises
    def loaded(self, page_hashes: Sequence[str], ok: Optional[Sequence[bool]] = None, *,
               token: Optional[list[int]] = None) -> None:
        """Pages read from the store: announced unless already."""
        self._announce(page_hashes, ok, None, token)

    @_never_raises
    def removed(self, page_hashes: Sequence[str], gone: Optional[Sequence[bool]] = None) -> None:
        """Pages deleted through this engine (``gone[i]``: page ``i`` was present)."""
        hashes = [block_hash(h) for i, h in enumerate(page_hashes) if gone is None or gone[i]]
        self._remove(hashes, "removed")

    @_never_raises
    def evicted(self, page_hashes: Sequence[str]) -> None:
        """Pages the store evicted (its eviction listener)."""
        self._remove([block_hash(h) for h in page_hashes], "evicted")

    @_never_raises
    def cleared(self) -> None:
        """The view was cleared: every page announced and not removed is gone."""
        with self._lock:
            hashes = list(self._announced)
        self._remove(hashes, "removed")

    # -- publishing -----------------------------------------------------------------------
    def _announce(self, page_hashes: Sequence[str], ok: Optional[Sequence[bool]], parent: Optional[str],
                  token: Optional[list[int]]) -> None:
        from sglang.srt.disaggregation.kv_events import BlockStored

        hashes = token if token is not None else [block_hash(h) for h in page_hashes]
        prev = block_hash(parent) if parent else None
        runs: list[tuple[Optional[int], list[int]]] = []  # (parent, chain) of each run of new pages
        with self._lock:
            lost = self._end(token)
            run: Optional[list[int]] = None
            for i, h in enumerate(hashes):
                if (ok is None or ok[i]) and h not in self._announced and h not in lost:
                    if run is None:
                        run = []
                        runs.append((prev, run))
                    run.append(h)
                    self._seq += 1
                    self._announced[h] = (page_hashes[i], self._seq)
                    if len(self._announced) > self._track:
                        self._announced.popitem(last=False)
                else:
                    run = None
                    if h in self._announced:
                        self._announced.move_to_end(h)
                prev = h
            for first_parent, blocks in runs:
                self._pending.append(BlockStored(
                    block_hashes=blocks, parent_block_hash=first_parent, token_ids=[],
                    block_size=self._block_size, lora_id=None, medium=MEDIUM))
                self.counts["stored"] += len(blocks)
        if runs:
            self._wake.set()

    def _remove(self, hashes: list[int], what: str) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved

        if not hashes:
            return
        with self._lock:
            for h in hashes:
                self._announced.pop(h, None)
                if h in self._inflight:
                    self._lost.add(h)
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM))
            self.counts[what] += len(hashes)
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            stopping = self._stopping
            if not stopping:
                time.sleep(self._flush_s)  # gather what else arrives into the same batch
            self._wake.clear()
            self._flush()
            if stopping:
                return

    def _flush(self) -> None:
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        with self._lock:
            events, self._pending = self._pending, []
            if events:
                self.counts["batches"] += 1
        if events:
            try:
                self._publisher.publish(KVEventBatch(ts=time.time(), events=events))
            except Exception as e:  # noqa: BLE001 - a publisher failure never reaches the engine
                log.error("kvconnect: publishing %d KV events failed: %s", len(events), e)

    def close(self) -> None:
        """Publish what is pending and shut the publisher down (idempotent)."""
        if self._stopping:
            return
        for unwatch in self._unwatch:
            unwatch()
        self._stopped.set()
        if self._auditor is not None:
            self._auditor.join(timeout=5.0)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        try:
            self._publisher.shutdown()
            # SGLang registers the same shutdown at exit; a second one waits a second for nothing
            atexit.unregister(self._publisher.shutdown)
        except Exception as e:  # noqa: BLE001 - close never raises into the engine
            log.error("kvconnect: KV event publisher shutdown failed: %s", e)


class ExternalBlocks:
    """Router side: which block hashes some publisher says are in the shared store.

    Feed it the decoded ``KVEventBatch``es of every server's kvconnect publisher
    (``apply``); ``cached_pages(prefix_block_hashes(...))`` is how many leading pages of a
    prompt any of them can load from the store."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()

    def apply(self, batch: Any) -> None:
        for ev in batch.events:
            if getattr(ev, "medium", None) != MEDIUM:
                continue
            name = type(ev).__name__
            if name == "BlockStored":
                self.blocks.update(ev.block_hashes)
            elif name == "BlockRemoved":
                self.blocks.difference_update(ev.block_hashes)

    def cached_pages(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n
