"""Fully sharded data parallelism on a 3-D mesh (8 ranks, run with ``--world-sizes 8``):
HSDP x TP, ``replicate=2 x dp=2 x tp=2``, on the stack of MLP blocks of test_fsdp.py: 20
AdamW steps with clipping like PyTorch on one device, each dimension's communications on its
own groups (the parameter gathers and reduce-scatters over dp, the allreduce across replicas,
the row-parallel products' allreduces over tp)."""

from __future__ import annotations

import pytest
import torch
from test_fsdp import LAYERS, _check_losses, _model, _on, _train

from meshfuse import DeviceMesh
from meshfuse.parallel.fsdp import NamedMesh


@pytest.mark.mpi
def test_hsdp_by_tp_2x2x2(multidevice_test):
    if multidevice_test.size != 8:
        pytest.skip("a 2x2x2 mesh needs 8 ranks (--world-sizes 8)")
    mesh = NamedMesh(DeviceMesh(torch.arange(8).reshape(2, 2, 2)), ("replicate", "dp", "tp"))
    fd, model = _model(mesh, tp="tp", replicate="replicate")
    losses, comms, _ = _train(fd, model)
    _check_losses(losses)
    for forward, backward in comms:
        assert _on(forward, "allgather", 1) == LAYERS  # dp: one per layer
        assert _on(forward, "allgather", 0) == _on(forward, "allgather", 2) == 0
        assert _on(forward, "allreduce", 2) == LAYERS  # tp: each fc2
        assert _on(backward, "allgather", 1) == LAYERS
        assert _on(backward, "reduce_scatter", 1) == LAYERS
        assert _on(backward, "allreduce", 0) == LAYERS  # across replicas, one per layer
