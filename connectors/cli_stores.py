"""``kvconnect stores``: registered stores, their options, and whether they can load here."""

from __future__ import annotations

import argparse
import json

from kvconnect.connectors.base import PageStore
from kvconnect.connectors.config import describe_config
from kvconnect.connectors.registry import available_stores, dependency_status, store_class


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="show the options of this store")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    specs = available_stores()
    if args.name:
        cls = store_class(args.name)
        rows = describe_config(cls.config_class)
        if args.json:
            print(json.dumps([dict(zip(("key", "type", "default", "help"), r)) for r in rows], indent=2))
            return 0
        print(f"{args.name}: {specs[args.name].summary}")
        print(f"  capabilities: {', '.join(sorted(c.value for c in cls.capabilities)) or 'none'}"
              f"{'' if cls.capabilities_of.__func__ is PageStore.capabilities_of.__func__ else ' (some with certain options only)'}")
        w = max((len(r[0]) for r in rows), default=4)
        for key, tp, default, help_ in rows:
            print(f"  {key:<{w}}  {tp:<8} default {default:<14} {help_}")
        return 0
    out = []
    for name, spec in sorted(specs.items()):
        ok, detail = dependency_status(name)
        cls = store_class(name) if ok else None
        caps = sorted(c.value for c in cls.capabilities) if cls else None
        out.append({"store": name, "available": ok, "detail": detail, "extra": spec.extra,
                    "summary": spec.summary, "capabilities": caps,
                    "capabilities_depend_on_options": bool(cls) and cls.capabilities_of.__func__
                    is not PageStore.capabilities_of.__func__})
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for r in out:
        mark = "yes" if r["available"] else "no "
        print(f"{r['store']:<10} available: {mark}  {r['summary']}")
        if r["capabilities"] is not None:
            depends = " (some with certain options only)" if r["capabilities_depend_on_options"] else ""
            print(f"{'':<10} capabilities: {', '.join(r['capabilities']) or 'none'}{depends}")
        if r["detail"] != "ok":
            print(f"{'':<10} {r['detail']}")
    return 0
