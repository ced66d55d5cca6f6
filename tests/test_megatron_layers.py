"""Megatron-style parallel layers, forward and backward as fusions, against PyTorch autograd.

Each layer is two fusions defined with global shapes: the forward (which also returns what the
backward needs) and the backward, written out with ops (linears and matmuls of transposes,
the tanh-GELU derivative from pointwise ops, sums for the bias gradients, ``sdpfa_bwd``). The
user schedules what a Megatron user decides: the weights (column parallel: output features;
row parallel: input features), the weight gradients like their weights, and, where the style
needs it, the token axis of inputs and outputs. Propagation fills every other tensor; the few
intermediates pinned below say why. Each rank checks its outputs against the float32 autograd
reference sliced with ``shard_tensor`` and asserts the communications Megatron does.

Every test runs in float32 and in bfloat16 (``DTYPES``): the fusions declare tensors of that
dtype and get the random inputs rounded to it; the reference is the float32 autograd run on those
rounded values, compared with ``_tolerance``. The communications asserted are the same for both.

Styles: (a) tensor parallel MLP; (b) the same with sequence parallelism; (c) attention with
head-parallel projections; (d) data x tensor parallel MLP on a 2x2 mesh. Tests named
``..._bug_...`` below the layers are minimal reproductions of library bugs.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import MX, MY, mesh_1d, mesh_2x2, shard

from meshfuse import DataType, DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.examples.gpt import gelu_tanh_derivative
from meshfuse.ir.placement import Shard, placements
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

TOKENS, HIDDEN, FFN = 16, 8, 16
B, S, HEADS, HEAD_DIM = 2, 8, 4, 2
DTYPES = pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16],
                                 ids=["fp32", "bf16"])

pytestmark = [pytest.mark.mpi, DTYPES]


# ----- helpers ---------------------------------------------------------------------------

def _randn(*shape: int, seed: int, dtype: DataType, scale: float = 1.0) -> torch.Tensor:
    """The same global tensor on every rank, on this rank's device (NCCL needs GPU tensors):
    float32 random values rounded to ``dtype``, so that both dtypes see the same values."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.to(current_device(), dtype.torch_dtype)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy of an input, for the reference (exact: every bfloat16 is a float32)."""
    return t.to(torch.float32, copy=True)


def _tolerance(dtype: DataType, reference: torch.Tensor) -> dict[str, float]:
    """``assert_close`` tolerances of a ``dtype`` result against its float32 ``reference``.

    float32 computes what the reference computes, up to summation order. bfloat16 keeps 8
    significant bits (a relative step of 2**-8 = 0.4%) and rounds after every op, so it gets
    rtol 1.6e-2 and an atol of 1% of the reference's largest magnitude: an element near zero
    that is the sum of larger terms carries their rounding error, not its own. On CPU the
    largest bfloat16 error seen is 0.96% of max|reference| (attention's dwq), 43% of this bound.
    """
    if dtype is DataType.Float:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1.6e-2, "atol": 1e-2 * reference.abs().max().item()}


def _execute(fd: FusionDefinition, inputs: list) -> tuple[list[torch.Tensor], list]:
    with record_communications() as comms:
        outputs = fd.execute(inputs)
    return outputs, comms


def _check(outputs, references, tvs, rank: int, dtype: DataType) -> None:
    """Each output is ``dtype`` and close to this rank's shard of its float32 reference."""
    for out, ref, tv in zip(outputs, references, tvs, strict=True):
        assert out.dtype == dtype.torch_dtype, f"{tv.name} is {out.dtype}, not {dtype}"
        torch.testing.assert_close(out.to(ref.dtype), shard_tensor(ref, tv, rank),
                                   **_tolerance(dtype, ref),
                                   msg=lambda m, tv=tv: f"{tv.name}: {m}")


def _traffic(comms) -> Counter:
    """(kind, mesh axis, group ranks) -> count, for the communications between processes."""
    return Counter((c.kind, c.mesh_axis, c.ranks) for c in comms if len(c.ranks) > 1)


