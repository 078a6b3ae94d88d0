#!/bin/bash
# The serving benchmark (`kvconnect bench serve`, docs/serving.md) on a GPU node, installing SGLang and
# the other systems from a bundle of files (prepare_serving.sh) instead of the network.
#   bash benchmarks/gpu/run_serving.sh PHASE...        (phases run in the order given; -h: this text)
# Phases:
#   install1   SGLang 0.5.17's wheels ($SGLANG_WHEELS/*.whl) + PeerCache ($EXTRA_WHEELS/*.whl) into
#              $GPU_TMP/site1; writes $OUT/diag.txt (GPU, Python, cores, memory, write rate of /tmp, /dev/shm)
#   install2   the rest of SGLang's wheel set + sglang-router ($SITE2_TAR) into $GPU_TMP/site2, Mooncake
#              ($MOONCAKE_TAR, with libibverbs/librdmacm) into $GPU_TMP/site3, an earlier run's JIT cache
#              ($JIT_CACHE, optional) into $GPU_TMP/jitcache
#   install5   LMCache 0.5.6 ($LMCACHE_TAR) into $GPU_TMP/site4, for the lmcache_* configurations; where its
#              CUDA ops do not load against the node's torch, builds them from $LMCACHE_SDIST (diag.txt says which)
#   start      start `kvconnect bench serve $SERVE_ARGS` detached from this shell (it outlives it); it
#              writes into $SERVE_DIR/out
#   wait       wait until the benchmark ends or DEADLINE_S seconds after this script started, printing its
#              progress lines, then copy what it wrote so far to $OUT (again at every wait)
#   stop       stop the benchmark and every process it started (they carry KVC_SERVE_DIR), then copy
# Env (defaults):
#   BUNDLE_DIR (the current folder): where prepare_serving.sh's folders are; SGLANG_WHEELS
#   ($BUNDLE_DIR/.gpuwheels1), EXTRA_WHEELS ($BUNDLE_DIR/.gpuserve1), SITE2_TAR
#   ($BUNDLE_DIR/.gpuserve2/site2.tar.xz), MOONCAKE_TAR ($BUNDLE_DIR/.gpumc/mc312.tar.xz), JIT_CACHE
#   ($BUNDLE_DIR/.gpujitcache/jitcache.tgz; every wait/stop leaves $OUT/jitcache.tgz to reuse), LMCACHE_TAR
#   ($BUNDLE_DIR/.gpulmc/site4.tar.xz), LMCACHE_SDIST ($BUNDLE_DIR/.gpulmcsrc/lmcache-0.5.6.tar.gz)
#   SERVE_ARGS (none): `kvconnect bench serve` options; DEADLINE_S (570); OUT (/tmp/out); GPU_TMP (/tmp: site1-4
#   and jitcache go there); SERVE_DIR ($GPU_TMP/serve); WRITE_PROBE_MB (2048: install1's write probe per
#   medium); STOP_GRACE_S (15: how long stop lets the benchmark stop its servers before killing what is left)
# The kvconnect it runs is this script's checkout (on PYTHONPATH). benchmarks/gpu/README.md: the runbook.
set -u
T0=$(date +%s)
case "${1:-}" in -h|--help|"") sed -n '2,/^set -u$/p' "$0" | sed '$d' | cut -c3-; [ -n "${1:-}" ]; exit $? ;; esac
DEADLINE_S=${DEADLINE_S:-570}
REPO=$(cd "$(dirname "$0")/../.." && pwd)   # the checkout this script is in: its kvconnect is the one run
OUTD=${OUT:-/tmp/out}; mkdir -p "$OUTD"
TMPD=${GPU_TMP:-/tmp}
SERVE=${SERVE_DIR:-$TMPD/serve}; mkdir -p "$SERVE"
# shellcheck source=benchmarks/gpu/bundle.sh
. "$REPO/benchmarks/gpu/bundle.sh"   # the bundle's paths, the environment, the install steps

say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

