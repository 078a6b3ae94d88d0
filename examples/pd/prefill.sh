#!/usr/bin/env bash
# Terminal 1: the prefill server of the PD deployment guide's 1P1D setup, with kvconnect
# as the PD transfer backend. GPU 0. The model, the transport (KVCONNECT_PD_CONFIG) and the
# arguments both servers share are in server.sh next to this script.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/server.sh"
launch_server \
  --port 30000 \
  --base-gpu-id 0 \
  --disaggregation-mode prefill \
  --disaggregation-bootstrap-port 8998
