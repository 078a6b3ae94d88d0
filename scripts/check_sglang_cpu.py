"""Smoke check of the CPU SGLang install: builds real MHATokenToKVPoolHost objects.

    LMCACHE_TRACK_USAGE=false .venv/bin/python scripts/check_sglang_cpu.py [layout ...]

Page size 4, 2 heads, head dim 8, 3 layers, bf16, a 64-token device pool, host ratio 2
(132 host tokens, a few KiB). Prints kv_buffer's shape per layout, round-trips one page
through get_data_page/set_from_flat_data_page, and imports StorageBackendFactory.
"""
import sys
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE, HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 3
EXPECTED = {
    "layer_first": (2, 3, 132, 2, 8),
    "page_first": (2, 132, 3, 2, 8),
    "page_first_direct": (2, 33, 3, 4, 2, 8),
    "page_head": (2, 33, 2, 4, 3, 8),
}


def build(layout: str) -> MHATokenToKVPoolHost:
    dev = MHATokenToKVPool(64, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                           start_layer=0, end_layer=LAYERS, enable_alt_stream=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    cap = dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=cap, start_layer=dev.start_layer,
                                end_layer=dev.end_layer,
                                write_back_staging=dev.hicache_write_back_staging)


def main(layouts: list[str]) -> int:
    ok = True
    for layout in layouts:
        host = build(layout)
        shape = tuple(host.kv_buffer.shape)
        idx = host.alloc(2 * PAGE)
        page0 = int(idx[0])
        flat = torch.full_like(host.get_dummy_flat_data_page(), 7)
        host.set_from_flat_data_page(page0, flat)
        back = host.get_data_page(page0, flat=True)
        rt = bool(torch.equal(back.flatten().to(flat.dtype), flat.flatten()))
        good = shape == EXPECTED[layout] and rt
        ok &= good
        print(f"{layout:18s} kv_buffer {shape} dtype={host.kv_buffer.dtype} "
              f"size={host.size} tokens page_roundtrip={rt} {'OK' if good else 'MISMATCH'}")
    print(f"StorageBackendFactory: {StorageBackendFactory.__module__}.{StorageBackendFactory.__name__}")
    print(f"torch {torch.__version__}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["page_first"]))
