#!/usr/bin/env bash
# Terminal 3 (a CUDA GPU): SGLang connected to the LMCache server (the LMCache deployment guide).
# LMCache's SGLang connector needs CUDA KV tensors and the same GPUs / IPC namespace as the
# server (lmcache_driven transfers): run both on the same machine.
set -euo pipefail
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
HERE="$(cd "$(dirname "$0")" && pwd)"
exec python -m sglang.launch_server \
  --model-path "${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}" \
  --host 127.0.0.1 \
  --port 30000 \
  --tp 1 \
  --context-length 8192 \
  --max-total-tokens 32768 \
  --mem-fraction-static 0.7 \
  --enable-lmcache \
  --lmcache-config-file "$HERE/lmcache_config.yaml"
