#!/usr/bin/env bash
# No GPU? Check the LMCache server + kvconnect store path on CPU: start 2_lmcache_server.sh
# (same STORE=... variables) with --l2-store-policy skip_l1 so hits must come from the
# kvconnect store, drive it with LMCache's own engine client (`lmcache bench server`, CPU KV
# tensors over POSIX SHM: the lmcache_driven path SGLang takes with CUDA IPC), then print the
# store's counters from the server's /status. Everything binds 127.0.0.1.
set -euo pipefail
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
HERE="$(cd "$(dirname "$0")" && pwd)"
PORT="${PORT:-5556}" HTTP_PORT="${HTTP_PORT:-8080}"
LOG="$(mktemp /tmp/lmcache-server.XXXX.log)"
L1_GB="${L1_GB:-1}" HTTP_PORT="$HTTP_PORT" bash "$HERE/2_lmcache_server.sh" --l2-store-policy skip_l1 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$HTTP_PORT/status" 2>/dev/null | grep -q '"is_healthy":true' && break
  kill -0 $SERVER 2>/dev/null || { tail -30 "$LOG"; exit 1; }
  sleep 1
done
lmcache bench server --rpc-url "tcp://127.0.0.1:$PORT" --url "http://127.0.0.1:$HTTP_PORT" \
  --mode cpu --transfer-mode lmcache_driven --kvcache-shape-spec '(2,64,16,2,64):float16:4' \
  --num-tokens 512 --start 0 --end 3 --interval 0.5 | grep -E "LOOKUP|STORE|RETRIEVE|CHECKSUM (MATCH|MISMATCH)"
curl -s "http://127.0.0.1:$HTTP_PORT/status" | python3 -c '
import json, sys
a = json.load(sys.stdin)["storage_manager"]["l2_adapters"][0]
print("kvconnect store:", a["store"], "healthy:", a["is_healthy"], "errors:", a["errors"])
print("store counters:", json.dumps(a.get("store_stats", {})))'
