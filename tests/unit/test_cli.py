"""The ``kvconnect`` command line: help everywhere, ``stores``, ``bench``, and ``demo``.

The demo tests drive the real SGLang adapter over a real SGLang CPU host pool (sglang is in
the CI venv) and check bytes: a store that returns a flipped byte or another key's page
must make the demo fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors import registry
from kvconnect.connectors.cli import SUBCOMMANDS, main
from kvconnect.connectors.memory import MemoryStore

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "grpc", "mooncake", "sglang", "lmcache")
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SMALL = ["--clients", "6", "--rounds", "3", "--groups", "2", "--prefix-tokens", "256", "--turn-tokens", "64",
         "--page-size", "16", "--threads", "2", "--no-progress"]


def kvconnect_cmd() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m kvconnect``."""
    script = Path(sys.executable).parent / "kvconnect"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvconnect.connectors.cli"]


def kvconnect(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(kvconnect_cmd() + list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=ENV)


def has_sglang() -> bool:
    """Installed (found without importing it: collecting these tests stays fast)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("sglang", "torch"))


needs_sglang = pytest.mark.skipif(not has_sglang(), reason="sglang is not installed: the demo's real SGLang "
                                                           "path needs it (the CI venv has it)")


# ---------------------------------------------------------------------------------
# Help and imports
# ---------------------------------------------------------------------------------


def test_top_level_help_lists_every_subcommand():
    r = kvconnect("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: kvconnect" in r.stdout
    for name in SUBCOMMANDS:
        assert name in r.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name):
    r = kvconnect(name, "--help")
    assert r.returncode == 0, f"kvconnect {name} --help failed:\n{r.stderr}"
    assert f"usage: kvconnect {name}" in r.stdout


def _parsers(parser):
    """A parser and every sub-parser below it."""
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_of_every_subcommand_says_what_it_does(name):
    from kvconnect.connectors.cli import build_parser

    bare = []
    for parser in _parsers(build_parser(load=name)):
        for action in parser._actions:
            if action.option_strings and action.help in (None, "") and action.dest != "help":
                bare.append(f"{parser.prog} {'/'.join(action.option_strings)}")
    assert not bare, f"options without help text: {bare}"


def test_no_command_prints_help_and_fails():
    r = kvconnect()
    assert r.returncode == 2 and "usage: kvconnect" in r.stdout


def _imported_heavy(code: str) -> list[str]:
    probe = code + f"\nimport sys\nprint([m for m in {HEAVY!r} if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_importing_the_packages_imports_no_heavy_dependency():
    assert _imported_heavy("import kvconnect, kvconnect.namespace, kvconnect.connectors.registry, "
                           "kvconnect.connectors.config, kvconnect.connectors.buffers, "
                           "kvconnect.connectors.memory") == []


@pytest.mark.parametrize("folder", ["connectors", "namespace", "benchmarks"])
def test_the_folders_import_only_under_the_kvconnect_root(folder):
    """A stale ``module_path`` such as ``connectors.engines...`` fails at once, naming the
    right one, instead of loading a second copy of every class."""
    r = subprocess.run([sys.executable, "-c", f"import {folder}"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=ENV)
    assert r.returncode != 0 and f"import kvconnect.{folder}, not {folder}" in r.stderr


def test_python_dash_m_kvconnect_is_the_command():
    r = subprocess.run([sys.executable, "-m", "kvconnect", "stores"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr
    assert {line.split()[0] for line in r.stdout.splitlines() if line.strip()} >= {"memory", "hf3fs"}


def test_top_level_help_imports_no_heavy_dependency():
    code = ("from kvconnect.connectors.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    assert _imported_heavy(code) == []


# ---------------------------------------------------------------------------------
# kvconnect stores
# ---------------------------------------------------------------------------------


def test_stores_lists_memory_as_available():
    r = kvconnect("stores", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["store"]: row for row in json.loads(r.stdout)}
    assert rows["memory"]["available"] is True
    r = kvconnect("stores")
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if x.startswith("memory"))
    assert "available: yes" in line


def test_stores_shows_options_of_one_store():
    r = kvconnect("stores", "memory")
    assert r.returncode == 0 and "capacity" in r.stdout


# ---------------------------------------------------------------------------------
# kvconnect bench
# ---------------------------------------------------------------------------------


def test_bench_list_and_unknown():
    r = kvconnect("bench", "--list")
    assert r.returncode == 0
    assert "limits" in [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    r = kvconnect("bench", "no-such-bench")
    assert r.returncode == 2 and "unknown benchmark 'no-such-bench'" in r.stderr and "limits" in r.stderr


def _benchmark_names() -> list[str]:
    from kvconnect.connectors.cli_bench import find_benchmarks_dir, list_benchmarks

    d = find_benchmarks_dir()
    return sorted(list_benchmarks(d)) if d else []


@pytest.mark.parametrize("name", _benchmark_names())
def test_every_benchmark_has_help_and_quick(name):
    r = kvconnect("bench", name, "--help")
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout, f"benchmarks/{name}.py has no --quick option"


def test_bench_limits_quick_writes_valid_json(tmp_path):
    out = tmp_path / "limits.json"
    r = kvconnect("bench", "limits", "--quick", "--dir", str(tmp_path), "--out", str(out), timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["name"] == "limits" and doc["params"]["quick"] is True
    assert "loadavg" in doc["machine"] and doc["machine"]["cpus"] >= 1
    for k in ("memcpy_gib_s", "loopback_tcp_gib_s", "disk_write_fsync_gib_s", "pagecache_read_gib_s"):
        assert 0.01 < doc["figures"][k] < 1000, (k, doc["figures"][k])
        assert doc["limits"][k] == doc["figures"][k]
    assert doc["ratios"], "no ratios"
    for row in doc["ratios"]:
        assert set(row) == {"metric", "ours", "reference", "ratio", "reference_system"}
        assert row["ratio"] == pytest.approx(row["ours"] / row["reference"], rel=1e-3)
    assert not list(tmp_path.glob("kvconnect-limits-*")), "disk test left files behind"


def test_limits_functions_importable_by_other_benchmarks(tmp_path):
    from kvconnect.benchmarks.limits import measure_disk, measure_loopback_tcp, measure_memcpy

    assert measure_memcpy(8 << 20, repeats=2)["gib_per_s"] > 0
    assert measure_loopback_tcp(16 << 20, repeats=1)["gib_per_s"] > 0
    d = measure_disk(tmp_path, 8 << 20, repeats=1)
    assert d["write_fsync"]["gib_per_s"] > 0 and d["pagecache_read"]["gib_per_s"] > 0
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------
# kvconnect demo
# ---------------------------------------------------------------------------------


class FlipByteStore(MemoryStore):
    """Returns a page with one byte flipped (a corrupting backend)."""

    name = "flip-byte"

    def _get_into(self, keys, pages):
        import ctypes

        result = super()._get_into(keys, pages)
        for ok, page in zip(result, pages):
            if ok:
                addr, n = page[-1]
                b = ctypes.c_ubyte.from_address(addr + n // 2)
                b.value ^= 0x01
                break
        return result


class ForeignPageStore(MemoryStore):
    """Answers a read with another key's (complete, untorn) page."""

    name = "foreign-page"

    def _get_into(self, keys, pages):
        with self._lock:
            others = [k for k in self._pages if k != keys[0]]
        if not others:
            return super()._get_into(keys, pages)
        return super()._get_into([others[0]] + list(keys[1:]), pages)


@pytest.fixture
def bad_stores(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    registry.register_store("flip-byte", f"{__name__}:FlipByteStore")
    registry.register_store("foreign-page", f"{__name__}:ForeignPageStore")


def run_demo(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = main(["demo", *SMALL, "--json", *args])
    cap = capsys.readouterr()
    doc = json.loads(cap.out) if rc == 0 else None
    return rc, doc, cap.err


def check_figures(doc: dict) -> None:
    assert doc["requests"] == 18
    assert doc["pages_loaded"] > 0 and doc["pages_verified"] == doc["pages_loaded"]
    assert doc["pages_store_failed"] == 0 and doc["adapter_errors"] == 0
    assert doc["pages_loaded"] + doc["pages_prefilled"] == doc["pages_looked_up"]
    # Shared prefixes and growing conversations must hit; never more than an unbounded store could.
    assert 0.4 < doc["page_hit_rate"] <= doc["ideal_page_hit_rate"] + 1e-9
    assert doc["gib_loaded"] == pytest.approx(doc["pages_loaded"] * doc["page_bytes"] / 2**30)


@needs_sglang
def test_demo_cli_end_to_end_real_sglang():
    """The console script, default store, real SGLang adapter and host pool, human-readable output."""
    r = kvconnect("demo", *SMALL, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "KVConnectStorage" in out and "StorageBackendFactory" in out and "MHATokenToKVPoolHost" in out
    # SGLang's native page hash is JIT-built with a C++ compiler and OpenSSL headers; where
    # those are missing the demo must say so and use the same scheme in Python.
    assert ("sglang.srt.mem_cache.utils.get_hash_str (native)" in out
            or "sglang's native hash unavailable" in out)
    assert "hit rate" in out and "byte-exact" in out and "GiB/s" in out


@needs_sglang
@pytest.mark.parametrize("shape,layout", [
    ("tiny", "page_first"), ("tiny", "layer_first"), ("tiny", "page_first_direct"), ("tiny", "page_head"),
    ("tiny-mla", "page_first"), ("tiny-mla", "layer_first"),
])
def test_demo_real_sglang_verifies_bytes(capsys, shape, layout):
    rc, doc, err = run_demo(capsys, "--model-shape", shape, "--layout", layout)
    assert rc == 0, err
    assert doc["path"] == "sglang" and "KVConnectStorage" in doc["description"]
    assert doc["layout"] == layout and doc["model_shape"] == shape
    check_figures(doc)


@needs_sglang
def test_demo_second_pass_hits_everything(capsys):
    """The guides' "run the same load again": on a warm store every full page is a hit."""
    rc, doc, err = run_demo(capsys, "--passes", "2")
    assert rc == 0, err
    first, second = doc["passes"]
    assert 0.4 < first["page_hit_rate"] < 1.0 and first["pages_stored"] > 0
    assert second["page_hit_rate"] == 1.0 and second["pages_stored"] == 0
    assert doc["pages_verified"] == first["pages_loaded"] + second["pages_loaded"]


@needs_sglang
@pytest.mark.parametrize("store", ["flip-byte", "foreign-page"])
def test_demo_fails_on_a_corrupting_store_real_sglang(capsys, bad_stores, store):
    rc, _, err = run_demo(capsys, "--store", store)
    assert rc == 1
    assert "VERIFICATION FAILED" in err and "wrong bytes" in err


@pytest.mark.parametrize("store", ["flip-byte", "foreign-page"])
def test_demo_fails_on_a_corrupting_store_without_sglang(capsys, bad_stores, store):
    rc, _, err = run_demo(capsys, "--store", store, "--no-sglang")
    assert rc == 1 and "VERIFICATION FAILED" in err


def test_demo_without_sglang_path(capsys):
    rc, doc, err = run_demo(capsys, "--no-sglang")
    assert rc == 0, err
    assert doc["path"] == "hostbuffer" and "NOT through SGLang" in doc["description"]
    check_figures(doc)
    assert doc["store_stats"]["store"]["get_hits"] == doc["pages_loaded"]


def test_demo_without_sglang_installed_falls_back_and_says_so(tmp_path):
    """sglang made unimportable (a package raising ImportError shadows it): HostBuffer path, said on line 1."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise ImportError('sglang hidden by the test')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "kvconnect.connectors.cli", "demo", *SMALL], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert "NOT through SGLang" in first and "sglang is not installed" in first and "sglang hidden" in first
    assert "hashlib" in r.stdout and "byte-exact" in r.stdout


def test_demo_bad_configuration(capsys):
    assert main(["demo", "--store", "memroy", "--no-sglang", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'memroy'" in err and "'memory'" in err
    assert main(["demo", "--store-options", "[1]", "--no-sglang"]) == 2
    assert "--store-options" in capsys.readouterr().err
    assert main(["demo", "--store-options", '{"capacty": 1}', "--no-sglang", "--no-progress"]) == 2
    assert "'capacty'" in capsys.readouterr().err
    assert main(["demo", "--model-shape", "tiny-mla", "--layout", "page_head", "--no-sglang"]) == 2
    assert "page_head" in capsys.readouterr().err


def test_page_hashes_follow_sglangs_scheme():
    from kvconnect.connectors.workload import hashlib_page_hashes

    import hashlib
    import struct

    toks = list(range(1000, 1100))
    got = hashlib_page_hashes(toks, 16)
    assert len(got) == 6  # full pages only
    d0 = hashlib.sha256(struct.pack("<16I", *toks[:16])).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<16I", *toks[16:32])).digest()
    assert got[:2] == [d0.hex(), d1.hex()]
    # The chain commits to the whole prefix: one changed token changes every later key.
    toks2 = toks[:20] + [7] + toks[21:]
    got2 = hashlib_page_hashes(toks2, 16)
    assert got2[0] == got[0] and all(a != b for a, b in zip(got[1:], got2[1:]))


@needs_sglang
def test_page_hashes_equal_sglangs_own_function():
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvconnect.connectors.workload import hashlib_page_hashes

    import random

    try:
        get_hash_str([1, 2], None, page_size=1)
    except RuntimeError as e:  # JIT build of sglang's hash_binding.cpp needs g++ and OpenSSL headers
        pytest.skip(f"sglang's native page hash cannot be built here: {e}")
    rng = random.Random(5)
    for page_size in (1, 16, 64):
        toks = [rng.randrange(150_000) for _ in range(page_size * 5)]
        assert hashlib_page_hashes(toks, page_size) == get_hash_str(toks, None, page_size=page_size)
        prior = "cd" * 32
        assert hashlib_page_hashes(toks, page_size, prior) == get_hash_str(toks, prior, page_size=page_size)
