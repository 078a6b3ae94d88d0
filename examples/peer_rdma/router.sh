#!/usr/bin/env bash
# Step 4: round-robin router on node 1 (spreads shared prefixes over nodes on purpose).
set -euo pipefail
: "${NODE1_IP:?source examples/peer_rdma/env.sh first}"
exec python -m sglang_router.launch_server \
  --worker-urls "http://$NODE1_IP:30000" "http://$NODE2_IP:30000" "http://$NODE3_IP:30000" "http://$NODE4_IP:30000" \
  --host 0.0.0.0 --port 8000 \
  --policy round_robin
