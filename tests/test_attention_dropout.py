"""Sharded attention dropout: per-shard streams (default) and the global-mask mode.

The masks are read off the outputs, whatever kernel drew them: with ``v`` the identity
(``Skv == Ev``), ``attn`` is the dropped-out probability matrix itself, zero exactly where an
element was dropped. With identical q, k (and v) in every head and batch, the masks are the
only thing that differs between heads, so two heads with the same pattern would mean two
shards sharing a stream.
"""

from __future__ import annotations

import math

import pytest
import torch
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import (
    DataType,
    DefinitionError,
    DeviceMesh,
    FusionDefinition,
    unshard_tensor,
)
from meshfuse.examples.seed_sdpa import QkvFormat, SeedAttention, random_inputs
from meshfuse.ops.attention.rules import state_stays_inside
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.sharding import shard_tensor
from meshfuse.testing.utils import current_device

P, SEED, OFFSET, SCALE = 0.25, 99, 3, 0.5
S = 16  # query and key length, and head dim (v is the identity)


class Dropout(FusionDefinition):
    """Attention forward and backward with dropout; outputs attn, q_grad, k_grad, v_grad."""

    def __init__(self, b, h, mode=None, causal=False, seeded=True, p=P):
        super().__init__()
        self.shape, self.mode, self.causal, self.seeded, self.p = [b, h, S, S], mode, causal, \
            seeded, p

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor(self.shape, dtype=DataType.BFloat16)
                                          for _ in range(4))
        seeds = {}
        if self.seeded:
            seeds = {"rng_seed": self.define_scalar(dtype=DataType.Int),
                     "rng_offset": self.define_scalar(dtype=DataType.Int)}
        self.attn, lse, seed, offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, self.p, self.causal, SCALE, dropout_mode=self.mode, **seeds)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, lse, self.p,
                                        self.causal, seed, offset, SCALE)
        for t in (self.attn, *self.grads):
            self.add_output(t)

    def tensors(self):
        self.define()
        return (self.q, self.k, self.v, self.g, self.attn, *self.grads)


def _global_inputs(b, h):
    """q, k alike in every head and batch, v the identity, g random: [b, h, S, S] bf16."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, S, generator=gen).expand(b, h, S, S) for _ in range(2))
    v = torch.eye(S).expand(b, h, S, S)
    g = torch.randn(b, h, S, S, generator=gen)
    return [t.to(torch.bfloat16).contiguous().to(current_device()) for t in (q, k, v, g)]


def _schedule(fd, mesh, axes):
    """Shards every tensor of ``fd``: ``axes`` is a list of (logical axis, parallel type)."""
    for t in fd.tensors():
        for axis, pt in axes:
            shard(t, axis, mesh, pt)


def _run(multidevice_test, fd, global_inputs, seed=SEED, offset=OFFSET):
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(global_inputs, fd.tensors())]
    scalars = [seed, offset] if fd.seeded else []
    with record_communications() as comms:
        outputs = fd.execute(local + scalars)
    assert comms == [], f"head, batch and query splits need no communication, got {comms}"
    return local, outputs


def _gather(multidevice_test, local: torch.Tensor, tv) -> torch.Tensor:
    shards = multidevice_test.communicator.allgather_object(local.cpu())
    if tv.mesh is None:
        return shards[0]
    return unshard_tensor([shards[r] for r in tv.mesh.device_ids], tv)


def _reference_grads(q, k, v, g, keep, causal, p=P):
    """Gradients of softmax(q k^T * scale) * keep / (1 - p) @ v in float64 (autograd)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-2, -1) * SCALE
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(),
                                    -math.inf)
    out = (torch.softmax(scores, -1) * keep / (1 - p)) @ leaves[2]
    out.backward(g.double())
    return out.detach(), [t.grad for t in leaves]


def _assert_close(name, actual, expected):
    atol = 1e-2 * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, rtol=1.6e-2, atol=atol, msg=name)


