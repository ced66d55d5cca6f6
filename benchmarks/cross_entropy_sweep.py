"""Variants of the fused cross-entropy kernel against a copy of the logits (issue 31's floor).

``python -m benchmarks.cross_entropy_sweep [--out DIR]`` on one GPU (``TRITON_INTERPRET=1``:
a correctness check of every variant on the CPU, no timing).

The kernel of :mod:`meshfuse.ops.cross_entropy.kernels` reads a row of logits, writes its loss
and the gradient of the mean loss. This probe times variants of it, all checked against
``F.cross_entropy`` (loss and gradient) before they are timed:

- ``stats``: how the first read of a row (a long one, read in blocks) finds the log-sum-exp:
  ``online`` (the library's: per block a maximum and a rescaled sum, two reductions over the
  block's threads) or ``shift`` (each thread keeps its own sum of ``exp(x - c)``, ``c`` the
  first block's maximum, and its own maximum; the threads' values are reduced once per row;
  a row whose maximum exceeds ``c`` by more than 60 is summed again with its true maximum,
  so no sum overflows);
- ``hints``: cache hints (the first read kept in L2 for the second, ``evict_last``; the second
  read and the gradient's stores streamed, ``evict_first`` / ``.cs``);
- the block of classes, the warps, and the software-pipelining stages of the loops;
- ``per_sm`` (chosen configurations only): a fixed number of programs per multiprocessor,
  each looping over rows, instead of one program per row: it bounds the rows in flight,
  whose first reads the second pass must still find in L2 (slower in every case swept on an
  H200: 2026-12-04-0834).

``--profile`` adds each variant's kernel time alone (torch.profiler) and the registers of
every compiled kernel, whose cubins it writes beside the results (``cuobjdump -sass``). The
registers a thread takes set how many programs share a multiprocessor, and so how many
rows are in flight: the library's kernel at 8 warps took 73 registers (3 programs) where
this probe's took 64 (4), one reason it was slower (2026-12-04-0838).

Each variant's time is the median over rounds of ``--iters`` calls between CUDA events, the
rounds interleaving the variants in an order that rotates; the floor is ``torch.clone`` of
the logits. ``--library-configs`` adds the library's kernel in other configurations.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.cross_entropy import IGNORE, _inputs
from meshfuse.ops.cross_entropy import kernels

triton, tl = kernels.triton, None
if triton is not None:
    import triton.language as tl

if triton is not None:
    @triton.jit
    def _online(x_row, n, BLOCK: tl.constexpr, STAGES: tl.constexpr, FIRST: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        for start in tl.range(0, n, BLOCK, num_stages=STAGES):
            x = tl.load(x_row + start + cols, mask=start + cols < n, other=float("-inf"),
                        eviction_policy=FIRST).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        return m + tl.log(s)

    @triton.jit
    def _shifted(x_row, n, BLOCK: tl.constexpr, STAGES: tl.constexpr, FIRST: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n, other=float("-inf"),
                    eviction_policy=FIRST).to(tl.float32)
        c = tl.max(x, 0)
        sums = tl.exp(x - c)
        peaks = x
        for start in tl.range(BLOCK, n, BLOCK, num_stages=STAGES):
            x = tl.load(x_row + start + cols, mask=start + cols < n, other=float("-inf"),
                        eviction_policy=FIRST).to(tl.float32)
            peaks = tl.maximum(peaks, x)
            sums += tl.exp(x - c)
        m = tl.max(peaks, 0)
        lse = c + tl.log(tl.sum(sums, 0))
        if m - c > 60.0:  # a later block far above the first: sum again from the true max
            lse = _online(x_row, n, BLOCK, STAGES, FIRST)
        return lse

    @triton.jit
    def _probe_row(row, x_ptr, x_stride, target_ptr, grad_ptr, loss_ptr, count_ptr, n,
                   ignore_index, BLOCK: tl.constexpr, SHIFT: tl.constexpr,
                   STAGES: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr,
                   STORE: tl.constexpr):
        x_row = x_ptr + row * x_stride
        g_row = grad_ptr + row * x_stride
        target = tl.load(target_ptr + row).to(tl.int64)
        ignored = target == ignore_index
        scale = tl.where(ignored, 0.0, 1.0 / tl.load(count_ptr))
        if SHIFT:
            lse = _shifted(x_row, n, BLOCK, STAGES, FIRST)
        else:
            lse = _online(x_row, n, BLOCK, STAGES, FIRST)
        x_t = tl.load(x_row + tl.where(ignored, 0, target)).to(tl.float32)
        cols = tl.arange(0, BLOCK)
        for start in tl.range(0, n, BLOCK, num_stages=STAGES):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=0.0,
                        eviction_policy=SECOND).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)) * scale
            tl.store(g_row + start + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask,
                     cache_modifier=STORE)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, (lse - x_t) * scale))

    @triton.jit
    def _probe_kernel(x_ptr, x_stride, target_ptr, grad_ptr, loss_ptr, count_ptr, n, rows,
                      ignore_index, BLOCK: tl.constexpr, SHIFT: tl.constexpr,
                      STAGES: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr,
                      STORE: tl.constexpr, PERSISTENT: tl.constexpr):
        if PERSISTENT:  # a fixed number of programs per multiprocessor, each over many rows
            for row in range(tl.program_id(0), rows, tl.num_programs(0)):
                _probe_row(tl.cast(row, tl.int64), x_ptr, x_stride, target_ptr, grad_ptr,
                           loss_ptr, count_ptr, n, ignore_index, BLOCK, SHIFT, STAGES, FIRST,
                           SECOND, STORE)
        else:
            _probe_row(tl.program_id(0).to(tl.int64), x_ptr, x_stride, target_ptr, grad_ptr,
                       loss_ptr, count_ptr, n, ignore_index, BLOCK, SHIFT, STAGES, FIRST,
                       SECOND, STORE)


def probe(x, t, count, block: int, warps: int, shift: bool, stages: int, hints: bool,
          per_sm: int = 0):
    """The probe kernel on ``x``; ``per_sm``: 0 for a program per row, else that many
    programs per multiprocessor, each looping over rows (which bounds the rows in flight,
    and so the first reads that the second must find in L2)."""
    rows, n = x.shape
    grad = torch.empty_like(x)
    loss = torch.empty(rows, dtype=torch.float32, device=x.device)
    programs = rows if not per_sm else min(rows, per_sm * _multiprocessors(x.device))
    _probe_kernel[(programs,)](x, x.stride(0), t, grad, loss, count, n, rows, IGNORE,
                               BLOCK=block, SHIFT=shift, STAGES=stages,
                               FIRST="evict_last" if hints else "",
                               SECOND="evict_first" if hints else "",
                               STORE=".cs" if hints else "", PERSISTENT=bool(per_sm),
                               num_warps=warps)
    return loss.sum(), grad


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: programs loop over the rows
    return torch.cuda.get_device_properties(device).multi_processor_count


def library(x, t, count, config: kernels.KernelConfig | None = None):
    """The library's kernel in its configured choice, or in ``config``."""
    loss, grad, _ = kernels.forward(x, t, count, IGNORE, 0.0, config=config)
    return loss, grad


