"""A tiny Llama-style model built locally, for tests, examples and benchmarks of vLLM on CPU.

``make_tiny_model(path)`` writes a random-weight ``LlamaForCausalLM`` (safetensors,
``config.json``) and a word-level tokenizer built with the ``tokenizers`` library
(``tokenizer.json`` + ``tokenizer_config.json``) into ``path``: nothing is downloaded, and
vLLM loads the directory as it would a hub checkpoint. The weights come from a fixed seed,
so every process that builds the model with the same arguments gets the same bytes and the
same greedy tokens; a wrong KV byte changes the logits, so outputs are a real check.

Needs torch, safetensors and tokenizers (all in vLLM's environment); imported lazily.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

from kvconnect.connectors.testing.processes import child_env, stop

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more out up into do any your what some can only other new time could these two may first "
    "then over such our like just after also made where most years work way well even back "
    "cache page store block token model layer engine server memory disk file metadata peer "
    "prefix hit miss load save key value green blue red river stone cloud light night day"
).split()


def _tokenizer_files(path: Path, words: list[str]) -> int:
    """Write a word-level fast tokenizer; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + [w for w in dict.fromkeys(words) if w not in specials])}
    # Digits as their own tokens so any number can be spelled.
    for d in "0123456789.,;:!?":
        vocab.setdefault(d, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return len(vocab)


def make_tiny_model(path: str | os.PathLike, *, layers: int = 2, hidden: int = 256, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 512, max_positions: int = 2048,
                    dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a random-weight Llama model and its tokenizer into ``path``; returns the path.

    Args:
        path: directory to create (reused when it already holds the same model).
        layers, hidden, heads, kv_heads, intermediate: the Llama geometry (head dim is
            ``hidden // heads``; GQA with ``kv_heads`` KV heads).
        max_positions: context length.
        dtype: ``torch_dtype`` of the checkpoint (vLLM's ``--dtype auto`` follows it).
        seed: weights seed (same seed, same bytes, same tokens).
    """
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer_files(path, list(WORDS))
    # Round the vocabulary up: embedding rows past the tokenizer's ids are never produced
    # by the tokenizer, but greedy decoding may pick them (decoded as <unk>).
    vocab_size = -(-vocab // 64) * 64
    head_dim = hidden // heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_act": "silu", "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, "attention_bias": False,
        "mlp_bias": False,
    }
    marker = path / ".kvconnect-tiny-model.json"
    ident = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    if marker.exists() and marker.read_text() == ident and (path / "model.safetensors").exists():
        return path
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(seed)
    td = getattr(torch, dtype)

    def w(*shape: int, scale: float = 0.0) -> torch.Tensor:
        s = scale or shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * s).to(td)

    tensors = {"model.embed_tokens.weight": w(vocab_size, hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden, dtype=td),
               "lm_head.weight": w(vocab_size, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=td),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=td),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(intermediate, hidden),
            p + "mlp.up_proj.weight": w(intermediate, hidden),
            p + "mlp.down_proj.weight": w(hidden, intermediate),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(ident)
    return path


def prompt_text(seed: int, n_words: int) -> str:
    """A deterministic prompt of ``n_words`` words of the tiny model's vocabulary."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# ---------------------------------------------------------------------------------
# A vLLM process driven by JSON lines (tests, examples, benchmarks)
# ---------------------------------------------------------------------------------

CPU_ENV = {
    # One process: scheduler, worker and connector share it (the ``memory`` store works,
    # and a test can read the connector's counters).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _metric(llm: Any, name: str) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total


def _build_llm(spec: dict) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(model=spec["model"], dtype=spec.get("dtype", "bfloat16"),
                              max_model_len=spec.get("max_model_len", 2048),
                              block_size=spec.get("block_size", 32), enforce_eager=True,
                              max_num_seqs=spec.get("max_num_seqs", 8),
                              max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
                              seed=0, distributed_executor_backend="uni", disable_log_stats=False,
                              gpu_memory_utilization=0.9)
    if spec.get("served_model_name"):
        kw["served_model_name"] = spec["served_model_name"]
    ktc = spec.get("kv_transfer_config")
    if ktc:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**ktc)
        kw["disable_hybrid_kv_cache_manager"] = True
    return LLM(**kw)


def drive(spec: dict) -> None:
    """Serve JSON-line commands on stdin with one ``vllm.LLM`` built from ``spec``.

    Commands: ``{"op": "generate", "prompts": [...], "max_tokens": n}`` -> per prompt the
    greedy token ids and ``num_cached_tokens``, plus the change of vLLM's
    ``vllm:external_prefix_cache_hits`` / ``vllm:prefix_cache_hits`` counters and the
    wall time; ``{"op": "reset"}`` empties vLLM's own prefix cache; ``{"op": "report"}``
    returns the kvconnect connectors' counters; ``{"op": "exit"}``.
    """
    import sys
    import time

    # Replies go to the real stdout; everything vLLM prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t0 = time.monotonic()
    llm = _build_llm(spec)
    out.write(json.dumps({"ready": True, "startup_s": round(time.monotonic() - t0, 2)}) + "\n")
    out.flush()
    from vllm import SamplingParams

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                ext0 = _metric(llm, "vllm:external_prefix_cache_hits")
                loc0 = _metric(llm, "vllm:prefix_cache_hits")
                sp = SamplingParams(temperature=0, max_tokens=int(cmd.get("max_tokens", 8)), ignore_eos=True)
                t = time.monotonic()
                res = llm.generate(cmd["prompts"], sp, use_tqdm=False)
                dt = time.monotonic() - t
                reply = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                         "cached": [int(r.num_cached_tokens or 0) for r in res],
                         "prompt_tokens": [len(r.prompt_token_ids) for r in res],
                         "prompt_ids": [list(r.prompt_token_ids) for r in res],
                         "external_hits": _metric(llm, "vllm:external_prefix_cache_hits") - ext0,
                         "local_hits": _metric(llm, "vllm:prefix_cache_hits") - loc0,
                         "seconds": dt}
            elif op == "reset":
                # A connector that saves asynchronously (LMCache) holds blocks until a later
                # engine step reports the save done: drive steps with a one-token request.
                ok = False
                for attempt in range(20):
                    if llm.reset_prefix_cache():
                        ok = True
                        break
                    llm.generate([f"flush {attempt}"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                reply = {"reset": ok}
            elif op == "report":
                from kvconnect.connectors.engines.vllm_native import live_connectors

                reply = {"connectors": [c.report() for c in live_connectors()]}
            elif op == "exit":
                out.write(json.dumps({"bye": True}) + "\n")
                out.flush()
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - report to the test, keep serving
            import traceback

            reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------
# The client side: such a process, started from another environment
# ---------------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("KVCONNECT_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")
"""The interpreter of vLLM's environment (``$KVCONNECT_VLLM_PYTHON`` overrides ``.venv-vllm``)."""


class VLLMProcess:
    def __init__(self, model: Path, log: Path, kv_transfer_config: dict | None = None, ns: Any = None,
                 env: dict | None = None, **spec: Any):
        """``ns``: a ``Netns`` or a namespace's name to run in (None: this one)."""
        ns = getattr(ns, "name", ns)
        spec = {"model": str(model), **spec}
        if kv_transfer_config:
            spec["kv_transfer_config"] = kv_transfer_config
        full_env = child_env({**CPU_ENV, **(env or {})})
        argv = [str(VLLM_PY), "-u", "-m", "kvconnect.connectors.testing.vllm", json.dumps(spec)]
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), env=full_env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.ready = self._recv(300)

    def _recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    return json.loads(line)
        tail = self.log_path.read_text()[-4000:] if self.log_path.exists() else ""
        raise RuntimeError(f"vLLM process did not answer (rc={self.proc.poll()}): {tail}")

    def call(self, op: str, timeout: float = 300, **args: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._recv(timeout)
        if "error" in reply:
            raise RuntimeError(f"{op}: {reply['error']}\n{reply.get('trace', '')}")
        return reply

    def generate(self, prompts: list[str], max_tokens: int = 8) -> dict:
        return self.call("generate", prompts=prompts, max_tokens=max_tokens)

    def worker_report(self) -> dict:
        reps = self.call("report")["connectors"]
        return next(r for r in reps if r["role"] == "worker")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except Exception:  # noqa: BLE001
                pass
        stop(self.proc, 10)
        self.log.close()

    def __enter__(self) -> "VLLMProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    import sys as _sys

    for _k, _v in CPU_ENV.items():
        os.environ.setdefault(_k, _v)
    _spec = json.loads(_sys.argv[1])
    if _spec.get("make_model"):
        make_tiny_model(_spec["model"], **_spec.get("model_args", {}))
    drive(_spec)


def prompts(seed: int, n: int = 2, words: int = 300) -> list[str]:
    """``n`` distinct prompts of ``words`` words, the same for the same ``seed``."""
    return [prompt_text(seed * 100 + i, words) for i in range(n)]


CONNECTOR = {"kv_connector": "KVConnectConnector", "kv_connector_module_path": "kvconnect.connectors.engines.vllm_native",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def vllm_skip_reason() -> str | None:
    if not VLLM_PY.exists():
        return f"needs {VLLM_PY} (built by scripts/install.sh)"
    return None


def connector_config(extra: dict) -> dict:
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def flag_fail(inner: str, options: dict, flag: Path) -> dict:
    """Extra config of a real store wrapped so that loads fail once ``flag`` exists (lookups
    still answer from the real store: vLLM is promised pages it then cannot load)."""
    return {"store": "kvconnect.connectors.testing.stores:FaultyStore", "inner": inner,
            "inner_options": options, "raise_on": ["get_into"], "fault_flag": str(flag),
            "message": "injected failure"}
