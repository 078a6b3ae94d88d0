"""vLLM's native connector over every registered store (``VLLMSuite``): a real vLLM 0.32
process on CPU per store, under the store harness's namespace, reading its own KV back from
the store after its prefix cache is emptied, with the cold run's tokens."""

from __future__ import annotations

from kvconnect.connectors.testing.engine_suites import VLLMSuite
from kvconnect.connectors.testing.harness import harness_fixture

store_harness = harness_fixture(variants=False, child_clients=True)


class TestVLLM(VLLMSuite):
    pass
