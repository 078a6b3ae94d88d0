#!/bin/bash
# A real SGLang server (0.5.17, the H200 image) with HiCache L3 = kvconnect's KVConnectStorage.
#
# Runs ON the lent H200, from the repository root, with the recipe of ../shared/gpu/sglang_on_h200.md
# carried as .gpu/ (client + wheels). Phases:
#   diag                  GPU memory in use, whether the wheels are installed
#   install1 / install2   pip install .gpuwheels1 / .gpuwheels2 into /tmp/site1 / /tmp/site2 (once per machine)
#   v1       launch with {"store":"memory","interface_v1":1} (page_first host layout): zero-copy path
#   legacy   launch without interface_v1 and with --hicache-mem-layout layer_first: legacy tensor path
#   stop     stop the server
#   require  stop here unless install1 and install2 already ran on this machine
# Each launch phase: cold prompt, GPU hit, wait until kvconnect stored the pages (its Prometheus
# counters), POST /flush_cache (drops GPU and host copies), then the same prompt again: its KV must
# come from L3 (cached_tokens_details.storage) and its output token must equal the cold one (dummy
# weights: wrong KV bytes change the logits). Results: $OUT/results.jsonl, $OUT/server_*.log.
set -u
T0=$(date +%s)
REPO=$(pwd)
G=$REPO/.gpu
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
LOGD=/tmp/kvclogs; mkdir -p "$LOGD"
RES=$OUTD/results.jsonl
MODEL=/tmp/llama8b-dummy
PORT=30100
MPORT=9400
export SGL_URL=http://127.0.0.1:$PORT

export PYTHONPATH=$REPO:/tmp/site2:/tmp/site1:$G
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export TVM_FFI_CACHE_DIR=/tmp/jitcache/tvm-ffi TRITON_CACHE_DIR=/tmp/jitcache/triton FLASHINFER_WORKSPACE_BASE=/tmp/jitcache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
command -v nvcc >/dev/null 2>&1 || export PATH=$PATH:/usr/local/cuda/bin
[ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1 && export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")

say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
CLI() { python3 "$G/hicache_client.py" "$@" --out "$RES"; }

COMMON=(--model-path "$MODEL" --load-format dummy --skip-tokenizer-init --host 127.0.0.1 --port "$PORT"
  --page-size 64 --enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through
  --mem-fraction-static 0.6 --max-total-tokens 32768 --disable-cuda-graph --enable-metrics
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --log-level info)
BASECFG='"backend_name":"kvconnect","module_path":"connectors.engines.sglang_hicache","class_name":"KVConnectStorage","store":"memory","capacity":"4gb","metrics_port":'$MPORT

make_model() {
  mkdir -p "$MODEL"
  cat > "$MODEL/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
 "max_position_embeddings": 16384, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
 "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": false, "attention_bias": false,
 "mlp_bias": false, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": true}
EOF
}

pipi() {
  local t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl 2>&1 \
    | grep -v -E "WARNING: Target directory|already exists" | tail -5
  say "installed $(ls "$1"/*.whl | wc -l) wheels from $1 into $2 in $(( $(date +%s) - t ))s"
}

launch() {  # name, extra args...
  local name=$1; shift
  make_model
  say "launch $name: $*"
  python3 -c 'import os, sys
try:
    os.setsid()
except OSError:
    pass
os.execvp(sys.argv[1], sys.argv[1:])' python3 -m sglang.launch_server "${COMMON[@]}" "$@" > "$LOGD/$name.log" 2>&1 < /dev/null &
  echo $! > "$LOGD/$name.pid"; echo "$name" > "$LOGD/current"
}

stop_server() {
  [ -f "$LOGD/current" ] || return 0
  local name pid; name=$(cat "$LOGD/current"); pid=$(cat "$LOGD/$name.pid")
  say "stopping $name (pgid $pid)"
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null; sleep 2
  cp "$LOGD/$name.log" "$OUTD/server_$name.log" 2>/dev/null
  rm -f "$LOGD/current"
}

counter() {  # prometheus counter name -> value (0 if absent)
  python3 - "$1" <<EOF
import re, sys, urllib.request
try:
    text = urllib.request.urlopen("http://127.0.0.1:$MPORT/metrics", timeout=5).read().decode()
except Exception:
    print(0); sys.exit()
vals = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(sys.argv[1] + "{")]
print(int(sum(vals)))
EOF
}

