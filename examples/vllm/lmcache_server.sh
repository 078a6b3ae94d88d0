#!/usr/bin/env bash
# Terminal 1: `lmcache server` with a kvconnect store (STORE, see stores.sh) as its L2.
# On a CPU-only host vLLM's KV is in host memory: add ENGINE_DRIVEN=1 (the worker packs and
# commits KV over ZMQ; LMCache's default lmcache_driven mode needs CUDA IPC).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/stores.sh"
export PYTHONPATH="$HERE/../..${PYTHONPATH:+:$PYTHONPATH}"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
STORE="${STORE:-memory}"
HF3FS_FILE=lmcache
ADAPTER="{\"type\":\"plugin\",\"module_path\":\"kvconnect.connectors.engines.lmcache_l2\",\"class_name\":\"KVConnectL2Adapter\",\"adapter_params\":{$(store_options "$STORE")}}"
[[ -n "${ENGINE_DRIVEN:-}" ]] && set -- --supported-transfer-mode engine_driven "$@"
echo "L2 adapter: $ADAPTER" >&2
exec lmcache server --host 127.0.0.1 --port "${LMCACHE_PORT:-5556}" --chunk-size "${CHUNK:-256}" \
  --l1-size-gb "${L1_GB:-4}" --eviction-policy LRU --http-host 127.0.0.1 --http-port "${HTTP_PORT:-8080}" \
  --disable-metrics --l2-adapter "$ADAPTER" "$@"