def _expect(multidevice_test, comms, mesh: DeviceMesh, **counts: int) -> None:
    """``comms`` are exactly ``counts`` (``allreduce_x=1``: one allreduce over this rank's
    mesh_x group); nothing crosses processes at size 1."""
    want: Counter = Counter()
    if multidevice_test.size > 1:
        for key, n in counts.items():
            kind, _, axis_name = key.rpartition("_")
            axis = mesh.axis_of(MX if axis_name == "x" else MY)
            want[(kind, axis, mesh.group_ranks(multidevice_test.rank, axis))] = n
    assert _traffic(comms) == want, comms


def _transpose(ops, t):
    return ops.permute(t, [1, 0])


# ----- the MLP: (a) tensor parallel, (b) sequence parallel, (d) data x tensor parallel -------

class MlpForward(FusionDefinition):
    """``y = gelu_tanh(x @ w1.T + b1) @ w2.T + b2`` over ``[tokens, hidden]``; also returns
    ``h = x @ w1.T + b1`` for the backward. The row-parallel bias is added after the
    reduction, as Megatron's RowParallelLinear does (see also
    ``test_bug_row_parallel_linear_adds_its_bias_once``)."""

    def __init__(self, style: str, mesh: DeviceMesh, dtype: DataType):
        super().__init__()
        self.style, self.mesh, self.dtype = style, mesh, dtype

    def definition(self) -> None:
        ops = self.ops
        self.x = self.define_tensor([TOKENS, HIDDEN], dtype=self.dtype)
        self.w1 = self.define_tensor([FFN, HIDDEN], dtype=self.dtype)
        self.b1 = self.define_tensor([FFN], dtype=self.dtype)
        self.w2 = self.define_tensor([HIDDEN, FFN], dtype=self.dtype)
        self.b2 = self.define_tensor([HIDDEN], dtype=self.dtype)
        self.h = ops.linear(self.x, self.w1, self.b1)
        # nvFuser's promotion adds bf16 in float: cast back to the layer's dtype (the sum is
        # scheduled like y, so that the partial sums are reduce-scattered into it).
        self.y_sum = ops.add(ops.linear(ops.gelu(self.h, approximate="tanh"), self.w2), self.b2)
        self.y = ops.cast(self.y_sum, self.dtype)
        self.add_output(self.y)
        self.add_output(self.h)

    def multidevice_schedule(self) -> None:
        mesh = self.mesh
        shard(self.w1, 0, mesh)  # column parallel
        shard(self.w2, 1, mesh)  # row parallel
        if self.style == "sp":
            shard(self.x, 0, mesh)
            shard(self.y_sum, 0, mesh)
            shard(self.y, 0, mesh)
        if self.style == "dp_tp":
            shard(self.x, 0, mesh, MY)
            shard(self.y_sum, 0, mesh, MY)
            shard(self.y, 0, mesh, MY)
            # Forced: propagation gives h the sharding of one input (w1's), so the tokens would
            # be gathered over mesh_y (test_bug_data_parallel_tokens_...).
            shard(self.h, 0, mesh, MY)
            shard(self.h, 1, mesh)


class MlpBackward(FusionDefinition):
    """Gradients of ``sum(y * dy)``: inputs ``dy, x, h, w1, w2``; outputs
    ``dx, dw1, db1, dw2, db2``."""

    def __init__(self, style: str, mesh: DeviceMesh, dtype: DataType):
        super().__init__()
        self.style, self.mesh, self.dtype = style, mesh, dtype

    def definition(self) -> None:
        ops = self.ops
        self.dy = self.define_tensor([TOKENS, HIDDEN], dtype=self.dtype)
        self.x = self.define_tensor([TOKENS, HIDDEN], dtype=self.dtype)
        self.h = self.define_tensor([TOKENS, FFN], dtype=self.dtype)
        self.w1 = self.define_tensor([FFN, HIDDEN], dtype=self.dtype)
        self.w2 = self.define_tensor([HIDDEN, FFN], dtype=self.dtype)
        dy = self.dy
        if self.style == "sp":
            # Megatron's gather of the sequence in the backward of the reduce-scatter, written
            # once and used by dg, dw2 and db2 (meshfuse would otherwise gather dy for dg and
            # its transpose for dw2, and allreduce db2's partial sums).
            self.dy_full = dy = ops.set(self.dy)
        self.dg = ops.linear(dy, _transpose(ops, self.w2))  # dy @ w2
        self.dw2 = ops.matmul(_transpose(ops, dy), ops.gelu(self.h, approximate="tanh"))
        self.db2 = ops.sum(dy, dims=[0])
        dh = ops.cast(ops.mul(self.dg, gelu_tanh_derivative(ops, self.h)), self.dtype)
        self.dw1 = ops.matmul(_transpose(ops, dh), self.x)
        self.db1 = ops.sum(dh, dims=[0])
        self.dx = ops.linear(dh, _transpose(ops, self.w1))  # dh @ w1
        for t in (self.dx, self.dw1, self.db1, self.dw2, self.db2):
            self.add_output(t)

    def multidevice_schedule(self) -> None:
        mesh = self.mesh
        for w, axis in ((self.w1, 0), (self.w2, 1), (self.dw1, 0), (self.dw2, 1)):
            shard(w, axis, mesh)
        if self.style == "sp":
            for t in (self.dy, self.x, self.dx):
                shard(t, 0, mesh)
            self.dy_full.set_device_mesh(mesh)
        if self.style == "dp_tp":
            for t in (self.dy, self.x, self.dx):
                shard(t, 0, mesh, MY)
            for t in (self.h, self.dg):  # h as the forward made it; dg forced, as h forward
                shard(t, 0, mesh, MY)
                shard(t, 1, mesh)


