"""kvconnect's SGLang linker over every registered store harness: a stored prompt loads with
no recomputed page, byte for byte.

Real: SGLang 0.5.23's ``UnifiedRadixCache``, its linker wrapper and ``create_unified_cache_linker``
over CPU device pools (``connectors/testing/linker.py``), and each store's services as its
harness starts them (``connectors/testing/harness.py``). The module runs in one process inside a
loopback-only network namespace of its own (``in_harness_namespace``), where every store's
services and clients run.

Not real, and why: the model's forward (no GPU): computed KV is bytes drawn from each page's
SGLang storage hash. The reader is a second server where the store claims ``shared``; else the
writer itself after SGLang's ``cache.reset()`` emptied its device tree.
"""

from __future__ import annotations

import pytest

from kvconnect.connectors.base import Capability
from kvconnect.connectors.testing.harness import harness_fixture, in_harness_namespace

store_harness = harness_fixture(namespace_run=True)
test_in_loopback_namespace = in_harness_namespace(__file__)


def _tokens(n: int, tag: int) -> list:
    import random

    rng = random.Random(tag)
    return [rng.randrange(1, 30000) for _ in range(n)]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_stored_prompt_loads_with_no_recomputed_page(store_harness, kind):
    pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")
    from kvconnect.connectors.testing.linker import LinkedServer, page_content

    shared = Capability.SHARED in store_harness.claims
    writer = LinkedServer(store_harness.options(0), kind=kind)
    reader = LinkedServer(store_harness.options(1), kind=kind) if shared else writer
    try:
        tokens = _tokens(4 * 6 + 3, 21)
        first = writer.prefill(tokens)
        assert (first.loaded_tokens, first.computed_pages) == (0, 6)
        assert writer.linker.counts["offloaded_pages"] == 6
        if not shared:
            writer.cache.reset()  # the device tree forgets the prompt; the store keeps it
        second = reader.prefill(tokens)
        assert (second.device_hit_tokens, second.loaded_tokens, second.computed_pages) == (0, 24, 0)
        assert not second.load_failed
        nbytes = reader.page_nbytes()
        for page, h in enumerate(second.page_hashes):
            assert reader.page_bytes(second.slots, page) == page_content(h, nbytes), f"page {page}"
        assert reader.linker.counts["offloaded_pages"] == (0 if shared else 6)  # nothing written twice
        assert writer.linker._errors.as_dict() == {} and reader.linker._errors.as_dict() == {}
    finally:
        writer.close()
        if reader is not writer:
            reader.close()
