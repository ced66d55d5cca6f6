"""``moe_experts``' saved products: the backward of the routed experts reads the forward's
``h1 = x w1^T`` and ``h3 = x w3^T`` (token-slot order, ``[T, K, 2, F]``) instead of
recomputing them, on one rank's experts (unsharded, tokens split, ffn split), and recomputes
them where expert parallelism runs the experts, EP x DP too (where a fusion reads them
itself, they come back with one more exchange). Tokens ``[T, H]`` or ``[B, S, H]`` (saved
``[B, S, K, 2, F]``). Float64 against plain PyTorch; the grouped GEMMs each way counted (3
forward; 6 backward with saved products, 8 without)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from mesh_helpers import mesh_1d, mesh_2x2, shard

from meshfuse import FusionDefinition, ParallelType, shard_tensor
from meshfuse.examples.moe import (
    PARAMS,
    MoEConfig,
    define_moe_block,
    expert_parallel,
    init_params,
    moe_block_torch,
    route_torch,
)
from meshfuse.ops.moe import kernels
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

TOL = {"rtol": 1e-9, "atol": 1e-9}
GEMMS = ("grouped_rows_mm", "grouped_outer")


def _schedule(layout: str, tv: dict, y, counts, mesh) -> None:
    """``dp``: the tokens split (experts whole on every rank; ``seq``: the second token axis
    of ``[B, S, H]``); ``tp``: the experts' ffn split (tokens whole); ``ep``: expert
    parallel; ``ep_dp``: a 2 x n/2 mesh, the tokens over mesh_y and mesh_x, the experts
    over mesh_x."""
    if layout in ("ep", "ep_dp"):
        dp = ParallelType.mesh_y if layout == "ep_dp" else None
        expert_parallel(tv, y, counts, mesh, dp=dp)
        return
    for t in (*tv.values(), y, counts):
        t.set_device_mesh(mesh)
    if layout in ("dp", "seq"):
        for t in (tv["x"], y):
            shard(t, 1 if layout == "seq" else 0, mesh)
    else:
        for name, axis in (("w1", 1), ("w2", 2), ("w3", 1)):
            shard(tv[name], axis, mesh)


def _counting(monkeypatch) -> Counter:
    """Counts the calls of the grouped GEMMs (``kernels``' two forms)."""
    calls = Counter()

    def counting(name: str, fn):
        def counted(*args):
            calls[name] += 1
            return fn(*args)
        return counted

    for name in GEMMS:
        monkeypatch.setattr(kernels, name, counting(name, getattr(kernels, name)))
    return calls


def _run(multidevice_test, monkeypatch, layout: str, cfg: MoEConfig, tokens, mesh=None):
    """The block fwd+bwd on this test's ranks (``tokens``: ``T`` or ``(B, S)``) against
    PyTorch; returns the grouped GEMMs counted in the forward and in the backward."""
    rank = multidevice_test.rank
    with FusionDefinition() as fd:
        tv, y_tv, counts_tv = define_moe_block(fd, cfg, tokens)
    if layout != "none":
        _schedule(layout, tv, y_tv, counts_tv, mesh or mesh_1d(multidevice_test))
    params = init_params(cfg)
    gen = torch.Generator().manual_seed(1)
    shape = (tokens,) if isinstance(tokens, int) else tokens
    x = torch.randn(*shape, cfg.dim, generator=gen, dtype=torch.float64)
    dy = torch.randn(*shape, cfg.dim, generator=gen, dtype=torch.float64)
    leaves = {n: t.clone().requires_grad_() for n, t in {"x": x, **params}.items()}
    y_ref, _ = moe_block_torch({n: leaves[n] for n in PARAMS}, leaves["x"], cfg)
    y_ref.backward(dy)

    def mine(t, tv_):
        return t if layout == "none" else shard_tensor(t, tv_, rank)

    names = ["x", *PARAMS]
    local = [mine(leaves[n].detach(), tv[n]).to(current_device()).requires_grad_()
             for n in names]
    calls = _counting(monkeypatch)
    y, _ = fd.as_autograd_function()(local)
    forward = Counter(calls)
    y.backward(mine(dy, y_tv).to(current_device()))
    torch.testing.assert_close(y.detach().cpu(), mine(y_ref.detach(), y_tv), **TOL)
    for n, leaf in zip(names, local):
        torch.testing.assert_close(leaf.grad.cpu(), mine(leaves[n].grad, tv[n]), **TOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return forward, calls - forward


def test_unsharded_block_backward_reads_saved_products(monkeypatch):
    """One device: 3 grouped GEMMs forward, 6 backward (u = g w2, three weight gradients,
    two products back to the rows): neither y nor h1, h3 recomputed."""
    cfg = MoEConfig(experts=5, top_k=2, ffn=6)
    forward, backward = _run(type("One", (), {"rank": 0, "size": 1}), monkeypatch,
                             "none", cfg, 9)
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 3, "grouped_outer": 3})


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_sharded_block_backward_reads_saved_products(multidevice_test, monkeypatch, layout):
    """Tokens split (uneven at 3 and 4 ranks: each rank saves its tokens' products) or the
    experts' ffn split (each rank saves its part of F): the saved products are read."""
    cfg = MoEConfig(experts=6, top_k=3, ffn=8)
    forward, backward = _run(multidevice_test, monkeypatch, layout, cfg, 11)
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 3, "grouped_outer": 3})