def _mlp_reference(x, w1, b1, w2, b2, dy) -> dict[str, torch.Tensor]:
    """The unsharded layer in float32, by autograd."""
    params = {n: _upcast(t).requires_grad_() for n, t in
              {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}.items()}
    h = F.linear(params["x"], params["w1"], params["b1"])
    y = F.linear(F.gelu(h, approximate="tanh"), params["w2"], params["b2"])
    y.backward(_upcast(dy))
    return {"y": y.detach(), "h": h.detach(), **{n: p.grad for n, p in params.items()}}


def _run_mlp(multidevice_test, style: str, mesh: DeviceMesh, dtype: DataType):
    """Runs the forward, then the backward on the forward's local ``h``; checks both against
    autograd; returns the forward's and the backward's communications."""
    rank = multidevice_test.rank
    x, dy = _randn(TOKENS, HIDDEN, seed=0, dtype=dtype), _randn(TOKENS, HIDDEN, seed=1, dtype=dtype)
    w1 = _randn(FFN, HIDDEN, seed=2, dtype=dtype, scale=0.3)
    b1 = _randn(FFN, seed=3, dtype=dtype, scale=0.1)
    w2 = _randn(HIDDEN, FFN, seed=4, dtype=dtype, scale=0.25)
    b2 = _randn(HIDDEN, seed=5, dtype=dtype, scale=0.1)
    ref = _mlp_reference(x, w1, b1, w2, b2, dy)

    fwd = MlpForward(style, mesh, dtype).define()
    (y, h), fwd_comms = _execute(
        fwd, [shard_tensor(t, tv, rank) for t, tv in zip((x, w1, b1, w2, b2), fwd.fusion.inputs())])
    _check([y, h], [ref["y"], ref["h"]], [fwd.y, fwd.h], rank, dtype)

    bwd = MlpBackward(style, mesh, dtype).define()
    # The forward's h is the backward's input as it comes.
    _check([h], [ref["h"]], [bwd.h], rank, dtype)
    inputs = [shard_tensor(t, tv, rank) for t, tv in
              zip((dy, x, ref["h"], w1, w2), bwd.fusion.inputs())]
    inputs[2] = h
    grads, bwd_comms = _execute(bwd, inputs)
    _check(grads, [ref[n] for n in ("x", "w1", "b1", "w2", "b2")], bwd.fusion.outputs(), rank,
           dtype)
    return fwd_comms, bwd_comms


def test_mlp_tensor_parallel(multidevice_test, dtype):
    """(a) Column-parallel fc1, GELU, row-parallel fc2: one allreduce forward (fc2's partial
    sums), one backward (fc1's input gradient); every weight gradient stays local."""
    mesh = mesh_1d(multidevice_test)
    fwd, bwd = _run_mlp(multidevice_test, "tp", mesh, dtype)
    _expect(multidevice_test, fwd, mesh, allreduce_x=1)
    _expect(multidevice_test, bwd, mesh, allreduce_x=1)


