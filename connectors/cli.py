"""``kvconnect`` command line.

Each subcommand lives in its own module and is imported only when run (so ``kvconnect
--help`` stays fast and never imports torch, grpc or mooncake). A module registered in
``SUBCOMMANDS`` provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help). Keep alphabetical.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("kvconnect.connectors.cli_bench", "run a benchmark from benchmarks/ (side by side with its reference)"),
    "demo": ("kvconnect.connectors.demo", "replay a multi-turn shared-prefix workload through the SGLang adapter"),
    "hf3fs-meta": ("kvconnect.connectors.hf3fs.cli", "HF3FS metadata service: serve the durable page index over gRPC"),
    "mooncake-store": ("kvconnect.connectors.mooncake.cli", "Mooncake: run a standalone store process that contributes a memory segment"),
    "peer": ("kvconnect.connectors.peer_rdma.cli", "peer memory pool: run a memory-only node (serve) or query one (status)"),
    "stores": ("kvconnect.connectors.cli_stores", "list stores, their options and whether their dependencies are present"),
}


def register_subcommand(name: str, module: str, help: str) -> None:
    if name in SUBCOMMANDS:
        raise ValueError(f"subcommand {name!r} already registered")
    SUBCOMMANDS[name] = (module, help)


class _LazyModule:
    def __init__(self, name: str):
        self.name = name
        self._mod = None

    def get(self):
        if self._mod is None:
            self._mod = importlib.import_module(self.name)
        return self._mod


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named ``load`` gets its arguments (imports its module)."""
    parser = argparse.ArgumentParser(
        prog="kvconnect",
        description="KV-cache page stores shared across processes, nodes and engines.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in sorted(SUBCOMMANDS.items()):
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == load:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Find the subcommand name (first positional that names one) to load only its module.
    load = next((a for a in argv if a in SUBCOMMANDS), None)
    parser = build_parser(load)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a clear one-line error for configuration mistakes
        from kvconnect.connectors.base import KVStoreError

        if isinstance(e, KVStoreError):
            print(f"kvconnect {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
