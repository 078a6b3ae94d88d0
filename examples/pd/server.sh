# shellcheck shell=bash
# Sourced by prefill.sh and decode.sh: the environment and the sglang.launch_server
# arguments both servers share. Pick the transport with KVCONNECT_PD_CONFIG (a JSON text
# or a file; see direct.json, relay_mooncake.json, relay_hf3fs.json next to this script).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export KVCONNECT_PD_CONFIG="${KVCONNECT_PD_CONFIG:-$HERE/direct.json}"
export SGLANG_HOST_IP="${SGLANG_HOST_IP:-127.0.0.1}"
MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"

# launch_server ARGS...: the shared arguments, then the server's own (port, GPU, role)
launch_server() {
  exec python -m sglang.launch_server \
    --model-path "$MODEL" \
    --host 127.0.0.1 \
    --tp 1 \
    --context-length 8192 \
    --max-total-tokens 32768 \
    --disaggregation-transfer-backend kvconnect \
    "$@"
}
