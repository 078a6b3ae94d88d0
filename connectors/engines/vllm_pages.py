"""Page hashes, key spaces and page byte layouts of the vLLM connector, free of vLLM.

Kept apart from ``vllm_native`` so that the SGLang side of the cross-engine tests (its
own environment, no vLLM there) computes exactly the same keys and bytes.

Page hash
    One store page is one vLLM block (``block_size`` tokens) of one worker rank. Its hash
    is SGLang HiCache's: ``h_i = sha256(h_{i-1} || tokens as little-endian uint32)``
    (``h_{-1}`` absent), hex, seeded like SGLang's ``storage_namespace_seed(None,
    cache_salt)`` for a salted request. vLLM's own block hashes cannot serve: their seed
    (``NONE_HASH``) is random per process unless ``PYTHONHASHSEED`` is pinned, so two vLLM
    processes would never share a key.

Page layouts (the bytes of a page)
    * ``native``: each layer's block exactly as the attention backend stores it, layer
      after layer. No reordering; only engines with the same backend layout share pages
      (the backend's block shape is part of the key space).
    * ``layer_first``: ``[K/V][layer][token][kv head][head dim]``, SGLang's flat page of an
      MHA ``layer_first`` host pool.
    * ``page_first``: ``[K/V][token][layer][kv head][head dim]``, SGLang's ``page_first``.
    With ``layer_first`` / ``page_first`` the key space is SGLang's (``KeySpace.layout`` =
    the SGLang layout, geometry ``mha:L..:H..:D..:B<page bytes>``), so a page SGLang's
    HiCache adapter wrote is a page this connector reads, and the other way round, when
    model name, tenant, page size, dtype, KV heads per rank, head dim, layers and ranks
    agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from kvconnect.connectors.base import Capability, ConfigError
from kvconnect.connectors.config import parse_size
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import split_engine_options
from kvconnect.namespace import KeySpace, resolve_kv_dtype
from kvconnect.namespace.dtypes import dtype_name

PAGE_LAYOUTS = ("native", "layer_first", "page_first")
SGLANG_LAYOUTS = ("layer_first", "page_first")
WHERE = "kvconnect vllm connector"
ENGINE_KEYS = ("model_name", "page_layout", "staging_size")
DEFAULT_STAGING = 256 << 20


# ---------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMConnectorConfig:
    """``kv_connector_extra_config`` of ``KVConnectConnector``.

    Keys:
      * ``store`` (required): ``memory``, ``hf3fs``, ``mooncake``, ``peer_rdma`` or
        ``"pkg.mod:Class"``; the store's options inline or under ``store_options``;
      * ``tenant``: isolates these pages from other tenants sharing the store;
      * ``model_fingerprint``: weights revision, to tell fine-tunes served under one name apart;
      * ``metrics_port``: serve the store's Prometheus ``/metrics`` on this port, on
        ``metrics_host`` (default 127.0.0.1);
      * ``model_name`` (default: vLLM's served model name): the model in the key space;
        give the same name to every engine that should share pages;
      * ``page_layout`` (``native`` | ``layer_first`` | ``page_first``, default ``native``):
        the byte order of a page; ``layer_first`` / ``page_first`` are SGLang's;
      * ``staging_size`` (size, default ``256mb``): host buffer that pages pass through;
        larger loads and saves go in several batches.
    """

    options: dict[str, Any]
    model_name: str = ""
    page_layout: str = "native"
    staging_size: int = DEFAULT_STAGING
    tenant: str = ""
    model_fingerprint: str = ""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> "VLLMConnectorConfig":
        extra = dict(extra or {})
        eo = split_engine_options(extra, where=WHERE, engine_keys=ENGINE_KEYS)
        model = eo.extra.get("model_name", "")
        if model is None:
            model = ""
        if not isinstance(model, str):
            raise ConfigError("model_name", f"expected a string, got {model!r}", None, WHERE)
        layout = eo.extra.get("page_layout", "native")
        if layout not in PAGE_LAYOUTS:
            raise ConfigError("page_layout", f"invalid value {layout!r}", PAGE_LAYOUTS, WHERE)
        staging = parse_size(eo.extra.get("staging_size", DEFAULT_STAGING), "staging_size", WHERE)
        if staging <= 0:
            raise ConfigError("staging_size", "must be > 0", None, WHERE)
        return cls(options=extra, model_name=model, page_layout=layout, staging_size=staging,
                   tenant=eo.tenant, model_fingerprint=eo.model_fingerprint, metrics_port=eo.metrics_port,
                   metrics_host=eo.metrics_host)




# ---------------------------------------------------------------------------------
# Hashes
# ---------------------------------------------------------------------------------


def salt_seed(cache_salt: str | None, extra: Iterable[str] = ()) -> str | None:
    """The first prior hash of a request's chain (None: unsalted, SGLang's plain chain).

    ``cache_salt`` alone gives SGLang 0.5.23's ``storage_namespace_seed(None, cache_salt)``;
    ``extra`` (e.g. multimodal feature ids) is folded in after it, which no SGLang chain
    produces: such pages are vLLM-only.
    """
    extra = [e for e in extra if e]
    if cache_salt is None and not extra:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (None, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    if extra:
        digest.update(b"kvconnect-vllm-extra")
        for e in extra:
            encoded = e.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_hashes(token_ids: Sequence[int], block_size: int, n_blocks: int | None = None,
                seed: str | None = None) -> list[str]:
    """Hex hashes of the first ``n_blocks`` full blocks (default: all full blocks)."""
    import numpy as np

    full = len(token_ids) // block_size
    n = full if n_blocks is None else min(n_blocks, full)
    if n <= 0:
        return []
    arr = np.asarray(token_ids[: n * block_size], dtype="<u4")
    prior = bytes.fromhex(seed) if seed else None
    out = []
    for i in range(n):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(arr[i * block_size:(i + 1) * block_size].tobytes())
        prior = h.digest()
        out.append(prior.hex())
    return out


# ---------------------------------------------------------------------------------
# Geometry and key spaces
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageGeometry:
    """What a page of one worker rank holds."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the logical KV dtype (``vllm_kv_dtype``), torch's name without "torch."
    itemsize: int
    layout: str = "native"
    backend_block: str = ""  # native layout: the backend's per-layer block shape
    kv_scales: str = ""  # quantization scales stored in the blocks, by format ("" for none)

    @property
    def page_elems(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim

    @property
    def page_nbytes(self) -> int:
        return self.page_elems * self.itemsize

    def geometry_tag(self) -> str:
        tag = f"mha:L{self.layers}:H{self.kv_heads}:D{self.head_dim}"
        if self.layout == "native":
            tag += f":vllm[{self.backend_block}]"
        return tag + f":B{self.page_nbytes}"

    def keyspace(self, *, model: str, weights: str = "", tenant: str = "", tp_rank: int = 0,
                 tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> KeySpace:
        """The key space of this rank's pages: SGLang's for ``layer_first`` / ``page_first``."""
        layout = self.layout if self.layout in SGLANG_LAYOUTS else "vllm-native"
        return KeySpace(model=model, weights=weights, tenant=tenant, layout=layout,
                        page_size=self.block_size, dtype=self.dtype, kv_scales=self.kv_scales,
                        geometry=self.geometry_tag(),
                        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)


def vllm_kv_dtype(stored: Any, cache_dtype: Any) -> tuple[str, str]:
    """``(dtype, kv_scales)`` of a vLLM KV cache: its spec's dtype (``uint8`` for every fp8
    variant) named by ``--kv-cache-dtype`` (``cache_config.cache_dtype``). vLLM names no other
    engine knows (``fp8_inc``, ``fp8_ds_mla``, ...) stay key spaces of their own."""
    try:
        return resolve_kv_dtype(stored, cache_dtype, key="cache_dtype", where=WHERE)
    except ConfigError:
        return f"{dtype_name(stored)}:{dtype_name(cache_dtype)}", ""


def lora_weights(weights: str, lora_name: str | None) -> str:
    """The ``KeySpace.weights`` of a request: the model fingerprint plus its LoRA adapter."""
    if not lora_name:
        return weights
    return f"{weights}+lora:{lora_name}"


def engine_context(model: str, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1) -> EngineContext:
    """The ``EngineContext`` of one vLLM process: a worker's TP and PP ranks, or rank 0 for
    the scheduler, which looks up the pages of every rank (``cross_rank_lookups``)."""
    return EngineContext(engine="vllm", model=model, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                         pp_size=pp_size, cross_rank_lookups=True)


def store_requirements(context: EngineContext) -> dict[Capability, str]:
    """The capabilities the connector needs of its store (for the factory's ``require=``):
    ``shared`` with more than one worker rank, whose pages the scheduler looks up from its
    own process."""
    ranks = context.tp_size * context.pp_size
    if ranks == 1:
        return {}
    return {Capability.SHARED: f"vLLM with {ranks} worker ranks (TP {context.tp_size} x PP {context.pp_size}) "
                               "needs: each rank writes its pages and the scheduler, another process, "
                               "looks all of them up"}


def rank_keyspaces(base: KeySpace, tp_size: int, pp_size: int,
                   layers_per_pp: Sequence[int], geometry: PageGeometry) -> list[KeySpace]:
    """The key spaces of every (pp, tp) rank of one deployment (for scheduler-side lookups)."""
    out = []
    for pp in range(pp_size):
        g = replace(geometry, layers=layers_per_pp[pp])
        for tp in range(tp_size):
            out.append(replace(base, tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size,
                               geometry=g.geometry_tag()))
    return out


# ---------------------------------------------------------------------------------
# Moving blocks between vLLM's per-layer KV tensors and flat pages
# ---------------------------------------------------------------------------------


class BlockCodec:
    """Gathers blocks of vLLM's per-layer KV tensors into flat pages and scatters them back.

    Known backend shapes (per layer; ``NB`` blocks, ``H`` KV heads, ``N`` tokens, ``D`` head
    dim), recognised from the tensor shape:

    * ``cpu``: ``[NB, H, N, 2*D]`` where each ``(block, head)`` holds N rows of K then N rows
      of V (vLLM's CPU attention backend);
    * ``kv_first``: ``[2, NB, N, H, D]`` (FlashAttention-style caches).

    Any other shape whose leading (or, after a leading 2, second) axis is the block axis is
    moved with the ``native`` layout only: the block's bytes as they are.
    """

    def __init__(self, layers: Sequence[Any], num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, layout: str):
        import torch

        if layout not in PAGE_LAYOUTS:
            raise ValueError(f"unknown page layout {layout!r}")
        if not layers:
            raise ValueError("no KV cache layers")
        self.layers = list(layers)
        t0 = self.layers[0]
        for t in self.layers:
            if tuple(t.shape) != tuple(t0.shape) or t.dtype != t0.dtype:
                raise ValueError("KV cache layers differ in shape or dtype")
        self.dtype = t0.dtype
        self.num_blocks, self.N, self.H, self.D = num_blocks, block_size, kv_heads, head_dim
        shape = tuple(t0.shape)
        self.kind = "native"
        if shape == (num_blocks, kv_heads, block_size, 2 * head_dim) and t0.device.type == "cpu":
            self.kind = "cpu"
        elif shape == (2, num_blocks, block_size, kv_heads, head_dim):
            self.kind = "kv_first"
        if shape[0] == num_blocks:
            self.block_dim = 0
        elif len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
            self.block_dim = 1
        else:
            raise ValueError(f"cannot find the block axis of KV cache shape {shape} ({num_blocks} blocks)")
        if layout != "native" and self.kind == "native":
            raise ValueError(f"page layout {layout!r} needs a KV cache shape kvconnect can split into K "
                             f"and V ([NB,H,N,2D] on CPU or [2,NB,N,H,D]); this backend's is {shape}")
        self.layout = layout
        per_block = list(shape)
        del per_block[self.block_dim]
        self.backend_block = "x".join(str(s) for s in per_block) + ("" if self.block_dim == 0 else "@1")
        elems = 1
        for s in per_block:
            elems *= s
        if elems != 2 * block_size * kv_heads * head_dim:
            raise ValueError(f"a block of KV cache shape {shape} holds {elems} elements, not "
                             f"2 x {block_size} tokens x {kv_heads} heads x {head_dim}")
        self.page_elems = len(self.layers) * elems
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.page_nbytes = self.page_elems * self.itemsize

    def _kv_view(self, t: Any) -> Any:
        """Per-layer view with K/V, block, token, head, dim axes named: ``(NB, 2, N, H, D)``."""
        if self.kind == "cpu":
            return t.view(self.num_blocks, self.H, 2, self.N, self.D).permute(0, 2, 3, 1, 4)
        return t.permute(1, 0, 2, 3, 4)  # kv_first

    def _page_views(self, pages: Any) -> list[Any]:
        """For each layer, the part of ``pages`` (``[n, page_elems]``) that holds it, shaped
        like ``_kv_view(t)[idx]`` (layouts with K/V) or ``t[idx]`` (native)."""
        n, L = pages.shape[0], len(self.layers)
        if self.layout == "native":
            v = pages.view(n, L, -1)
            return [v[:, i] for i in range(L)]
        if self.layout == "layer_first":
            v = pages.view(n, 2, L, self.N, self.H, self.D)
            return [v[:, :, i] for i in range(L)]
        v = pages.view(n, 2, self.N, L, self.H, self.D)  # page_first
        return [v[:, :, :, i] for i in range(L)]

    def gather(self, block_ids: Any, out: Any) -> None:
        """Copy blocks ``block_ids`` (int64 tensor) into ``out`` (``[n, page_elems]``)."""
        for t, dst in zip(self.layers, self._page_views(out)):
            if self.layout == "native":
                src = t.index_select(self.block_dim, block_ids)
                if self.block_dim:
                    src = src.movedim(self.block_dim, 0)
                dst.copy_(src.reshape(dst.shape))
            else:
                dst.copy_(self._kv_view(t)[block_ids])

    def scatter(self, block_ids: Any, src: Any) -> None:
        """Copy pages ``src`` (``[n, page_elems]``) into blocks ``block_ids``."""
        for t, part in zip(self.layers, self._page_views(src)):
            if self.layout == "native":
                if self.block_dim == 0:
                    t[block_ids] = part.reshape((-1,) + tuple(t.shape[1:]))
                else:
                    shape = (-1,) + tuple(t.shape[:1]) + tuple(t.shape[2:])
                    t.index_copy_(1, block_ids, part.reshape(shape).movedim(0, 1))
            else:
                view = self._kv_view(t)
                view[block_ids] = part
