"""``python -m kvconnect`` is the ``kvconnect`` command."""

import sys

from kvconnect.connectors.cli import main

sys.exit(main())
