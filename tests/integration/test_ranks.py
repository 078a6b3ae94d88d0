"""TP and PP ranks as processes over each shared store: what one rank writes, who may read it.

Real: four processes, each one SGLang TP rank (``kvconnect.connectors.testing.ranks``) of
two engines of TP 4, two of TP 2 x PP 2 (process r: TP rank r % 2 of stage r // 2) and, on
ranks 0 and 1, two engines of TP 2: an MHA model (per-rank KV) and an MLA model
(rank-replicated KV), each with a real SGLang 0.5.23 host KV pool
and a real ``MambaPoolHost`` side pool (TP-sharded state), kvconnect's backend built by
SGLang's ``StorageBackendFactory`` and registered as SGLang's controller registers it.
The stores are every registered store harness that claims ``shared``
(``kvconnect.connectors.testing.harness``): HF3FS with its metadata service, Mooncake with a
``mooncake_master`` and a segment holder (in a loopback-only network namespace), and a
peer pool whose nodes are the rank processes plus a memory-only seed node (same).

Checked, byte for byte (BLAKE2b of SGLang's flat pages): every rank reads back its own
MHA pages and never another rank's; MLA pages are written once (by the writer rank) and
read by every rank (of its pipeline stage); pipeline stages never read each other's pages;
the Mamba state is per rank even under MLA; clear and delete remove
only what that rank of that engine owns; HF3FS keeps one data file per rank for
per-rank KV and one shared file for replicated KV.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="needs sglang 0.5.23 (installed by scripts/install.sh)")

from kvconnect.connectors.base import Capability  # noqa: E402
from kvconnect.connectors.testing.harness import harness_class, harness_params  # noqa: E402
from kvconnect.connectors.testing.ranks import RankProcess  # noqa: E402

STORES = harness_params()
PAGE_GEOMETRY = {"page_size": 4, "layers": 2, "host_pages": 48}


def _keys(n: int, tag: str) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


@contextlib.contextmanager
def shared_store(name: str, variant: str, tmp: Path):
    """(store options, command prefix for the rank processes, where HF3FS-style stores keep
    their per-rank files) of one registered harness; skips a store that is not shared."""
    cls = harness_class(name)
    why = cls.skip_reason()
    if why:
        pytest.skip(why)
    with cls(tmp / "harness", variant) as harness:
        if Capability.SHARED not in harness.claims:
            pytest.skip(f"{harness.label} does not claim shared: ranks in processes of their own cannot share it")
        options = harness.options(0)
        prefix = options.get("file_path_prefix")
        yield options, harness.exec_prefix(), Path(prefix).parent if prefix else None


def _engines(rank: int) -> list[dict]:
    out = [{"name": "mha4", "model": "model/mha", "mla": False, "tp_rank": rank, "tp_size": 4, **PAGE_GEOMETRY},
           {"name": "mla4", "model": "model/mla", "mla": True, "tp_rank": rank, "tp_size": 4, **PAGE_GEOMETRY}]
    if rank < 2:
        out += [{"name": "mha2", "model": "model/mha2", "mla": False, "tp_rank": rank, "tp_size": 2, **PAGE_GEOMETRY},
                {"name": "mla2", "model": "model/mla2", "mla": True, "tp_rank": rank, "tp_size": 2, **PAGE_GEOMETRY}]
    # the four processes as TP 2 x PP 2: process r is TP rank r % 2 of pipeline stage r // 2
    stage = {"tp_rank": rank % 2, "tp_size": 2, "pp_rank": rank // 2, "pp_size": 2, "mamba": False, **PAGE_GEOMETRY}
    out += [{"name": "mha2pp2", "model": "model/mha-pp", "mla": False, **stage},
            {"name": "mla2pp2", "model": "model/mla-pp", "mla": True, **stage}]
    return out


@pytest.fixture(scope="module", params=STORES, ids=[f"{n}-{v}" if v else n for n, v in STORES])
def ranks(request, tmp_path_factory):
    """Four rank processes over one shared store, started together (each imports SGLang)."""
    name, variant = request.param
    tmp = tmp_path_factory.mktemp(name)
    with shared_store(name, variant, tmp) as (options, prefix, files):
        store = options["store"]
        procs: list[RankProcess] = []
        try:
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(RankProcess, f"{name}-rank{r}", store, options, _engines(r),
                                       prefix=prefix, log_dir=tmp) for r in range(4)]
                procs = [f.result() for f in futures]
            yield store, procs, files
        finally:
            for p in procs:
                p.close()


def _each_rank_reads_back_its_own(procs: list[RankProcess], engine: str, pool: str, keys: list[str],
                                 seed: int) -> list[dict]:
    """Every rank writes ``keys`` with bytes of its own, then reads back exactly those."""
    written = [p.write(engine, pool, keys, seed=seed + r) for r, p in enumerate(procs)]
    assert all(w["ok"] == [True] * len(keys) for w in written)
    for r, p in enumerate(procs):
        got = p.read(engine, pool, keys)
        assert got["ok"] == [True] * len(keys) and got["digests"] == written[r]["digests"], f"rank {r}"
    assert len({d for w in written for d in w["digests"]}) == len(keys) * len(procs)  # every page's bytes differ
    return written


@pytest.mark.parametrize("tp", [2, 4])
def test_mha_ranks_read_back_their_own_pages_and_never_anothers(ranks, tp):
    store, procs, _ = ranks
    procs, engine = procs[:tp], f"mha{tp}"
    _each_rank_reads_back_its_own(procs, engine, "kv", _keys(6, f"{store}/{engine}/shared"), seed=100)
    only0 = _keys(4, f"{store}/{engine}/rank0-only")
    assert procs[0].write(engine, "kv", only0, seed=7)["ok"] == [True] * 4
    for r, p in enumerate(procs[1:], 1):
        assert p.read(engine, "kv", only0)["ok"] == [False] * 4, f"rank {r} read rank 0's MHA pages"
        assert p.call("exists", engine=engine, keys=only0)["hits"] == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_mla_pages_are_written_once_and_read_by_every_rank(ranks, tp):
    store, procs, _ = ranks
    procs, engine = procs[:tp], f"mla{tp}"
    keys = _keys(5, f"{store}/{engine}/replicated")
    before = [p.call("stats", engine=engine)["store"]["put_pages"] for p in procs]
    # every rank offers its own bytes; only the writer rank's reach the store
    written = [p.write(engine, "kv", keys, seed=200 + r) for r, p in enumerate(procs)]
    assert all(w["ok"] == [True] * 5 for w in written)
    after = [p.call("stats", engine=engine)["store"]["put_pages"] for p in procs]
    assert [a - b for a, b in zip(after, before)] == [5] + [0] * (tp - 1)
    for r, p in enumerate(procs):
        got = p.read(engine, "kv", keys)
        assert got["ok"] == [True] * 5 and got["digests"] == written[0]["digests"], f"rank {r}"


@pytest.mark.parametrize("tp", [2, 4])
def test_mamba_state_is_per_rank_even_under_mla(ranks, tp):
    store, procs, _ = ranks
    engine = f"mla{tp}"
    _each_rank_reads_back_its_own(procs[:tp], engine, "mamba", _keys(3, f"{store}/{engine}/state"), seed=300)


def test_pipeline_stages_keep_their_own_pages(ranks):
    """TP 2 x PP 2: the same page hashes on the two stages are different layers. MHA: each
    of the four (TP, PP) ranks reads back its own bytes only. MLA: per stage, the stage's
    writer rank (TP 0) writes once and its other TP rank reads that; the stages never see
    each other's."""
    store, procs, _ = ranks
    _each_rank_reads_back_its_own(procs, "mha2pp2", "kv", _keys(5, f"{store}/pp/mha"), seed=600)
    keys = _keys(5, f"{store}/pp/mla")
    before = [p.call("stats", engine="mla2pp2")["store"]["put_pages"] for p in procs]
    written = [p.write("mla2pp2", "kv", keys, seed=700 + r) for r, p in enumerate(procs)]
    assert all(w["ok"] == [True] * 5 for w in written)
    after = [p.call("stats", engine="mla2pp2")["store"]["put_pages"] for p in procs]
    assert [a - b for a, b in zip(after, before)] == [5, 0, 5, 0]  # one writer per stage
    assert written[0]["digests"] != written[2]["digests"]
    for r, p in enumerate(procs):
        got = p.read("mla2pp2", "kv", keys)
        writer = 2 * (r // 2)
        assert got["ok"] == [True] * 5 and got["digests"] == written[writer]["digests"], f"process {r}"


def test_clear_and_delete_remove_only_what_that_rank_of_that_engine_owns(ranks):
    store, procs, _ = ranks
    h = _keys(4, f"{store}/scope")
    for r, p in enumerate(procs):
        for engine in ("mha4", "mla4"):
            assert p.write(engine, "kv", h, seed=400 + r)["ok"] == [True] * 4
        assert p.write("mha4", "mamba", h, seed=500 + r)["ok"] == [True] * 4
    # delete on rank 1 of the MHA engine: its page only
    assert procs[1].call("delete", engine="mha4", keys=h[:1])["deleted"] == [True]
    assert procs[1].read("mha4", "kv", h)["ok"] == [False, True, True, True]
    assert procs[2].read("mha4", "kv", h)["ok"] == [True] * 4
    assert procs[1].read("mla4", "kv", h)["ok"] == [True] * 4
    # clear on rank 0 of the MHA engine: rank 0's KV and Mamba pages, nothing else
    assert procs[0].call("clear", engine="mha4")["cleared"] is True
    assert procs[0].read("mha4", "kv", h)["ok"] == [False] * 4
    assert procs[0].read("mha4", "mamba", h)["ok"] == [False] * 4
    for r in (2, 3):
        assert procs[r].read("mha4", "kv", h)["ok"] == [True] * 4
        assert procs[r].read("mha4", "mamba", h)["ok"] == [True] * 4
    assert all(p.read("mla4", "kv", h)["ok"] == [True] * 4 for p in procs)
    # a reader rank of replicated KV owns none of it: its clear leaves it for every rank
    assert procs[3].call("clear", engine="mla4")["cleared"] is True
    assert all(p.read("mla4", "kv", h)["ok"] == [True] * 4 for p in procs)
    assert procs[0].call("clear", engine="mla4")["cleared"] is True  # the writer's clears it
    assert all(p.read("mla4", "kv", h)["ok"] == [False] * 4 for p in procs)


def test_hf3fs_keeps_a_file_per_rank_and_one_for_replicated_kv(ranks):
    """SGLang's HF3FS naming: ``{prefix}.{rank}.bin`` per rank for per-rank KV, rank 0's
    file for replicated KV (pages of another size get a lane ``.bin.p<bytes>`` of the same
    file). MLA pages here are 384 bytes: no rank but 0 has a lane of that size."""
    store, procs, files = ranks
    if files is None:
        pytest.skip(f"{store} keeps no per-rank files")
    names = {p.name for p in files.iterdir() if not p.name.endswith(".lock")}
    assert {f"kv.{r}.bin" for r in range(4)} <= names, sorted(names)
    assert not any(f"kv.{r}.bin.p384" in names for r in (1, 2, 3)), sorted(names)
