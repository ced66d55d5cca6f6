"""A GPT block written as its forward only, tensor and sequence parallel (Megatron TP+SP).

The block (pre-norm, causal self-attention, tanh-GELU MLP)::

    h = x + out_proj(attention(q_proj(ln1(x)), k_proj(ln1(x)), v_proj(ln1(x))))
    y = h + fc2(gelu_tanh(fc1(ln2(h))))

Its backward is derived (``fd.as_autograd_function()``, ``meshfuse.vjp``); nothing of it is
written here. The schedule pins what a Megatron user decides, on a 1-D mesh of ``d`` ranks:
q/k/v and fc1 weights column parallel (output features, so heads, split), out_proj and fc2
row parallel (input features split), layer norms and the row-parallel biases replicated,
and with sequence parallelism the block's input and output (and ``h``) split on the
sequence. Propagation and resharding derive the rest: an allgather of each layer norm's
output before the column-parallel projections and a reduce-scatter of each row-parallel
result, in the forward and, transposed, in the backward.

:class:`GptBlockWithBackward` is the same block with its backward written out by hand (the
layer norm, tanh-GELU, attention and head-split derivatives as ops) in one fusion: the
reference the derived backward is tested and benchmarked against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshfuse.dtypes import DataType
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType

EPS = 1e-5


def parameter_shapes(embed: int) -> dict[str, tuple[int, ...]]:
    """The block's parameters, in input order after ``x``."""
    e = embed
    return {
        "ln1_w": (e,), "ln1_b": (e,),
        "w_q": (e, e), "b_q": (e,), "w_k": (e, e), "b_k": (e,), "w_v": (e, e), "b_v": (e,),
        "w_o": (e, e), "b_o": (e,),
        "ln2_w": (e,), "ln2_b": (e,),
        "w_fc1": (4 * e, e), "b_fc1": (4 * e,), "w_fc2": (e, 4 * e), "b_fc2": (e,),
    }


# The axis each parameter is split on under tensor parallelism (None: replicated).
TP_AXIS = {"w_q": 0, "b_q": 0, "w_k": 0, "b_k": 0, "w_v": 0, "b_v": 0, "w_o": 1,
           "w_fc1": 0, "b_fc1": 0, "w_fc2": 1}


