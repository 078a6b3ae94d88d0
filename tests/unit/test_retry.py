"""``kvconnect.connectors.retry``: tries within one deadline, what each error means, cool-offs."""

from __future__ import annotations

import time

import pytest

from kvconnect.connectors import retry
from kvconnect.connectors.retry import AT_ONCE, GIVE_UP, RETRY, CoolOff, RetriesFailed, call_with_retries


class Flaky:
    """Raises ``errors`` one per try, then answers ``"ok"``; records each try's time and deadline."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.tries: list[tuple[float, float]] = []

    def __call__(self, deadline: float) -> str:
        self.tries.append((time.monotonic(), deadline))
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_transient_errors_are_retried_after_a_growing_back_off_within_one_deadline():
    fn = Flaky(OSError("a"), OSError("b"))
    assert call_with_retries(fn, attempts=3, timeout=5.0, on_error=lambda e: RETRY, first_delay=0.01) == "ok"
    (t0, d0), (t1, d1), (t2, d2) = fn.tries
    assert d0 == d1 == d2  # one deadline for every try
    assert 0.01 <= t1 - t0 and 0.02 <= t2 - t1 < 1.0  # [d, 2d), d doubling (upper bound: a loaded CI)


def test_verdicts_give_up_at_once_and_pass_on():
    seen = []
    fn = Flaky(KeyError("moved"), ValueError("bad"))

    def on_error(e):
        seen.append(type(e))
        return AT_ONCE if isinstance(e, KeyError) else GIVE_UP

    t = time.monotonic()
    with pytest.raises(RetriesFailed) as failed:
        call_with_retries(fn, attempts=5, timeout=5.0, on_error=on_error, first_delay=1.0)
    assert time.monotonic() - t < 0.9  # AT_ONCE slept no back-off, GIVE_UP stopped
    assert seen == [KeyError, ValueError] and isinstance(failed.value.last, ValueError) and len(fn.tries) == 2

    err = ZeroDivisionError("fatal")
    with pytest.raises(ZeroDivisionError) as raised:  # None: the error itself, unchanged
        call_with_retries(Flaky(err), attempts=3, timeout=5.0, on_error=lambda e: None)
    assert raised.value is err


def test_attempts_and_the_deadline_bound_the_call():
    fn = Flaky(*[OSError()] * 10)
    with pytest.raises(RetriesFailed):
        call_with_retries(fn, attempts=3, timeout=5.0, on_error=lambda e: RETRY, first_delay=0.001)
    assert len(fn.tries) == 3
    fn = Flaky(*[OSError()] * 10)
    t = time.monotonic()
    with pytest.raises(RetriesFailed):
        call_with_retries(fn, attempts=10, timeout=0.1, on_error=lambda e: RETRY, first_delay=0.05)
    assert time.monotonic() - t < 0.6 and len(fn.tries) < 10  # sleeps cut to the time left
    with pytest.raises(RetriesFailed, match="no time left") as failed:
        call_with_retries(fn, attempts=3, timeout=0.0, on_error=lambda e: RETRY)
    assert failed.value.last is None


def test_cool_off_for_every_caller_and_per_key():
    c = CoolOff(0.05)
    assert c.allow() and c.allow("slot-1") and not c.tripped
    assert c.trip("slot-1") is True and c.trip("slot-1") is False
    assert not c.allow("slot-1") and c.allow("slot-2")  # keys cool off one by one
    time.sleep(0.06)
    assert c.allow("slot-1") and c.allow("slot-1")  # over: every caller may try


def test_one_probe_lets_one_caller_through_at_a_time_until_reset():
    c = CoolOff(0.05, one_probe=True)
    c.trip()
    assert not c.allow() and not c.closed()
    time.sleep(0.06)
    assert c.allow() and not c.allow()  # the prober, then fail fast while it probes
    time.sleep(0.06)
    assert c.allow()  # its probe failed (no reset): the next due probe
    c.reset()
    assert c.closed() and not c.tripped and c.allow() and c.allow()


def test_the_clients_use_it():
    """The HF3FS metadata clients and the Mooncake store's session retry and cool off through this module."""
    import inspect

    from kvconnect.connectors.hf3fs import client, redis_index
    from kvconnect.connectors.mooncake import session  # the store's calls and health circuit

    for mod in (client, redis_index, session):
        src = inspect.getsource(mod)
        assert "from kvconnect.connectors.retry import" in src and "random.random()" not in src, mod.__name__
    assert "time.sleep(" not in inspect.getsource(client)  # every back-off of the metadata client is retry's
    assert retry.FIRST_DELAY == 0.02
