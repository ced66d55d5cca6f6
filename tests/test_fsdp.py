"""Fully sharded data parallelism (meshfuse.parallel.fsdp) on CPU ranks: a stack of MLP
blocks (examples/mlp_stack.py) trained 20 AdamW steps with gradient clipping, every step's
loss within 1e-5 relative of the same model in PyTorch on one device; FSDP over every rank
(even and uneven shards), HSDP 2x2 and FSDP x TP 2x2 at 4 ranks. Per step, the
communications on the dp groups (one allgather per layer in the forward, one more in the
backward with reshard_after_forward, one reduce-scatter per layer), the gathers' program
order (one layer ahead) and the memory (sharded state, peak of gathered parameters)."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.distributed as dist

from meshfuse import DataType, DeviceMesh
from meshfuse.autodiff.fsdp_module import FullyShardedModule
from meshfuse.errors import DefinitionError, ScheduleError
from meshfuse.examples.gpt import parameter_shapes as gpt_shapes
from meshfuse.examples.gpt_stack import GptStack, stack_parameters
from meshfuse.examples.gpt_stack import torch_loss as gpt_loss
from meshfuse.examples.mlp_stack import MlpStack, block_shapes, init_parameters, torch_loss
from meshfuse.parallel.fsdp import GATHERED, MixedPrecision, NamedMesh
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.sharding import shard_tensor

B, E, FFN, LAYERS = 8, 5, 12, 3
STEPS, LR, MAX_NORM = 20, 1e-2, 0.5


def _model(mesh: NamedMesh, tp=None, **options) -> tuple[MlpStack, FullyShardedModule]:
    fd = MlpStack(B, E, FFN, LAYERS, mesh, tp).define()
    tvs, init = fd.parameter_inputs(), init_parameters(E, FFN, LAYERS)
    layers = [[f"{k}_{n}" for n in block_shapes(E, FFN)] for k in range(LAYERS)]
    model = FullyShardedModule(fd, {n: (tvs[n], init[n]) for n in tvs}, layers,
                               [fd.x, fd.target], mesh, **options)
    return fd, model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, E, generator=gen), torch.randn(B, E, generator=gen)


def _train(fd: MlpStack, model: FullyShardedModule, steps: int = STEPS):
    """Trains ``model`` and the PyTorch reference side by side; returns both losses per
    step and the communications of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref = {n: torch.nn.Parameter(v) for n, v in init_parameters(E, FFN, LAYERS).items()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=LR)
    losses, comms = [], []
    for step in range(steps):
        x, target = _batch(step)
        with record_communications() as log:
            loss = model(model.shard_input(fd.x, x), model.shard_input(fd.target, target))
            forward = list(log)
            loss.backward()
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        account = model.memory_account(opt)  # with the gradients, before they are dropped
        opt.zero_grad()
        expected = torch_loss(x, target, ref, LAYERS)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(ref.values(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), expected.item()))
        comms.append((forward, log[len(forward):]))
    return losses, comms, account


def _check_losses(losses) -> None:
    for step, (mine, theirs) in enumerate(losses):
        assert abs(mine - theirs) <= 1e-5 * abs(theirs), (step, mine, theirs)
    assert losses[-1][1] < losses[0][1]  # it trains


def _on(comms, kind: str, mesh_axis: int) -> int:
    return sum(c.kind == kind and c.mesh_axis == mesh_axis for c in comms)


@pytest.mark.mpi
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp_trains_like_one_device(multidevice_test, reshard_after_forward):
    d = multidevice_test.size
    mesh = NamedMesh(DeviceMesh(range(d)), ("dp",))
    fd, model = _model(mesh, reshard_after_forward=reshard_after_forward)
    losses, comms, account = _train(fd, model)
    _check_losses(losses)
    if d == 1:
        assert all(not f and not b for f, b in comms)
        return
    for forward, backward in comms:
        assert _on(forward, "allgather", 0) == LAYERS  # one per layer: 6 parameters each
        assert [c.kind for c in forward].count("allreduce") == 1  # the loss
        regathers = LAYERS if reshard_after_forward else 0
        assert _on(backward, "allgather", 0) == regathers
        assert _on(backward, "reduce_scatter", 0) == LAYERS
        assert len(backward) == regathers + LAYERS
    _check_sharded_state(account, d)


