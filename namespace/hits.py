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
    """A pool holding a second form of the FULL pages (e.g. compressed blocks): each block
    of ``block_pages`` FULL pages from the span start is one group of ``group_pages`` of
    the pool's own keys; the pool's verdict is the FULL pages its leading complete groups
    cover, and it never gates the KV hit (SGLang 0.5.23 ``PoolHitPolicy.BLOCK_GROUPS``)."""

    @classmethod
    def parse(cls, value: "str | HitPolicy") -> "HitPolicy":
        if isinstance(value, HitPolicy):
            return value
        v = getattr(value, "value", value)
        try:
            return cls(str(v).lower())
        except ValueError:
            accepted = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"config key 'hit_policy': invalid value {value!r} (accepted: {accepted})") from None


def leading_hits(present: Sequence[bool]) -> int:
    if type(present) is list:  # a store's answer: at C speed (SGLang asks on its lookup path)
        n = present.count(True)
        if n == len(present):
            return n
        if n + present.count(False) == len(present):  # only True / False (or 1 / 0)
            return present.index(False)
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def block_group_pages(present: Sequence[bool], group_pages: int, block_pages: int = 0,
                      span_pages: int | None = None) -> int:
    """FULL pages covered by the leading complete groups of a BLOCK_GROUPS pool.

    ``present[k]`` says whether the pool's key ``k`` exists; keys come in groups of
    ``group_pages`` (at least 1), one group per block of ``block_pages`` FULL pages (0: as
    many as the group has keys). A trailing partial group covers nothing. The result is
    clamped to ``span_pages`` when given.
    """
    g = max(1, group_pages)
    b = block_pages if block_pages > 0 else g
    groups = leading_hits(present) // g
    covered = groups * b
    return covered if span_pages is None else min(covered, span_pages)


def restorable_prefixes(present: Sequence[bool], policy: "HitPolicy | str" = HitPolicy.PREFIX,
                        trailing: int | None = None, *, group_pages: int = 1, block_pages: int = 0) -> list[int]:
    """Prefix lengths (in pages, ascending) at which a load may stop.

    ``present[i]`` says whether page ``i`` of the span (from its first page) exists. This is
    SGLang 0.5.23's ``batch_exists_v2`` rule (``HiCacheFile`` and ``MooncakeStore`` agree):

    * PREFIX / ALL_PAGES: every ``p`` in ``1..leading_hits(present)``.
    * TRAILING_PAGES with ``trailing=N``: every ``p`` whose window
      ``present[max(0, p - N):p]`` is complete (``N`` is ``max(1, N)``, as SGLang does).
      A trailing pool can leave holes: 5 restorable while 4 is not. With ``trailing=None``
      ``present`` is the window itself: ``[len(present)]`` if all present, else ``[]``.
    * BLOCK_GROUPS: ``present`` holds the pool's own keys; the block boundaries its leading
      complete groups cover (``block_group_pages``).
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
        b = block_pages if block_pages > 0 else max(1, group_pages)
        return list(range(b, block_group_pages(present, group_pages, block_pages) + 1, b))
    return list(range(1, leading_hits(present) + 1))


def count_hits(present: Sequence[bool], policy: "HitPolicy | str" = HitPolicy.PREFIX,
               trailing: int | None = None, *, group_pages: int = 1, block_pages: int = 0) -> int:
    """Number of usable pages.

    Args:
        present: per-page existence, in page order.
        policy: a ``HitPolicy`` (or its value / SGLang's ``PoolHitPolicy``).
        trailing: for ``TRAILING_PAGES``, the window N (SGLang: ``len(transfer.keys)``);
            ``present`` then covers the whole span from its first page. None: ``present`` is
            the window itself (all present or nothing).
        group_pages, block_pages: for ``BLOCK_GROUPS``, the pool's keys per group and FULL
            pages per block (``present`` is then per pool key).
    Returns:
        The longest usable prefix, in pages: ``max(restorable_prefixes(...))`` or 0.
        PREFIX / ALL_PAGES: the leading run; TRAILING_PAGES: the longest ``p`` whose window
        of N pages ending at ``p`` is complete (SGLang 0.5.23 ``batch_exists_v2``).
    """
    policy = HitPolicy.parse(policy)
    if policy in (HitPolicy.PREFIX, HitPolicy.ALL_PAGES):
        return leading_hits(present)
    if policy is HitPolicy.BLOCK_GROUPS:
        return block_group_pages(present, group_pages, block_pages)
    stops = restorable_prefixes(present, policy, trailing, group_pages=group_pages)
    return stops[-1] if stops else 0
