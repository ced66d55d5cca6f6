"""Differentiating whole fusions: shardings and communications of the derived backward,
replica semantics, the remat policy, ``meshfuse.vjp``, FusionModule, and errors.

Every multi-rank test compares each rank's gradients with this rank's shard of the
float64 torch.autograd gradients of the unsharded program, and asserts the collectives the
forward and the backward ran.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

import meshfuse
from meshfuse import DataType, DefinitionError, FusionDefinition, FusionModule, shard_tensor
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

T, H, FFN = 8, 4, 16
TOL = {"rtol": 1e-9, "atol": 1e-9}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _mlp(mesh=None, sequence_parallel=False):
    """``y = gelu(x @ w1.T) @ w2.T``, forward only; weights Megatron-sharded on ``mesh``.
    With ``sequence_parallel`` x and y are split on tokens (x gathered for the first
    linear, y reduce-scattered from the second's partial sum)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([T, H], dtype=DataType.Double)
        w1 = fd.define_tensor([FFN, H], dtype=DataType.Double)
        w2 = fd.define_tensor([H, FFN], dtype=DataType.Double)
        xs = fd.ops.set(x) if sequence_parallel else x
        y = fd.ops.linear(fd.ops.gelu(fd.ops.linear(xs, w1), approximate="tanh"), w2)
        fd.add_output(y)
    if mesh is not None:
        shard(w1, 0, mesh)
        shard(w2, 1, mesh)
        if sequence_parallel:
            shard(x, 0, mesh)
            shard(y, 0, mesh)
            xs.set_device_mesh(mesh)
    return fd, (x, w1, w2), y


def _mlp_reference(x, w1, w2, dy):
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
    y = F.linear(F.gelu(F.linear(leaves[0], leaves[1]), approximate="tanh"), leaves[2])
    return y.detach(), torch.autograd.grad(y, leaves, dy)


def _run_mlp(multidevice_test, sequence_parallel, remat="recompute"):
    mesh = mesh_1d(multidevice_test)
    fd, tvs, y_tv = _mlp(mesh, sequence_parallel)
    rank = multidevice_test.rank
    glob = [_randn(T, H, seed=1), _randn(FFN, H, seed=2), _randn(H, FFN, seed=3)]
    dy = _randn(T, H, seed=4)
    local = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
             for t, tv in zip(glob, tvs)]
    f = fd.as_autograd_function(remat=remat)
    with record_communications() as forward_comms:
        y, = f(local)
    with record_communications() as backward_comms:
        y.backward(shard_tensor(dy, y_tv, rank).to(current_device()))
    y_ref, grads = _mlp_reference(*glob, dy)
    torch.testing.assert_close(y.detach().cpu(), shard_tensor(y_ref, y_tv, rank), **TOL)
    for leaf, ref, tv in zip(local, grads, tvs):
        torch.testing.assert_close(leaf.grad.cpu(), shard_tensor(ref, tv, rank), **TOL)
    kinds = (Counter(c.kind for c in forward_comms), Counter(c.kind for c in backward_comms))
    return fd, kinds, multidevice_test.size


@pytest.mark.mpi
def test_megatron_mlp_gradients_and_communications(multidevice_test):
    """Tensor parallel: the forward's partial-sum resolution (allreduce of y) transposes to
    a replicated cotangent used locally; the replicated x's gradient is a partial sum made
    complete on every rank by one allreduce; the weights' gradients stay sharded."""
    _, (forward, backward), size = _run_mlp(multidevice_test, sequence_parallel=False)
    sharded = size > 1
    assert forward == Counter({"allreduce": 1} if sharded else {})
    assert backward == Counter({"allreduce": 1} if sharded else {})


@pytest.mark.mpi
@pytest.mark.parametrize("remat", ["recompute", "recompute_fused", "recompute_gathers", "save"])
def test_sequence_parallel_allgather_transposes_to_reduce_scatter(multidevice_test, remat):
    """Sequence parallel: x's allgather in the forward is a reduce-scatter of its gradient
    in the backward, and y's reduce-scatter an allgather of its cotangent. The backward
    keeps the gathered x from the forward for w1's gradient (no collective runs twice, as
    with DTensor), except with ``recompute_gathers``, which gathers x again (Megatron-LM's
    schedule: less memory)."""
    _, (forward, backward), size = _run_mlp(multidevice_test, True, remat)
    sharded = size > 1
    gathers = 2 if remat == "recompute_gathers" else 1
    assert forward == Counter({"allgather": 1, "reduce_scatter": 1} if sharded else {})
    assert backward == Counter({"allgather": gathers, "reduce_scatter": 1} if sharded else {})


