"""kvconnect: KV-cache page stores shared across processes, nodes and engines.

``kvconnect`` is the one import root. The repository keeps its folders at the top
(``connectors/``, ``namespace/``, ``benchmarks/``); the wheel places them under this
package (``setup.py``), so installed or not the names are the same:

* ``kvconnect.connectors``: the page-store interface, the stores and the engine
  integrations (``kvconnect.connectors.engines.sglang_hicache`` is SGLang's
  ``module_path``, ``kvconnect.connectors.engines.lmcache_l2`` LMCache's);
* ``kvconnect.connectors.testing``: the conformance suite and test kits for stores;
* ``kvconnect.namespace``: key spaces and hit policies;
* ``kvconnect.benchmarks``: what ``kvconnect bench`` runs.

Importing this package is cheap: stores import their heavy dependencies only when
selected (``kvconnect.connectors.registry``).
"""

from __future__ import annotations

import os as _os

# A source checkout (PYTHONPATH=<repository root>, or an editable install) keeps the
# subpackages next to this folder, not in it: look for them there.
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "connectors")):
    __path__.append(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))  # type: ignore[name-defined]

from kvconnect.connectors import *  # noqa: E402,F401,F403 - the public API, at the root
from kvconnect.connectors import __all__  # noqa: E402,F401

__version__ = "0.1.0"
