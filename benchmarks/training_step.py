"""A GPT layer's training step (forward and backward), meshfuse against PyTorch, one GPU
(issue 34).

The layer of :mod:`meshfuse.examples.gpt` (pre-norm, causal attention, tanh-GELU MLP),
bf16 on CUDA, at the issue's sizes (``b, s, heads, embed``): ``small`` 4,1024,16,1024,
``medium`` 2,2048,32,4096 and ``big`` 1,2048,96,12288. Each step computes ``y`` and the
gradients of ``x`` and of every parameter for a given ``dy``. Variants, all with their
default settings:

- ``torch_eager``: :class:`~meshfuse.examples.gpt_torch.Gpt3Block`, autograd;
- ``torch_compile``: the same module under ``torch.compile`` (default mode);
- ``torch_compile_ro``: ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; CUDA only);
- ``meshfuse_autograd``: :class:`~meshfuse.examples.gpt.GptBlock` (the forward only) through
  ``as_autograd_function()``: the derived backward, fused segments and CUDA-graph replay as
  they are by default;
- ``meshfuse_autograd_no_replay``: the same with ``MESHFUSE_CUDA_GRAPH=0`` (fused segments
  launched from Python: what the replay saves; its first call is made before the timed one);
- ``meshfuse_autograd_device_thread``: the same with ``MESHFUSE_BACKWARD_THREAD=device``
  (the backward handed to autograd's thread for the device, as before meshfuse ran it on
  the calling thread: :mod:`meshfuse.autodiff.engine_thread`);
- ``meshfuse_autograd_saved``: the same with ``remat="save"`` (the backward reads every
  value of the forward it needs rather than recomputing the cheap ones);
- ``meshfuse_autograd_recompute``: the same with ``remat="recompute"`` (the default until
  2026-12-05: the GELU of the 4x-wide hidden and the norms' outputs recomputed inside the
  backward's fused segments, which write them again: memory traffic the hand-written fusion
  does not pay; the default ``"recompute_fused"`` saves what the forward writes anyway);
- ``meshfuse_captured``: the same step under ``meshfuse.capture_step`` (forward and backward
  as one CUDA graph; CUDA only);
- ``meshfuse_hand_written``: :class:`~meshfuse.examples.gpt.GptBlockWithBackward`, one fusion
  with the backward written out, ``execute`` with its defaults;
- ``meshfuse_autograd_opcount30``, ``meshfuse_hand_written_opcount30``: the two above with
  their segments compiled under Inductor's own ``realize_opcount_threshold`` of 30 rather
  than meshfuse's 40 on CUDA (:data:`meshfuse.runtime.interpreter.fused.INDUCTOR_ON_CUDA`):
  a pointwise value of more ops than the threshold, read twice, is written to memory rather
  than recomputed in each reader. At 30 the derived layer-norm backward's ``grad * x_hat``
  (x_hat recomputed from the residual sum, its casts and the saved statistics) is written
  in float32 by its row kernel and read back by the weight gradient's column sum, 32 MiB
  per norm at the small size. Not run by default: they show what the setting is worth.
- ``meshfuse_autograd_multi_kernel``, ``meshfuse_hand_written_multi_kernel``: segments that
  reduce along rows compiled with Inductor's ``triton.multi_kernel`` (a persistent and a
  looped kernel per reduction, the faster kept at the first run; meshfuse's setting until
  2026-12-06) rather than persistent kernels for rows of up to 16384
  (:mod:`meshfuse.runtime.interpreter.persistent_rows`). Not run by default.

Each block of timed steps starts with autograd's device threads on (torch's default, which
the torch variants keep; a meshfuse call turns them off for its thread:
:func:`benchmarks.timing.interleaved`).

Timing: every variant set up, checked against the eager layer (relative error of ``y`` and
``dx`` within 5e-2), warmed up, then timed *interleaved*: each round times a block of steps
of every variant in turn (CUDA events around the block; the order shuffled each round:
:func:`benchmarks.timing.interleaved`), so that a drift of the GPU's clocks, and what a
block leaves to the next, hit all alike. Reported per variant: the
median over rounds of the time per step, its ratios to ``torch_compile``,
``torch_compile_ro`` and ``meshfuse_hand_written`` (median of the per-round ratios), the
first call's time (compilation included) and the second's (meshfuse captures its CUDA
graphs there), the peak memory its warm-up added, whether the timed steps compiled anything
(Dynamo's and meshfuse's counters before and after), and for the meshfuse variants the host
time per cached call (``explain``'s lines) and the replay's state.

    python -m benchmarks.training_step --out DIR             # small and medium (< 8 min)
    python -m benchmarks.training_step --sizes big --out DIR # the big layer alone
    python -m benchmarks.training_step --quick               # tiny shapes, CPU dry run

Results: ``DIR/training_step.json`` and ``DIR/training_step.md`` (rewritten after each
size, so a run cut short keeps the sizes it finished).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch
from torch._dynamo.utils import counters

import meshfuse
from benchmarks.harness import autograd_step, check_close
from benchmarks.timing import interleaved
from meshfuse.autodiff.engine_thread import BACKWARD_THREAD_ENV
from meshfuse.examples.gpt import GptBlock, GptBlockWithBackward, init_parameters
from meshfuse.examples.gpt_torch import Gpt3Block
from meshfuse.runtime.interpreter import fused

SIZES = {"small": (4, 1024, 16, 1024), "medium": (2, 2048, 32, 4096),
         "big": (1, 2048, 96, 12288)}
TINY = (1, 16, 2, 32)  # --quick: b, s, heads, embed
TOL = 5e-2
BASELINES = ("torch_compile", "torch_compile_ro", "meshfuse_hand_written")
# variants run only when named (--variants)
OPT_IN = ("meshfuse_autograd_opcount30", "meshfuse_hand_written_opcount30",
          "meshfuse_autograd_multi_kernel", "meshfuse_hand_written_multi_kernel")
# the ``*_multi_kernel`` variants' settings of segments that reduce along rows, on GPUs (until
# 2026-12-06: Inductor's persistent and looped kernels both, the faster kept at the first run)
MULTI_KERNEL = {"triton.multi_kernel": 1}
# Issue 34's targets for meshfuse_autograd: (baseline, bound at small, bound at the others)
TARGETS = (("meshfuse_hand_written", 1.02, 1.02), ("torch_compile", 0.5, 0.97),
           ("torch_compile_ro", 1.0, 1.0))


@dataclasses.dataclass
class Result:
    variant: str
    status: str = "ok"
    message: str = ""
    ms: float | None = None
    round_ms: list[float] = dataclasses.field(default_factory=list)
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    first_call_s: float | None = None
    second_call_s: float | None = None
    peak_mib: float | None = None
    recompiled: bool | None = None
    info: dict = dataclasses.field(default_factory=dict)
    step_ms: list[float] = dataclasses.field(default_factory=list)  # --per-step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_call(step: Callable, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _meshfuse_runners(obj) -> list:
    """The runners of a FusionFunction (forward, backward) or of a FusionDefinition."""
    if hasattr(obj, "_derivations"):
        runners = []
        for compiled in obj._derivations.values():
            runners += [compiled.derivation.forward_runner, compiled._backward]
        return [r for r in runners if r is not None]
    return [obj._get_runner()]


def _compile_state(runners) -> tuple:
    """Dynamo's counters and meshfuse's compilations: a change means a recompilation."""
    dynamo = tuple(sorted((k, tuple(sorted(v.items()))) for k, v in counters.items()
                          if k in ("stats", "aot_autograd", "inductor")))
    mine = tuple(s.compiles for r in runners for _, s in r._fused.values())
    return dynamo, mine


def _meshfuse_info(runners) -> dict:
    info = {}
    names = ("forward", "backward") if len(runners) == 2 else ("program",)
    for name, runner in zip(names, runners):
        lines = []
        for (key, backend), log in runner._host.items():
            lines += log.lines()
            replay = runner._replays.get((key, backend))
            if replay is not None:
                lines.append(replay.describe())
            fused = runner._fused.get((key, backend))
            if fused is not None:
                lines.append(f"fused ({backend}): {fused[1].describe()}")
            if log.replayed.calls:
                info[f"{name}_host_us_replayed"] = round(log.replayed.least / 1e3, 1)
            if log.breakdown is not None:
                info[f"{name}_host_us_interpreted"] = round(log.breakdown.total / 1e3, 1)
        info[f"{name}_explain"] = lines
    return info


def _node_info(owner) -> dict:
    """The autograd node's host time per call (``FusionFunction.explain``'s last lines),
    its programs' ``execute`` included: microseconds of Python per step, forward and
    backward."""
    info = {}
    for compiled in getattr(owner, "_derivations", {}).values():
        for name, path in (("forward", compiled.node_forward),
                           ("backward", compiled.node_backward)):
            if path.calls:
                info[f"{name}_node_host_us"] = round(path.least / 1e3, 1)
        info["node_explain"] = compiled.node_lines()
    return info


def layer_inputs(size, device, dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The layer's input ``x``, the cotangent ``dy`` and its parameters at ``size``, drawn
    the same way at each call."""
    b, s, _, e = size
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(b, s, e, generator=gen, device=device).to(dtype)
    dy = torch.randn(b, s, e, generator=gen, device=device).to(dtype)
    return x, dy, init_parameters(e, dtype=dtype, device=device)


