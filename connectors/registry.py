"""Stores by short name, imported lazily from ``"module:Class"`` strings; the one factory.

Importing ``kvconnect.connectors`` never imports an optional heavy dependency (mooncake,
grpc, torch, hf3fs bindings): a store's module is imported when the store is first
selected. Every store declares the modules it needs (``requires``) and the pip extra that
brings them; a store whose modules are missing, or whose import or construction fails on
a missing module, raises ``MissingDependency`` naming that extra, and ``kvconnect stores``
says which modules are missing without importing anything.

``create_store`` is the factory every integration goes through: it validates the options
with the store's typed config, checks the capabilities the integration requires
(``MissingCapability`` names the store and the capability), then builds the store with the
engine's ``EngineContext``.

Third-party stores: the ``kvconnect.stores`` entry-point group (``name = "pkg.mod:Class"``),
``register_store()``, or ``"pkg.mod:Class"`` in place of a name.

Every store may name its test harness (``harness``: ``"module:Class"`` of a
``kvconnect.connectors.testing.harness.StoreHarness``, which starts the store's services for
tests and says what it claims): by string only, so this module never imports a test kit.
Plugins name theirs in the ``kvconnect.harnesses`` entry-point group (same name as the store)
or with ``register_store(..., harness=...)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Mapping

from kvconnect.connectors.base import Capability, PageStore
from kvconnect.connectors.errors import ConfigError, MissingCapability, MissingDependency, UnknownStore, install_hint

if TYPE_CHECKING:
    from kvconnect.connectors.context import EngineContext


@dataclass(frozen=True)
class StoreSpec:
    name: str
    target: str  # "module:Class"
    extra: str | None  # pip extra that brings its dependencies
    summary: str
    requires: tuple[str, ...] = ()  # top-level modules the store cannot load without
    optional: tuple[tuple[str, str], ...] = ()  # (module, what needs it): features that need more
    harness: str | None = None  # "module:Class" of its test harness (kvconnect.connectors.testing.harness)

    def missing(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(required modules not installed, optional (module, feature) pairs not installed)."""
        absent = [m for m in self.requires if importlib.util.find_spec(m) is None]
        absent_opt = [(m, why) for m, why in self.optional if importlib.util.find_spec(m) is None]
        return absent, absent_opt


_BUILTIN: dict[str, StoreSpec] = {
    spec.name: spec
    for spec in (
        StoreSpec("memory", "kvconnect.connectors.memory:MemoryStore", None,
                  "in-process LRU store (reference, embedded default)",
                  harness="kvconnect.connectors.testing.harness:MemoryHarness"),
        StoreSpec("hf3fs", "kvconnect.connectors.hf3fs.store:HF3FSStore", "hf3fs",
                  "pages in files (3FS usrbio or POSIX) + page index (in-process or durable gRPC service)",
                  optional=(("grpc", "metadata_server_url"),),
                  harness="kvconnect.connectors.testing.store_harnesses:HF3FSHarness"),
        StoreSpec("mooncake", "kvconnect.connectors.mooncake.store:MooncakeStore", "mooncake",
                  "Mooncake Store (mooncake_master + client segments), zero-copy", ("mooncake",),
                  harness="kvconnect.connectors.testing.store_harnesses:MooncakeHarness"),
        StoreSpec("peer_rdma", "kvconnect.connectors.peer_rdma.store:PeerRdmaStore", "peer",
                  "peer memory pool: gRPC membership, one-sided reads via Mooncake TE",
                  ("grpc", "msgpack", "xxhash", "mooncake"),
                  harness="kvconnect.connectors.testing.store_harnesses:PeerRdmaHarness"),
    )
}

_lock = threading.Lock()
_registry: dict[str, StoreSpec] = dict(_BUILTIN)
_entry_points_loaded = False
ENTRY_POINT_GROUP = "kvconnect.stores"
HARNESS_ENTRY_POINT_GROUP = "kvconnect.harnesses"


def register_store(name: str, target: str, *, extra: str | None = None, summary: str = "",
                   requires: tuple[str, ...] = (), harness: str | None = None, replace: bool = False) -> None:
    """Register a store under ``name`` (``harness``: ``"module:Class"`` of its test harness).
    Duplicates are errors unless ``replace``."""
    for key, value in (("target", target), ("harness", harness)):
        if value is not None and ":" not in value:
            raise ValueError(f"store {key} must be 'module:Class', got {value!r}")
    with _lock:
        if name in _registry and not replace:
            raise ValueError(f"store {name!r} is already registered ({_registry[name].target})")
        _registry[name] = StoreSpec(name, target, extra, summary, requires, harness=harness)


def unregister_store(name: str) -> None:
    """Forget a store ``register_store`` added (tests that add one for a while); built-in
    stores stay."""
    if name in _BUILTIN:
        raise ValueError(f"store {name!r} is built in")
    with _lock:
        _registry.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    harnesses = {ep.name: ep.value for ep in entry_points(group=HARNESS_ENTRY_POINT_GROUP)}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        with _lock:
            if ep.name not in _registry:
                _registry[ep.name] = StoreSpec(ep.name, ep.value, None, f"plugin ({ep.value})",
                                               harness=harnesses.get(ep.name))


def available_stores() -> dict[str, StoreSpec]:
    _load_entry_points()
    with _lock:
        return dict(_registry)


