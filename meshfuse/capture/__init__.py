"""Bring your own PyTorch model: capture a ``torch.nn.Module`` into meshfuse fusions.

- :mod:`~meshfuse.capture.trace`: the module and example inputs traced with ``torch.export``
  (non-strict) into one ATen graph;
- :mod:`~meshfuse.capture.repeats`: identical layers traced once (the first's nodes copied
  for the others);
- :mod:`~meshfuse.capture.regions`: ``torch.no_grad()`` and ``torch.autocast`` blocks inlined;
- :mod:`~meshfuse.capture.aten_ops`: the table from ATen ops to meshfuse ops;
- :mod:`~meshfuse.capture.partition`: constants folded, the graph cut into fusions and graph
  breaks (ops with no meshfuse rule, run as PyTorch ops);
- :mod:`~meshfuse.capture.plan`: a user's plan (DTensor styles, Hugging Face tp-plan strings,
  placements) read into parameter placements and module boundary layouts;
- :mod:`~meshfuse.capture.build`: one segment as a ``FusionDefinition``;
- :mod:`~meshfuse.capture.program`: the program of one input signature, run under autograd;
- :mod:`~meshfuse.capture.parallelize`: ``meshfuse.parallelize(module, mesh, plan)``;
- :mod:`~meshfuse.capture.backend`: ``torch.compile(model, backend=meshfuse.backend(...))``;
- :mod:`~meshfuse.capture.report`: ``explain()`` of a parallelized module.

See docs/models.md.
"""
