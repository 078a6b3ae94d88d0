#!/bin/bash
# GPU end-to-end TTFT of SGLang HiCache with kvconnect stores vs SGLang's own L3 backends.
# Runs on a GPU node (one GPU; two of one host for pd:*); benchmarks/gpu/README.md is the runbook.
#   bash benchmarks/gpu/run_e2e.sh PHASE...        (phases run in the order given; -h: this text)
# PHASE: diag | install1 | install2 | install3 (Mooncake) | install4 (CUDA Mooncake + the PD plugin's entry
#        point, for pd:*) | install5 (LMCache, for lmcache_*) | stop | ARCH:STORE | ARCH:restart_STORE |
#        ARCH:cross_STORE | pd:TRANSPORT
#   install1-4 install from a bundle of files (no network): install1 pip-installs $SGLANG_WHEELS/*.whl into
#   $GPU_TMP/site1; install2 $SGLANG_WHEELS2/*.whl into site2 or, without that folder, unpacks $SITE2_TAR
#   (prepare_serving.sh's bundle); install3 unpacks $MOONCAKE_TAR into site3, install4 $MOONCAKE_CUDA_TAR,
#   install5 $LMCACHE_TAR into site4 (first on PYTHONPATH) and records whether LMCache's CUDA ops load; where
#   they do not and $LMCACHE_SDIST is there, it builds them against the node's torch (build_lmcache_cuda_ops.py).
#   Where SGLang and Mooncake are installed already, skip them: the store phases need only `python3 -m sglang`.
#   ARCH  qwen3 (Qwen3-32B shape) | llama (Llama-3-8B shape)
#   STORE file (SGLang built-in, reference) | hf3fsref (SGLang built-in hf3fs, mock client, reference)
#         kvc_hf3fs (kvconnect HF3FS store, POSIX client) | kvc_memory (kvconnect in-process store)
#         kvc_mooncake_local (as kvc_mooncake, but each SGLang server also lends KVC_PEER_SEGMENT and keeps
#           its own pages there: prefer_local_segment; read back with local_copy)
#         kvc_memory_legacy (in-process store through SGLang's legacy tensor interface, layer_first pool)
#         kvc_mooncake_shm (as kvc_mooncake, but the store process lends its segment from /dev/shm
#           (shared_segment) and SGLang copies pages from it instead of a Transfer Engine transfer)
#         kvc_mooncake (kvconnect Mooncake store: mooncake_master + a standalone `kvconnect mooncake-store`
#           lending the memory, SGLang lends none) | kvc_peer_rdma (kvconnect peer pool: each SGLang
#           server lends its own memory, as in the peer-pool deployment guide, plus a memory-only `kvconnect peer serve`
#           seed node; Transfer Engine over TCP)
#         lmcache_kvc_hf3fs | lmcache_fs: SGLang --enable-lmcache (no HiCache) in front of a standalone `lmcache server`
#           (the LMCache deployment guide: MP mode, L1 of LMC_L1_GB in its memory) whose L2 is kvconnect's plugin over
#           the hf3fs store + metadata service, or LMCache's own `fs` adapter; the flush step's hit is then LMCache's L1
#           and restart_lmcache_* restarts SGLang AND the lmcache server (an empty L1), so its hits come from the L2
#   restart_STORE: stop the server, launch it again, replay the prompts measured before (durable L3 hit); for
#                  lmcache_* two cold prompts go first (the first request after a start pays one-time costs)
#   cross_STORE:   two servers (ports 30000/30001) sharing one store; prompts prefilled on A, read on B
#   pd:TRANSPORT   prefill server on GPU 0, decode server on GPU 1 (Llama-3-8B shape), pd_driver.py routes 8k-token
#                  prompts at PD_LEVELS (default 1,8,32) concurrent requests; TRANSPORT mooncake_ref (SGLang's own
#                  mooncake backend, Transfer Engine over TCP: MC_FORCE_TCP=1) | kvc_peer_rdma | kvc_mooncake
#                  (kvconnect backend, KVCONNECT_PD_CONFIG transport direct over TCP / relay through the mooncake store)
# Env: DEADLINE_S (default 570, from script start), PLAN (default w8192,8192,16384),
#      HICACHE_LAYOUT (--hicache-mem-layout for every server; default: SGLang's),
#      KVC_MC_SEGMENT (default 40gb), LMC_L1_GB (default 8), LMC_ARGS (more `lmcache server` options), KVC_PEER_SEGMENT (per SGLang server, default 24gb), KVC_JOBS, KVC_ENTRIES,
#      OUT (default /tmp/out: results.jsonl, diag.txt, logs.tgz, jitcache.tgz), GPU_TMP (default /tmp: where
#      site1-3, sglogs, l3, the model configs and jitcache go), PORT_OFFSET (default 0, added to every port),
#      SGLANG_SERVER_MODULE (default sglang.launch_server) -- the CPU tests run the script with a stand-in
#      server, a scratch GPU_TMP and free ports.
#      The bundle: BUNDLE_DIR (default: the current folder), SGLANG_WHEELS ($BUNDLE_DIR/.gpuwheels1),
#      SGLANG_WHEELS2 ($BUNDLE_DIR/.gpuwheels2), SITE2_TAR ($BUNDLE_DIR/.gpuserve2/site2.tar.xz), MOONCAKE_TAR
#      ($BUNDLE_DIR/.gpumc/mc312.tar.xz), MOONCAKE_CUDA_TAR ($BUNDLE_DIR/.gpumccuda/mccuda312.tar.xz),
#      LMCACHE_TAR ($BUNDLE_DIR/.gpulmc/site4.tar.xz), LMCACHE_SDIST ($BUNDLE_DIR/.gpulmcsrc/lmcache-0.5.6.tar.gz),
#      JIT_CACHE ($BUNDLE_DIR/.gpujitcache/jitcache.tgz, optional: an earlier run's $OUT/jitcache.tgz).
#      MOONCAKE_MASTER (default: install3's, else mooncake_master on PATH).
#      The kvconnect it runs is this script's checkout (on PYTHONPATH).
set -u
T0=$(date +%s)
case "${1:-}" in -h|--help|"") sed -n '2,/^set -u$/p' "$0" | sed '$d' | cut -c3-; [ -n "${1:-}" ]; exit $? ;; esac
DEADLINE_S=${DEADLINE_S:-570}
REPO=$(cd "$(dirname "$0")/../.." && pwd)   # the checkout this script is in: its kvconnect is the one run
B=$(cd "$(dirname "$0")" && pwd)    # the drivers, next to this script
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
TMPD=${GPU_TMP:-/tmp}
LOGD=$TMPD/sglogs; mkdir -p "$LOGD"
L3=$TMPD/l3
SGLANG_SERVER=${SGLANG_SERVER_MODULE:-sglang.launch_server}
PO=${PORT_OFFSET:-0}
P_SRV=$((30000 + PO)) P_MET=$((9400 + PO)) P_META=$((18000 + PO)) P_MC=$((50051 + PO)) P_MCM=$((9003 + PO))
P_MCS=$((9310 + PO)) P_PEER=$((31998 + PO)) P_BOOT=$((8998 + PO)) P_LMC=$((5556 + PO)) P_LMH=$((9480 + PO))
RES=$OUTD/results.jsonl
PLAN=${PLAN:-w8192,8192,16384}
# shellcheck source=benchmarks/gpu/bundle.sh
. "$B/bundle.sh"   # the bundle's paths, the environment (site1-4 on PYTHONPATH), the install steps
export SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=$L3/file

el() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(el)s] $*"; }
left() { echo $(( DEADLINE_S - $(el) )); }
need() { if [ "$(left)" -lt "$1" ]; then say "SKIP $2: only $(left)s left (< $1)"; echo "{\"event\":\"skip\",\"phase\":\"$2\",\"t\":$(el)}" >> "$RES"; return 1; fi; }
done_mark() { echo "$1" >> "$LOGD/phases_done"; }
is_done() { grep -qxF "$1" "$LOGD/phases_done" 2>/dev/null; }

model_dir() { echo "$TMPD/model-$1"; }
make_model() {  # arch
  local m; m=$(model_dir "$1"); mkdir -p "$m"
  if [ "$1" = qwen3 ]; then
    cat > "$m/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600,
 "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
 "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null, "vocab_size": 151936,
 "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": false, "attention_bias": false,
 "attention_dropout": 0.0, "initializer_range": 0.02, "max_window_layers": 64, "sliding_window": null,
 "use_sliding_window": false, "torch_dtype": "bfloat16", "use_cache": true}
JSON
  else
    cat > "$m/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
 "max_position_embeddings": 40960, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
 "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": false, "attention_bias": false,
 "mlp_bias": false, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": true}
JSON
  fi
}
# bytes of one page's K (or V) object: layers * 64 tokens * 8 kv heads * 128 dims * 2 bytes
kv_half_page_bytes() { if [ "$1" = qwen3 ]; then echo $((64*64*8*128*2)); else echo $((32*64*8*128*2)); fi; }

