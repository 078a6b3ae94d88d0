"""Peer memory pool: nodes lend host memory to each other; no master.

* ``membership`` — gRPC heartbeats, any node a seed, TTL expiry, clean leave
* ``placement`` — rendezvous hashing of keys over live members
* ``segment`` / ``disk`` — the lent memory (allocator, LRU, slot generations) and its disk tier
* ``transport`` — Mooncake Transfer Engine (one-sided batched reads/writes)
* ``node`` — the node that ties them together; ``store.PeerRdmaStore`` is the ``PageStore``

Importing this package imports nothing heavy; grpc and mooncake load with ``store``.
"""
