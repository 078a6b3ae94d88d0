"""The vLLM connector's vLLM-free parts: config, page hashes, key spaces, block layouts."""

from __future__ import annotations

import pytest

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.engines.vllm_pages import (
    BlockCodec,
    PageGeometry,
    ENGINE_KEYS,
    WHERE,
    VLLMConnectorConfig,
    engine_context,
    lora_weights,
    page_hashes,
    rank_keyspaces,
    salt_seed,
    store_requirements,
)

torch = pytest.importorskip("torch")


def test_config_keys_and_errors_name_the_key_and_accepted_values():
    c = VLLMConnectorConfig.parse({"store": "memory", "capacity": "1gb", "page_layout": "page_first",
                                   "staging_size": "64mb", "model_name": "m", "tenant": "t"})
    assert (c.page_layout, c.staging_size, c.model_name, c.tenant) == ("page_first", 64 << 20, "m", "t")
    assert VLLMConnectorConfig.parse({"store": "memory"}).page_layout == "native"
    with pytest.raises(ConfigError, match=r"'page_layout'.*accepted: 'native', 'layer_first', 'page_first'"):
        VLLMConnectorConfig.parse({"store": "memory", "page_layout": "nhd"})
    with pytest.raises(ConfigError, match=r"'store': is required.*accepted: .*'hf3fs'"):
        VLLMConnectorConfig.parse({"page_layout": "native"})
    with pytest.raises(ConfigError, match="'staging_size'"):
        VLLMConnectorConfig.parse({"store": "memory", "staging_size": "lots"})
    with pytest.raises(ConfigError, match="'model_name'"):
        VLLMConnectorConfig.parse({"store": "memory", "model_name": 3})


def test_page_hashes_are_sglang_hicache_hashes():
    tokens = list(range(5000, 5000 + 32 * 4 + 7))
    h = page_hashes(tokens, 32)
    assert len(h) == 4 and len(set(h)) == 4
    assert page_hashes(tokens, 32, 2) == h[:2]
    assert page_hashes(tokens[:32 * 2 + 3], 32) == h[:2]  # prefix chained
    salted = page_hashes(tokens, 32, seed=salt_seed("alice"))
    assert not set(salted) & set(h)
    assert page_hashes(tokens, 32, seed=salt_seed("alice", ["img0"])) != salted
    try:
        from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed
    except ImportError:
        pytest.skip("needs sglang for the cross-check")
    assert get_hash_str(tokens, None, page_size=32)[:4] == h
    assert storage_namespace_seed(None, "alice") == salt_seed("alice")
    assert get_hash_str(tokens, salt_seed("alice"), page_size=32)[:4] == salted


def test_key_spaces_separate_ranks_loras_layouts_and_match_sglang_for_its_layouts():
    geo = PageGeometry(layers=4, kv_heads=2, head_dim=64, block_size=32, dtype="bfloat16", itemsize=2,
                       layout="layer_first")
    ks = geo.keyspace(model="m")
    assert ks.layout == "layer_first" and ks.geometry == f"mha:L4:H2:D64:B{2 * 4 * 32 * 2 * 64 * 2}"
    spaces = rank_keyspaces(ks, 2, 2, [3, 1], geo)
    assert len({s.prefix for s in spaces}) == 4
    assert spaces[2].geometry.startswith("mha:L1:")  # PP stage 1 holds one layer
    native = PageGeometry(**{**geo.__dict__, "layout": "native", "backend_block": "2x32x128"}).keyspace(model="m")
    assert native.prefix != ks.prefix and native.layout == "vllm-native"
    assert geo.keyspace(model="m", weights=lora_weights("", "sql")).prefix != ks.prefix