# -- the stores ------------------------------------------------------------------------------------------
KVC_BASE='"backend_name":"kvconnect","module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage"'
KVC="$KVC_BASE,\"interface_v1\":1"   # SGLang's zero-copy v1 batch interface
store_args() {  # store, port-suffix -> prints backend args (one per line)
  local s=$1 k=${2:-0}
  case $s in
    file) printf '%s\n' --hicache-storage-backend file --hicache-storage-backend-extra-config "{\"file_storage_path\":\"$L3/file\"}" ;;
    hf3fsref)
      mkdir -p "$L3/hf3fsref"
      echo "{\"file_path_prefix\":\"$L3/hf3fsref/hicache\",\"file_size\":34359738368,\"numjobs\":16,\"entries\":8}" > "$L3/hf3fsref.json"
      printf '%s\n' --hicache-storage-backend hf3fs --hicache-storage-backend-extra-config '{"use_mock_hf3fs_client":true}' ;;
    kvc_hf3fs)
      mkdir -p "$L3/kvc"
      local meta=""; [ -f "$LOGD/meta.pid" ] && meta=",\"metadata_server_url\":\"http://127.0.0.1:$P_META\""
      printf '%s\n' --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC,\"store\":\"hf3fs\",\"file_path_prefix\":\"$L3/kvc/hicache\",\"file_size\":\"32gb\",\"numjobs\":${KVC_JOBS:-16},\"entries\":${KVC_ENTRIES:-16}$meta,\"metrics_port\":$((P_MET+k))}" ;;
    kvc_mooncake|kvc_mooncake_shm)
      printf '%s\n' --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC,\"store\":\"mooncake\",\"master_server_address\":\"127.0.0.1:$P_MC\",\"protocol\":\"tcp\",\"local_hostname\":\"127.0.0.1\",\"global_segment_size\":0,\"metrics_port\":$((P_MET+k))}" ;;
    kvc_mooncake_local)  # SGLang lends memory too and keeps its own pages there (prefer_local_segment)
      printf '%s\n' --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC,\"store\":\"mooncake\",\"master_server_address\":\"127.0.0.1:$P_MC\",\"protocol\":\"tcp\",\"local_hostname\":\"127.0.0.1\",\"global_segment_size\":\"${KVC_PEER_SEGMENT:-24gb}\",\"prefer_local_segment\":true,\"metrics_port\":$((P_MET+k))}" ;;
    kvc_peer_rdma)
      printf '%s\n' --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC,\"store\":\"peer_rdma\",\"discovery_addr\":\"127.0.0.1:$P_PEER\",\"protocol\":\"tcp\",\"local_hostname\":\"127.0.0.1\",\"control_port\":0,\"global_segment_size\":\"${KVC_PEER_SEGMENT:-24gb}\",\"metrics_port\":$((P_MET+k))}" ;;
    kvc_memory)
      printf '%s\n' --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC,\"store\":\"memory\",\"capacity\":\"40gb\",\"metrics_port\":$((P_MET+k))}" ;;
    kvc_memory_legacy)  # SGLang's legacy (tensor) interface, layer-first host pool: the adapter's other path
      printf '%s\n' --hicache-mem-layout layer_first --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
        "{$KVC_BASE,\"store\":\"memory\",\"capacity\":\"40gb\",\"metrics_port\":$((P_MET+k))}" ;;
    lmcache_kvc_hf3fs|lmcache_fs) ;;   # no HiCache backend: launch gives --enable-lmcache instead
    *) say "unknown store $s"; return 1 ;;
  esac
}
store_wait() {  # arch store port-suffix -> driver wait args
  case $2 in
    file) echo "--wait files:$L3/file" ;;
    hf3fsref) echo "--wait blocks:$L3/hf3fsref/hicache* --page-bytes $(kv_half_page_bytes "$1") --objects-per-page 2" ;;
    kvc_*) echo "--wait metrics:http://127.0.0.1:$((P_MET+${3:-0}))/metrics --metrics http://127.0.0.1:$((P_MET+${3:-0}))/metrics" ;;
    # LMCache stores 256-token chunks, each one object of its L2
    lmcache_kvc_hf3fs) echo "--wait metrics:http://127.0.0.1:$P_MET/metrics --metrics http://127.0.0.1:$P_MET/metrics --tokens-per-object 256 --lmcache-log $LOGD/lmcache.log" ;;
    lmcache_fs) echo "--wait tree:$L3/lmc_fs --tokens-per-object 256 --lmcache-log $LOGD/lmcache.log" ;;
  esac
}

