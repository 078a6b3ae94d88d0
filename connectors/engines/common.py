"""Behaviour every engine adapter shares (SGLang HiCache, LMCache L2, SGLang PD).

* ``build_store``: a store from an engine's flat options dict, for the engine process its
  ``EngineContext`` describes and with the capabilities the integration needs. The engine's
  own keys are dropped (``ignore``), the adapter's keys (``store``, ``store_options``,
  ``tenant``, ``model_fingerprint``, ``metrics_port``, ``metrics_host`` + any
  ``engine_keys``) are split out, and every other key is a store option, validated by the
  store's typed config at construction. ``metrics_port`` is always this process's one
  Prometheus endpoint (a store takes no port of its own).
* ``guarded`` / ``safe_call``: an engine calls adapters from its own threads; an
  exception there kills a prefetch or backup thread or wedges a request. Data-path calls
  therefore catch everything, count it, log it (rate-limited) and return a miss.
* ``RateLimitedLog`` (from ``connectors/rate_limited_log.py``, stores use it too): one line per
  distinct problem per interval, so a dead backend does not flood the engine's log.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, TypeVar

from kvconnect.connectors.base import Capability, ConfigError, PageStore, UnknownConfigKey
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvconnect.engines")

T = TypeVar("T")

# Keys every adapter understands, next to the store's own options.
ADAPTER_KEYS = ("store", "store_options", "tenant", "model_fingerprint", "metrics_port", "metrics_host",
                "metrics_bind_host")  # metrics_bind_host: the older spelling of metrics_host


# ---------------------------------------------------------------------------------
# Rate-limited logging and error counting
# ---------------------------------------------------------------------------------


class ErrorCounter:
    """Thread-safe counts of exceptions an adapter swallowed, by operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, op: str, n: int = 1) -> None:
        with self._lock:
            self._counts[op] = self._counts.get(op, 0) + n

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


_default_rlog = RateLimitedLog(log)
_default_errors = ErrorCounter()


