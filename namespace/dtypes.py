"""The logical KV dtype of a key space: what the bytes of a page mean, not what they are stored as.

SGLang and vLLM keep fp8 KV in ``uint8`` tensors (``index_put`` has no fp8 kernels), so a host
pool or KV spec says ``uint8`` for ``fp8_e4m3``, ``fp8_e5m2`` and ``mxfp8`` alike: three engines
whose pages decode differently would share keys (SGLang's own L3 keys omit the dtype entirely,
sglang issue #33268). A ``KeySpace`` therefore carries the *logical* dtype (``float8_e4m3fn``)
and, separately, the format of any quantization scales stored inside the pages
(``KeySpace.kv_scales``: ``mxfp8`` block scales differ from a per-tensor fp8 page with none).

``logical_kv_dtype`` turns an engine's spelling (``--kv-cache-dtype fp8_e4m3``, vLLM's
``cache_dtype="fp8"``, ``torch.bfloat16``) into one canonical name; ``resolve_kv_dtype`` picks
between the engine's declared dtype and the dtype its buffers have.
"""

from __future__ import annotations

from typing import Any, Optional

from kvconnect.connectors.errors import ConfigError

AUTO = "auto"
"""An engine's "same as the model" setting: the buffers' dtype is the logical one."""

_CANONICAL = {
    # name -> (logical dtype, scale format stored in the pages)
    "bfloat16": ("bfloat16", ""), "bf16": ("bfloat16", ""),
    "float16": ("float16", ""), "fp16": ("float16", ""), "half": ("float16", ""),
    "float32": ("float32", ""), "fp32": ("float32", ""), "float": ("float32", ""),
    # fp8 without a suffix is e4m3 in both SGLang and vLLM
    "fp8": ("float8_e4m3fn", ""), "fp8_e4m3": ("float8_e4m3fn", ""), "float8_e4m3fn": ("float8_e4m3fn", ""),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", ""), "fp8_e4m3fnuz": ("float8_e4m3fnuz", ""),
    "fp8_e5m2": ("float8_e5m2", ""), "float8_e5m2": ("float8_e5m2", ""),
    "float8_e5m2fnuz": ("float8_e5m2fnuz", ""),
    # block-scaled formats: the scales ride in the pages
    "mxfp8": ("float8_e4m3fn", "mxfp8"),
    "nvfp4": ("float4_e2m1fn_x2", "nvfp4"), "fp4_mx_block16": ("float4_e2m1fn_x2", "fp4_mx_block16"),
    "fp4_e2m1": ("float4_e2m1fn_x2", ""), "float4_e2m1fn_x2": ("float4_e2m1fn_x2", ""),
    # byte containers: only ever a *stored* dtype of a quantized cache, or a format of its own
    "uint8": ("uint8", ""), "int8": ("int8", ""),
}

ACCEPTED = tuple(sorted(set(_CANONICAL) | {AUTO}))
BYTE_CONTAINERS = frozenset({"uint8", "int8"})
"""Stored dtypes that say nothing about what the bytes mean."""


def dtype_name(dtype: Any) -> str:
    """``torch.float8_e4m3fn`` / ``"torch.bfloat16"`` / ``"bf16"`` -> its bare lower-case name."""
    return str(dtype).replace("torch.", "").strip().lower()


def logical_kv_dtype(value: Any, *, key: str = "kv_cache_dtype",
                     where: str = "key space") -> Optional[tuple[str, str]]:
    """``(logical dtype, scale format)`` of an engine's KV dtype setting; None for ``auto``/unset.

    Raises ``ConfigError`` naming ``key`` and the accepted values for anything else."""
    if value is None or value == "":
        return None
    name = dtype_name(value)
    if name == AUTO:
        return None
    try:
        return _CANONICAL[name]
    except KeyError:
        raise ConfigError(key, f"unknown KV dtype {value!r}", ", ".join(ACCEPTED), where) from None


def resolve_kv_dtype(stored: Any, declared: Any = None, *, key: str = "kv_cache_dtype",
                     where: str = "key space") -> tuple[str, str]:
    """The ``(dtype, kv_scales)`` of a key space from the dtype the engine's buffers have
    (``stored``) and the KV dtype it was started with (``declared``: ``--kv-cache-dtype``,
    ``auto`` or None when unknown). The declared one names what a byte container (``uint8``)
    holds and adds its scale format; buffers typed with another real dtype (a draft model's
    own bf16 KV beside an fp8 target) keep theirs. A byte container with nothing declared
    stays ``uint8``, a key space no fp8 or bf16 one shares."""
    name = dtype_name(stored) if stored is not None else "unknown"
    own = _CANONICAL.get(name, (name, ""))
    declared_pair = logical_kv_dtype(declared, key=key, where=where)
    if declared_pair is None:
        return own
    if stored is None or name in BYTE_CONTAINERS or declared_pair[0] == own[0]:
        return declared_pair
    return own  # buffers typed with a real dtype other than the declared one say what the bytes are