def variants(size, device, dtype, backend: str, chosen=None) -> dict[str, Callable]:
    """name -> setup() returning (step, its meshfuse owner or None, first and second call's
    seconds), checked against the eager layer; ``chosen``: the names to set up (None:
    all)."""
    b, s, heads, e = size
    x, dy, params = layer_inputs(size, device, dtype)
    ref_block = Gpt3Block(params, heads)
    ref_y, (ref_dx, *_) = autograd_step(ref_block, [x], dy, ref_block.parameters())()
    ref = [ref_y.detach(), ref_dx]
    del ref_block
    mf_dtype = meshfuse.DataType.from_torch(dtype)

    def torch_variant(**options):
        block = Gpt3Block(params, heads)
        step = autograd_step(torch.compile(block, backend=backend, **options), [x], dy,
                             block.parameters())
        if options.get("mode") == "reduce-overhead":
            inner = step

            def step():
                torch.compiler.cudagraph_mark_step_begin()
                return inner()
        return step, None

    def eager():
        block = Gpt3Block(params, heads)
        return autograd_step(block, [x], dy, block.parameters()), None

    def reduce_overhead():
        if device.type != "cuda":
            raise Skipped("reduce-overhead captures CUDA graphs: CUDA only")
        return torch_variant(mode="reduce-overhead")

    def derived(**options):  # (the library's default remat, unless given)
        block = GptBlock(b, s, e, heads, mf_dtype).define()
        function = block.as_autograd_function(**options)
        step = autograd_step(lambda *leaves: function(leaves)[0], [x, *params.values()], dy)
        return step, function

    def derived_saved():
        return derived(remat="save")

    def derived_recompute():
        return derived(remat="recompute")

    def derived_device_thread():
        inner, function = derived()

        def step():  # (setting the variable costs a few us of host time per step)
            os.environ[BACKWARD_THREAD_ENV] = "device"
            try:
                with torch.autograd.set_multithreading_enabled(True):
                    return inner()
            finally:
                del os.environ[BACKWARD_THREAD_ENV]
        return step, function

    def derived_no_replay():
        # the runners read MESHFUSE_CUDA_GRAPH when the first call makes them
        with mock.patch.dict(os.environ, {"MESHFUSE_CUDA_GRAPH": "0"}):
            step, function = derived()
            step()
        return step, function

    def captured():
        if device.type != "cuda":
            raise Skipped("capture_step captures CUDA graphs: CUDA only")
        step, function = derived()
        return meshfuse.capture_step(step, copy_outputs=False), function

    def hand_written():
        fd = GptBlockWithBackward(b, s, e, heads, mf_dtype).define()
        inputs = [x, dy, *params.values()]
        return (lambda: fd.execute(inputs)), fd

    def with_inductor(setup, along_rows=None, **settings):
        """``setup``'s variant, its segments compiled (at its first step, which the first
        call's time counts) with ``settings`` over meshfuse's Inductor settings, on every
        device, and with ``along_rows`` (if given) for meshfuse's settings of segments that
        reduce along rows on GPUs (kept apart in the compiled segments' cache, whose key
        holds them)."""
        def patched():
            step, owner = setup()
            compiled = []

            def run():
                if compiled:
                    return step()
                compiled.append(True)
                on_cuda = {k: v for k, v in settings.items() if k in fused.INDUCTOR_ON_CUDA}
                rows = fused.INDUCTOR_ALONG_ROWS_ON_CUDA if along_rows is None else along_rows
                with mock.patch.dict(fused.INDUCTOR, settings), \
                        mock.patch.dict(fused.INDUCTOR_ON_CUDA, on_cuda), \
                        mock.patch.dict(fused.INDUCTOR_ALONG_ROWS_ON_CUDA, rows, clear=True):
                    return step()
            return run, owner
        return patched

    def checked(setup):
        def run():
            step, owner = setup()
            first = _timed_call(step, device)
            _sync(device)
            begin = time.perf_counter()
            out = step()
            _sync(device)
            second = time.perf_counter() - begin
            y, dx = (out[0], out[1]) if isinstance(out, list) else (out[0], out[1][0])
            check_close("vs torch eager", [y.detach(), dx], ref, TOL)
            return step, owner, first, second
        return run

    return {name: checked(setup) for name, setup in (
        ("torch_eager", eager), ("torch_compile", torch_variant),
        ("torch_compile_ro", reduce_overhead), ("meshfuse_autograd", derived),
        ("meshfuse_autograd_no_replay", derived_no_replay),
        ("meshfuse_autograd_device_thread", derived_device_thread),
        ("meshfuse_autograd_saved", derived_saved),
        ("meshfuse_autograd_recompute", derived_recompute), ("meshfuse_captured", captured),
        ("meshfuse_hand_written", hand_written),
        ("meshfuse_autograd_opcount30", with_inductor(derived, realize_opcount_threshold=30)),
        ("meshfuse_hand_written_opcount30",
         with_inductor(hand_written, realize_opcount_threshold=30)),
        ("meshfuse_autograd_multi_kernel", with_inductor(derived, MULTI_KERNEL)),
        ("meshfuse_hand_written_multi_kernel", with_inductor(hand_written, MULTI_KERNEL)))
        if (name in chosen if chosen is not None else name not in OPT_IN)}


