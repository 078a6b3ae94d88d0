"""Side-by-side benchmarks: each runs its reference system in the same run and records
ratios (``kvconnect bench NAME``; ``kvconnect bench --list``)."""

if __name__ != "kvconnect.benchmarks":  # the repository root on sys.path makes the folder importable by itself
    raise ImportError(f"import kvconnect.benchmarks, not {__name__}: two copies of one module would not "
                      "share classes (kvconnect/benchmarks is a link to this folder)")