check() {  # name: compare the cold and the L3-hit generations
  python3 - "$RES" "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"gen"' in l]
rows = {r["label"]: r for r in rows if r.get("label", "").startswith(sys.argv[2] + "_")}
cold, l3 = rows.get(sys.argv[2] + "_1_cold"), rows.get(sys.argv[2] + "_3_after_flush")
det = (l3 or {}).get("meta", {}).get("cached_tokens_details") or {}
ok = bool(cold and l3 and cold.get("output_ids") and cold["output_ids"] == l3.get("output_ids")
          and (det.get("storage") or 0) > 0)
print(json.dumps({"event": "check", "phase": sys.argv[2], "ok": ok, "cold_output": (cold or {}).get("output_ids"),
                  "l3_output": (l3 or {}).get("output_ids"), "l3_cached": det,
                  "cold_s": (cold or {}).get("meta", {}).get("e2e_latency"),
                  "l3_s": (l3 or {}).get("meta", {}).get("e2e_latency")}))
EOF
}

run_phase() {  # name, extra-config, extra launch args...
  local name=$1 cfg=$2; shift 2
  stop_server
  launch "$name" --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "$cfg" "$@"
  if ! CLI wait --timeout 400 --pid "$(cat "$LOGD/$name.pid")"; then
    say "server $name NOT ready"; tail -n 60 "$LOGD/$name.log" | cut -c1-400; cp "$LOGD/$name.log" "$OUTD/server_$name.log"; return 1
  fi
  say "server $name ready"; grep -E "kvconnect|KVConnect|Traceback" "$LOGD/$name.log" | cut -c1-300 | head -20
  CLI gen --label "${name}_1_cold"
  CLI gen --label "${name}_2_gpu_hit"
  for _ in $(seq 1 60); do [ "$(counter kvconnect_put_written_total)" -ge 127 ] && break; sleep 0.5; done
  say "kvconnect pages stored: $(counter kvconnect_put_written_total), bytes: $(counter kvconnect_put_bytes_total)"
  CLI flush; sleep 1
  CLI gen --label "${name}_3_after_flush"
  CLI gen --label "${name}_4_after_flush_again"
  say "kvconnect pages read: $(counter kvconnect_get_hits_total), bytes: $(counter kvconnect_get_bytes_total), errors: $(counter kvconnect_errors_total)"
  check "$name" | tee -a "$RES"
  grep -n -i -E "kvconnect|storage backend|Traceback|Error" "$LOGD/$name.log" | grep -v -i deprecat | cut -c1-300 | tail -15
  cp "$LOGD/$name.log" "$OUTD/server_$name.log"
}

for ph in "$@"; do
  say "=== phase $ph"
  case $ph in
    install1) if [ -d /tmp/site1/sglang ]; then say "/tmp/site1 already installed"; else pipi .gpuwheels1 /tmp/site1; fi ;;
    install2) if [ -d /tmp/site2/xgrammar ]; then say "/tmp/site2 already installed"; else pipi .gpuwheels2 /tmp/site2; fi ;;
    diag) nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; ls -d /tmp/site1/sglang /tmp/site2/xgrammar 2>&1
          python3 -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1 ;;
    v1) run_phase v1 "{$BASECFG,\"interface_v1\":1}" --hicache-mem-layout page_first ;;
    legacy) run_phase legacy "{$BASECFG}" --hicache-mem-layout layer_first ;;
    stop) stop_server ;;
    require) if [ ! -d /tmp/site1/sglang ] || [ ! -d /tmp/site2/xgrammar ]; then say "wheels not installed: run install1, install2 first"; exit 3; fi ;;
  esac
done
say "end"
