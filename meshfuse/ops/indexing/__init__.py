"""Indexing ops: lookups at integer positions and their scatter-adds
(:mod:`.lookups`), and the host check of index values that ``MESHFUSE_CHECK_INDICES=1``
turns on (:mod:`.checks`)."""

from meshfuse.ops.indexing import lookups  # noqa: F401  (registrations)
from meshfuse.ops.indexing.checks import CHECK_INDICES_ENV, IndexCheck, index_check

__all__ = ["CHECK_INDICES_ENV", "IndexCheck", "index_check"]
