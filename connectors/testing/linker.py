"""SGLang's unified-cache linker path on CPU: a real ``UnifiedRadixCache`` over real device
pools (``MHATokenToKVPool`` / ``MLATokenToKVPool`` / ``SWAKVPool`` with ``device="cpu"``), the
linker built by SGLang's own ``create_unified_cache_linker`` (backend ``dynamic``), and a
stand-in forward.

``LinkedServer.prefill`` does what SGLang's scheduler does for one request: ``match_prefix``
(the linker's lookup), ``init_load_back`` + ``ready_to_load_host_cache`` (the load, waited on
layer by layer through the pools' layer counter, as the forward does) and
``finish_external_linker_loads``; then it "computes" the pages nothing had, inserts the
request (the write-through chain offloads it) and polls ``check_hicache_events`` until the
offload is committed. Computed KV is a function of the page's SGLang storage hash
(``hash_model``'s rule: the same prefix gives the same bytes on every server), so a page
loaded from the store can be compared with what a server computes for it.

Not real, and why: the model's forward (no GPU; its KV is bytes drawn from the page hash).
"""

from __future__ import annotations

import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

LINKER_CONFIG = {"linker": "KVConnectLinker", "linker_module_path": "kvconnect.connectors.engines.sglang_linker"}
"""The keys of ``--unified-cache-external-linker-config`` that load kvconnect's linker."""

MODEL = "tiny/linker-model"

_published = False


