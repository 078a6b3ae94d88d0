"""Process-wide Mooncake settings (environment variables) kvconnect chooses where the user
has not; every variable kvconnect sets lives here.

TCP queues (``apply_engine_defaults``, for every engine kvconnect creates):

Mooncake's TCP transport admits at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024)
queued plus ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1024) transfers per peer and fails
every transfer beyond that at once (QUEUE_FULL; the store reports TRANSFER_FAIL, -800).
One transfer is one buffer segment, and kvconnect hands Mooncake whole batches: 64 pages
of a 32-layer ``page_first_direct`` pool are 4096 segments, one 8k-token PD room of an
8B model 8192. Measured (0.3.13, TCP, one batch of 8192 4 KiB segments): with the
defaults most of the batch fails; with 65535 every segment lands byte-exact. The engine
reads these when it is created, so they are set before kvconnect creates one; a user's
own values are kept.

Timeouts (``apply_inline_timeouts``, for a Mooncake store with ``call_mode="inline"``):
derived from its ``op_timeout``; a later inline store's values replace an earlier one's,
a user's own values are kept.
"""

from __future__ import annotations

import os

TCP_QUEUE_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # Mooncake's upper limit for both
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


def apply_engine_defaults() -> None:
    """Set the variables above unless the environment already has them."""
    for name, value in TCP_QUEUE_DEFAULTS.items():
        os.environ.setdefault(name, value)


def mooncake_timeouts(op_timeout: float) -> dict[str, str]:
    """Mooncake's own timeouts (environment variables, default 30 s each) that bound an
    inline call: a stalled master fails the RPC, a stalled peer the transfer (TCP). Not
    always within ``op_timeout``: transfers queued behind a dropped lane wait their turn
    (measured bounds in ``docs/mooncake.md``). ``MC_TCP_STATUS_TIMEOUT_SEC`` is left alone:
    the progress timeout already ends such transfers, and a short status timeout makes
    Mooncake take a slow peer for one speaking its legacy protocol."""
    half_ms = max(int(op_timeout * 500), 200)
    # whole seconds, minimum 1; a stall is noticed within ~2 s more than this (measured)
    progress_s = max(int(op_timeout / 2) - 1, 1)
    return {
        "MC_RPC_TIMEOUT_MS": str(half_ms),  # every client->master RPC
        "MC_RPC_CONNECT_TIMEOUT_MS": str(half_ms),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(progress_s),  # no payload progress on a transfer
        "MC_TCP_ADMISSION_TIMEOUT_MS": str(half_ms),  # waiting for a lane to the peer
    }


# Timeout variables the user set before kvconnect ran (not those an earlier inline store set)
_USER_TIMEOUTS = frozenset(k for k in mooncake_timeouts(1.0) if k in os.environ)


def apply_inline_timeouts(op_timeout: float) -> None:
    """Set ``mooncake_timeouts(op_timeout)``, except the variables the user set."""
    for name, value in mooncake_timeouts(op_timeout).items():
        if name not in _USER_TIMEOUTS:
            os.environ[name] = value
