#!/usr/bin/env bash
# Terminal 2: the decode server (GPU 1). Same KVCONNECT_PD_CONFIG transport as prefill.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVCONNECT_PD_CONFIG="${KVCONNECT_PD_CONFIG:-$HERE/direct.json}"
export SGLANG_HOST_IP="${SGLANG_HOST_IP:-127.0.0.1}"
MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"

exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --host 127.0.0.1 \
  --port 30001 \
  --base-gpu-id 1 \
  --tp 1 \
  --context-length 8192 \
  --max-total-tokens 32768 \
  --disaggregation-mode decode \
  --disaggregation-transfer-backend kvconnect
