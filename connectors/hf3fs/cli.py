"""``kvconnect hf3fs-meta``: run (or query) the HF3FS metadata service.

    kvconnect hf3fs-meta serve --host 127.0.0.1 --port 18000 --data-dir DIR [--auth-token-file F]
    kvconnect hf3fs-meta serve --persistence-path DIR --save-interval 60   # SGLang's mini server flags
    kvconnect hf3fs-meta usage --address 127.0.0.1:18000 [--namespace 0:kv] [--token-file F]
"""

from __future__ import annotations

import argparse
import json
import logging

from kvconnect.connectors.config import port_arg
from kvconnect.connectors.hf3fs.wal import FSYNC_POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="serve the page index over gRPC (durable in --data-dir)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; SGLang's mini "
                                                       "server binds 0.0.0.0: set a token before you do)")
    s.add_argument("--port", type=port_arg(), default=18000, help="port (default 18000, SGLang's)")
    s.add_argument("--data-dir", "--persistence-path", dest="data_dir", required=True,
                   help="journal, snapshots and the index's identity live here, locked while the service runs "
                        "(a second service on it exits naming the holder) (--persistence-path, SGLang "
                        "mini_3fs_metadata_server's flag, is the same option: a directory here, not a file)")
    s.add_argument("--auth-token-file", "--token-file", dest="token_file",
                   help="file holding the shared secret every client must send (else $KVCONNECT_HF3FS_TOKEN)")
    s.add_argument("--auth-token", help="the shared secret itself (visible in ps: prefer --auth-token-file)")
    s.add_argument("--fsync", choices=FSYNC_POLICIES, default="interval",
                   help="journal fsync policy (default interval: every 50 ms; kill -9 never loses a "
                        "confirmed key under any policy)")
    s.add_argument("--workers", type=int, default=8, help="threads for calls that wait for fsync (--fsync always; default 8)")
    s.add_argument("--read-lease", type=float, default=2.0,
                   help="seconds a page returned by get is kept from reuse (default 2; slower readers re-validate)")
    s.add_argument("--write-lease", type=float, default=30.0,
                   help="seconds a reservation lives without confirm (default 30)")
    s.add_argument("--tcp-port", type=port_arg(-1), default=0,
                   help="port of the framed TCP listener clients prefer over gRPC (default 0: any free port, "
                        "announced over gRPC; -1: gRPC only)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: any free port; default: none)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics binds (default 127.0.0.1; unauthenticated: a WARNING beyond loopback)")
    s.add_argument("--snapshot-interval", type=float, default=60.0, help="seconds between snapshots (default 60)")
    s.add_argument("--save-interval", type=float, default=None,
                   help="SGLang mini_3fs_metadata_server's flag, mapped to --snapshot-interval: every write is "
                        "journaled before it is answered, snapshots only shorten recovery")
    s.add_argument("--hello-timeout", type=float, default=2.0,
                   help="seconds a framed TCP connection may take to authenticate (default 2)")
    s.add_argument("--max-unauthenticated", type=int, default=256,
                   help="framed TCP connections waiting to authenticate at once; past it the oldest is "
                        "closed (default 256)")
    s.add_argument("--ready-file", help="write the bound address here once serving (scripts, tests)")
    u = sub.add_parser("usage", help="print a namespace's usage as JSON")
    u.add_argument("--address", default="127.0.0.1:18000", help="the service's gRPC host:port (default 127.0.0.1:18000)")
    u.add_argument("--namespace", default="0:kv", help="'{rank}:{pool}' (default 0:kv)")
    u.add_argument("--auth-token-file", "--token-file", dest="token_file",
                   help="file holding the shared secret (when the service requires one)")


def _token(path: str | None, token: str | None = None) -> str | None:
    """--auth-token, else the token file's secret, else $KVCONNECT_HF3FS_TOKEN (kvconnect.connectors.auth)."""
    from kvconnect.connectors.auth import resolve_token, warn_token_on_command_line

    if token:
        warn_token_on_command_line("--auth-token", "--auth-token-file")
    return resolve_token(token, path, "hf3fs")


def run(args: argparse.Namespace) -> int:
    if args.action == "serve":
        from kvconnect.connectors.hf3fs.service import serve

        if args.save_interval is not None:
            args.snapshot_interval = args.save_interval
            logging.getLogger("kvconnect.hf3fs.meta").info(
                "--save-interval %g: a snapshot every %g s; every write is journaled before it is answered, "
                "so nothing waits for a save", args.save_interval, args.save_interval)
        return serve(args.host, args.port, args.data_dir, _token(args.token_file, args.auth_token), fsync=args.fsync,
                     workers=args.workers, snapshot_interval_s=args.snapshot_interval, ready_file=args.ready_file,
                     read_lease_s=args.read_lease, write_lease_s=args.write_lease, tcp_port=args.tcp_port,
                     metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                     hello_timeout_s=args.hello_timeout, max_unauthenticated=args.max_unauthenticated)
    from kvconnect.connectors.hf3fs.client import RemoteMetadata

    c = RemoteMetadata(args.address, _token(args.token_file))
    try:
        c.connect()
        print(json.dumps(c.usage(args.namespace), indent=2))
    finally:
        c.close()
    return 0