def _kept(attn: torch.Tensor, causal: bool) -> torch.Tensor:
    """The keep mask read off ``attn`` (v = identity): nonzero where kept."""
    keep = attn != 0
    if causal:  # above the diagonal nothing is attended: count those as kept (mask-free)
        keep |= ~torch.ones(S, S, dtype=torch.bool, device=attn.device).tril()
    return keep


SCHEDULES = {
    "heads": [(1, MX)],
    "batch": [(0, MX)],
}


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", list(SCHEDULES))
def test_every_head_has_its_own_mask(multidevice_test, split, causal):
    """Shard mode: distinct patterns for every (batch, head) on every rank, a kept fraction
    of about 1 - p, and gradients equal to autograd's with the mask the forward drew."""
    d = multidevice_test.size
    b, h = (2, 2 * d) if split == "heads" else (2 * d, 2)
    fd = Dropout(b, h, causal=causal)
    _schedule(fd, mesh_1d(multidevice_test), SCHEDULES[split])
    local, (attn, *grads) = _run(multidevice_test, fd, _global_inputs(b, h))

    keep = _kept(attn, causal)
    ref_attn, ref_grads = _reference_grads(*local, keep, causal)
    _assert_close("attn", attn, ref_attn)
    for name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), grads, ref_grads):
        _assert_close(name, grad, ref)

    patterns = _gather(multidevice_test, keep, fd.attn).flatten(0, 1).flatten(1)
    assert len({tuple(p.tolist()) for p in patterns}) == b * h, "two heads share a mask"
    attended = b * h * (S * (S + 1) // 2 if causal else S * S)
    kept = patterns.sum().item() - (b * h * S * (S - 1) // 2 if causal else 0)
    sigma = math.sqrt(P * (1 - P) / attended)
    assert abs(kept / attended - (1 - P)) < 5 * sigma


@pytest.mark.mpi
def test_2d_mesh_batch_and_heads(multidevice_test):
    mesh = mesh_2x2(multidevice_test)
    fd = Dropout(2, 4)
    _schedule(fd, mesh, [(0, MY), (1, MX)])
    local, (attn, *grads) = _run(multidevice_test, fd, _global_inputs(2, 4))
    keep = _kept(attn, False)
    _, ref_grads = _reference_grads(*local, keep, False)
    for name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), grads, ref_grads):
        _assert_close(name, grad, ref)
    patterns = _gather(multidevice_test, keep, fd.attn).flatten(0, 1).flatten(1)
    assert len({tuple(p.tolist()) for p in patterns}) == 8


@pytest.mark.mpi
def test_query_sequence_split_forward(multidevice_test):
    """Non-causal attention with the query sequence split: each query block its stream."""
    d = multidevice_test.size
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([1, 2, S, S], dtype=DataType.BFloat16) for _ in range(3))
        attn, _, _, _ = fd.ops.sdpfa_fwd(q, k, v, P, False, SCALE, rng_seed=SEED, rng_offset=0)
        fd.add_output(attn)
    mesh = mesh_1d(multidevice_test)
    for t in (q, attn):
        shard(t, 2, mesh)
    for t in (k, v):
        t.set_device_mesh(mesh)
    gq, gk, gv, _ = _global_inputs(1, 2)
    local = [multidevice_test.shard_tensor(gq, q), gk, gv]
    out, = fd.execute(local)
    blocks = _gather(multidevice_test, _kept(out, False), attn)  # [1, 2, S, S]
    queries = [r for r in torch.arange(S).chunk(d) if len(r)]  # the ranks' query blocks
    per_block = [blocks[0, head, r].flatten() for head in range(2) for r in queries]
    assert len({tuple(x.tolist()) for x in per_block}) == 2 * len(queries)