@pytest.mark.mpi
def test_vjp_backward_prints_and_explains_its_collectives(multidevice_test):
    mesh = mesh_1d(multidevice_test)
    fd, tvs, y_tv = _mlp(mesh, sequence_parallel=True)
    before = str(fd.fusion)
    bwd = meshfuse.vjp(fd)
    assert str(fd.fusion) == before and not fd.fusion.propagated, "the user's fusion changed"
    rank = multidevice_test.rank
    glob = [_randn(T, H, seed=1), _randn(FFN, H, seed=2), _randn(H, FFN, seed=3)]
    inputs = [shard_tensor(t, tv, rank).to(current_device()) for t, tv in zip(glob, tvs)]
    outs = bwd.forward.execute(inputs)
    dy = _randn(T, H, seed=4)
    args = bwd.backward_inputs([shard_tensor(dy, y_tv, rank).to(current_device())], inputs,
                               outs)
    text = bwd.explain(args)
    assert "matmul" in str(bwd) and "gelu_backward" in str(bwd)
    if multidevice_test.size > 1:
        assert "reduce_scatter" in text and "allgather" in text, text
    grads = bwd.input_gradients(bwd.execute(args))
    _, expected = _mlp_reference(*glob, dy)
    for got, ref, tv in zip(grads, expected, tvs):
        torch.testing.assert_close(got.cpu(), shard_tensor(ref, tv, rank), **TOL)


