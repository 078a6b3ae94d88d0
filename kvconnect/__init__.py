"""kvconnect: KV-cache page stores shared across processes, nodes and engines.

``kvconnect`` is the one import root. The repository keeps its folders at the top
(``connectors/``, ``namespace/``, ``benchmarks/``); this folder holds a relative link to each
(``kvconnect/connectors -> ../connectors``, ...), the one place that maps folders to packages.
A checkout on ``PYTHONPATH`` (or installed editable) imports them through the links, type
checkers and IDEs resolve them the same way, and a wheel holds the files themselves under
``kvconnect/``, so installed or not the names are the same:

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

from kvconnect.connectors import *  # noqa: F401,F403 - the public API, at the root
from kvconnect.connectors import __all__  # noqa: F401

__version__ = "0.1.0"
