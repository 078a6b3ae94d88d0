"""kvconnect: KV-cache page stores shared across processes, nodes and engines.

Importing this package is cheap: stores and engine adapters import their heavy
dependencies only when selected (see ``connectors.registry``).
"""

from connectors.base import (  # noqa: F401
    BackendUnavailable,
    ConfigError,
    KVStoreError,
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
from connectors.registry import available_stores, create_store, register_store, store_class  # noqa: F401

__version__ = "0.1.0"