def _check_sharded_state(account, d: int, copies: int = 1) -> None:
    """Each rank holds its shard of every parameter, gradient and AdamW moment: at most
    ceil(rows / d) rows of each (1/d of the replicated model plus the padding), and the
    ranks' bytes add up to the replicated model's (``copies`` times: HSDP's replicas)."""
    init = init_parameters(E, FFN, LAYERS)
    whole = sum(t.numel() * 4 for t in init.values()) * 4  # parameter, grad, 2 moments
    bound = sum(math.ceil(t.shape[0] / d) * t[0].numel() * 4 for t in init.values()) * 4
    assert account.sharded_state <= bound < whole
    total = torch.tensor(account.sharded_state)
    dist.all_reduce(total)
    assert total.item() == whole * copies


@pytest.mark.mpi
def test_gathers_one_layer_ahead_and_two_layers_at_most(multidevice_test):
    d = multidevice_test.size
    if d == 1:
        pytest.skip("nothing is gathered on one rank")
    mesh = NamedMesh(DeviceMesh(range(d)), ("dp",))
    fd, model = _model(mesh)
    x, target = _batch(0)
    GATHERED.reset_peak()
    start = GATHERED.live
    loss = model(model.shard_input(fd.x, x), model.shard_input(fd.target, target))
    loss.backward()
    layer = init_parameters(E, FFN, 1).values()
    layer_bytes = sum(t.numel() * 4 for t in layer)
    padded = sum(math.ceil(t.shape[0] / d) * d * t[0].numel() * 4 for t in layer)
    assert GATHERED.live == start  # every gathered parameter freed
    # a layer's flat buffer and its parameters cut out of it, or those and the next layer's
    # buffer in flight: two layers (the buffers padded), never three
    assert layer_bytes < GATHERED.peak - start <= 2 * padded
    forward, backward = model.programs()
    for program, layers in ((forward, range(LAYERS)), (backward, list(reversed(range(LAYERS))))):
        _check_prefetch(program, list(layers))
    _check_reduced_when_ready(backward, list(reversed(range(LAYERS))))


def _check_prefetch(program, layers: list[int]) -> None:
    """Each layer's gather (one step) is launched after the first read of the layer that
    runs before it and before that layer's last read: one layer ahead, under its compute."""
    gathers, values, reads = {}, {}, {}
    for i, step in enumerate(program.steps):
        layer = re.search(r"layer (\d+)'s \d+ parameters, one allgather", step.label)
        if layer:
            gathers[int(layer[1])] = i
            values.update(dict.fromkeys(step.outputs, int(layer[1])))
        for k in {values[r] for r in step.reads if r in values}:
            if step.op == "set":
                values[step.outputs[0]] = k
            else:
                reads.setdefault(k, []).append(i)
    assert sorted(gathers) == sorted(layers)
    for before, k in itertools.pairwise(layers):
        assert gathers[before] < reads[before][0] < gathers[k] < reads[before][-1], (
            before, k, gathers, reads)
        assert gathers[k] < reads[k][0]


def _check_reduced_when_ready(program, layers: list[int]) -> None:
    """Each layer's gradients are reduced by one step, launched before the backward of the
    layer below it ends (as its gradients are ready, not all at the end)."""
    reductions, reads, values = {}, {}, {}
    for i, step in enumerate(program.steps):
        found = re.search(r"layer (\d+)'s \d+ parameters, one (allgather|reduce_scatter)",
                          step.label)
        if found and found[2] == "reduce_scatter":
            assert int(found[1]) not in reductions, step.label  # one per layer
            reductions[int(found[1])] = i
        elif found:
            values.update(dict.fromkeys(step.outputs, int(found[1])))
        for k in {values[r] for r in step.reads if r in values}:
            if step.op == "set":
                values[step.outputs[0]] = k
            else:
                reads.setdefault(k, []).append(i)
    assert sorted(reductions) == sorted(layers)
    for k, below in itertools.pairwise(layers):
        assert reductions[k] < reads[below][-1], (k, reductions, reads)


