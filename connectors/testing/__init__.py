"""Test kits that ship with kvconnect, for its own tests and benchmarks and for third-party stores.

* ``conformance``: ``PageStoreConformance``, the one suite every store runs (subclass it,
  provide ``make_store``), and ``CapabilityChecks``, proofs of each capability a store claims;
* ``harness``: ``StoreHarness``, one per store, named by its registry entry (its services, the
  options of engine instances sharing it, its claims), ``harness_fixture`` and
  ``in_harness_namespace`` to run any test module over every registered store; the built-in
  stores' harnesses are in ``store_harnesses``;
* ``engine_suites``: one suite per engine (SGLang HiCache, LMCache L2, PD relay, vLLM) over a
  harness;
* ``lmcache_adapter``: LMCache's L2 adapter interface driven in-process (memory objects, tasks);
* ``stores``: ``FaultyStore`` (a wrapper that makes operations raise or hang) and
  ``SharedMemoryStore`` (memory stores sharing pages by name);
* ``netns``: network namespaces, one loopback-only (``Netns``) or several on a bridge
  (``Bridge``), for multi-host tests on one machine and for fencing Mooncake processes;
* ``processes``: how child processes import kvconnect, stop, and are waited for;
* ``standin``: the CPU stand-in for ``sglang.launch_server`` as a test process, free port ranges;
* ``mooncake``: a real ``mooncake_master`` cluster in a namespace, and the pytest pieces
  that run a test module inside one;
* ``hf3fs``: the HF3FS metadata service as a process;
* ``sglang``: real SGLang host KV pools on CPU, page contents, storage configs;
* ``linker``: SGLang's unified-cache linker path on CPU (a real ``UnifiedRadixCache`` over CPU
  device pools with kvconnect's linker from SGLang's factory, a request's prefill step by step,
  one TP rank as a process);
* ``kv_events``: a KV-event subscriber as a cache-aware router runs one (ZMQ SUB, SGLang's
  ``KVEventBatch`` decoding, gaps filled through the publisher's replay socket);
* ``ranks``: several SGLang rank processes (real host pools) sharing one store;
* ``pd``: the PD role driver (a prefill or decode process on CPU) and the relay's store services;
* ``peer``: peer-pool node processes driven by JSON lines;
* ``lmcache``: ``lmcache server`` processes with the kvconnect plugin and LMCache's engine client;
* ``hash_model``: the model both SGLang server stand-ins serve (pages keyed and filled from hashes,
  outputs a digest of every page) and how they reach an L3 backend through SGLang's storage factory;
* ``serving_engine``: a CPU stand-in for ``sglang.launch_server`` behind ``sglang_router`` (text
  prompts, SGLang's admin API and its not-idle refusals), for ``kvconnect bench serve``;
* ``launch_server``: a CPU stand-in taking ``sglang.launch_server``'s own flags (``input_ids``,
  HiCache or a PD prefill/decode pair), for the GPU scripts under ``benchmarks/gpu/``.

Nothing in the rest of the package imports these modules; they import pytest, sglang,
lmcache or mooncake only where a kit needs them.
"""
