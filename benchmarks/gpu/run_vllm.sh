#!/usr/bin/env bash
# vLLM on a GPU host: the same side-by-side as `kvconnect bench vllm` on CPU, plus the references
# that need CUDA (vLLM's OffloadingConnector CPU tier, LMCache's LMCacheConnectorV1 local CPU backend).
#   VLLM_SPEC='vllm==X.Y.Z' bash benchmarks/gpu/run_vllm.sh        (-h: this text; needs network for pip)
# Not run on a GPU yet (docs/vllm.md): a vLLM release pins its torch, so give one built for the torch
# already on the host (the venv sees the system's packages).
# What it does:
#   1. a venv (VLLM_VENV, default <checkout>/.venv-vllm-gpu, system site packages: the host's torch) with
#      VLLM_SPEC, lmcache 0.5.6 (--no-deps + its light deps, as docs/lmcache.md's GPU notes) and this
#      checkout's kvconnect (editable, --no-deps);
#   2. benchmarks/vllm.py (`kvconnect bench vllm`) run by that venv's interpreter, which is also vLLM's
#      (KVCONNECT_VLLM_PYTHON), every system, into VLLM_GPU_OUT (default benchmarks/results/vllm_gpu.json).
# Env: VLLM_SPEC (required), VLLM_VENV, VLLM_GPU_OUT (above), PROMPTS (32), WORDS (4000).
# Not done by this script: both serving paths with a real model dir, by hand (examples/vllm/native.sh,
# examples/vllm/lmcache_server.sh + lmcache_vllm.sh).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d' | cut -c3-; exit 0 ;; esac
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
: "${VLLM_SPEC:?set VLLM_SPEC to a vLLM release built for the torch of this host}"
VENV=${VLLM_VENV:-$ROOT/.venv-vllm-gpu}
[[ -x "$VENV/bin/python" ]] || python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install "$VLLM_SPEC" msgpack xxhash prometheus-client tqdm grpcio sortedcontainers \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"$VENV/bin/pip" install --no-deps lmcache==0.5.6
"$VENV/bin/pip" install --no-deps -e "$ROOT"
export KVCONNECT_VLLM_PYTHON="$VENV/bin/python" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
# the venv's interpreter runs the benchmark: it is the one that has vLLM
"$VENV/bin/python" -m kvconnect.connectors.cli bench vllm --prompts "${PROMPTS:-32}" --words "${WORDS:-4000}" \
  --systems recompute,kvc_memory,kvc_hf3fs,lmcache_mp,lmcache_mp_kvc_hf3fs,vllm_offloading,lmcache_v1 \
  --out "${VLLM_GPU_OUT:-$ROOT/benchmarks/results/vllm_gpu.json}"
