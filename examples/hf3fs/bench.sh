#!/usr/bin/env bash
# Step 4: SGLang's multi-turn benchmark through the router (unchanged from SGLang's guide).
set -euo pipefail
SGLANG_SRC="${SGLANG_SRC:-/sgl-workspace/sglang}"
MODEL="${MODEL:-/code/models/Qwen3-32B}"
DATASET="${DATASET:-/code/models/ShareGPT_V3_unfiltered_cleaned_split.json}"
python3 "$SGLANG_SRC/benchmark/hicache/bench_multiturn.py" \
    --model-path "$MODEL" --dataset-path "$DATASET" --port 30000 \
    --request-length 2048 --num-clients 512 --num-rounds 5 --max-parallel 8 2>&1 | tee bench_multiturn.out
