"""Blocking calls under a deadline: on persistent worker threads, or inline.

The engine thread hands a call to an idle worker and waits at most until the deadline;
past it the call is *abandoned*: the caller goes on, the worker finishes the call
whenever it returns and then runs the caller's ``on_late`` clean-up (on the worker).

Why not ``concurrent.futures.ThreadPoolExecutor``: per call it builds a Future, a work
item and a Condition and goes through a queue, and any idle thread may take the call.
Here the hand-off is two lock releases (on the 2-core dev VM about 20 us less per call
than the executor), and the most recently used idle worker takes the next call (LIFO),
so a caller that calls in sequence always meets the same, recently run thread. What
remains is the cost of any hand-off: waking the worker and, at the end, the caller.
Running the call on the caller's thread (``call_mode="inline"``, ``run_inline``) removes
that; then only Mooncake's own timeouts bound the call, which ``transfer_engine.mooncake_timeouts`` derives
from ``op_timeout`` (measured bounds in ``docs/mooncake.md``).
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("kvconnect.mooncake")

DONE, RAISED, BUSY, ABANDONED = "done", "raised", "busy", "abandoned"

_RUNNING, _FINISHED, _GAVE_UP = 0, 1, 2


def run_inline(fn: Callable[..., Any], args: tuple) -> tuple[str, Any]:
    """``fn(*args)`` on the calling thread, answered like ``DeadlineRunner.run``."""
    try:
        return DONE, fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the caller
        return RAISED, e


class _Job:
    __slots__ = ("fn", "args", "on_late", "done", "result", "exc", "state")

    def __init__(self, fn: Callable[..., Any], args: tuple, on_late: Callable[[Any], None] | None):
        self.fn, self.args, self.on_late = fn, args, on_late
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result: Any = None
        self.exc: BaseException | None = None
        self.state = _RUNNING


class _Worker:
    __slots__ = ("go", "job")

    def __init__(self) -> None:
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.job: _Job | None = None


class DeadlineRunner:
    """Up to ``max_threads`` persistent daemon workers (started on demand); thread-safe."""

    def __init__(self, max_threads: int, name: str):
        self._max = max_threads
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._idle: list[_Worker] = []  # a stack: the most recently used worker on top
        self._started = 0
        self._abandoned = 0
        self._closed = False

    @property
    def abandoned(self) -> int:
        """Abandoned calls still running (their clean-up included)."""
        return self._abandoned

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float,
            on_late: Callable[[Any], None] | None = None) -> tuple[str, Any]:
        """``fn(*args)`` on a worker, waiting at most ``timeout`` seconds in all.

        Returns ``(DONE, result)``, ``(RAISED, exception)``, ``(BUSY, None)`` (no worker
        free within the deadline: the call never ran) or ``(ABANDONED, None)``: the call
        runs on; once it has returned, ``on_late(result)`` runs on its worker (result None
        if it raised).
        """
        deadline = time.monotonic() + timeout
        w = self._take(deadline)
        if w is None:
            return BUSY, None
        job = _Job(fn, args, on_late)
        w.job = job
        w.go.release()
        if not job.done.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            with self._cond:
                if job.state == _RUNNING:  # else it finished just now: its result is set
                    job.state = _GAVE_UP
                    self._abandoned += 1
                    return ABANDONED, None
        return (DONE, job.result) if job.exc is None else (RAISED, job.exc)

    def _take(self, deadline: float) -> _Worker | None:
        with self._cond:
            while not self._closed:
                if self._idle:
                    return self._idle.pop()
                if self._started < self._max:
                    self._started += 1
                    w = _Worker()
                    threading.Thread(target=self._loop, args=(w,), name=f"{self._name}-{self._started}",
                                     daemon=True).start()
                    return w
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return None

    def _loop(self, w: _Worker) -> None:
        cond = self._cond
        while True:
            w.go.acquire()
            job = w.job
            if job is None:  # close
                return
            w.job = None
            try:
                result, exc = job.fn(*job.args), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            with cond:
                gave_up = job.state == _GAVE_UP
                if not gave_up:
                    job.result, job.exc, job.state = result, exc, _FINISHED
                    self._release(w)
            if not gave_up:
                job.done.release()
                continue
            if job.on_late is not None:
                try:
                    job.on_late(result if exc is None else None)
                except Exception as e:  # noqa: BLE001 - a clean-up must not kill the worker
                    log.error("mooncake: clean-up after an abandoned call failed: %s", e)
            with cond:
                self._abandoned -= 1
                self._release(w)

    def _release(self, w: _Worker) -> None:
        """Back on the idle stack, or told to exit after close (under ``_cond``)."""
        if self._closed:
            w.job = None
            w.go.release()
        else:
            self._idle.append(w)
            self._cond.notify()

    def close(self) -> None:
        """Idle workers exit now, busy ones once their call returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.job = None
            w.go.release()