# -- servers ---------------------------------------------------------------------------------------------
launch() {  # name arch port store [suffix]
  local name=$1 arch=$2 port=$3 store=$4 k=${5:-0}
  make_model "$arch"; load_jitcache
  local memfrac=0.85 maxtok=65536
  [ "$arch" = llama ] && { memfrac=0.4; maxtok=65536; }
  local args=(); mapfile -t args < <(store_args "$store" "$k")
  local cache=(--enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through)
  case $store in
    lmcache_*) cache=(--enable-lmcache --lmcache-config-file "$L3/lmcache_mp.yaml") ;;
    *) [ -n "${HICACHE_LAYOUT:-}" ] && args=(--hicache-mem-layout "$HICACHE_LAYOUT" "${args[@]}") ;;
  esac
  local env=()
  [ "$store" = hf3fsref ] && env=("SGLANG_HICACHE_HF3FS_CONFIG_PATH=$L3/hf3fsref.json")
  say "launch $name: $arch store=$store port=$port"
  echo "{\"event\":\"launch\",\"name\":\"$name\",\"arch\":\"$arch\",\"store\":\"$store\",\"t\":$(el),\"wall\":$(date +%s)}" >> "$RES"
  env "${env[@]}" python3 -c 'import os, sys
try: os.setsid()
except OSError: pass
os.execvp(sys.argv[1], sys.argv[1:])' python3 -m "$SGLANG_SERVER" --model-path "$(model_dir "$arch")" --load-format dummy \
    --skip-tokenizer-init --host 127.0.0.1 --port "$port" --page-size 64 "${cache[@]}" \
    --mem-fraction-static "$memfrac" --max-total-tokens "$maxtok" --disable-cuda-graph \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none --log-level info \
    "${args[@]}" > "$LOGD/$name.log" 2>&1 < /dev/null &
  echo $! > "$LOGD/$name.pid"; echo "$name" >> "$LOGD/running"
}
wait_up() {  # name port timeout: until the server answers GET /health with 200 (or its process is gone)
  local t; t=$(date +%s)
  if python3 - "http://127.0.0.1:$2/health" "$3" "$(cat "$LOGD/$1.pid")" "$RES" <<'PY'
import json, sys, time, urllib.request
url, timeout, pid, res = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
t0, ok = time.time(), False
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
while not ok and time.time() - t0 < timeout and alive():
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            ok = r.status == 200
    except Exception:  # not listening yet, or 503 while it starts
        pass
    if not ok:
        time.sleep(0.5)
with open(res, "a") as f:
    f.write(json.dumps({"event": "wait", "ok": ok, "after_s": round(time.time() - t0, 1)}) + "\n")
sys.exit(0 if ok else 1)
PY
  then
    say "server $1 ready after $(( $(date +%s) - t ))s"; return 0
  fi
  say "server $1 NOT ready; log tail:"; tail -n 40 "$LOGD/$1.log" | cut -c1-300; return 1
}
stop_all() {
  [ -f "$LOGD/running" ] || return 0
  for name in $(cat "$LOGD/running"); do
    local pid; pid=$(cat "$LOGD/$name.pid")
    kill -TERM -- "-$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null
  done
  rm -f "$LOGD/running"; sleep 2
}
meta_start() {
  [ -f "$LOGD/meta.pid" ] && return 0
  mkdir -p "$L3/meta"
  python3 -c 'import os, sys
os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' python3 -m kvconnect hf3fs-meta serve --host 127.0.0.1 --port "$P_META" \
    --data-dir "$L3/meta" > "$LOGD/meta.log" 2>&1 < /dev/null &
  echo $! > "$LOGD/meta.pid"; sleep 3; say "metadata service pid $(cat "$LOGD/meta.pid")"
}
svc_start() {  # name cmd...: a detached service process, logs in $LOGD/name.log
  local name=$1; shift
  python3 -c 'import os, sys
os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@" >> "$LOGD/$name.log" 2>&1 < /dev/null &   # a restart appends
  echo $! > "$LOGD/svc_$name.pid"
}
svc_stop_all() {
  local f; for f in "$LOGD"/svc_*.pid; do [ -f "$f" ] || continue; kill -- "-$(cat "$f")" 2>/dev/null; rm -f "$f"; done
  sleep 1
}
wait_port() { python3 - "$1" "$2" <<'PY'
import socket, sys, time
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 0.5).close(); sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
PY
}
store_services() {  # store: start what the store needs next to SGLang (all on 127.0.0.1)
  case $1 in
    kvc_hf3fs) meta_start ;;
    kvc_mooncake|kvc_mooncake_local|kvc_mooncake_shm)
      local shared=false; [ "$1" = kvc_mooncake_shm ] && shared=true
      if [ -f "$LOGD/svc_mc_master.pid" ]; then
        [ "$(cat "$LOGD/mc_store.shared" 2>/dev/null)" = "$shared" ] && return 0
        svc_stop_all  # the running store lends its segment the other way: start both afresh
      fi
      echo "$shared" > "$LOGD/mc_store.shared"
      local master=${MOONCAKE_MASTER:-$TMPD/site3/mooncake/mooncake_master}
      [ -x "$master" ] || master=$(command -v mooncake_master || echo "$master")   # a pip-installed Mooncake
      svc_start mc_master "$master" --rpc_address=127.0.0.1 --rpc_port="$P_MC" \
        --metrics_host=127.0.0.1 --metrics_port="$P_MCM"
      wait_port "$P_MC" 20 || { say "mooncake_master did not start"; tail -5 "$LOGD/mc_master.log"; return 1; }
      svc_start mc_store python3 -m kvconnect mooncake-store --master "127.0.0.1:$P_MC" --segment "${KVC_MC_SEGMENT:-40gb}" \
        -o protocol=tcp -o local_hostname=127.0.0.1 -o shared_segment=$shared --metrics-port "$P_MCS"
      wait_port "$P_MCS" 60 || { say "mooncake-store did not start"; tail -5 "$LOGD/mc_store.log"; return 1; }
      say "mooncake_master + store (${KVC_MC_SEGMENT:-40gb}, shared_segment=$shared) up" ;;
    lmcache_kvc_hf3fs) meta_start && lmcache_start "$1" ;;
    lmcache_fs) lmcache_start "$1" ;;
    kvc_peer_rdma)
      [ -f "$LOGD/svc_peer_seed.pid" ] && return 0
      rm -f "$LOGD/peer.ready"
      svc_start peer_seed python3 -m kvconnect peer serve --discovery-addr "127.0.0.1:$P_PEER" --bind-host 127.0.0.1 \
        --local-hostname 127.0.0.1 --protocol tcp --global-segment-size 1gb --ready-file "$LOGD/peer.ready"
      for _ in $(seq 1 60); do [ -s "$LOGD/peer.ready" ] && break; sleep 0.5; done
      [ -s "$LOGD/peer.ready" ] || { say "peer seed did not start"; tail -5 "$LOGD/peer_seed.log"; return 1; }
      say "peer seed node up" ;;
  esac
}
lmcache_adapter() {  # store -> the lmcache server's --l2-adapter JSON
  case $1 in
    lmcache_kvc_hf3fs) mkdir -p "$L3/lmc_kvc"
      echo "{\"type\":\"plugin\",\"module_path\":\"kvconnect.connectors.engines.lmcache_l2\",\"class_name\":\"KVConnectL2Adapter\",\"adapter_params\":{\"store\":\"hf3fs\",\"file_path_prefix\":\"$L3/lmc_kvc/lmcache\",\"file_size\":\"32gb\",\"numjobs\":${KVC_JOBS:-16},\"entries\":${KVC_ENTRIES:-16},\"metadata_server_url\":\"http://127.0.0.1:$P_META\",\"metrics_port\":$P_MET}}" ;;
    lmcache_fs) mkdir -p "$L3/lmc_fs"; echo "{\"type\":\"fs\",\"base_path\":\"$L3/lmc_fs\"}" ;;
  esac
}
lmcache_start() {  # store: a standalone `lmcache server` (127.0.0.1) with that L2, and SGLang's MP config for it
  [ -f "$LOGD/svc_lmcache.pid" ] && return 0
  printf 'mp_host: 127.0.0.1\nmp_port: %s\n' "$P_LMC" > "$L3/lmcache_mp.yaml"
  # shellcheck disable=SC2086
  svc_start lmcache python3 -m lmcache.cli.main server --host 127.0.0.1 --port "$P_LMC" --chunk-size 256 \
    --l1-size-gb "${LMC_L1_GB:-8}" --eviction-policy LRU --http-host 127.0.0.1 --http-port "$P_LMH" --disable-metrics \
    --l2-adapter "$(lmcache_adapter "$1")" ${LMC_ARGS:-}
  if python3 - "http://127.0.0.1:$P_LMH/status" 150 <<'PY'
import json, sys, time, urllib.request
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
            if json.load(r).get("is_healthy"):
                sys.exit(0)
    except Exception:  # not listening yet
        pass
    time.sleep(0.5)
sys.exit(1)
PY
  then say "lmcache server up ($1, L1 ${LMC_L1_GB:-8} GB)"; return 0; fi
  say "lmcache server did not become healthy"; tail -n 20 "$LOGD/lmcache.log" | cut -c1-300; return 1
}
lmcache_stop() { [ -f "$LOGD/svc_lmcache.pid" ] && kill -- "-$(cat "$LOGD/svc_lmcache.pid")" 2>/dev/null; rm -f "$LOGD/svc_lmcache.pid"; sleep 1; }
meta_stop() { [ -f "$LOGD/meta.pid" ] && kill -- "-$(cat "$LOGD/meta.pid")" 2>/dev/null; rm -f "$LOGD/meta.pid"; }

