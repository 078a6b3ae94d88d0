"""The wheel a user installs: one import name, honest about missing extras, and a
conformance suite a store outside this repository can run.

Real: a wheel built by pip from a copy of the working tree, unpacked into a fresh virtual
environment that has nothing else (no pip, no extras: no grpc, mooncake, msgpack, numpy,
sglang, lmcache). The third-party store and its test module live in a temporary directory;
pytest comes from the development environment through a ``.pth`` line, which imports
kvconnect from the wheel (site-packages comes first), never from this checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_tree(dst: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files, copied to ``dst`` (links
    as links: ``kvconnect/connectors -> ../connectors`` and its siblings are the import root)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_symlink():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst / f)
        elif src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to build the wheel from")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    _tracked_tree(src)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(work / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = (work / "dist").glob("kvconnect-*.whl")
    env_dir = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        names = z.namelist()
        links = [i.filename for i in z.infolist() if stat.S_ISLNK(i.external_attr >> 16)]
    env_dir.joinpath("top_level").write_text(json.dumps(sorted({n.split("/")[0] for n in names})))
    env_dir.joinpath("contents").write_text(json.dumps({"names": names, "links": links}))
    return env_dir


def _run(venv: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(venv), env={**clean, **env})


def test_the_wheel_installs_one_top_level_name(venv):
    tops = json.loads((venv / "top_level").read_text())
    assert [t for t in tops if not t.endswith(".dist-info")] == ["kvconnect"]
    r = _run(venv, "import kvconnect, kvconnect.namespace, kvconnect.connectors.memory, sys; "
                   "print(kvconnect.__file__); print(sorted(m for m in sys.modules if m.split('.')[0] in "
                   "('connectors', 'namespace', 'benchmarks')))")
    assert r.returncode == 0, r.stderr
    where, stray = r.stdout.splitlines()
    assert where.startswith(str(venv)) and stray == "[]"


def test_the_wheel_holds_the_files_the_import_roots_links_point_to(venv):
    got = json.loads((venv / "contents").read_text())
    assert got["links"] == []
    for rel in ("kvconnect/connectors/base.py", "kvconnect/connectors/testing/conformance.py",
                "kvconnect/namespace/keyspace.py", "kvconnect/benchmarks/harness.py",
                "kvconnect/benchmarks/serving/data/mooncake_conversation_trace.jsonl.gz"):
        assert rel in got["names"]
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert (site / "kvconnect" / "connectors" / "base.py").is_file()
    assert not (site / "kvconnect" / "connectors").is_symlink()


def test_stores_lists_each_store_with_its_missing_extra(venv):
    r = _run(venv, "import sys; from kvconnect.connectors.cli import main; sys.exit(main(['stores', '--json']))")
    assert r.returncode == 0, r.stderr
    rows = {row["store"]: row for row in json.loads(r.stdout)}
    assert rows["memory"]["available"] is True
    assert rows["mooncake"]["available"] is False and 'pip install "kvconnect[mooncake]"' in rows["mooncake"]["detail"]
    assert rows["peer_rdma"]["available"] is False and 'pip install "kvconnect[peer]"' in rows["peer_rdma"]["detail"]
    # the in-process HF3FS index needs nothing more; the metadata service needs the extra
    assert rows["hf3fs"]["available"] is True and 'pip install "kvconnect[hf3fs]"' in rows["hf3fs"]["detail"]
    r = _run(venv, "import sys; from kvconnect.connectors.cli import main; sys.exit(main(['stores']))")
    assert "missing" in r.stdout and 'pip install "kvconnect[peer]"' in r.stdout


@pytest.mark.parametrize("name, options, extra", [
    ("mooncake", {"master_server_address": "127.0.0.1:50051"}, "mooncake"),
    ("peer_rdma", {}, "peer"),
    ("hf3fs", {"file_path_prefix": "/tmp/kvc-wheel/x", "file_size": "1mb", "numjobs": 1, "entries": 1,
               "metadata_server_url": "127.0.0.1:1"}, "hf3fs"),
])
def test_a_store_whose_extra_is_missing_raises_missing_dependency_naming_it(venv, name, options, extra):
    code = ("import json\nfrom kvconnect import create_store, MissingDependency\n"
            f"try:\n    create_store({name!r}, {options!r})\nexcept MissingDependency as e:\n"
            "    print(json.dumps({'extra': e.extra, 'message': str(e)}))\n")
    r = _run(venv, code)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["extra"] == extra and f'pip install "kvconnect[{extra}]"' in got["message"]


THIRD_PARTY_STORE = '''
import threading
from dataclasses import dataclass, field

from kvconnect import PageStore
from kvconnect.connectors.base import StoreUsage
from kvconnect.connectors.buffers import gather, scatter, bytes_address
from kvconnect.connectors.config import Size, StoreConfig, field_doc


@dataclass(frozen=True)
class DictConfig(StoreConfig):
    capacity: Size = field(default=1 << 20, metadata=field_doc("bytes kept"))


class DictStore(PageStore):
    """A store written outside kvconnect: pages as bytes in a dict, oldest evicted first."""

    name = "dict"
    config_class = DictConfig

    def __init__(self, config=None, context=None):
        super().__init__(context)
        self.config = config or DictConfig()
        self.pages = {}
        self.lock = threading.Lock()

    def _exists(self, keys):
        with self.lock:
            return [k in self.pages for k in keys]

    def _get_into(self, keys, pages):
        out = []
        for k, page in zip(keys, pages):
            with self.lock:
                data = self.pages.get(k)
            ok = data is not None and len(data) == sum(n for _, n in page)
            if ok:
                scatter(bytes_address(data), page)
            out.append(ok)
        return out

    def _put_from(self, keys, pages):
        for k, page in zip(keys, pages):
            data = bytes(gather(page))
            with self.lock:
                self.pages.setdefault(k, data)
                while sum(map(len, self.pages.values())) > self.config.capacity:
                    self.pages.pop(next(iter(self.pages)))
        return [True] * len(keys)

    def _delete(self, keys):
        with self.lock:
            return [self.pages.pop(k, None) is not None for k in keys]

    def _clear(self):
        with self.lock:
            self.pages.clear()

    def _clear_prefix(self, prefix):
        with self.lock:
            for k in [k for k in self.pages if k.startswith(prefix)]:
                del self.pages[k]

    def _usage(self):
        with self.lock:
            return StoreUsage(keys=len(self.pages), bytes_used=sum(map(len, self.pages.values())),
                              capacity_bytes=self.config.capacity)
'''

THIRD_PARTY_TEST = '''
import kvconnect
from kvconnect.connectors.testing.conformance import PageStoreConformance

from dict_store import DictConfig, DictStore


class TestDictStore(PageStoreConformance):
    store_name = "dict_store:DictStore"
    capacity_bytes = 1 << 20  # 64 pages of the suite

    def make_store(self):
        return DictStore(DictConfig(capacity=self.capacity_bytes))

    def store_options(self):
        return {"capacity": self.capacity_bytes}

    def test_kvconnect_comes_from_the_wheel(self):
        assert "site-packages" in kvconnect.__file__
'''


def test_the_conformance_suite_runs_from_the_wheel_against_a_store_outside_the_repository(venv, tmp_path):
    import pytest as _pytest

    dev_site = str(Path(_pytest.__file__).resolve().parents[1])
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "dev_tools.pth").write_text(dev_site + "\n")  # pytest & co., after the wheel's kvconnect
    try:
        (tmp_path / "dict_store.py").write_text(THIRD_PARTY_STORE)
        (tmp_path / "test_dict_store.py").write_text(THIRD_PARTY_TEST)
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-rA", str(tmp_path / "test_dict_store.py")], capture_output=True, text=True,
                           timeout=300, cwd=str(tmp_path), env={**clean, "PYTHONPATH": str(tmp_path)})
    finally:
        (site / "dev_tools.pth").unlink()
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "PASSED test_dict_store.py::TestDictStore::test_round_trip_multi_segment_bytes" in r.stdout
    assert "PASSED test_dict_store.py::TestDictStore::test_kvconnect_comes_from_the_wheel" in r.stdout
    assert "PASSED test_dict_store.py::TestDictStore::test_eviction_under_capacity_pressure" in r.stdout
