#!/usr/bin/env bash
# Terminal 1 (only for STORE=hf3fs shared by several LMCache servers or nodes): the HF3FS
# metadata service, the page index every server shares. Binds 127.0.0.1; on several nodes
# set META_HOST to this node's address (never 0.0.0.0 unless you mean it).
#   META_DIR   journal + snapshots (default ./hf3fs-meta)
#   TOKEN_FILE shared secret (created if missing; copy it to every server node)
set -euo pipefail
META_HOST="${META_HOST:-127.0.0.1}"
META_DIR="${META_DIR:-$PWD/hf3fs-meta}"
TOKEN_FILE="${TOKEN_FILE:-$PWD/hf3fs.token}"
if [[ ! -s "$TOKEN_FILE" ]]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TOKEN_FILE"
    chmod 600 "$TOKEN_FILE"
fi
mkdir -p "$META_DIR"
exec kvconnect hf3fs-meta serve --host "$META_HOST" --port 18000 --data-dir "$META_DIR" --token-file "$TOKEN_FILE"
