"""Real vLLM (CPU, ``.venv-vllm``) processes for the tests, driven by JSON lines.

Each ``VLLMProcess`` runs ``python -m connectors.engines.vllm_testing SPEC`` (one
``vllm.LLM`` over the tiny local model, scheduler and worker in one process) with the
vLLM environment's interpreter, optionally inside a network namespace.
"""

from __future__ import annotations

from pathlib import Path

from connectors.engines.vllm_testing import VLLM_PY, VLLMProcess  # noqa: F401

CONNECTOR = {"kv_connector": "KVConnectConnector", "kv_connector_module_path": "connectors.engines.vllm_native",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def vllm_skip_reason() -> str | None:
    if not VLLM_PY.exists():
        return f"needs {VLLM_PY} (built by scripts/install.sh)"
    return None


def connector_config(extra: dict) -> dict:
    return {**CONNECTOR, "kv_connector_extra_config": extra}


def flag_fail(inner: str, options: dict, flag: Path) -> dict:
    """Extra config of a real store wrapped so that loads fail once ``flag`` exists."""
    return {"store": "tests.integration.vllm_faulty:FlagFailStore", "inner": inner,
            "inner_options": options, "fail_flag": str(flag)}


