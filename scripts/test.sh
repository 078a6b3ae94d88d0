#!/usr/bin/env bash
# Install (idempotent, ~1 s when nothing changed) and run the test suite.
# With arguments they replace the default `tests` target, e.g.
#   bash scripts/test.sh tests/unit -x      bash scripts/test.sh -k hf3fs
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install.sh

export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
args=("$@")
((${#args[@]})) || args=(tests)
rc=0
.venv/bin/python -m pytest -q -ra --durations=30 "${args[@]}" || rc=$?
if ((rc == 5)); then
    echo "test.sh: pytest ran no tests (exit 5): that counts as a failure" >&2
fi
exit "$rc"