def _own_module(missing: str | None, module_name: str) -> bool:
    """True when the module that failed to import is the target itself (a bad module path,
    not a missing extra)."""
    return bool(missing) and (missing == module_name or module_name.startswith(missing + "."))


def _import_target(target: str, *, store: str, extra: str | None) -> type[PageStore]:
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if _own_module(getattr(e, "name", None), module_name):
            raise ConfigError("module_path", f"cannot import {module_name!r}: {e}") from e
        raise MissingDependency(store, extra, e) from e
    try:
        cls = getattr(module, class_name)
    except AttributeError as e:
        raise ConfigError("class_name", f"{module_name!r} has no attribute {class_name!r}") from e
    if not (isinstance(cls, type) and issubclass(cls, PageStore)):
        raise ConfigError("class_name", f"{target} is not a PageStore subclass")
    return cls


def _spec(name: str) -> StoreSpec:
    if ":" in name:  # "pkg.mod:Class": an out-of-tree store named by its class
        return StoreSpec(name, name, None, "")
    stores = available_stores()
    if name not in stores:
        raise UnknownStore(name, stores)
    return stores[name]


def store_class(name: str) -> type[PageStore]:
    """The class registered under ``name`` (or named ``"pkg.mod:Class"``); imports it now."""
    spec = _spec(name)
    absent, _ = spec.missing()
    if absent:
        raise MissingDependency(name, spec.extra, ModuleNotFoundError(f"No module named {absent[0]!r}",
                                                                      name=absent[0]))
    return _import_target(spec.target, store=name, extra=spec.extra)


def dependency_status(name: str) -> tuple[bool, str]:
    """(loadable, detail) for ``kvconnect stores``: the declared modules first (nothing is
    imported while one is missing), then an import of the store's module, which also
    catches a dependency it never declared."""
    spec = _spec(name)
    absent, absent_opt = spec.missing()
    if absent:
        return False, f"missing {', '.join(absent)}: {install_hint(spec.extra)}"
    try:
        store_class(name)
    except MissingDependency as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001 - a report, not control flow
        return False, f"{type(e).__name__}: {e}"
    if absent_opt:
        needs = "; ".join(f"{why} needs {m}" for m, why in absent_opt)
        return True, f"ok; missing for {needs}: {install_hint(spec.extra)}"
    return True, "ok"


def check_capabilities(cls: type[PageStore], config: Any, name: str, require: Collection[Capability | str],
                       why: Mapping[Capability, str] | None = None, where: str | None = None) -> None:
    """``MissingCapability`` for the first capability in ``require`` that a ``cls`` store
    configured with ``config`` lacks; ``why[capability]`` says what the caller needs it for."""
    have = cls.capabilities_of(config)
    for cap in require:
        cap = Capability(cap)
        if cap not in have:
            reason = (why or {}).get(cap) or cap.meaning
            raise MissingCapability(name, cap.value, reason, cls.capability_hint(cap, config), where)


def create_store(name: str | None, options: Mapping[str, Any] | None = None, *,
                 context: "EngineContext | None" = None, require: Collection[Capability | str] = (),
                 why: Mapping[Capability, str] | None = None, where: str | None = None) -> PageStore:
    """Build a store by registry name, by ``"pkg.mod:Class"``, or by ``module_path`` /
    ``class_name`` in ``options``.

    Args:
        name: registry name (``"memory"``, ``"hf3fs"``, ...) or ``"pkg.mod:Class"``; None
            means take ``options["store"]``.
        options: the store's options (validated by its config class; unknown keys are errors).
        context: the engine process the store serves (ranks, pool, device), or None.
        require: capabilities the caller needs; a store without one is refused.
        why: per required capability, what the caller needs it for (for the error message).
        where: prefix for error messages (the integration).
    Raises:
        UnknownStore, ConfigError, MissingCapability, MissingDependency.
    """
    opts = dict(options or {})
    if name is None:
        name = opts.pop("store", None)
    if "module_path" in opts or "class_name" in opts:
        mod, cls_name = opts.pop("module_path", None), opts.pop("class_name", None)
        if not mod or not cls_name:
            raise ConfigError("module_path" if not mod else "class_name",
                              "both module_path and class_name are needed for an out-of-tree store")
        name = f"{mod}:{cls_name}"
    if not name:
        raise ConfigError("store", "is required", sorted(available_stores()))
    if not isinstance(name, str):
        raise ConfigError("store", f"expected a store name, got {name!r}", sorted(available_stores()))
    spec = _spec(name)
    cls = store_class(name)
    config = cls.config_from_options(opts)
    check_capabilities(cls, config, name, require, why, where)
    try:
        store = cls(config, context)  # type: ignore[call-arg]
    except ImportError as e:  # a dependency the store imports only when it starts
        if _own_module(getattr(e, "name", None), spec.target.partition(":")[0]) or isinstance(e, MissingDependency):
            raise
        raise MissingDependency(name, spec.extra, e) from e
    log_start(store)
    return store


def log_start(store: PageStore) -> None:
    """One INFO line in the engine's log (logger ``kvconnect``): what the store is and reaches."""
    try:
        details = store.describe()
    except Exception as e:  # noqa: BLE001 - a log line never stops a start
        details = f"({type(e).__name__} describing it: {e})"
    ctx = store.context.describe() if store.context is not None else "no engine context"
    logging.getLogger("kvconnect").info("kvconnect %s: %s%sfor %s", store.name, details, "; " if details else "", ctx)
