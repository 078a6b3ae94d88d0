"""``namespace``: key spaces keep engines apart unless their bytes are interchangeable; hit policies."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvconnect.connectors.base import ConfigError
from kvconnect.namespace import HitPolicy, KeySpace, count_hits, leading_hits, restorable_prefixes

H = "ab" * 32  # a 64-hex SGLang page hash

BASE = KeySpace(model="Qwen/Qwen3-32B", layout="page_first", page_size=64, dtype="bfloat16",
                geometry="mha:L64:H4:D128", tp_rank=0, tp_size=2)


def test_tp_ranks_never_share_keys():
    r0, r1 = BASE, replace(BASE, tp_rank=1)
    assert r0.key(H) != r1.key(H)


def test_mla_ranks_share_keys():
    mla = replace(BASE, geometry="mla:L61:R512:P64", rank_replicated=True, tp_size=8)
    keys = {replace(mla, tp_rank=r).key(H) for r in range(8)}
    assert len(keys) == 1
    # Even a different tp_size shares MLA pages (rank-replicated KV is identical everywhere).
    assert replace(mla, tp_size=4, tp_rank=3).key(H) == mla.key(H)
    # ... but MLA pages never collide with the per-rank pages of the same model.
    assert mla.key(H) != BASE.key(H)


@pytest.mark.parametrize("change", [
    {"tenant": "team-b"}, {"pool": "mamba"}, {"model": "Qwen/Qwen3-8B"}, {"dtype": "float8_e4m3fn"},
    {"layout": "layer_first"}, {"page_size": 32}, {"geometry": "mha:L64:H8:D128"}, {"weights": "rev2"},
    {"pp_rank": 1, "pp_size": 2}, {"cp_rank": 1, "cp_size": 2}, {"tp_size": 4}, {"kv_scales": "mxfp8"},
])
def test_every_identity_field_changes_the_key(change):
    other = replace(BASE, **change)
    assert other.key(H) != BASE.key(H)
    assert other.prefix != BASE.prefix


def test_same_identity_same_keys_and_stable_across_processes():
    same = KeySpace(model="Qwen/Qwen3-32B", layout="page_first", page_size=64, dtype="bfloat16",
                    geometry="mha:L64:H4:D128", tp_rank=0, tp_size=2)
    assert same.key(H) == BASE.key(H) and same == BASE
    assert BASE.keys([H, "cd" * 32]) == [BASE.key(H), BASE.key("cd" * 32)]
    code = ("from kvconnect.namespace import KeySpace; import sys; sys.stdout.write(KeySpace(model='Qwen/Qwen3-32B', "
            "layout='page_first', page_size=64, dtype='bfloat16', geometry='mha:L64:H4:D128', tp_rank=0, "
            f"tp_size=2).key('{H}'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
                         cwd=__import__("pathlib").Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout == BASE.key(H)


def test_the_writer_rule_lives_in_the_engine_context_once():
    """SGLang's is_storage_writer: every rank writes per-rank KV; for rank-replicated KV the
    TP rank equal to its DCP rank (rank 0 without DCP) writes and the others only read."""
    from kvconnect.connectors.context import EngineContext

    assert all(EngineContext(tp_rank=r, tp_size=4).is_writer for r in range(4))
    mla = [EngineContext(tp_rank=r, tp_size=4, rank_replicated=True) for r in range(4)]
    assert [c.is_writer for c in mla] == [True, False, False, False]
    assert {c.data_rank for c in mla} == {0} and mla[2].sharing_ranks == 4
    dcp = EngineContext(tp_rank=1, tp_size=4, dcp_rank=1, dcp_size=2, rank_replicated=True)
    assert dcp.is_writer and dcp.writer_rank == 1
    side = mla[2].for_pool("mamba", rank_replicated=False)  # Mamba state is TP-sharded under MLA
    assert side.is_writer and side.data_rank == 2 and side.pool == "mamba"
    assert [EngineContext(tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, dp_rank=d).rank_index
            for d in range(2) for p in range(2) for t in range(2)] == list(range(8))
    with pytest.raises(ConfigError, match="tp_rank"):
        EngineContext(tp_rank=2, tp_size=2)


def test_side_pool_keyspace():
    mamba = BASE.for_pool("mamba")
    assert mamba.pool == "mamba" and mamba.model == BASE.model and mamba.key(H) != BASE.key(H)
    assert "mamba" in mamba.describe() and mamba.prefix in mamba.describe()


@pytest.mark.parametrize("bad", [
    {"model": ""}, {"tp_rank": 2, "tp_size": 2}, {"tp_size": 0}, {"pp_rank": -1}, {"cp_rank": 1},
    {"page_size": 0},
])
def test_invalid_keyspaces_are_refused(bad):
    with pytest.raises(ValueError):
        replace(BASE, **bad)


def test_identity_is_json():
    ident = BASE.identity()
    json.dumps(ident)
    assert ident["tp_rank"] == 0 and "writer_rank" not in ident
    assert replace(BASE, rank_replicated=True).identity()["tp_rank"] is None


# ---------------------------------------------------------------------------------
# Hit policies
# ---------------------------------------------------------------------------------

T, F = True, False


@pytest.mark.parametrize("present,expected", [
    ([], 0), ([F], 0), ([T], 1), ([T, T, F, T], 2), ([F, T, T], 0), ([T] * 5, 5),
])
def test_prefix_counts_the_leading_run(present, expected):
    assert leading_hits(present) == expected
    assert count_hits(present) == expected
    assert count_hits(present, HitPolicy.PREFIX) == expected
    assert count_hits(present, "prefix") == expected


@pytest.mark.parametrize("present,expected", [([T, T, T], 3), ([T, F, T], 1), ([F, T], 0)])
def test_all_pages_clamps_to_the_leading_run(present, expected):
    assert count_hits(present, HitPolicy.ALL_PAGES) == expected
    assert count_hits(present, "ALL_PAGES") == expected


def test_trailing_pages_window_only():
    # `present` is the window itself: all or nothing.
    assert count_hits([T, T, T], HitPolicy.TRAILING_PAGES) == 3
    assert count_hits([F, T, T], HitPolicy.TRAILING_PAGES) == 0
    assert count_hits([], HitPolicy.TRAILING_PAGES) == 0


def test_trailing_pages_over_a_span():
    # Holes before the window do not matter: only the N pages ending at the stop point.
    span = [F, T, T, T, F, T, T]
    assert count_hits(span, HitPolicy.TRAILING_PAGES, trailing=2) == 7
    assert count_hits(span[:5], HitPolicy.TRAILING_PAGES, trailing=2) == 4
    assert count_hits([F, F, F], HitPolicy.TRAILING_PAGES, trailing=1) == 0
    assert count_hits([F, F, T], HitPolicy.TRAILING_PAGES, trailing=1) == 3


def test_policies_accept_sglang_pool_hit_policy():
    sglang_storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                                         reason="sglang not installed: SGLang's PoolHitPolicy enum unavailable")
    P = sglang_storage.PoolHitPolicy
    assert HitPolicy.parse(P.ALL_PAGES) is HitPolicy.ALL_PAGES
    assert HitPolicy.parse(P.TRAILING_PAGES) is HitPolicy.TRAILING_PAGES
    assert count_hits([T, F, T], P.TRAILING_PAGES, trailing=1) == 3


def test_unknown_policy_names_accepted_values():
    with pytest.raises(ValueError) as e:
        count_hits([T], "suffix")
    assert "'hit_policy'" in str(e.value)
    for p in ("prefix", "all_pages", "trailing_pages", "block_groups"):
        assert f"'{p}'" in str(e.value)


def test_block_groups_count_the_full_pages_of_leading_complete_groups():
    """SGLang 0.5.23 BLOCK_GROUPS: the pool's own keys come in groups of group_pages, one
    group per block of block_pages FULL pages; only whole groups count, from the start."""
    from kvconnect.namespace import block_group_pages

    keys = [T, T, T, T, T, F, T, T]  # groups of 2: complete, complete, broken, complete
    assert block_group_pages(keys, group_pages=2, block_pages=16) == 32
    assert count_hits(keys, HitPolicy.BLOCK_GROUPS, group_pages=2, block_pages=16) == 32
    assert restorable_prefixes(keys, HitPolicy.BLOCK_GROUPS, group_pages=2, block_pages=16) == [16, 32]
    assert block_group_pages(keys, group_pages=2, block_pages=16, span_pages=20) == 20  # the span's end
    assert block_group_pages([T, T, T], group_pages=2) == 2  # a trailing partial group covers nothing
    assert block_group_pages([F, T], group_pages=1, block_pages=4) == 0


def test_unsalted_key_spaces_keep_their_keys():
    """Adding the salt field left every unsalted key space where it was (existing caches hit)."""
    assert BASE.prefix == "kvc1-f9df7c1beef0a4280c73"
    assert KeySpace(model="m", tenant="t").prefix == "kvc1-a5377a7d2cdff5ac4eb4"


def test_no_two_tenant_salt_pairs_share_a_key_space():
    """Every (tenant, salt) pair over parts with separators, escapes and empties is its own key
    space (tenant 'a' + salt 'b/' and tenant 'a/b' without salt used to be one)."""
    parts = ["", "a", "b", "a/b", "b/", "/b", "a/", "/", "//", "a\\b", "a:b", '"', "a,b", "a b", "\x00"]
    spaces = {}
    for tenant in parts:
        for salt in parts:
            p = replace(BASE, tenant=tenant, salt=salt).prefix
            assert p not in spaces, f"{(tenant, salt)} and {spaces[p]} share {p}"
            spaces[p] = (tenant, salt)
    assert len(spaces) == len(parts) ** 2
    from kvconnect.connectors.engines.lmcache_l2 import ObjectKeyMapper

    assert ObjectKeyMapper(tenant="a").space("m", 0, "b/").prefix != ObjectKeyMapper(tenant="a/b").space("m", 0, "").prefix
    # no tenant, no salt: a stable prefix across processes and releases. It changed once, on
    # purpose, when chunks were keyed by their L1 dtype (docs/lmcache.md: earlier chunks miss).
    assert ObjectKeyMapper().space("m", 0, "").prefix == "kvc1-d61fd409a81f9b1e3c85"


def test_an_unnamed_model_never_shares_keys_with_a_named_one():
    from kvconnect.namespace.keyspace import UNNAMED_MODEL, model_key

    names = ["", None, UNNAMED_MODEL, "<" + UNNAMED_MODEL, "<x", "meta-llama/Llama-3-8B", "unnamed-model"]
    mapped = [model_key(n) for n in names]
    assert mapped[0] == mapped[1] == UNNAMED_MODEL  # no name at all: one key space
    assert len(set(mapped[1:])) == len(names) - 1  # every real name gets its own, "<unnamed>" included
    assert model_key("meta-llama/Llama-3-8B") == "meta-llama/Llama-3-8B"  # ordinary names unchanged
    spaces = {KeySpace(model=model_key(n), layout="l").prefix for n in ("", UNNAMED_MODEL)}
    assert len(spaces) == 2