def test_mlp_sequence_parallel(multidevice_test, dtype):
    """(b) Tokens sharded in and out: forward allgather (x) + reduce-scatter (y); backward
    mirrors it: allgather dy, allgather x (for dw1, as Megatron re-gathers its input), and
    reduce-scatter dx."""
    mesh = mesh_1d(multidevice_test)
    fwd, bwd = _run_mlp(multidevice_test, "sp", mesh, dtype)
    _expect(multidevice_test, fwd, mesh, allgather_x=1, reduce_scatter_x=1)
    _expect(multidevice_test, bwd, mesh, allgather_x=2, reduce_scatter_x=1)


def test_mlp_backward_launches_the_input_gradient_allreduce_before_the_weight_gradients(
        multidevice_test, dtype):
    """dx is defined last, but its allreduce is launched as soon as its partial sums exist,
    before the weight gradients are computed, so that their matmuls overlap it; its result is
    waited for only as an output. The values are those of the tensor-parallel test above."""
    mesh = mesh_1d(multidevice_test)
    bwd = MlpBackward("tp", mesh, dtype).define()
    inputs = [shard_tensor(_randn(*[d.extent for d in tv.logical], seed=i, dtype=dtype), tv,
                           multidevice_test.rank)
              for i, tv in enumerate(bwd.fusion.inputs())]
    _, comms = _execute(bwd, inputs)
    _expect(multidevice_test, comms, mesh, allreduce_x=1)
    program, = bwd._runner._programs.values()
    labels = [step.label for step in program.steps]
    computes = {tv: next(i for i, lb in enumerate(labels) if lb.startswith(f"{tv.name} = "))
                for tv in (bwd.dw1, bwd.dw2, bwd.db1, bwd.db2)}
    reduce = next((i for i, lb in enumerate(labels) if "allreduce" in lb), None)
    if multidevice_test.size == 1:
        assert reduce is None, program.describe()
    else:
        assert all(reduce < i for i in computes.values()), program.describe()


def test_mlp_data_and_tensor_parallel_on_a_2x2_mesh(multidevice_test, dtype):
    """(d) Tokens on mesh_y (data parallel), weights on mesh_x (tensor parallel). The forward's
    allreduce and the backward's input-gradient allreduce run over mesh_x groups only; the
    weight and bias gradients are allreduced over mesh_y groups (the data-parallel sync), the
    four of them as one bucket (small, and read by no later step)."""
    mesh = mesh_2x2(multidevice_test)
    fwd, bwd = _run_mlp(multidevice_test, "dp_tp", mesh, dtype)
    assert {c.mesh_axis for c in fwd} == {mesh.axis_of(MX)}
    _expect(multidevice_test, fwd, mesh, allreduce_x=1)
    _expect(multidevice_test, bwd, mesh, allreduce_x=1, allreduce_y=1)


# ----- (c) attention with head-parallel projections ------------------------------------------

class AttentionForward(FusionDefinition):
    """Causal self-attention ``y = out_proj(sdpa(q, k, v))`` over ``[B, S, hidden]``.

    The projection weights are ``[heads, head_dim, hidden]``: Megatron's ``[heads * head_dim,
    hidden]`` QKV weights with their output features split into heads, and the
    ``[hidden, heads * head_dim]`` output projection transposed alike, so that the head axis is
    an axis of each weight and sharding it shards the heads. ``x`` is reshaped to
    ``[B, 1, S, hidden]`` (a broadcast head axis) and each projection is a batched matmul to
    ``[B, heads, S, head_dim]``; the output projection sums over heads (the row-parallel
    reduction). Splitting a sharded ``[B, S, hidden]`` by reshape is not supported yet
    (``test_attention_heads_by_reshape_of_sharded_features``).
    """

    def __init__(self, mesh: DeviceMesh, dtype: DataType):
        super().__init__()
        self.mesh, self.dtype = mesh, dtype

    def definition(self) -> None:
        self.x = self.define_tensor([B, S, HEADS * HEAD_DIM], dtype=self.dtype)
        self.wq, self.wk, self.wv, self.wo = (
            self.define_tensor([HEADS, HEAD_DIM, HEADS * HEAD_DIM], dtype=self.dtype)
            for _ in range(4))
        self.bo = self.define_tensor([HEADS * HEAD_DIM], dtype=self.dtype)
        _, (_, _, _, attn, *_) = self.attention(self.x)
        self.y = self.ops.cast(
            self.ops.add(self.ops.sum(self.ops.matmul(attn, self.wo), dims=[1]), self.bo),
            self.dtype)
        self.add_output(self.y)

    def attention(self, x):
        """``x`` with a head axis, and (q, k, v, attn, log_sumexp, seed, offset)."""
        ops = self.ops
        x_heads = ops.reshape(x, [B, 1, S, HEADS * HEAD_DIM])
        q, k, v = (ops.matmul(x_heads, ops.permute(w, [0, 2, 1]))
                   for w in (self.wq, self.wk, self.wv))
        return x_heads, (q, k, v, *ops.sdpfa_fwd(q, k, v, 0.0, True))

    def multidevice_schedule(self) -> None:
        for w in (self.wq, self.wk, self.wv, self.wo):
            shard(w, 0, self.mesh)


