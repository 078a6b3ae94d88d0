"""``kvconnect hf3fs-meta``: run (or query) the HF3FS metadata service.

    kvconnect hf3fs-meta serve --host 127.0.0.1 --port 18000 --data-dir DIR [--token-file F]
    kvconnect hf3fs-meta usage --address 127.0.0.1:18000 [--namespace 0:kv] [--token-file F]
"""

from __future__ import annotations

import argparse
import json

from kvconnect.connectors.hf3fs.wal import FSYNC_POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="serve the page index over gRPC (durable in --data-dir)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=18000, help="port (default 18000, SGLang's)")
    s.add_argument("--data-dir", required=True, help="journal and snapshots live here")
    s.add_argument("--token-file", help="file holding the shared secret every client must send")
    s.add_argument("--fsync", choices=FSYNC_POLICIES, default="interval",
                   help="journal fsync policy (default interval: every 50 ms; kill -9 never loses a "
                        "confirmed key under any policy)")
    s.add_argument("--workers", type=int, default=8, help="threads for calls that wait for fsync (--fsync always; default 8)")
    s.add_argument("--read-lease", type=float, default=2.0,
                   help="seconds a page returned by get is kept from reuse (default 2; slower readers re-validate)")
    s.add_argument("--write-lease", type=float, default=30.0,
                   help="seconds a reservation lives without confirm (default 30)")
    s.add_argument("--tcp-port", type=int, default=0,
                   help="port of the framed TCP listener clients prefer over gRPC (default 0: any free port, "
                        "announced over gRPC; -1: gRPC only)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: any free port; default: none)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics binds (default 127.0.0.1; unauthenticated: a WARNING beyond loopback)")
    s.add_argument("--snapshot-interval", type=float, default=60.0, help="seconds between snapshots (default 60)")
    s.add_argument("--ready-file", help="write the bound address here once serving (scripts, tests)")
    u = sub.add_parser("usage", help="print a namespace's usage as JSON")
    u.add_argument("--address", default="127.0.0.1:18000", help="the service's gRPC host:port (default 127.0.0.1:18000)")
    u.add_argument("--namespace", default="0:kv", help="'{rank}:{pool}' (default 0:kv)")
    u.add_argument("--token-file", help="file holding the shared secret (when the service requires one)")


def _token(path: str | None) -> str | None:
    """The token file's secret, else $KVCONNECT_HF3FS_TOKEN (kvconnect.connectors.auth)."""
    from kvconnect.connectors.auth import resolve_token

    return resolve_token(None, path, "hf3fs")


def run(args: argparse.Namespace) -> int:
    if args.action == "serve":
        from kvconnect.connectors.hf3fs.service import serve

        return serve(args.host, args.port, args.data_dir, _token(args.token_file), fsync=args.fsync,
                     workers=args.workers, snapshot_interval_s=args.snapshot_interval, ready_file=args.ready_file,
                     read_lease_s=args.read_lease, write_lease_s=args.write_lease, tcp_port=args.tcp_port,
                     metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    from kvconnect.connectors.hf3fs.client import RemoteMetadata

    c = RemoteMetadata(args.address, _token(args.token_file))
    try:
        c.connect()
        print(json.dumps(c.usage(args.namespace), indent=2))
    finally:
        c.close()
    return 0