class GptBlock(FusionDefinition):
    """One block; inputs ``x [batch, seq, embed]`` then :func:`parameter_shapes`' parameters;
    output ``y``.

    Args:
        batch, seq, embed, heads: the sizes (global).
        dtype: the element type.
        mesh: a 1-D mesh for tensor parallelism, or None (one device).
        sequence_parallel: split ``x``, ``h`` and ``y`` on the sequence (else replicated).
        output_replicated: gather ``y`` on every rank (for a loss computed on each).
    """

    def __init__(self, batch: int, seq: int, embed: int, heads: int,
                 dtype: DataType = DataType.Float, mesh: DeviceMesh | None = None,
                 sequence_parallel: bool = True, output_replicated: bool = False) -> None:
        super().__init__()
        self.sizes = (batch, seq, embed, heads)
        self.dtype = dtype
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.output_replicated = output_replicated
        self.params: dict = {}

    def definition(self) -> None:
        self.define_inputs()
        self.add_output(self.forward())

    def define_inputs(self) -> None:
        b, s, e, _ = self.sizes
        self.x = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        for name, shape in parameter_shapes(e).items():
            self.params[name] = self.define_tensor(list(shape), dtype=self.dtype,
                                                   contiguity=True)

    def forward(self):
        """Defines the block's ops; returns ``y``. The intermediates a backward reads are
        kept in ``self.saved`` by name."""
        o, p = self.ops, self.params
        ln1, x_hat1, rstd1 = self.layer_norm(self.x, p["ln1_w"], p["ln1_b"])
        ln1_in = self.tp_input(ln1)
        q, k, v = (self.to_heads(o.linear(ln1_in, p[f"w_{n}"], p[f"b_{n}"])) for n in "qkv")
        attn, lse, seed, offset = o.sdpfa_fwd(q, k, v, 0.0, True)
        a = self.from_heads(attn)
        # nvFuser's promotion adds bf16 in float: the sums are cast back to the block's dtype
        # (and scheduled like the casts, so that partial sums are reduce-scattered into them).
        self.h_sum = o.add(self.x, o.linear(a, p["w_o"], p["b_o"]))
        self.h = self._io(self.h_sum)
        ln2, x_hat2, rstd2 = self.layer_norm(self.h, p["ln2_w"], p["ln2_b"])
        ln2_in = self.tp_input(ln2)
        f1 = o.linear(ln2_in, p["w_fc1"], p["b_fc1"])
        g = o.gelu(f1, approximate="tanh")
        self.y_sum = o.add(self.h, o.linear(g, p["w_fc2"], p["b_fc2"]))
        self.y = self._io(self.y_sum)
        self.saved = {"ln1_in": ln1_in, "x_hat1": x_hat1, "rstd1": rstd1, "q": q, "k": k,
                      "v": v, "attn": attn, "lse": lse, "seed": seed, "offset": offset, "a": a,
                      "ln2_in": ln2_in, "x_hat2": x_hat2, "rstd2": rstd2, "f1": f1, "g": g}
        return self.y

    def tp_input(self, t):
        """The input of a tensor-parallel region (a layer norm's output, read by the
        column-parallel projections): ``t`` itself; propagation gathers it."""
        return t

    def multidevice_schedule(self) -> None:
        if self.mesh is None:
            return
        for name, tv in self.params.items():
            self._place(tv, TP_AXIS.get(name))
        sequence = 1 if self.sequence_parallel else None
        self._place(self.x, sequence)
        for tv in dict.fromkeys((self.h_sum, self.h)):  # one tensor in float32
            self._place(tv, sequence)
        for tv in dict.fromkeys((self.y_sum, self.y)):
            self._place(tv, None if self.output_replicated else sequence)

    def _place(self, tv, axis: int | None) -> None:
        place(tv, self.mesh, axis)

    def layer_norm(self, x, w, b):
        """Layer norm over the last axis: the output (in the block's dtype), and the
        normalized ``x_hat`` and ``1 / std`` (for a backward)."""
        o = self.ops
        var, mean = o.var_mean(x, dims=[-1], correction=0, keepdim=True)
        rstd = o.rsqrt(o.add(var, EPS))
        x_hat = o.mul(o.sub(x, mean), rstd)
        return self._io(o.add(o.mul(x_hat, w), b)), x_hat, rstd

    def _io(self, t):
        """``t`` in the block's dtype (a no-op when it already is)."""
        return t if t.dtype is self.dtype else self.ops.cast(t, self.dtype)

    def to_heads(self, t):
        """``[B, S, E]`` to ``[B, heads, S, E / heads]``."""
        b, s, e, heads = self.sizes
        return self.ops.permute(self.ops.reshape(t, [b, s, heads, e // heads]), [0, 2, 1, 3])

    def from_heads(self, t):
        b, s, e, _ = self.sizes
        return self.ops.reshape(self.ops.permute(t, [0, 2, 1, 3]), [b, s, e])


class GptBlockWithBackward(GptBlock):
    """:class:`GptBlock` and its backward written out, as one fusion: inputs ``x``, ``dy``
    (the cotangent of ``y``, laid out like it), then the parameters; outputs ``y``, ``dx``,
    then each parameter's gradient (:func:`parameter_shapes` order), in the block's dtype.

    Sharded like the block, ``dy`` as ``y``, the gradient of each input and activation as
    its primal (as the derived backward pins them): the sequence-parallel ones on the
    sequence, the tensor-parallel ones on features or heads. So the backward communicates as
    Megatron's: the cotangents gathered into the tensor-parallel regions, their input
    gradients (partial sums) reduce-scattered back onto the sequence.
    """

    def definition(self) -> None:
        b, s, e, _ = self.sizes
        self.x = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        self.dy = self.define_tensor([b, s, e], dtype=self.dtype, contiguity=True)
        self._gathers = []
        for name, shape in parameter_shapes(e).items():
            self.params[name] = self.define_tensor(list(shape), dtype=self.dtype,
                                                   contiguity=True)
        self.add_output(self.forward())
        self.grads = self.backward(self.dy)
        for name in ("x", *self.params):
            self.grads[name] = self._io(self.grads[name])
            self.add_output(self.grads[name])

    def multidevice_schedule(self) -> None:
        super().multidevice_schedule()
        if self.mesh is None:
            return
        self._place(self.dy, None if self.output_replicated else 1)
        for name in self.params:
            self._place(self.grads[name], TP_AXIS.get(name))
        sequence = 1 if self.sequence_parallel else None
        for tv, axis in self._activation_grads:
            self._place(tv, sequence if axis == "sequence" else axis)
        for tv in self._gathers:
            self._place(tv, None)

    def backward(self, dy) -> dict:
        """The gradients of ``sum(y * dy)``, by name (``"x"`` and the parameters')."""
        o, p, sv = self.ops, self.params, self.saved
        grads = {}
        dg, grads["w_fc2"], grads["b_fc2"] = self.linear_backward(
            self._gathered(dy), sv["g"], p["w_fc2"])
        df1 = o.gelu_backward(dg, sv["f1"], "tanh")
        dln2, grads["w_fc1"], grads["b_fc1"] = self.linear_backward(
            df1, sv["ln2_in"], p["w_fc1"])
        dh_ln, grads["ln2_w"], grads["ln2_b"] = self.layer_norm_backward(
            dln2, p["ln2_w"], sv["x_hat2"], sv["rstd2"])
        dh = self._io(o.add(dy, dh_ln))  # gathered next: in the block's dtype, not float
        da, grads["w_o"], grads["b_o"] = self.linear_backward(
            self._gathered(dh), sv["a"], p["w_o"])
        dq, dk, dv = o.sdpfa_bwd(self.to_heads(self._io(da)), sv["q"], sv["k"], sv["v"],
                                 sv["attn"], sv["lse"], 0.0, True, sv["seed"], sv["offset"])
        ln1 = sv["ln1_in"]
        dln1 = None
        for n, d in zip("qkv", (dq, dk, dv)):
            part, grads[f"w_{n}"], grads[f"b_{n}"] = self.linear_backward(
                self.from_heads(d), ln1, p[f"w_{n}"])
            dln1 = part if dln1 is None else o.add(dln1, part)
        dln1 = self._io(dln1)  # rounded once, then reduce-scattered in the block's dtype
        dx_ln, grads["ln1_w"], grads["ln1_b"] = self.layer_norm_backward(
            dln1, p["ln1_w"], sv["x_hat1"], sv["rstd1"])
        grads["x"] = o.add(dh, dx_ln)
        # Where each activation's gradient lies: as the activation.
        self._activation_grads = [(dg, 2), (df1, 2), (dln2, "sequence"), (dh, "sequence"),
                                  (da, 2), (dq, 1), (dk, 1), (dv, 1), (dln1, "sequence"),
                                  (dx_ln, "sequence"), (grads["x"], "sequence")]
        return grads

    def tp_input(self, t):
        """The layer norm's output gathered once, in the forward, and read again by the
        weight gradients (as DTensor's autograd saves it)."""
        return self._gathered(t)

    def _gathered(self, t):
        """``t`` (sequence parallel) gathered whole on every rank, for a matmul of the
        tensor-parallel region."""
        if self.mesh is None or not self.sequence_parallel:
            return t
        gathered = self.ops.set(t)
        self._gathers.append(gathered)
        return gathered

    def layer_norm_backward(self, dout, w, x_hat, rstd):
        """dx = rstd (dx_hat - mean(dx_hat) - x_hat mean(dx_hat x_hat)), dw, db."""
        o = self.ops
        dx_hat = o.mul(dout, w)
        m1 = o.mean(dx_hat, dims=[-1], keepdim=True)
        m2 = o.mean(o.mul(dx_hat, x_hat), dims=[-1], keepdim=True)
        dx = o.mul(rstd, o.sub(o.sub(dx_hat, m1), o.mul(x_hat, m2)))
        return dx, o.sum(o.mul(dout, x_hat), dims=[0, 1]), o.sum(dout, dims=[0, 1])

    def linear_backward(self, dout, x, w):
        """For ``out = x @ w.T + b`` over ``[batch, seq, *]``: dx = dout @ w, dw, db. The
        weight gradient is one matrix product over all tokens, ``dout^T x`` with batch and
        sequence merged (both whole here: the tensor-parallel region's inputs are gathered),
        in the layouts torch's autograd uses (no copy of a transposed operand, no sum of a
        batch of weight-sized products)."""
        o = self.ops
        dout, x = self._io(dout), self._io(x)
        dw = o.matmul(o.permute(self._tokens(dout), [1, 0]), self._tokens(x))
        return o.matmul(dout, w), dw, o.sum(dout, dims=[0, 1])

    def _tokens(self, t):
        """``[batch, seq, features]`` as ``[batch * seq, features]``."""
        b, s = self.sizes[:2]
        return self.ops.reshape(t, [b * s, t.materialized()[-1].extent])


def place(tv, mesh: DeviceMesh, axis: int | None) -> None:
    """Puts ``tv`` on the 1-D ``mesh``, block-split on its materialized axis ``axis`` (None:
    replicated): how the examples pin a Megatron layout."""
    tv.set_device_mesh(mesh)
    if axis is not None:
        loop = tv.loop.index(tv.materialized()[axis])  # a sum's reduction axes come first
        tv.outer_split(loop, mesh.size)
        tv.axis(loop).parallelize(ParallelType.mesh_x)


def gelu_tanh_derivative(ops, x):
    """d/dx of 0.5 x (1 + tanh(u)), u = c (x + a x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) u',
    with fusion ops (``ops``: a FusionDefinition's ``ops``)."""
    c, a = math.sqrt(2 / math.pi), 0.044715
    x2 = ops.mul(x, x)
    t = ops.tanh(ops.mul(ops.mul(x, ops.add(ops.mul(x2, a), 1.0)), c))
    du = ops.mul(ops.add(ops.mul(x2, 3 * a), 1.0), c)
    dtanh = ops.mul(ops.mul(ops.sub(1.0, ops.mul(t, t)), du), ops.mul(x, 0.5))
    return ops.add(ops.mul(ops.add(t, 1.0), 0.5), dtanh)


def torch_block(x: torch.Tensor, p: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """The same block in plain PyTorch (the reference)."""
    b, s, e = x.shape
    h = F.layer_norm(x, (e,), p["ln1_w"], p["ln1_b"], EPS)
    q, k, v = (F.linear(h, p[f"w_{n}"], p[f"b_{n}"]).reshape(b, s, heads, e // heads)
               .transpose(1, 2) for n in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(b, s, e), p["w_o"], p["b_o"])
    f = F.gelu(F.linear(F.layer_norm(x, (e,), p["ln2_w"], p["ln2_b"], EPS), p["w_fc1"],
                        p["b_fc1"]), approximate="tanh")
    return x + F.linear(f, p["w_fc2"], p["b_fc2"])


def init_parameters(embed: int, seed: int = 0, dtype=torch.float32,
                    device=None) -> dict[str, torch.Tensor]:
    """Global initial values: layer norms near (1, 0), weights scaled by 1/sqrt(fan_in);
    drawn on ``device`` (default the CPU; the same values on every rank of one device type)."""
    gen = torch.Generator(device or "cpu").manual_seed(seed)
    result = {}
    for name, shape in parameter_shapes(embed).items():
        x = torch.randn(shape, generator=gen, device=device)
        if name.startswith("ln"):
            x = (1 + 0.1 * x) if name.endswith("_w") else 0.1 * x
        elif name.startswith("w"):
            x = x / shape[1] ** 0.5
        else:
            x = 0.1 * x
        result[name] = x.to(dtype)
    return result