class AttentionBackward(AttentionForward):
    """Inputs ``dy, x, wq, wk, wv, wo``; outputs ``dx, dwq, dwk, dwv, dwo, dbo``. Recomputes
    the attention (activation recomputation), so that ``sdpfa_bwd`` gets the forward's
    statistics, seed and offset within the fusion."""

    def definition(self) -> None:
        ops = self.ops
        hidden = HEADS * HEAD_DIM
        self.dy = self.define_tensor([B, S, hidden], dtype=self.dtype)
        self.x = self.define_tensor([B, S, hidden], dtype=self.dtype)
        self.wq, self.wk, self.wv, self.wo = (
            self.define_tensor([HEADS, HEAD_DIM, hidden], dtype=self.dtype)
            for _ in range(4))
        x_heads, (q, k, v, attn, lse, seed, offset) = self.attention(self.x)
        dy_heads = ops.reshape(self.dy, [B, 1, S, hidden])
        d_attn = ops.matmul(dy_heads, ops.permute(self.wo, [0, 2, 1]))
        self.dwo = ops.sum(ops.matmul(ops.permute(attn, [0, 1, 3, 2]), dy_heads), dims=[0])
        self.dbo = ops.sum(self.dy, dims=[0, 1])
        dq, dk, dv = ops.sdpfa_bwd(d_attn, q, k, v, attn, lse, 0.0, True, seed, offset)
        self.dwq, self.dwk, self.dwv = (
            ops.sum(ops.matmul(ops.permute(g, [0, 1, 3, 2]), x_heads), dims=[0])
            for g in (dq, dk, dv))
        # Summed over q, k and v per head first, so that one reduction over heads remains.
        dx_heads = ops.cast(ops.add(ops.add(ops.matmul(dq, self.wq), ops.matmul(dk, self.wk)),
                                    ops.matmul(dv, self.wv)), self.dtype)
        self.dx = ops.sum(dx_heads, dims=[1])
        for t in (self.dx, self.dwq, self.dwk, self.dwv, self.dwo, self.dbo):
            self.add_output(t)

    def multidevice_schedule(self) -> None:
        super().multidevice_schedule()
        for g in (self.dwq, self.dwk, self.dwv, self.dwo):
            shard(g, 0, self.mesh)


