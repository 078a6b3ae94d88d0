"""The errors every kvconnect module raises: one hierarchy, carrying context.

Data-path outcomes (hits, misses, failed writes) are values; exceptions are for misuse,
configuration and lifecycle. Every error is a ``KVStoreError`` and also the built-in
exception a caller would expect (``ConfigError`` is a ``ValueError``, ``MissingDependency``
an ``ImportError``, ...).
"""

from __future__ import annotations

from typing import Iterable


class KVStoreError(Exception):
    """Base of every error kvconnect raises."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing, unknown or invalid.

    The message always names the key and, where there is a closed set, the accepted values.
    """

    def __init__(self, key: str, problem: str, accepted: Iterable[str] | str | None = None,
                 where: str | None = None):
        self.key = key
        self.problem = problem
        self.where = where
        if accepted is not None and not isinstance(accepted, str):
            accepted = ", ".join(repr(a) for a in accepted)
        self.accepted = accepted
        msg = f"{where + ': ' if where else ''}config key {key!r}: {problem}"
        if accepted:
            msg += f" (accepted: {accepted})"
        super().__init__(msg)


class UnknownConfigKey(ConfigError):
    """A key that the store does not know (never silently dropped)."""

    def __init__(self, key: str, accepted: Iterable[str], where: str | None = None):
        super().__init__(key, "unknown key", sorted(accepted), where)


class UnknownStore(ConfigError):
    """A store name that is not registered."""

    def __init__(self, name: str, accepted: Iterable[str]):
        super().__init__("store", f"unknown store {name!r}", sorted(accepted))
        self.name = name


class MissingDependency(KVStoreError, ImportError):
    """An optional dependency of a store is not installed; names the extra to install."""

    def __init__(self, store: str, extra: str | None, cause: BaseException | None = None, *, kind: str = "store"):
        self.store = store
        self.extra = extra
        self.missing = getattr(cause, "name", None)
        hint = install_hint(extra)
        detail = f" ({cause})" if cause else ""
        super().__init__(f"{kind} {store!r} cannot be loaded{detail}: {hint}")


def install_hint(extra: str | None) -> str:
    """What to run for a missing extra."""
    return f'pip install "kvconnect[{extra}]"' if extra else "install its dependencies"


class MissingCapability(ConfigError):
    """An integration needs a capability the configured store does not have."""

    def __init__(self, store: str, capability: str, why: str, hint: str = "", where: str | None = None):
        self.store = store
        self.capability = capability
        problem = f"store {store!r} does not have the capability {capability!r}, which {why}"
        if hint:
            problem += f" ({hint})"
        super().__init__("store", problem, f"a store with the capability {capability!r}", where)


class Unsupported(KVStoreError, NotImplementedError):
    """An operation, layout or capability a store or adapter does not support."""

    def __init__(self, operation: str, adapter: str, accepted: Iterable[str] | None = None):
        self.operation = operation
        self.adapter = adapter
        msg = f"{adapter}: {operation} is not supported"
        if accepted is not None:
            msg += f" (supported: {', '.join(repr(a) for a in accepted)})"
        super().__init__(msg)


class BackendUnavailable(KVStoreError, ConnectionError):
    """The store's backend (service, master, peer) cannot be reached."""

    def __init__(self, store: str, detail: str):
        self.store = store
        super().__init__(f"{store}: backend unavailable: {detail}")


class StoreClosed(KVStoreError, RuntimeError):
    """The store was closed."""


class NotFound(KVStoreError, KeyError):
    """A key is not present (raised only by convenience APIs; the data path returns misses)."""


class InvalidKey(KVStoreError, ValueError):
    """A key breaks the key contract (``PageStore``: a non-empty ``str``, UTF-8 encodable, no
    newline or NUL, at most ``MAX_KEY_BYTES`` bytes): a caller's bug, refused by every store
    the same way before any backend call."""


class PageSizeMismatch(KVStoreError, ValueError):
    """The caller's page and the stored page differ in size."""
