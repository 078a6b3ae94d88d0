"""What a real ``lmcache server`` reports as its kvconnect L2's usage, across a restart.

HF3FS shared through a real metadata service process (``kvconnect hf3fs-meta serve``,
``kvconnect.connectors.testing.hf3fs.MetaProcess``) is the durable store: its pages and
its index outlive the server. LMCache's own engine client stores two sequences (four
512 KiB chunks) through server A; A is stopped (SIGINT) and a new server, B, started on the
same store reports the same used and capacity bytes before any request, in ``GET /status``
and in ``lmcache describe kvcache``, and serves the chunks byte-exact.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="needs lmcache (pip install \"kvconnect[lmcache]\")")
pytest.importorskip("grpc", reason="the HF3FS metadata service needs grpcio")

from kvconnect.connectors.testing.hf3fs import MetaProcess  # noqa: E402
from kvconnect.connectors.testing.lmcache import EngineClient, Server, wait_for  # noqa: E402

CHUNK = 512 * 1024  # EngineClient.SHAPE: 256 tokens of 4 layers
FILE_SIZE = 64 << 20


def usage_of(st: dict) -> tuple:
    return (st["stored_object_count"], st["current_size_bytes"], st["max_capacity_bytes"], st["usage"])


def test_usage_after_restart_matches_usage_before(tmp_path):
    meta = MetaProcess(tmp_path / "meta").start()
    params = {"store": "hf3fs", "file_path_prefix": str(tmp_path / "kv"), "file_size": "64mb", "numjobs": 2,
              "entries": 8, "metadata_server_url": meta.url}
    a = b = ca = cb = None
    try:
        a = Server(params, tmp_path / "a.log", "--l2-store-policy", "skip_l1")
        a.wait_healthy()
        st = a.adapter_status()
        assert (st["current_size_bytes"], st["max_capacity_bytes"]) == (0, FILE_SIZE)  # empty: 0 of file_size
        ca = EngineClient(a)
        sums = {seq: ca.store_sequence(seq) for seq in (0, 1)}
        wait_for(lambda: a.adapter_status()["store_stats"]["put_written"] >= 4, 30, "A's L2 stores")
        before = a.adapter_status()
        # real figures: four 512 KiB pages of one 64 MiB data file (128 pages of 512 KiB)
        assert usage_of(before) == (4, 4 * CHUNK, FILE_SIZE, {
            "bytes_used_from": "store", "capacity_from": "store", "stale": False,
            "usage_fraction": 4 * CHUNK / FILE_SIZE, "shared": True, "global_eviction": False,
            "eviction_by": "store"})
        assert "2.00 MB / 64.00 MB (3.1%)" in a.describe()
        ca.close()
        ca = None
        assert a.stop() is not None  # clean SIGINT shutdown

        b = Server(params, tmp_path / "b.log")
        b.wait_healthy()
        after = b.adapter_status()
        assert usage_of(after) == usage_of(before)  # before any request: the store's own figures
        assert "2.00 MB / 64.00 MB (3.1%)" in b.describe()
        cb = EngineClient(b)
        assert cb.hit_chunks(0) == (2, 2) and cb.hit_chunks(1) == (2, 2)
        assert cb.retrieve_sequence(0) == sums[0] and cb.retrieve_sequence(1) == sums[1]
        assert usage_of(b.adapter_status()) == usage_of(before)  # reading adds nothing
    finally:
        for c in (ca, cb):
            if c is not None:
                c.close()
        for s in (a, b):
            if s is not None:
                s.stop()
        meta.stop()