def safe_call(fn: Callable[..., T], *args: Any, default: Callable[[], T] | T, what: str,
              errors: ErrorCounter | None = None, rlog: RateLimitedLog | None = None,
              **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; on any exception: count, log (rate-limited), return ``default``.

    ``default`` may be a zero-argument callable (called only on failure).
    """
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - nothing may escape into engine threads
        (errors or _default_errors).add(what)
        (rlog or _default_rlog).error(f"{what}:{type(e).__name__}", "kvconnect %s failed, returning a miss: %s: %s",
                                      what, type(e).__name__, e, exc_info=True)
        return default() if callable(default) else default


def guarded(default: Callable[..., Any]):
    """Decorator for an adapter's data-path method: exceptions become ``default(self, *args)``.

    The instance may carry ``_errors`` (``ErrorCounter``) and ``_rlog`` (``RateLimitedLog``);
    ``default`` gets the method's arguments so it can size the miss (e.g. one False per key).
    """

    def deco(method: Callable[..., T]) -> Callable[..., T]:
        what = method.__name__

        @functools.wraps(method)
        def wrapper(self, *args: Any, **kwargs: Any) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - nothing may escape into engine threads
                getattr(self, "_errors", _default_errors).add(what)
                getattr(self, "_rlog", _default_rlog).error(
                    f"{what}:{type(e).__name__}", "kvconnect %s failed, returning a miss: %s: %s",
                    what, type(e).__name__, e, exc_info=True)
                try:
                    return default(self, *args, **kwargs)
                except Exception:  # noqa: BLE001 - a default that cannot size itself
                    return None  # type: ignore[return-value]

        return wrapper

    return deco


# ---------------------------------------------------------------------------------
# Building a store from an engine's options
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineOptions:
    """What an adapter read from an engine's options, besides the store's own."""

    store: str
    store_options: dict[str, Any]
    tenant: str = ""
    model_fingerprint: str = ""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    extra: dict[str, Any] = field(default_factory=dict)
    """The adapter-specific keys it asked for (``engine_keys``), raw."""


def _accepted_stores() -> list[str]:
    from kvconnect.connectors.registry import available_stores

    return sorted(available_stores())


def split_engine_options(options: Mapping[str, Any] | None, *, where: str,
                         ignore: Collection[str] = (), engine_keys: Collection[str] = ()) -> EngineOptions:
    """Split an engine's flat options into the adapter's keys and the store's options.

    Args:
        options: the engine's dict (e.g. SGLang's parsed extra config).
        where: prefix for error messages (``"sglang hicache"``).
        ignore: keys the engine itself owns; dropped, never passed to the store.
        engine_keys: adapter-specific keys to hand back in ``EngineOptions.extra``.
    Raises:
        ConfigError: ``store`` missing or not a string, ``store_options`` not an object, a key
            given both inline and in ``store_options``, a mistyped adapter key.
    """
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError("<root>", f"expected an object of options, got {type(options).__name__}", None, where)
    opts = {k: v for k, v in options.items() if k not in ignore}
    store = opts.pop("store", None)
    if store is None or store == "":
        raise ConfigError("store", "is required", _accepted_stores(), where)
    if not isinstance(store, str):
        raise ConfigError("store", f"expected a store name, got {store!r}", _accepted_stores(), where)

    nested = opts.pop("store_options", None)
    if nested is None:
        nested = {}
    if not isinstance(nested, Mapping):
        raise ConfigError("store_options", f"expected an object, got {nested!r}", None, where)

    def _str(key: str) -> str:
        v = opts.pop(key, "")
        if v is None:
            return ""
        if not isinstance(v, str):
            raise ConfigError(key, f"expected a string, got {v!r}", None, where)
        return v

    tenant = _str("tenant")
    fingerprint = _str("model_fingerprint")
    host, old_host = _str("metrics_host"), _str("metrics_bind_host")
    if host and old_host and host != old_host:
        raise ConfigError("metrics_host", f"given as {host!r} and as metrics_bind_host {old_host!r}",
                          "one of the two", where)
    host = host or old_host or "127.0.0.1"
    port = opts.pop("metrics_port", None)
    if port is not None:
        if isinstance(port, str) and port.strip().isdigit():
            port = int(port)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("metrics_port", f"expected a TCP port, got {port!r}", "an integer 0..65535", where)
    extra = {k: opts.pop(k) for k in list(opts) if k in engine_keys}

    store_options = dict(opts)
    for k, v in nested.items():
        if k in store_options:
            raise ConfigError(k, "given both inline and in 'store_options'", None, where)
        store_options[k] = v
    # "pkg.mod:Class" names an out-of-tree store (SGLang's module_path/class_name keys
    # name this adapter, so the store's cannot be spelled that way inline).
    if ":" in store:
        mod, _, cls = store.partition(":")
        store_options["module_path"], store_options["class_name"] = mod, cls
    return EngineOptions(store=store, store_options=store_options, tenant=tenant,
                         model_fingerprint=fingerprint, metrics_port=port, metrics_host=host, extra=extra)


def build_store(options: Mapping[str, Any] | None, *, where: str, ignore: Collection[str] = (),
                engine_keys: Collection[str] = (), context: EngineContext | None = None,
                require: Mapping[Capability, str] | None = None) -> tuple[PageStore, EngineOptions]:
    """The store an engine's options name, plus the adapter's own options.

    Args:
        context: the engine process the store serves.
        require: the capabilities the integration needs, each with what for; a store
            without one is refused (``MissingCapability``), before it starts.

    Errors are raised here, at construction, and name the key and the accepted values:
    an unknown store lists the registered stores; an unknown option lists the store's
    options and the adapter's keys.
    """
    from kvconnect.connectors.registry import create_store

    eo = split_engine_options(options, where=where, ignore=ignore, engine_keys=engine_keys)
    name = None if ":" in eo.store else eo.store
    try:
        store = create_store(name, eo.store_options, context=context, require=tuple(require or ()), why=require,
                             where=where)
    except ConfigError as e:
        if name is None and e.key in ("module_path", "class_name"):
            # The user wrote "store": "pkg.mod:Class"; name that key, not our translation.
            raise ConfigError("store", f"{eo.store!r}: {e.problem}", "a registered store name or 'module:Class'",
                              where) from e
        if not isinstance(e, UnknownConfigKey) or name is None:
            raise
        from kvconnect.connectors.config import config_fields
        from kvconnect.connectors.registry import store_class

        accepted = set(ADAPTER_KEYS) | set(engine_keys) | set(config_fields(store_class(name).config_class))
        raise UnknownConfigKey(e.key, sorted(accepted), f"{where}: store {eo.store!r}") from e
    return store, eo


def serve_store_metrics(store: PageStore, port: int | None, host: str = "127.0.0.1", **labels: str) -> int | None:
    """Export ``store.stats()`` to Prometheus and, if ``port`` is set, serve ``/metrics`` on
    ``host`` (127.0.0.1 unless the operator says otherwise).

    A port that cannot be bound is logged, not raised: metrics never stop an engine.
    Returns the bound port (None when not serving).
    """
    from kvconnect.connectors import metrics

    try:
        metrics.export_store(store, **labels)
        if port is None:
            return None
        return metrics.serve_metrics(port, host=host)
    except Exception as e:  # noqa: BLE001 - metrics are optional
        log.error("kvconnect: cannot serve metrics on port %s: %s", port, e)
        return None


# ---------------------------------------------------------------------------------
# Diagnosing stalls of an engine process
# ---------------------------------------------------------------------------------

STACKS_EVERY_ENV = "KVCONNECT_DUMP_STACKS_S"
STACKS_DIR_ENV = "KVCONNECT_DUMP_STACKS_DIR"


def start_stack_dumps() -> Any:
    """If ``KVCONNECT_DUMP_STACKS_S`` is set (seconds), a daemon thread appends every thread's
    Python stack of this process to ``$KVCONNECT_DUMP_STACKS_DIR/stacks-<pid>.log`` (default: the
    temp directory) at that interval until ``stop_stack_dumps``: where an engine's threads are
    while it stalls. The thread takes the GIL like any other (``faulthandler``'s timed dumps read
    other threads' frames without it and can crash a busy process), so a dump that comes late
    means something held the GIL. Off by default; a bad value is logged and ignored."""
    import os
    import sys
    import tempfile
    import traceback

    every = os.environ.get(STACKS_EVERY_ENV, "")
    if not every:
        return None
    try:
        seconds = float(every)
        if not 0.05 <= seconds <= 3600:
            raise ValueError("out of 0.05..3600")
        path = os.path.join(os.environ.get(STACKS_DIR_ENV) or tempfile.gettempdir(), f"stacks-{os.getpid()}.log")
        out = open(path, "a")
    except (ValueError, OSError) as e:
        log.error("kvconnect: %s=%r: %s; no stack dumps", STACKS_EVERY_ENV, every, e)
        return None
    stop = threading.Event()

    def dump() -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        while not stop.wait(seconds):
            lines = [f"--- {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}\n"]
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                lines.append(f"Thread {names.get(ident) or ident}:\n")
                lines.extend(traceback.format_stack(frame))
            out.write("".join(lines))
            out.flush()
            names = {t.ident: t.name for t in threading.enumerate()}

    thread = threading.Thread(target=dump, name="kvconnect-stack-dumps", daemon=True)
    thread.start()
    log.warning("kvconnect: dumping every thread's stack every %.2f s to %s (%s)", seconds, path, STACKS_EVERY_ENV)
    return stop, thread, out


def stop_stack_dumps(handle: Any) -> None:
    if handle is None:
        return
    stop, thread, out = handle
    stop.set()
    thread.join(5)
    out.close()
