"""Key spaces (which model, layout, dtype, ranks, pool and tenant a page belongs to) and
hit policies (how many pages of a lookup are usable), shared by every integration."""

if __name__ != "kvconnect.namespace":  # the repository root on sys.path makes the folder importable by itself
    raise ImportError(f"import kvconnect.namespace, not {__name__}: two copies of one module would not "
                      "share classes (kvconnect/namespace is a link to this folder)")


from kvconnect.namespace.hits import (  # noqa: F401
    HitPolicy, block_group_pages, count_hits, leading_hits, restorable_prefixes)
from kvconnect.namespace.keyspace import KeySpace  # noqa: F401
from kvconnect.namespace.dtypes import logical_kv_dtype, resolve_kv_dtype  # noqa: F401,E402
