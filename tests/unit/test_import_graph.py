"""The shape of the package, read from its imports (every import, function-local ones too).

* no import cycle among kvconnect's modules;
* no store package imports another store's package (what two stores share lives on the
  ground floor: ``transfer_engine``, ``auth``, ``buffers``, ...);
* nothing in the product imports the test kits (``kvconnect.connectors.testing``);
* nothing at all imports ``tests.*`` (tests and benchmarks use the shipped test kits).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _store_roots() -> dict[str, str]:
    """Each registered store's own code: its package (``kvconnect.connectors.hf3fs``) or, for a
    store of one module, that module. Read from the registry, so a new store is covered when it
    is registered, with no list here to forget."""
    from kvconnect.connectors.registry import available_stores

    roots = {}
    for name, spec in available_stores().items():
        module = spec.target.split(":")[0]
        parts = module.split(".")
        if parts[:2] == ["kvconnect", "connectors"]:
            roots[name] = ".".join(parts[:3])
    return roots


STORES = _store_roots()


def _store_of(module: str):
    return next((s for s, root in STORES.items() if module == root or module.startswith(root + ".")), None)


def _modules() -> dict[str, Path]:
    """Every module by the name Python imports it by: the tree under ``kvconnect/``, read
    through its links to the top-level folders (the one place that maps them)."""
    out = {}
    for folder, _dirs, files in os.walk(ROOT / "kvconnect", followlinks=True):
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
                out[".".join(parts)] = path.resolve()
    return out


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names |= {f"{prefix}.{a.name}" for a in node.names}
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        edges = set()
        for name in _imports(path, mod, path.name == "__init__.py"):
            # the longest kvconnect module the name is, or is inside of
            parts = name.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if target and target != mod:
                edges.add(target)
        graph[mod] = edges
    return graph


def _all_sources() -> list[Path]:
    return [p for folder in ("connectors", "namespace", "benchmarks", "kvconnect", "tests", "examples", "scripts")
            for p in (ROOT / folder).rglob("*.py")]


def test_no_import_cycle():
    graph = _graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan, iterative enough for this size
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    assert not cycles, cycles


def test_no_store_package_imports_another_stores():
    assert {"memory", "hf3fs", "mooncake", "peer_rdma"} <= set(STORES)
    bad = []
    for mod, edges in _graph().items():
        own = _store_of(mod)
        for target in edges:
            other = _store_of(target)
            if own and other and other != own:
                bad.append(f"{mod} -> {target}")
    assert not bad, bad


def test_the_product_never_imports_the_test_kits():
    bad = [f"{mod} -> {t}" for mod, edges in _graph().items()
           if not mod.startswith(("kvconnect.connectors.testing", "kvconnect.benchmarks"))
           for t in edges if t.startswith("kvconnect.connectors.testing")]
    assert not bad, bad


def test_nothing_imports_tests():
    bad = []
    for path in _all_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
        text = path.read_text()
        if path != Path(__file__).resolve():  # this file names what it looks for
            bad += [f"{path.relative_to(ROOT)}: module path" for marker in ('"tests.', "'tests.", "-m tests.")
                    if marker in text]
    assert not bad, bad
