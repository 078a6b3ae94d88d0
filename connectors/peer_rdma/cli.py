"""``kvconnect peer``: run a memory-only pool node, or ask a node for its state.

    kvconnect peer serve --discovery-addr 10.0.0.1:31998 --global-segment-size 16gb \\
        --bind-host 10.0.0.2 --metrics-port 31997 --metrics-host 10.0.0.2
    kvconnect peer status 10.0.0.2:31998          # members and counters (JSON)

Any ``PeerRdmaConfig`` key can be given as ``--set key=value`` (or ``--config JSON``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading

_FLAGS = ("discovery_addr", "bind_host", "local_hostname", "control_port", "global_segment_size",
          "protocol", "device_name", "device_names", "disk_path", "disk_size", "auth_token", "auth_token_file")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvconnect.connectors.config import port_arg
    from kvconnect.connectors.peer_rdma.config import PeerRdmaConfig  # light: no grpc / mooncake import

    fields = {f.name: f for f in dataclasses.fields(PeerRdmaConfig)}
    sub = p.add_subparsers(dest="peer_command", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="run a memory-only node (no engine) until SIGTERM/SIGINT")
    for key in _FLAGS:
        f = fields[key]  # one source of truth for option docs: the config dataclass
        s.add_argument("--" + key.replace("_", "-"), dest=key, default=None,
                       help=f"{f.metadata.get('help', '')} (default: {f.default!r})")
    s.add_argument("--metrics-port", type=port_arg(), default=None,
                   help="serve Prometheus /metrics on this port (0: any free port; default: none)")
    s.add_argument("--metrics-host", "--metrics-bind-host", dest="metrics_host", default="127.0.0.1",
                   help="address /metrics binds (default 127.0.0.1; unauthenticated: a WARNING beyond loopback)")
    s.add_argument("--config", default=None, help="JSON object of options (the SGLang extra-config form)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other option")
    s.add_argument("--ready-file", default=None, help="write the node id here once joined (scripts, tests)")
    t = sub.add_parser("status", help="print a node's members and counters as JSON")
    t.add_argument("address", help="control address host:port")
    t.add_argument("--token", default=None, help="shared token (default: --token-file, else $KVCONNECT_PEER_TOKEN)")
    t.add_argument("--token-file", default=None, help="file holding the shared token")
    t.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the node (default 2)")


def options_from_args(args: argparse.Namespace) -> dict:
    opts: dict = json.loads(args.config) if args.config else {}
    for key in ("backend_name", "module_path", "class_name", "interface_v1", "store"):
        opts.pop(key, None)  # SGLang extra-config keys that are not pool options
    for key in _FLAGS:
        v = getattr(args, key)
        if v is not None:
            opts[key] = v
    for kv in args.set:
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--set needs KEY=VALUE, got {kv!r}")
        opts[k.strip()] = v
    return opts


def run(args: argparse.Namespace) -> int:
    if args.peer_command == "status":
        from kvconnect.connectors.auth import resolve_token
        from kvconnect.connectors.peer_rdma.rpc import Clients

        c = Clients(resolve_token(args.token, args.token_file, "peer") or "", args.timeout)
        try:
            print(json.dumps(c.call(args.address, "Stats", []), indent=2, sort_keys=True))
        finally:
            c.close()
        return 0

    from kvconnect.connectors.registry import create_store

    if args.auth_token:
        from kvconnect.connectors.auth import warn_token_on_command_line

        warn_token_on_command_line("--auth-token", "--auth-token-file")
    store = create_store("peer_rdma", options_from_args(args))
    try:
        return _serve(args, store)
    finally:
        store.close()  # clean leave, also when the node fails after it joined (a metrics port taken)
        print(f"peer node {store.node.node_id} left", file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, store) -> int:
    node = store.node
    port = None
    if args.metrics_port is not None:
        from kvconnect.connectors import metrics

        metrics.export_store(store, node=node.node_id)
        port = metrics.serve_metrics(args.metrics_port, host=args.metrics_host)
    print(f"peer node {node.node_id} up: te={node.transport.name} segment={node.config.global_segment_size} "
          f"members={len(node.view.members)}"
          + (f" metrics=http://{args.metrics_host}:{port}/metrics" if port else ""), flush=True)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(node.node_id)
        import os

        os.replace(args.ready_file + ".tmp", args.ready_file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return 0
