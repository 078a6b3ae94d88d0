"""``kvconnect.connectors.registry``: stores by short name, lazy imports, errors that say what to do."""

from __future__ import annotations

import sys
import textwrap

import pytest

from kvconnect.connectors import registry
from kvconnect.connectors.base import ConfigError, MissingDependency, UnknownConfigKey, UnknownStore
from kvconnect.connectors.memory import MemoryStore


@pytest.fixture
def isolated_registry(monkeypatch):
    """Registrations made by a test vanish with it."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    return registry


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []
    yield tmp_path, created
    for name in created:
        sys.modules.pop(name, None)


def write_module(plugin_dir, name: str, body: str) -> None:
    path, created = plugin_dir
    (path / f"{name}.py").write_text(textwrap.dedent(body))
    created.append(name)


def test_unknown_store_lists_accepted_names():
    with pytest.raises(UnknownStore) as e:
        registry.create_store("memroy", {})
    msg = str(e.value)
    assert "'memroy'" in msg and "'memory'" in msg
    assert e.value.key == "store"
    assert isinstance(e.value, ConfigError)
    with pytest.raises(UnknownStore):
        registry.store_class("nope")


def test_store_is_required_and_must_be_a_name():
    with pytest.raises(ConfigError) as e:
        registry.create_store(None, {})
    assert e.value.key == "store" and "'memory'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        registry.create_store(None, {"store": 3})
    assert e.value.key == "store"


def test_memory_by_name_with_typed_options():
    store = registry.create_store("memory", {"capacity": "1mb"})
    try:
        assert isinstance(store, MemoryStore) and store.config.capacity == 1 << 20
    finally:
        store.close()
    store = registry.create_store(None, {"store": "memory", "capacity": 4096})
    assert store.config.capacity == 4096
    store.close()


def test_unknown_store_option_is_an_error():
    with pytest.raises(UnknownConfigKey) as e:
        registry.create_store("memory", {"capacity": "1mb", "eviction": "lru"})
    assert "'eviction'" in str(e.value) and "'capacity'" in str(e.value) and "memory" in str(e.value)


def test_missing_dependency_names_the_extra(isolated_registry, plugin_dir):
    """A store whose module imports a package that is not installed: MissingDependency naming the extra."""
    write_module(plugin_dir, "kvc_test_needs_missing_pkg", """
        import kvconnect_test_package_that_does_not_exist  # noqa: F401
        from kvconnect.connectors.memory import MemoryStore

        class NeedsMissing(MemoryStore):
            name = "needs-missing"
    """)
    registry.register_store("needs-missing", "kvc_test_needs_missing_pkg:NeedsMissing", extra="fancyextra",
                            summary="test store")
    with pytest.raises(MissingDependency) as e:
        registry.create_store("needs-missing", {})
    msg = str(e.value)
    assert 'pip install "kvconnect[fancyextra]"' in msg
    assert "kvconnect_test_package_that_does_not_exist" in msg
    assert e.value.extra == "fancyextra" and e.value.store == "needs-missing"
    assert isinstance(e.value, ImportError)
    ok, detail = registry.dependency_status("needs-missing")
    assert not ok and "kvconnect[fancyextra]" in detail
    assert registry.dependency_status("memory") == (True, "ok")


def test_importing_connectors_does_not_import_store_modules(isolated_registry, plugin_dir):
    """Registration is a string: the module is imported only when the store is selected."""
    write_module(plugin_dir, "kvc_test_lazy_store", """
        from kvconnect.connectors.memory import MemoryStore

        class LazyStore(MemoryStore):
            name = "lazy"
    """)
    registry.register_store("lazy", "kvc_test_lazy_store:LazyStore")
    assert "kvc_test_lazy_store" not in sys.modules
    assert "lazy" in registry.available_stores()
    store = registry.create_store("lazy", {"capacity": 1024})
    assert type(store).__name__ == "LazyStore" and "kvc_test_lazy_store" in sys.modules
    store.close()


def test_bad_targets(isolated_registry, plugin_dir):
    write_module(plugin_dir, "kvc_test_not_a_store", """
        class NotAStore:
            pass
    """)
    registry.register_store("not-a-store", "kvc_test_not_a_store:NotAStore")
    registry.register_store("no-class", "kvc_test_not_a_store:Missing")
    registry.register_store("no-module", "kvc_test_module_that_is_not_there:X")
    with pytest.raises(ConfigError) as e:
        registry.create_store("not-a-store", {})
    assert e.value.key == "class_name" and "not a PageStore" in str(e.value)
    with pytest.raises(ConfigError) as e:
        registry.create_store("no-class", {})
    assert e.value.key == "class_name"
    # Our own module path missing is a bad module_path, not a missing extra.
    with pytest.raises(ConfigError) as e:
        registry.create_store("no-module", {})
    assert e.value.key == "module_path" and not isinstance(e.value, MissingDependency)


def test_duplicates_are_errors_unless_replace(isolated_registry):
    with pytest.raises(ValueError, match="already registered"):
        registry.register_store("memory", "kvconnect.connectors.memory:MemoryStore")
    registry.register_store("memory", "kvconnect.connectors.memory:MemoryStore", replace=True)
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_store("x", "kvconnect.connectors.memory.MemoryStore")


def test_out_of_tree_store_by_module_path(plugin_dir):
    write_module(plugin_dir, "kvc_test_oot_store", """
        from kvconnect.connectors.memory import MemoryStore

        class OutOfTree(MemoryStore):
            name = "oot"
    """)
    store = registry.create_store(None, {"module_path": "kvc_test_oot_store", "class_name": "OutOfTree",
                                         "capacity": "2kb"})
    assert type(store).__name__ == "OutOfTree" and store.config.capacity == 2048
    store.close()
    with pytest.raises(ConfigError) as e:
        registry.create_store(None, {"module_path": "kvc_test_oot_store"})
    assert e.value.key == "class_name"


def test_hf3fs_metadata_client_without_grpc_names_the_extra(tmp_path, monkeypatch):
    """The HF3FS store itself imports without grpc; only its metadata-service client needs it.
    With grpc absent, a store pointed at a service fails with MissingDependency naming the
    extra (the registry turns any ImportError of a store's start into it), before any file is made."""
    import sys

    monkeypatch.setitem(sys.modules, "grpc", None)  # import grpc -> ImportError
    with pytest.raises(MissingDependency) as e:
        registry.create_store("hf3fs", {"file_path_prefix": str(tmp_path / "kv"), "file_size": "1mb", "numjobs": 1,
                                        "entries": 1, "metadata_server_url": "127.0.0.1:1"})
    assert e.value.store == "hf3fs" and e.value.extra == "hf3fs"
    assert 'pip install "kvconnect[hf3fs]"' in str(e.value)
    assert not list(tmp_path.iterdir())


def test_needs_registered_memory_is_a_capability_read_through_views():
    from kvconnect.connectors.base import Capability
    from kvconnect.connectors.registry import store_class
    from kvconnect.connectors.views import PrefixedStore

    need = Capability.NEEDS_REGISTERED_MEMORY
    assert {n for n in ("memory", "hf3fs", "mooncake", "peer_rdma") if need in store_class(n).capabilities} \
        == {"mooncake", "peer_rdma"}

    class Registering(MemoryStore):
        capabilities = MemoryStore.capabilities | {need}

    for store, needs in ((MemoryStore(), False), (Registering(), True)):
        view = PrefixedStore(store, "p-")
        assert store.supports(need) is view.supports(need) is needs
        store.close()
