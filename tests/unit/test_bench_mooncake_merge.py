"""``kvconnect.benchmarks.mooncake._merge``: figures of several worker processes pooled into one set."""

from __future__ import annotations

import statistics

from kvconnect.benchmarks.mooncake import _merge


def _fig(put: list[float], get: list[float], path: dict | None = None) -> dict:
    nbytes = 1 << 30  # one GiB per call: GiB/s = 1 / seconds
    f = {"put_s": statistics.median(put), "get_s": statistics.median(get),
         "put_gib_s": nbytes / (1 << 30) / statistics.median(put),
         "get_gib_s": nbytes / (1 << 30) / statistics.median(get), "put_all_s": put, "get_all_s": get}
    if path is not None:
        f["path"] = path
    return f


def test_merge_pools_repetitions_in_order_and_recomputes_medians_and_rates():
    a = {"page_nbytes": 524288, "raw": _fig([1.0, 3.0], [2.0, 2.0]),
         "kvc": _fig([2.0, 4.0], [1.0, 1.0], {"direct_pages": 5, "call_mode": "worker"})}
    b = {"page_nbytes": 524288, "raw": _fig([5.0], [4.0]),
         "kvc": _fig([0.5], [8.0], {"direct_pages": 7, "call_mode": "worker"})}
    m = _merge([a, b], 1 << 30)
    assert m["page_nbytes"] == 524288
    # process after process, so repetition i of one system still pairs with repetition i of another
    assert m["raw"]["put_all_s"] == [1.0, 3.0, 5.0] and m["kvc"]["put_all_s"] == [2.0, 4.0, 0.5]
    assert m["raw"]["put_s"] == 3.0 and m["kvc"]["get_s"] == 1.0
    assert abs(m["raw"]["put_gib_s"] - 1 / 3.0) < 1e-12 and abs(m["kvc"]["get_gib_s"] - 1.0) < 1e-12
    assert m["raw"]["put_s_per_process"] == [2.0, 5.0]
    assert m["kvc"]["path"] == {"direct_pages": 12, "call_mode": "worker"}  # counters summed, labels kept
    assert a["raw"]["put_all_s"] == [1.0, 3.0]  # inputs untouched


def test_merge_of_one_process_keeps_its_figures():
    a = {"page_nbytes": 1, "raw": _fig([1.0, 2.0, 3.0], [1.0, 1.0, 4.0])}
    m = _merge([a], 1 << 30)
    assert m["raw"]["put_s"] == 2.0 and m["raw"]["get_all_s"] == [1.0, 1.0, 4.0]
