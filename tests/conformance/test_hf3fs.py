"""Conformance: the HF3FS store (POSIX file client; reads from the file mapping, and with
``preadv``; writes staged and direct) with the in-process index and with the gRPC metadata service (a real
``MetaServer`` on 127.0.0.1 with a durable journal and a token).

The usrbio client needs a 3FS mount; none exists here, so it is not exercised (see
tests/integration/test_hf3fs.py::test_usrbio_client_on_3fs_mount).
"""

import pytest

from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.hf3fs.config import HF3FSConfig
from kvconnect.connectors.hf3fs.store import HF3FSStore
from kvconnect.connectors.testing.conformance import PAGE, PageStoreConformance

CAPACITY_PAGES = 64


class TestHF3FSLocalIndex(PageStoreConformance):
    store_name = "hf3fs"
    capacity_bytes = CAPACITY_PAGES * PAGE

    @pytest.fixture(autouse=True)
    def _dir(self, tmp_path):
        self.dir = tmp_path

    def store_options(self):
        return {"file_path_prefix": str(self.dir / "hicache"), "file_size": self.capacity_bytes,
                "numjobs": 4, "entries": 4}

    def make_store(self):
        return HF3FSStore(HF3FSConfig(**self.store_options()))


class TestHF3FSPreadvReads(TestHF3FSLocalIndex):
    """The same with ``os.preadv`` instead of the file mapping (what the POSIX client does on
    network and FUSE file systems)."""

    def store_options(self):
        return {**super().store_options(), "posix_read": "preadv"}


class TestHF3FSDirectWrites(TestHF3FSLocalIndex):
    """Writes with ``pwritev`` straight from the pages (the default has staged writes when
    it has two or more workers and cores, as here)."""

    def store_options(self):
        return {**super().store_options(), "posix_write": "direct"}


class TestHF3FSStagedWrites(TestHF3FSLocalIndex):
    """Writes staged through per-worker buffers, also where ``auto`` would not stage."""

    def store_options(self):
        return {**super().store_options(), "posix_write": "staged"}


class TestHF3FSStripedFiles(TestHF3FSLocalIndex):
    """Pages striped over three files (``posix_files``)."""

    def store_options(self):
        return {**super().store_options(), "posix_files": 3}


grpc = pytest.importorskip("grpc", reason="the metadata service needs grpcio (extra 'hf3fs')")


@pytest.fixture(scope="class")
def meta_server(tmp_path_factory):
    from kvconnect.connectors.hf3fs.service import MetaServer

    d = tmp_path_factory.mktemp("meta")
    srv = MetaServer("127.0.0.1", 0, str(d / "data"), token="s3cret", fsync="never").start()
    yield srv
    srv.stop(0)


class TestHF3FSService(TestHF3FSLocalIndex):
    @pytest.fixture(autouse=True)
    def _server(self, meta_server, tmp_path):
        self.server = meta_server
        self.dir = tmp_path  # a fresh file (and namespace per test file) per test

    def store_options(self):
        opts = super().store_options()
        # one namespace per test: the rank is unique per test directory
        opts.update(metadata_server_url=f"http://{self.server.address}", auth_token="s3cret",
                    client_timeout=5)
        return opts

    def make_store(self):
        rank = abs(hash(str(self.dir))) % 1_000_000
        return HF3FSStore(HF3FSConfig(**self.store_options()), EngineContext(tp_rank=rank, tp_size=rank + 1))
