"""The Mooncake store's session: its client of the cluster, set up within ``setup_timeout``,
and every call to it under ``op_timeout`` behind a health circuit.

Calls run by ``call_mode`` (``kvconnect.connectors.mooncake.calls``); one past its deadline
turns the session unhealthy, and so does an unreachable master or peer in the codes a call
returns. While unhealthy, calls answer None at once (the store's misses) until a health
probe passes, at most one per ``reconnect_interval``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any, Callable

from kvconnect.connectors.base import BackendUnavailable
from kvconnect.connectors.mooncake import errors as mc_errors
from kvconnect.connectors.mooncake.calls import ABANDONED, DONE, RAISED, DeadlineRunner, run_inline
from kvconnect.connectors.retry import CoolOff
from kvconnect.connectors.transfer_engine import (
    apply_engine_defaults,
    apply_inline_timeouts,
    apply_rpc_timeouts,
    rpc_timeout_s,
)

log = logging.getLogger("kvconnect.mooncake")

# Mooncake's setup retries its master connection ~every 4.5 s (20 times by default).
_SETUP_ATTEMPT_S = 4.5
_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_USER_RETRIES = _RETRIES_ENV in os.environ  # a user's own choice is never overridden

LOOKUP_ON_CALLER_MIN_S = 5.0
"""The least ``op_timeout`` at which a ``worker``-mode store makes its lookups on the caller's
thread: Mooncake's client gives up on a killed (refusing) master only after ~4.5 s whatever
its RPC timeouts (measured 4.27-4.44 s a lookup), and a stalled master fails the RPC at
``MC_RPC_TIMEOUT_MS`` (``op_timeout`` / 2: 2.5 s measured at 5 s)."""

_MISS_CAUSE = {mc_errors.Outcome.BAD_REQUEST: "mismatch", mc_errors.Outcome.LEASED: "deadline"}
"""Why a Mooncake error code missed (``PageStore._miss``); anything else: the cluster failed us."""


def _wait_for_tcp(address: str, deadline: float) -> str | None:
    """None once ``host:port`` accepts a TCP connection before ``deadline``, else why not."""
    host, _, port = address.rpartition(":")
    why = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, 2.0)):
                return None
        except OSError as e:
            why = f"{type(e).__name__}: {e.strerror or e}"
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


class Session:
    """The client and the calls made through it (see the module docstring)."""

    def __init__(self, store, client_class: type):  # the MooncakeStore this is part of
        self.store = store
        self.config = store.config
        self._client_class = client_class
        self.client: Any = None  # set by connect()
        self.inline = self.config.call_mode == "inline"
        # lookups (batch_is_exist: one master RPC, no transfer) on the caller's thread; worker
        # mode decides in connect(), once Mooncake's RPC timeouts are set
        self.lookups_on_caller = self.inline
        self.runner = DeadlineRunner(self.config.io_threads, "kvc-mooncake")  # threads start on first use
        # unhealthy (open) from a timeout or an unreachable master until a health probe passes;
        # one probe per reconnect_interval
        self.circuit = CoolOff(self.config.reconnect_interval, one_probe=True)

    # -- set-up -----------------------------------------------------------------------
    def connect(self) -> None:
        """Set up the client, or BackendUnavailable naming the master, within ``setup_timeout``."""
        c = self.config
        # Mooncake retries an unreachable master for ~90 s; keep its retries within our
        # deadline (it reads the variable during setup) unless the user chose a value.
        if not _USER_RETRIES:
            os.environ[_RETRIES_ENV] = str(max(1, math.ceil(c.setup_timeout / _SETUP_ATTEMPT_S)))
        apply_engine_defaults()  # per-peer TCP queues that hold a whole batch's segments
        if c.call_mode == "inline":
            # nothing but Mooncake's own timeouts bounds an inline call: derive them from
            # op_timeout (process-wide; read by setup and by each transfer)
            apply_inline_timeouts(c.op_timeout)
        else:
            # a lookup is a master RPC: on the caller's thread (no hand-off to a worker, the
            # largest part of its cost) where the RPC timeouts and a dead master's give-up
            # bound it within op_timeout; everything else on a worker under op_timeout
            apply_rpc_timeouts(c.op_timeout)
            self.lookups_on_caller = c.op_timeout >= LOOKUP_ON_CALLER_MIN_S and rpc_timeout_s() <= c.op_timeout
        # Mooncake's setup holds the GIL while it retries, so a thread cannot bound it:
        # first wait (bounded) until the master accepts TCP connections at all.
        t0 = time.monotonic()
        left = _wait_for_tcp(c.master_server_address, t0 + c.setup_timeout)
        if left is not None:
            raise BackendUnavailable(
                "mooncake", f"cannot reach master {c.master_server_address} within "
                f"setup_timeout={c.setup_timeout:g}s ({left}; metadata {c.metadata_server}, "
                f"protocol {c.protocol})")
        client = self._client_class()
        kwargs = {"tenant_id": c.tenant_id} if c.tenant_id != "default" else {}
        # a shared segment is mounted from its file after setup, not allocated by Mooncake
        segment = 0 if c.shared_segment else c.global_segment_size
        context = self.store.context
        args = (c.local_hostname, c.metadata_server, segment, c.local_buffer_size,
                c.protocol, c.rdma_devices(context.tp_rank if context is not None else None),
                c.master_server_address)
        result: dict[str, Any] = {}
        done = threading.Event()
        gave_up = threading.Event()

        def run() -> None:
            try:
                result["rc"] = client.setup(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
                result["exc"] = e
            done.set()
            if gave_up.is_set():  # nobody will use this client: release it
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass

        t = threading.Thread(target=run, name="kvc-mooncake-setup", daemon=True)
        t.start()
        if not done.wait(c.setup_timeout):
            gave_up.set()
            if not done.is_set():
                raise BackendUnavailable(
                    "mooncake", f"no answer from master {c.master_server_address} within "
                    f"setup_timeout={c.setup_timeout:g}s (metadata {c.metadata_server}, protocol {c.protocol})")
        if "exc" in result:
            e = result["exc"]
            if isinstance(e, TypeError) and kwargs:
                raise BackendUnavailable("mooncake", f"this Mooncake build rejects tenant_id: {e}") from e
            raise BackendUnavailable("mooncake", f"setup against master {c.master_server_address} "
                                                 f"raised {type(e).__name__}: {e}") from e
        rc = result.get("rc", -1)
        if rc != 0:
            client.close()
            # Mooncake reports a segment it could not allocate with the same code as an
            # unreachable master: name both causes
            raise BackendUnavailable(
                "mooncake", f"setup failed (rc {rc} after {time.monotonic() - t0:.1f}s): cannot connect to "
                f"master {c.master_server_address}, or cannot allocate global_segment_size="
                f"{c.global_segment_size} bytes of memory (metadata {c.metadata_server}, protocol {c.protocol}, "
                f"local_hostname {c.local_hostname}; Mooncake's log above says which)")
        self.client = client

    def check_rc(self, what: str, rc: int) -> None:
        if rc != 0:
            mc_errors.raise_for(what, rc, master=self.config.master_server_address)

    def stop(self) -> int:
        """Stop the call threads; the number of abandoned calls still running."""
        self.runner.close()
        return self.runner.abandoned

    # -- calls under a deadline ---------------------------------------------------------
    def call(self, op: str, fn: Callable[..., Any], *args: Any,
             on_abandoned_done: Callable[[Any], None] | None = None, lookup: bool = False) -> Any:
        """``fn(*args)`` within ``op_timeout``; None if it failed or timed out.

        ``call_mode="worker"``: on a worker, abandoned at ``op_timeout``; ``"inline"``: on
        this thread, bounded by Mooncake's timeouts (``transfer_engine.mooncake_timeouts``); a call that
        still took longer than ``op_timeout`` keeps its answer but turns the store unhealthy,
        so the next calls short-circuit instead of waiting as long. A ``lookup`` (a master
        RPC, no transfer) runs on this thread in worker mode too where ``lookups_on_caller``.

        ``on_abandoned_done(result)`` runs when the caller gets None and nothing of the
        call can happen any more: at once if it failed or never ran (result None), else
        once an abandoned call has really returned (its result; e.g. to release its
        staging extent or remove what it wrote).
        """
        store = self.store
        if not self.available():
            store._miss("unavailable")
            if on_abandoned_done is not None:
                on_abandoned_done(None)
            return None
        inline = self.lookups_on_caller if lookup else self.inline
        t0 = time.monotonic()
        status, value = run_inline(fn, args) if inline else self.runner.run(fn, args, self.config.op_timeout,
                                                                             on_abandoned_done)
        took = time.monotonic() - t0
        if inline and took > self.config.op_timeout:
            store.figures.add(timeouts=1)
            self.mark_unhealthy(f"{op}: answered after {took:.1f}s > op_timeout={self.config.op_timeout:g}s")
        if status == DONE:
            return value
        store._miss("unavailable" if status == RAISED else "deadline")
        if status == RAISED:  # a binding error is a miss on the data path
            store.record_error()
            log.warning("mooncake %s raised %s: %s", op, type(value).__name__, value)
        else:
            store.figures.add(timeouts=1, abandoned=int(status == ABANDONED))
            self.mark_unhealthy(f"{op}: no answer within op_timeout={self.config.op_timeout:g}s"
                                if status == ABANDONED else
                                f"{op}: no free I/O thread within op_timeout={self.config.op_timeout:g}s")
        if status != ABANDONED and on_abandoned_done is not None:
            on_abandoned_done(None)
        return None

    def invoke(self, fn: Callable[..., Any], args: tuple,
               on_late: Callable[[Any], None] | None = None) -> tuple[str, Any]:
        """One Mooncake call, by ``call_mode``: inline, or on a worker under ``op_timeout``."""
        if self.inline:
            return run_inline(fn, args)
        return self.runner.run(fn, args, self.config.op_timeout, on_late)

    # -- health -------------------------------------------------------------------------
    def mark_unhealthy(self, why: str) -> None:
        if self.circuit.trip():
            log.warning("mooncake store unhealthy (master %s): %s; returning misses until it recovers",
                        self.config.master_server_address, why)

    def healthy(self) -> bool:
        return self.circuit.closed()

    def available(self) -> bool:
        """Healthy, or a due health probe succeeded. Never blocks beyond ``op_timeout``."""
        if not self.circuit.tripped:
            return True
        if self.runner.abandoned or not self.circuit.allow():  # allow(): this caller is the one prober
            self.store.figures.add(short_circuited=1)
            return False
        # a probe that hangs counts as abandoned: no further probe until it returned
        status, rc = self.invoke(self.client.health_check, ())
        ok = status == DONE and rc == 0
        if ok:
            self.circuit.reset()
            log.warning("mooncake store healthy again (master %s)", self.config.master_server_address)
        else:
            self.store.figures.add(short_circuited=1)
        return ok

    def note_codes(self, codes: list[int]) -> None:
        """Count errors; an unreachable master or peer turns the store unhealthy."""
        bad = [c for c in codes if c < 0 and mc_errors.outcome(c) not in
               (mc_errors.Outcome.MISS, mc_errors.Outcome.EXISTS)]
        if not bad:
            return
        store = self.store
        store.record_error(len(bad))
        for c in bad:
            store._miss(_MISS_CAUSE.get(mc_errors.outcome(c), "unavailable"), 1)
        unavailable = [c for c in bad if mc_errors.outcome(c) is mc_errors.Outcome.UNAVAILABLE]
        if unavailable:
            store.figures.add(unavailable=len(unavailable))
            self.mark_unhealthy(f"{mc_errors.code_name(unavailable[0])} ({unavailable[0]})")
