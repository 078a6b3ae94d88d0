"""Reading pages that lie in this process's own Mooncake segment with a parallel copy.

A process that lends memory to the store (``global_segment_size`` > 0, and with
``prefer_local_segment`` most of its own pages) reads those pages back through Mooncake's
local path: one memcpy worker thread per client (Mooncake 0.3.x), ~4 GiB/s on an H200 host,
slower than recomputing a long prefix. The replica's address is known to the client
(``batch_get_replica_desc``) and the memory is mapped in this very process, so kvconnect
copies it with its own copy threads (``kvconnect.connectors.buffers.copy_many``) instead.

Why this reads the same bytes Mooncake's own get would:
  * only replicas whose status is COMPLETE (a put has published all their bytes);
  * the descriptor query is the one Mooncake's get makes, and the master grants the same
    read lease with it (measured: a non-forced remove right after it returns
    OBJECT_HAS_LEASE); eviction and non-forced removes wait for the lease, so the bytes
    stay put while they are copied;
  * the copy must end within half the lease (``lease_ttl`` / 2, counted from *before* the
    query): a page copied later is reported a miss, never served (Mooncake's own get
    fails with LEASE_EXPIRED in the same case);
  * "own segment" is not guessed from names: at start a probe object with random bytes is
    put into the process's own segment, and the transport endpoint its replica reports
    counts as local only if the replica's address is mapped in this process and holds
    exactly those bytes.
"""

from __future__ import annotations

import ctypes
import logging
import secrets
from typing import Any, Iterator, Sequence

log = logging.getLogger("kvconnect.mooncake")

PROBE_BYTES = 64


def mappings() -> Iterator[tuple[int, int, str, int, str]]:
    """This process's memory mappings: (start, end, perms, file offset, path or '')."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            yield lo, hi, fields[1], int(fields[2], 16), fields[5].strip() if len(fields) > 5 else ""


def mapping_base(path: str, nbytes: int) -> int | None:
    """Start address of this process's mapping of the first ``nbytes`` of ``path`` (one
    mapping from file offset 0), else None."""
    for lo, hi, _, offset, mapped in mappings():
        if mapped == path and offset == 0 and hi - lo >= nbytes:
            return lo
    return None


def _readable(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` lies in one readable mapping of this process."""
    try:
        for lo, hi, perms, _, _ in mappings():
            if lo <= address and address + nbytes <= hi:
                return perms.startswith("r")
    except OSError:
        return False
    return False


def memory_replicas(replicas: Sequence[Any], nbytes: int) -> list[tuple[str, int]]:
    """(transport endpoint, address) of every COMPLETE memory replica of ``nbytes`` bytes."""
    found = []
    for r in replicas:
        if not r.is_memory_replica() or r.status.name != "COMPLETE":
            continue
        desc = r.get_memory_descriptor().buffer_descriptor
        if desc.size == nbytes:
            found.append((str(desc.transport_endpoint), int(desc.buffer_address)))
    return found


def find_own_endpoint(client: Any, replicate: Any, scratch_address: int) -> tuple[str | None, str]:
    """(the transport endpoint of this process's own segment, or None; why not).

    ``replicate`` must prefer this process's segment; ``scratch_address`` is
    ``PROBE_BYTES`` of registered memory the probe is put from. The probe object is
    force-removed afterwards."""
    token = secrets.token_bytes(PROBE_BYTES)
    key = f"__kvconnect_probe__/{client.get_hostname()}/{token[:8].hex()}"
    ctypes.memmove(scratch_address, token, PROBE_BYTES)
    try:
        rc = client.put_from(key, scratch_address, PROBE_BYTES, replicate)
        if rc != 0:
            return None, f"probe put returned {rc}"
        for endpoint, address in memory_replicas(client.get_replica_desc(key), PROBE_BYTES):
            if _readable(address, PROBE_BYTES) and ctypes.string_at(address, PROBE_BYTES) == token:
                return endpoint, ""
        return None, "the probe object was not placed in this process's segment"
    except Exception as e:  # noqa: BLE001 - a probe failure only disables the fast path
        return None, f"probe raised {type(e).__name__}: {e}"
    finally:
        try:
            client.remove(key, True)
        except Exception:  # noqa: BLE001
            pass
