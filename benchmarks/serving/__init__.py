"""Serving under load: several SGLang servers behind ``sglang_router``, a workload, every L3 option.

``kvconnect bench serve`` (``benchmarks/serve.py``) drives it; the pieces:

- ``model``: a dummy-weight model directory (Llama-3-8B shape) with a locally built word-level
  tokenizer, so servers, router and clients run on text without downloading anything;
- ``workloads``: W1 shared-prefix groups (the peer-pool guide's ``generated-shared-prefix`` load),
  W2 multi-turn chat clients (the HF3FS guide's multi-turn load), W3 a production trace replay;
- ``client``: an asyncio load driver that streams ``/generate`` and records TTFT per request;
- ``cluster``: the processes (SGLang servers, the router, each store's services) and their control;
- ``configs``: the L3 configurations compared side by side (HiCache L2 only, SGLang's own backends,
  PeerCache, LMCache, every kvconnect store);
- ``report``: percentiles, the ``ratios`` list and the picture.
"""
