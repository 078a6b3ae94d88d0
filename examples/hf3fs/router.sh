#!/usr/bin/env bash
# Step 3 (router node): unchanged from SGLang's guide; the engines share KV through 3FS.
set -euo pipefail
NODE1="${NODE1:-node1}"
NODE2="${NODE2:-node2}"
rm -f router.out
nohup python -m sglang_router.launch_router --worker-urls "http://$NODE1:10000" "http://$NODE2:10000" \
    >router.out 2>&1 &
echo "router (pid $!) logging to router.out"