def test_unsharded_block_of_batch_and_sequence_reads_saved_products(monkeypatch):
    """Tokens ``[B, S, H]``: the saved products ``[B, S, K, 2, F]`` are read as well."""
    cfg = MoEConfig(experts=5, top_k=2, ffn=6)
    forward, backward = _run(type("One", (), {"rank": 0, "size": 1}), monkeypatch,
                             "none", cfg, (2, 5))
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 3, "grouped_outer": 3})


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["dp", "seq", "tp"])
def test_sharded_block_of_batch_and_sequence_reads_saved_products(multidevice_test,
                                                                   monkeypatch, layout):
    """Tokens ``[B, S, H]`` split over the batch or the sequence (uneven at 3 and 4 ranks),
    or the ffn split: each rank saves and reads its part of ``[B, S, K, 2, F]``."""
    cfg = MoEConfig(experts=6, top_k=3, ffn=8)
    forward, backward = _run(multidevice_test, monkeypatch, layout, cfg, (3, 5))
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 3, "grouped_outer": 3})


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [13, (2, 7)], ids=["tokens", "batch_seq"])
def test_expert_and_data_parallel_backward_recomputes_products(multidevice_test,
                                                                monkeypatch, tokens):
    """EP x DP (2 x n/2 meshes at 4 ranks): expert-parallel within each data-parallel
    group, so the backward recomputes h1 and h3 where the experts live, as under EP."""
    mesh = mesh_2x2(multidevice_test)
    cfg = MoEConfig(experts=5, top_k=2)
    forward, backward = _run(multidevice_test, monkeypatch, "ep_dp", cfg, tokens, mesh)
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 5, "grouped_outer": 3})


@pytest.mark.mpi
def test_expert_parallel_backward_recomputes_products(multidevice_test, monkeypatch):
    """Expert-parallel, the rows of a rank's tokens are computed on the experts' ranks: the
    backward recomputes h1 and h3 there (two more grouped GEMMs), y still not; a rank
    without experts runs its GEMMs on no rows."""
    cfg = MoEConfig(experts=5, top_k=2)
    forward, backward = _run(multidevice_test, monkeypatch, "ep", cfg, 13)
    assert forward == Counter({"grouped_rows_mm": 3})
    assert backward == Counter({"grouped_rows_mm": 5, "grouped_outer": 3})


@pytest.mark.mpi
@pytest.mark.parametrize("tokens", [9, (2, 5)], ids=["tokens", "batch_seq"])
def test_expert_parallel_saved_products_come_back_when_read(multidevice_test, tokens):
    """Expert-parallel, a fusion that reads the saved products itself gets them (each
    rank its tokens' slots, ``x w1^T`` and ``x w3^T`` of the slot's expert; ``[B, S, H]``
    tokens: the sequence split, ``saved [B, S, K, 2, F]`` likewise) with one more ragged
    all-to-all than the forward's two (none alone on the mesh axis)."""
    cfg = MoEConfig(experts=5, top_k=2)
    shape = (tokens,) if isinstance(tokens, int) else tokens
    with FusionDefinition() as fd:
        tv, y, counts = define_moe_block(fd, cfg, tokens)
        op = next(e for e in fd.fusion.exprs if getattr(e.op, "name", "") == "moe_experts")
        saved = op.outputs[2]
        fd.add_output(saved)
    mesh = mesh_1d(multidevice_test)
    expert_parallel(tv, y, counts, mesh)
    shard(saved, len(shape) - 1, mesh)
    rank = multidevice_test.rank
    glob = {"x": torch.randn(*shape, cfg.dim, dtype=torch.float64), **init_params(cfg)}
    indices = route_torch(glob["x"], glob["gate"], cfg)[1]
    expected = torch.stack([torch.einsum("...kfh,...h->...kf", glob[w][indices], glob["x"])
                            for w in ("w1", "w3")], -2)
    with record_communications() as comms:
        *_, got = fd.execute([shard_tensor(glob[n], tv[n], rank) for n in ["x", *PARAMS]])
    torch.testing.assert_close(got, shard_tensor(expected, saved, rank), **TOL)
    moved = Counter(c.kind for c in comms)["ragged_all_to_all"]
    assert moved == (3 if multidevice_test.size > 1 else 0)
