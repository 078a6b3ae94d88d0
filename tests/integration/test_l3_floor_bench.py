"""``kvconnect bench l3_floor --quick``: the L3 load path's floor on this host (memory and hf3fs
reads into one host buffer, alone and under a writer, beside memcpy). Real stores and files
(/dev/shm); no GPU here, so the host-to-device part is absent and the JSON says so (on a GPU
node it is measured by the same code)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvconnect.benchmarks import l3_floor


def test_quick_floor_measures_every_store_and_checks_its_bytes(tmp_path):
    out = tmp_path / "l3_floor.json"
    assert l3_floor.main(["--quick", "--out", str(out), "--store-s-per-l3-hit", "0.039",
                          "--stores", "memory,hf3fs,hf3fs_e16,hf3fs_2t,hf3fs_e16_1pool"]) == 0
    doc = json.loads(out.read_text())
    figs = doc["figures"]
    assert doc["params"]["pages"] == 4 and doc["params"]["page_bytes"] == 8 << 20
    for store in ("memory", "hf3fs", "hf3fs_e16", "hf3fs_2t", "hf3fs_e16_1pool"):
        g, u = figs[store]["get"], figs[store]["get_under_puts"]
        assert g["gib_per_s"] > 0 and u["gib_per_s"] > 0 and g["repeats"] == 3
        assert u["writer_gib_per_s"] > 0  # the writer really wrote while the reads ran
    x = figs["xxh3"]  # the peer pool's page checksums, one thread and spread, agreeing (checked inside)
    assert x["one_thread"]["gib_per_s"] > 0 and x["copy_threads"]["gib_per_s"] > 0
    names = {r["metric"] for r in doc["ratios"]}
    assert {"memory_get_over_memcpy_16t", "hf3fs_get_under_puts_over_alone",
            "serving_store_time_over_hf3fs_get_floor", "hf3fs_e16_get_over_2_workers",
            "xxh3_copy_threads_over_one_thread", "hf3fs_e16_get_under_puts_over_one_pool"} <= names
    if not doc["params"]["cuda"]:
        assert "h2d" not in figs and any("no CUDA" in n for n in doc["notes"])


def test_an_unknown_store_name_is_refused_with_the_accepted_ones(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="unknown nope; accepted values: memory, hf3fs, hf3fs_e16, hf3fs_2t, hf3fs_e16_1pool"):
        l3_floor.open_stores(["memory", "nope"], tmp_path, 1 << 20, 4)


def test_a_read_that_returns_other_bytes_fails_the_run(tmp_path):
    """The byte check is real: a store whose reads hit but land other bytes fails the figure."""
    import ctypes

    import pytest

    store = l3_floor.open_stores(["memory"], tmp_path, 1 << 20, 4)["memory"]

    class Torn:
        def __getattr__(self, name):
            return getattr(store, name)

        def get_into(self, keys, pages):
            ok = store.get_into(keys, pages)
            addr, n = pages[0][0]
            ctypes.memset(addr + n // 2, 0xAB, 64)  # half a page from elsewhere
            return ok

    try:
        with pytest.raises(AssertionError, match="other bytes"):
            l3_floor.measure_store(Torn(), "torn", l3_floor.PinnedPages(4, 1 << 20), 4, 2, None)
    finally:
        store.close()


def test_quick_floor_reads_a_same_host_peer_in_one_pass_and_in_two(tmp_path):
    """``peer_shm``: two peer_rdma nodes of one host (shared_segment), the reader copying the
    holder's pages out of its file, checked byte for byte and against their checksums, in one
    pass (copy and hash per chunk) alternating with two passes, also at two other step sizes
    (``--peer-chunks``, each read checked too); the ratios. Run in a
    loopback-only namespace (the nodes' Transfer Engines listen on every interface)."""
    import subprocess

    import pytest

    from kvconnect.connectors.testing.netns import Netns
    from kvconnect.connectors.testing.peer import skip_reason
    from kvconnect.connectors.testing.processes import MOONCAKE_QUIET_ENV, child_env, python

    reason = skip_reason("grpc", "mooncake.engine")
    if reason:
        pytest.skip(reason)
    out = tmp_path / "l3_floor_peer.json"
    ns = Netns("kvf")
    try:
        proc = subprocess.run(ns.exec_prefix() + [python(), "-m", "kvconnect.benchmarks.l3_floor", "--quick",
                                                  "--stores", "peer_shm", "--peer-chunks", "64k,1m",
                                                  "--out", str(out)],
                              env=child_env(MOONCAKE_QUIET_ENV), capture_output=True, text=True, timeout=180)
    finally:
        ns.delete()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figs = json.loads(out.read_text())["figures"]
    peer = figs["peer_shm"]
    for f in (peer, peer["two_pass"]):
        assert f["get"]["gib_per_s"] > 0 and f["get"]["repeats"] == 3 and f["get_under_puts"]["writer_gib_per_s"] > 0
    c = peer["reader_counters"]  # every read came out of the holder's shared segment
    assert c["shared_reads"] > 0 and c["staged_reads"] == 0 and c["read_stale"] == 0, c
    names = {r["metric"] for r in json.loads(out.read_text())["ratios"]}
    assert {"peer_shm_get_over_2pass", "peer_shm_get_under_puts_over_2pass", "peer_shm_get_chunk_64k_over_2pass",
            "peer_shm_get_chunk_1024k_over_2pass"} <= names
    steps = peer["chunks"]
    assert {k: v["chunk_bytes"] for k, v in steps.items()} == {"64k": 64 << 10, "1024k": 1 << 20}
    assert all(v["get"]["repeats"] == 3 and v["two_pass_get"]["gib_per_s"] > 0 for v in steps.values())


def test_bad_peer_chunks_are_refused_naming_the_option(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvconnect.benchmarks.l3_floor", "--quick", "--stores", "memory",
                           "--peer-chunks", "1m,lots", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--peer-chunks" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.json").exists()
