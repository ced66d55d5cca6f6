"""Runs fuzz programs through their derived backward and compares the gradients with torch's
autograd (see ``test_fuzz_autodiff.py``).

A program (``fuzz_programs.generate`` with ``Features.differentiable``) runs through
``fd.as_autograd_function()`` (with the program's drawn ``remat`` policy) on this rank's
shards, its floating-point inputs requiring grad. Its outputs are compared with torch's as
``fuzz_runner.run_program`` compares them; then each differentiable output gets a random
global cotangent (the same on every rank;
where there are several, some get none: :func:`dropped_outputs`, whose backward is derived
without them), this rank's shard of it flows back through the derived backward, and each input's
gradient must be this rank's shard of ``torch.autograd.grad`` of the torch code on the
global tensors, with the same cotangents. A rank outside an output's mesh gets an empty
output; its cotangent is empty too, and it runs the backward with the others.

Outcomes are ``fuzz_runner``'s: ``match``, ``mismatch`` (an output, a gradient, or an output
that should be differentiable and is not), ``untyped`` (an error that is not a typed
refusal), or a refusal of :data:`fuzz_runner.REFUSALS`. Each program runs twice (the first
call derives the backward, the second runs the cached one), both compared.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from fuzz_programs import Program, build, reference
from fuzz_runner import Outcome, classify, holder, local_inputs, rounds_to_bfloat16, tolerance

from meshfuse import shard_tensor

# The reproduction's end for a gradient failure (Program.repro's ``check``).
GRADIENT_CHECK = """f = fd.as_autograd_function()
for x in local:
    if x is not None and x.is_floating_point():
        x.requires_grad_()
outs = f(local)
leaves = [x.requires_grad_() if x.is_floating_point() else x for x in inputs]
with torch.enable_grad():
    refs = reference.__wrapped__(*leaves)  # reference() without its no_grad
cgen = torch.Generator().manual_seed(COTANGENT_SEED)
drawn = {j: torch.randn(r.shape, generator=cgen) for j, r in enumerate(refs) if r.requires_grad}
carried = [j for j in drawn if j not in DROPPED]  # outputs without a gradient: none
cots = [drawn[j] for j in carried]
mine = [meshfuse.shard_tensor(ct, fd.fusion.outputs()[j], rank)
        if compiled[fd.fusion.outputs()[j]].mesh is None
        or rank in compiled[fd.fusion.outputs()[j]].mesh else torch.zeros_like(outs[j])
        for j, ct in zip(carried, cots)]
torch.autograd.backward([outs[j] for j in carried], mine)
wanted = [i for i, x in enumerate(leaves) if x.requires_grad]
grads = torch.autograd.grad([refs[j] for j in carried], [leaves[i] for i in wanted], cots,
                            allow_unused=True)
for i, ref in zip(wanted, grads):
    tv = fd.fusion.inputs()[i]
    if held[i]:
        ref = torch.zeros_like(leaves[i]) if ref is None else ref
        got = torch.zeros_like(local[i]) if local[i].grad is None else local[i].grad
        torch.testing.assert_close(got, meshfuse.shard_tensor(ref, tv, rank), rtol=1e-4,
                                   atol=1e-4, msg=lambda m, i=i: f"gradient of input {i}: {m}")