@pytest.mark.mpi
def test_same_seed_same_outputs_twice(multidevice_test):
    d = multidevice_test.size
    fd = Dropout(2, 2 * d, seeded=False)
    _schedule(fd, mesh_1d(multidevice_test), SCHEDULES["heads"])
    inputs = _global_inputs(2, 2 * d)
    torch.manual_seed(11)
    first = _run(multidevice_test, fd, inputs)[1]
    second = _run(multidevice_test, fd, inputs)[1]
    torch.manual_seed(11)
    again = _run(multidevice_test, fd, inputs)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], second[0]), "a new call draws a new seed"
    fd2 = Dropout(2, 2 * d)
    _schedule(fd2, mesh_1d(multidevice_test), SCHEDULES["heads"])
    runs = [_run(multidevice_test, fd2, inputs)[1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    other = _run(multidevice_test, fd2, inputs, seed=SEED + 1)[1]
    assert not torch.equal(runs[0][0], other[0])


@pytest.mark.mpi
@pytest.mark.parametrize("split", ["heads", "batch", "2d"])
def test_global_mode_is_the_unsharded_run(multidevice_test, split):
    """Global mode: every output of a sharded run equals the unsharded run's slice bitwise,
    and the mask is ``uniform(0, 1, [B, H, S, S], seed, offset) >= p``."""
    d = multidevice_test.size
    b, h = (2, 2 * d) if split != "batch" else (2 * d, 2)
    inputs = _global_inputs(b, h)
    unsharded = Dropout(b, h, mode="global")
    expected = unsharded.execute(inputs + [SEED, OFFSET])
    fd = Dropout(b, h, mode="global")
    if split == "2d":
        _schedule(fd, mesh_2x2(multidevice_test), [(0, MY), (1, MX)])
    else:
        _schedule(fd, mesh_1d(multidevice_test), SCHEDULES[split])
    _, outputs = _run(multidevice_test, fd, inputs)
    for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
        assert torch.equal(out, shard_tensor(ref.cpu(), tv, multidevice_test.rank).to(out.device))

    with FusionDefinition() as mask_fd:
        u = mask_fd.ops.uniform(0.0, 1.0, [b, h, S, S], rng_seed=SEED, rng_offset=OFFSET)
        mask_fd.add_output(mask_fd.ops.ge(u, P))
    assert torch.equal(_kept(expected[0], False).cpu(), mask_fd.execute([])[0])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["shard", "global"])
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
def test_seed_program_with_dropout(multidevice_test, qkv_format, mode):
    """The seed program with dropout_p = 0.1 (the seed's sizes on GPUs, a shorter sequence on
    CPU ranks): it runs, a repeat with the same torch seed is bitwise equal, and in global
    mode it is the unsharded run."""
    s = 1024 if multidevice_test.device.type == "cuda" else 32
    d, b, h, e = multidevice_test.size, 2, 12, 768
    inputs = random_inputs(b, h, s, e, device=multidevice_test.device)
    if qkv_format is QkvFormat.BSHE:
        inputs = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs]
    fd = SeedAttention(qkv_format, DeviceMesh(range(d)), b, h, s, e, dropout_p=0.1,
                       dropout_mode=mode)
    local = fd.inputs_for(*inputs, multidevice_test.rank)
    local = [t.to(multidevice_test.device) for t in local]
    torch.manual_seed(1)
    outputs = fd.execute(local)
    torch.manual_seed(1)
    again = fd.execute(local)
    assert torch.equal(outputs[0], again[0])  # the attention output: same masks, same bits
    for grad, repeat in zip(outputs[1:], again[1:]):
        if grad.is_cuda:
            # Fused CUDA backward kernels may accumulate in another order from run to run;
            # a different mask would be off by far more than this.
            torch.testing.assert_close(grad, repeat, rtol=1.6e-2, atol=1e-2)
        else:
            assert torch.equal(grad, repeat)
    assert all(o.isfinite().all() for o in outputs)
    if mode == "global":
        whole = _Unsharded(qkv_format, DeviceMesh(range(d)), b, h, s, e, dropout_p=0.1,
                           dropout_mode=mode)
        torch.manual_seed(1)
        expected = whole.execute(inputs)
        for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
            assert torch.equal(out.cpu(), shard_tensor(ref.cpu(), tv, multidevice_test.rank))


class _Unsharded(SeedAttention):
    """The seed program with no schedule: every rank runs it whole (the reference)."""

    def multidevice_schedule(self) -> None:
        pass


