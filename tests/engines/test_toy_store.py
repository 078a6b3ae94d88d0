"""A fifth store from one file (tests/engines/toy_plugin/kvconnect_toy_store.py, a plugin's
own top-level module) and its registry entry, added at test time, through every engine suite
and the page conformance and capability checks.

The entry goes in both ways a plugin has: the ``kvconnect.stores`` / ``kvconnect.harnesses``
entry points of a ``*.dist-info`` put on ``PYTHONPATH`` with the module (what ``pip install`` of
a plugin writes; the child processes of the ``shared`` and ``durable`` checks and vLLM find the
store by name through it) and ``register_store()`` in this process (whose entry points were
read already).
Everything else is what the other suites run: real SGLang, LMCache and PD relay classes, and a
real vLLM process (vLLM's suite: the built-in stores' vLLM tests are tests/integration/test_vllm.py,
two vLLM processes per shared store).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from kvconnect.connectors.registry import register_store, unregister_store
from kvconnect.connectors.testing.conformance import CapabilityChecks, PageStoreConformance
from kvconnect.connectors.testing.engine_suites import HiCacheSuite, LMCacheL2Suite, PDRelaySuite, VLLMSuite
from kvconnect.connectors.testing.harness import harness_fixture, harness_names

PLUGIN_DIR = Path(__file__).resolve().parent / "toy_plugin"
STORE = "kvconnect_toy_store:ToyStore"
HARNESS = "kvconnect_toy_store:ToyHarness"


def write_plugin_dist(root: Path) -> Path:
    """A ``*.dist-info`` declaring the toy store's two entry points, as pip would install it."""
    dist = root / "kvconnect_toy_store-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvconnect-toy-store\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[kvconnect.stores]\ntoy = {STORE}\n\n"
                                           f"[kvconnect.harnesses]\ntoy = {HARNESS}\n")
    return root


@pytest.fixture(scope="module", autouse=True)
def toy_registered(tmp_path_factory):
    import sys

    root = write_plugin_dist(tmp_path_factory.mktemp("toy-plugin"))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(PLUGIN_DIR), saved) if p)
    sys.path.insert(0, str(PLUGIN_DIR))
    register_store("toy", STORE, summary="pages as files (a plugin's one file)", harness=HARNESS)
    try:
        yield
    finally:
        unregister_store("toy")
        sys.path.remove(str(PLUGIN_DIR))
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


store_harness = harness_fixture(["toy"])


def test_the_toy_store_is_registered_with_its_harness():
    assert "toy" in harness_names()


def test_a_child_process_finds_the_toy_store_by_name_through_its_entry_points():
    import subprocess
    import sys

    from kvconnect.connectors.testing.processes import child_env

    code = ("from kvconnect.connectors.registry import available_stores as a; s = a()['toy']; "
            "print(s.target, s.harness)")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [STORE, HARNESS], out.stderr[-2000:]


class TestToyConformance(PageStoreConformance):
    store_name = "toy"

    def make_store(self):
        from kvconnect.connectors.registry import create_store

        return create_store("toy", self.store_options())

    def store_options(self):
        if not hasattr(self, "_root"):
            type(self)._root = tempfile.mkdtemp(prefix="kvc-toy-")
        return {"root": os.path.join(self._root, f"pages-{os.getpid()}-{id(self)}")}


class TestToyCapabilities(CapabilityChecks):
    pass


class TestToyHiCache(HiCacheSuite):
    pass


class TestToyLMCacheL2(LMCacheL2Suite):
    pass


class TestToyPDRelay(PDRelaySuite):
    pass


class TestToyVLLM(VLLMSuite):
    pass