def cuda_variants(label: str, chosen, purpose: str) -> dict[str, Callable]:
    """:func:`variants` of the layer at size ``label`` in bf16 on the GPU, Inductor for
    torch.compile's (``chosen``: their names, None: all); without a GPU, says that the
    caller (doing ``purpose``) needs one and exits with 2."""
    if not torch.cuda.is_available():
        print(f"CUDA only: {purpose}", file=sys.stderr)
        raise SystemExit(2)
    return variants(SIZES[label], torch.device("cuda"), torch.bfloat16, "inductor", chosen)


class Skipped(Exception):
    """A variant that cannot run here (a CUDA-only one on the CPU)."""


def _set_up(name, setup, device, warmup) -> tuple[Result, Callable | None, list, object]:
    result = Result(name)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        step, owner, result.first_call_s, result.second_call_s = setup()
        for _ in range(warmup):
            step()
        _sync(device)
    except Skipped as e:
        result.status, result.message = "skipped", str(e)
        return result, None, [], None
    except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
        result.status, result.message = "error", f"{type(e).__name__}: {e}"[:2000]
        return result, None, [], None
    if device.type == "cuda":
        result.peak_mib = round((torch.cuda.max_memory_allocated(device) - before) / 2**20)
    runners = _meshfuse_runners(owner) if owner is not None else []
    return result, step, runners, owner