@pytest.mark.mpi
def test_explain_shows_each_ranks_stream(multidevice_test):
    d = multidevice_test.size
    fd = Dropout(1, 2 * d)
    _schedule(fd, mesh_1d(multidevice_test), SCHEDULES["heads"])
    local = [multidevice_test.shard_tensor(t, tv)
             for t, tv in zip(_global_inputs(1, 2 * d), fd.tensors())]
    text = fd.explain(local + [SEED, OFFSET])
    h0 = 2 * multidevice_test.rank
    assert f"dropout stream of this shard: hash(seed, offset, b=0, h={h0}, s=0); " \
           "seed S0, offset S1" in text
    assert f"replays the forward's dropout stream of this shard: hash(seed, offset, b=0, " \
           f"h={h0}, s=0)" in text


def test_explain_shows_the_stream_key_of_constant_seeds():
    with FusionDefinition() as fd:
        q = fd.define_tensor([1, 2, S, S])
        fd.add_output(fd.ops.sdpfa_fwd(q, q, q, 0.1, rng_seed=5, rng_offset=0)[0])
    x = torch.randn(1, 2, S, S)
    assert "seed 5, offset 0 (stream key 0x" in fd.explain([x])
    with FusionDefinition() as fd:
        q = fd.define_tensor([1, 2, S, S])
        fd.add_output(fd.ops.sdpfa_fwd(q, q, q, 0.1, dropout_mode="global")[0])
    assert "dropout mask at global b all 1, h all 2, s all 16, k all 16 from uniform(seed, " \
           "offset); seed drawn from torch's generator at each call" in fd.explain([x])


def _forward_on_batch_backward_on_heads(b, h, mode, moved_inputs):
    """Attention with dropout: the forward (q, k, v, attn, lse) sharded on batch, the
    backward's gradients (and, with ``moved_inputs``, copies of its inputs) on heads."""
    with FusionDefinition() as fd:
        q, k, v, g = (fd.define_tensor([b, h, S, S], dtype=DataType.BFloat16)
                      for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, P, False, SCALE, rng_seed=1,
                                                   rng_offset=0, dropout_mode=mode)
        args = [q, k, v, attn, lse]
        moved = [fd.ops.set(t) for t in args] if moved_inputs else []
        grads = fd.ops.sdpfa_bwd(g, *(moved or args), P, False, seed, offset, SCALE)
        for t in (attn, *grads):
            fd.add_output(t)
    return fd, (q, k, v, g), (q, k, v, attn, lse), (*moved, *grads)


@pytest.mark.mpi
@pytest.mark.parametrize("moved_inputs", [False, True], ids=["grads_pinned", "inputs_moved"])
@pytest.mark.parametrize("mode", ["shard", "global"])
def test_backward_sharded_otherwise_than_its_forward(multidevice_test, mode, moved_inputs):
    """Per-shard streams: a backward pinned on heads whose forward ran on batch is computed
    on batch, as its forward was (so each rank redraws the masks its forward drew), and its
    gradients are moved to heads afterwards; in global mode the mask does not depend on the
    sharding, and the backward runs on heads. Batch and heads ``d + 1``: uneven shards."""
    d, mesh = multidevice_test.size, mesh_1d(multidevice_test)
    b = h = d + 1
    fd, inputs, on_batch, on_heads = _forward_on_batch_backward_on_heads(b, h, mode,
                                                                         moved_inputs)
    for t in on_batch:
        shard(t, 0, mesh)
    for t in on_heads:
        shard(t, 1, mesh)
    shard(inputs[3], 1 if moved_inputs else 0, mesh)
    global_inputs = _global_inputs(b, h)
    local = [multidevice_test.shard_tensor(t, tv) for t, tv in zip(global_inputs, inputs)]
    with record_communications() as comms:
        attn, *grads = fd.execute(local)
    outputs = fd.fusion.outputs()
    keep = _kept(_gather(multidevice_test, attn, outputs[0]), False)
    _, ref_grads = _reference_grads(*(t.cpu() for t in global_inputs), keep.cpu(), False)
    for name, grad, ref, tv in zip(("q_grad", "k_grad", "v_grad"), grads, ref_grads,
                                   outputs[1:]):
        _assert_close(name, _gather(multidevice_test, grad, tv), ref)
    moves = [c for c in comms if len(c.ranks) > 1]
    if d == 1:
        assert moves == []
    elif not moved_inputs:  # the three gradients: batch -> heads
        assert [c.kind for c in moves] == ["all_to_all"] * 3, moves
    elif mode == "shard":  # the user's five copies to heads, back to batch with g, the
        assert len(moves) == 5 + 6 + 3, moves  # gradients to heads
    else:  # the user's five copies to heads; the backward runs there
        assert len(moves) == 5, moves