def _attention_reference(x, wq, wk, wv, wo, bo, dy) -> dict[str, torch.Tensor]:
    """The unsharded layer with Megatron's 2-D weights in float32, by autograd."""
    params = {n: _upcast(t).requires_grad_() for n, t in
              {"x": x, "wq": wq, "wk": wk, "wv": wv, "wo": wo, "bo": bo}.items()}
    q, k, v = (F.linear(params["x"], params[w]).reshape(B, S, HEADS, HEAD_DIM).transpose(1, 2)
               for w in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = F.linear(a.transpose(1, 2).reshape(B, S, -1), params["wo"], params["bo"])
    y.backward(_upcast(dy))
    return {"y": y.detach(), **{n: p.grad for n, p in params.items()}}


def _heads_first(w_qkv: torch.Tensor) -> torch.Tensor:
    """A ``[heads * head_dim, hidden]`` projection weight as ``[heads, head_dim, hidden]``."""
    return w_qkv.reshape(HEADS, HEAD_DIM, -1)


def _out_proj_heads_first(w_o: torch.Tensor) -> torch.Tensor:
    """The ``[hidden, heads * head_dim]`` output projection as ``[heads, head_dim, hidden]``."""
    return w_o.reshape(-1, HEADS, HEAD_DIM).permute(1, 2, 0)


def test_attention_head_parallel(multidevice_test, dtype):
    """(c) Head-parallel Q/K/V projections, attention per local head, row-parallel output
    projection: one allreduce forward (the sum over heads), one backward (dx)."""
    mesh, rank = mesh_1d(multidevice_test), multidevice_test.rank
    hidden = HEADS * HEAD_DIM
    x, dy = _randn(B, S, hidden, seed=0, dtype=dtype), _randn(B, S, hidden, seed=1, dtype=dtype)
    w = [_randn(hidden, hidden, seed=2 + i, dtype=dtype, scale=0.3) for i in range(4)]
    bo = _randn(hidden, seed=6, dtype=dtype, scale=0.1)
    ref = _attention_reference(x, *w, bo, dy)
    weights = [_heads_first(t) for t in w[:3]] + [_out_proj_heads_first(w[3])]

    fwd = AttentionForward(mesh, dtype).define()
    (y,), fwd_comms = _execute(fwd, [shard_tensor(t, tv, rank) for t, tv in
                                     zip((x, *weights, bo), fwd.fusion.inputs())])
    _check([y], [ref["y"]], [fwd.y], rank, dtype)
    _expect(multidevice_test, fwd_comms, mesh, allreduce_x=1)

    bwd = AttentionBackward(mesh, dtype).define()
    grads, bwd_comms = _execute(bwd, [shard_tensor(t, tv, rank) for t, tv in
                                      zip((dy, x, *weights), bwd.fusion.inputs())])
    expected = [ref["x"], *(_heads_first(ref[n]) for n in ("wq", "wk", "wv")),
                _out_proj_heads_first(ref["wo"]), ref["bo"]]
    _check(grads, expected, bwd.fusion.outputs(), rank, dtype)
    _expect(multidevice_test, bwd_comms, mesh, allreduce_x=1)


def test_attention_heads_by_reshape_of_sharded_features(multidevice_test, dtype):
    """Megatron's own formulation: 2-D weights sharded on output features, then reshape and
    permute to heads: the block shard of the features carries over to the heads."""
    if multidevice_test.size == 1:
        pytest.skip("one rank: nothing is sharded")
    mesh, rank = mesh_1d(multidevice_test), multidevice_test.rank
    hidden = HEADS * HEAD_DIM

    with FusionDefinition() as fd:
        ops = fd.ops
        x = fd.define_tensor([B, S, hidden], dtype=dtype)
        wq, wk, wv, wo = (fd.define_tensor([hidden, hidden], dtype=dtype)
                          for _ in range(4))
        bo = fd.define_tensor([hidden], dtype=dtype)
        q, k, v = (ops.permute(ops.reshape(ops.linear(x, w), [B, S, HEADS, HEAD_DIM]),
                               [0, 2, 1, 3]) for w in (wq, wk, wv))
        attn, _, _, _ = ops.sdpfa_fwd(q, k, v, 0.0, True)
        merged = ops.reshape(ops.permute(attn, [0, 2, 1, 3]), [B, S, hidden])
        y = ops.cast(ops.add(ops.linear(merged, wo), bo), dtype)  # (bf16 adds in float)
        fd.add_output(y)
    for w in (wq, wk, wv):
        shard(w, 0, mesh)
    shard(wo, 1, mesh)

    inputs = [_randn(B, S, hidden, seed=0, dtype=dtype)] + [
        _randn(hidden, hidden, seed=2 + i, dtype=dtype, scale=0.3) for i in range(4)] + [
        _randn(hidden, seed=6, dtype=dtype, scale=0.1)]
    ref = _attention_reference(*inputs, torch.zeros(B, S, hidden, device=current_device()))
    (out,), comms = _execute(fd, [shard_tensor(t, tv, rank) for t, tv in
                                  zip(inputs, fd.fusion.inputs())])
    _check([out], [ref["y"]], [y], rank, dtype)
    if HEADS % mesh.size == 0:
        _expect(multidevice_test, comms, mesh, allreduce_x=1)
    else:  # feature blocks cut heads (8 over 3 ranks: 3, 3, 2): q, k and v are gathered
        _expect(multidevice_test, comms, mesh, allgather_x=3, allreduce_x=1)


# ----- minimal reproductions of library bugs -----------------------------------------------

def test_bug_row_parallel_linear_adds_its_bias_once(multidevice_test, dtype):
    """``linear(x, w, b)`` with ``w`` sharded on input features makes a partial result; the
    bias must enter the sum once. Today every rank adds it, so the allreduce adds it d times."""
    mesh, rank = mesh_1d(multidevice_test), multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([TOKENS, FFN], dtype=dtype)
        w = fd.define_tensor([HIDDEN, FFN], dtype=dtype)
        b = fd.define_tensor([HIDDEN], dtype=dtype)
        y = fd.ops.linear(x, w, b)
        fd.add_output(y)
    shard(w, 1, mesh)
    tensors = [_randn(TOKENS, FFN, seed=0, dtype=dtype), _randn(HIDDEN, FFN, seed=1, dtype=dtype),
               _randn(HIDDEN, seed=2, dtype=dtype)]
    (out,), comms = _execute(fd, [shard_tensor(t, tv, rank) for t, tv in
                                  zip(tensors, fd.fusion.inputs())])
    _check([out], [F.linear(*map(_upcast, tensors))], [y], rank, dtype)
    _expect(multidevice_test, comms, mesh, allreduce_x=1)


def test_bug_sequence_parallel_linear_of_3d_activations_gathers_the_activations(
        multidevice_test, dtype):
    """``x [B, S, hidden]`` sharded on the sequence, a column-parallel weight: the sequence is
    gathered (Megatron's sequence parallelism) and the output is sharded on features. Today
    propagation prefers x (it maps 3 axes, the weight 2) over the weight linear prefers, so
    the output is sharded on the sequence and the weight is gathered instead."""
    mesh, rank, d = mesh_1d(multidevice_test), multidevice_test.rank, multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([B, 2 * S, HIDDEN], dtype=dtype)
        w = fd.define_tensor([FFN, HIDDEN], dtype=dtype)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, 1, mesh)
    shard(w, 0, mesh)
    tensors = [_randn(B, 2 * S, HIDDEN, seed=0, dtype=dtype),
               _randn(FFN, HIDDEN, seed=1, dtype=dtype)]
    (out,), comms = _execute(fd, [shard_tensor(t, tv, rank) for t, tv in
                                  zip(tensors, fd.fusion.inputs())])
    _check([out], [F.linear(*map(_upcast, tensors))], [y], rank, dtype)
    assert placements(fd.compiled()[y]) == (Shard(2, None),)
    _expect(multidevice_test, comms, mesh, allgather_x=1)
    if d > 1:  # this rank's slice of x (padded to the largest), not of the weight
        rows = -(-2 * S // d)
        assert comms[0].bytes == B * rows * HIDDEN * dtype.torch_dtype.itemsize


def test_bug_data_parallel_tokens_and_tensor_parallel_weight_both_shard_a_linear(
        multidevice_test, dtype):
    """Tokens on mesh_y and the weight's output features on mesh_x: the output is sharded on
    both, with no communication. Today propagation copies one input's sharding (the
    weight's), so the tokens are allgathered over mesh_y."""
    mesh, rank = mesh_2x2(multidevice_test), multidevice_test.rank
    with FusionDefinition() as fd:
        x = fd.define_tensor([TOKENS, HIDDEN], dtype=dtype)
        w = fd.define_tensor([FFN, HIDDEN], dtype=dtype)
        y = fd.ops.linear(x, w)
        fd.add_output(y)
    shard(x, 0, mesh, MY)
    shard(w, 0, mesh, MX)
    tensors = [_randn(TOKENS, HIDDEN, seed=0, dtype=dtype),
               _randn(FFN, HIDDEN, seed=1, dtype=dtype)]
    (out,), comms = _execute(fd, [shard_tensor(t, tv, rank) for t, tv in
                                  zip(tensors, fd.fusion.inputs())])
    _check([out], [F.linear(*map(_upcast, tensors))], [y], rank, dtype)
    assert placements(fd.compiled()[y]) == (Shard(0, None), Shard(1, None))
    assert comms == []
