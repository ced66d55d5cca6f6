"""Case ``context_parallel`` (issue 14): attention with the sequence sharded over the ranks.

Causal bf16 attention, forward and backward, b=1, h=32, head dim 128, at s=32768 and
s=131072, and non-causal at s=32768. Variants, in one run:

- ``one_gpu`` (baseline): the whole problem on one device as bare ``torch.ops.aten`` calls
  of cuDNN's attention forward and backward (Hopper, Blackwell; flash on other GPUs, the CPU
  flash kernel on CPUs); every rank runs it on its own GPU. ``one_gpu_flash``: the same with
  the flash kernel (CUDA). The ideal time on ``n`` GPUs is the faster of the two over
  ``n``; each record's ``pct_of_ideal`` is ideal / its time (``ideal_from`` names it).
- ``one_gpu_meshfuse``: the whole problem through meshfuse's kernel layer
  (``meshfuse.ops.attention.kernels``, the kernel it selects), checked against ``one_gpu``:
  what meshfuse's own one-device path costs beside the bare kernels;
- ``ring_zigzag``: meshfuse, the sequence zig-zag split (load balanced), forced ring;
- ``ring_zigzag_synced``: the same, each call waiting for its kernels (the harness times
  calls back to back; this one shows the host time before the first kernel instead of
  hiding it, and whether calls that overlap their neighbours run slower);
- ``ring_zigzag_own_whole``: the same with the backward's own block computed whole at the
  first step (``MESHFUSE_CP_OWN_PARTS=1``) instead of in two halves, the second after the
  last step, under the finished dk/dv sums' trip home: what the halves gain (the trip home
  then waits after the last kernels); ``ring_zigzag_own_quarters``: in four parts;
- ``ring_zigzag_nccl``, ``ring_zigzag_copy_engine``: the ring's blocks moved by NCCL's
  send/recv or by the GPUs' copy engines (``MESHFUSE_CP_TRANSPORT``; copy engines: no SM
  taken from the attention kernels); ``ring_zigzag_copy_engine_quarters``: the copy
  engines, the own block in quarters; ``ring_zigzag_eager_merge``: the forward's merge in
  torch operations (``MESHFUSE_CP_MERGE=eager``; the default on CUDA compiles it into one
  pass);
- ``ring_block``: the same on a block split (unbalanced under a causal mask);
- ``allgather``, ``alltoall``: meshfuse's other strategies, zig-zag split;
- ``auto``: the cost estimate's choice (``metrics["strategies"]``, with its estimates);
- ``torch_cp_allgather``, ``torch_cp_alltoall``: ``torch.distributed.tensor.experimental.
  context_parallel`` (load balanced) with cuDNN forced, k/v rotated by all-gather or
  all-to-all; its buffers are sharded and restored inside each timed call, as its API does.

``MESHFUSE_CP_BENCH_CONFIGS`` and ``MESHFUSE_CP_BENCH_VARIANTS`` (comma-separated names)
run only those configurations and variants (``one_gpu`` and ``one_gpu_flash`` are always
run: the baselines). Each meshfuse variant is checked against ``one_gpu`` (sharded alike)
before it is timed. A
``constants`` record gives the speeds the estimate can use, measured here (one kernel's
TFLOP/s, one k/v block transfer's GB/s) and which strategy the estimate picks with them, and
which was fastest. With ``MESHFUSE_CP_PROFILE=<dir>``, every rank also writes a
torch.profiler trace of two ``ring_zigzag`` calls at s=32768 and its summary (compute busy
time, idle gaps, NCCL time that no kernel hid, each call's wall time), also recorded as
``profile_ring_zigzag``.
"""

from __future__ import annotations

import json
import os
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import meshfuse
from benchmarks import trace_summary
from benchmarks.cases.attention import attention_flops, raw_aten
from benchmarks.context import Context
from benchmarks.harness import Plan, Record, Skip, Variant, check_close, run_variants
from meshfuse import DataType, FusionDefinition, ParallelType
from meshfuse.ops.attention import kernels
from meshfuse.ops.attention.backends import select_backend
from meshfuse.parallel.context.cost import Machine, choose, machine
from meshfuse.parallel.context.planning import problem
from meshfuse.parallel.context.record import MERGE_VAR, TRANSPORT_VAR
from meshfuse.runtime.comm.collectives import Group, ring_shift
from meshfuse.runtime.comm.communicator import Communicator

