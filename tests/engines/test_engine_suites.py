"""Every engine integration over every registered store: the engine suites of
``kvconnect.connectors.testing.engine_suites`` (SGLang HiCache adapter, LMCache L2 plugin, PD
relay), parametrized by ``harness_fixture``.

Real: SGLang 0.5.23's storage factory and CPU host pools, LMCache 0.5.6's plugin factory and
memory objects, the PD relay's data plane, and each store's services as its harness starts
them. The module runs in one process inside a loopback-only network namespace of its own
(``in_harness_namespace``), where every store's services and clients run.
"""

from __future__ import annotations

from kvconnect.connectors.testing.engine_suites import HiCacheSuite, LMCacheL2Suite, PDRelaySuite
from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

store_harness = harness_fixture(namespace_run=True)
test_in_loopback_namespace = in_harness_namespace(__file__)


class TestHiCache(HiCacheSuite):
    pass


class TestLMCacheL2(LMCacheL2Suite):
    pass


class TestPDRelay(PDRelaySuite):
    pass
