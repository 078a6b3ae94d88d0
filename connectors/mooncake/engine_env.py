"""Process-wide Transfer Engine settings kvconnect chooses where the user has not.

Mooncake's TCP transport admits at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (1024)
queued plus ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1024) transfers per peer and fails
every transfer beyond that at once (QUEUE_FULL; the store reports TRANSFER_FAIL, -800).
One transfer is one buffer segment, and kvconnect hands Mooncake whole batches: 64 pages
of a 32-layer ``page_first_direct`` pool are 4096 segments, one 8k-token PD room of an
8B model 8192. Measured (0.3.13, TCP, one batch of 8192 4 KiB segments): with the
defaults most of the batch fails; with 65535 every segment lands byte-exact. The engine
reads these when it is created, so they are set before kvconnect creates one; a user's
own values are kept.
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