CONFIGS = (("causal_s32k", 32768, True), ("causal_s128k", 131072, True),
           ("full_s32k", 32768, False))
QUICK_CONFIGS = (("causal_quick", 256, True),)
SIZES = {"b": 1, "h": 32, "head_dim": 128}
QUICK_SIZES = {"b": 1, "h": 4, "head_dim": 16}
TOL = 2e-2
ONE_GPU_ATEN = ("one_gpu", "one_gpu_flash")  # the baselines, always run


class CausalAttention(FusionDefinition):
    """sdpfa_fwd + sdpfa_bwd on ``[b, h, s, e]`` bf16, every tensor's sequence split over
    ``mesh`` (``zigzag``: head-tail pairs), the strategy ``strategy`` (None: the estimate)."""

    def __init__(self, sizes, s, causal, mesh, zigzag, strategy):
        super().__init__()
        self.shape = [sizes["b"], sizes["h"], s, sizes["head_dim"]]
        self.causal, self.mesh, self.zigzag, self.strategy = causal, mesh, zigzag, strategy

    def definition(self):
        self.q, self.k, self.v, self.g = (self.define_tensor(self.shape, dtype=DataType.BFloat16)
                                          for _ in range(4))
        attn, lse, seed, offset = self.ops.sdpfa_fwd(self.q, self.k, self.v, 0.0, self.causal,
                                                     None, context_parallel=self.strategy)
        grads = self.ops.sdpfa_bwd(self.g, self.q, self.k, self.v, attn, lse, 0.0, self.causal,
                                   seed, offset, None, context_parallel=self.strategy)
        self.tensors = [self.q, self.k, self.v, self.g, attn, lse, *grads]
        for t in (attn, *grads):
            self.add_output(t)

    def multidevice_schedule(self):
        for tv in self.tensors:
            tv.set_device_mesh(self.mesh)
            pos = tv.loop.index(tv.logical[2])
            tv.split(pos, self.mesh.size, inner_split=False, zigzag=self.zigzag)
            tv.parallelize(pos, ParallelType.mesh_x)


def global_inputs(ctx: Context, sizes, s) -> list[torch.Tensor]:
    """q, k, v and the output gradient at global sizes, bf16, the same on every rank."""
    gen = torch.Generator(ctx.device).manual_seed(0)
    shape = (sizes["b"], sizes["h"], s, sizes["head_dim"])
    return [torch.randn(shape, generator=gen, device=ctx.device, dtype=torch.bfloat16)
            for _ in range(4)]


def one_gpu_kernel(device: torch.device) -> str:
    """The one-GPU baseline's kernel: cuDNN on Hopper and Blackwell (the issue's baseline, the
    fastest there), flash on other GPUs, PyTorch's CPU flash kernel on CPUs."""
    if device.type != "cuda":
        return "cpu_flash"
    return "cudnn" if torch.cuda.get_device_capability(device)[0] in (9, 10) else "flash"


def _one_gpu_aten(full, causal, kernel, name="one_gpu"):
    """The whole problem on one device as bare ``torch.ops.aten`` calls of ``kernel`` (no
    meshfuse code between the timer and the kernels)."""
    q, k, v, g = full

    def setup():
        if kernel == "flash" and not q.is_cuda:
            raise Skip("the flash kernel is CUDA's")
        return (lambda: raw_aten(kernel, q, k, v, g, causal)), {"backend": kernel}

    return Variant(name, setup, f"whole problem on one GPU, torch.ops.aten {kernel}", gpus=1)


def _one_gpu_meshfuse(full, causal, expected):
    """The whole problem on one device through meshfuse's kernel layer (the kernel it
    selects, with its checks and layout handling), checked against the aten baseline."""
    q, k, v, g = full

    def setup():
        backend = select_backend(q, k, v, 0.0, causal)

        def step():
            attn, lse, seed, offset = kernels.sdpa_forward(q, k, v, 0.0, causal, None, backend)
            return attn, kernels.sdpa_backward(g, q, k, v, attn, lse, 0.0, causal, seed, offset,
                                               None, backend)

        attn, grads = step()
        check_close("one_gpu_meshfuse vs one_gpu", [attn, *grads], expected, TOL)
        return step, {"backend": backend.value}

    return Variant("one_gpu_meshfuse", setup, "whole problem on one GPU, meshfuse's kernel "
                   "layer", gpus=1)


