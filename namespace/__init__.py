"""Key spaces (which model, layout, dtype, ranks, pool and tenant a page belongs to) and
hit policies (how many pages of a lookup are usable), shared by every integration."""

from namespace.hits import HitPolicy, count_hits, leading_hits, restorable_prefixes  # noqa: F401
from namespace.keyspace import KeySpace  # noqa: F401