drive() {  # arch store tag port k extra...
  local arch=$1 store=$2 tag=$3 port=$4 k=$5; shift 5
  # shellcheck disable=SC2046
  python3 "$B/e2e_driver.py" run --url "http://127.0.0.1:$port" --out "$RES" --tag "$tag" --plan "$PLAN" \
    --deadline $(( T0 + DEADLINE_S - 20 )) $(store_wait "$arch" "$store" "$k") "$@"
}

# -- phases ----------------------------------------------------------------------------------------------
phase_diag() { { nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv; python3 -V; free -g | head -2; df -h /tmp | tail -1; nproc; } 2>&1 | tee "$OUTD/diag.txt"; }
phase_install1() { install_wheels "$TMPD/site1" "$SGLANG_WHEELS"; load_jitcache; }
phase_install2() {
  if [ -d "$SGLANG_WHEELS2" ] || [ ! -f "$SITE2_TAR" ]; then install_wheels "$TMPD/site2" "$SGLANG_WHEELS2"
  else unpack_site2; fi
  load_jitcache; date_back_sites; }
phase_install3() { install_mooncake "$MOONCAKE_TAR"; }  # the non-CUDA wheel (cp312)
phase_install4() {  # Mooncake CUDA build (registers GPU memory: PD) replaces install3's; kvconnect's PD plugin
  # is found through an entry point, so give the repository on PYTHONPATH a dist-info that declares it
  rm -rf "$TMPD/site3"
  export LD_LIBRARY_PATH=$TMPD/site3/ibv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}   # its libcudart and libmlx5 too
  install_mooncake "$MOONCAKE_CUDA_TAR" || return 1
  local d=$TMPD/site3/kvconnect-0.0.0+gpu.dist-info; mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: kvconnect\nVersion: 0.0.0+gpu\n' > "$d/METADATA"
  printf '[sglang.srt.plugins]\nkvconnect = kvconnect.connectors.engines.sglang_pd_plugin:register\n' > "$d/entry_points.txt"
  python3 -c 'from importlib.metadata import entry_points as e; assert "kvconnect" in [x.name for x in e(group="sglang.srt.plugins")]' \
    || { say "kvconnect entry point not found"; return 1; }
  say "declared kvconnect's sglang.srt.plugins entry point in $d"
}
phase_install5() { install_lmcache; }
phase_stop() { stop_all; meta_stop; svc_stop_all; }

