"""Conformance: the in-process reference store."""

from kvconnect.connectors.memory import MemoryStore, MemoryStoreConfig
from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance


class TestMemoryStore(PageStoreConformance):
    store_name = "memory"
    capacity_bytes = 64 * PAGE

    def make_store(self):
        return MemoryStore(MemoryStoreConfig(capacity=self.capacity_bytes))

    def store_options(self):
        return {"capacity": self.capacity_bytes}
