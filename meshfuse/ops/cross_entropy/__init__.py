"""The fused cross entropy on class indices: the op pair (:mod:`.declaration`) and its Triton
kernels (:mod:`.kernels`); see docs/cross_entropy.md."""

from meshfuse.ops.cross_entropy import declaration  # noqa: F401  (registrations)
from meshfuse.ops.cross_entropy.declaration import decomposed, needs_decomposition

__all__ = ["decomposed", "needs_decomposition"]
