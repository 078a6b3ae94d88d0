"""Store harnesses: one per store, so that every suite runs over every store without a chain.

A ``StoreHarness`` is what a test needs of one store: it starts and stops the store's
services (a metadata service, a master, a seed node; nothing for ``memory``), gives the
options of engine instance ``i`` of several sharing the store, says where the store's
clients must run (``exec_prefix()``: Mooncake-based stores listen on every interface, so
their clients run inside a loopback-only network namespace), restarts the services
(``restart()``, for the ``durable`` check) and declares the capabilities it claims (those
of its store configured with its options, ``claims``).

Each store names its harness in its registry entry (``harness="module:Class"``, see
``kvconnect.connectors.registry``; plugins: the ``kvconnect.harnesses`` entry-point group or
``register_store(..., harness=...)``). ``harness_names()`` lists every registered store that
has one; ``harness_class(name)`` imports it.

Using them from a test module (the engine suites, the capability checks and any new test
file do it this way)::

    from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

    store_harness = harness_fixture()                   # module-scoped, one param per store
    test_in_loopback_namespace = in_harness_namespace(__file__)

    def test_round_trip(store_harness):
        store = create_store(None, store_harness.options(0))
        ...

``in_harness_namespace`` re-runs the module in a loopback-only namespace made for it (the
module's tests run there, in one process, with every store's services started inside it);
outside that run, harnesses that need a namespace are skipped with that reason, which the
outer test's own result covers.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from kvconnect.connectors.base import Capability

NS_ENV = "KVCONNECT_HARNESS_NS"
"""Set (to the namespace's name) in a test run that ``in_harness_namespace`` started inside
a loopback-only namespace made for it: harnesses then start their services right here."""


def inside_harness_namespace() -> bool:
    return bool(os.environ.get(NS_ENV))


class StoreHarness:
    """One store's services for tests, and the options of the engine instances that share it.

    Subclasses set ``store`` (registry name) and implement ``_start`` / ``_stop`` /
    ``options``; ``restart`` and ``skip_reason`` when they have something to say.

    Attributes:
        store: the registry name of the store.
        needs_namespace: the store's clients must run inside a network namespace made for
            the test (stores built on Mooncake, whose listeners bind every interface).
        restart_keeps: what ``restart()`` restarts, for the ``durable`` check's message.
    """

    store: ClassVar[str] = ""
    needs_namespace: ClassVar[bool] = False
    restart_keeps: ClassVar[str] = "nothing to restart (the store has no services)"
    variants: ClassVar[tuple[str, ...]] = ("",)
    """Configurations worth proving besides the default ``""`` (the cheapest real one)."""

    def __init__(self, workdir: str | os.PathLike | None = None, variant: str = "", *, netns: Any = None,
                 capacity: int | None = None):
        """``netns``: a ``Netns`` to start the services in (its processes are the clients; the
        caller removes it); ``capacity``: bytes the store's services hold (None: a small default)."""
        self.netns = netns
        self.capacity = capacity
        if variant not in self.variants:
            raise ValueError(f"harness {self.store!r}: variant {variant!r} (accepted: "
                             f"{', '.join(repr(v) for v in self.variants)})")
        self.variant = variant
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"kvc-{self.store or 'store'}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started = False

    # -- to provide -------------------------------------------------------------
    @classmethod
    def skip_reason(cls) -> str | None:
        """Why this store cannot run here (a package or namespaces missing), or None."""
        return None

    def _start(self) -> None:
        """Start the store's services."""

    def _stop(self) -> None:
        """Stop them (idempotent, never raises for a service already gone)."""

    def options(self, instance: int = 0) -> dict[str, Any]:
        """``create_store`` options (``store`` included) of engine instance ``instance``:
        every instance shares the same store, each with options of its own (ports, segments)."""
        raise NotImplementedError

    def sized_options(self, nbytes: int) -> dict[str, Any] | None:
        """Options of instance 0 holding about ``nbytes`` of pages (small: a test makes it
        evict; large: a benchmark's working set fits), or None where the store cannot be sized."""
        return None

    def restart(self) -> None:
        """Restart the store's services (kill, then start on the same state); pages a
        ``durable`` store held must be found again after it."""

    def outage(self) -> None:
        """Kill the store's services and leave them down (outage tests); clients must turn
        it into misses in bounded time."""

    # -- common -------------------------------------------------------------------
    @property
    def claims(self) -> frozenset[Capability]:
        """The capabilities the store claims, configured as ``options(0)`` configures it."""
        from kvconnect.connectors.registry import store_class

        opts = dict(self.options(0))
        cls = store_class(opts.pop("store"))
        return cls.capabilities_of(cls.config_from_options(opts))

    netns: Any = None
    """The ``Netns`` the store's services and clients run in, or None (this process's namespace)."""

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a process where the store's clients may run ([] here)."""
        return self.netns.exec_prefix() if self.netns is not None else []

    @property
    def in_process(self) -> bool:
        """Whether this process may build the store's clients itself."""
        return self.netns is None and (not self.needs_namespace or inside_harness_namespace())

    def start(self) -> "StoreHarness":
        why = self.skip_reason()
        if why:
            raise RuntimeError(f"store {self.store!r} cannot run here: {why}")
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        self.started = True
        return self

    def stop(self) -> None:
        self._stop()
        self.started = False
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "StoreHarness":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def label(self) -> str:
        return f"{self.store}-{self.variant}" if self.variant else self.store

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label} at {self.workdir}>"


