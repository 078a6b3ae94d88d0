#!/usr/bin/env bash
# Step 3: one SGLang server with kvconnect's peer pool as its HiCache L3 (run on every node).
set -euo pipefail
: "${PC:?source examples/peer_rdma/env.sh first}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
exec python -m sglang.launch_server \
  --model-path "$MODEL" --tp-size "$TP" --trust-remote-code \
  --host 0.0.0.0 --port 30000 \
  --enable-hierarchical-cache \
  --hicache-write-policy write_through \
  --hicache-ratio 1.2 \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "$PC"
