"""A GPT-3 transformer layer, forward and backward, as one meshfuse fusion and as a torch
module (the layer of nvFuser's multi-device transformer test, written here for meshfuse).

The layer (pre-norm, causal self-attention, tanh-GELU MLP, biases, no dropout)::

    h = x + proj(attention(qkv(layer_norm_1(x))))
    y = h + fc2(gelu_tanh(fc1(layer_norm_2(h))))

The qkv projection's outputs are grouped by head (``[h, 3 * dh]``: each head's q, k and v
rows together), so that a row shard of its weight holds whole heads: Megatron's layout.
Tensor parallelism (TP) shards ``qkv`` and ``fc1`` by rows and ``proj`` and ``fc2`` by
columns; sequence parallelism (SP) shards ``x`` and ``dy`` (and so the layer norms and the
residuals) on the sequence. The fusion's arithmetic is nvFuser's: Float for the layer norms
and residuals, the I/O dtype (bf16) for matmuls and attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import meshfuse
from meshfuse import DataType, FusionDefinition, ParallelType

EPS = 1e-5
PARAM_SHAPES = {  # name -> shape as a function of the hidden size e
    "ln1_w": lambda e: (e,), "ln1_b": lambda e: (e,),
    "w_qkv": lambda e: (3 * e, e), "b_qkv": lambda e: (3 * e,),
    "w_o": lambda e: (e, e), "b_o": lambda e: (e,),
    "ln2_w": lambda e: (e,), "ln2_b": lambda e: (e,),
    "w_fc1": lambda e: (4 * e, e), "b_fc1": lambda e: (4 * e,),
    "w_fc2": lambda e: (e, 4 * e), "b_fc2": lambda e: (e,),
}
ROW_SHARDED = ("w_qkv", "b_qkv", "w_fc1", "b_fc1")   # column-parallel linears
COLUMN_SHARDED = ("w_o", "w_fc2")                    # row-parallel linears


def layer_flops(b: int, s: int, e: int) -> float:
    """Forward and backward: 3 x (the linears' 24 b s e^2 + attention's 4 b s^2 e)."""
    return 3.0 * (24.0 * b * s * e * e + 4.0 * b * s * s * e)


class Gpt3Layer(FusionDefinition):
    """Inputs: ``x``, ``dy`` (``[b, s, e]``), then the parameters in PARAM_SHAPES order.
    Outputs: ``y``, ``dx``, then each parameter's gradient (PARAM_SHAPES order).

    ``mesh`` None: unsharded. Else TP over the mesh, and with ``sequence_parallel`` SP too.
    """

    def __init__(self, b: int, s: int, h: int, e: int, dtype: DataType,
                 mesh: meshfuse.DeviceMesh | None = None, sequence_parallel: bool = True):
        super().__init__()
        self.b, self.s, self.h, self.e, self.dtype = b, s, h, e, dtype
        self.mesh, self.sequence_parallel = mesh, sequence_parallel

    def definition(self) -> None:
        b, s, e = self.b, self.s, self.e
        self.x = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        self.dy = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        self.p = {n: self.define_tensor(list(shape(e)), dtype=self.dtype, contiguity=True)
                  for n, shape in PARAM_SHAPES.items()}
        y, saved = self.forward(self.x)
        grads = self.backward(self.dy, saved)
        for t in (y, grads["x"], *(grads[n] for n in PARAM_SHAPES)):
            self.add_output(self.io(t))

    def multidevice_schedule(self) -> None:
        if self.mesh is None:
            return
        d = self.mesh.size
        for tv in self.fusion.inputs():
            tv.set_device_mesh(self.mesh)
        sharded = [(self.p[n], 0) for n in ROW_SHARDED] + [(self.p[n], 1) for n in COLUMN_SHARDED]
        if self.sequence_parallel:
            sharded += [(self.x, 1), (self.dy, 1)]
        for tv, axis in sharded:
            tv.outer_split(axis, d)
            tv.axis(axis).parallelize(ParallelType.mesh_x)

    # ----- the layer ------------------------------------------------------------------------
    def forward(self, x):
        ops, p = self.ops, self.p
        x = ops.cast(x, DataType.Float)
        ln1, ln1_saved = self.layer_norm(x, p["ln1_w"], p["ln1_b"])
        ln1 = self.io(ln1)
        qkv = ops.linear(ln1, p["w_qkv"], p["b_qkv"])
        q, k, v = self.split_heads(qkv)
        attn, lse, seed, offset = ops.sdpfa_fwd(q, k, v, 0.0, True)
        a = self.merge_heads(attn)
        h = ops.add(x, ops.linear(a, p["w_o"], p["b_o"]))
        ln2, ln2_saved = self.layer_norm(h, p["ln2_w"], p["ln2_b"])
        ln2 = self.io(ln2)
        f1 = ops.linear(ln2, p["w_fc1"], p["b_fc1"])
        g = ops.gelu(f1, approximate="tanh")
        y = ops.add(h, ops.linear(g, p["w_fc2"], p["b_fc2"]))
        return y, (ln1, ln1_saved, q, k, v, attn, lse, seed, offset, a, ln2, ln2_saved, f1, g)

    def backward(self, dy, saved):
        ops, p = self.ops, self.p
        ln1, ln1_saved, q, k, v, attn, lse, seed, offset, a, ln2, ln2_saved, f1, g = saved
        grads = {}
        dg, grads["w_fc2"], grads["b_fc2"] = self.linear_backward(dy, g, p["w_fc2"])
        df1 = ops.mul(dg, gelu_tanh_derivative(ops, f1))
        dln2, grads["w_fc1"], grads["b_fc1"] = self.linear_backward(df1, ln2, p["w_fc1"])
        dh_ln, grads["ln2_w"], grads["ln2_b"] = self.layer_norm_backward(
            dln2, p["ln2_w"], *ln2_saved)
        dh = ops.add(ops.cast(dy, DataType.Float), dh_ln)
        da, grads["w_o"], grads["b_o"] = self.linear_backward(dh, a, p["w_o"])
        dq, dk, dv = ops.sdpfa_bwd(self.to_heads(self.io(da)), q, k, v, attn, lse, 0.0, True,
                                   seed, offset)
        dqkv = ops.reshape(ops.cat([ops.permute(t, [0, 2, 1, 3]) for t in (dq, dk, dv)], 3),
                           [self.b, self.s, 3 * self.e])
        dln1, grads["w_qkv"], grads["b_qkv"] = self.linear_backward(dqkv, ln1, p["w_qkv"])
        dx_ln, grads["ln1_w"], grads["ln1_b"] = self.layer_norm_backward(
            dln1, p["ln1_w"], *ln1_saved)
        grads["x"] = ops.add(dh, dx_ln)
        return grads

    # ----- building blocks ------------------------------------------------------------------
    def io(self, t):
        """``t`` in the layer's I/O dtype (a no-op when it already is)."""
        return t if t.dtype is self.dtype else self.ops.cast(t, self.dtype)

    def layer_norm(self, x, w, b):
        """Layer norm of the Float ``x`` over the last axis; the output and (x_hat, rstd)."""
        ops = self.ops
        var, mean = ops.var_mean(x, dims=[-1], correction=0, keepdim=True)
        rstd = ops.rsqrt(ops.add(var, EPS))
        x_hat = ops.mul(ops.sub(x, mean), rstd)
        return ops.add(ops.mul(x_hat, w), b), (x_hat, rstd)

    def layer_norm_backward(self, dout, w, x_hat, rstd):
        """dx = rstd (dx_hat - mean(dx_hat) - x_hat mean(dx_hat x_hat)); dw; db (Float)."""
        ops = self.ops
        dx_hat = ops.mul(dout, w)
        m1 = ops.mean(dx_hat, dims=[-1], keepdim=True)
        m2 = ops.mean(ops.mul(dx_hat, x_hat), dims=[-1], keepdim=True)
        dx = ops.mul(rstd, ops.sub(ops.sub(dx_hat, m1), ops.mul(x_hat, m2)))
        dw = ops.sum(ops.mul(dout, x_hat), dims=[0, 1])
        return dx, dw, ops.sum(ops.cast(dout, DataType.Float), dims=[0, 1])

    def linear_backward(self, dout, x, w):
        """For ``out = x @ w.T + b`` over ``[b, s, *]``: dx = dout @ w, dw = dout^T x, db."""
        ops = self.ops
        dout = self.io(dout)
        n, k = (i.extent for i in w.materialized())
        rows = self.b * self.s
        dw = ops.matmul(ops.permute(ops.reshape(dout, [rows, n]), [1, 0]),
                        ops.reshape(x, [rows, k]))
        db = ops.sum(dout, dims=[0, 1], dtype=DataType.Float)
        return ops.matmul(dout, w), dw, db

    def split_heads(self, qkv):
        """``[b, s, 3e]`` grouped by head to q, k, v, each ``[b, h, s, dh]``."""
        ops, b, s, h = self.ops, self.b, self.s, self.h
        dh = self.e // h
        grouped = ops.reshape(qkv, [b, s, h, 3 * dh])
        return tuple(ops.permute(ops.slice(grouped, [0, 0, 0, i * dh], [b, s, h, (i + 1) * dh]),
                                 [0, 2, 1, 3]) for i in range(3))

    def to_heads(self, t):
        """``[b, s, e]`` to ``[b, h, s, dh]``."""
        ops = self.ops
        return ops.permute(ops.reshape(t, [self.b, self.s, self.h, self.e // self.h]),
                           [0, 2, 1, 3])

    def merge_heads(self, t):
        """``[b, h, s, dh]`` to ``[b, s, e]``."""
        return self.ops.reshape(self.ops.permute(t, [0, 2, 1, 3]), [self.b, self.s, self.e])


def gelu_tanh_derivative(ops, x):
    """d/dx of 0.5 x (1 + tanh(u)), u = c (x + a x^3), with fusion ops."""
    c, a = math.sqrt(2 / math.pi), 0.044715
    x2 = ops.mul(x, x)
    t = ops.tanh(ops.mul(ops.mul(x, ops.add(ops.mul(x2, a), 1.0)), c))
    du = ops.mul(ops.add(ops.mul(x2, 3 * a), 1.0), c)
    dtanh = ops.mul(ops.mul(ops.sub(1.0, ops.mul(t, t)), du), ops.mul(x, 0.5))
    return ops.add(ops.mul(ops.add(t, 1.0), 0.5), dtanh)


# ----- the same layer in torch ----------------------------------------------------------------
class Gpt3Block(torch.nn.Module):
    """The layer as a torch module (the qkv outputs grouped by head, as in the fusion); the
    number of local heads follows the local width, so it runs tensor-parallel too."""

    def __init__(self, e: int, h: int):
        super().__init__()
        self.head_dim = e // h
        self.ln1, self.ln2 = torch.nn.LayerNorm(e, eps=EPS), torch.nn.LayerNorm(e, eps=EPS)
        self.qkv, self.proj = torch.nn.Linear(e, 3 * e), torch.nn.Linear(e, e)
        self.fc1, self.fc2 = torch.nn.Linear(e, 4 * e), torch.nn.Linear(4 * e, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, s, width = qkv.shape
        grouped = qkv.reshape(b, s, width // (3 * self.head_dim), 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in grouped.split(self.head_dim, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))

    def load(self, params: dict[str, torch.Tensor]) -> Gpt3Block:
        """Copies the parameters (PARAM_SHAPES names) in."""
        names = {"ln1_w": "ln1.weight", "ln1_b": "ln1.bias", "w_qkv": "qkv.weight",
                 "b_qkv": "qkv.bias", "w_o": "proj.weight", "b_o": "proj.bias",
                 "ln2_w": "ln2.weight", "ln2_b": "ln2.bias", "w_fc1": "fc1.weight",
                 "b_fc1": "fc1.bias", "w_fc2": "fc2.weight", "b_fc2": "fc2.bias"}
        self.load_state_dict({names[n]: t for n, t in params.items()})
        return self


def make_params(e: int, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The layer's parameters, the same on every rank: weights scaled by 1/sqrt(fan in)."""
    gen = torch.Generator(device).manual_seed(seed)
    params = {}
    for name, shape in PARAM_SHAPES.items():
        t = torch.randn(shape(e), generator=gen, device=device, dtype=torch.float32)
        if name.startswith("w"):
            t = t / math.sqrt(shape(e)[1])
        elif name.startswith("ln") and name.endswith("_w"):
            t = 1 + 0.1 * t
        else:
            t = 0.1 * t
        params[name] = t.to(dtype)
    return params
