#!/usr/bin/env bash
# Terminal 3: the PD router. It tags each request with bootstrap_host/port/room and sends it
# to both servers; clients (the guides' bench_serving) use --base-url http://127.0.0.1:8000.
set -euo pipefail
exec python -m sglang_router.launch_router \
  --pd-disaggregation \
  --prefill http://127.0.0.1:30000 8998 \
  --decode http://127.0.0.1:30001 \
  --host 127.0.0.1 \
  --port 8000