phase_install1() {
  install_wheels "$TMPD/site1" "$SGLANG_WHEELS" "$EXTRA_WHEELS"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V; nproc; free -g | head -2;
    df -h /tmp /dev/shm | tail -2
    # the media the file-backed stores write to: 2 GiB, flushed to the device (the write-through demand is in runs.jsonl)
    for d in /tmp /dev/shm; do echo "$d: $(dd if=/dev/zero of="$d/kvc_write_probe.$$" bs=8M \
      count=$(( ${WRITE_PROBE_MB:-2048} / 8 )) conv=fdatasync 2>&1 | tail -n 1)"; rm -f "$d/kvc_write_probe.$$"; done
  } 2>&1 | tee "$OUTD/diag.txt"
  say "install1 done"
}
phase_install2() {
  unpack_site2 || return 1
  install_mooncake "$MOONCAKE_TAR" || return 1
  date_back_sites; load_jitcache
  python3 -c 'import sglang_router, peercache.store, sglang' || return 1   # Mooncake: checked by install_mooncake
  say "install2 done"
}
phase_install5() { install_lmcache; }
phase_start() {
  [ -f "$SERVE/pid" ] && kill -0 "$(cat "$SERVE/pid")" 2>/dev/null && { say "already running"; return 0; }
  # shellcheck disable=SC2086
  KVC_SERVE_DIR=$SERVE python3 -c 'import os, sys
os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' python3 -m kvconnect.connectors.cli bench serve --workdir "$SERVE/work" \
    --out "$SERVE/out" --results-dir "$SERVE/out" ${SERVE_ARGS:-} > "$SERVE/bench.log" 2>&1 < /dev/null &
  echo $! > "$SERVE/pid"
  say "serving benchmark started (pid $(cat "$SERVE/pid")): ${SERVE_ARGS:-}"
}
collect() {
  cp "$SERVE"/out/* "$OUTD"/ 2>/dev/null
  tr '\r' '\n' < "$SERVE/bench.log" | grep -v -E "it/s\]|req/s\]|s/req\]" | tail -n 400 > "$OUTD/bench.log"
  ( cd "$SERVE/work/logs" 2>/dev/null && tar czf "$OUTD/server_logs.tgz" ./*.log )
  [ -d "$TMPD/jitcache" ] && [ ! -f "$OUTD/jitcache.tgz" ] && tar czf "$OUTD/jitcache.tgz" -C "$TMPD" jitcache 2>/dev/null
  return 0
}
phase_wait() {
  local pid; pid=$(cat "$SERVE/pid" 2>/dev/null) || { say "not started"; return 1; }
  local shown=0 line
  new_lines() {  # every [serve] line written since the last poll, so no pair's line is skipped
    local n=0
    while IFS= read -r line; do
      n=$((n + 1)); [ "$n" -gt "$shown" ] && say "$line"
    done < <(grep -a "^\[serve\]" "$SERVE/bench.log" 2>/dev/null)
    [ "$n" -gt "$shown" ] && shown=$n
    return 0
  }
  while kill -0 "$pid" 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "$DEADLINE_S" ]; do
    sleep 5; new_lines
  done
  new_lines
  kill -0 "$pid" 2>/dev/null && say "still running (results so far copied)" || say "benchmark finished"
  collect
}
started_here() {  # pids of the processes that carry this run's KVC_SERVE_DIR (the benchmark and its children)
  local f p
  for f in /proc/[0-9]*/environ; do
    p=${f#/proc/}; p=${p%/environ}
    [ "$p" = $$ ] && continue
    { tr '\0' '\n' < "$f"; } 2>/dev/null | grep -qxF "KVC_SERVE_DIR=$SERVE" && echo "$p"
  done
}
phase_stop() {
  # SIGTERM makes the benchmark stop its servers and services; whatever is left after the grace is killed
  local pid left=""; pid=$(cat "$SERVE/pid" 2>/dev/null) && kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 1 "${STOP_GRACE_S:-15}"); do left=$(started_here); [ -z "$left" ] && break; sleep 1; done
  # shellcheck disable=SC2086
  [ -n "$left" ] && { say "killing what is left: ${left//$'\n'/ }"; kill -KILL $left 2>/dev/null; sleep 1; }
  collect
}

for ph in "$@"; do
  say "=== $ph"
  "phase_$ph" || { say "=== $ph FAILED"; case $ph in install*) exit 1 ;; esac; }
done