def publish_runtime(page_size: int = 4) -> Any:
    """SGLang's runtime context of one scheduler rank with the linker flags set (once per
    process; later calls return the same server args)."""
    global _published
    from sglang.srt import runtime_context as rc

    if not _published:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sglang.srt.server_args import ServerArgs

        rc.publish(ServerArgs(model_path="dummy", served_model_name=MODEL, device="cpu", page_size=page_size,
                              enable_unified_cache_external_linker=True,
                              unified_cache_external_linker_backend="dynamic",
                              unified_cache_external_linker_config=dict(LINKER_CONFIG)),
                   role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
        rc.get_parallel().override_permanently(pp_group=None)
        _published = True
    return rc.get_server_args()


def page_content(page_hash: str, nbytes: int) -> bytes:
    """The KV bytes a server computes for the page with this storage hash."""
    import hashlib

    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(f"{page_hash}:{counter}".encode(), digest_size=64).digest()
        counter += 1
    return bytes(out[:nbytes])


@dataclass
class PrefillResult:
    device_hit_tokens: int
    loaded_tokens: int
    computed_pages: int
    load_failed: bool
    slots: Any  # the request's device token slots, prompt order
    page_hashes: list = field(default_factory=list)


class LinkedServer:
    """One SGLang scheduler's cache on CPU with kvconnect's linker attached (see module
    docstring). ``kind``: ``"mha"``, ``"mla"`` or ``"swa"`` (FULL + SWA layers); ``tp_group``:
    the torch.distributed group of this server's TP ranks (None: one rank)."""

    def __init__(self, extra_config: dict, *, kind: str = "mha", page_size: int = 4, layers: int = 3,
                 heads: int = 2, head_dim: int = 8, tokens: int = 512, swa_layers: tuple = (1,),
                 sliding_window: int = 8, dtype: Any = None, tp_group: Any = None):
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.server_args = publish_runtime(page_size)
        self.page_size = page_size
        self.kind = kind
        dtype = dtype or torch.bfloat16
        components = (ComponentType.FULL,)
        extra_params: dict = {}
        if kind == "mla":
            self.kvcache = MLATokenToKVPool(tokens, page_size, dtype, head_dim, head_dim // 2, layers, "cpu", False,
                                            start_layer=0, end_layer=layers)
            allocator = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", self.kvcache, False)
        elif kind == "mha":
            self.kvcache = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False,
                                            start_layer=0, end_layer=layers, enable_alt_stream=False)
            allocator = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", self.kvcache, False)
        elif kind == "swa":
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            full = [i for i in range(layers) if i not in swa_layers]
            self.kvcache = SWAKVPool(tokens, tokens, page_size, dtype, heads, head_dim, list(swa_layers), full, "cpu",
                                     enable_alt_stream=False)
            allocator = SWATokenToKVPoolAllocator(tokens, tokens, page_size, dtype, "cpu", self.kvcache, False)
            components = (ComponentType.FULL, ComponentType.SWA)
            extra_params = {"sliding_window_size": sliding_window}
        else:
            raise ValueError(f"kind {kind!r}: expected 'mha', 'mla' or 'swa'")
        self.allocator = allocator
        self.params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(16, 4096, "cpu", False),
                                      token_to_kv_pool_allocator=allocator, page_size=page_size,
                                      tree_components=components, tp_cache_group=tp_group,
                                      attn_tp_cache_group=tp_group, **extra_params)
        self.cache = UnifiedRadixCache(self.params)
        self.linker = create_unified_cache_linker(
            self.server_args, self.params, backend="dynamic",
            config={**LINKER_CONFIG, "linker_extra_config": dict(extra_config)},
            components=set(self.cache.components))
        self.cache.init_cache_linker(self.linker)
        self.kvcache.register_layer_transfer_counter(self.linker.layer_done_counter)
        self._rids = 0
        self._page_slots: dict = {}  # page hash -> its device slots, once inserted

    # -- the KV bytes of token slots ---------------------------------------------------------
    def _kv_buffers(self) -> list:
        """The full-attention device buffers, in the order a linker page holds them."""
        pool = getattr(self.kvcache, "full_kv_pool", self.kvcache)
        if hasattr(pool, "k_buffer"):
            return [*pool.k_buffer, *pool.v_buffer]
        return list(pool.kv_buffer)

    def page_nbytes(self) -> int:
        return sum(b[0].numel() * b.element_size() * self.page_size for b in self._kv_buffers())

    def page_bytes(self, slots: Any, page: int) -> bytes:
        import torch

        rows = slots[page * self.page_size:(page + 1) * self.page_size]
        return b"".join(b[rows].contiguous().view(torch.uint8).numpy().tobytes() for b in self._kv_buffers())

    def write_page(self, slots: Any, page: int, data: bytes) -> None:
        import torch

        rows = slots[page * self.page_size:(page + 1) * self.page_size]
        pos = 0
        for b in self._kv_buffers():
            part = b[rows]
            n = part.numel() * part.element_size()
            src = torch.frombuffer(bytearray(data[pos:pos + n]), dtype=torch.uint8).view(b.dtype).view(part.shape)
            b[rows] = src
            pos += n

    # -- one request --------------------------------------------------------------------------
    def prefill(self, tokens: list, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None,
                offload: bool = True, timeout_s: float = 30.0) -> PrefillResult:
        """One request's prefill (see module docstring); its full pages' KV bytes are
        ``page_content`` of their storage hashes. Waits for the write-through offload."""
        import torch
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        from kvconnect.connectors.testing.sglang import storage_page_keys

        self._rids += 1
        req = Req(f"req-{self._rids}", "", list(tokens), SamplingParams())
        key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
        full = len(tokens) // self.page_size * self.page_size
        hashes = storage_page_keys(tokens[:full], self.page_size, extra_key=extra_key, cache_salt=cache_salt)
        res = self.cache.match_prefix(MatchPrefixParams(key=key, req=req))
        device_hit = res.device_prefix_len
        # The tree's own pages of the device hit: where this server inserted them.
        prefix = torch.cat([self._page_slots[h] for h in hashes[:device_hit // self.page_size]] or
                           [torch.empty(0, dtype=torch.int64)])
        loaded, failed = 0, False
        if res.host_hit_length:
            req.last_node = res.last_device_node
            loaded, _ = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=res.last_host_node, host_hit_length=res.host_hit_length, req=req))
            tail = self.cache.linker.private_load_indices.get(req.rid)
            index = self.cache.ready_to_load_host_cache()
            counter = self.linker.layer_done_counter
            counter.set_consumer(index)
            for layer in range(self.linker.num_layers):
                counter.wait_until(layer)  # as the forward's attention layers do
            failed = bool(self.cache.finish_external_linker_loads([req]))
            if tail is not None:
                prefix = torch.cat([prefix, tail.to(torch.int64)])
        rest = len(tokens) - len(prefix)
        new = self.allocator.alloc(-(-rest // self.page_size) * self.page_size)[:rest] if rest else prefix[:0]
        slots = torch.cat([prefix, new.to(torch.int64)])
        first_new = len(prefix) // self.page_size
        nbytes = self.page_nbytes()
        for page in range(first_new, len(hashes)):
            self.write_page(slots, page, page_content(hashes[page], nbytes))
        computed = len(hashes) - first_new
        if not failed and offload:
            self.cache.insert(InsertParams(key=RadixKey(array("q", tokens[:full]), extra_key=extra_key,
                                                        cache_salt=cache_salt), value=slots[:full].clone()))
            self.drain(timeout_s)
            for page, h in enumerate(hashes):
                self._page_slots.setdefault(h, slots[page * self.page_size:(page + 1) * self.page_size].clone())
        return PrefillResult(device_hit, loaded, computed, failed, slots, hashes)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Poll SGLang's scheduler hook until every offload in flight is committed."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.cache.check_hicache_events()
            if not self.cache.linker.pending_offloads:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.cache.linker.pending_offloads)} offload(s) still pending")
            time.sleep(0.005)

    def close(self) -> None:
        self.cache.linker.close()