def run_size(label: str, size, device, dtype, backend, rounds, iters, warmup,
             chosen=None, per_step: bool = False) -> dict:
    results, steps, runners, owners = {}, {}, {}, {}
    for name, setup in variants(size, device, dtype, backend, chosen).items():
        print(f"  {label} {name}: setting up", flush=True)
        result, step, found, owners[name] = _set_up(name, setup, device, warmup)
        results[name] = result
        if step is not None:
            steps[name], runners[name] = step, found
    states = {n: _compile_state(runners[n]) for n in steps}
    by_step: dict[str, list[list[float]]] | None = {} if per_step else None
    times = interleaved(steps, rounds, iters, device, by_step)
    for name, samples in times.items():
        result = results[name]
        result.round_ms = [round(t, 4) for t in samples]
        if by_step:  # the median over rounds of each step of a block
            result.step_ms = [round(statistics.median(s), 4) for s in zip(*by_step[name])]
        result.ms = statistics.median(samples)
        result.recompiled = _compile_state(runners[name]) != states[name]
        if runners[name]:
            result.info = {**_meshfuse_info(runners[name]), **_node_info(owners[name])}
    for name, result in results.items():
        for base in BASELINES:
            if name in times and base in times and base != name:
                per_round = [a / b for a, b in zip(times[name], times[base])]
                result.ratios[base] = round(statistics.median(per_round), 3)
    b, s, heads, e = size
    return {"size": label, "b": b, "s": s, "heads": heads, "embed": e,
            "results": [dataclasses.asdict(r) for r in results.values()],
            "targets": _targets(label, results)}


