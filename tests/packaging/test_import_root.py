"""The import root a checkout has on disk: ``kvconnect/`` with relative links to the top-level
folders (``kvconnect/connectors -> ../connectors``, ``namespace``, ``benchmarks``), so a static
tool resolves ``kvconnect.connectors.*`` from the files as Python imports them.

Real: mypy, run from the checkout on a small program that imports the three subpackages,
finds each module's file under ``kvconnect/`` and reads its types (``reveal_type``); Python,
with the checkout on ``PYTHONPATH``, imports the same files. Only kvconnect's modules are
followed (silently: the tree's own type errors are not what this checks), everything else is
skipped, so it takes about a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINKS = ("connectors", "namespace", "benchmarks")

PROGRAM = """\
import kvconnect.connectors.cli
from kvconnect.connectors.base import PageStore
from kvconnect.connectors.testing.conformance import PageStoreConformance
from kvconnect.namespace.keyspace import KeySpace
import kvconnect.benchmarks.harness

reveal_type(kvconnect.connectors.cli.main)
reveal_type(PageStore.exists)
reveal_type(PageStoreConformance)
reveal_type(KeySpace.key)
reveal_type(kvconnect.benchmarks.harness)
"""

CONFIG = """\
[mypy]
follow_imports = skip
[mypy-kvconnect.*]
follow_imports = silent
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH", "VIRTUAL_ENV")}


def test_kvconnect_holds_a_relative_link_to_each_top_level_folder():
    for name in LINKS:
        link = ROOT / "kvconnect" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert link.resolve() == ROOT / name and (link / "__init__.py").is_file()


def test_mypy_resolves_kvconnect_connectors_from_the_checkout(tmp_path):
    (tmp_path / "probe.py").write_text(PROGRAM)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"), "--cache-dir",
                        os.devnull, "--no-error-summary", "-v", str(tmp_path / "probe.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, (r.stdout + r.stderr[-3000:])
    assert "import-not-found" not in r.stdout and "Cannot find" not in r.stdout, r.stdout
    notes = [line.split("Revealed type is ", 1)[1] for line in r.stdout.splitlines() if "Revealed type is" in line]
    assert len(notes) == 5 and '"Any"' not in notes, r.stdout
    assert notes[0] == '"def (argv: list[str] | None =) -> int"'
    assert "kvconnect.connectors.base.PageStore" in notes[1] and "list[bool]" in notes[1]
    assert "kvconnect.connectors.testing.conformance.PageStoreConformance" in notes[2]
    assert "kvconnect.namespace.keyspace.KeySpace" in notes[3] and notes[4] == '"types.ModuleType"'
    # each module was read from the checkout's import root, through its link
    for rel in ("kvconnect/connectors/cli.py", "kvconnect/connectors/base.py", "kvconnect/namespace/keyspace.py",
                "kvconnect/benchmarks/harness.py"):
        assert str(ROOT / rel) in r.stderr, rel


def test_python_imports_the_same_files_from_the_checkout(tmp_path):
    code = ("import kvconnect.connectors.cli as c, kvconnect.namespace.keyspace as k, "
            "kvconnect.benchmarks.harness as h; print(c.__file__); print(k.__file__); print(h.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "kvconnect/connectors/cli.py"), str(ROOT / "kvconnect/namespace/keyspace.py"),
                                str(ROOT / "kvconnect/benchmarks/harness.py")]
    r = subprocess.run([sys.executable, "-m", "kvconnect.connectors.cli", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env={**_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.startswith("usage: kvconnect"), r.stderr
