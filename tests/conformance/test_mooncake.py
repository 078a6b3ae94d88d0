"""Conformance: the Mooncake store against a real mooncake_master (loopback-only netns).

The outer run re-runs this module inside a namespace made for it (kvconnect.connectors.testing.mooncake).
The suite's pages are plain ``HostBuffer``s, never registered: they go through the
store's registered staging buffer. ``tests/integration/test_mooncake.py`` covers the
direct (registered, zero-copy) path, failures and two processes.
"""

import pytest

from kvconnect.connectors.testing.mooncake import INNER, outer_test

if not INNER:
    test_conformance_in_loopback_namespace = outer_test(__file__)
else:
    from kvconnect.connectors.registry import create_store
    from kvconnect.connectors.testing.conformance import PageStoreConformance
    from kvconnect.connectors.testing.mooncake import mooncake_cluster, store_options  # noqa: F401 - fixture

    class TestMooncakeStore(PageStoreConformance):
        store_name = "mooncake"
        capacity_bytes = None  # Mooncake evicts by watermark over its segments, not to a byte budget

        @pytest.fixture(autouse=True)
        def _cluster(self, mooncake_cluster):  # noqa: F811
            self.cluster = mooncake_cluster

        def store_options(self):
            return store_options(self.cluster)

        def make_store(self):
            return create_store("mooncake", self.store_options())

    class TestMooncakeStoreWithoutLocalCopy(TestMooncakeStore):
        """The same suite with ``local_copy`` off: every read goes through Mooncake's own get."""

        def store_options(self):
            return store_options(self.cluster, local_copy=False)
