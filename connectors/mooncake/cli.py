"""``kvconnect mooncake-store``: a standalone Mooncake store process.

It contributes ``global_segment_size`` bytes of memory to the Mooncake cluster of
``master_server_address`` and holds them until SIGINT/SIGTERM, so pages outlive engine
restarts (the role ``python -m mooncake.mooncake_store_service`` plays in SGLang's
Mooncake deployment), configured like every kvconnect Mooncake client: ``MOONCAKE_*``
environment variables, ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, then ``--option k=v``.
Optionally serves Prometheus ``/metrics`` (127.0.0.1 unless ``--metrics-host``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from kvconnect.connectors.config import port_arg

log = logging.getLogger("kvconnect.mooncake")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default=None, help="mooncake_master host:port (else MOONCAKE_MASTER)")
    p.add_argument("--segment", default=None,
                   help="memory to contribute, e.g. '4gb' (else MOONCAKE_GLOBAL_SEGMENT_SIZE, default 4gb)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="any mooncake store option (see `kvconnect stores`); repeatable")
    p.add_argument("--metrics-port", type=port_arg(), default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address for /metrics (default 127.0.0.1)")


def options_from(args: argparse.Namespace) -> dict:
    opts: dict = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option expects KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    if args.master:
        opts["master_server_address"] = args.master
    if args.segment:
        opts["global_segment_size"] = args.segment
    return opts


def run(args: argparse.Namespace) -> int:
    from kvconnect.connectors.registry import create_store

    store = create_store("mooncake", options_from(args))
    c = store.config  # type: ignore[attr-defined]
    if c.global_segment_size == 0:
        log.warning("global_segment_size is 0: this process contributes no memory")
    if args.metrics_port is not None:
        from kvconnect.connectors import metrics

        metrics.export_store(store, role="mooncake-store")
        port = metrics.serve_metrics(args.metrics_port, host=args.metrics_host)
        log.info("metrics on %s:%s/metrics", args.metrics_host, port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kvconnect mooncake-store: contributing {c.global_segment_size} bytes to master "
          f"{c.master_server_address} (protocol {c.protocol}, metadata {c.metadata_server}); Ctrl-C to stop",
          flush=True)
    while not stop.wait(5.0):
        if not store.health():  # type: ignore[attr-defined]
            log.warning("master %s unreachable; the segment is re-mounted when it is back",
                        c.master_server_address)
    store.close()
    return 0
