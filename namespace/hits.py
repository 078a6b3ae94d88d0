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
    """Only the last N pages matter (Mamba / SWA state); all N present or nothing."""

    @classmethod
    def parse(cls, value: "str | HitPolicy") -> "HitPolicy":
        if isinstance(value, HitPolicy):
            return value
        v = getattr(value, "value", value)
        try:
            return cls(str(v).lower())
        except ValueError:
            from connectors.base import ConfigError

            raise ConfigError("hit_policy", f"invalid value {value!r}", [p.value for p in cls]) from None


def leading_hits(present: Sequence[bool]) -> int:
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def count_hits(present: Sequence[bool], policy: "HitPolicy | str" = HitPolicy.PREFIX,
               trailing: int | None = None) -> int:
    """Number of usable pages.

    Args:
        present: per-page existence, in page order.
        policy: a ``HitPolicy`` (or its value / SGLang's ``PoolHitPolicy``).
        trailing: for ``TRAILING_PAGES``, how many trailing pages are needed (default: all of
            ``present``, which is how SGLang passes only the trailing keys).
    Returns:
        PREFIX / ALL_PAGES: the number of pages usable from the start; TRAILING_PAGES: N when
        the last N pages are all present, else 0.
    """
    policy = HitPolicy.parse(policy)
    if policy is HitPolicy.TRAILING_PAGES:
        n = len(present) if trailing is None else trailing
        if n <= 0:
            return 0
        if n > len(present):
            return 0
        return n if all(present[-n:]) else 0
    return leading_hits(present)
