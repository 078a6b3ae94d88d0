"""Any kvconnect ``PageStore`` as a vLLM KV connector (``KVConnectorBase_V1``), out of tree.

Load it into vLLM (0.32 / 0.33) with::

    vllm serve MODEL --disable-hybrid-kv-cache-manager --kv-transfer-config '{
      "kv_connector": "KVConnectConnector",
      "kv_connector_module_path": "kvconnect.connectors.engines.vllm_native",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"store": "hf3fs", "file_path_prefix": "/mnt/3fs/kvc/vllm",
                                    "file_size": "1tb", "numjobs": 16, "entries": 16,
                                    "metadata_server_url": "http://127.0.0.1:18000"}}'

``kv_connector_extra_config`` holds ``store`` (a registry name, or ``"pkg.mod:Class"``),
the store's options inline (or under ``store_options``), the common adapter keys
(``tenant``, ``model_fingerprint``, ``metrics_port``) and this connector's keys
(``model_name``, ``page_layout``, ``staging_size``): see ``VLLMConnectorConfig``.

How vLLM's contract maps onto the store (one store page = one vLLM block of one rank):

* Scheduler side: ``get_num_new_matched_tokens`` hashes the prompt's full blocks (SGLang's
  page hash, ``vllm_pages.page_hashes``), asks the store once, in one batched ``exists``
  over the keys of every (tp, pp) rank, and answers the blocks every rank holds, from the
  first block vLLM does not already hold, as a leading run (``namespace.leading_hits``).
  Loads are synchronous (``load_kv_async`` False): they finish in ``start_load_kv`` of the
  step that uses them.
* Worker side: ``start_load_kv`` reads the step's blocks with batched ``get_into`` into one
  staging buffer and copies them into vLLM's paged KV tensors; ``wait_for_save`` copies the
  blocks a step completed (prompt blocks only) into the staging buffer and writes them with
  batched ``put_from``. The staging buffer is registered with stores that need registered
  memory (Mooncake, peer pool) once, at start.
* Failures: a store call that raises is a miss (scheduler) or a failed page (worker). A
  page that was announced and then fails to load is a load error
  (``get_block_ids_with_load_errors``), which vLLM recomputes: the connector refuses to
  start unless ``kv_load_failure_policy`` is ``"recompute"``. Nothing raises into vLLM's
  threads from the data path; configuration errors raise at start, naming the key.
* Key space: model (``model_name`` or vLLM's served model name) + ``model_fingerprint`` +
  LoRA adapter name, page layout, block size, KV dtype, geometry (layers of the PP stage,
  KV heads per TP rank, head dim, page bytes), TP and PP rank, and ``tenant``; the request's
  ``cache_salt`` (and multimodal feature ids) seed its hash chain. With ``page_layout``
  ``layer_first`` / ``page_first`` the key space and bytes are SGLang HiCache's
  (``vllm_pages``): such pages are shared with SGLang servers of the same model geometry.

Engine glue only: the store is used through ``PageStore`` and its declared capabilities
(``Capability.NEEDS_REGISTERED_MEMORY``), never by name. One store instance per process and
configuration serves both roles when they share a process (offline ``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor): the process-local ``memory``
store serves hits only there; ``vllm serve`` runs the two roles in two processes.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvconnect.connectors.base import Capability, ConfigError, PageStore, Unsupported
from kvconnect.connectors.context import EngineContext
from kvconnect.connectors.engines.common import ErrorCounter, RateLimitedLog, build_store, safe_call, serve_store_metrics
from kvconnect.connectors.engines.vllm_pages import (
    ENGINE_KEYS,
    PAGE_LAYOUTS,
    WHERE,
    BlockCodec,
    PageGeometry,
    VLLMConnectorConfig,
    lora_weights,
    engine_context,
    page_hashes,
    rank_keyspaces,
    store_requirements,
    salt_seed,
    vllm_kv_dtype,
)
from kvconnect.connectors.views import PrefixedStore, exists_many, get_many, put_many
from kvconnect.namespace import KeySpace, leading_hits

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvconnect.vllm")


# ---------------------------------------------------------------------------------
# One store per process and configuration (scheduler and worker share it in-process)
# ---------------------------------------------------------------------------------

_live: "weakref.WeakSet[KVConnectConnector]" = weakref.WeakSet()


def live_connectors() -> list["KVConnectConnector"]:
    """The connectors of this process (scheduler and worker roles), for reports and tests."""
    return list(_live)


_stores_lock = threading.Lock()
_stores: dict[str, list[Any]] = {}  # config json -> [store, refcount]


def _acquire_store(options: Mapping[str, Any], context: EngineContext) -> tuple[PageStore, str]:
    """One store per configuration and process: the scheduler and the worker of an offline
    ``LLM`` share it (so the in-process ``memory`` store serves both). The context carries the
    worker's ranks (rank 0 for the scheduler); every rank's pages live in its own key space
    (``rank_keyspaces``), which the scheduler checks all of, so with several ranks the store
    must be ``shared`` (``store_requirements``: the factory refuses one that is not)."""
    ident = json.dumps([options, repr(context)], sort_keys=True, default=str)
    with _stores_lock:
        entry = _stores.get(ident)
        if entry is None or entry[0].closed:
            store, _ = build_store(options, where=WHERE, engine_keys=ENGINE_KEYS, context=context,
                                   require=store_requirements(context))
            entry = _stores[ident] = [store, 0]
        entry[1] += 1
        return entry[0], ident


def _release_store(ident: str) -> None:
    with _stores_lock:
        entry = _stores.get(ident)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _stores[ident]
    safe_call(entry[0].close, default=None, what="vllm.close")


# ---------------------------------------------------------------------------------
# Metadata passed from the scheduler to the workers each step
# ---------------------------------------------------------------------------------


@dataclass
class BlockOp:
    """Blocks of one request to load or save: ``block_ids[i]`` holds page ``hashes[i]``."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    lora: str = ""


