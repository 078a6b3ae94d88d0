#!/usr/bin/env bash
# Step 6: the pool counters of every node.
set -euo pipefail
: "${NODE1_IP:?source examples/peer_rdma/env.sh first}"
for ip in "$NODE1_IP" "$NODE2_IP" "$NODE3_IP" "$NODE4_IP"; do
  echo "== $ip =="
  curl -s "http://$ip:31997/metrics" | grep -E \
    '^kvconnect_peer_(members|write_requests_total|read_requests_total|read_hits_total|read_remote_hits_total|bytes_read_total|pool_keys|read_timeouts_total|read_failures_total|read_stale_total)\b'
done
