"""The GPT-3 layer of the benchmark (``benchmarks/gpt3_layer.py``): one fusion with the
forward and backward written out, tensor and sequence parallel, against PyTorch autograd of
the same layer, and its collectives against DTensor's ``parallelize_module`` of it."""

from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Shard

from benchmarks.gpt3_layer import MODULE_NAMES, PARAM_SHAPES, Gpt3Block, Gpt3Layer, make_params
from meshfuse import DataType, DeviceMesh, shard_tensor
from meshfuse.runtime.collectives import record_communications
from meshfuse.testing.utils import current_device

B, S, HEADS, E = 1, 8, 4, 16
# Megatron's TP + SP layer: an allgather before each column-parallel linear and a
# reduce-scatter after each row-parallel one, forward and backward (the backward gathers
# the cotangents and reduce-scatters the input gradients); and meshfuse's own: an allreduce
# of each layer norm parameter's gradient (DTensor leaves those Partial).
MEGATRON = Counter({"allgather": 4, "reduce_scatter": 4})
LAYER_NORM_GRADS = Counter({"allreduce": 4})


def _inputs(device):
    gen = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(B, S, E, generator=gen).to(device) for _ in range(2))
    return x, dy, make_params(E, torch.float32, device)


def _reference(x, dy, params):
    """y and the gradients of sum(y * dy) by autograd, unsharded."""
    block = Gpt3Block(E, HEADS).to(x.device).load(params)
    x = x.clone().requires_grad_()
    y = block(x)
    y.backward(dy)
    return [y.detach(), x.grad,
            *(block.get_parameter(MODULE_NAMES[n]).grad for n in PARAM_SHAPES)]


@pytest.mark.mpi
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["tp_sp", "tp"])
def test_layer_matches_autograd_with_megatrons_collectives(multidevice_test,
                                                           sequence_parallel):
    d, rank = multidevice_test.size, multidevice_test.rank
    x, dy, params = _inputs(current_device())
    fd = Gpt3Layer(B, S, HEADS, E, DataType.Float, DeviceMesh(range(d)),
                   sequence_parallel=sequence_parallel).define()
    inputs = [shard_tensor(t, tv, rank) for t, tv in
              zip((x, dy, *params.values()), fd.fusion.inputs())]
    with record_communications() as comms:
        outs = fd.execute(inputs)
    names = ["y", "x", *PARAM_SHAPES]
    for name, got, ref, tv in zip(names, outs, _reference(x, dy, params), fd.fusion.outputs()):
        torch.testing.assert_close(got, shard_tensor(ref, tv, rank), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if d > 1:
        expected = MEGATRON + LAYER_NORM_GRADS if sequence_parallel else \
            Counter({"allreduce": 4})  # TP only: the two partial sums each way
        assert Counter(c.kind for c in comms) == expected


@pytest.mark.mpi
def test_layer_runs_dtensors_collectives_and_the_layer_norm_gradients(multidevice_test):
    """DTensor's parallelize_module of the same layer (Colwise/Rowwise + SequenceParallel)
    runs 4 allgathers and 4 reduce-scatters per forward and backward; meshfuse runs those and
    one allreduce per layer norm parameter gradient, which DTensor leaves Partial."""
    d, rank = multidevice_test.size, multidevice_test.rank
    if d == 1:
        pytest.skip("nothing is communicated on one rank")
    x, dy, params = _inputs(current_device())
    plan = {"ln1": SequenceParallel(use_local_output=True),
            "qkv": ColwiseParallel(input_layouts=Shard(1)),
            "proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(use_local_output=True),
            "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1))}
    mesh = init_device_mesh(current_device().type, (d,))
    block = parallelize_module(Gpt3Block(E, HEADS).to(x.device).load(params), mesh, plan)
    with CommDebugMode() as dtensor:
        block(x.chunk(d, 1)[rank].requires_grad_()).backward(dy.chunk(d, 1)[rank])
    counts = {op.__name__: n for op, n in dtensor.get_comm_counts().items()}
    assert counts == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}
    assert block.ln1.weight.grad.placements[0].is_partial()
    fd = Gpt3Layer(B, S, HEADS, E, DataType.Float, DeviceMesh(range(d))).define()
    inputs = [shard_tensor(t, tv, rank) for t, tv in
              zip((x, dy, *params.values()), fd.fusion.inputs())]
    with record_communications() as comms:
        fd.execute(inputs)
    assert Counter(c.kind for c in comms) == MEGATRON + LAYER_NORM_GRADS