def _assert_same_gradients(first, second) -> None:
    """The MLP's two derived backwards give bitwise the same gradients on one input."""
    glob = [_randn(T, H, seed=1), _randn(FFN, H, seed=2), _randn(H, FFN, seed=3)]
    dy = _randn(T, H, seed=4)
    results = []
    for bwd in (first, second):
        outs = bwd.forward.execute(glob)
        results.append(bwd.execute(bwd.backward_inputs([dy], glob, outs)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_remat_recompute_saves_fewer_residuals_than_save():
    fd, _, _ = _mlp()
    recompute, save = meshfuse.vjp(fd, remat="recompute"), meshfuse.vjp(fd, remat="save")
    kept = [len(b.derivation.residuals) for b in (recompute, save)]
    assert kept[0] < kept[1], kept
    # No matrix product runs twice: the backward's matmuls are the four of the gradients.
    for bwd in (recompute, save):
        assert [e.op.name for e in bwd.fusion.exprs].count("matmul") == 4
    _assert_same_gradients(recompute, save)


def test_remat_recompute_fused_saves_what_the_forward_writes_for_a_product():
    """``recompute_fused`` (the default) keeps the GELU output, which the forward writes for the second
    product anyway, where ``recompute`` computes it again for w2's gradient; the values
    are the same."""
    fd, _, _ = _mlp()
    recompute, fused = meshfuse.vjp(fd, remat="recompute"), meshfuse.vjp(fd)  # the default
    ops = [[e.op.name for e in bwd.fusion.exprs] for bwd in (recompute, fused)]
    assert "gelu" in ops[0] and "gelu" not in ops[1], ops
    saved = [sorted(v.definition.op.name for v in bwd.derivation.source.residuals
                    if v.definition is not None) for bwd in (recompute, fused)]
    assert saved == [["linear"], ["gelu", "linear"]], saved
    _assert_same_gradients(recompute, fused)


@pytest.mark.mpi
@pytest.mark.parametrize("remat", ["recompute", "recompute_fused"])
def test_explain_lists_what_the_forward_saves_for_the_backward(multidevice_test, remat):
    fd, _, _ = _mlp(mesh_1d(multidevice_test))
    f = fd.as_autograd_function(remat=remat)
    glob = [_randn(T, H, seed=1), _randn(FFN, H, seed=2), _randn(H, FFN, seed=3)]
    rank = multidevice_test.rank
    local = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
             for t, tv in zip(glob, fd.fusion.inputs())]
    f(local)[0].sum().backward()
    saved = next(line for line in f.explain(local).splitlines() if "saved for the" in line)
    assert f"(remat={remat!r}): " in saved and "(linear)" in saved and "(input)" in saved
    assert ("(gelu)" in saved) == (remat == "recompute_fused"), saved


def test_remat_policy_is_checked():
    fd, _, _ = _mlp()
    with pytest.raises(DefinitionError, match="remat must be one of"):
        meshfuse.vjp(fd, remat="recompute_all")


def test_wrt_selects_the_gradients():
    fd, (_x, _w1, w2), _ = _mlp()
    bwd = meshfuse.vjp(fd, wrt=[w2])
    assert bwd.derivation.gradients == (None, None, 0)
    assert "gelu_backward" not in str(bwd)  # nothing flows further back than w2 needs


@pytest.mark.parametrize("differentiated", ["y", "both"])
def test_an_output_without_a_gradient_gets_no_zeros(multidevice_test, differentiated):
    """A Megatron MLP that also returns its sharded hidden activation h (as a language model
    returns its logits beside the loss): where only y is differentiated, autograd gives h
    no cotangent and the backward derived without it runs (no zero tensor of h's size is
    made, copied in or added); both differentiated, the whole backward. Gradients are
    torch's; the backward communicates as the one-output MLP's (one allreduce)."""
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x = fd.define_tensor([T, H], dtype=DataType.Double)
        w1 = fd.define_tensor([FFN, H], dtype=DataType.Double)
        w2 = fd.define_tensor([H, FFN], dtype=DataType.Double)
        h = fd.ops.gelu(fd.ops.linear(x, w1), approximate="tanh")
        fd.add_output(h)
        fd.add_output(fd.ops.linear(h, w2))
    shard(w1, 0, mesh)
    shard(w2, 1, mesh)
    shard(h, 1, mesh)
    rank = multidevice_test.rank
    glob = [_randn(T, H, seed=1), _randn(FFN, H, seed=2), _randn(H, FFN, seed=3)]
    dy, dh = _randn(T, H, seed=4), _randn(T, FFN, seed=5)
    local = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
             for t, tv in zip(glob, (x, w1, w2))]
    function = fd.as_autograd_function()
    h_local, y = function(local)
    cotangents = [dy.to(current_device()), shard_tensor(dh, h, rank).to(current_device())]
    with record_communications() as comms:
        if differentiated == "y":
            y.backward(cotangents[0])
        else:
            torch.autograd.backward([y, h_local], cotangents)
    leaves = [t.detach().requires_grad_() for t in glob]
    h_ref = F.gelu(F.linear(leaves[0], leaves[1]), approximate="tanh")
    torch.autograd.backward([F.linear(h_ref, leaves[2]), h_ref],
                            [dy, dh if differentiated == "both" else torch.zeros_like(dh)])
    for leaf, ref, tv in zip(local, leaves, (x, w1, w2)):
        torch.testing.assert_close(leaf.grad.cpu(), shard_tensor(ref.grad, tv, rank), **TOL)
    (compiled,) = function._derivations.values()
    partial = [p for p in compiled._partial.values() if p is not None]
    if differentiated == "y":
        assert [len(p[0].cotangents) for p in partial] == [1] and compiled._backward is None
    else:
        assert not partial and compiled._backward is not None
    assert Counter(c.kind for c in comms) == Counter({"allreduce": 1} if mesh.size > 1 else {})


def test_a_replicated_output_used_twice_and_an_unused_input():
    with FusionDefinition() as fd:
        a = fd.define_tensor([3, 4], dtype=DataType.Double)
        fd.define_tensor([3, 4], dtype=DataType.Double)
        fd.add_output(fd.ops.mul(a, a))
        fd.add_output(fd.ops.sin(a))
    x = _randn(3, 4, seed=0).requires_grad_()
    y = _randn(3, 4, seed=1).requires_grad_()
    p, q = fd.as_autograd_function()([x, y])
    (p.sum() + 2 * q.sum()).backward()
    torch.testing.assert_close(x.grad, 2 * x.detach() + 2 * torch.cos(x.detach()))
    assert y.grad is None  # unused, as in PyTorch


