#!/usr/bin/env bash
# Terminal 1: the prefill server of the PD deployment guide's 1P1D setup, with kvconnect
# as the PD transfer backend. GPU 0. Pick the transport with KVCONNECT_PD_CONFIG (a JSON
# text or a file; see direct.json, relay_mooncake.json, relay_hf3fs.json next to this script).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVCONNECT_PD_CONFIG="${KVCONNECT_PD_CONFIG:-$HERE/direct.json}"
export SGLANG_HOST_IP="${SGLANG_HOST_IP:-127.0.0.1}"
MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"

exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --host 127.0.0.1 \
  --port 30000 \
  --base-gpu-id 0 \
  --tp 1 \
  --context-length 8192 \
  --max-total-tokens 32768 \
  --disaggregation-mode prefill \
  --disaggregation-bootstrap-port 8998 \
  --disaggregation-transfer-backend kvconnect
