"""``kvconnect bench NAME [args...]``: run ``kvconnect.benchmarks.NAME``'s ``main(argv)``.

The benchmarks ship with the package (the repository's ``benchmarks/`` folder is installed
as ``kvconnect.benchmarks``). Every benchmark accepts ``--quick``; where results go is said
in ``kvconnect.benchmarks.harness``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

NOT_BENCHMARKS = {"__init__", "harness"}


def find_benchmarks_dir() -> Path:
    """The folder of the ``kvconnect.benchmarks`` package."""
    import kvconnect.benchmarks

    return Path(kvconnect.benchmarks.__file__).resolve().parent


def list_benchmarks(directory: Path) -> dict[str, str]:
    """name -> first docstring line, for every ``benchmarks/*.py`` that defines ``main``.

    Read with ``ast`` (not imported), so listing never imports a benchmark's dependencies.
    """
    out = {}
    for path in sorted(directory.glob("*.py")):
        name = path.stem
        if name in NOT_BENCHMARKS or name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError as e:
            out[name] = f"(cannot parse: {e})"
            continue
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out[name] = doc[0] if doc else ""
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="benchmark to run (a file benchmarks/NAME.py)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="arguments passed to the benchmark (e.g. --quick; see kvconnect bench NAME --help)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")


def run(args: argparse.Namespace) -> int:
    directory = find_benchmarks_dir()
    available = list_benchmarks(directory)
    if args.list or not args.name:
        w = max((len(n) for n in available), default=8)
        for name, doc in available.items():
            print(f"{name:<{w}}  {doc}")
        if not args.list:
            print("\nusage: kvconnect bench NAME [--quick] [benchmark options]", file=sys.stderr)
            return 2
        return 0
    if args.name not in available:
        print(f"kvconnect bench: error: unknown benchmark {args.name!r} in {directory} "
              f"(accepted: {', '.join(available) or 'none'})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvconnect.benchmarks.{args.name}")
    bench_args = list(args.bench_args)
    if bench_args[:1] == ["--"]:
        bench_args = bench_args[1:]
    # argparse takes its default prog from argv[0]: make usage lines read "kvconnect bench NAME".
    saved, sys.argv = sys.argv, [f"kvconnect bench {args.name}", *bench_args]
    try:
        return int(module.main(bench_args) or 0)
    finally:
        sys.argv = saved