# ---------------------------------------------------------------------------------
# One TP rank of a server as a process
# ---------------------------------------------------------------------------------


def run_rank(rank: int, world: int, init_port: int, extra: dict, tokens: list, kind: str = "mla") -> dict:
    """TP rank ``rank`` of ``world`` (gloo on 127.0.0.1:``init_port``): prefill ``tokens``
    (offloaded), empty the device tree (SGLang's ``cache.reset()``), prefill them again (loaded
    from the store). Every rank runs the same steps, as SGLang's TP ranks do, since the
    tree reduces its lookups and offload commits across them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{init_port}", rank=rank, world_size=world)
    try:
        server = LinkedServer(extra, kind=kind, tp_group=dist.group.WORLD)
        first = server.prefill(tokens)
        server.cache.reset()
        second = server.prefill(tokens, offload=False)
        nbytes = server.page_nbytes()
        same = [server.page_bytes(second.slots, p) == page_content(h, nbytes) for p, h in enumerate(second.page_hashes)]
        pool = server.linker.linked["kv"]
        out = {"rank": rank, "is_writer": pool.is_writer, "rank_in_key": pool.store.keyspace.identity()["tp_rank"],
               "first": [first.loaded_tokens, first.computed_pages], "failed": second.load_failed,
               "second": [second.loaded_tokens, second.computed_pages], "bytes_same": same,
               "put_pages": server.linker.store.stats().put_pages, "counts": server.linker.counts.as_dict()}
        server.close()
        return out
    finally:
        dist.destroy_process_group()


def main(argv: list | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m kvconnect.connectors.testing.linker",
                                 description="One TP rank of a CPU SGLang server with kvconnect's linker (tests)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init-port", type=int, required=True, help="gloo rendezvous port on 127.0.0.1")
    ap.add_argument("--extra", required=True, help="linker_extra_config (JSON)")
    ap.add_argument("--tokens", required=True, help="the prompt's token ids (JSON list)")
    ap.add_argument("--kind", default="mla", choices=("mha", "mla"))
    args = ap.parse_args(argv)
    print(json.dumps(run_rank(args.rank, args.world, args.init_port, json.loads(args.extra), json.loads(args.tokens),
                              args.kind)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
