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
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import meshfuse
from meshfuse import DataType, DeviceMesh, shard_tensor
from meshfuse.examples.gpt import GptBlock, GptBlockWithBackward, init_parameters, torch_block
from meshfuse.examples.gpt_torch import Gpt3Block, parallelize
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

# 12 heads: every world size the suite runs at (1 to 4) divides them, so the tensor-parallel
# plan is Megatron's at each; the sequence (64) is uneven at 3 ranks.
B, S, E, HEADS = 2, 64, 96, 12

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
    shards; and the collectives the forward and the backward ran."""
    block.define()
    leaves = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
              for t, tv in zip([x, *params.values()], [block.x, *block.params.values()])]
    with record_communications() as forward:
        y, = block.as_autograd_function()(leaves)
    with record_communications() as backward:
        y.backward(shard_tensor(dy, block.y, rank).to(current_device()))
    grads = {"y": y.detach(), "x": leaves[0].grad,
             **{n: leaf.grad for n, leaf in zip(params, leaves[1:])}}
    return grads, (forward, backward)


def hand_written(block: GptBlockWithBackward, x, dy, params, rank: int = 0):
    """The same through the hand-written fusion; and the collectives it ran."""
    block.define()
    tvs = [block.x, block.dy, *block.params.values()]
    inputs = [shard_tensor(t, tv, rank).to(current_device())
              for t, tv in zip([x, dy, *params.values()], tvs)]
    with record_communications() as comms:
        outputs = block.execute(inputs)
    return dict(zip(["y", "x", *params], outputs)), comms


def assert_matches(got, expected, dtype, tvs=None, rank: int = 0):
    """Each of ``got`` (this rank's shards when ``tvs`` names their schedules) equals
    ``expected`` within ``dtype``'s tolerance, judged at each tensor's scale."""
    rtol, atol = TOLERANCE[dtype]
    for name, value in expected.items():
        ref = value if tvs is None else shard_tensor(value, tvs[name], rank)
        scale = expected[SCALE_OF.get(name, name)].abs().max().item()
        torch.testing.assert_close(got[name].cpu().double(), ref.cpu().double(), rtol=rtol,
                                   atol=atol * scale, msg=lambda m, name=name: f"{name}: {m}")


def sp_plan(size: int, seq: int = S, embed: int = E, itemsize: int = 4) -> tuple[list, list]:
    """The collectives of Megatron's (and DTensor's) sequence-parallel plan for the block
    (elements of ``itemsize`` bytes: float32 by default), per forward and backward, as ``(kind, bytes sent by this rank)``: forward, an
    allgather of each layer norm's output before the column-parallel projections (this
    rank's ``[B, S/d, E]``) and a reduce-scatter of each row-parallel result (``[B, S, E]``);
    backward, their transposes (an allgather of the cotangent into the row-parallel
    projection, a reduce-scatter of the input gradient out of the column-parallel ones),
    then one allreduce of the four layer norm parameters' gradients (``4 x [E]``: sums over
    the sequence shards, bucketed; DTensor leaves them pending as ``Partial`` gradients).
    Uneven sequence shards are padded to the longest."""
    longest = -(-seq // size)
    ag = ("allgather", B * longest * embed * itemsize)
    rs = ("reduce_scatter", B * longest * size * embed * itemsize)
    return [ag, rs] * 2, [ag, rs] * 2 + [("allreduce", 4 * embed * itemsize)]


def kinds_and_bytes(comms) -> list[tuple[str, int]]:
    return [(c.kind, c.bytes) for c in comms]


@pytest.mark.mpi
def test_forward_only_block_tp_sp_gradients_match_hand_written_and_autograd(multidevice_test):
    """Tensor and sequence parallel: every rank's gradients, derived and hand-written, are
    its shards of PyTorch autograd's, and both run exactly the collectives of the
    sequence-parallel plan (:func:`sp_plan`): the layer norms' gathered outputs are saved
    for the weight gradients, not gathered again; the row-parallel biases' gradients are
    sums of the gathered cotangent, complete locally; the input gradients of the q, k and v
    projections are three partial sums, added while partial and reduce-scattered once."""
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
        plan_forward, plan_backward = sp_plan(size)
        assert kinds_and_bytes(forward) == plan_forward
        assert kinds_and_bytes(backward) == plan_backward
        # by hand, one fusion: the same communications (in the order its program issues them)
        assert Counter(kinds_and_bytes(comms)) == Counter(plan_forward + plan_backward)
    else:
        assert not forward and not backward and not comms


@pytest.mark.mpi
def test_bf16_block_communicates_bf16_and_derives_bf16_gradients(multidevice_test):
    """In bf16 (nvFuser's promotion: float arithmetic, bf16 tensors) every gradient the
    derived backward returns is bf16, as its input (contributions summed in float, rounded
    once), so every collective of the plan moves bf16: none in float (the q, k and v input
    gradients' sum is rounded before its reduce-scatter, the layer norm parameters' partial
    gradients before their allreduces). The gradients match float64 autograd's (bf16
    tolerance)."""
    size, rank = multidevice_test.size, multidevice_test.rank
    x, dy, params = make_inputs(torch.bfloat16)
    block = GptBlock(B, S, E, HEADS, DataType.BFloat16, DeviceMesh(range(size)))
    bwd = meshfuse.vjp(block.define())
    assert {tv.dtype for tv in bwd.fusion.outputs()} == {DataType.BFloat16}
    got, (forward, backward) = derived(block, x, dy, params, rank)
    assert_matches(got, reference(x, dy, params), torch.bfloat16,
                   {"y": block.y, "x": block.x, **block.params}, rank)
    plan_forward, plan_backward = sp_plan(size, itemsize=2) if size > 1 else ([], [])
    assert kinds_and_bytes(forward) == plan_forward
    assert kinds_and_bytes(backward) == plan_backward


@pytest.mark.mpi
def test_uneven_sequence_shards_match_autograd_with_the_same_collectives(multidevice_test):
    """A sequence that no world size of 2, 3 or 4 divides (31 = 16 + 15, 11 + 11 + 9,
    8 + 8 + 8 + 7; 12 heads, which they all divide): the
    derived gradients still equal autograd's and the collectives are the plan's, each
    uneven shard padded to the longest."""
    size, rank = multidevice_test.size, multidevice_test.rank
    seq = 31
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(1, seq, 48, generator=gen) for _ in range(2))
    params = init_parameters(48)
    block = GptBlock(1, seq, 48, 12, DataType.Float, DeviceMesh(range(size)))
    got, (forward, backward) = derived(block, x, dy, params, rank)
    xr = x.double().requires_grad_()
    pr = {n: t.double().requires_grad_() for n, t in params.items()}
    y = torch_block(xr, pr, 12)
    y.backward(dy.double())
    expected = {"y": y.detach(), "x": xr.grad, **{n: t.grad for n, t in pr.items()}}
    assert_matches(got, expected, torch.float32, {"y": block.y, "x": block.x, **block.params},
                   rank)
    if size > 1:
        plan_forward, plan_backward = sp_plan(size, seq, 48)
        plan_forward = [(k, n // B) for k, n in plan_forward]  # batch 1 here
        plan_backward = [(k, n if k == "allreduce" else n // B) for k, n in plan_backward]
        assert kinds_and_bytes(forward) == plan_forward
        assert kinds_and_bytes(backward) == plan_backward


DTENSOR_KINDS = {"all_gather_into_tensor": "allgather",
                 "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "allreduce"}


class _FunctionalCollectives(TorchDispatchMode):
    """Records DTensor's collectives (torch's functional collectives) as ``(kind, bytes
    sent by this rank)``, named as meshfuse's recorder names them."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname in DTENSOR_KINDS:
            self.log.append((DTENSOR_KINDS[func._opname],
                             args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


@pytest.mark.mpi
def test_collectives_are_dtensors_plus_the_layer_norm_gradients(multidevice_test):
    """DTensor's ``parallelize_module`` of the same block (Colwise/Rowwise + SequenceParallel,
    the benchmark's baseline) runs the same allgathers and reduce-scatters, of the same
    sizes, forward and backward; meshfuse adds one allreduce, of the four layer norm
    parameters' gradients together, which DTensor leaves ``Partial`` (reduced later, one
    allreduce each, when the optimizer reads them) while meshfuse returns them complete, as
    a replicated input's gradient."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    size, rank = multidevice_test.size, multidevice_test.rank
    if size == 1:
        pytest.skip("tensor parallelism needs 2 or more ranks")
    x, dy, params = make_inputs(torch.float32)
    _, (forward, backward) = derived(GptBlock(B, S, E, HEADS, DataType.Float,
                                              DeviceMesh(range(size))), x, dy, params, rank)
    device = multidevice_test.device
    mesh = init_device_mesh(device.type, (size,))
    block = parallelize(Gpt3Block(params, HEADS), mesh)
    local_x = x.chunk(size, 1)[rank].to(device).requires_grad_()
    with _FunctionalCollectives() as dtensor_forward:
        y = block(DTensor.from_local(local_x, mesh, [Shard(1)], shape=x.shape,
                                     stride=x.stride()))  # uneven at 3 ranks
    with _FunctionalCollectives() as dtensor_backward:
        y.to_local().backward(dy.chunk(size, 1)[rank].to(device))
    norms = [p for n, p in block.named_parameters() if n.startswith("ln")]
    assert all(p.grad.placements == (Partial(),) for p in norms)
    assert kinds_and_bytes(forward) == dtensor_forward.log
    reduced = [c for c in kinds_and_bytes(backward) if c[0] == "allreduce"]
    assert reduced == [("allreduce", len(norms) * E * 4)]
    assert Counter(kinds_and_bytes(backward)) - Counter(reduced) == Counter(dtensor_backward.log)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_derived_backward_equals_the_hand_written_one(dtype):
    """Unsharded, in float32 and bf16 (nvFuser's promotion: float arithmetic, bf16 I/O):
    the derived gradients equal the hand-written fusion's."""
    x, dy, params = make_inputs(dtype)
    mf_dtype = DataType.from_torch(dtype)
    written, _ = hand_written(GptBlockWithBackward(B, S, E, HEADS, mf_dtype), x, dy, params)
    got, _ = derived(GptBlock(B, S, E, HEADS, mf_dtype), x, dy, params)
    assert_matches(got, written, dtype)


def test_compiled_derived_backward_equals_the_interpreted_one():
    """``as_autograd_function(compile=...)`` runs the forward and the derived backward as
    fused segments (``aot_eager`` here: the same lowering as Inductor, no kernel build):
    the same output and gradients as the interpreter's."""
    x, dy, params = make_inputs(torch.float32)
    results = []
    for compile in (False, "aot_eager"):
        block = GptBlock(B, S // 4, E, HEADS).define()
        leaves = [t.clone().requires_grad_() for t in [x[:, :S // 4], *params.values()]]
        function = block.as_autograd_function(compile=compile)
        y, = function(leaves)
        y.backward(dy[:, :S // 4])
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
        compiled, = function._derivations.values()
        runners = (compiled.derivation.forward_runner, compiled._backward)
        assert all(bool(runner._fused) == bool(compile) for runner in runners)
    for interpreted, compiled in zip(*results):
        torch.testing.assert_close(compiled, interpreted)


@pytest.mark.mpi
def test_backward_collectives_run_under_weight_gradients(multidevice_test):
    """The derived backward's program places a matrix product between each collective's
    launch and the first step that reads its result, wherever one does not need it: the
    reduce-scatter of the MLP's input gradient runs under fc2's weight gradient, the
    allgather of ``dh`` under fc1's, the reduce-scatter of the attention's input gradient
    under out_proj's (the first allgather, of ``dy``, feeds the first matmul: nothing can
    hide it; the bucketed allreduce is read by no step)."""
    size, rank = multidevice_test.size, multidevice_test.rank
    if size == 1:
        pytest.skip("no collective on one rank")
    x, dy, params = make_inputs(torch.float32)
    block = GptBlock(B, S, E, HEADS, DataType.Float, DeviceMesh(range(size))).define()
    leaves = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
              for t, tv in zip([x, *params.values()], [block.x, *block.params.values()])]
    function = block.as_autograd_function()
    y, = function(leaves)
    y.backward(shard_tensor(dy, block.y, rank).to(current_device()))
    compiled, = function._derivations.values()
    steps = next(iter(compiled._backward._programs.values())).steps
    hidden = []
    for k, step in enumerate(steps):
        if step.op != "reshard" or not step.plan:
            continue
        readers = [j for j in range(k + 1, len(steps))
                   if any(getattr(a, "index", None) in step.outputs for a in steps[j].args)]
        if readers:
            between = [s.op for s in steps[k + 1:readers[0]]]
            hidden.append((step.plan[0].kind, "matmul" in between))
    assert hidden == [("allgather", False), ("reduce_scatter", True), ("allgather", True),
                      ("reduce_scatter", True)]


@pytest.mark.mpi
def test_weight_gradients_are_one_matrix_product_over_all_tokens(multidevice_test):
    """Each weight gradient of the derived backward is one ``[n, tokens] x [tokens, k]``
    product, batch and sequence merged (as torch's autograd and the hand-written backward
    compute it): no batch of weight-sized products summed afterwards, which wrote, read and
    held ``batch`` times the weights' bytes (issue 34: 1.09x the hand-written fusion's time
    at the medium GPT layer). Unsharded and tensor + sequence parallel (the projections'
    token axes are whole inside the tensor-parallel region); the gradients stay right."""
    size, rank = multidevice_test.size, multidevice_test.rank
    x, dy, params = make_inputs(torch.float32)
    mesh = DeviceMesh(range(size)) if size > 1 else None
    block = GptBlock(B, S, E, HEADS, DataType.Float, mesh)
    got, _ = derived(block, x, dy, params, rank)
    assert_matches(got, reference(x, dy, params), torch.float32,
                   {"y": block.y, "x": block.x, **block.params}, rank)
    flags = [True] * len(block.fusion.inputs())
    backward = block.as_autograd_function().derivation(flags).derivation.backward
    matmuls = [e for e in backward.exprs if e.op.name == "matmul"]
    ranks = Counter(tuple(len(t.materialized()) for t in e.tensor_inputs) for e in matmuls)
    tokens = B * S
    assert ranks == Counter({(3, 2): 6, (2, 2): 6})  # 6 input gradients, 6 weight gradients
    for e in matmuls:
        if len(e.tensor_inputs[0].materialized()) == 2:
            assert e.tensor_inputs[0].materialized()[1].extent == tokens
            assert not any(e.outputs[0] in u.tensor_inputs and u.op.name == "sum"
                           for u in backward.exprs)
