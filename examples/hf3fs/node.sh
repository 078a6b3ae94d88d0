#!/usr/bin/env bash
# Step 2 (node1 and node2, identical): SGLang with kvconnect's hf3fs store as HiCache L3.
# The HF3FS JSON is SGLang's own file (hf3fs_config.json next to this script: same keys,
# plus auth_token_file); SGLANG_HICACHE_HF3FS_CONFIG_PATH points at it as before.
#   MODEL   model path (default /code/models/Qwen3-32B/)
#   TP      tensor parallel size (default 2)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL="${MODEL:-/code/models/Qwen3-32B/}"
TP="${TP:-2}"
export SGLANG_HICACHE_HF3FS_CONFIG_PATH="${SGLANG_HICACHE_HF3FS_CONFIG_PATH:-$HERE/hf3fs_config.json}"
# usrbio (3FS mounts only): the hf3fs_py_usrbio library path, as in SGLang's guide
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/lib/python3.12/dist-packages"
EXTRA='{"backend_name":"kvconnect","module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage","interface_v1":1,"store":"hf3fs"}'
rm -f instance.out
nohup python3 -m sglang.launch_server \
    --model-path "$MODEL" \
    --host 0.0.0.0 --port 10000 \
    --page-size 64 \
    --enable-hierarchical-cache \
    --hicache-ratio 2 --hicache-size 0 \
    --hicache-write-policy write_through \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config "$EXTRA" \
    --tp "$TP" >instance.out 2>&1 &
echo "sglang (pid $!) logging to instance.out"
