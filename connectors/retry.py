"""Retries within a deadline, and fast failures after a failure: the one helper of every client.

Two pieces, used by the HF3FS metadata clients (``hf3fs/client.py``'s ``RemoteMetadata``,
``hf3fs/redis_index.py``'s ``RedisMetadata``) and the Mooncake store:

* ``call_with_retries(fn, attempts=, timeout=, on_error=)``: ``fn(deadline)`` until it returns,
  at most ``attempts`` tries, all within ``timeout`` seconds; between tries a jittered
  exponential back-off (20 ms, doubling, each sleep drawn from [d, 2d) and cut to the time
  left). ``on_error(exc)`` classifies what a try raised: it raises (a fatal error: an
  authentication failure, a malformed reply), or answers ``RETRY``, ``AT_ONCE`` (retry with no
  back-off: a Redis Cluster redirection) or ``GIVE_UP``; ``None`` passes the exception on
  unchanged. When no try succeeded: ``RetriesFailed`` carrying the last error.
* ``CoolOff(seconds, one_probe=)``: the circuit around such calls. ``trip(key)`` opens it for
  ``seconds``; ``allow(key)`` is False while it is open and True once the time is over: for
  every caller (``one_probe=False``: the metadata clients), or for one caller at a time, the
  circuit staying open for another ``seconds`` while that caller probes (``one_probe=True``:
  Mooncake's health check), until ``reset(key)`` closes it. Keys are optional (a Redis
  Cluster's hash slots cool off one by one).

Why not ``tenacity``: it is not among this project's dependencies, and these calls sit on the
path of every index lookup, where a decorator library builds an attempt state per call. The
success path here is one function call and one ``try``. Measured (CPython 3.11, stubbed
backends, best of 7 x 200,000 calls, next to the inline loops this replaced): the HF3FS
metadata client's call ~0.35 us -> ~0.7 us (its framed-TCP round trip alone is tens of us),
the Redis index's ~1.1 us -> ~0.6 us (a per-call import left with the loop), the Mooncake
store's healthy check unchanged (~0.36 us per call, a plain attribute test).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")

RETRY = "retry"
"""Try again after the back-off."""
AT_ONCE = "at_once"
"""Try again now (the error said where to ask: no reason to wait)."""
GIVE_UP = "give_up"
"""No further try (the error will not go away by retrying)."""

FIRST_DELAY = 0.02
"""The first back-off, seconds; it doubles after each sleep."""


class RetriesFailed(Exception):
    """No try of ``call_with_retries`` succeeded: ``last`` is the last error (None: no time was left)."""

    def __init__(self, last: BaseException | None):
        super().__init__(repr(last) if last is not None else "no time left")
        self.last = last


def call_with_retries(fn: Callable[[float], T], *, attempts: int, timeout: float,
                      on_error: Callable[[Exception], str | None], first_delay: float = FIRST_DELAY) -> T:
    """``fn(deadline)`` (``deadline`` on ``time.monotonic()``) until it returns; see the module
    docstring. ``on_error`` runs in the ``except`` block of the failed try (``raise ... from``
    works there)."""
    deadline = time.monotonic() + timeout
    delay = first_delay
    last: Exception | None = None
    for attempt in range(attempts):
        if time.monotonic() >= deadline:
            break
        try:
            return fn(deadline)
        except Exception as e:  # noqa: BLE001 - on_error says what it is
            verdict = on_error(e)
            if verdict is None:
                raise
            last = e
            if verdict == GIVE_UP:
                break
            if verdict == AT_ONCE:
                continue
        if attempt + 1 < attempts:
            time.sleep(max(0.0, min(delay * (1 + random.random()), deadline - time.monotonic())))
            delay *= 2
    raise RetriesFailed(last)


class CoolOff:
    """Fast failures for ``seconds`` after a failure (see the module docstring)."""

    def __init__(self, seconds: float, *, one_probe: bool = False):
        self.seconds = seconds
        self.one_probe = one_probe
        self._until: dict[Hashable, float] = {}  # key -> when the cool-off ends; absent: closed
        self._lock = threading.Lock()
        self.tripped = False
        """Some key tripped since the last ``reset`` of every one (a plain attribute: the hot
        path's test)."""

    def closed(self, key: Hashable = None) -> bool:
        """No failure of ``key`` since its last ``reset``."""
        return key not in self._until

    def allow(self, key: Hashable = None) -> bool:
        """Whether a call may go to the backend now."""
        if not self.tripped:
            return True
        until = self._until.get(key)
        if until is None:
            return True
        now = time.monotonic()
        if now < until:
            return False
        if not self.one_probe:
            return True
        with self._lock:  # one prober at a time: the others fail fast while it probes
            if now < self._until.get(key, 0.0):
                return False
            self._until[key] = now + self.seconds
        return True

    def trip(self, key: Hashable = None) -> bool:
        """Open for ``seconds`` from now; True when it was closed."""
        with self._lock:
            was = key not in self._until
            self._until[key] = time.monotonic() + self.seconds
            self.tripped = True
        return was

    def reset(self, key: Hashable = None) -> None:
        """Closed again (a probe succeeded)."""
        with self._lock:
            self._until.pop(key, None)
            self.tripped = bool(self._until)
