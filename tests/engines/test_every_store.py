"""Every registered store: each capability it claims proven, then every engine suite over it.

``CapabilityChecks`` (``kvconnect.connectors.testing.conformance``) and the engine suites of
``kvconnect.connectors.testing.engine_suites`` (SGLang HiCache adapter, LMCache L2 plugin, PD
relay), parametrized by ``harness_fixture`` over every registered harness and variant.

Real: each store's own services as its harness starts them (the HF3FS metadata service, a
``mooncake_master`` with a segment holder, a peer-pool seed node over TCP), store clients in
separate processes for ``shared`` and ``durable`` (``kvconnect.connectors.testing.peer.Worker``
driving any store), SGLang 0.5.23's storage factory and CPU host pools, LMCache 0.5.6's plugin
factory and memory objects, the PD relay's data plane. The module runs in one process inside a
loopback-only network namespace of its own (``in_harness_namespace``), where every store's
services and clients run. (vLLM's suite: ``test_vllm_suite.py``.)
"""

from __future__ import annotations

from kvconnect.connectors.testing.conformance import CapabilityChecks
from kvconnect.connectors.testing.engine_suites import HiCacheSuite, LMCacheL2Suite, PDRelaySuite
from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

store_harness = harness_fixture(namespace_run=True)
test_in_loopback_namespace = in_harness_namespace(__file__)


class TestCapabilities(CapabilityChecks):
    pass


class TestHiCache(HiCacheSuite):
    pass


class TestLMCacheL2(LMCacheL2Suite):
    pass


class TestPDRelay(PDRelaySuite):
    pass
