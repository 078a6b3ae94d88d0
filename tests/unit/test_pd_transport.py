"""Address arithmetic and wire formats of the PD transfer backend (no SGLang, no Mooncake needed)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvconnect.connectors.base import ConfigError
from kvconnect.connectors.engines.pd_transport import (
    BufferLayout,
    Marker,
    PDConfig,
    RelayKeys,
    StoreRelay,
    contiguous_runs,
    kv_blocks,
    load_pd_config,
    page_segments,
    token_matches,
)


def test_contiguous_runs_break_where_either_side_jumps():
    src = np.array([4, 5, 6, 9, 10, 11])
    dst = np.array([0, 1, 7, 8, 9, 3])
    assert contiguous_runs(src, dst) == [(4, 0, 2), (6, 7, 1), (9, 8, 2), (11, 3, 1)]
    with pytest.raises(ValueError):
        contiguous_runs(np.array([1, 2]), np.array([1]))


def test_kv_blocks_cover_exactly_the_requested_pages():
    layout = BufferLayout(kv_ptrs=(1000, 5000), kv_lens=(400, 400), kv_item_lens=(10, 20),
                          aux_ptrs=(), aux_lens=(), aux_item_lens=())
    blocks = kv_blocks(layout, [90_000, 95_000], np.array([3, 4, 8]), np.array([0, 1, 2]))
    assert blocks == [(1030, 90_000, 20), (1080, 90_020, 10), (5060, 95_000, 40), (5160, 95_040, 20)]


def test_page_segments_are_buffer_major_and_match_on_both_sides():
    """Prefill and decode must serialise a block in the same byte order whatever their slots."""
    layout = BufferLayout(kv_ptrs=(0, 1 << 20), kv_lens=(1 << 20,) * 2, kv_item_lens=(16, 32),
                          aux_ptrs=(), aux_lens=(), aux_item_lens=())
    a = page_segments(layout.kv_ptrs, layout.kv_item_lens, np.array([2, 3, 7]))
    b = page_segments(layout.kv_ptrs, layout.kv_item_lens, np.array([10, 40, 41]))
    assert [n for _, n in a] == [32, 16, 64, 32] and [n for _, n in b] == [16, 32, 32, 64]
    assert sum(n for _, n in a) == sum(n for _, n in b) == 3 * layout.page_bytes


def test_marker_round_trip_and_rejects_garbage():
    m = Marker(room=2**63 - 5, npages=123, block_pages=16, page_bytes=65536, aux_bytes=9000, state_counts=(1, 0, 3))
    data = m.pack()
    assert len(data) == 64 and Marker.unpack(data) == m
    with pytest.raises(ValueError):
        Marker.unpack(b"\0" * 64)


def test_relay_keys_name_every_key_of_a_room_once():
    keys = RelayKeys("kvcpd.127.0.0.1_5000.42", npages=35, block_pages=16, state_counts=[2, 1])
    names = keys.all()
    assert len(names) == len(set(names)) == 3 + 1 + 3 + 1
    assert keys.block_range(2) == (32, 35) and names[-1].endswith(".done")


def test_relay_moves_a_room_in_calls_of_at_most_call_bytes():
    relay = types.SimpleNamespace(config=PDConfig(transport="mooncake", call_bytes=6))
    pages = [[(0, 3)], [(8, 2), (16, 1)], [(32, 3)], [(48, 10)], [(64, 1)]]
    runs = StoreRelay._calls(relay, pages)
    assert runs == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]  # a page larger than the limit goes alone
    assert [i for r in runs for i in range(len(pages))[r]] == list(range(len(pages)))
    assert StoreRelay._calls(relay, []) == []


def test_config_from_json_text_file_and_env_token(tmp_path, monkeypatch):
    path = tmp_path / "pd.json"
    path.write_text('{"transport": "hf3fs", "store": {"file_path_prefix": "/x"}, "key_bytes": "1mb"}')
    cfg = load_pd_config(str(path))
    assert cfg.transport == "hf3fs" and cfg.is_relay and cfg.key_bytes == 1 << 20
    monkeypatch.setenv("KVCONNECT_PD_TOKEN", "t0k")
    assert load_pd_config('{"transport": "peer_rdma"}').auth_token == "t0k"
    assert token_matches("t0k", "t0k") and not token_matches("t0k", "nope") and not token_matches("t0k", None)
    assert token_matches(None, None)
    with pytest.raises(ConfigError, match="timeout_s"):
        load_pd_config('{"timeout_s": -1}')
    with pytest.raises(ConfigError, match="neither JSON nor a readable file"):
        load_pd_config("/no/such/file.json")


def test_relay_on_gpu_memory_refuses_hf3fs_and_warns_only_for_the_non_cuda_mooncake(monkeypatch, caplog):
    """On a GPU the relay hands device pointers to the store: hf3fs (file I/O) is refused with a
    config error; mooncake is warned about only when the -non-cuda wheel is what is installed."""
    pytest.importorskip("sglang", reason="needs sglang (the CI venv has it)")
    import importlib.metadata as md
    import logging

    from kvconnect.connectors.engines import sglang_pd
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_device", lambda: types.SimpleNamespace(device="cuda:0"))
    with pytest.raises(ConfigError, match="transport"):
        sglang_pd.KVConnectKVManager._check_relay_device(PDConfig(transport="hf3fs"))

    installed = {"mooncake-transfer-engine-non-cuda"}

    def distribution(name):
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return object()

    monkeypatch.setattr(md, "distribution", distribution)
    with caplog.at_level(logging.WARNING, logger=sglang_pd.logger.name):
        sglang_pd.KVConnectKVManager._check_relay_device(PDConfig(transport="mooncake"))
    assert "non-cuda is installed" in caplog.text
    caplog.clear()
    installed.clear()  # a CUDA build (or a bundle without package metadata)
    with caplog.at_level(logging.WARNING, logger=sglang_pd.logger.name):
        sglang_pd.KVConnectKVManager._check_relay_device(PDConfig(transport="mooncake"))
    assert caplog.text == ""
    monkeypatch.setattr(runtime_context, "get_device", lambda: types.SimpleNamespace(device="cpu"))
    sglang_pd.KVConnectKVManager._check_relay_device(PDConfig(transport="hf3fs"))  # CPU memory: fine
