#!/usr/bin/env bash
# Terminal 2: the decode server (GPU 1). Same KVCONNECT_PD_CONFIG transport as prefill
# (server.sh next to this script).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/server.sh"
launch_server \
  --port 30001 \
  --base-gpu-id 1 \
  --disaggregation-mode decode