@pytest.mark.mpi
def test_kept_gathers_hold_every_layer(multidevice_test):
    """reshard_after_forward=False keeps the gathered parameters for the backward."""
    d = multidevice_test.size
    if d == 1:
        pytest.skip("nothing is gathered on one rank")
    fd, model = _model(NamedMesh(DeviceMesh(range(d)), ("dp",)), reshard_after_forward=False)
    x, target = _batch(0)
    GATHERED.reset_peak()
    start = GATHERED.live
    loss = model(model.shard_input(fd.x, x), model.shard_input(fd.target, target))
    assert GATHERED.live - start >= LAYERS * 2 * E * FFN * 4  # every layer's w1 and w2
    loss.backward()
    assert GATHERED.live == start


@pytest.mark.mpi
def test_hsdp_2x2(multidevice_test):
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    mesh = NamedMesh(DeviceMesh(torch.arange(4).reshape(2, 2)), ("replicate", "dp"))
    fd, model = _model(mesh, replicate="replicate")
    losses, comms, account = _train(fd, model)
    _check_losses(losses)
    for forward, backward in comms:
        assert _on(forward, "allgather", 1) == LAYERS and _on(forward, "allgather", 0) == 0
        assert _on(backward, "reduce_scatter", 1) == LAYERS
        assert _on(backward, "allreduce", 0) == LAYERS  # across replicas, one per layer
        assert _on(backward, "allreduce", 1) == 0
    _check_sharded_state(account, 2, copies=2)


@pytest.mark.mpi
def test_fsdp_with_tensor_parallel_2x2(multidevice_test):
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    mesh = NamedMesh(DeviceMesh(torch.arange(4).reshape(2, 2)), ("dp", "tp"))
    fd, model = _model(mesh, tp="tp")
    losses, comms, account = _train(fd, model)
    _check_losses(losses)
    for forward, backward in comms:
        assert _on(forward, "allgather", 0) == LAYERS
        assert _on(backward, "allgather", 0) == LAYERS
        assert _on(backward, "reduce_scatter", 0) == LAYERS
        assert _on(forward, "allreduce", 1) == LAYERS  # each row-parallel fc2, on tp
    # sharded over dp at least (the tensor-parallel weights over tp too)
    init = init_parameters(E, FFN, LAYERS)
    assert account.sharded_state <= sum(
        math.ceil(t.shape[0] / 2) * t[0].numel() * 4 for t in init.values()) * 4


@pytest.mark.mpi
def test_fsdp_2x2_reduces_each_layer_as_its_gradients_are_ready(multidevice_test):
    """On dp x tp, each layer's gathers are issued one layer ahead and its gradients'
    reduce-scatter is launched before the backward of the layer below ends (the derived
    backward pins the column-parallel weights' gradients at its end: their reductions are
    moved to where the gradients are ready); every rank issues its collectives in one
    order."""
    if multidevice_test.size != 4:
        pytest.skip("a 2x2 mesh needs 4 ranks")
    mesh = NamedMesh(DeviceMesh(torch.arange(4).reshape(2, 2)), ("dp", "tp"))
    fd, model = _model(mesh, tp="tp")
    _train(fd, model, steps=2)
    forward, backward = model.programs()
    for program, layers in ((forward, range(LAYERS)), (backward, reversed(range(LAYERS)))):
        _check_prefetch(program, list(layers))  # one layer ahead, on dp x tp too
    _check_reduced_when_ready(backward, list(reversed(range(LAYERS))))
    # every rank issues its collectives in one order (else they wait on each other)
    issued = [(p.kind, p.mesh_axis) for s in backward.steps for p in s.plan[:1]]
    everyone = [None] * 4
    dist.all_gather_object(everyone, issued)
    assert all(theirs == issued for theirs in everyone), everyone


@pytest.mark.mpi
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_mixed_precision_gathers_bf16_and_reduces_as_asked(multidevice_test, reduce_dtype):
    """Parameters kept in float32, gathered and multiplied in bf16, gradients reduced in
    ``reduce_dtype`` (None: bf16) and returned in float32; the losses follow float32's
    within bf16's precision."""
    d = multidevice_test.size
    if d == 1:
        pytest.skip("nothing is communicated on one rank")
    mesh = NamedMesh(DeviceMesh(range(d)), ("dp",))
    fd, model = _model(mesh, mp_policy=MixedPrecision(torch.bfloat16, reduce_dtype))
    losses, comms, _ = _train(fd, model, steps=5)
    for mine, theirs in losses:
        assert abs(mine - theirs) <= 3e-2 * abs(theirs)
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters()
               if p.grad is not None)
    layer = init_parameters(E, FFN, 1).values()
    padded = sum(math.ceil(t.shape[0] / d) * t[0].numel() for t in layer)  # per rank
    forward, backward = comms[-1]
    assert [c.bytes for c in forward if c.kind == "allgather"] == [padded * 2] * LAYERS
    width = 4 if reduce_dtype is torch.float32 else 2
    assert [c.bytes for c in backward if c.kind == "reduce_scatter"] == \
        [padded * d * width] * LAYERS


