#!/usr/bin/env bash
# Single machine: one HF3FS metadata service + two engine processes sharing one directory.
#
#   bash examples/hf3fs/single_machine.sh [WORKDIR]
#
# Runs here (CPU, no 3FS, no GPU): the metadata service is `kvconnect hf3fs-meta serve`
# bound to 127.0.0.1 with a token; each "engine" is examples/hf3fs/engine.py, i.e. a real
# SGLang 0.5.23 host KV pool with kvconnect's KVConnectStorage loaded through SGLang's
# dynamic backend factory (exactly the --hicache-storage-backend dynamic path, minus the
# GPU). Engine 1 backs pages up, engine 2 (another process, its own pool) loads them and
# checks every byte. Exit code 0 = every page hit and byte-exact. Cleans up after itself.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
WORK="${1:-$(mktemp -d /tmp/kvc-hf3fs-demo.XXXXXX)}"
PORT="${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
mkdir -p "$WORK/shared" "$WORK/meta"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/token"
chmod 600 "$WORK/token"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1

META_PID=""
cleanup() {
    [[ -n "$META_PID" ]] && kill "$META_PID" 2>/dev/null && wait "$META_PID" 2>/dev/null || true
    [[ -z "${KEEP:-}" ]] && rm -rf "$WORK"
}
trap cleanup EXIT

# 1. the metadata service (durable: journal + snapshots in $WORK/meta)
"$PY" -m kvconnect --log-level WARNING hf3fs-meta serve --host 127.0.0.1 --port "$PORT" \
    --data-dir "$WORK/meta" --token-file "$WORK/token" --ready-file "$WORK/meta.ready" &
META_PID=$!
for _ in $(seq 300); do [[ -f "$WORK/meta.ready" ]] && break; sleep 0.1; done
[[ -f "$WORK/meta.ready" ]] || { echo "metadata service did not start" >&2; exit 1; }
echo "metadata service on 127.0.0.1:$PORT (pid $META_PID)"

# 2. the HF3FS config, SGLang's keys unchanged plus kvconnect's token file
cat >"$WORK/hf3fs_config.json" <<JSON
{"file_path_prefix": "$WORK/shared/hicache", "file_size": 67108864, "numjobs": 4, "entries": 8,
 "metadata_server_url": "http://127.0.0.1:$PORT", "auth_token_file": "$WORK/token"}
JSON
export SGLANG_HICACHE_HF3FS_CONFIG_PATH="$WORK/hf3fs_config.json"
echo '{"pages": 300, "seed": 11}' >"$WORK/engine.json"

# 3. two engines at once; engine 2 reads once engine 1 has backed up
cd "$REPO"
"$PY" "$HERE/engine.py" write --config "$WORK/engine.json" --out "$WORK/engine1.json" &
E1=$!
"$PY" "$HERE/engine.py" read --config "$WORK/engine.json" --out "$WORK/engine2.json" --wait-for "$WORK/engine1.json" &
E2=$!
wait "$E1"
wait "$E2" && rc=0 || rc=$?

"$PY" -m kvconnect --log-level WARNING hf3fs-meta usage --address "127.0.0.1:$PORT" \
    --token-file "$WORK/token" --namespace 0:kv
ls -l "$WORK/shared"
[[ $rc == 0 ]] && echo "OK: engine 2 read every page engine 1 wrote, byte-exact" || echo "FAILED" >&2
exit $rc
