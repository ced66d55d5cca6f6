"""GPU check of attention dropout, kernel by kernel: ``python -m benchmarks.dropout_check OUT``
(one GPU) or ``torchrun --nproc-per-node 2 -m benchmarks.dropout_check OUT`` (heads split over
the GPUs). Runs on CPU processes too (the math kernel only, the seed program at small sizes).

For each kernel that runs dropout (math, cuDNN, flash, memory-efficient: forced with
``MESHFUSE_SDPA_BACKEND`` at the program's first call) and for ``dropout_mode="global"``:

- **same seed, same bits** (:func:`benchmarks.reproducibility.check_same_seed`) on the seed
  program with ``dropout_p = 0.1``: the attention output bitwise equal over two calls with one
  torch seed; the gradients bitwise equal under ``torch.use_deterministic_algorithms(True)``;
  which gradients are not bitwise equal by default (flash's ``q_grad``: atomics);
- **the masks**, read off the output of an attention whose ``v`` is the identity (``attn`` is
  then the dropped-out probability matrix, zero exactly where dropped) with identical q, k in
  every head: the same masks for the same seed and different ones for another seed, no two
  (batch, head) pairs anywhere with one mask, a kept fraction within 5 sigma of ``1 - p``, and
  gradients equal to float64 autograd with the recovered mask;
- **the user's generator**: ``torch.cuda.manual_seed(4)`` then a dropout call leaves the
  next ``torch.rand`` as without it.

Rank 0 writes ``OUT/dropout_check.json`` and prints one line per check, then ``RESULT: PASS``
or ``RESULT: FAIL``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS under deterministic mode

import torch

import meshfuse
from benchmarks import context
from benchmarks.cases.attention import QUICK_SEED_SIZES, SEED_SIZES, local_inputs
from benchmarks.fusions import QkvFormat, SeedAttention
from benchmarks.reproducibility import check_same_seed
from meshfuse import DataType, FusionDefinition, ParallelType
from meshfuse.ops.attention.backends import ENV_VAR as BACKEND_ENV

KERNELS = ("math", "cudnn", "flash", "efficient")
P, MASK_P, SEED, OFFSET = 0.1, 0.25, 99, 3
S = 128  # the mask program's sequence length and head dim (v is the S x S identity)


class MaskProgram(FusionDefinition):
    """Attention fwd+bwd with dropout, heads split over the ranks, explicit seed and offset."""

    def __init__(self, mesh, b: int, h: int, mode: str | None):
        super().__init__()
        self.mesh, self.shape, self.mode = mesh, [b, h, S, S], mode

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor(self.shape, dtype=DataType.BFloat16)
                                          for _ in range(4))
        seed, offset = (self.define_scalar(dtype=DataType.Int) for _ in range(2))
        self.attn, lse, rng_seed, rng_offset = self.ops.sdpfa_fwd(
            self.q, self.k, self.v, MASK_P, False, None, rng_seed=seed, rng_offset=offset,
            dropout_mode=self.mode)
        self.grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, self.attn, lse, MASK_P,
                                        False, rng_seed, rng_offset, None)
        for t in (self.attn, *self.grads):
            self.add_output(t)

    def multidevice_schedule(self):
        for t in (self.q, self.k, self.v, self.g, self.attn, *self.grads):
            self.sched._set_device_mesh(t, self.mesh)
            self.sched.split(t, 1, self.mesh.size, False)
            self.sched.parallelize(t, 1, ParallelType.mesh_x)


def _first_call(model, inputs, kernel: str | None):
    """The program's first call (where its kernel is bound) with ``kernel`` forced."""
    saved = os.environ.get(BACKEND_ENV)
    if kernel is not None:
        os.environ[BACKEND_ENV] = kernel
    try:
        return model.execute(inputs)
    finally:
        os.environ.pop(BACKEND_ENV, None)
        if saved is not None:
            os.environ[BACKEND_ENV] = saved


def same_bits(ctx, kernel: str | None, mode: str | None) -> dict:
    """The seed program with dropout 0.1: ``check_same_seed`` (raises if broken)."""
    sizes = SEED_SIZES if ctx.cuda else QUICK_SEED_SIZES
    inputs = local_inputs(ctx, sizes, QkvFormat.BHSE)
    b, h, s, hd = (sizes[k] for k in ("b", "h", "s", "head_dim"))
    model = SeedAttention(QkvFormat.BHSE, meshfuse.DeviceMesh(range(ctx.world)), b, h, s,
                          h * hd, dropout_p=P, dropout_mode=mode)
    _first_call(model, inputs, kernel)
    found = check_same_seed(lambda: model.execute(inputs), ("attn", "q_grad", "k_grad", "v_grad"),
                            deterministic_check=True)
    determined = found["deterministic"]
    return {"not_bitwise_by_default": [n for n, r in found["default"].items()
                                       if not r["bitwise"]],
            "largest_default_difference": max(r["max_diff"] for r in found["default"].values()),
            "deterministic": determined if isinstance(determined, str) else "all bitwise"}


