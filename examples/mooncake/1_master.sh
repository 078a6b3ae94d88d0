#!/usr/bin/env bash
# Terminal 1: the Mooncake master (metadata only; the data lives in store segments).
# As in the Mooncake Store deployment guide: embedded HTTP metadata server on 8080, eviction at 95 % full.
# RPC (50051) and metrics (9003) bind 127.0.0.1; the embedded HTTP metadata server binds
# 0.0.0.0 whatever it is told (Mooncake 0.3.13): keep it behind a firewall / in a netns.
set -euo pipefail
exec mooncake_master \
  --rpc_address=127.0.0.1 --rpc_port=50051 \
  --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 --http_metadata_server_port=8080 \
  --metrics_host=127.0.0.1 --metrics_port=9003 \
  --eviction_high_watermark_ratio=0.95
