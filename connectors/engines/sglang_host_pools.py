"""Small *real* SGLang host KV pools in CPU memory: the engine the demo runs, and the pools
``kvconnect.connectors.testing.sglang`` hands to tests, examples and benchmarks.

``make_cpu_host_pool`` builds a real SGLang device pool on ``device="cpu"`` (a tiny one:
the host pool only reads its geometry) and the real host pool SGLang's HiCache uses
(``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``) on top of it, exactly as
``HybridCacheController`` does on a GPU, minus pinned memory (``pin_memory=True`` needs
CUDA). The pool's ``kv_buffer``, ``get_page_buffer_meta`` and flat-page methods are the
real ones, so bytes moved through them are laid out as on a GPU server.

Needs sglang (0.5.23; 0.5.17 works too); imported lazily, so importing this
module never imports sglang or torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

SUPPORTED_LAYOUTS_MHA = ("layer_first", "page_first", "page_first_direct", "page_head")
SUPPORTED_LAYOUTS_MLA = ("layer_first", "page_first", "page_first_direct")


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r}")
    return value


def budget_scope(nbytes: int):
    """Book the pool against a fixed budget instead of psutil minus a 10 GiB reserve.

    SGLang sizes host pools against free RAM minus 10 GiB; on a small shared test machine
    that check can fail for a pool of a few KiB. The scope exists in sglang 0.5.23.
    """
    try:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    except ImportError:  # older sglang: no budget scope, use the psutil check
        return contextlib.nullcontext()
    return host_memory_budget_scope(max(nbytes * 4, 64 << 20))


def _takes_device_pool(host_cls) -> bool:
    """sglang <= 0.5.17 builds host pools from the device pool, 0.5.23 from its buffer info."""
    import inspect

    params = list(inspect.signature(host_cls.__init__).parameters)
    return len(params) > 1 and params[1] == "device_pool"


def make_cpu_host_pool(layout: str = "page_first", page_size: int = 4, layer_num: int = 3,
                       head_num: int = 2, head_dim: int = 8, dtype: Any = "bfloat16",
                       mla: bool = False, host_tokens: int | None = None,
                       rope_dim: int | None = None):
    """A real SGLang host KV pool in CPU memory.

    Args:
        layout: host layout (``layer_first``, ``page_first``, ``page_first_direct``,
            ``page_head``; MLA: all but ``page_head``).
        page_size: tokens per page.
        layer_num, head_num, head_dim: MHA geometry (K and V each ``head_num*head_dim``).
        dtype: torch dtype or its name (``"bfloat16"``, ``"float16"``, ``"float32"``...).
        mla: build an ``MLATokenToKVPoolHost`` instead: one latent row per token of
            ``kv_lora_rank=head_dim`` plus ``qk_rope_head_dim=rope_dim`` (default
            ``head_dim // 2``) elements; ``head_num`` is ignored (MLA has one KV head).
        host_tokens: host capacity in tokens (rounded up to whole pages). Default: the
            SGLang rule ``2 x device pool + one padding page`` over a 64-token device pool
            (132 tokens for page_size 4). sglang <= 0.5.17 has no such knob: ignored there.
    Returns:
        The host pool. Allocate page-aligned token slots with ``pool.alloc(n * page_size)``.
    """
    import torch

    td = _torch_dtype(dtype)
    if page_size < 1 or layer_num < 1 or head_num < 1 or head_dim < 1:
        raise ValueError("page_size, layer_num, head_num and head_dim must be >= 1")
    supported = SUPPORTED_LAYOUTS_MLA if mla else SUPPORTED_LAYOUTS_MHA
    if layout not in supported:
        raise ValueError(f"layout {layout!r} not supported for {'MLA' if mla else 'MHA'} "
                         f"(supported: {', '.join(supported)})")
    capacity = None
    if host_tokens is not None:
        capacity = -(-int(host_tokens) // page_size) * page_size
        if capacity <= 0:
            raise ValueError("host_tokens must be > 0")
    device_tokens = 64 if page_size <= 16 else 4 * page_size

    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        rope = head_dim // 2 if rope_dim is None else rope_dim
        dev = MLATokenToKVPool(device_tokens, page_size, td, head_dim, rope, layer_num, "cpu", False,
                               start_layer=0, end_layer=layer_num)
        per_token = (head_dim + rope) * layer_num * td.itemsize
        host_cls = MLATokenToKVPoolHost
        new_kwargs = dict(device_capacity_tokens=dev.size, start_layer=0, end_layer=layer_num,
                          target_layer_num=layer_num, host_token_capacity=capacity)
    else:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        dev = MHATokenToKVPool(device_tokens, page_size, td, head_num, head_dim, layer_num, "cpu", False,
                               start_layer=0, end_layer=layer_num, enable_alt_stream=False)
        per_token = 2 * head_num * head_dim * layer_num * td.itemsize
        cap = dev.size if getattr(dev, "host_capacity_tokens", None) is None else dev.host_capacity_tokens
        host_cls = MHATokenToKVPoolHost
        new_kwargs = dict(device_capacity_tokens=cap, start_layer=dev.start_layer, end_layer=dev.end_layer,
                          write_back_staging=getattr(dev, "hicache_write_back_staging", None),
                          host_token_capacity=capacity)
    tokens = capacity or 2 * device_tokens + page_size
    with budget_scope(per_token * tokens):
        if _takes_device_pool(host_cls):  # sglang <= 0.5.17
            host = host_cls(dev, 2.0, 0, page_size, layout, pin_memory=False, device="cpu")
        else:
            host = host_cls(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                            pin_memory=False, device="cpu", **new_kwargs)
    # The device pool is only a geometry source; the host pool keeps no reference to
    # its buffers' data once built on CPU, but keep it alive with the host pool anyway.
    host._kvconnect_device_pool = dev
    del torch
    return host
