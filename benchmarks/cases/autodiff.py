"""Issue 17: forward and backward through derived backwards (``fd.as_autograd_function()``).

- ``mlp_autodiff``: the Megatron MLP of the ``mlp`` case (T8192 H8192 F32768, bf16), forward
  and backward: ``hand_written`` (baseline: :class:`~benchmarks.fusions.MegatronMlp`, the
  backward written out in the same fusion) against ``derived`` (the forward only, its
  backward derived, run through torch autograd). Time and peak memory.
- ``gpt_layer``: a GPT-3 block (e=12288, s=2048, 96 heads, b=1, bf16) forward and backward,
  tensor and sequence parallel: ``meshfuse_autograd``
  (:class:`~meshfuse.examples.gpt.GptBlock` through autograd) against ``dtensor_tp_sp``
  (the same block in torch, ``parallelize_module`` with Megatron's colwise/rowwise plan and
  sequence-parallel layer norms) and ``torch_1gpu`` (the whole block on each GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import meshfuse
from benchmarks.cases.mlp import QUICK_SIZES, SIZES, mlp_flops, tensors
from benchmarks.context import Context
from benchmarks.fusions import MegatronMlp
from benchmarks.harness import Plan, Record, Skip, Variant, check_close, run_variants
from meshfuse import DataType, FusionDefinition, ParallelType
from meshfuse.examples.gpt import GptBlock, init_parameters, torch_block

GPT3 = {"batch": 1, "seq": 2048, "embed": 12288, "heads": 96}
GPT_QUICK = {"batch": 1, "seq": 16, "embed": 32, "heads": 4}
TOL = 3e-2  # bf16, relative


def forward_only_mlp(sizes, mesh, dtype: DataType) -> tuple[FusionDefinition, list]:
    """``z = gelu(x @ w1.T) @ w2.T``, Megatron-sharded weights, z replicated."""
    t, h, f = sizes["tokens"], sizes["hidden"], sizes["ffn"]
    with FusionDefinition() as fd:
        x = fd.define_tensor([t, h], dtype=dtype)
        w1 = fd.define_tensor([f, h], dtype=dtype)
        w2 = fd.define_tensor([h, f], dtype=dtype)
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1)), w2)
        fd.add_output(z)
    if mesh is not None:
        for tv, axis in ((x, None), (w1, 0), (w2, 1), (z, None)):
            tv.set_device_mesh(mesh)
            if axis is not None:
                tv.outer_split(axis, mesh.size)
                tv.axis(axis).parallelize(ParallelType.mesh_x)
    return fd, [x, w1, w2]


def _autograd_step(function, inputs, cotangent):
    leaves = [t.detach().requires_grad_() for t in inputs]

    def step():
        out, = function(leaves)
        return out, torch.autograd.grad(out, leaves, cotangent)

    return step


def mlp_run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    x, dz, _, _, w1_local, w2_local = tensors(ctx, sizes, dtype)
    mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None
    mf_dtype = DataType.from_torch(dtype)

    def hand_written():
        model = MegatronMlp(**sizes, mesh=mesh, dtype=mf_dtype)
        inputs = [x, w1_local, w2_local, dz]
        return lambda: model.execute(inputs)

    def derived():
        fd, _ = forward_only_mlp(sizes, mesh, mf_dtype)
        step = _autograd_step(fd.as_autograd_function(), [x, w1_local, w2_local], dz)
        z, (dx, dw1, dw2) = step()
        expected = MegatronMlp(**sizes, mesh=mesh, dtype=mf_dtype).execute(
            [x, w1_local, w2_local, dz])
        check_close("derived vs hand_written", [z, dx, dw1, dw2], expected, TOL)
        return step

    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=15)
    plan = Plan(plan.warmup, plan.iters, flops=mlp_flops(**sizes))
    variants = [
        Variant("hand_written", hand_written, "forward and backward written as one fusion"),
        Variant("derived", derived, "forward only; backward derived, through torch autograd"),
    ]
    params = dict(sizes, dtype=str(dtype).removeprefix("torch."))
    return run_variants(ctx, "mlp_autodiff",
                        f"T{sizes['tokens']} H{sizes['hidden']} F{sizes['ffn']}",
                        variants, plan, "hand_written", params)


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


class TorchBlock(torch.nn.Module):
    """The GPT block as torch modules (what ``parallelize_module`` shards)."""

    def __init__(self, params: dict[str, torch.Tensor], heads: int) -> None:
        super().__init__()
        e = params["w_q"].shape[1]
        self.ln1, self.ln2 = torch.nn.LayerNorm(e), torch.nn.LayerNorm(e)
        self.attention, self.mlp = _Attention(e, heads), _Mlp(e)
        linears = {**{f"{n}": getattr(self.attention, n) for n in "qkvo"},
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


def _dtensor_block(ctx: Context, params, heads: int):
    """Megatron TP + SP as torchtitan writes it: sequence-parallel layer norms, their
    outputs gathered at the attention and MLP inputs, colwise q/k/v/fc1, rowwise o/fc2
    reduce-scattered back to the sequence split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    def gather():
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    def rowwise():
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)

    plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attention": gather(), "mlp": gather(),
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(), "attention.o": rowwise(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": rowwise()}
    block = TorchBlock(params, heads).to(ctx.device, params["w_q"].dtype)
    return parallelize_module(block, ctx.dtensor_mesh(), plan)


def gpt_run(ctx: Context) -> list[Record]:
    sizes = GPT_QUICK if ctx.quick else GPT3
    b, s, e, heads = sizes["batch"], sizes["seq"], sizes["embed"], sizes["heads"]
    if heads % ctx.world or s % ctx.world:
        raise ValueError(f"{heads} heads and sequence {s} must split over {ctx.world} ranks")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator(ctx.device).manual_seed(0)
    x = torch.randn(b, s, e, generator=gen, device=ctx.device, dtype=dtype)
    dy = torch.randn(b, s, e, generator=gen, device=ctx.device, dtype=dtype)
    params = {n: t.to(ctx.device, dtype) for n, t in init_parameters(e).items()}
    mesh = meshfuse.DeviceMesh(range(ctx.world)) if ctx.world > 1 else None

    def meshfuse_autograd():
        block = GptBlock(b, s, e, heads, DataType.from_torch(dtype), mesh).define()
        tvs = [block.x, *block.params.values()]
        local = [meshfuse.shard_tensor(t, tv).to(ctx.device)
                 for t, tv in zip([x, *params.values()], tvs)]
        step = _autograd_step(block.as_autograd_function(), local,
                              meshfuse.shard_tensor(dy, block.y).to(ctx.device))
        y, _ = step()
        expected = torch_block(x, params, heads)
        check_close("meshfuse vs torch", [y], [meshfuse.shard_tensor(expected, block.y)], TOL)
        return step

    def dtensor_tp_sp():
        if ctx.world == 1:
            raise Skip("tensor parallelism needs 2 or more ranks")
        from torch.distributed.tensor import DTensor, Shard

        block = _dtensor_block(ctx, params, heads)
        mesh_ = ctx.dtensor_mesh()
        per = s // ctx.world
        local_x = x[:, ctx.rank * per:(ctx.rank + 1) * per].contiguous().requires_grad_()
        local_dy = dy[:, ctx.rank * per:(ctx.rank + 1) * per].contiguous()
        leaves = [local_x, *block.parameters()]

        def step():
            y = block(DTensor.from_local(local_x, mesh_, [Shard(1)]))
            y = y.to_local() if isinstance(y, DTensor) else y
            return y, torch.autograd.grad(y, leaves, local_dy)

        return step

    def one_gpu():
        block = TorchBlock(params, heads).to(ctx.device, dtype)
        leaves = [x.detach().requires_grad_(), *block.parameters()]

        def step():
            y = block(leaves[0])
            return y, torch.autograd.grad(y, leaves, dy)

        return step

    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=15)
    variants = [
        Variant("torch_1gpu", one_gpu, "the whole block on each GPU, autograd", gpus=1),
        Variant("dtensor_tp_sp", dtensor_tp_sp, "parallelize_module, Megatron TP + SP"),
        Variant("meshfuse_autograd", meshfuse_autograd, "forward-only fusion, derived backward"),
    ]
    params_ = dict(sizes, dtype=str(dtype).removeprefix("torch."))
    return run_variants(ctx, "gpt_layer", f"e{e} s{s} h{heads} b{b}", variants, plan,
                        "dtensor_tp_sp" if ctx.world > 1 else "torch_1gpu", params_)
