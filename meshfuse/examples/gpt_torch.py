"""The GPT block of :mod:`meshfuse.examples.gpt` as torch modules, and DTensor's tensor and
sequence parallel plan of it: the references that meshfuse's block is tested, trained and
benchmarked against (``parallelize_module``, Colwise/Rowwise + SequenceParallel).

The block (pre-norm, causal self-attention, tanh-GELU MLP, biases, no dropout)::

    h = x + o(attention(q(ln1(x)), k(ln1(x)), v(ln1(x))))
    y = h + fc2(gelu_tanh(fc1(ln2(h))))

Tensor parallelism (TP) splits q, k, v and fc1 by output features (so the heads) and o and
fc2 by input features; sequence parallelism (SP) splits ``x``, ``h`` and ``y`` (so the layer
norms and the residuals) on the sequence. The parameters are named as
:func:`meshfuse.examples.gpt.parameter_shapes` names them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshfuse.examples.gpt import EPS


class _Attention(torch.nn.Module):
    def __init__(self, embed: int, heads: int) -> None:
        super().__init__()
        self.head_dim = embed // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(embed, embed) for _ in range(4))

    def forward(self, x):
        def split(t):  # the local heads under tensor parallelism
            return t.view(t.shape[0], t.shape[1], -1, self.head_dim).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                           is_causal=True)
        return self.o(a.transpose(1, 2).reshape(a.shape[0], a.shape[2], -1))


class _Mlp(torch.nn.Module):
    def __init__(self, embed: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(embed, 4 * embed), torch.nn.Linear(4 * embed, embed)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Gpt3Block(torch.nn.Module):
    """The layer as torch modules (what ``parallelize_module`` shards), with the values of
    ``params`` (global, :func:`meshfuse.examples.gpt.parameter_shapes` names)."""

    def __init__(self, params: dict[str, torch.Tensor], heads: int) -> None:
        super().__init__()
        e = params["w_q"].shape[1]
        with torch.device(params["w_q"].device):  # not 7 GB of float32 on the host first
            self.ln1, self.ln2 = torch.nn.LayerNorm(e, eps=EPS), torch.nn.LayerNorm(e, eps=EPS)
            self.attention, self.mlp = _Attention(e, heads), _Mlp(e)
        self.to(dtype=params["w_q"].dtype)
        linears = {**{n: getattr(self.attention, n) for n in "qkvo"},
                   "fc1": self.mlp.fc1, "fc2": self.mlp.fc2}
        with torch.no_grad():
            for name, module in (("ln1", self.ln1), ("ln2", self.ln2)):
                module.weight.copy_(params[f"{name}_w"])
                module.bias.copy_(params[f"{name}_b"])
            for name, module in linears.items():
                module.weight.copy_(params[f"w_{name}"])
                module.bias.copy_(params[f"b_{name}"])

    def forward(self, x):
        h = x + self.attention(self.ln1(x))
        return h + self.mlp(self.ln2(h))


def parallelize(block: Gpt3Block, mesh) -> torch.nn.Module:
    """Megatron TP + SP with ``parallelize_module``, as torchtitan writes it: sequence-parallel
    layer norms, their outputs gathered once at the attention and MLP inputs, colwise q, k, v
    and fc1, rowwise o and fc2 reduce-scattered back to the sequence split."""
    def gather():
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def rowwise():
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)

    plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attention": gather(), "mlp": gather(),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(), "attention.o": rowwise(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": rowwise()}
    return parallelize_module(block, mesh, plan)
