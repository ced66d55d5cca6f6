"""The GPT block of :mod:`meshfuse.examples.gpt` (pre-norm, causal self-attention, tanh-GELU
MLP) written as its forward only, its backward derived, against the same block with its
backward written out by hand (:class:`~meshfuse.examples.gpt.GptBlockWithBackward`) and
against PyTorch autograd in float64: ``y`` and the gradients of ``sum(y * dy)`` for ``x`` and
every parameter, unsharded and tensor + sequence parallel at 2 and 4 ranks.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from meshfuse import DataType, DeviceMesh, shard_tensor
from meshfuse.examples.gpt import GptBlock, GptBlockWithBackward, init_parameters, torch_block
from meshfuse.runtime.collectives import record_communications
from meshfuse.testing.utils import current_device

B, S, E, HEADS = 2, 64, 64, 4

# (rtol, atol relative to each tensor's largest magnitude) against the float64 reference.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 3e-2)}
# The key bias gets no gradient (softmax is invariant to adding one value to every score of a
# row): its exact gradient is zero, so its rounding errors are judged at the query bias's scale.
SCALE_OF = {"b_k": "b_q"}


def make_inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(B, S, E, generator=gen).to(dtype) for _ in range(2))
    return x, dy, {n: t.to(dtype) for n, t in init_parameters(E).items()}


def reference(x, dy, params) -> dict[str, torch.Tensor]:
    """``y`` and the gradients of ``sum(y * dy)``, by autograd in float64."""
    x = x.double().requires_grad_()
    p = {n: t.double().requires_grad_() for n, t in params.items()}
    y = torch_block(x, p, HEADS)
    y.backward(dy.double())
    return {"y": y.detach(), "x": x.grad, **{n: t.grad for n, t in p.items()}}


def derived(block: GptBlock, x, dy, params, rank: int = 0):
    """``y`` and the gradients through ``block.as_autograd_function()`` on this rank's
    shards; and the kinds of the collectives the forward and the backward ran."""
    block.define()
    leaves = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
              for t, tv in zip([x, *params.values()], [block.x, *block.params.values()])]
    with record_communications() as forward:
        y, = block.as_autograd_function()(leaves)
    with record_communications() as backward:
        y.backward(shard_tensor(dy, block.y, rank).to(current_device()))
    grads = {"y": y.detach(), "x": leaves[0].grad,
             **{n: leaf.grad for n, leaf in zip(params, leaves[1:])}}
    return grads, [Counter(c.kind for c in comms) for comms in (forward, backward)]


def hand_written(block: GptBlockWithBackward, x, dy, params, rank: int = 0):
    """The same through the hand-written fusion; and the kinds of its collectives."""
    block.define()
    tvs = [block.x, block.dy, *block.params.values()]
    inputs = [shard_tensor(t, tv, rank).to(current_device())
              for t, tv in zip([x, dy, *params.values()], tvs)]
    with record_communications() as comms:
        outputs = block.execute(inputs)
    return dict(zip(["y", "x", *params], outputs)), Counter(c.kind for c in comms)


def assert_matches(got, expected, dtype, tvs=None, rank: int = 0):
    """Each of ``got`` (this rank's shards when ``tvs`` names their schedules) equals
    ``expected`` within ``dtype``'s tolerance, judged at each tensor's scale."""
    rtol, atol = TOLERANCE[dtype]
    for name, value in expected.items():
        ref = value if tvs is None else shard_tensor(value, tvs[name], rank)
        scale = expected[SCALE_OF.get(name, name)].abs().max().item()
        torch.testing.assert_close(got[name].cpu().double(), ref.double(), rtol=rtol,
                                   atol=atol * scale, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.mpi
def test_forward_only_block_tp_sp_gradients_match_hand_written_and_autograd(multidevice_test):
    """Tensor and sequence parallel: every rank's gradients, derived and hand-written, are
    its shards of PyTorch autograd's. The forward runs two allgathers (the layer norm
    outputs) and two reduce-scatters (the row-parallel results); the derived backward their
    transposes, the layer norm outputs gathered again for the weight gradients, and an
    allreduce for each layer norm parameter's gradient (a sum over sequence shards; the
    row-parallel biases' gradients are sums of the gathered cotangent, complete locally).
    The input gradients of the q, k and v projections are three partial sums, added while
    partial and reduce-scattered once."""
    size, rank = multidevice_test.size, multidevice_test.rank
    x, dy, params = make_inputs(torch.float32)
    mesh = DeviceMesh(range(size))
    expected = reference(x, dy, params)
    block = GptBlock(B, S, E, HEADS, DataType.Float, mesh)
    got, (forward, backward) = derived(block, x, dy, params, rank)
    tvs = {"y": block.y, "x": block.x, **block.params}
    assert_matches(got, expected, torch.float32, tvs, rank)
    written = GptBlockWithBackward(B, S, E, HEADS, DataType.Float, mesh)
    by_hand, comms = hand_written(written, x, dy, params, rank)
    assert_matches(by_hand, expected, torch.float32, tvs, rank)
    if size > 1:
        assert forward == Counter({"allgather": 2, "reduce_scatter": 2})
        assert backward == Counter({"allgather": 4, "reduce_scatter": 2, "allreduce": 4})
        assert comms == forward + backward  # by hand: the same communications
    else:
        assert not forward and not backward and not comms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_derived_backward_equals_the_hand_written_one(dtype):
    """Unsharded, in float32 and bf16 (nvFuser's promotion: float arithmetic, bf16 I/O):
    the derived gradients equal the hand-written fusion's."""
    x, dy, params = make_inputs(dtype)
    mf_dtype = DataType.from_torch(dtype)
    written, _ = hand_written(GptBlockWithBackward(B, S, E, HEADS, mf_dtype), x, dy, params)
    got, _ = derived(GptBlock(B, S, E, HEADS, mf_dtype), x, dy, params)
    assert_matches(got, written, dtype)