def _meshfuse(ctx, name, sizes, s, causal, full, expected, zigzag, strategy, env=None,
              synced=False):
    def setup():
        if not ctx.cuda and {"copy_engine", "compiled"} & set((env or {}).values()):
            raise Skip("the copy engines and the compiled merge are for CUDA")
        mesh = meshfuse.DeviceMesh(range(ctx.world))
        fd = CausalAttention(sizes, s, causal, mesh, zigzag, strategy)
        fd.define()
        local = [meshfuse.shard_tensor(t, tv) for t, tv in zip(full, fd.tensors[:4])]
        # the settings are read when the program is built (the first call)
        graphs, start = _compiled_graphs(), time.perf_counter()
        with mock.patch.dict(os.environ, env or {}):
            got = fd.execute(local)
        ctx.sync()
        first = {"first_call_s": round(time.perf_counter() - start, 2),
                 "graphs_compiled_by_first_call": _compiled_graphs() - graphs}
        want = [meshfuse.shard_tensor(t, tv) for t, tv in zip(expected, fd.fusion.outputs())]
        check_close(f"{name} vs one GPU", got, want, TOL)
        del got, want
        metrics = {"strategies": _strategies(fd), **first}
        if synced:  # each call waits for its kernels: the next starts from an idle device
            return (lambda: (fd.execute(local), ctx.sync())), metrics
        return (lambda: fd.execute(local)), metrics

    note = f"{'zig-zag' if zigzag else 'block'} split, {strategy or 'estimate'}"
    return Variant(name, setup, note)


def _compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process (the compiled merge's
    among them): a count that grows in timed calls means recompiles."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _strategies(fd) -> dict:
    """The strategy of the forward and of the backward, with the estimates behind them."""
    chosen = {}
    for expr in fd.compiled().fusion.exprs:
        if getattr(expr.op, "name", None) in ("sdpfa_fwd", "sdpfa_bwd"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            _, estimates = choose(problem(expr), machine(device), ("ring", "allgather",
                                                                   "alltoall"))
            chosen[expr.op.name] = {"strategy": expr.args[-1],
                                    "estimates_ms": {k: round(v * 1e3, 3)
                                                     for k, v in estimates.items()}}
    return chosen


def _torch_cp(ctx, full, causal, rotate):
    def setup():
        if not ctx.cuda or ctx.world == 1:
            raise Skip("torch's context_parallel runs on 2+ CUDA ranks")
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options,
        )

        set_rotate_method(rotate)
        mesh = ctx.dtensor_mesh()

        def step():
            # context_parallel shards its buffers in place (resize_), which tensors that
            # require grad refuse: shard fresh copies, then ask for their gradients. The
            # copies (about 1 GB at s=32k) are part of torch's per-step cost.
            q, k, v, g = buffers = [t.detach().clone() for t in full[:4]]
            # torch balances the load (head-tail chunks) only for causal attention; without
            # a mask it refuses the option, so it is set per step (torch restores it on exit).
            _cp_options.enable_load_balance = causal
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), \
                    context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2],
                                     no_restore_buffers=set(buffers)):
                for t in (q, k, v):
                    t.requires_grad_()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return out, torch.autograd.grad(out, (q, k, v), g)

        return step, {"rotate": rotate}

    return Variant(f"torch_cp_{rotate}", setup, "torch context_parallel, cuDNN, load balanced")


