"""A dummy-weight model directory that SGLang, ``sglang_router`` and the load driver can run on text.

SGLang's ``--load-format dummy`` fills the weights deterministically, so outputs repeat exactly while
wrong KV bytes change them. The tokenizer is a word-level one built here (no download): token id
``i`` is the word ``w<i>`` (id 0 is ``<unk>``), words are split on spaces, so every id sequence maps
to one text and back. Prompts are made of ids and sent as text; SGLang re-tokenizes them to the same
ids, and generated ids always decode to distinct words, so equal texts mean equal tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

# Llama-3-8B geometry: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 128 KiB of KV per token.
SHAPES = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256, "bos_token_id": 128000,
        "eos_token_id": 128001, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True,
    },
}
# A small shape for trying the benchmark on a modest GPU.
SHAPES["llama-1b"] = {**SHAPES["llama3-8b"], "hidden_size": 2048, "intermediate_size": 8192,
                      "num_hidden_layers": 16, "head_dim": 64, "tie_word_embeddings": True}

# Prompt ids stay below the special-token range of Llama-3's vocabulary.
PROMPT_VOCAB = 128000


def word(i: int) -> str:
    return f"w{i}"


def ids_to_text(ids: Sequence[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def text_to_ids(text: str) -> list[int]:
    return [int(w[1:]) if w.startswith("w") and w[1:].isdigit() else 0 for w in text.split()]


def build_tokenizer(vocab_size: int):
    """The word-level tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0}
    vocab.update({word(i): i for i in range(1, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def write_model_dir(path: Path | str, shape: str = "llama3-8b") -> Path:
    """Write config.json + tokenizer files for ``shape`` into ``path`` (idempotent)."""
    if shape not in SHAPES:
        raise ValueError(f"model shape {shape!r}: accepted values are {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = SHAPES[shape]
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if not (path / "tokenizer.json").exists():
        build_tokenizer(config["vocab_size"]).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False,
    }) + "\n")
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}) + "\n")
    return path