def _cpu_cache(nb=6, h=2, n=4, d=8):
    return [torch.randn(nb, h, n, 2 * d).to(torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("layout", ["native", "layer_first", "page_first"])
def test_block_codec_round_trips_blocks_byte_exact(layout):
    layers = _cpu_cache()
    codec = BlockCodec(layers, 6, 4, 2, 8, layout)
    assert codec.kind == "cpu" and codec.page_nbytes == 3 * 2 * 4 * 2 * 8 * 2
    pages = torch.empty((2, codec.page_elems), dtype=torch.bfloat16)
    codec.gather(torch.tensor([4, 1]), pages)
    dst = [torch.zeros_like(t) for t in layers]
    BlockCodec(dst, 6, 4, 2, 8, layout).scatter(torch.tensor([0, 5]), pages)
    for t, u in zip(layers, dst):
        assert torch.equal(u[0], t[4]) and torch.equal(u[5], t[1])
        assert not u[1:5].any()


def test_layer_first_pages_are_sglang_flat_pages_of_cpu_blocks():
    """[K/V][layer][token][head][dim]; the CPU backend keeps K rows then V rows per head."""
    nb, h, n, d = 3, 2, 4, 8
    layers = _cpu_cache(nb, h, n, d)
    codec = BlockCodec(layers, nb, n, h, d, "layer_first")
    page = torch.empty((1, codec.page_elems), dtype=torch.bfloat16)
    codec.gather(torch.tensor([2]), page)
    want = torch.empty(2, len(layers), n, h, d, dtype=torch.bfloat16)
    for li, t in enumerate(layers):
        blk = t[2].reshape(h, 2 * n, d)  # rows 0..n-1: K, n..2n-1: V
        want[0, li] = blk[:, :n].permute(1, 0, 2)
        want[1, li] = blk[:, n:].permute(1, 0, 2)
    assert torch.equal(page[0], want.flatten())


def test_block_codec_kv_first_shape_and_unknown_shapes():
    layers = [torch.randn(2, 5, 4, 2, 8) for _ in range(2)]  # [2, NB, N, H, D]
    codec = BlockCodec(layers, 5, 4, 2, 8, "page_first")
    pages = torch.empty((1, codec.page_elems))
    codec.gather(torch.tensor([3]), pages)
    v = pages.view(2, 4, 2, 2, 8)  # [K/V][token][layer][head][dim]
    assert torch.equal(v[1, :, 1], layers[1][1, 3])
    with pytest.raises(ValueError, match="needs a KV cache shape"):
        BlockCodec([torch.randn(5, 64) for _ in range(2)], 5, 4, 2, 4, "layer_first")
    assert BlockCodec([torch.randn(5, 64) for _ in range(2)], 5, 4, 2, 4, "native").backend_block == "64"


def test_ranks_go_in_the_context_and_several_ranks_need_a_shared_store(tmp_path):
    from kvconnect.connectors.engines.common import build_store
    from kvconnect.connectors.errors import MissingCapability
    from kvconnect.connectors.hf3fs.store import HF3FSStore
    from kvconnect.connectors.registry import check_capabilities

    assert store_requirements(engine_context("m")) == {}  # one rank: any store
    store, _ = build_store({"store": "memory"}, where=WHERE, engine_keys=ENGINE_KEYS, context=engine_context("m"),
                           require=store_requirements(engine_context("m")))
    store.close()
    for ranks in ({"tp_rank": 1, "tp_size": 2}, {"pp_rank": 1, "pp_size": 2}):
        ctx = engine_context("m", **ranks)
        assert ctx.cross_rank_lookups and (ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size) == (
            ranks.get("tp_rank", 0), ranks.get("tp_size", 1), ranks.get("pp_rank", 0), ranks.get("pp_size", 1))
        with pytest.raises(MissingCapability, match="'shared'.*scheduler") as e:
            build_store({"store": "memory"}, where=WHERE, engine_keys=ENGINE_KEYS, context=ctx,
                        require=store_requirements(ctx))
        assert e.value.capability == "shared" and WHERE in str(e.value)
        # a shared store passes; HF3FS keeps one file and namespace for every rank of vLLM
        shared = HF3FSStore.config_from_options({"file_path_prefix": str(tmp_path / "f"), "file_size": "1mb",
                                                 "numjobs": 1, "entries": 1, "metadata_server_url": "http://127.0.0.1:1"})
        check_capabilities(HF3FSStore, shared, "hf3fs", store_requirements(ctx), store_requirements(ctx))
    local = HF3FSStore.config_from_options({"file_path_prefix": str(tmp_path / "g"), "file_size": "1mb",
                                            "numjobs": 1, "entries": 1})
    with HF3FSStore(local, engine_context("m", tp_rank=1, tp_size=2)) as s:
        assert s.file_rank == 0 and s.context.tp_rank == 1
