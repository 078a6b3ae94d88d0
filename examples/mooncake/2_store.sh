#!/usr/bin/env bash
# Terminal 2: the standalone store: holds 4 GB of pages so they outlive engine restarts.
# Same MOONCAKE_* variables as the Mooncake Store deployment guide's `python -m mooncake.mooncake_store_service`;
# kvconnect reads them, so one configuration serves the store and every engine.
set -euo pipefail
export MOONCAKE_LOCAL_HOSTNAME="${MOONCAKE_LOCAL_HOSTNAME:-localhost}"
export MOONCAKE_TE_META_DATA_SERVER="${MOONCAKE_TE_META_DATA_SERVER:-http://127.0.0.1:8080/metadata}"
export MOONCAKE_MASTER="${MOONCAKE_MASTER:-127.0.0.1:50051}"
export MOONCAKE_PROTOCOL="${MOONCAKE_PROTOCOL:-tcp}"
export MOONCAKE_GLOBAL_SEGMENT_SIZE="${MOONCAKE_GLOBAL_SEGMENT_SIZE:-4gb}"
export MOONCAKE_LOCAL_BUFFER_SIZE="${MOONCAKE_LOCAL_BUFFER_SIZE:-0}"
# Engines on this host copy pages straight from the store's memory when it is lent from /dev/shm
# (needs MOONCAKE_GLOBAL_SEGMENT_SIZE free there; SHARED_SEGMENT=false: every page over the Transfer Engine)
exec kvconnect mooncake-store --metrics-port 9310 -o shared_segment="${SHARED_SEGMENT:-true}"
