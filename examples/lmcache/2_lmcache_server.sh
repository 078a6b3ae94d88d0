#!/usr/bin/env bash
# Terminal 2: the LMCache MP server of the LMCache deployment guide, with a kvconnect store as its L2.
#   STORE=memory   (default) pages in the server process, LRU over CAPACITY
#   STORE=hf3fs    pages in one file under KV_DIR (a 3FS mount, or any POSIX file system);
#                  with META_URL (see 1_meta_server.sh) several servers/nodes share the pages
#   STORE=mooncake pages in a Mooncake Store cluster (MOONCAKE_MASTER, TCP unless MOONCAKE_PROTOCOL)
# Usage telemetry is off; the HTTP status API and the ZMQ port bind 127.0.0.1.
set -euo pipefail
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
HERE="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$HERE/../..${PYTHONPATH:+:$PYTHONPATH}"   # or: pip install "kvconnect[lmcache]"
STORE="${STORE:-memory}"
case "$STORE" in
  memory)   PARAMS="{\"store\":\"memory\",\"capacity\":\"${CAPACITY:-16gb}\"}" ;;
  hf3fs)    KV_DIR="${KV_DIR:-/3fs/kvconnect}"; mkdir -p "$KV_DIR"
            PARAMS="{\"store\":\"hf3fs\",\"file_path_prefix\":\"$KV_DIR/lmcache\",\"file_size\":\"${FILE_SIZE:-64gb}\",\"numjobs\":8,\"entries\":8"
            if [[ -n "${META_URL:-}" ]]; then
              PARAMS="$PARAMS,\"metadata_server_url\":\"$META_URL\",\"auth_token_file\":\"${TOKEN_FILE:-$PWD/hf3fs.token}\""
            fi
            PARAMS="$PARAMS}" ;;
  mooncake) PARAMS="{\"store\":\"mooncake\",\"master_server_address\":\"${MOONCAKE_MASTER:-127.0.0.1:50051}\",\"metadata_server\":\"P2PHANDSHAKE\",\"local_hostname\":\"${MOONCAKE_LOCAL_HOSTNAME:-127.0.0.1}\",\"protocol\":\"${MOONCAKE_PROTOCOL:-tcp}\",\"global_segment_size\":\"${MOONCAKE_GLOBAL_SEGMENT_SIZE:-4gb}\"}" ;;
  *) echo "STORE must be memory, hf3fs or mooncake" >&2; exit 2 ;;
esac
ADAPTER="{\"type\":\"plugin\",\"module_path\":\"kvconnect.connectors.engines.lmcache_l2\",\"class_name\":\"KVConnectL2Adapter\",\"adapter_params\":$PARAMS}"
echo "L2 adapter: $ADAPTER" >&2
exec lmcache server "$@" \
  --host 127.0.0.1 \
  --port "${PORT:-5556}" \
  --l1-size-gb "${L1_GB:-4}" \
  --eviction-policy LRU \
  --http-host 127.0.0.1 --http-port "${HTTP_PORT:-8080}" \
  --disable-metrics \
  --l2-adapter "$ADAPTER"
