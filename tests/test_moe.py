"""Mixture-of-experts blocks (meshfuse.examples.moe) against plain PyTorch, float64: the
routed experts alone and expert-parallel (tokens and experts split over the ranks, dispatch
and combine a ragged all-to-all), with expert tensor parallelism, routings that leave
experts or ranks without tokens, and the communications asserted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from mesh_helpers import mesh_1d

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType, shard_tensor
from meshfuse.examples.moe import (
    PARAMS,
    MoEConfig,
    define_moe_block,
    expert_parallel,
    init_params,
    moe_block_torch,
    route_torch,
)
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

TOL = {"rtol": 1e-9, "atol": 1e-9}


def _block(cfg, tokens, mesh=None, tp=None):
    with FusionDefinition() as fd:
        tv, y, counts = define_moe_block(fd, cfg, tokens)
    if mesh is not None:
        ep = ParallelType.mesh_y if tp is not None else ParallelType.mesh_x
        expert_parallel(tv, y, counts, mesh, ep=ep, tp=tp)
    return fd, tv, y, counts


def _reference(params, x, cfg, dy, bias=None):
    leaves = {n: t.clone().requires_grad_() for n, t in {"x": x, **params}.items()}
    y, counts = moe_block_torch({n: leaves[n] for n in PARAMS}, leaves["x"], cfg, bias)
    y.backward(dy)
    return y.detach(), counts, {n: t.grad for n, t in leaves.items()}


def _run(multidevice_test, cfg, tokens, x=None, tp=None, mesh=None, bias=None):
    """The block on this test's ranks against the reference (``bias``: the routing bias
    of a ``biased`` block): returns the communications of the forward and the backward."""
    mesh = mesh if mesh is not None else mesh_1d(multidevice_test)
    fd, tv, y_tv, counts_tv = _block(cfg, tokens, mesh, tp)
    return _run_fd(multidevice_test, cfg, x, fd, tv, y_tv, counts_tv, bias)


def _run_fd(multidevice_test, cfg, x, fd, tv, y_tv, counts_tv, bias=None):
    rank = multidevice_test.rank
    params = init_params(cfg)
    x = _tokens(tuple(i.extent for i in tv["x"].logical[:-1]), cfg.dim) if x is None else x
    dy = _tokens(x.shape[:-1], cfg.dim, seed=2)
    y_ref, counts_ref, grads = _reference(params, x, cfg, dy, bias)
    names = ["x", *PARAMS]
    glob = {"x": x, **params}
    local = [shard_tensor(glob[n], tv[n], rank).to(current_device()).requires_grad_()
             for n in names]
    extra = [] if bias is None else [shard_tensor(bias, tv["bias"], rank).to(current_device())]
    f = fd.as_autograd_function()
    with record_communications() as forward:
        y, counts = f(local + extra)
    torch.testing.assert_close(y.detach().cpu(), shard_tensor(y_ref, y_tv, rank), **TOL)
    torch.testing.assert_close(counts.cpu(), shard_tensor(counts_ref, counts_tv, rank))
    with record_communications() as backward:
        y.backward(shard_tensor(dy, y_tv, rank).to(current_device()))
    for n, leaf in zip(names, local):
        torch.testing.assert_close(leaf.grad.cpu(), shard_tensor(grads[n], tv[n], rank),
                                   **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return forward, backward


def _kinds(comms):
    return Counter(c.kind for c in comms)


def _off_rank_slots(indices, experts, size, rank, owner=None):
    """``(sent, received)``: token slots of ``rank``'s tokens routed to another rank's
    experts, and slots of other ranks' tokens routed to ``rank``'s (experts in blocks of
    ``ceil(n / size)``; tokens too, or as ``owner`` (the rank of each token) says)."""
    per_token, per_expert = -(-indices.shape[0] // size), -(-experts // size)
    owner = torch.arange(indices.shape[0]) // per_token if owner is None else owner
    token_owner = owner.unsqueeze(1).expand_as(indices)
    expert_owner = indices // per_expert
    sent = int(((token_owner == rank) & (expert_owner != rank)).sum())
    received = int(((token_owner != rank) & (expert_owner == rank)).sum())
    return sent, received


def _assert_exchanges(forward, backward, indices, cfg, size, coordinate,
                      dp=None, tp=None, owner=None):
    """One split-size exchange and two ragged all-to-alls each way over the expert group
    (``size`` ranks, this one at ``coordinate``; see :func:`_assert_expert_exchanges`).
    Besides: ``dp`` in the backward (default: one allreduce of the router's and the shared
    expert's gradients when the tokens are split), ``tp`` each way (expert tensor
    parallelism's partial sums)."""
    ep = Counter({"split_sizes": 1, "ragged_all_to_all": 2}) if size > 1 else Counter()
    tp = (Counter(), Counter()) if tp is None else tp
    dp = (Counter({"allreduce": 1}) if size > 1 else Counter()) if dp is None else dp
    assert _kinds(forward) == ep + tp[0] and _kinds(backward) == ep + dp + tp[1]
    _assert_expert_exchanges(forward, backward, indices, cfg, size, coordinate, owner=owner)


def _assert_expert_exchanges(forward, backward, indices, cfg, size, coordinate,
                             mesh_axis=0, owner=None):
    """The expert group's exchanges (on ``mesh_axis``), for ``indices`` the routing of the
    group's tokens: one split-size exchange and two ragged all-to-alls each way; their
    bytes are the token rows that leave this rank (float64): the forward's dispatch and
    combine carry ``dim`` values a row, the backward's ``2 dim + 1`` (the row, its
    cotangent and its weight) out and ``dim + 1`` back (its gradient and its weight's)."""
    kinds = ("split_sizes", "ragged_all_to_all")
    for comms in (forward, backward):
        ours = [c for c in comms if c.kind in kinds]
        assert _kinds(ours) == (Counter({"split_sizes": 1, "ragged_all_to_all": 2})
                                if size > 1 else Counter())
        assert all(c.mesh_axis == mesh_axis for c in ours)
    if size == 1:
        return
    sent, received = _off_rank_slots(indices, cfg.experts, size, coordinate, owner)
    h = cfg.dim
    moved = [c.bytes for c in forward + backward if c.kind == "ragged_all_to_all"]
    assert moved == [8 * sent * h, 8 * received * h, 8 * sent * (2 * h + 1),
                     8 * received * (h + 1)]
    split_sizes = [c.bytes for c in forward + backward if c.kind == "split_sizes"]
    assert split_sizes == [8 * size * -(-cfg.experts // size)] * 2


def _indices(cfg, x, bias=None):
    return route_torch(x, init_params(cfg)["gate"], cfg, bias)[1]


def _tokens(n, dim, seed=1):
    """Tokens ``[n, dim]``, or ``[*n, dim]`` for a tuple ``n``."""
    shape = (n,) if isinstance(n, int) else tuple(n)
    return torch.randn(*shape, dim, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("experts", [8, 5])
def test_expert_parallel_block_equals_torch(multidevice_test, experts):
    """8 experts, and 5 that do not divide 2, 3 or 4 ranks (at 4 ranks: 2, 2, 1, 0: the
    last rank holds no expert and receives no token)."""
    cfg = MoEConfig(experts=experts, top_k=2)
    x = _tokens(13, cfg.dim)
    forward, backward = _run(multidevice_test, cfg, 13, x)
    _assert_exchanges(forward, backward, _indices(cfg, x), cfg, multidevice_test.size,
                      multidevice_test.rank)


@pytest.mark.mpi
def test_routing_to_the_first_experts_leaves_ranks_empty(multidevice_test):
    """A routing bias sends every token to experts 0 and 1 (both on rank 0 at any size):
    the other ranks' experts compute nothing, their gradients are zero, and rank 0 sends
    nothing to the others (DeepSeek-V3's sigmoid scores, groups of experts, the bias steering
    the choice only)."""
    cfg = MoEConfig(experts=8, top_k=2, groups=4, top_groups=2, biased=True)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[:2] = 10.0
    x = _tokens(11, cfg.dim)
    indices = _indices(cfg, x, bias)
    assert set(indices.reshape(-1).tolist()) == {0, 1}
    forward, backward = _run(multidevice_test, cfg, 11, x, bias=bias)
    _assert_exchanges(forward, backward, indices, cfg, multidevice_test.size,
                      multidevice_test.rank)


def _mesh_2d(multidevice_test, rows: int) -> DeviceMesh:
    """``rows`` x ``size / rows`` ranks; skips the test unless it runs on 4 or 8 ranks."""
    if multidevice_test.size not in (4, 8):
        pytest.skip("a 2-D mesh of experts needs 4 or 8 ranks")
    return DeviceMesh(torch.arange(multidevice_test.size).reshape(rows, -1))


@pytest.mark.mpi
def test_expert_and_tensor_parallel_block_equals_torch(multidevice_test):
    """2x2 and 4x2 meshes: experts and tokens over mesh_y, the experts' ffn over mesh_x
    (expert tensor parallelism): each ffn shard's routed output is a partial sum, reduced
    once. 6 experts: at 4x2 the last expert rank holds none."""
    mesh = _mesh_2d(multidevice_test, multidevice_test.size // 2)
    cfg = MoEConfig(experts=6, top_k=3, ffn=8)
    x = _tokens(10, cfg.dim)
    forward, backward = _run(multidevice_test, cfg, 10, x, tp=ParallelType.mesh_x, mesh=mesh)
    # forward: the routed output; backward: x's and the routing weights' gradients
    tp = (Counter({"allreduce": 1}), Counter({"allreduce": 2}))
    _assert_exchanges(forward, backward, _indices(cfg, x), cfg, mesh.shape[0],
                      multidevice_test.rank // 2, tp=tp)


@pytest.mark.mpi
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("tokens", [13, (2, 7)], ids=["tokens", "batch_seq"])
def test_expert_and_data_parallel_block_equals_torch(multidevice_test, biased, tokens):
    """2x2 and 2x4 meshes: the tokens split over mesh_y (data parallel; ``[batch, seq,
    dim]`` tokens: the batch) then mesh_x (the sequence), the experts over mesh_x (expert
    parallel; 5 experts: 2, 2, 1, 0 at 4 expert ranks): each data-parallel group dispatches
    its own tokens among its expert ranks, and the experts' gradients and token counts are
    partial over mesh_y, reduced there once. ``biased``: every token routed to experts 0
    and 1 (the other expert ranks get none)."""
    mesh = _mesh_2d(multidevice_test, 2)
    cfg = MoEConfig(experts=5, top_k=2, biased=biased)
    bias = torch.tensor([10.0, 10.0, 0, 0, 0], dtype=torch.float64) if biased else None
    x = _tokens(tokens, cfg.dim)
    fd, tv, y_tv, counts_tv = _block(cfg, tokens)
    expert_parallel(tv, y_tv, counts_tv, mesh, ep=ParallelType.mesh_x, dp=ParallelType.mesh_y)
    forward, backward = _run_fd(multidevice_test, cfg, x, fd, tv, y_tv, counts_tv, bias)
    dp, ep = divmod(multidevice_test.rank, mesh.shape[1])
    indices = _indices(cfg, x, bias)
    group = indices[7 * dp:7 * (dp + 1)] if x.ndim == 2 else indices[dp]  # 7 and 6 tokens
    n = mesh.shape[1]
    owner = torch.arange(group.shape[0]) // -(-7 // n)
    _assert_expert_exchanges(forward, backward, group, cfg, n, ep, 1, owner)
    # over mesh_y, one allreduce each way: the counts in the forward, the experts'
    # gradients (one bucket) in the backward (the router's and the shared expert's
    # gradients are reduced over both mesh axes besides)
    per = -(-cfg.experts // n)
    local = max(0, min(per, cfg.experts - ep * per))
    assert [(c.mesh_axis, c.bytes) for c in forward if c.kind == "allreduce"] == \
        [(0, 4 * local)]
    grads = 8 * 3 * local * cfg.ffn * cfg.dim
    assert [c.mesh_axis for c in backward if c.kind == "allreduce" and c.bytes == grads] == \
        [0]


@pytest.mark.mpi
def test_expert_parallel_block_of_batch_and_sequence_equals_torch(multidevice_test):
    """Tokens ``[batch, seq, dim]`` (as torchtitan's and Hugging Face's blocks hold them),
    the sequence and the experts split over the ranks (uneven at 3 and 4 ranks)."""
    cfg = MoEConfig(experts=6, top_k=2)
    x = _tokens((3, 5), cfg.dim)
    mesh = mesh_1d(multidevice_test)
    fd, tv, y_tv, counts_tv = _block(cfg, (3, 5), mesh)
    forward, backward = _run_fd(multidevice_test, cfg, x, fd, tv, y_tv, counts_tv)
    size, rank = multidevice_test.size, multidevice_test.rank
    owner = (torch.arange(5) // -(-5 // size)).repeat(3)  # each token's rank, row-major
    _assert_exchanges(forward, backward, _indices(cfg, x).reshape(-1, 2), cfg, size, rank,
                      owner=owner,  # the router's and shared expert's gradients: 4 allreduces
                      dp=Counter({"allreduce": 4}) if size > 1 else Counter())


@pytest.mark.mpi
def test_capacity_drops_the_last_tokens_of_full_experts(multidevice_test):
    """Capacity factor 0.5: an expert computes at most its first ceil(0.5 * 14 * 2 / 4) = 4
    rows by token order (the block's tokens are split in order, so a rank's received rows
    come after those of the ranks before it); the dropped rows add nothing and get no
    gradient. The exchanges are those of the dropless block (every row still travels)."""
    cfg = MoEConfig(experts=4, top_k=2, capacity_factor=0.5)
    x = _tokens(14, cfg.dim)
    indices = _indices(cfg, x)
    assert torch.bincount(indices.reshape(-1)).max() > cfg.capacity(14) == 4  # drops
    forward, backward = _run(multidevice_test, cfg, 14, x)
    _assert_exchanges(forward, backward, indices, cfg, multidevice_test.size,
                      multidevice_test.rank)


@pytest.mark.mpi
def test_load_balancing_losses_equal_torch_with_tokens_split(multidevice_test):
    """The switch loss and the auxiliary-loss-free bias update from router logits whose
    tokens are split over the ranks (uneven at 3 and 4): the per-expert counts and mean
    scores are partial sums, reduced before their product."""
    t, e, k = 10, 6, 2
    with FusionDefinition() as fd:
        logits = fd.define_tensor([t, e], dtype=DataType.Double)
        bias = fd.define_tensor([e], dtype=DataType.Double)
        scores = fd.ops.softmax(logits, -1)
        _, indices = fd.ops.moe_route(logits, top_k=k)
        loss = fd.ops.moe_aux_loss(scores, indices)
        updated = fd.ops.moe_bias_update(bias, indices, 0.01)
        fd.add_output(loss)
        fd.add_output(updated)
    mesh = mesh_1d(multidevice_test)
    for tv in (logits, bias, loss, updated):
        tv.set_device_mesh(mesh)
    logits.outer_split(0, mesh.size)
    logits.axis(0).parallelize(ParallelType.mesh_x)
    x = _tokens(t, e)
    b = torch.linspace(-0.1, 0.1, e, dtype=torch.float64)
    got_loss, got_bias = fd.execute([shard_tensor(x, logits, multidevice_test.rank), b])
    probs = x.softmax(-1)
    idx = probs.topk(k, -1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=e).double()
    want = e * ((counts / (t * k)) * probs.mean(0)).sum()
    torch.testing.assert_close(got_loss, want, **TOL)
    torch.testing.assert_close(got_bias, b + 0.01 * torch.sign(counts.mean() - counts), **TOL)