def _check(fn, x, t) -> str:
    ref_x = x.float().requires_grad_()
    ref = F.cross_entropy(ref_x, t, ignore_index=IGNORE)
    ref.backward()
    count = (t != IGNORE).sum().float().reshape(1)
    loss, grad = fn(x, t, count)
    dl = abs(loss.item() - ref.item()) / max(1.0, abs(ref.item()))
    dg = (grad.float() - ref_x.grad).abs().max().item()
    ok = dl < 1e-4 and dg < 2e-2 / x.shape[0] + 1e-6
    return f"{'ok' if ok else 'WRONG'} (loss {dl:.1e}, grad {dg:.1e})"


def _time(fn, x, t, iters: int) -> float:
    count = (t != IGNORE).sum().float().reshape(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(x, t, count)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _profiled(candidates, x, t, calls: int = 5) -> list[str]:
    """Each variant's kernels alone: microseconds per call of every kernel it launched, from
    torch.profiler (host gaps and launch costs excluded)."""
    from torch.profiler import ProfilerActivity, profile
    count = (t != IGNORE).sum().float().reshape(1)
    lines = ["  kernels alone (us per call):"]
    for name, fn in candidates.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(x, t, count)
            torch.cuda.synchronize()
        spent = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
                spent[event.name] = spent.get(event.name, 0.0) + us / calls
        parts = ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(spent.items(),
                                                                  key=lambda kv: -kv[1]))
        lines.append(f"    {name}: {parts}")
    return lines


