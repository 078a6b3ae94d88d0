"""Rendezvous (highest-random-weight) placement over the live members.

A key's owners are the ``n`` members with the highest ``xxh64(key, seed(member))``.
When a member leaves, only the keys it owned move (to the next-highest member, which
already holds a replica when ``directory_replicas >= 1``); when one joins, it takes over
only the keys it now wins. Every node computes this locally from its view.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
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


VECTOR_FROM = 48  # members from which the scores are computed as one numpy array (~20x faster at 1,000)


@lru_cache(maxsize=16)
def _seed_array(members: tuple[str, ...]) -> np.ndarray:
    return np.fromiter((_seed(m) for m in members), dtype=np.uint64, count=len(members))


def _mix_array(x: np.ndarray) -> np.ndarray:
    """``_mix`` over an array (uint64 arithmetic wraps as ``& _M`` does)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def owners(key: str, members: list[str], n: int) -> list[str]:
    """The ``n`` owners of ``key`` among ``members``, best first."""
    if not members:
        return []
    h = xxhash.xxh64_intdigest(key.encode())
    if len(members) >= VECTOR_FROM:
        # the same scores as below (scores of distinct members never tie: _mix is a bijection)
        scores = _mix_array(_seed_array(tuple(members)) ^ np.uint64(h))
        if n == 1:
            return [members[int(scores.argmax())]]
        top = np.argpartition(scores, -n)[-n:] if n < len(members) else np.arange(len(members))
        return [members[int(i)] for i in top[np.argsort(scores[top])[::-1]]]
    if n == 1:
        return [max(members, key=lambda m: _mix(h ^ _seed(m)))]
    return sorted(members, key=lambda m: _mix(h ^ _seed(m)), reverse=True)[:n]
