"""kvconnect: KV-cache page stores shared across processes, nodes and engines.

Importing this package is cheap: stores and engine adapters import their heavy
dependencies only when selected (see ``kvconnect.connectors.registry``).
"""

if __name__ != "kvconnect.connectors":  # the repository root on sys.path makes the folder importable by itself
    raise ImportError(f"import kvconnect.connectors, not {__name__}: two copies of one module would not "
                      "share classes (kvconnect/connectors is a link to this folder)")


from kvconnect.connectors.base import (  # noqa: F401
    BackendUnavailable,
    Capability,
    ConfigError,
    InvalidKey,
    KVStoreError,
    MissingCapability,
    MissingDependency,
    NotFound,
    Page,
    PageStore,
    PageSizeMismatch,
    Segment,
    StoreClosed,
    StoreStats,
    UnknownConfigKey,
    UnknownStore,
    Unsupported,
)
from kvconnect.connectors.context import EngineContext  # noqa: F401
from kvconnect.connectors.registry import available_stores, create_store, register_store, store_class  # noqa: F401

__all__ = ["BackendUnavailable", "Capability", "ConfigError", "EngineContext", "InvalidKey", "KVStoreError",
           "MissingCapability", "MissingDependency", "NotFound", "Page", "PageSizeMismatch", "PageStore", "Segment", "StoreClosed",
           "StoreStats", "UnknownConfigKey", "UnknownStore", "Unsupported", "available_stores", "create_store",
           "register_store", "store_class"]
__version__ = "0.1.0"
