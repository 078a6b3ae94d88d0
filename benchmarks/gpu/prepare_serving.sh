#!/bin/bash
# Build the bundle run_serving.sh (and run_e2e.sh) installs from, on a machine with access to PyPI, for a
# GPU node with Python 3.12 and a CUDA torch but no network. Writes into BUNDLE_DIR (default: the checkout
# this script is in); copy those folders next to the checkout on the node (or point BUNDLE_DIR there):
#   .gpuwheels1/             SGLang 0.5.17, a slimmed sglang-kernel, transformers, tokenizers, tvm-ffi (~52 MiB)
#   .gpuserve1/              PeerCache 0.8.4 (cp312)
#   .gpuserve2/site2.tar.xz  the rest of SGLang's wheel set + sglang-router 0.3.2 (stripped), unpacked (~34 MiB)
#   .gpumc/mc312.tar.xz      Mooncake 0.3.13 (non-CUDA build: host memory) trimmed, with libibverbs/librdmacm (~15 MiB)
#   .gpulmc/site4.tar.xz     LMCache 0.5.6 and what it imports beyond the image and SGLang's set, unpacked
#                            (lmcache_056_wheels.txt; ~33 MiB): run_e2e.sh install5, for the lmcache_* phases
#   .gpulmcsrc/lmcache-0.5.6.tar.gz  LMCache's source archive (~9 MiB): install5 builds its CUDA ops from it
#                            against the node's torch, where the wheel's do not load (build_lmcache_cuda_ops.py)
#   .gpuwheels-dl/           the downloads (not needed on the node)
# No part is over ~55 MiB, for nodes that take files in small uploads.
# The pins (sglang_0517_wheels.txt) are the wheels SGLang 0.5.17 needs beyond a CUDA torch 2.11 image.
# Needs: python3 -m pip, xz, strip, and libibverbs/libnl/librdmacm in /lib/x86_64-linux-gnu (copied for bare
# images). The folders are git-ignored.
#   bash benchmarks/gpu/prepare_serving.sh          (-h: this text)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo pipefail$/p' "$0" | sed '$d' | cut -c3-; exit 0 ;; esac
G=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${BUNDLE_DIR:-$G/../..}" && cd "${BUNDLE_DIR:-$G/../..}"
D=.gpuwheels-dl
W="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
P="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
mkdir -p "$D"

# 1. SGLang's wheel set, split in two
# shellcheck disable=SC2086
$W $P -d "$D" -r "$G/sglang_0517_wheels.txt"
rm -rf .gpuwheels1 .gpuserve1 .gpuserve2 "$D/slim" "$D/site2"
mkdir -p .gpuwheels1 .gpuserve1 .gpuserve2 "$D/site2"
python3 "$G/slim_sglang_kernel.py" "$D"/sglang_kernel-0.4.5-*.whl "$D/slim"
cp "$D"/slim/sglang_kernel-0.4.5-*.whl .gpuwheels1/
for w in "$D"/*.whl; do
  case "$(basename "$w")" in
    sglang_kernel-*|sglang_router-*|peercache-*|mooncake_*) ;;
    sglang-0.5.17-*|transformers-*|tokenizers-*|apache_tvm_ffi-*) cp "$w" .gpuwheels1/ ;;
    *) python3 -m zipfile -e "$w" "$D/site2/" ;;
  esac
done

# 2. the router (a Rust binary: stripped, it packs to ~17 MiB) and PeerCache
# shellcheck disable=SC2086
$W $P -d "$D" sglang-router==0.3.2 peercache==0.8.4
python3 -m zipfile -e "$D"/sglang_router-0.3.2-*.whl "$D/site2/"
strip --strip-unneeded "$D"/site2/sglang_router/*.so
cp "$D"/peercache-0.8.4-*.whl .gpuserve1/
tar cf - -C "$D/site2" . | xz -6 -T0 > .gpuserve2/site2.tar.xz

# 3. Mooncake: the store and engine modules, the master, their libraries, libibverbs/librdmacm for bare images
# shellcheck disable=SC2086
$W $P -d "$D" mooncake-transfer-engine-non-cuda==0.3.13.post1
rm -rf "$D/mc" && mkdir -p "$D/mc/ibv" .gpumc
python3 -m zipfile -e "$D"/mooncake_transfer_engine_non_cuda-*.whl "$D/mc"
( cd "$D/mc" && find mooncake -name '*.py' ! -name __init__.py ! -name buffer_pool.py -delete \
  && rm -rf mooncake/reshard mooncake/transfer_engine_bench mooncake/mooncake_client ./*.dist-info \
  && cp -L /lib/x86_64-linux-gnu/{libibverbs.so.1,libnl-route-3.so.200,libnl-3.so.200,librdmacm.so.1} ibv/ \
  && tar cf - mooncake mooncake_transfer_engine_non_cuda.libs ibv ) | xz -9 -T0 > .gpumc/mc312.tar.xz

# 4. LMCache (its server and SGLang's --enable-lmcache connector), unpacked like site2
# shellcheck disable=SC2086
$W $P -d "$D/lmc" -r "$G/lmcache_056_wheels.txt"
rm -rf "$D/site4" && mkdir -p "$D/site4" .gpulmc
for w in "$D"/lmc/*.whl; do python3 -m zipfile -e "$w" "$D/site4/"; done
tar cf - -C "$D/site4" . | xz -6 -T0 > .gpulmc/site4.tar.xz
mkdir -p .gpulmcsrc && ( cd .gpulmcsrc && python3 - lmcache 0.5.6 <<'PY'
import re, sys, urllib.request as u   # the sdist from PyPI's simple index (pip would try to build it)
name, ver = sys.argv[1], sys.argv[2]
page = u.urlopen(f"https://pypi.org/simple/{name}/", timeout=60).read().decode()
url = next(m for m in re.findall(r'href="([^"]+)"', page) if f"/{name}-{ver}.tar.gz" in m)
u.urlretrieve(url.split("#")[0], f"{name}-{ver}.tar.gz")
PY
)

du -sh .gpuwheels1 .gpuserve1 .gpuserve2 .gpumc .gpulmc .gpulmcsrc
