"""Scaled dot-product attention: the ``sdpfa_fwd``/``sdpfa_bwd`` declarations and their rules,
kernels, backends, fused dropout and grouped key/value heads. Importing it registers both ops."""

from meshfuse.ops.attention import declaration  # noqa: F401
