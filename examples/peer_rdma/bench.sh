#!/usr/bin/env bash
# Step 5: a prefix-heavy load through the router (SGLang's generated-shared-prefix dataset).
set -euo pipefail
: "${NODE1_IP:?source examples/peer_rdma/env.sh first}"
exec python -m sglang.bench_serving --backend sglang \
  --host "$NODE1_IP" --port 8000 --model "$MODEL" \
  --dataset-name generated-shared-prefix \
  --gsp-num-groups 64 --gsp-prompts-per-group 16 \
  --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256 \
  --num-prompts 1024 --request-rate 8
