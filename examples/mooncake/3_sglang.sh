#!/usr/bin/env bash
# Terminal 3: SGLang with HiCache L3 on the Mooncake store through kvconnect (needs a GPU).
# The engine contributes no memory (MOONCAKE_GLOBAL_SEGMENT_SIZE=0): pages live in the
# standalone store of terminal 2, so they survive an SGLang restart.
set -euo pipefail
export MOONCAKE_LOCAL_HOSTNAME="${MOONCAKE_LOCAL_HOSTNAME:-localhost}"
export MOONCAKE_TE_META_DATA_SERVER="${MOONCAKE_TE_META_DATA_SERVER:-http://127.0.0.1:8080/metadata}"
export MOONCAKE_MASTER="${MOONCAKE_MASTER:-127.0.0.1:50051}"
export MOONCAKE_PROTOCOL="${MOONCAKE_PROTOCOL:-tcp}"
export MOONCAKE_GLOBAL_SEGMENT_SIZE=0
exec python -m sglang.launch_server \
  --model-path Qwen/Qwen2.5-1.5B-Instruct \
  --host 127.0.0.1 --port 30000 --tp 1 \
  --context-length 8192 --max-total-tokens 32768 --mem-fraction-static 0.7 \
  --enable-metrics \
  --enable-hierarchical-cache --hicache-ratio 2 --page-size 64 \
  --hicache-mem-layout page_first_direct --hicache-io-backend direct \
  --hicache-write-policy write_through \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config '{"backend_name":"kvconnect","module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage","interface_v1":1,"store":"mooncake","metrics_port":9320}'
