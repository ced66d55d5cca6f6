"""A GPT-style transformer layer, forward and backward, as ONE fusion, against PyTorch autograd.

The layer (pre-norm, causal self-attention, tanh-GELU MLP)::

    h = x + out_proj(attention(qkv_proj(layer_norm_1(x))))
    y = h + fc2(gelu_tanh(fc1(layer_norm_2(h))))

The fusion computes ``y`` and, given the loss gradient ``dy``, the gradients of ``x`` and of
every parameter, with the backward written out with ops: ``sdpfa_bwd`` for attention,
matmuls for the linears' transposes, the layer norm and tanh-GELU derivatives from pointwise
ops and reductions, and the inverse reshape/permute of the head split. The gradient of the
qkv projection is computed per slice of its weight (q, k, v rows).

The reference is the same layer in plain PyTorch (``F.layer_norm``, ``F.linear``,
``F.scaled_dot_product_attention``, ``F.gelu``) with autograd, in float64 from the same
inputs: float32 must match it tightly, bfloat16 loosely.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from fusion_math import gelu_tanh_derivative

from meshfuse import DataType, DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.examples.gpt import GptBlock, parameter_shapes
from meshfuse.runtime.collectives import record_communications
from meshfuse.testing.utils import current_device

B, S, H, HEADS = 2, 64, 64, 4
D = H // HEADS
EPS = 1e-5
PARAMS = {
    "ln1_w": (H,), "ln1_b": (H,),
    "w_qkv": (3 * H, H), "b_qkv": (3 * H,),
    "w_o": (H, H), "b_o": (H,),
    "ln2_w": (H,), "ln2_b": (H,),
    "w_fc1": (4 * H, H), "b_fc1": (4 * H,),
    "w_fc2": (H, 4 * H), "b_fc2": (H,),
}
# The fusion's gradients of the qkv projection, per slice of w_qkv/b_qkv rows.
QKV_GRADS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v")
OUTPUTS = ("y", "x", *(n for n in PARAMS if not n.endswith("qkv")), *QKV_GRADS)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ----------------------------------------------------------------------------------------------
# The reference


def torch_layer(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.layer_norm(x, (H,), p["ln1_w"], p["ln1_b"], EPS)
    q, k, v = (t.reshape(B, S, HEADS, D).transpose(1, 2)
               for t in F.linear(h, p["w_qkv"], p["b_qkv"]).split(H, dim=-1))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(B, S, H), p["w_o"], p["b_o"])
    h = F.layer_norm(x, (H,), p["ln2_w"], p["ln2_b"], EPS)
    f = F.gelu(F.linear(h, p["w_fc1"], p["b_fc1"]), approximate="tanh")
    return x + F.linear(f, p["w_fc2"], p["b_fc2"])


def reference(x, dy, params) -> dict[str, torch.Tensor]:
    """``y`` and the gradients of ``sum(y * dy)``, by autograd in float64."""
    x = x.double().requires_grad_()
    p = {n: t.double().requires_grad_() for n, t in params.items()}
    y = torch_layer(x, p)
    y.backward(dy.double())
    grads = {"y": y.detach(), "x": x.grad, **{n: t.grad for n, t in p.items()}}
    for name in ("w", "b"):
        for part, grad in zip("qkv", grads.pop(f"{name}_qkv").split(H, dim=0)):
            grads[f"{name}_{part}"] = grad
    return grads


# ----------------------------------------------------------------------------------------------
# The fusion


class TransformerLayer(FusionDefinition):
    """Inputs: ``x``, ``dy`` (both ``[B, S, H]``), then the parameters in PARAMS order.
    Outputs: OUTPUTS (``y``, then the gradients)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = DataType.from_torch(dtype)

    def definition(self) -> None:
        ops = self.ops
        x = self.define_tensor([B, S, H], dtype=self.dtype, contiguity=True)
        dy = self.define_tensor([B, S, H], dtype=self.dtype, contiguity=True)
        p = {n: self.define_tensor(list(shape), dtype=self.dtype, contiguity=True)
             for n, shape in PARAMS.items()}

        # Forward.
        ln1, ln1_saved = self.layer_norm(x, p["ln1_w"], p["ln1_b"])
        # nvFuser's promotion computes bf16 arithmetic in float: cast back before matmuls.
        ln1 = self.io(ln1)
        qkv = ops.linear(ln1, p["w_qkv"], p["b_qkv"])
        q, k, v = (self.to_heads(ops.slice(qkv, [0, 0, i * H], [B, S, (i + 1) * H]))
                   for i in range(3))
        attn, lse, seed, offset = ops.sdpfa_fwd(q, k, v, 0.0, True)
        a = self.from_heads(attn)
        h = ops.add(x, ops.linear(a, p["w_o"], p["b_o"]))
        ln2, ln2_saved = self.layer_norm(h, p["ln2_w"], p["ln2_b"])
        ln2 = self.io(ln2)
        f1 = ops.linear(ln2, p["w_fc1"], p["b_fc1"])
        g = ops.gelu(f1, approximate="tanh")
        y = ops.add(h, ops.linear(g, p["w_fc2"], p["b_fc2"]))

        # Backward of sum(y * dy).
        grads = {"y": y}
        dg, grads["w_fc2"], grads["b_fc2"] = self.linear_backward(dy, g, p["w_fc2"])
        df1 = ops.mul(dg, gelu_tanh_derivative(ops, f1))
        dln2, grads["w_fc1"], grads["b_fc1"] = self.linear_backward(df1, ln2, p["w_fc1"])
        dh_ln, grads["ln2_w"], grads["ln2_b"] = self.layer_norm_backward(
            dln2, p["ln2_w"], *ln2_saved)
        dh = ops.add(dy, dh_ln)
        da, grads["w_o"], grads["b_o"] = self.linear_backward(dh, a, p["w_o"])
        dq, dk, dv = ops.sdpfa_bwd(self.to_heads(self.io(da)), q, k, v, attn, lse, 0.0, True, seed,
                                   offset)
        dln1 = None
        for i, (part, d) in enumerate(zip("qkv", (dq, dk, dv))):
            w = ops.slice(p["w_qkv"], [i * H, 0], [(i + 1) * H, H])
            dln1_part, grads[f"w_{part}"], grads[f"b_{part}"] = self.linear_backward(
                self.from_heads(d), ln1, w)
            dln1 = dln1_part if dln1 is None else ops.add(dln1, dln1_part)
        dx_ln, grads["ln1_w"], grads["ln1_b"] = self.layer_norm_backward(
            dln1, p["ln1_w"], *ln1_saved)
        grads["x"] = ops.add(dh, dx_ln)
        for name in OUTPUTS:
            self.add_output(self.io(grads[name]))

    def io(self, t):
        """``t`` in the layer's dtype (a no-op when it already is)."""
        return t if t.dtype is self.dtype else self.ops.cast(t, self.dtype)

    # ----- building blocks, each with its backward --------------------------------------
    def layer_norm(self, x, w, b):
        """Layer norm over the last axis; returns the output and (x_hat, 1/std)."""
        ops = self.ops
        var, mean = ops.var_mean(x, dims=[-1], correction=0, keepdim=True)
        rstd = ops.rsqrt(ops.add(var, EPS))
        x_hat = ops.mul(ops.sub(x, mean), rstd)
        return ops.add(ops.mul(x_hat, w), b), (x_hat, rstd)

    def layer_norm_backward(self, dout, w, x_hat, rstd):
        """dx = rstd * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat * x_hat)); dw; db."""
        ops = self.ops
        dx_hat = ops.mul(dout, w)
        m1 = ops.mean(dx_hat, dims=[-1], keepdim=True)
        m2 = ops.mean(ops.mul(dx_hat, x_hat), dims=[-1], keepdim=True)
        dx = ops.mul(rstd, ops.sub(ops.sub(dx_hat, m1), ops.mul(x_hat, m2)))
        dw = ops.sum(ops.mul(dout, x_hat), dims=[0, 1])
        return dx, dw, ops.sum(dout, dims=[0, 1])

    def linear_backward(self, dout, x, w):
        """For ``out = x @ w.T + b`` over ``[B, S, *]``: dx = dout @ w, dw = dout^T x, db."""
        ops = self.ops
        dout, x = self.io(dout), self.io(x)
        n, k = w.materialized()[0].extent, w.materialized()[1].extent
        dout_t = ops.permute(ops.reshape(dout, [B * S, n]), [1, 0])
        dw = ops.matmul(dout_t, ops.reshape(x, [B * S, k]))
        return ops.matmul(dout, w), dw, ops.sum(dout, dims=[0, 1])

    def to_heads(self, t):
        """``[B, S, H]`` to ``[B, HEADS, S, D]``."""
        return self.ops.permute(self.ops.reshape(t, [B, S, HEADS, D]), [0, 2, 1, 3])

    def from_heads(self, t):
        """``[B, HEADS, S, D]`` to ``[B, S, H]``."""
        return self.ops.reshape(self.ops.permute(t, [0, 2, 1, 3]), [B, S, H])