class MemoryHarness(StoreHarness):
    """``memory``: nothing to start; every instance is a store of its own (one process's memory)."""

    store = "memory"

    def options(self, instance: int = 0) -> dict[str, Any]:
        return {"store": "memory", "capacity": self.capacity or "64mb"}

    def sized_options(self, nbytes: int) -> dict[str, Any] | None:
        return {"store": "memory", "capacity": nbytes}


# ---------------------------------------------------------------------------------
# The registered harnesses, and the pytest pieces
# ---------------------------------------------------------------------------------


def harness_names() -> list[str]:
    """Registry names of the stores that name a harness, registration order."""
    from kvconnect.connectors.registry import available_stores

    return [name for name, spec in available_stores().items() if spec.harness]


def harness_class(name: str) -> type[StoreHarness]:
    """The harness class store ``name``'s registry entry names (imported now)."""
    from kvconnect.connectors.registry import available_stores

    spec = available_stores().get(name)
    if spec is None or not spec.harness:
        raise LookupError(f"store {name!r} names no test harness (registry entry 'harness'); "
                          f"stores with one: {', '.join(harness_names())}")
    module, _, cls_name = spec.harness.partition(":")
    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, StoreHarness)):
        raise TypeError(f"{spec.harness} (harness of store {name!r}) is not a StoreHarness")
    return cls


def harness_params(names: list[str] | None = None, variants: bool = True) -> list[tuple[str, str]]:
    """(store, variant) of every registered harness (or of ``names``), with every variant
    unless ``variants`` is False."""
    out = []
    for name in harness_names() if names is None else names:
        try:
            cls = harness_class(name)
        except (ImportError, LookupError):  # missing imports, or registered later: the fixture says so
            out.append((name, ""))
            continue
        out += [(name, v) for v in (cls.variants if variants else ("",))]
    return out


def harness_fixture(names: list[str] | None = None, scope: str = "module", *, variants: bool = True,
                    namespace_run: bool = False, child_clients: bool = False):
    """A pytest fixture, parametrized over ``names`` (default: every registered harness;
    every variant unless ``variants`` is False), that yields a started harness and stops it
    after the last test of its scope.

    A harness whose store cannot run here is skipped with its reason; one that needs a
    network namespace is skipped outside ``in_harness_namespace``'s run (which runs it), and
    with ``namespace_run`` every harness is (the module runs its store tests only there).
    ``child_clients``: the tests build no store client themselves, only child processes
    under ``harness.exec_prefix()``, so every harness runs here (fenced ones in a namespace
    of their own)."""
    import pytest

    params = harness_params(names, variants)
    ids = [f"{n}-{v}" if v else n for n, v in params]
    # Outside the namespace run, the tests of a harness that runs only inside it carry
    # NAMESPACE_ONLY: tests/conftest.py deselects them there (the outer test runs them inside)
    # instead of reporting each as skipped.
    def namespace_only(name: str) -> bool:
        try:
            fenced = harness_class(name).needs_namespace and not child_clients
        except LookupError:  # registered later (a test's own store): the fixture decides at run time
            fenced = False
        return namespace_run or fenced

    marked = [pytest.param(p, id=i, marks=pytest.mark.namespace_only) if namespace_only(p[0]) else
              pytest.param(p, id=i) for p, i in zip(params, ids)]

    @pytest.fixture(scope=scope, params=marked)
    def store_harness(request, tmp_path_factory):
        name, variant = request.param
        fenced = harness_class(name).needs_namespace and not child_clients
        if (namespace_run or fenced) and not inside_harness_namespace():
            pytest.skip(f"{name} runs inside the module's own loopback namespace (in_harness_namespace)")
        cls = harness_class(name)
        why = cls.skip_reason()
        if why:
            pytest.skip(why)
        harness = cls(tmp_path_factory.mktemp(name.replace(":", "_")), variant)
        with harness:
            yield harness

    return store_harness


def in_harness_namespace(module_file: str, timeout: float = 600, skip_reason=None):
    """The test that re-runs ``module_file`` inside a fresh loopback-only namespace with
    ``NS_ENV`` set, where every harness starts its services (and every store client runs);
    None in that run (assigned to a ``test_*`` name, pytest then collects nothing).
    ``skip_reason``: why the inner run could not run anything here (default: namespaces
    cannot be made)."""
    from kvconnect.connectors.testing.netns import netns_available, outer_test

    if inside_harness_namespace():
        return None
    return outer_test(module_file, NS_ENV, skip_reason or netns_available, prefix="kvc-h", timeout=timeout)