def test_mode_errors(monkeypatch):
    with pytest.raises(DefinitionError, match="dropout_mode='mask' is not a dropout mode"), \
            FusionDefinition() as fd:
        q = fd.define_tensor([1, 2, S, S])
        fd.ops.sdpfa_fwd(q, q, q, 0.1, dropout_mode="mask")
    monkeypatch.setenv("MESHFUSE_DROPOUT_MODE", "bad")
    with pytest.raises(DefinitionError, match="MESHFUSE_DROPOUT_MODE='bad'"), \
            FusionDefinition() as fd:
        q = fd.define_tensor([1, 2, S, S])
        fd.ops.sdpfa_fwd(q, q, q, 0.1)


def test_dropout_p_as_an_input_switches_between_calls():
    """One program, dropout_p given at execute: 0 (no mask), then 0.5, then 0 again."""
    with FusionDefinition() as fd:
        q, k, v = (fd.define_tensor([1, 2, S, S], dtype=DataType.BFloat16) for _ in range(3))
        p = fd.define_scalar(dtype=DataType.Double)
        attn, _, _, _ = fd.ops.sdpfa_fwd(q, k, v, p, False, SCALE, rng_seed=1, rng_offset=0)
        fd.add_output(attn)
    q, k, v, _ = (t.cpu() for t in _global_inputs(1, 2))
    plain = fd.execute([q, k, v, 0.0])[0]
    dropped = fd.execute([q, k, v, 0.5])[0]
    assert (plain != 0).all()
    assert 0.3 < (dropped == 0).float().mean().item() < 0.7
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept].float(), (plain[kept] / 0.5).float(), rtol=1.6e-2,
                               atol=1e-3)
    assert torch.equal(fd.execute([q, k, v, 0.0])[0], plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generator_is_left_as_it_was():
    """The fused kernel draws from the shard's stream through torch's CUDA generator, which
    is restored: the user's CUDA random numbers do not depend on meshfuse's dropout."""
    fd = Dropout(1, 2)
    inputs = [t.cuda() for t in _global_inputs(1, 2)] + [SEED, OFFSET]
    torch.cuda.manual_seed(4)
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(4)
    fd.execute(inputs)
    assert torch.equal(torch.rand(8, device="cuda"), expected)


def _forward_expr(fd):
    return next(e for e in fd.fusion.exprs if getattr(e.op, "name", None) == "sdpfa_fwd")


class _StateOut(Dropout):
    """Dropout whose forward's RNG state is also a fusion output (it leaves the program)."""

    def definition(self):
        super().definition()
        seed = _forward_expr(self).outputs[2]
        self.add_output(seed)


class _OtherCausal(Dropout):
    """A backward that is not causal while its forward is: it may pick another kernel."""

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor(self.shape, dtype=DataType.BFloat16)
                                          for _ in range(4))
        self.attn, lse, seed, offset = self.ops.sdpfa_fwd(self.q, self.k, self.v, P, True)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, lse, P,
                                        False, seed, offset)
        for t in (self.attn, *self.grads):
            self.add_output(t)


@pytest.mark.parametrize("fd_class, expected", [(Dropout, True), (_StateOut, False),
                                                (_OtherCausal, False)])
def test_rng_state_stays_in_kernel_form_only_inside_the_program(fd_class, expected):
    """The forward hands its kernel's own RNG state to its backward (no join per call) only
    when the state is no fusion output and every reader replays the forward's kernel."""
    fd = fd_class(1, 2)
    fd.define()
    assert state_stays_inside(_forward_expr(fd)) is expected
