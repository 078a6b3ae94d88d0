"""Hit policies: how many pages of a lookup an engine may use.

One function, ``count_hits``, serves every integration (SGLang HiCache v1/v2, LMCache
lookups, PD), mirroring SGLang's ``PoolHitPolicy`` and LMCache's contiguous-prefix rule.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence


class HitPolicy(str, Enum):
    PREFIX = "prefix"
    """The leading run of present pages (KV: a page is useless without all before it)."""
    ALL_PAGES = "all_pages"
    """Every page of the requested range must be present; else the leading run (clamps KV)."""
    TRAILING_PAGES = "trailing_pages"
    """Only the last N pages before the stop point matter (Mamba / SWA state)."""
    BLOCK_GROUPS = "block_groups"
    """Whole groups of ``group_pages`` pages from the start; a pool's own verdict that
    never gates the KV hit (SGLang 0.5.23 ``PoolHitPolicy.BLOCK_GROUPS``)."""

    @classmethod
    def parse(cls, value: "str | HitPolicy") -> "HitPolicy":
        if isinstance(value, HitPolicy):
            return value
        v = getattr(value, "value", value)
        try:
            return cls(str(v).lower())
        except ValueError:
            from kvconnect.connectors.base import ConfigError

            raise ConfigError("hit_policy", f"invalid value {value!r}", [p.value for p in cls]) from None


def leading_hits(present: Sequence[bool]) -> int:
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def restorable_prefixes(present: Sequence[bool], policy: "HitPolicy | str" = HitPolicy.PREFIX,
                        trailing: int | None = None, *, group_pages: int = 1) -> list[int]:
    """Prefix lengths (in pages, ascending) at which a load may stop.

    ``present[i]`` says whether page ``i`` of the span (from its first page) exists. This is
    SGLang 0.5.23's ``batch_exists_v2`` rule (``HiCacheFile`` and ``MooncakeStore`` agree):

    * PREFIX / ALL_PAGES: every ``p`` in ``1..leading_hits(present)``.
    * TRAILING_PAGES with ``trailing=N``: every ``p`` whose window
      ``present[max(0, p - N):p]`` is complete (``N`` is ``max(1, N)``, as SGLang does).
      A trailing pool can leave holes: 5 restorable while 4 is not. With ``trailing=None``
      ``present`` is the window itself: ``[len(present)]`` if all present, else ``[]``.
    * BLOCK_GROUPS: every ``p`` covered by the leading complete groups of ``group_pages``.
    """
    policy = HitPolicy.parse(policy)
    n = len(present)
    if policy is HitPolicy.TRAILING_PAGES:
        if trailing is None:
            return [n] if n and all(present) else []
        window = max(1, trailing)
        # A running count of misses inside the window keeps this O(n).
        out, misses = [], 0
        for p in range(1, n + 1):
            if not present[p - 1]:
                misses += 1
            if p - window - 1 >= 0 and not present[p - window - 1]:
                misses -= 1
            if misses == 0:
                out.append(p)
        return out
    if policy is HitPolicy.BLOCK_GROUPS:
        g = max(1, group_pages)
        lead = leading_hits(present)
        return list(range(1, (lead // g) * g + 1))
    return list(range(1, leading_hits(present) + 1))


def count_hits(present: Sequence[bool], policy: "HitPolicy | str" = HitPolicy.PREFIX,
               trailing: int | None = None, *, group_pages: int = 1) -> int:
    """Number of usable pages.

    Args:
        present: per-page existence, in page order.
        policy: a ``HitPolicy`` (or its value / SGLang's ``PoolHitPolicy``).
        trailing: for ``TRAILING_PAGES``, the window N (SGLang: ``len(transfer.keys)``);
            ``present`` then covers the whole span from its first page. None: ``present`` is
            the window itself (all present or nothing).
        group_pages: for ``BLOCK_GROUPS``, pages per group.
    Returns:
        The longest usable prefix, in pages: ``max(restorable_prefixes(...))`` or 0.
        PREFIX / ALL_PAGES: the leading run; TRAILING_PAGES: the longest ``p`` whose window
        of N pages ending at ``p`` is complete (SGLang 0.5.23 ``batch_exists_v2``).
    """
    policy = HitPolicy.parse(policy)
    if policy in (HitPolicy.PREFIX, HitPolicy.ALL_PAGES):
        return leading_hits(present)
    stops = restorable_prefixes(present, policy, trailing, group_pages=group_pages)
    return stops[-1] if stops else 0