def _mask_inputs(ctx, b: int, h: int):
    """Global q, k alike in every head, v the identity, g random; this rank's heads."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(S, S, generator=gen).expand(b, h, S, S) for _ in range(2))
    v = torch.eye(S).expand(b, h, S, S)
    g = torch.randn(b, h, S, S, generator=gen)
    per = h // ctx.world
    return [t[:, ctx.rank * per:(ctx.rank + 1) * per].to(torch.bfloat16).contiguous()
            .to(ctx.device) for t in (q, k, v, g)]


def masks(ctx, kernel: str | None, mode: str | None) -> dict:
    """The masks read off ``attn`` (see the module doc); raises AssertionError if wrong."""
    b, h = 2, 4 * ctx.world
    model = MaskProgram(meshfuse.DeviceMesh(range(ctx.world)), b, h, mode)
    local = _mask_inputs(ctx, b, h)
    attn, *grads = _first_call(model, local + [SEED, OFFSET], kernel)
    again = model.execute(local + [SEED, OFFSET])[0]
    other = model.execute(local + [SEED + 1, OFFSET])[0]
    keep = attn != 0
    assert torch.equal(keep, again != 0), "the same seed drew another mask"
    assert not torch.equal(keep, other != 0), "another seed drew the same mask"
    reference = _reference_grads(*local, keep)
    for name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), grads, reference):
        atol = 1e-2 * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grad.double(), ref, rtol=1.6e-2, atol=atol, msg=name)
    patterns = torch.cat(ctx.gather(keep.cpu()), dim=1).flatten(0, 1).flatten(1)
    distinct = len({tuple(p.tolist()) for p in patterns})
    assert distinct == b * h, f"{b * h - distinct} (batch, head) pairs share a mask"
    fraction = patterns.float().mean().item()
    sigma = math.sqrt(MASK_P * (1 - MASK_P) / patterns.numel())
    assert abs(fraction - (1 - MASK_P)) < 5 * sigma, f"kept fraction {fraction:.4f}"
    return {"kept_fraction": round(fraction, 4), "distinct_masks": distinct}


def _reference_grads(q, k, v, g, keep):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-2, -1) / math.sqrt(S)
    out = (torch.softmax(scores, -1) * keep / (1 - MASK_P)) @ leaves[2]
    out.backward(g.double())
    return [t.grad for t in leaves]


def generator_untouched(ctx, kernel: str | None) -> dict:
    """A dropout call between ``manual_seed(4)`` and ``rand`` changes nothing."""
    model = MaskProgram(meshfuse.DeviceMesh(range(ctx.world)), 2, 4 * ctx.world, None)
    inputs = _mask_inputs(ctx, 2, 4 * ctx.world) + [SEED, OFFSET]
    _first_call(model, inputs, kernel)
    torch.manual_seed(4)
    expected = torch.rand(8, device=ctx.device)
    torch.manual_seed(4)
    model.execute(inputs)
    assert torch.equal(torch.rand(8, device=ctx.device), expected), "the generator moved"
    return {}


def main(argv: list[str]) -> int:
    out = argv[0] if argv else "gpu-out"
    ctx = context.setup(quick=False)
    kernels = KERNELS if ctx.cuda else ("math",)
    cases = [(f"{check.__name__}[{k}]", check, k, None) for k in kernels
             for check in (same_bits, masks, generator_untouched)]
    cases += [(f"{check.__name__}[global]", check, None, "global") for check in (same_bits, masks)]
    results, failed = {}, False
    for name, check, kernel, mode in cases:
        try:
            args = (ctx, kernel) if check is generator_untouched else (ctx, kernel, mode)
            results[name] = {"status": "pass", **check(*args)}
        except Exception as err:  # noqa: BLE001 - every check is reported
            results[name] = {"status": "fail", "error": f"{type(err).__name__}: {err}"}
            if ctx.rank == 0:
                traceback.print_exc()
        statuses = ctx.gather(results[name]["status"])
        failed |= "fail" in statuses
        ctx.log(f"{name}: {statuses} {json.dumps(results[name])[:300]}")
    if ctx.rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "dropout_check.json"), "w") as f:
            json.dump({"world": ctx.world, "device": str(ctx.device),
                       "torch": torch.__version__, "results": results}, f, indent=1)
    ctx.log(f"RESULT: {'FAIL' if failed else 'PASS'}")
    ctx.barrier()
    context.teardown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