def _config(ctx: Context, name: str, s: int, causal: bool, sizes, plan: Plan):
    full = global_inputs(ctx, sizes, s)
    kernel = one_gpu_kernel(full[0].device)
    attn, grads = raw_aten(kernel, *full, causal)
    expected = [attn, *grads]
    del attn, grads
    variants = [
        _one_gpu_aten(full, causal, kernel),
        *([_one_gpu_aten(full, causal, "flash", "one_gpu_flash")] if kernel != "flash" else []),
        _one_gpu_meshfuse(full, causal, expected),
        _meshfuse(ctx, "ring_zigzag", sizes, s, causal, full, expected, True, "ring"),
        _meshfuse(ctx, "ring_zigzag_synced", sizes, s, causal, full, expected, True, "ring",
                  synced=True),
        _meshfuse(ctx, "ring_zigzag_own_whole", sizes, s, causal, full, expected, True, "ring",
                  {"MESHFUSE_CP_OWN_PARTS": "1"}),
        _meshfuse(ctx, "ring_zigzag_own_quarters", sizes, s, causal, full, expected, True,
                  "ring", {"MESHFUSE_CP_OWN_PARTS": "4"}),
        _meshfuse(ctx, "ring_zigzag_nccl", sizes, s, causal, full, expected, True, "ring",
                  {TRANSPORT_VAR: "nccl"}),
        _meshfuse(ctx, "ring_zigzag_copy_engine", sizes, s, causal, full, expected, True,
                  "ring", {TRANSPORT_VAR: "copy_engine"}),
        _meshfuse(ctx, "ring_zigzag_copy_engine_quarters", sizes, s, causal, full, expected,
                  True, "ring", {TRANSPORT_VAR: "copy_engine", "MESHFUSE_CP_OWN_PARTS": "4"}),
        _meshfuse(ctx, "ring_zigzag_eager_merge", sizes, s, causal, full, expected, True,
                  "ring", {MERGE_VAR: "eager"}),
        _meshfuse(ctx, "ring_block", sizes, s, causal, full, expected, False, "ring"),
        _meshfuse(ctx, "allgather", sizes, s, causal, full, expected, True, "allgather"),
        _meshfuse(ctx, "alltoall", sizes, s, causal, full, expected, True, "alltoall"),
        _meshfuse(ctx, "auto", sizes, s, causal, full, expected, True, None),
        _torch_cp(ctx, full, causal, "allgather"),
        _torch_cp(ctx, full, causal, "alltoall"),
    ]
    wanted = _selected("MESHFUSE_CP_BENCH_VARIANTS")
    variants = [v for v in variants
                if wanted is None or v.name in wanted or v.name in ONE_GPU_ATEN]
    flops = attention_flops(sizes["b"], sizes["h"], s, sizes["head_dim"], causal)
    params = dict(sizes, s=s, causal=causal, dtype="bf16")
    records = run_variants(ctx, "context_parallel", name, variants,
                           Plan(plan.warmup, plan.iters, flops=flops), "one_gpu", params)
    del expected
    _set_pct_of_ideal(records, ctx.world)
    records.append(_constants(ctx, name, full, causal, records, params))
    if name in ("causal_s32k", "causal_quick") and os.environ.get("MESHFUSE_CP_PROFILE"):
        records.append(_profile(ctx, name, sizes, s, causal, full,
                                os.environ["MESHFUSE_CP_PROFILE"], params))
    return records


def _set_pct_of_ideal(records: list[Record], world: int) -> None:
    """Each record's ``pct_of_ideal``: the ideal time on ``world`` GPUs, the fastest bare
    aten one-GPU time over ``world`` (named in ``ideal_from``), over its time (the one-GPU
    records have none: their time over the baseline's is their ratio)."""
    bases = [r for r in records if r.variant in ONE_GPU_ATEN and r.status == "ok"]
    if not bases:
        return
    base = min(bases, key=lambda r: r.median_ms)
    for r in records:
        if r.status == "ok" and not r.variant.startswith("one_gpu"):
            r.metrics["pct_of_ideal"] = round(100 * base.median_ms / world / r.median_ms, 1)
            r.metrics["ideal_from"] = base.variant


