"""SGLang kits: real host KV pools on CPU, page contents, storage configs.

The pools are SGLang's own classes (``kvconnect.connectors.engines.sglang_host_pools``);
``fill_pages`` / ``page_bytes`` / ``zero_pages`` move recognisable bytes through their
flat pages, so a test compares exactly what a GPU server would hold.

Pools with no flat page format, only ``get_page_buffer_meta`` (and ``get_ksize_per_token``),
which is all SGLang's own ``MooncakeStore`` asks of a pool: ``MinimalHostPool`` (the mock
pool of SGLang 0.5.23's ``mooncake_store/test_mooncake_store.py``) and ``SegmentsOnlyPool``
(a real pool seen through those two methods only); ``segment_bytes`` reads a page of either
through its segments.
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


def storage_page_keys(tokens, page_size: int, *, extra_key: str | None = None, cache_salt: str | None = None,
                      last_hash: str | None = None) -> list[str]:
    """SGLang's own L3 page keys of a request's tokens: ``get_storage_hash_str`` over a
    ``RadixKey`` carrying ``extra_key`` / ``cache_salt`` (the chain is seeded by
    ``storage_namespace_seed`` unless it continues from ``last_hash``), one key per full page."""
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    key = RadixKey(array("l", list(tokens)), extra_key=extra_key, cache_salt=cache_salt)
    return list(get_storage_hash_str(key, last_hash, page_size=page_size))


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


class MinimalHostPool:
    """The host pool of SGLang 0.5.23's ``mooncake_store/test_mooncake_store.py``
    (``create_mock_host_kv_cache``): ``kv_buffer`` (a 1-D tensor), ``layout`` "page_first",
    ``page_size`` 1, and only ``get_page_buffer_meta`` / ``get_ksize_per_token``. Page ``p``
    is ``entries_per_page`` segments of ``page_elements`` elements each, the first at element
    ``p * entries_per_page * page_elements``; no flat page format."""

    def __init__(self, buffer: Any, entries_per_page: int = 2, page_elements: int = 1):
        self.kv_buffer = buffer
        self.layout = "page_first"
        self.page_size = 1
        self.entries_per_page = entries_per_page
        self.page_elements = page_elements

    def get_page_buffer_meta(self, indices):
        ptr_list, element_size_list = [], []
        for idx in indices:
            page_offset = int(idx) * self.entries_per_page * self.page_elements
            for entry_idx in range(self.entries_per_page):
                offset = page_offset + entry_idx * self.page_elements
                ptr_list.append(self.kv_buffer[offset:].data_ptr())
                element_size_list.append(self.page_elements * self.kv_buffer.element_size())
        return ptr_list, element_size_list

    def get_ksize_per_token(self):
        return self.entries_per_page * self.page_elements * self.kv_buffer.element_size()


class SegmentsOnlyPool:
    """A real SGLang host pool seen only through ``get_page_buffer_meta`` and
    ``get_ksize_per_token`` (plus ``kv_buffer``, ``layout``, ``page_size``, ``size`` and
    ``alloc``): a pool class the adapter does not know, without SGLang's flat pages."""

    def __init__(self, pool: Any):
        self._pool = pool
        self.kv_buffer = pool.kv_buffer
        self.layout = pool.layout
        self.page_size = pool.page_size
        self.size = pool.size

    def get_page_buffer_meta(self, indices):
        return self._pool.get_page_buffer_meta(indices)

    def get_ksize_per_token(self):
        return self._pool.get_ksize_per_token()

    def alloc(self, need_size: int):
        return self._pool.alloc(need_size)


def segment_bytes(pool: Any, index: int) -> bytes:
    """The bytes of the page that starts at token slot ``index``, read through
    ``get_page_buffer_meta`` (its segments in their order)."""
    import ctypes

    import torch

    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(int(index), int(index) + pool.page_size))
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(ptrs, sizes))