def test_errors_name_the_fix():
    mesh = NamedMesh(DeviceMesh(range(1)), ("dp",))
    fd = MlpStack(B, E, FFN, 1).define()
    tvs, init = fd.parameter_inputs(), init_parameters(E, FFN, 1)
    params = {n: (tvs[n], init[n]) for n in tvs}
    with pytest.raises(ScheduleError, match="no dimension 'fsdp'"):
        FullyShardedModule(fd, params, [list(tvs)], [fd.x], mesh, shard="fsdp")
    with pytest.raises(DefinitionError, match="layers 0 and 1"):
        FullyShardedModule(fd, params, [["0_w1"], ["0_w1"]], [fd.x], mesh)
    with pytest.raises(DefinitionError, match="not among the parameters"):
        FullyShardedModule(fd, params, [["0_w9"]], [fd.x], mesh)
    with pytest.raises(ScheduleError, match="multiply to 4"):
        NamedMesh.parse("dp=2,tp=3", 4)
    assert NamedMesh.parse("dp=2,tp=2", 4).size("tp") == 2


@pytest.mark.mpi
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None])
def test_bf16_parameters_reduce_in_the_reduce_dtype(multidevice_test, reduce_dtype):
    """A GPT stack whose parameters are stored in bf16 (as FSDP2's ``MixedPrecisionPolicy(
    reduce_dtype=float32)`` on bf16 weights): gathered in bf16, each layer's gradients
    reduce-scattered in ``reduce_dtype`` (float32: 4 bytes an element; None: bf16's 2) and
    held in bf16; the gradients those of the float32 model within bf16's precision."""
    d = multidevice_test.size
    if d == 1:
        pytest.skip("nothing is communicated on one rank")
    b, s, e, heads, n = 2, 4, 8, 2, 2
    mesh = NamedMesh(DeviceMesh(range(d)), ("dp",))
    fd = GptStack(b, s, e, heads, n, mesh, dtype=DataType.BFloat16)
    tvs, init = fd.parameter_inputs(), stack_parameters(e, n, torch.bfloat16)
    layers = [[f"{k}_{p}" for p in gpt_shapes(e)] for k in range(n)]
    model = FullyShardedModule(fd, {p: (tvs[p], init[p]) for p in tvs}, layers,
                               [fd.input, fd.target], mesh,
                               mp_policy=MixedPrecision(reduce_dtype=reduce_dtype))
    gen = torch.Generator().manual_seed(0)
    x, target = (torch.randn(b, s, e, generator=gen).to(torch.bfloat16) for _ in range(2))
    with record_communications() as log:
        loss = model(model.shard_input(fd.input, x), model.shard_input(fd.target, target))
        loss.backward()
    ref = {p: torch.nn.Parameter(t.float()) for p, t in init.items()}
    gpt_loss(x.float(), target.float(), ref, n, heads).backward()
    for name, tv in tvs.items():
        grad = getattr(model, name).grad
        assert grad.dtype == torch.bfloat16, name
        want = shard_tensor(ref[name].grad, model.sharded.storage(tv))
        torch.testing.assert_close(grad.float(), want, rtol=5e-2, atol=2e-2, msg=name)
    padded = sum(math.ceil(shape[0] / d) * math.prod(shape[1:])
                 for shape in gpt_shapes(e).values())  # a layer's elements per rank
    width = 2 if reduce_dtype is None else 4
    assert [c.bytes for c in log if c.kind == "reduce_scatter"] == [padded * d * width] * n
    # the forward gathers every parameter in bf16 (the backward those it reads again)
    assert [c.bytes for c in log if c.kind == "allgather"][:n] == [padded * 2] * n
