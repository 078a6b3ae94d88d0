"""Stores by short name, imported lazily from ``"module:Class"`` strings.

Importing ``connectors`` never imports an optional heavy dependency (mooncake, grpc,
torch, hf3fs bindings): a store's module is imported when the store is first selected, and
an ``ImportError`` of a third-party module becomes ``MissingDependency`` naming the extra.

Third-party stores: the ``kvconnect.stores`` entry-point group (``name = "pkg.mod:Class"``),
``register_store()``, or ``{"module_path": "pkg.mod", "class_name": "Class"}`` in options.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from kvconnect.connectors.base import ConfigError, MissingDependency, PageStore, UnknownStore


@dataclass(frozen=True)
class StoreSpec:
    name: str
    target: str  # "module:Class"
    extra: str | None  # pip extra that brings its dependencies
    summary: str
    requires: tuple[str, ...] = ()  # top-level modules it needs (for `kvconnect stores`)


_BUILTIN: dict[str, StoreSpec] = {
    spec.name: spec
    for spec in (
        StoreSpec("memory", "kvconnect.connectors.memory:MemoryStore", None,
                  "in-process LRU store (reference, embedded default)"),
        StoreSpec("hf3fs", "kvconnect.connectors.hf3fs.store:HF3FSStore", "hf3fs",
                  "pages in files (3FS usrbio or POSIX) + page index (in-process or durable gRPC service)"),
        StoreSpec("mooncake", "kvconnect.connectors.mooncake.store:MooncakeStore", "mooncake",
                  "Mooncake Store (mooncake_master + client segments), zero-copy", ("mooncake",)),
        StoreSpec("peer_rdma", "kvconnect.connectors.peer_rdma.store:PeerRdmaStore", "peer",
                  "peer memory pool: gRPC membership, one-sided reads via Mooncake TE", ("grpc", "mooncake")),
    )
}

_lock = threading.Lock()
_registry: dict[str, StoreSpec] = dict(_BUILTIN)
_entry_points_loaded = False
ENTRY_POINT_GROUP = "kvconnect.stores"


def register_store(name: str, target: str, *, extra: str | None = None, summary: str = "",
                   requires: tuple[str, ...] = (), replace: bool = False) -> None:
    """Register a store under ``name``. Duplicates are errors unless ``replace``."""
    if ":" not in target:
        raise ValueError(f"store target must be 'module:Class', got {target!r}")
    with _lock:
        if name in _registry and not replace:
            raise ValueError(f"store {name!r} is already registered ({_registry[name].target})")
        _registry[name] = StoreSpec(name, target, extra, summary, requires)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        with _lock:
            if ep.name not in _registry:
                _registry[ep.name] = StoreSpec(ep.name, ep.value, None, f"plugin ({ep.value})")


def available_stores() -> dict[str, StoreSpec]:
    _load_entry_points()
    with _lock:
        return dict(_registry)


def _import_target(target: str, *, store: str, extra: str | None) -> type[PageStore]:
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        # Our own module missing is a bug or a bad module_path, not a missing extra.
        if missing and (missing == module_name or module_name.startswith(missing + ".")):
            raise ConfigError("module_path", f"cannot import {module_name!r}: {e}") from e
        raise MissingDependency(store, extra, e) from e
    try:
        cls = getattr(module, class_name)
    except AttributeError as e:
        raise ConfigError("class_name", f"{module_name!r} has no attribute {class_name!r}") from e
    if not (isinstance(cls, type) and issubclass(cls, PageStore)):
        raise ConfigError("class_name", f"{target} is not a PageStore subclass")
    return cls


def store_class(name: str) -> type[PageStore]:
    """The class registered under ``name`` (imports its module now)."""
    stores = available_stores()
    if name not in stores:
        raise UnknownStore(name, stores)
    spec = stores[name]
    return _import_target(spec.target, store=name, extra=spec.extra)


def dependency_status(name: str) -> tuple[bool, str]:
    """(importable, detail) without raising: for ``kvconnect stores``."""
    try:
        store_class(name)
        return True, "ok"
    except MissingDependency as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001 - a report, not control flow
        return False, f"{type(e).__name__}: {e}"


def create_store(name: str | None, options: Mapping[str, Any] | None = None, **context: Any) -> PageStore:
    """Build a store by registry name (or by ``module_path``/``class_name`` in ``options``).

    Args:
        name: registry name (``"memory"``, ``"hf3fs"``, ...); None means take ``options["store"]``.
        options: the store's options (validated by its config class; unknown keys are errors).
        context: keyword arguments the engine adapter passes to the constructor (e.g. rank).
    """
    opts = dict(options or {})
    if name is None:
        name = opts.pop("store", None)
    if "module_path" in opts or "class_name" in opts:
        mod, cls_name = opts.pop("module_path", None), opts.pop("class_name", None)
        if not mod or not cls_name:
            raise ConfigError("module_path" if not mod else "class_name",
                              "both module_path and class_name are needed for an out-of-tree store")
        cls = _import_target(f"{mod}:{cls_name}", store=name or cls_name, extra=None)
        return cls.from_options(opts, **context)
    if not name:
        raise ConfigError("store", "is required", sorted(available_stores()))
    if not isinstance(name, str):
        raise ConfigError("store", f"expected a store name, got {name!r}", sorted(available_stores()))
    return store_class(name).from_options(opts, **context)
