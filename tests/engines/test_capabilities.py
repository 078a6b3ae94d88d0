"""Every registered store's claimed capabilities, proven over its harness.

Real: each store's own services as its harness starts them (the HF3FS metadata service, a
``mooncake_master`` with a segment holder, a peer-pool seed node over TCP), store clients in
separate processes for ``shared`` and ``durable`` (``kvconnect.connectors.testing.peer.Worker``
driving any store). The module runs inside a loopback-only network namespace of its own
(``in_harness_namespace``), where every store's services start.
"""

from __future__ import annotations

from kvconnect.connectors.testing.conformance import CapabilityChecks
from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

store_harness = harness_fixture(namespace_run=True)
test_in_loopback_namespace = in_harness_namespace(__file__)


class TestCapabilities(CapabilityChecks):
    pass
