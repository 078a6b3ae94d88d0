"""SGLang kits: real host KV pools on CPU, page contents, storage configs.

The pools are SGLang's own classes (``kvconnect.connectors.engines.sglang_host_pools``);
``fill_pages`` / ``page_bytes`` / ``zero_pages`` move recognisable bytes through their
flat pages, so a test compares exactly what a GPU server would hold.
"""

from __future__ import annotations

from typing import Any

from kvconnect.connectors.engines.sglang_host_pools import (  # noqa: F401
    SUPPORTED_LAYOUTS_MHA,
    SUPPORTED_LAYOUTS_MLA,
    make_cpu_host_pool,
)

HICACHE_EXTRA_CONFIG = {"backend_name": "kvconnect", "module_path": "kvconnect.connectors.engines.sglang_hicache",
                        "class_name": "KVConnectStorage", "interface_v1": 1}
"""The keys of ``--hicache-storage-backend-extra-config`` that load kvconnect's backend."""


def storage_config(*, extra_config: dict[str, Any] | None = None, model_name: str = "tiny/model",
                   layout: str = "page_first", **fields: Any):
    """A ``HiCacheStorageConfig`` of one rank (every rank and size field defaults to 0 / 1,
    MLA off) with kvconnect's backend keys plus ``extra_config`` as its extra config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=False, enable_storage_metrics=False,
                  is_page_first_layout=layout == "page_first", model_name=model_name,
                  extra_config={**HICACHE_EXTRA_CONFIG, **(extra_config or {})})
    values.update(fields)
    return HiCacheStorageConfig(**values)


def fill_pages(host, host_indices, seed: int = 0) -> None:
    """Fill every page starting at ``host_indices[i * page_size]`` with distinct bytes.

    Page ``i`` gets pseudo-random bytes from ``(seed, i)``, so two pages (and two seeds)
    never hold the same bytes.
    """
    import torch

    ps = host.page_size
    n_pages = len(host_indices) // ps
    template = host.get_dummy_flat_data_page()
    nbytes = template.numel() * template.element_size()
    for i in range(n_pages):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        host.set_from_flat_data_page(int(host_indices[i * ps]), raw.view(template.dtype))


def page_bytes(host, index: int) -> bytes:
    """The flat bytes of the page that starts at token slot ``index``."""
    import torch

    page = host.get_data_page(int(index), flat=True)
    return page.contiguous().view(torch.uint8).numpy().tobytes()


def zero_pages(host, host_indices) -> None:
    """Zero the pages starting at ``host_indices[i * page_size]``."""
    ps = host.page_size
    zero = host.get_dummy_flat_data_page()
    for i in range(len(host_indices) // ps):
        host.set_from_flat_data_page(int(host_indices[i * ps]), zero)


def make_cpu_mamba_pool(slots: int = 32, layers: int = 2, state_shape: tuple[int, ...] = (4, 8),
                        conv_shape: tuple[int, ...] = (6, 3), layout: str = "page_first"):
    """A real SGLang ``MambaPoolHost`` in CPU memory: one page per request state slot,
    ``layers`` layers of a float32 temporal state and a bfloat16 conv state. Built from
    CPU stand-ins of the device state buffers (the host pool only reads their geometry)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    from kvconnect.connectors.engines.sglang_host_pools import budget_scope

    device_slots = max(1, slots // 2)
    info = MambaStateBufferInfo(temporal=torch.zeros(layers, device_slots + 1, *state_shape, dtype=torch.float32),
                                conv=(torch.zeros(layers, device_slots + 1, *conv_shape, dtype=torch.bfloat16),))
    per_slot = layers * (4 * _prod(state_shape) + 2 * _prod(conv_shape))
    with budget_scope(per_slot * (slots + 2)):
        return MambaPoolHost(info, 2.0, 0, device_capacity=device_slots, pin_memory=False, device="cpu",
                             layout=layout)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
