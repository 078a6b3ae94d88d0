"""Key-space views of a store: namespacing as a wrapper (object_store's ``PrefixStore``).

``PrefixedStore(inner, prefix)`` is a ``PageStore`` whose key ``k`` is ``prefix + k`` on
``inner``: a caller of the view can neither name nor reach a key outside its prefix, and its
``clear()`` removes only what lies under the prefix. Integrations hold views and pass bare
keys (SGLang page hashes, LMCache chunk keys, a PD room's block names); the view builds the
store key. ``KeySpace`` (``kvconnect.namespace``) says what a prefix stands for.

Several views of one store in one round trip (a SGLang lookup across the KV and its side
pools, a batch of LMCache keys of several models): ``exists_many`` / ``get_many`` /
``put_many`` / ``delete_many`` group their calls by inner store.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvconnect.connectors.base import Page, PageStore, StoreUsage
from kvconnect.namespace import KeySpace


class PrefixedStore(PageStore):
    """``inner`` seen under ``prefix``; closing the view leaves ``inner`` open."""

    name = "prefixed"

    def __init__(self, inner: PageStore, prefix: str):
        super().__init__()
        if not prefix:
            raise ValueError("a key-space view needs a non-empty prefix")
        self.inner = inner
        self.prefix = prefix

    @classmethod
    def for_keyspace(cls, inner: PageStore, keyspace: KeySpace) -> "PrefixedStore":
        view = cls(inner, keyspace.prefix + "-")
        view.keyspace = keyspace
        return view

    def inner_keys(self, keys: Sequence[str]) -> list[str]:
        """The inner store's keys of ``keys`` (for batching helpers)."""
        p = self.prefix
        return [p + k for k in keys]

    def supports(self, capability) -> bool:
        """The inner store's (needs_registered_memory included: the medium is the inner store's)."""
        return self.inner.supports(capability)

    def add_eviction_listener(self, listener: Callable[[list[str]], None]) -> Callable[[], None]:
        """The inner store's evictions of keys under this prefix, as the view's keys."""
        p, n = self.prefix, len(self.prefix)

        def mine(keys: list[str]) -> None:
            own = [k[n:] for k in keys if k.startswith(p)]
            if own:
                listener(own)

        return self.inner.add_eviction_listener(mine)

    def _exists(self, keys: list[str]) -> list[bool]:
        return self.inner.exists(self.inner_keys(keys))

    def _get_into(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self.inner.get_into(self.inner_keys(keys), pages)

    def _put_from(self, keys: list[str], pages: list[Page]) -> list[bool]:
        return self.inner.put_from(self.inner_keys(keys), pages)

    def _delete(self, keys: list[str]) -> list[bool]:
        return self.inner.delete(self.inner_keys(keys))

    def _clear(self) -> None:
        self.inner.clear_prefix(self.prefix)

    def _clear_prefix(self, prefix: str) -> None:
        self.inner.clear_prefix(self.prefix + prefix)

    def _register_memory(self, address: int, nbytes: int) -> None:
        self.inner.register_memory(address, nbytes)

    def _usage(self) -> StoreUsage:
        return StoreUsage(extra={"prefix": self.prefix, "store": self.inner.name})

    def _close(self) -> None:
        """A view owns nothing."""

    def __repr__(self) -> str:
        return f"<PrefixedStore {self.prefix!r} of {self.inner!r}>"


def _grouped(calls: Sequence[tuple[PrefixedStore, Sequence[str]]],
             run: Callable[[PageStore, list[str], list[int]], list[bool]]) -> list[list[bool]]:
    """One ``run(inner, inner_keys, call_indices)`` per inner store; results split back per call."""
    out: list[list[bool]] = [[] for _ in calls]
    groups: dict[int, list[int]] = {}
    for i, (view, _) in enumerate(calls):
        groups.setdefault(id(view.inner), []).append(i)
    for members in groups.values():
        inner = calls[members[0]][0].inner
        keys: list[str] = []
        for i in members:
            keys += calls[i][0].inner_keys(calls[i][1])
        res = run(inner, keys, members) if keys else []
        pos = 0
        for i in members:
            n = len(calls[i][1])
            out[i] = list(res[pos:pos + n])
            pos += n
    return out


def exists_many(calls: Sequence[tuple[PrefixedStore, Sequence[str]]]) -> list[list[bool]]:
    """``view.exists(keys)`` for every ``(view, keys)``, one call per inner store."""
    return _grouped(calls, lambda inner, keys, _: inner.exists(keys))


def delete_many(calls: Sequence[tuple[PrefixedStore, Sequence[str]]]) -> list[list[bool]]:
    """``view.delete(keys)`` for every ``(view, keys)``, one call per inner store."""
    return _grouped(calls, lambda inner, keys, _: inner.delete(keys))


def get_many(calls: Sequence[tuple[PrefixedStore, Sequence[str], Sequence[Page]]]) -> list[list[bool]]:
    """``view.get_into(keys, pages)`` for every ``(view, keys, pages)``, one call per inner store."""
    pairs = [(v, k) for v, k, _ in calls]
    return _grouped(pairs, lambda inner, keys, members: inner.get_into(
        keys, [p for i in members for p in calls[i][2]]))


def put_many(calls: Sequence[tuple[PrefixedStore, Sequence[str], Sequence[Page]]]) -> list[list[bool]]:
    """``view.put_from(keys, pages)`` for every ``(view, keys, pages)``, one call per inner store."""
    pairs = [(v, k) for v, k, _ in calls]
    return _grouped(pairs, lambda inner, keys, members: inner.put_from(
        keys, [p for i in members for p in calls[i][2]]))
