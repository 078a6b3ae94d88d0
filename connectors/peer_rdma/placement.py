"""Rendezvous (highest-random-weight) placement over the live members.

A key's owners are the ``n`` members with the highest ``xxh64(key, seed(member))``.
When a member leaves, only the keys it owned move (to the next-highest member, which
already holds a replica when ``directory_replicas >= 1``); when one joins, it takes over
only the keys it now wins. Every node computes this locally from its view.
"""

from __future__ import annotations

from functools import lru_cache

import xxhash


@lru_cache(maxsize=4096)
def _seed(node_id: str) -> int:
    return xxhash.xxh64_intdigest(node_id.encode())


def owners(key: str, members: list[str], n: int) -> list[str]:
    """The ``n`` owners of ``key`` among ``members``, best first."""
    if not members:
        return []
    kb = key.encode()
    if n == 1:
        return [max(members, key=lambda m: xxhash.xxh64_intdigest(kb, _seed(m)))]
    scored = sorted(members, key=lambda m: xxhash.xxh64_intdigest(kb, _seed(m)), reverse=True)
    return scored[:n]