def _constants(ctx, name, full, causal, records, params) -> Record:
    """Measured speeds, what the estimate picks with them, and what was fastest."""
    record = Record("context_parallel", name, "constants", ctx.world, params=dict(params))
    one = next((r for r in records if r.variant == "one_gpu" and r.status == "ok"), None)
    timed = {r.variant: r.median_ms for r in records
             if r.status == "ok" and r.variant in ("ring_zigzag", "allgather", "alltoall")}
    if one is None or ctx.world == 1 or not timed:
        record.status, record.message = "skipped", "needs 2+ ranks and the timed variants"
        return record
    link = _link_bytes_per_s(ctx, full)
    kernel = one.tflops_per_gpu * 1e12
    measured = Machine(kernel_flops=kernel, link_bytes=link, latency=machine("cuda").latency)
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    fd = CausalAttention({"b": full[0].shape[0], "h": full[0].shape[1],
                          "head_dim": full[0].shape[3]}, full[0].shape[2], causal, mesh, True,
                         None)
    fd.define()
    picks = {}
    for expr in fd.compiled().fusion.exprs:
        if getattr(expr.op, "name", None) in ("sdpfa_fwd", "sdpfa_bwd"):
            picks[expr.op.name] = choose(problem(expr), measured,
                                         ("ring", "allgather", "alltoall"))[0]
    record.metrics = {"kernel_tflops": round(kernel / 1e12, 3), "link_gbps": round(link / 1e9, 3),
                      "estimate_picks_measured": picks,
                      "estimate_picks_default": _strategies(fd),
                      "fastest": min(timed, key=timed.get).replace("ring_zigzag", "ring"),
                      "graphs_compiled_in_process": _compiled_graphs()}
    return record


def _link_bytes_per_s(ctx, full) -> float:
    """Bytes/s of one rank's k/v block sent to the next rank (and one received)."""
    communicator = Communicator.instance()
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    group = Group(communicator.group(mesh, 0), tuple(range(ctx.world)), ctx.rank, 0)
    block = [t.chunk(ctx.world, dim=2)[0].contiguous() for t in full[1:3]]
    shapes = [b.shape for b in block]
    for _ in range(2):
        ring_shift(block, shapes, group).wait()
    ctx.barrier()
    start, iters = time.perf_counter(), 5
    for _ in range(iters):
        ring_shift(block, shapes, group).wait()
    ctx.sync()
    seconds = (time.perf_counter() - start) / iters
    return sum(b.numel() * b.element_size() for b in block) / seconds


def _profile(ctx, name, sizes, s, causal, full, out_dir, params) -> Record:
    """A torch.profiler trace of every rank over two ring calls (each in a ``ring_zigzag``
    window), written as ``ring_zigzag_s<s>_rank<r>.json`` with its summary
    (:mod:`benchmarks.trace_summary`: compute busy time, idle gaps, NCCL time no kernel
    hid) beside it; the record holds every rank's summary of the second call."""
    mesh = meshfuse.DeviceMesh(range(ctx.world))
    fd = CausalAttention(sizes, s, causal, mesh, True, "ring")
    fd.define()
    local = [meshfuse.shard_tensor(t, tv) for t, tv in zip(full, fd.tensors[:4])]
    fd.execute(local)
    ctx.sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            start = time.perf_counter()
            with torch.profiler.record_function("ring_zigzag"):
                fd.execute(local)
            ctx.sync()  # each call from an idle device: its host time before the first kernel
            walls.append(round((time.perf_counter() - start) * 1e3, 3))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ring_zigzag_s{s}_rank{ctx.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        summary = trace_summary.summarize(json.load(f), "ring_zigzag")
    for window, wall in zip(summary, walls):
        window["wall_ms"] = wall  # the call and its synchronization, by the host's clock
    with open(path.replace(".json", "_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    record = Record("context_parallel", name, "profile_ring_zigzag", ctx.world,
                    params=dict(params))
    record.metrics = {f"rank{r}": summaries[-1]
                      for r, summaries in enumerate(ctx.gather(summary))}
    record.message = f"traces and summaries in {out_dir}"
    return record


def _selected(variable: str) -> set[str] | None:
    """The names listed in the environment ``variable`` (None: unset, everything)."""
    value = os.environ.get(variable, "").strip()
    return {n.strip() for n in value.split(",") if n.strip()} if value else None


def run(ctx: Context) -> list[Record]:
    sizes = QUICK_SIZES if ctx.quick else SIZES
    plan = Plan(warmup=1, iters=3) if ctx.quick else Plan(warmup=3, iters=10)
    records = []
    wanted = _selected("MESHFUSE_CP_BENCH_CONFIGS")
    for name, s, causal in (QUICK_CONFIGS if ctx.quick else CONFIGS):
        if wanted is not None and name not in wanted:
            continue
        slow = s > 65536
        config_plan = Plan(1, 3) if slow and not ctx.quick else plan
        records += _config(ctx, name, s, causal, sizes, config_plan)
    return records
