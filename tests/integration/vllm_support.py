"""Real vLLM (CPU, ``.venv-vllm``) processes for the tests, driven by JSON lines.

Each ``VLLMProcess`` runs ``python -m connectors.engines.vllm_testing SPEC`` (one
``vllm.LLM`` over the tiny local model, scheduler and worker in one process) with the
vLLM environment's interpreter, optionally inside a network namespace.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

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


class VLLMProcess:
    def __init__(self, model: Path, log: Path, kv_transfer_config: dict | None = None, ns: str | None = None,
                 env: dict | None = None, **spec: Any):
        spec = {"model": str(model), **spec}
        if kv_transfer_config:
            spec["kv_transfer_config"] = kv_transfer_config
        from connectors.engines.vllm_testing import CPU_ENV

        full_env = dict(os.environ, PYTHONPATH=str(ROOT), **CPU_ENV, **(env or {}))
        argv = [str(VLLM_PY), "-u", "-m", "connectors.engines.vllm_testing", json.dumps(spec)]
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=str(ROOT), env=full_env, stdin=subprocess.PIPE,
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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()

    def __enter__(self) -> "VLLMProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
