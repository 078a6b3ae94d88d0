#!/usr/bin/env bash
# Step 1 (metadata node): the durable HF3FS metadata service.
# Replaces `python3 -m sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server`.
#   META_HOST  address the engines reach this node on (default: this node's first address;
#              never 0.0.0.0 unless you mean it)
#   META_DIR   journal + snapshots (default /var/lib/kvconnect/hf3fs-meta)
#   TOKEN_FILE shared secret, same file content on every node (default /etc/kvconnect/hf3fs.token)
# Engines reach it on two ports: 18000 (gRPC: setup, fallback) and 18001 (framed TCP: the fast path
# clients prefer; without it they fall back to gRPC). Open both between the nodes.
set -euo pipefail
META_HOST="${META_HOST:-$(hostname -I | awk '{print $1}')}"
META_DIR="${META_DIR:-/var/lib/kvconnect/hf3fs-meta}"
TOKEN_FILE="${TOKEN_FILE:-/etc/kvconnect/hf3fs.token}"
if [[ ! -s "$TOKEN_FILE" ]]; then
    mkdir -p "$(dirname "$TOKEN_FILE")"
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN_FILE"
    chmod 600 "$TOKEN_FILE"
    echo "created $TOKEN_FILE: copy it to every engine node" >&2
fi
mkdir -p "$META_DIR"
exec kvconnect hf3fs-meta serve --host "$META_HOST" --port 18000 --tcp-port 18001 --data-dir "$META_DIR" \
    --token-file "$TOKEN_FILE" >>meta.out 2>&1
