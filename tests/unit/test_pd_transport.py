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
)
from kvconnect.connectors.auth import token_matches


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
    assert keys.block_range(2) == (32, 35) and names[-1] == "done"
    assert not any(n.startswith("kvcpd") for n in names)  # the room's view adds its namespace


def test_relay_moves_a_room_in_calls_of_at_most_call_bytes():
    relay = types.SimpleNamespace(config=PDConfig(transport="relay", store={"store": "memory"}, call_bytes=6))
    pages = [[(0, 3)], [(8, 2), (16, 1)], [(32, 3)], [(48, 10)], [(64, 1)]]
    runs = StoreRelay._calls(relay, pages)
    assert runs == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]  # a page larger than the limit goes alone
    assert [i for r in runs for i in range(len(pages))[r]] == list(range(len(pages)))
    assert StoreRelay._calls(relay, []) == []


def test_config_from_json_text_file_and_env_token(tmp_path, monkeypatch):
    path = tmp_path / "pd.json"
    path.write_text('{"transport": "relay", "store": {"store": "hf3fs", "file_path_prefix": "/x"}, "key_bytes": "1mb"}')
    cfg = load_pd_config(str(path))
    assert cfg.transport == "relay" and cfg.is_relay and cfg.key_bytes == 1 << 20
    monkeypatch.setenv("KVCONNECT_PD_TOKEN", "t0k")
    assert load_pd_config('{"transport": "direct"}').auth_token == "t0k"
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    assert load_pd_config({"auth_token_file": str(secret)}).auth_token == "from-file"  # the file wins over env
    assert token_matches("t0k", "t0k") and not token_matches("t0k", "nope") and not token_matches("t0k", None)
    assert token_matches(None, None)
    with pytest.raises(ConfigError, match="timeout_s"):
        load_pd_config('{"timeout_s": -1}')
    with pytest.raises(ConfigError, match="neither JSON nor a readable file"):
        load_pd_config("/no/such/file.json")


def test_the_relay_takes_any_shared_store_and_refuses_others_naming_the_capability():
    """No store is named in the PD backend: the relay asks for ``shared`` (and
    ``device_memory`` where the KV lives on a GPU) and the factory answers."""
    from kvconnect.connectors.base import MissingCapability
    from kvconnect.connectors.context import EngineContext
    from kvconnect.connectors.engines.pd_transport import create_relay_store

    layout = BufferLayout(kv_ptrs=(), kv_lens=(), kv_item_lens=(4096,), aux_ptrs=(), aux_lens=(), aux_item_lens=())
    with pytest.raises(MissingCapability) as e:
        StoreRelay(PDConfig(transport="relay", store={"store": "memory"}), layout)
    assert e.value.store == "memory" and e.value.capability == "shared"
    assert "prefill writes a room, decode (another process) reads it" in str(e.value)
    hf3fs = {"store": "hf3fs", "file_path_prefix": "/tmp/kvc-pd-cap/x", "file_size": "1mb", "numjobs": 1,
             "entries": 1}
    with pytest.raises(MissingCapability, match="metadata_server_url"):  # in-process index: not shared
        create_relay_store(PDConfig(transport="relay", store=hf3fs), EngineContext(page_bytes=4096))
    gpu = EngineContext(device="cuda:0", page_bytes=4096)
    with pytest.raises(MissingCapability) as e:  # file I/O cannot reach GPU memory
        create_relay_store(PDConfig(transport="relay", store={**hf3fs, "metadata_server_url": "127.0.0.1:1"}), gpu)
    assert e.value.capability == "device_memory" and "cuda:0" in str(e.value)


def test_the_engine_glue_names_no_store():
    """Which store an integration got is the factory's business: nothing under
    connectors/engines/ names one outside docstrings (only the registry does)."""
    import ast
    import pathlib

    import kvconnect.connectors.engines as engines
    from kvconnect.connectors.registry import available_stores

    names = set(available_stores()) | {"peer", "rdma_peer"}
    found = []
    for path in pathlib.Path(engines.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                hits = [n for n in names if n in node.value.lower().replace("-", "_").split(".")
                        or node.value == n or f"'{n}'" in node.value or f'"{n}"' in node.value
                        or f"{n}:" in node.value]
                if hits:
                    found.append(f"{path.name}:{node.lineno}: {node.value!r}")
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            comment = line.partition("#")[2].lower()
            if comment and any(n in comment.replace("-", "_").split() for n in names):
                found.append(f"{path.name}:{lineno}: # {comment.strip()}")
    assert not found, found
