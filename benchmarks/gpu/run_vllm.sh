#!/usr/bin/env bash
# vLLM on a GPU host: the same side-by-side as `kvconnect bench vllm` on CPU, plus the references
# that need CUDA (vLLM's OffloadingConnector CPU tier, LMCache's LMCacheConnectorV1 local CPU backend).
# NOT RUN YET (docs/vllm.md, GPU): the lent H200 image has Python 3.12 + torch 2.11 (CUDA 13) and no
# vLLM; vLLM 0.33 pins torch 2.14. Give a vLLM release built for the host's torch:
#   VLLM_SPEC='vllm==X.Y.Z' bash benchmarks/gpu/run_vllm.sh
# What it does:
#   1. a venv (VLLM_VENV, default .gpu/vllm-venv, system site packages: the image's torch) with VLLM_SPEC,
#      lmcache 0.5.6 (--no-deps + its light deps, as docs/lmcache.md's GPU notes) and kvconnect (editable, --no-deps);
#   2. benchmarks/vllm.py (`kvconnect bench vllm`) run by that venv's interpreter, which is also vLLM's
#      (KVCONNECT_VLLM_PYTHON), every system, into VLLM_GPU_OUT (default benchmarks/results/vllm_gpu.json).
# Not done by this script: both serving paths with a real model dir, by hand (examples/vllm/native.sh,
# examples/vllm/lmcache_server.sh + lmcache_vllm.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${VLLM_SPEC:?set VLLM_SPEC to a vLLM release built for the torch of this host}"
VENV=${VLLM_VENV:-$ROOT/.gpu/vllm-venv}
[[ -x "$VENV/bin/python" ]] || python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install "$VLLM_SPEC" msgpack xxhash prometheus-client tqdm grpcio sortedcontainers \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"$VENV/bin/pip" install --no-deps lmcache==0.5.6
"$VENV/bin/pip" install --no-deps -e "$ROOT"
export KVCONNECT_VLLM_PYTHON="$VENV/bin/python" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
# the venv's interpreter: the copy of the tree on a GPU machine has no .venv (scripts/install.sh's)
"$VENV/bin/python" -m kvconnect.connectors.cli bench vllm --prompts "${PROMPTS:-32}" --words "${WORDS:-4000}" \
  --systems recompute,kvc_memory,kvc_hf3fs,lmcache_mp,lmcache_mp_kvc_hf3fs,vllm_offloading,lmcache_v1 \
  --out "${VLLM_GPU_OUT:-$ROOT/benchmarks/results/vllm_gpu.json}"
