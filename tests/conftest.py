import os
import sys
from pathlib import Path

# Tests run against the checkout (also when the package is installed editable).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402

# The shared suites are plain modules imported by the test files: rewrite their asserts too,
# so a failing check shows the values (a flaky store failure must be diagnosable from CI logs).
pytest.register_assert_rewrite("kvconnect.connectors.testing.conformance", "kvconnect.connectors.testing.mooncake")
