# Sourced by run_serving.sh and run_e2e.sh (not run on its own): where prepare_serving.sh's bundle is, the
# environment both give SGLang, Mooncake and LMCache, and the steps that install the bundle into
# $GPU_TMP/site1..4. Expects REPO (the checkout), TMPD ($GPU_TMP), OUTD ($OUT) and say() to be set.
BUNDLE=${BUNDLE_DIR:-.}
SGLANG_WHEELS=${SGLANG_WHEELS:-$BUNDLE/.gpuwheels1} EXTRA_WHEELS=${EXTRA_WHEELS:-$BUNDLE/.gpuserve1}
SGLANG_WHEELS2=${SGLANG_WHEELS2:-$BUNDLE/.gpuwheels2}
SITE2_TAR=${SITE2_TAR:-$BUNDLE/.gpuserve2/site2.tar.xz} MOONCAKE_TAR=${MOONCAKE_TAR:-$BUNDLE/.gpumc/mc312.tar.xz}
MOONCAKE_CUDA_TAR=${MOONCAKE_CUDA_TAR:-$BUNDLE/.gpumccuda/mccuda312.tar.xz}
LMCACHE_TAR=${LMCACHE_TAR:-$BUNDLE/.gpulmc/site4.tar.xz} LMCACHE_SDIST=${LMCACHE_SDIST:-$BUNDLE/.gpulmcsrc/lmcache-0.5.6.tar.gz}
JIT_CACHE=${JIT_CACHE:-$BUNDLE/.gpujitcache/jitcache.tgz}
BUNDLE_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# site4 (LMCache) first: LMCache pins opentelemetry-api <= 1.40, site2 carries SGLang's newer one
export PYTHONPATH=$TMPD/site4:$TMPD/site3:$TMPD/site2:$TMPD/site1:$REPO
# Mooncake's .so files need libibverbs.so.1 (the bundle carries it for images that lack it); its CUDA build
# also needs libcudart.so.12 and libmlx5.so.1, shipped in the same folder
if [ -f "$TMPD/site3/ibv/libcudart.so.12" ] || ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
  export LD_LIBRARY_PATH=$TMPD/site3/ibv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export LMCACHE_TRACK_USAGE=false
export TVM_FFI_CACHE_DIR=$TMPD/jitcache/tvm-ffi TRITON_CACHE_DIR=$TMPD/jitcache/triton FLASHINFER_WORKSPACE_BASE=$TMPD/jitcache
export TORCH_EXTENSIONS_DIR=$TMPD/jitcache/torch_extensions   # SGLang's native page hash, built at the first L3 lookup
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
command -v nvcc >/dev/null 2>&1 || export PATH=$PATH:/usr/local/cuda/bin
[ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null 2>&1 && export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")

install_wheels() {  # TARGET DIR...: every *.whl of the folders, no index, no dependencies
  local t=$(date +%s) target=$1 d; shift
  local wheels=()
  for d in "$@"; do wheels+=("$d"/*.whl); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
    "${wheels[@]}" 2>&1 | grep -v -E "WARNING: Target directory|already exists" | tail -5
  say "installed ${#wheels[@]} wheels from ${*#./} into $target in $(( $(date +%s) - t ))s"
}
load_jitcache() {  # an earlier run's compiled kernels ($OUT/jitcache.tgz of that run)
  if [ ! -d "$TMPD/jitcache" ] && [ -f "$JIT_CACHE" ]; then
    tar xzf "$JIT_CACHE" -C "$TMPD" && say "restored $TMPD/jitcache"
  fi
}
unpack_site2() {  # the rest of SGLang's wheel set and sglang-router, unpacked by prepare_serving.sh
  mkdir -p "$TMPD/site2" && xz -dc "$SITE2_TAR" | tar xf - -C "$TMPD/site2" && say "unpacked $SITE2_TAR into $TMPD/site2"
}
date_back_sites() {  # JIT caches stay newer than the headers they were built from
  find "$TMPD/site1" "$TMPD/site2" -exec touch -h -d 2000-01-01 {} + 2>/dev/null
  return 0
}
install_mooncake() {  # TAR: Mooncake unpacked into site3 (mooncake/, its .libs, libibverbs for bare images)
  local t=$(date +%s); mkdir -p "$TMPD/site3"
  tar xJf "$1" -C "$TMPD/site3" && chmod +x "$TMPD/site3/mooncake/mooncake_master" || return 1
  python3 -c 'import mooncake.store, mooncake.engine' || { say "mooncake import failed"; return 1; }
  say "installed mooncake from $1 into $TMPD/site3 in $(( $(date +%s) - t ))s"
}
install_lmcache() {  # LMCache 0.5.6 and what it needs beyond the image and SGLang's set, unpacked into site4
  local t=$(date +%s); mkdir -p "$TMPD/site4"
  tar xJf "$LMCACHE_TAR" -C "$TMPD/site4" || return 1
  python3 -c 'import lmcache.cli.main, lmcache.v1.multiprocess.server, lmcache.integration.sglang.multi_process_adapter' \
    || { say "lmcache import failed"; return 1; }
  # LMCache's compiled CUDA ops (the wheel's are built against another torch): whether they load against this
  # image's torch; where they do not and LMCache's source archive came along, build them here (nvcc)
  local ops ok=0
  ops=$(python3 -c 'import torch, lmcache.cuda_ops as c; print("loads", c.__file__, "with torch", torch.__version__)' 2>&1) \
    || ok=$?
  echo "lmcache.cuda_ops: $(tail -n 1 <<< "$ops")" | tee -a "$OUTD/diag.txt"
  if [ "$ok" != 0 ] && [ -f "$LMCACHE_SDIST" ]; then
    python3 "$BUNDLE_SCRIPTS/build_lmcache_cuda_ops.py" --sdist "$LMCACHE_SDIST" --site "$TMPD/site4" 2>&1 | tail -n 5 \
      | tee -a "$OUTD/diag.txt"
  fi
  say "installed lmcache into $TMPD/site4 in $(( $(date +%s) - t ))s"
}