print("rank", rank, "gradients ok")
"""


def cotangent_seed(program: Program) -> int:
    """The seed of the generator that draws ``program``'s cotangents (as its
    reproduction does)."""
    return program.seed + 1


def run_gradients(program: Program, rank: int, device: torch.device,
                  compile: str | None = None) -> Outcome:
    """Runs ``program`` forward and backward on this rank's shards and compares its outputs
    and its inputs' gradients with torch's on the global tensors (see the module doc);
    ``compile``: the torch.compile backend of its fused segments (None: the default)."""
    return _run(program, rank, device, compile)


def dropped_outputs(program: Program, differentiable: list[int]) -> set[int]:
    """The outputs among ``differentiable`` (positions) that get no cotangent: where there
    are several, each is left out with probability 1/3, one at least kept (the backward
    is then derived without their cotangents, as for the logits a language model returns
    beside its loss)."""
    if len(differentiable) < 2:
        return set()
    draw = random.Random(program.seed + 2)
    dropped = {j for j in differentiable if draw.random() < 1 / 3}
    return dropped - {differentiable[0]} if dropped == set(differentiable) else dropped


def _run(program: Program, rank: int, device: torch.device,
         compile: str | None = None) -> Outcome:
    check = GRADIENT_CHECK.replace("COTANGENT_SEED", str(cotangent_seed(program)))
    check = check.replace("as_autograd_function()", f"as_autograd_function(compile={compile!r}, "
                          f"remat={program.remat!r})")
    try:
        _, expected = reference(program, grad=True)
        dropped = dropped_outputs(program, [j for j, e in enumerate(expected)
                                            if e.requires_grad])
        check = check.replace("DROPPED", repr(sorted(dropped)))
        fd, _ = build(program)
        function = fd.as_autograd_function(compile=compile, remat=program.remat)
        failures = []
        for call in ("first call", "cached call"):  # both on every rank: they communicate
            failure = _check_call(program, fd, function, rank, device)
            if failure:
                failures.append(f"{call}, {failure}")
        if failures:
            return Outcome("mismatch", failures[0], program, check)
    except Exception as e:  # noqa: BLE001 (every error is an outcome to count)
        kind, detail = classify(e)
        return Outcome(kind, detail, program, check)
    return Outcome("match", "", program, check)


def _check_call(program: Program, fd, function, rank: int, device: torch.device) -> str:
    """One forward and backward of ``function``; what differs from torch ("" if nothing)."""
    inputs, expected = reference(program, grad=True)
    gen = torch.Generator().manual_seed(cotangent_seed(program))
    cotangents = [torch.randn(e.shape, generator=gen) if e.requires_grad else None
                  for e in expected]
    dropped = dropped_outputs(program, [j for j, c in enumerate(cotangents) if c is not None])
    cotangents = [None if j in dropped else c for j, c in enumerate(cotangents)]
    return check_gradients(fd, function, inputs, expected, cotangents, rank, device,
                           lambda ref: tolerance(program, ref),
                           float64_reference(program, inputs, cotangents))


def float64_reference(program: Program, inputs: list, cotangents: list
                      ) -> tuple[list, list[torch.Tensor | None]] | None:
    """The program's outputs computed by torch in float64, and per input its float64
    gradient with the same cotangents (None where it has none), to measure what float32
    rounding alone moves torch's own results by (:func:`check_gradients`' slack). None
    where the program is not all float32, or cannot run in float64 (an op of two operands
    that must share a dtype, one of them cast to float32 by the program)."""
    carried = [j for j, ct in enumerate(cotangents) if ct is not None]
    wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
    if program.low or rounds_to_bfloat16(program):
        return None
    try:
        inputs64, expected64 = reference(program, grad=True, double=True)
        grads = torch.autograd.grad([expected64[j] for j in carried],
                                    [inputs64[i] for i in wanted],
                                    [cotangents[j].to(expected64[j].dtype) for j in carried],
                                    allow_unused=True) if carried and wanted else []
    except RuntimeError:  # a dtype mismatch: see the doc
        return None
    exact: list[torch.Tensor | None] = [None] * len(inputs)
    for i, grad in zip(wanted, grads):
        exact[i] = grad
    return [e.detach() for e in expected64], exact


def _roundoff_slack(single: torch.Tensor | None, double: torch.Tensor | None) -> float:
    """4 times the distance of torch's float32 result (an output, a gradient) from its
    float64 one (over the elements finite in both): an ill-conditioned program (a
    normalization of nearly equal values: ``var`` near 0 and ``rsqrt`` large; a product of
    many factors, some near 0) amplifies the roundoff of sums and products taken in another
    order, on shards, beyond float32's fixed tolerance."""
    if single is None or double is None or single.dtype != torch.float32:
        return 0.0
    finite = torch.isfinite(single) & torch.isfinite(double)
    if not finite.any():
        return 0.0
    return 4.0 * float((single.double() - double)[finite].abs().max())


