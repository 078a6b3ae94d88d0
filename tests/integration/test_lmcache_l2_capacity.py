"""Two real ``lmcache server`` processes over a Mooncake cluster or a peer pool: usage,
cross-server reads, and writes past the store's capacity.

Mooncake: a real ``mooncake_master`` and a segment holder (16 MiB, Mooncake's smallest
segment; the servers lend none). The peer pool: a seed node lending nothing and one node
per server lending 4 MiB (``placement=local``: a server's pages land in its own segment).
Each runs in a loopback-only namespace with both servers and LMCache's engine client
(``testing.lmcache share --fill``). A stores two sequences (``skip_l1``), B finds and
retrieves them checksum-exact; then A and B each store sequences of their own, alternating,
to 1.5 times the store's capacity. Checked, from ``GET /status`` and ``lmcache describe kvcache``:

* the store's capacity (the master's mounted segments; every pool member's lent segment)
  and used bytes, from the store, empty (0) and after A's two sequences (4 chunks), the same
  on both servers;
* while and after writing past it, the store's bytes never exceed its capacity and, full,
  stay within one eviction batch of it (``mooncake_master`` evicts 5 % of its objects once
  above its 90 % watermark; each pool node evicts one LRU page per page it needs), eviction
  is the store's (LMCache's ``global_eviction`` off), no L2 write failed, and each server
  still finds the other's newest sequence.

HF3FS's case runs over the two servers of ``test_lmcache_l2.py`` (its ``servers`` fixture).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.base", reason="needs lmcache (pip install \"kvconnect[lmcache]\")")

from kvconnect.connectors.testing.harness import harness_class  # noqa: E402
from kvconnect.connectors.testing.lmcache import check_fill, described  # noqa: E402
from kvconnect.connectors.testing.processes import child_env  # noqa: E402

CHUNK = 512 * 1024  # EngineClient.SHAPE: 256 tokens of 4 layers
MB = 1 << 20

# store -> (harness capacity, the store's capacity in bytes, sequences each server stores
# past it (2 chunks each), the lowest full figure: capacity less one eviction batch)
CASES = {
    "mooncake": ("16mb", 16 * MB, 12, int(16 * MB * 0.85) - CHUNK),
    "peer_rdma": ("0", 8 * MB, 6, 8 * MB - 2 * CHUNK),  # two nodes of 4 MiB, one page each
}
# each server's node; the pool's figures re-read every second (default 5 s)
OPTIONS = {"peer_rdma": {"global_segment_size": "4mb", "pool_usage_interval": 1}}


@pytest.mark.parametrize("store", sorted(CASES))
def test_two_servers_share_and_write_past_the_stores_capacity(store, tmp_path):
    size, cap, fill_seqs, lowest = CASES[store]
    cls = harness_class(store)
    why = cls.skip_reason()
    if why:
        pytest.skip(why)
    with cls(tmp_path / "harness", capacity=size) as harness:
        params, prefix = {**harness.options(0), **OPTIONS.get(store, {})}, harness.exec_prefix()
        out = tmp_path / "share.json"
        p = subprocess.run(prefix + [sys.executable, "-m", "kvconnect.connectors.testing.lmcache", "share",
                                     "--params", json.dumps(params), "--out", str(out), "--fill", str(fill_seqs)],
                           env=child_env(), capture_output=True, text=True, timeout=300)
        doc = json.loads(out.read_text()) if out.exists() else {"error": (p.stdout + p.stderr)[-3000:]}
    assert "error" not in doc, doc.get("error")
    assert p.returncode == 0
    print(store, "capacity", cap, "bytes after each pair of sequences", doc["fill"]["samples"], "seconds",
          doc["seconds"])
    for seq, sums in doc["stored"].items():  # B reads what A stored
        assert sums and doc["retrieved"][seq] == sums and doc["b_hits"][seq] == [2, 2]
    a, b, empty = doc["a_status"], doc["b_status"], doc["a_empty"]
    assert a["store"] == store and a["errors"] == {} and a["store_stats"]["put_written"] >= 4
    assert b["store_stats"]["get_hits"] >= 4 and b["errors"] == {}
    assert (empty["current_size_bytes"], empty["max_capacity_bytes"]) == (0, cap), empty
    assert empty["usage"] == {"bytes_used_from": "store", "capacity_from": "store", "stale": False,
                              "usage_fraction": 0.0, "shared": True, "global_eviction": False,
                              "eviction_by": "store"}
    assert described(doc["describe_empty"]) == (0, cap)
    for st in (a, b):  # A's two sequences, in the store, seen by both
        assert (st["current_size_bytes"], st["max_capacity_bytes"]) == (4 * CHUNK, cap), st
    check_fill(doc["fill"], cap, lowest, fill_seqs)
    assert None not in doc["exit_codes"]  # both stopped cleanly on SIGINT
