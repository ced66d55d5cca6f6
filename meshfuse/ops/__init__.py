"""Op declarations. Importing this package registers every op in ``registry.REGISTRY``."""

from meshfuse.ops import (  # noqa: F401
    attention,
    cross_entropy,
    indexing,
    linalg,
    moe,
    pointwise,
    random,
    reductions,
    shape,
    slicing,
)
from meshfuse.ops.registry import REGISTRY, OpDef, lookup  # noqa: F401
