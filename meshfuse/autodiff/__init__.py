"""Automatic differentiation of fusions.

- :mod:`~meshfuse.autodiff.derivation`: the forward-with-residuals and the backward of a
  fusion, derived at global shapes from each op's ``vjp`` rule;
- :mod:`~meshfuse.autodiff.function`: a fusion as a ``torch.autograd.Function``
  (``fd.as_autograd_function()``);
- :mod:`~meshfuse.autodiff.module`: :class:`FusionModule`, a ``torch.nn.Module`` whose
  forward is a fusion and whose parameters are local shards.

``meshfuse.vjp(fd)``, the backward as a FusionDefinition of its own, is the frontend's
(:mod:`meshfuse.frontend.backward`): the frontend stands on this package.
"""
