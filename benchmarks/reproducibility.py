"""Whether a program with dropout gives the same bits twice for the same seed, output by output.

The contract (``docs/dropout.md``): one seed gives one set of dropout masks, so the forward
outputs are bitwise the same on every backend. Gradients are bitwise the same where the
backward kernel sums in a fixed order: the math kernels, and every fused kernel under
``torch.use_deterministic_algorithms(True)``. By default PyTorch's flash backward adds the
query gradient's blocks with float atomics (``dq_accum``), in whatever order the thread blocks
finish, so two calls with the same mask may differ in the last bits of ``q_grad``: the
reproducibility check must not read that as a different mask.

:func:`check_same_seed` runs a program twice per mode and raises ``ValueError`` naming the
output that broke the contract; the benchmark cases and ``benchmarks.dropout_check`` use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from meshfuse.errors import ExecutionError, InputError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# How far a gradient may move when only the backward's summation order differs (bf16 rounding
# of a few atomically added terms); a different mask moves it by O(1) of its scale.
GRAD_RTOL, GRAD_ATOL = 1.6e-2, 1e-2


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaNs with the same payload are equal, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() in _INT_OF_SIZE:
        as_int = _INT_OF_SIZE[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference (inf where one side is not finite and the other is)."""
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return float((a.long() - b.long()).abs().max()) if a.numel() else 0.0
    diff = (a.double() - b.double()).abs()
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """``torch.use_deterministic_algorithms(enabled)`` for the block, the setting restored."""
    saved = torch.are_deterministic_algorithms_enabled()
    saved_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved, warn_only=saved_warn)


def same_seed_twice(call: Callable[[], Sequence[torch.Tensor]], seed: int = 0):
    """Two results of ``call()``, each after ``torch.manual_seed(seed)``."""
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)
        runs.append([t.clone() for t in call()])
    return runs


def compare(first, second, names: Sequence[str]) -> dict[str, dict]:
    """Per output: ``{"bitwise": bool, "max_diff": float, "scale": float}`` (the scale is
    the first run's largest magnitude)."""
    return {name: {"bitwise": bitwise_equal(a, b), "max_diff": max_difference(a, b),
                   "scale": max_difference(a, torch.zeros_like(a))}
            for name, a, b in zip(names, first, second)}


def deterministic_refusal(err: Exception) -> Exception | None:
    """The refusal to run a program under deterministic algorithms that ``err`` (raised by
    the run in that mode only) is, or None for another error: torch's RuntimeError (a kernel
    without a deterministic implementation) or meshfuse's InputError (its cuDNN attention
    backward: ``check_deterministic_backward``), raised as it is or as the cause of the
    ExecutionError of the meshfuse step that ran the kernel."""
    refusals = RuntimeError | InputError
    if isinstance(err, refusals):
        return err
    if isinstance(err, ExecutionError) and isinstance(err.__cause__, refusals):
        return err.__cause__
    return None


def check_same_seed(call: Callable[[], Sequence[torch.Tensor]], names: Sequence[str],
                    forward: int = 1, deterministic_check: bool = True,
                    strict: bool = True) -> dict:
    """Runs ``call`` twice with one torch seed, then twice more under
    ``torch.use_deterministic_algorithms(True)`` (if ``deterministic_check``), and checks the
    contract in the module doc: the first ``forward`` outputs bitwise equal in both modes, the
    others (gradients) bitwise equal in deterministic mode and close otherwise. Not
    ``strict``: gradients need only be close in deterministic mode too (the benchmarks time
    the program and report the bits; ``benchmarks.dropout_check`` and the tests hold the
    contract).

    Returns:
        ``{"default": compare(...), "deterministic": compare(...)}``; ``"deterministic"`` is
        None when not checked, or says why torch or meshfuse refused to run the program that
        way (see :func:`deterministic_refusal`).

    Raises:
        ValueError: an output that breaks the contract, named, with its largest difference.
    """
    found = {"default": compare(*same_seed_twice(call), names), "deterministic": None}
    if deterministic_check:
        try:
            with deterministic_algorithms(True):
                found["deterministic"] = compare(*same_seed_twice(call), names)
        except (RuntimeError, InputError, ExecutionError) as err:
            refusal = deterministic_refusal(err)
            if refusal is None:
                raise
            found["deterministic"] = f"not run: {str(refusal).splitlines()[0]}"
    for mode, outputs in found.items():
        if not isinstance(outputs, dict):
            continue
        for i, (name, result) in enumerate(outputs.items()):
            exact = i < forward or (strict and mode == "deterministic")
            close = result["max_diff"] <= GRAD_ATOL + GRAD_RTOL * result["scale"]
            if result["bitwise"] or (not exact and close):
                continue
            raise ValueError(
                f"two runs with the same seed differ in {name} ({mode} algorithms): largest "
                f"difference {result['max_diff']:.3g}"
                + ("" if exact else f", beyond a reordered sum's (rtol {GRAD_RTOL})"))
    return found

