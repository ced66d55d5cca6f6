"""Op declarations. Importing this package registers every op in ``registry.REGISTRY``."""

from meshfuse.ops import attention, linalg, pointwise, random, reductions, shape, slicing  # noqa: F401
from meshfuse.ops.registry import REGISTRY, OpDef, lookup  # noqa: F401