@dataclass
class KVConnectMetadata(KVConnectorMetadata):
    loads: list[BlockOp] = field(default_factory=list)
    saves: list[BlockOp] = field(default_factory=list)


@dataclass
class _ReqState:
    """Scheduler-side state of one request."""

    hashes: list[str]          # page hashes of the prompt's full blocks
    lora: str
    local_blocks: int = 0      # blocks vLLM held itself when the request was admitted
    hit_blocks: int = 0        # blocks the store answered beyond them
    saved_blocks: int = 0      # blocks known stored (or planned) from the start
    block_ids: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------------


def _model_geometry(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[PageGeometry, list[int]]:
    """This deployment's page geometry (PP stage 0) and the layers of every PP stage."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise Unsupported(f"{len(groups)} KV cache groups (hybrid models); start vLLM with "
                          "--disable-hybrid-kv-cache-manager on a model with one kind of attention",
                          WHERE)
    spec = groups[0].kv_cache_spec
    if getattr(spec, "use_mla", False) or type(spec).__name__.startswith("MLA"):
        raise Unsupported("MLA KV caches", WHERE, ["MHA / GQA full attention"])
    for attr in ("num_kv_heads", "head_size", "block_size", "dtype"):
        if not hasattr(spec, attr):
            raise Unsupported(f"KV cache spec {type(spec).__name__} (no {attr})", WHERE)
    pc = vllm_config.parallel_config
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    total = vllm_config.model_config.get_total_num_hidden_layers()
    if pp_size > 1:
        from vllm.distributed.utils import get_pp_indices

        layers = [b - a for a, b in (get_pp_indices(total, r, pp_size) for r in range(pp_size))]
    else:
        layers = [total]
    dtype = spec.dtype
    # vLLM keeps every fp8 variant as uint8: --kv-cache-dtype names what the bytes are
    logical, scales = vllm_kv_dtype(dtype, getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None))
    geo = PageGeometry(layers=layers[0], kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
                       block_size=int(spec.block_size), dtype=logical, kv_scales=scales,
                       itemsize=int(getattr(dtype, "itemsize", 2)))
    return geo, layers


def _ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker (0, 0 outside a distributed setup)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - no process groups (tests, single process)
        return 0, 0


class KVConnectConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` over a kvconnect ``PageStore`` (see module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConfigError("kv_load_failure_policy", f"is {policy!r}: a store failure would fail the "
                              "request instead of recomputing it", ["recompute"], WHERE)
        self.config = VLLMConnectorConfig.parse(ktc.kv_connector_extra_config)
        self._errors = ErrorCounter()
        self._rlog = RateLimitedLog(log)
        mc = vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        self.model_name = self.config.model_name or str(served or mc.model)
        geo, self.layers_per_pp = _model_geometry(vllm_config, kv_cache_config)
        self.block_size = geo.block_size
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self.geometry = geo
        tp_rank, pp_rank = (0, 0) if role == KVConnectorRole.SCHEDULER else _ranks()
        self.context = engine_context(self.model_name, tp_rank=tp_rank, tp_size=self.tp_size, pp_rank=pp_rank,
                                      pp_size=self.pp_size)
        self.store, self._store_ident = _acquire_store(self.config.options, self.context)
        self._spaces: dict[tuple[str, int, int], KeySpace] = {}
        self._views: dict[str, PrefixedStore] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _ReqState] = {}
            self._pending_loads: list[BlockOp] = []
        else:
            self.tp_rank, self.pp_rank = tp_rank, pp_rank
            self.codec: BlockCodec | None = None
            self._staging = None
            self._load_errors: set[int] = set()
            self.loaded_pages = 0
            self.saved_pages = 0
            self.load_error_pages = 0
            if self.config.metrics_port is not None:
                serve_store_metrics(self.store, self.config.metrics_port, self.config.metrics_host, engine="vllm")
        _live.add(self)
        log.info("kvconnect vLLM connector (%s) over store %r, model %r, layout %s",
                 role.name.lower(), self.store.name, self.model_name, self.config.page_layout)

    # -- key spaces -------------------------------------------------------------------
    def _space(self, lora: str, tp_rank: int, pp_rank: int, geo: PageGeometry) -> KeySpace:
        ident = (lora, tp_rank, pp_rank)
        ks = self._spaces.get(ident)
        if ks is None:
            ks = self._spaces[ident] = geo.keyspace(
                model=self.model_name, weights=lora_weights(self.config.model_fingerprint, lora),
                tenant=self.config.tenant, tp_rank=tp_rank, tp_size=self.tp_size,
                pp_rank=pp_rank, pp_size=self.pp_size)
        return ks

    def _view(self, ks: KeySpace) -> PrefixedStore:
        v = self._views.get(ks.prefix)
        if v is None:
            v = self._views[ks.prefix] = PrefixedStore.for_keyspace(self.store, ks)
        return v

    def _scheduler_spaces(self, lora: str) -> list[KeySpace]:
        key = ("*" + lora, -1, -1)
        spaces = self._spaces.get(key)  # type: ignore[arg-type]
        if spaces is None:
            geo = PageGeometry(**{**self.geometry.__dict__, "layout": self.config.page_layout,
                                  "backend_block": self._backend_block()})
            base = self._space(lora, 0, 0, geo)
            spaces = rank_keyspaces(base, self.tp_size, self.pp_size, self.layers_per_pp, geo)
            self._spaces[key] = spaces  # type: ignore[assignment]
        return spaces  # type: ignore[return-value]

    def _backend_block(self) -> str:
        """The backend's block shape, for the ``native`` layout's key space.

        The scheduler never sees the KV tensors; both sides derive the shape the same way:
        the CPU backend's ``H x N x 2D``, else FlashAttention's ``2 x N x H x D``.
        """
        g = self.geometry
        if self.config.page_layout != "native":
            return ""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return f"{g.kv_heads}x{g.block_size}x{2 * g.head_dim}"
        return f"2x{g.block_size}x{g.kv_heads}x{g.head_dim}@1"

    # ==============================
    # Scheduler side
    # ==============================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        st = safe_call(self._lookup, request, num_computed_tokens, default=None, what="vllm.lookup",
                       errors=self._errors, rlog=self._rlog)
        if st is None:
            return 0, False
        return st.hit_blocks * self.block_size, False

    def _request_state(self, request: "Request") -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
            seed = salt_seed(getattr(request, "cache_salt", None), mm)
            lora_req = getattr(request, "lora_request", None)
            lora = str(getattr(lora_req, "lora_name", "") or "") if lora_req is not None else ""
            st = self._reqs[request.request_id] = _ReqState(
                hashes=page_hashes(tokens, self.block_size, seed=seed), lora=lora)
        return st

    def _lookup(self, request: "Request", num_computed_tokens: int) -> _ReqState:
        st = self._request_state(request)
        # vLLM must compute at least the prompt's last token itself.
        usable = max(0, (request.num_tokens - 1) // self.block_size)
        usable = min(usable, len(st.hashes))
        first = num_computed_tokens // self.block_size
        st.local_blocks, st.hit_blocks = first, 0
        st.saved_blocks = max(st.saved_blocks, first)
        if usable <= first:
            return st
        wanted = st.hashes[first:usable]
        spaces = self._scheduler_spaces(st.lora)
        present = exists_many([(self._view(ks), wanted) for ks in spaces])  # one store call
        every_rank = [all(rank[i] for rank in present) for i in range(len(wanted))]
        st.hit_blocks = leading_hits(every_rank)
        st.saved_blocks = max(st.saved_blocks, first + st.hit_blocks)
        return st

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        try:
            block_ids = list(blocks.get_block_ids()[0])
        except Exception as e:  # noqa: BLE001 - no blocks: nothing announced can be loaded
            self._rlog.error("alloc", "kvconnect vllm: no block ids for %s: %s", request.request_id, e)
            return
        n = num_external_tokens // self.block_size
        first = st.local_blocks
        ids = block_ids[first:first + n]
        if len(ids) != n:
            self._rlog.error("alloc-short", "kvconnect vllm: %d blocks for %d external pages of %s",
                             len(ids), n, request.request_id)
        self._pending_loads.append(BlockOp(request.request_id, ids, st.hashes[first:first + len(ids)], st.lora))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVConnectMetadata(loads=self._pending_loads)
        self._pending_loads = []
        # Saves are best effort. After a planning failure a request's block list may be stale,
        # and a stale block id would store another block's bytes under this key: stop saving
        # the requests in flight (they are recomputed or loaded as usual).
        ok = safe_call(self._plan_saves, meta, scheduler_output, default=False, what="vllm.plan_save",
                       errors=self._errors, rlog=self._rlog)
        if ok is False:
            meta.saves = []
            for st in self._reqs.values():
                st.saved_blocks = len(st.hashes)
        return meta

    def _plan_saves(self, meta: KVConnectMetadata, scheduler_output: "SchedulerOutput") -> bool:
        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + num_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + num_sched.get(req_id, 0))
        return True

    def _plan_save(self, meta: KVConnectMetadata, req_id: str, st: _ReqState, computed: int) -> None:
        """Prompt blocks this step completes that the store does not hold yet."""
        done = min(computed // self.block_size, len(st.hashes), len(st.block_ids))
        if done <= st.saved_blocks:
            return
        meta.saves.append(BlockOp(req_id, st.block_ids[st.saved_blocks:done], st.hashes[st.saved_blocks:done],
                                  st.lora))
        st.saved_blocks = done

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ==============================
    # Worker side
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        import torch

        groups = self._kv_cache_config.kv_cache_groups
        names = [n for n in groups[0].layer_names if n in kv_caches] or list(kv_caches)
        g = self.geometry
        expected = self.layers_per_pp[self.pp_rank] if self.pp_rank < len(self.layers_per_pp) else g.layers
        if len(names) != expected:
            raise Unsupported(f"{len(names)} KV cache layers on PP rank {self.pp_rank}, expected {expected}", WHERE)
        try:
            codec = BlockCodec([kv_caches[n] for n in names], self._kv_cache_config.num_blocks, g.block_size,
                               g.kv_heads, g.head_dim, self.config.page_layout)
        except ValueError as e:
            raise ConfigError("page_layout", str(e), PAGE_LAYOUTS, WHERE) from e
        geo = PageGeometry(**{**g.__dict__, "layers": len(names), "layout": self.config.page_layout,
                              "backend_block": codec.backend_block if self.config.page_layout == "native" else ""})
        if geo.backend_block != self._backend_block():
            raise Unsupported(f"KV cache block shape {codec.backend_block} (the scheduler keys pages as "
                              f"{self._backend_block()}); use page_layout 'layer_first'", WHERE)
        self.codec = codec
        self.page_geometry = geo
        self.keyspace = self._space("", self.tp_rank, self.pp_rank, geo)
        pages = max(1, self.config.staging_size // codec.page_nbytes)
        self._staging = torch.empty((pages, codec.page_elems), dtype=codec.dtype)
        if self.store.supports(Capability.NEEDS_REGISTERED_MEMORY):
            self.store.register_memory(self._staging.data_ptr(), pages * codec.page_nbytes)
        log.info("kvconnect vLLM worker tp%d pp%d: %d layers, %s layout (%s backend), %d B pages, "
                 "%d staging pages; keys %s", self.tp_rank, self.pp_rank, len(names), self.config.page_layout,
                 codec.kind, codec.page_nbytes, pages, self.keyspace.describe())

    def _batches(self, ops: Sequence[BlockOp]):
        """((view, page hash) pairs, block ids) in batches that fit the staging buffer."""
        cap = self._staging.shape[0]
        keys: list[tuple[PrefixedStore, str]] = []
        ids: list[int] = []
        for op in ops:
            view = self._view(self._space(op.lora, self.tp_rank, self.pp_rank, self.page_geometry))
            for bid, h in zip(op.block_ids, op.hashes):
                keys.append((view, h))
                ids.append(bid)
                if len(keys) == cap:
                    yield keys, ids
                    keys, ids = [], []
        if keys:
            yield keys, ids

    def _pages(self, n: int) -> list[list[tuple[int, int]]]:
        base, size = self._staging.data_ptr(), self.codec.page_nbytes
        return [[(base + i * size, size)] for i in range(n)]

    def _calls(self, keys: list[tuple[PrefixedStore, str]]) -> list[tuple[PrefixedStore, list[str], list]]:
        """A batch as (view, hashes, staging pages) runs, in batch order, for get_many / put_many."""
        pages = self._pages(len(keys))
        calls: list[tuple[PrefixedStore, list[str], list]] = []
        for (view, h), page in zip(keys, pages):
            if not calls or calls[-1][0] is not view:
                calls.append((view, [], []))
            calls[-1][1].append(h)
            calls[-1][2].append(page)
        return calls

    @staticmethod
    def _flat(results: list[list[bool]]) -> list[bool]:
        return [ok for run in results for ok in run]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVConnectMetadata) or not meta.loads or self.codec is None:
            return
        done: set[int] = set()
        try:
            for keys, ids in self._batches(meta.loads):
                ok = self._load_batch(keys, ids)
                failed = [b for b, good in zip(ids, ok) if not good]
                self.load_error_pages += len(failed)
                self._load_errors.update(failed)
                done.update(ids)
        except Exception as e:  # noqa: BLE001 - whatever was not loaded is a load error
            rest = {b for op in meta.loads for b in op.block_ids} - done
            self.load_error_pages += len(rest)
            self._load_errors.update(rest)
            self._errors.add("vllm.load")
            self._rlog.error("load", "kvconnect vllm: load failed: %s: %s", type(e).__name__, e, exc_info=True)

    def _load_batch(self, keys: list[tuple[PrefixedStore, str]], ids: list[int]) -> list[bool]:
        import torch

        n = len(keys)
        ok = safe_call(lambda: self._flat(get_many(self._calls(keys))), default=lambda: [False] * n,
                       what="vllm.load", errors=self._errors, rlog=self._rlog)
        good = [i for i, g in enumerate(ok) if g]
        if good:
            try:
                sel = torch.tensor(good, dtype=torch.int64)
                self.codec.scatter(torch.tensor([ids[i] for i in good], dtype=torch.int64),
                                   self._staging[:n].index_select(0, sel) if len(good) < n else self._staging[:n])
            except Exception as e:  # noqa: BLE001 - a failed copy is a load error, recomputed
                self._errors.add("vllm.scatter")
                self._rlog.error("scatter", "kvconnect vllm: copying loaded pages failed: %s", e, exc_info=True)
                return [False] * n
        self.loaded_pages += len(good)
        return ok

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVConnectMetadata) or not meta.saves or self.codec is None:
            return
        safe_call(self._save, meta.saves, default=None, what="vllm.save", errors=self._errors, rlog=self._rlog)

    def _save(self, saves: Sequence[BlockOp]) -> None:
        import torch

        for keys, ids in self._batches(saves):
            n = len(keys)
            try:
                self.codec.gather(torch.tensor(ids, dtype=torch.int64), self._staging[:n])
            except Exception as e:  # noqa: BLE001 - a failed save is a future miss
                self._errors.add("vllm.gather")
                self._rlog.error("gather", "kvconnect vllm: copying pages to save failed: %s", e, exc_info=True)
                continue
            ok = safe_call(lambda: self._flat(put_many(self._calls(keys))), default=lambda: [False] * n,
                           what="vllm.save", errors=self._errors, rlog=self._rlog)
            self.saved_pages += sum(ok)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            self._rlog.warning("load-errors", "kvconnect vllm: %d blocks failed to load; vLLM recomputes them",
                               len(errors))
        return errors

    def shutdown(self):
        _release_store(self._store_ident)

    # -- introspection ----------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Counters for logs and tests."""
        out: dict[str, Any] = {"role": self.role.name.lower(), "store": self.store.name,
                               "errors": self._errors.as_dict()}
        if self.role != KVConnectorRole.SCHEDULER:
            out.update(loaded_pages=self.loaded_pages, saved_pages=self.saved_pages,
                       load_error_pages=self.load_error_pages)
        stats = safe_call(self.store.stats, default=None, what="vllm.stats", errors=self._errors, rlog=self._rlog)
        if stats is not None:
            out["store_stats"] = {k: v for k, v in stats.as_dict().items() if isinstance(v, (int, float))}
        return out