def check_gradients(fd, function, inputs: list, expected: list, cotangents: list, rank: int,
                    device: torch.device, tol: Callable[[torch.Tensor], dict],
                    exact: tuple[list, list[torch.Tensor | None]] | None = None) -> str:
    """Runs ``function`` (``fd``'s autograd function) on this rank's shards of global
    ``inputs`` (its floating-point ones leaves that require grad), then backward with this
    rank's shards of ``cotangents`` (global, one per output, None where torch's output
    ``expected`` does not require grad); compares the outputs with ``expected`` and each
    held input's gradient with ``torch.autograd.grad`` of ``expected``, within
    ``tol(reference)`` and, where ``exact`` (:func:`float64_reference`: the outputs and the
    inputs' gradients in float64) has one, the roundoff torch's own float32 result shows
    more absolute error (:func:`_roundoff_slack`). Returns what differs ("" if nothing)."""
    held = holder(fd.fusion, rank)
    local = local_inputs(fd.fusion, inputs, rank, device)
    for x in local:
        if x is not None and x.is_floating_point():
            x.requires_grad_()
    outputs = function(local)
    outs = fd.fusion.outputs()
    exact_outputs, exact_gradients = exact if exact else ([None] * len(outs), None)
    for out, ref, tv, ref64 in zip(outputs, expected, outs, exact_outputs):
        if held(tv):
            extra = _roundoff_slack(ref.detach(), ref64)
            failure = _compare(out, ref, tv, rank, lambda r, extra=extra: _widened(tol(r), extra))
            if failure:
                return f"output {tv.name}: {failure}"
    carried = [j for j, ct in enumerate(cotangents) if ct is not None]
    holds_a_leaf = any(x is not None and x.requires_grad for x in local)
    for j in carried:
        if holds_a_leaf and held(outs[j]) and not outputs[j].requires_grad:
            return f"output {outs[j].name} is not differentiable; torch differentiates it"
    mine = [(outputs[j], shard_tensor(cotangents[j].to(device), outs[j], rank)
             if held(outs[j]) else torch.zeros_like(outputs[j])) for j in carried]
    mine = [(out, ct) for out, ct in mine if out.requires_grad]
    if mine:
        torch.autograd.backward([out for out, _ in mine], [ct for _, ct in mine])
    wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
    grads = torch.autograd.grad([expected[j] for j in carried], [inputs[i] for i in wanted],
                                [cotangents[j] for j in carried], allow_unused=True) \
        if carried else [None] * len(wanted)
    for i, ref in zip(wanted, grads):
        tv = fd.fusion.inputs()[i]
        if not held(tv):
            continue
        extra = _roundoff_slack(ref, exact_gradients[i]) if exact_gradients else 0.0
        ref = torch.zeros_like(inputs[i]) if ref is None else ref
        got = local[i].grad if local[i].grad is not None else torch.zeros_like(local[i])
        failure = _compare(got, ref, tv, rank, lambda r, extra=extra: _widened(tol(r), extra))
        if failure:
            return f"gradient of input {tv.name}: {failure}"
    return ""


def _widened(tol: dict, extra: float) -> dict:
    return {**tol, "atol": tol["atol"] + extra} if extra else tol


def _compare(got: torch.Tensor, ref: torch.Tensor, tv, rank: int, tol) -> str:
    """How ``got`` differs from this rank's shard of global ``ref`` ("" if it does not).
    Where torch's own result is not finite (float32 overflowed: a product of 200 factors
    whose true values reach 1e41, fuzzer seed 600756), ``got`` need only not be finite
    either: which of inf and NaN an overflow leaves depends on the order of the operations."""
    want = shard_tensor(ref.detach().to(got.device), tv, rank)
    got = got.detach()
    if want.is_floating_point() and got.dtype == want.dtype and got.shape == want.shape:
        overflowed = ~torch.isfinite(want) & ~torch.isfinite(got)
        if overflowed.any():
            got, want = got.masked_fill(overflowed, 0), want.masked_fill(overflowed, 0)
    try:
        torch.testing.assert_close(got, want, **tol(ref.detach()))
    except AssertionError as e:
        return str(e)
    return ""