# ----------------------------------------------------------------------------------------------
# The test


def make_inputs(dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    params = {}
    for name, shape in PARAMS.items():
        if name.startswith("ln") and name.endswith("_w"):
            params[name] = (1 + rand(*shape, scale=0.1))
        elif name.startswith("w"):
            params[name] = rand(*shape, scale=1 / math.sqrt(shape[1]))
        else:
            params[name] = rand(*shape, scale=0.1)
    return rand(B, S, H), rand(B, S, H), params


# (rtol, atol relative to each tensor's largest magnitude) against the float64 reference.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 3e-2)}
# The key bias gets no gradient (softmax is invariant to adding one value to every score of a
# row): its exact gradient is zero, so its rounding errors are judged at the query bias's scale.
SCALE_OF = {"b_k": "b_q"}


def _split_qkv(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block's parameters with separate q/k/v projections (GptBlock's)."""
    split = {n: t for n, t in params.items() if not n.endswith("qkv")}
    for name in ("w", "b"):
        for part, t in zip("qkv", params[f"{name}_qkv"].split(H, dim=0)):
            split[f"{name}_{part}"] = t
    return {n: split[n] for n in parameter_shapes(H)}


def _derived(block: GptBlock, x, dy, params, rank: int = 0):
    """``y`` and the gradients of ``sum(y * dy)`` through ``block.as_autograd_function()``,
    on this rank's shards; also the collectives the forward and the backward ran."""
    block.define()
    tvs = [block.x, *block.params.values()]
    leaves = [shard_tensor(t, tv, rank).to(current_device()).requires_grad_()
              for t, tv in zip([x, *params.values()], tvs)]
    with record_communications() as forward:
        y, = block.as_autograd_function()(leaves)
    with record_communications() as backward:
        y.backward(shard_tensor(dy, block.y, rank).to(current_device()))
    grads = {"y": y.detach(), "x": leaves[0].grad,
             **{n: leaf.grad for n, leaf in zip(params, leaves[1:])}}
    counts = [Counter(c.kind for c in comms) for comms in (forward, backward)]
    return grads, counts


@pytest.mark.mpi
def test_forward_only_layer_tp_sp_gradients_match_autograd(multidevice_test):
    """The layer written as its forward only, tensor and sequence parallel: every rank's
    gradients are its shards of PyTorch autograd's. The forward runs two allgathers (the
    layer norm outputs) and two reduce-scatters (the row-parallel results); the backward
    their transposes, the layer norm outputs gathered again for the weight gradients, and an
    allreduce for each layer norm parameter's gradient (a sum over sequence shards; the
    row-parallel biases' gradients are sums of the gathered cotangent, complete locally). The input gradients of the q, k and v projections are three
    partial sums: each is allreduced before they are added (an add of partial values is not
    kept partial yet), where one reduce-scatter of their sum would do."""
    x, dy, params = make_inputs(torch.float32, "cpu")
    params = _split_qkv(params)
    mesh = DeviceMesh(range(multidevice_test.size))
    block = GptBlock(B, S, H, HEADS, DataType.Float, mesh)
    got, (forward, backward) = _derived(block, x, dy, params, multidevice_test.rank)
    expected = reference(x, dy, {**params, "w_qkv": torch.cat([params[f"w_{n}"] for n in "qkv"]),
                                 "b_qkv": torch.cat([params[f"b_{n}"] for n in "qkv"])})
    rtol, atol = TOLERANCE[torch.float32]
    tvs = {"y": block.y, "x": block.x, **block.params}
    for name, tv in tvs.items():
        ref = shard_tensor(expected[name].float(), tv, multidevice_test.rank)
        scale = expected[SCALE_OF.get(name, name)].abs().max().item()
        torch.testing.assert_close(got[name].cpu(), ref, rtol=rtol, atol=atol * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if multidevice_test.size > 1:
        assert forward == Counter({"allgather": 2, "reduce_scatter": 2})
        assert backward == Counter({"allgather": 4, "reduce_scatter": 1, "allreduce": 4 + 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_derived_backward_equals_the_hand_written_one(dtype):
    """The hand-written fusion above (forward and backward as one fusion) and the derived
    backward of the forward-only block give the same gradients."""
    x, dy, params = make_inputs(dtype, "cpu")
    written = dict(zip(OUTPUTS, TransformerLayer(dtype).execute([x, dy, *params.values()])))
    derived, _ = _derived(GptBlock(B, S, H, HEADS, DataType.from_torch(dtype)), x, dy,
                          _split_qkv(params))
    rtol, atol = TOLERANCE[dtype]
    for name, value in written.items():
        scale = written[SCALE_OF.get(name, name)].abs().max().item()
        torch.testing.assert_close(derived[name].double(), value.double(), rtol=rtol,
                                   atol=atol * scale, msg=lambda m, name=name: f"{name}: {m}")