def _compiled_kernels(out: str) -> list[str]:
    """Registers and spills of every compiled variant of the library's and the probe's
    kernels, their cubins written to ``out`` (for ``cuobjdump -sass``)."""
    lines = ["compiled kernels:"]
    os.makedirs(out, exist_ok=True)
    for label, fn in (("library", kernels._forward_kernel), ("probe", _probe_kernel)):
        for device_cache in fn.device_caches.values():
            for i, compiled in enumerate(device_cache[0].values()):
                meta = compiled.metadata
                source = getattr(compiled, "src", None)
                lines.append(f"  {label} #{i}: warps {meta.num_warps}, stages "
                             f"{meta.num_stages}, {getattr(compiled, 'n_regs', '?')} registers, "
                             f"{getattr(compiled, 'n_spills', '?')} spills, shared "
                             f"{meta.shared} B, constants {getattr(source, 'constants', '?')}, "
                             f"attributes {getattr(source, 'attrs', '?')}")
                with open(os.path.join(out, f"{label}-{i}.cubin"), "wb") as f:
                    f.write(compiled.asm["cubin"])
    return lines


def configurations(vocab: int, chosen: str | None = None):
    """Every combination of the swept options (at most 32 classes a thread), or ``chosen``:
    ``block/warps/shift/stages/hints[/per_sm]`` entries separated by commas (``8192/8/0/1/1``,
    ``8192/8/0/1/1/3``: 3 persistent programs per multiprocessor)."""
    if chosen:
        for entry in chosen.split(","):
            block, warps, shift, stages, hints, *per_sm = (int(v) for v in entry.split("/"))
            if block <= vocab:
                yield {"block": block, "warps": warps, "shift": bool(shift), "stages": stages,
                       "hints": bool(hints), "per_sm": per_sm[0] if per_sm else 0}
        return
    blocks = [b for b in (4096, 8192, 16384) if b <= vocab]
    for block, warps, shift, stages, hints in itertools.product(
            blocks, (8, 16), (False, True), (1, 3), (False, True)):
        if block // (warps * 32) <= 32:  # at most 32 classes a thread
            yield {"block": block, "warps": warps, "shift": shift, "stages": stages,
                   "hints": hints}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", default="32768,131072")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", default=None,
                        help="only these: block/warps/shift/stages/hints, comma separated")
    parser.add_argument("--library-configs", default="",
                        help="the library's kernel also in these configurations: "
                             "block/warps/max_registers (0: the compiler's choice), "
                             "comma separated")
    parser.add_argument("--profile", action="store_true",
                        help="also each variant's kernel times alone (torch.profiler) and its "
                             "compiled kernels' registers; cubins written beside the results")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    lines = [f"# cross entropy kernel sweep, {torch.__version__}, {where}"]
    for vocab in [int(v) for v in args.vocab.split(",")]:
        tokens = args.tokens if cuda else 4
        x, t = _inputs(tokens, vocab if cuda else min(vocab, 5000), device)
        x = x.detach()
        candidates = {"library": library}
        for entry in [e for e in args.library_configs.split(",") if e]:
            block, warps, registers = (int(v) for v in entry.split("/"))
            config = kernels.KernelConfig(block, warps, registers or None)
            candidates[f"library {entry}"] = (
                lambda x, t, count, config=config: library(x, t, count, config))
        for c in configurations(x.shape[1], args.configs):
            name = " ".join(f"{k}={v}" for k, v in c.items())
            candidates[name] = lambda x, t, count, c=c: probe(x, t, count, **c)
        if not cuda:  # the far-apart-blocks path of "shift" too
            x[:, -1] = 100.0
            candidates = dict(itertools.islice(candidates.items(), 6))
        checks = {name: _check(fn, x, t) for name, fn in candidates.items()}
        times = {name: [] for name in candidates}
        if cuda:
            floor = []
            names = list(candidates)
            for round_ in range(args.rounds):  # the order rotates: drift weighs on all alike
                floor.append(_time(lambda x, t, c: x.clone(), x, t, args.iters))
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    times[name].append(_time(candidates[name], x, t, args.iters))
            base = statistics.median(floor)
            lines.append(f"V={vocab} floor {base:.3f} ms")
        for name in sorted(candidates, key=lambda n: statistics.median(times[n] or [0])):
            ms = statistics.median(times[name]) if times[name] else None
            timing = "" if ms is None else f"{ms:.3f} ms {ms / base:.2f}x floor  "
            lines.append(f"  {name}: {timing}{checks[name]}")
        if cuda and args.profile:
            lines += _profiled(candidates, x, t)
    if cuda and args.profile:
        lines += _compiled_kernels(args.out)
    text = "\n".join(lines)
    print(text)
    if cuda:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d-%H%M")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{stamp}-cross_entropy_sweep.txt"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