launch_pd() {  # name mode gpu port backend: one PD half of the Llama-3-8B shape
  local name=$1 mode=$2 gpu=$3 port=$4 backend=$5
  make_model llama; load_jitcache
  say "launch $name: pd $mode on GPU $gpu, backend $backend, port $port"
  echo "{\"event\":\"launch\",\"name\":\"$name\",\"arch\":\"llama\",\"store\":\"pd_$backend\",\"t\":$(el),\"wall\":$(date +%s)}" >> "$RES"
  python3 -c 'import os, sys
try: os.setsid()
except OSError: pass
os.execvp(sys.argv[1], sys.argv[1:])' python3 -m "$SGLANG_SERVER" --model-path "$(model_dir llama)" --load-format dummy \
    --skip-tokenizer-init --host 127.0.0.1 --port "$port" --page-size 64 --base-gpu-id "$gpu" --mem-fraction-static 0.6 \
    --max-total-tokens 327680 --disable-cuda-graph --attention-backend triton --sampling-backend pytorch \
    --grammar-backend none --log-level info --disaggregation-mode "$mode" --disaggregation-transfer-backend "$backend" \
    --disaggregation-bootstrap-port "$P_BOOT" > "$LOGD/$name.log" 2>&1 < /dev/null &
  echo $! > "$LOGD/$name.pid"; echo "$name" >> "$LOGD/running"
}
run_pd() {  # transport
  local tr=$1 backend=kvconnect
  need 200 "pd:$tr" || return 1
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { say "pd:$tr needs two GPUs"; return 1; }
  stop_all; meta_stop; svc_stop_all
  case $tr in
    mooncake_ref) backend=mooncake; export MC_FORCE_TCP=1; unset KVCONNECT_PD_CONFIG ;;
    kvc_peer_rdma) unset MC_FORCE_TCP
      export KVCONNECT_PD_CONFIG='{"transport":"direct","protocol":"tcp","timeout_s":120,"workers":4}' ;;
    kvc_mooncake) unset MC_FORCE_TCP; store_services kvc_mooncake || return 1
      export KVCONNECT_PD_CONFIG='{"transport":"relay","timeout_s":120,"workers":4,"store":{"store":"mooncake","master_server_address":"127.0.0.1:'"$P_MC"'","metadata_server":"P2PHANDSHAKE","local_hostname":"127.0.0.1","protocol":"tcp","global_segment_size":0,"local_buffer_size":0}}' ;;
    *) say "unknown PD transport $tr"; return 1 ;;
  esac
  export SGLANG_HOST_IP=127.0.0.1
  launch_pd "pd_${tr}_prefill" prefill 0 "$P_SRV" "$backend"
  launch_pd "pd_${tr}_decode" decode 1 "$((P_SRV + 1))" "$backend"
  wait_up "pd_${tr}_prefill" "$P_SRV" "$(( $(left) - 90 ))" || return 1
  wait_up "pd_${tr}_decode" "$((P_SRV + 1))" "$(( $(left) - 60 ))" || return 1
  python3 "$B/pd_driver.py" --prefill "http://127.0.0.1:$P_SRV" --decode "http://127.0.0.1:$((P_SRV + 1))" --bootstrap-port "$P_BOOT" \
    --tokens 8192 --levels "${PD_LEVELS:-1,8,32}" --new-tokens 8 --timeout 150 --out "$RES" --tag "pd:$tr" \
    --deadline $(( T0 + DEADLINE_S - 40 )); local rc=$?
  stop_all; svc_stop_all; return $rc
}