def _targets(label: str, results: dict[str, Result]) -> list[str]:
    """Issue 34's targets for meshfuse_autograd, met or not."""
    mine = results.get("meshfuse_autograd")
    lines = []
    for base, small, other in TARGETS:
        bound = small if label == "small" else other
        ratio = mine.ratios.get(base) if mine is not None else None
        verdict = "n/a" if ratio is None else ("met" if ratio <= bound else "NOT met")
        lines.append(f"meshfuse_autograd / {base} <= {bound}: {ratio} ({verdict})")
    if mine is not None and mine.recompiled is not None:
        verdict = "NOT met" if mine.recompiled else "met"
        lines.append(f"meshfuse_autograd's timed steps compiled nothing ({verdict})")
    return lines


HEADER = ("| variant | ms/step | / compile | / compile RO | / hand-written | first call s | "
          "second call s | peak MiB | recompiled |")


def markdown(report: dict) -> str:
    lines = [f"# GPT layer training step, {report['device']} ({report['torch']})", ""]
    for size in report["sizes"]:
        title = (f"## {size['size']}: b={size['b']} s={size['s']} heads={size['heads']} "
                 f"embed={size['embed']}")
        lines += [title, "", HEADER, "|---|---|---|---|---|---|---|---|---|"]
        for r in size["results"]:
            if r["status"] != "ok":
                lines.append(f"| {r['variant']} | {r['status']}: {r['message'][:120]} "
                             "| | | | | | | |")
                continue
            ratios = [r["ratios"].get(b, "") for b in BASELINES]
            lines.append(f"| {r['variant']} | {r['ms']:.3f} | {ratios[0]} | {ratios[1]} | "
                         f"{ratios[2]} | {r['first_call_s']:.2f} | {r['second_call_s']:.3f} "
                         f"| {r['peak_mib']} | {r['recompiled']} |")
        lines += ["", *[f"- {t}" for t in size["targets"]], ""]
        lines += [f"- {r['variant']} per step of a block (ms, median over rounds): "
                  + ", ".join(f"{t:.3f}" for t in r["step_ms"])
                  for r in size["results"] if r.get("step_ms")]
        for r in size["results"]:
            for key, value in r["info"].items():
                if isinstance(value, list):
                    lines += [f"{r['variant']} {key}:", *[f"    {v}" for v in value]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="small,medium",
                        help="comma-separated of small, medium, big (default small,medium)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, few steps (a CPU dry run when there is no GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names (default: all)")
    parser.add_argument("--per-step", action="store_true",
                        help="also time each step of a block (an event between steps): the "
                             "first step's host latency apart from the steady state")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="no new size is started after this many seconds")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Inductor on GPUs; on the CPU torch.compile's variants use aot_eager (no C++ build)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    sizes = {"tiny": TINY} if args.quick else {k: SIZES[k] for k in args.sizes.split(",")}
    rounds = args.rounds or (3 if args.quick else 7)
    iters = args.iters or (2 if args.quick else 10)
    warmup = 2 if args.quick else 5
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rounds": rounds, "iters": iters,
              "compile_env": os.environ.get("MESHFUSE_COMPILE"), "sizes": []}
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    for label, size in sizes.items():
        if time.perf_counter() - start > args.budget_s:
            report["sizes"].append({"size": label, "skipped": "over --budget-s"})
            continue
        print(f"{label} {size}", flush=True)
        chosen = args.variants.split(",") if args.variants else None
        report["sizes"].append(run_size(label, size, device, dtype, backend, rounds, iters,
                                        warmup, chosen, args.per_step))
        torch._dynamo.reset()  # the next size compiles its own modules
        gc.collect()  # this size's modules, programs and CUDA graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _write(report, args.out)
    report["seconds"] = round(time.perf_counter() - start, 1)
    _write(report, args.out)
    print(markdown(report))
    failed = [r for s in report["sizes"] for r in s.get("results", ())
              if r["status"] == "error"]
    return 1 if failed else 0


def _write(report: dict, out: str) -> None:
    done = {**report, "sizes": [s for s in report["sizes"] if "results" in s]}
    with open(os.path.join(out, "training_step.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "training_step.md"), "w") as f:
        f.write(markdown(done))


if __name__ == "__main__":
    sys.exit(main())