def test_errors_name_the_problem():
    fd, (_x, _, _), _ = _mlp()
    with pytest.raises(DefinitionError, match="remat"):
        meshfuse.vjp(fd, remat="sometimes")
    with FusionDefinition() as other:
        z = other.define_tensor([2], dtype=DataType.Double)
        i = other.define_tensor([2], dtype=DataType.Int)
        other.add_output(other.ops.gelu_backward(z, z))
        other.add_output(other.ops.cast(i, DataType.Double))
    with pytest.raises(DefinitionError, match="wrt: .* not a tensor input"):
        meshfuse.vjp(fd, wrt=[z])
    with pytest.raises(DefinitionError, match="only floating-point inputs"):
        meshfuse.vjp(other, wrt=[i])
    with pytest.raises(DefinitionError, match="gelu_backward has no derivative rule"):
        meshfuse.vjp(other)
    with FusionDefinition() as symbolic:
        s = symbolic.define_tensor([-1, 4], dtype=DataType.Double)
        symbolic.add_output(symbolic.ops.sum(s, dims=[0]))
    with pytest.raises(DefinitionError, match="symbolic.*static extents"):
        meshfuse.vjp(symbolic)


@pytest.mark.mpi
def test_fusion_module_trains_like_torch(multidevice_test):
    """A tensor-parallel MLP as a FusionModule: five SGD steps from the same weights give
    the single-device model's losses and weights (shards)."""
    mesh = mesh_1d(multidevice_test)
    fd, (_x, w1, w2), _ = _mlp(mesh)
    init = {"w1": _randn(FFN, H, seed=2), "w2": _randn(H, FFN, seed=3)}
    layer = FusionModule(fd, {"w1": (w1, init["w1"]), "w2": (w2, init["w2"])})
    layer.to(current_device())
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.values(), lr=0.1)
    for step in range(5):
        data = _randn(T, H, seed=10 + step)
        loss = layer(data.to(current_device())).pow(2).mean()
        ref_loss = F.linear(F.gelu(F.linear(data, ref["w1"]), approximate="tanh"),
                            ref["w2"]).pow(2).mean()
        torch.testing.assert_close(loss.item(), ref_loss.item(), **TOL)
        for o, l_ in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            l_.backward()
            o.step()
    for name, tv in (("w1", w1), ("w2", w2)):
        torch.testing.assert_close(getattr(layer, name).detach().cpu(),
                                   shard_tensor(ref[name].detach(), tv, multidevice_test.rank),
                                   **TOL)


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [None, 0, 1], ids=["whole", "batch-sharded", "seq-sharded"])
def test_linear_weight_gradient_merges_only_whole_token_axes(multidevice_test, axis):
    """A linear's weight gradient is one product over its token axes merged when none of
    them is split over devices; with the batch or the sequence split (uneven at 3 ranks) it
    stays a batch of products summed (a merge would leave a rank no block of the merged
    axis): the gradients equal torch's either way."""
    size, rank = multidevice_test.size, multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 7, 6], dtype=DataType.Double)
        w = fd.define_tensor([5, 6], dtype=DataType.Double)
        fd.add_output(fd.ops.linear(x, w, None))
    if size > 1:
        mesh = mesh_1d(multidevice_test)
        w.set_device_mesh(mesh)
        if axis is None:
            x.set_device_mesh(mesh)
        else:
            shard(x, axis, mesh)
    xs, ws, dy = _randn(4, 7, 6, seed=0), _randn(5, 6, seed=1), _randn(4, 7, 5, seed=2)
    leaves = [shard_tensor(xs, x, rank).to(current_device()).requires_grad_(),
              ws.clone().to(current_device()).requires_grad_()]
    function = fd.as_autograd_function()
    y, = function(leaves)
    y.backward(shard_tensor(dy, fd.fusion.outputs()[0], rank).to(current_device()))
    ref_x, ref_w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    F.linear(ref_x, ref_w).backward(dy)
    torch.testing.assert_close(leaves[0].grad.cpu(), shard_tensor(ref_x.grad, x, rank))
    torch.testing.assert_close(leaves[1].grad.cpu(), ref_w.grad)
    backward = next(iter(function._derivations.values())).derivation.backward
    products = [e for e in backward.exprs if e.op.name == "matmul"]
    merged = [len(e.tensor_inputs[1].materialized()) == 2 for e in products]
    sharded = axis is not None and size > 1
    assert merged.count(True) == (1 if not sharded else 0) + 1  # + the input gradient's