run_store() {  # arch store
  local arch=$1 store=$2
  need 150 "$arch:$store" || return 1
  stop_all; meta_stop; svc_stop_all; rm -rf "$L3/file" "$L3/hf3fsref" "$L3/kvc" "$L3/meta" "$L3/lmc_kvc" "$L3/lmc_fs"
  mkdir -p "$L3/file"
  store_services "$store" || return 1   # they outlive the server: the restart phase finds the pages
  launch "${arch}_$store" "$arch" "$P_SRV" "$store" || return 1
  wait_up "${arch}_$store" "$P_SRV" "$(( $(left) - 60 ))" || return 1
  rm -f "$L3/prompts_${arch}_$store.jsonl"
  drive "$arch" "$store" "${arch}:${store}" "$P_SRV" 0 --record "$L3/prompts_${arch}_$store.jsonl"
}
run_restart() {  # arch store: relaunch with the store's data kept, replay recorded prompts
  local arch=$1 store=$2
  need 110 "$arch:restart_$store" || return 1
  stop_all
  local m="" label=L3_after_restart warm=0
  case $store in
    kvc_*) m="--metrics http://127.0.0.1:$P_MET/metrics" ;;
    lmcache_*)  # both restarted: LMCache's L1 starts empty, the prompts' chunks come from its L2
      lmcache_stop; store_services "$store" || return 1; label=L2_after_restart; warm=2 m="--lmcache-log $LOGD/lmcache.log"
      [ "$store" = lmcache_kvc_hf3fs ] && m="$m --metrics http://127.0.0.1:$P_MET/metrics" ;;
  esac
  launch "${arch}_${store}_restart" "$arch" "$P_SRV" "$store" || return 1
  wait_up "${arch}_${store}_restart" "$P_SRV" "$(( $(left) - 40 ))" || return 1
  # shellcheck disable=SC2086
  python3 "$B/e2e_driver.py" replay --url "http://127.0.0.1:$P_SRV" --out "$RES" --tag "${arch}:restart_${store}" \
    --ids-from "$L3/prompts_${arch}_$store.jsonl" --label "$label" --cold-first "$warm" \
    --deadline $(( T0 + DEADLINE_S - 15 )) $m
}
run_cross() {  # arch store: A prefills, B (another server process) hits through the shared store
  local arch=$1 store=$2
  need 200 "$arch:cross_$store" || return 1
  stop_all; meta_stop; svc_stop_all; rm -rf "$L3/kvc" "$L3/meta"; store_services "$store" || return 1
  launch "${arch}_${store}_A" "$arch" "$P_SRV" "$store" 0 || return 1
  launch "${arch}_${store}_B" "$arch" "$((P_SRV + 1))" "$store" 1 || return 1
  wait_up "${arch}_${store}_A" "$P_SRV" "$(( $(left) - 90 ))" || return 1
  wait_up "${arch}_${store}_B" "$((P_SRV + 1))" "$(( $(left) - 60 ))" || return 1
  rm -f "$L3/cross.jsonl"
  PLAN=$(echo "$PLAN" | sed 's/w[0-9]*,\?//') drive "$arch" "$store" "${arch}:cross_${store}_A" "$P_SRV" 0 --record "$L3/cross.jsonl"
  python3 "$B/e2e_driver.py" run --url "http://127.0.0.1:$((P_SRV + 1))" --out "$RES" --tag "${arch}:cross_${store}_Bwarm" --plan w4096 \
    --deadline $(( T0 + DEADLINE_S - 15 ))
  python3 "$B/e2e_driver.py" replay --url "http://127.0.0.1:$((P_SRV + 1))" --out "$RES" --tag "${arch}:cross_${store}_B" \
    --ids-from "$L3/cross.jsonl" --label L3_cross_instance --deadline $(( T0 + DEADLINE_S - 10 )) \
    --metrics "http://127.0.0.1:$((P_MET + 1))/metrics"
  stop_all; meta_stop; svc_stop_all
}

say "phases: $* (deadline ${DEADLINE_S}s, plan $PLAN)"
for ph in "$@"; do
  if is_done "$ph"; then say "=== $ph already done"; continue; fi
  say "=== phase $ph"
  case $ph in
    pd:*) run_pd "${ph#pd:}" ;;
    *:restart_*) arch=${ph%%:*}; s=${ph#*:restart_}; run_restart "$arch" "$s" ;;
    *:cross_*) arch=${ph%%:*}; s=${ph#*:cross_}; run_cross "$arch" "$s" ;;
    *:*) run_store "${ph%%:*}" "${ph#*:}" ;;
    *) "phase_$ph" ;;
  esac
  rc=$?
  if [ $rc = 0 ]; then done_mark "$ph"; say "=== phase $ph ok"; else say "=== phase $ph FAILED/skipped"; fi
  case $ph in install*) [ $rc = 0 ] || break ;; esac
done
stop_all
( cd "$LOGD" && tar czf "$OUTD/logs.tgz" ./*.log 2>/dev/null )
[ -d "$TMPD/jitcache" ] && [ ! -f "$JIT_CACHE" ] && tar czf "$OUTD/jitcache.tgz" -C "$TMPD" jitcache 2>/dev/null
say "end"
