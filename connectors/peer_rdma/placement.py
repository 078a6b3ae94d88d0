"""Rendezvous (highest-random-weight) placement over the live members.

A key's owners are the ``n`` members with the highest ``xxh64(key, seed(member))``.
When a member leaves, only the keys it owned move (to the next-highest member, which
already holds a replica when ``directory_replicas >= 1``); when one joins, it takes over
only the keys it now wins. Every node computes this locally from its view.
"""

from __future__ import annotations

from functools import lru_cache

import xxhash


_M = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _seed(node_id: str) -> int:
    return xxhash.xxh64_intdigest(node_id.encode())


def _mix(x: int) -> int:
    """splitmix64's finaliser: a key hash XOR a member seed becomes an independent score."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M
    return x ^ (x >> 31)


def owners(key: str, members: list[str], n: int) -> list[str]:
    """The ``n`` owners of ``key`` among ``members``, best first."""
    if not members:
        return []
    h = xxhash.xxh64_intdigest(key.encode())
    if n == 1:
        return [max(members, key=lambda m: _mix(h ^ _seed(m)))]
    return sorted(members, key=lambda m: _mix(h ^ _seed(m)), reverse=True)[:n]
