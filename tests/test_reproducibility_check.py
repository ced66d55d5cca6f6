"""The same-seed check of the dropout benchmarks (``benchmarks/reproducibility.py``): the
forward bitwise, gradients bitwise under deterministic algorithms and to rounding otherwise
(a fused backward that adds with atomics, as flash's does, differs in the last bits)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.reproducibility import bitwise_equal, check_same_seed
from meshfuse.errors import ExecutionError, InputError

NAMES = ("attn", "q_grad")
_calls = {"n": 0}


def _program(forward_noise: float = 0.0, grad_noise: float = 0.0):
    """A stand-in for a dropout program: attn from the seeded generator; ``*_noise`` added
    on every other call, to the gradient only outside deterministic mode (like flash)."""
    def call():
        _calls["n"] += 1
        wobble = _calls["n"] % 2
        attn = torch.rand(64) + forward_noise * wobble
        grad = torch.rand(64) * 4
        if not torch.are_deterministic_algorithms_enabled():
            grad = grad + grad_noise * wobble
        return attn, grad
    return call


def test_bitwise_equal_compares_bits():
    nan = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert bitwise_equal(torch.arange(4), torch.arange(4))


def test_reordered_gradient_sum_is_rounding_not_another_mask():
    found = check_same_seed(_program(grad_noise=1e-3), NAMES)
    assert found["default"]["attn"]["bitwise"]
    assert not found["default"]["q_grad"]["bitwise"]
    assert all(r["bitwise"] for r in found["deterministic"].values())


def test_another_forward_is_reported_by_name():
    with pytest.raises(ValueError, match="differ in attn"):
        check_same_seed(_program(forward_noise=1e-6), NAMES)


def test_a_gradient_beyond_rounding_is_reported():
    with pytest.raises(ValueError, match="differ in q_grad .default"):
        check_same_seed(_program(grad_noise=1.0), NAMES)


def test_deterministic_mode_demands_every_bit():
    def call():
        _calls["n"] += 1
        return torch.zeros(4), torch.full((4,), 1e-6 * (_calls["n"] % 2))
    with pytest.raises(ValueError, match="differ in q_grad .deterministic"):
        check_same_seed(call, NAMES)
    assert not torch.are_deterministic_algorithms_enabled()  # restored


def test_not_strict_lets_deterministic_gradients_differ_by_rounding():
    def call():
        _calls["n"] += 1
        return torch.zeros(4), torch.full((4,), 1e-6 * (_calls["n"] % 2))
    found = check_same_seed(call, NAMES, strict=False)
    assert not found["deterministic"]["q_grad"]["bitwise"]


def _refused_when_deterministic(error: Exception):
    """A program that runs by default and raises ``error`` under deterministic algorithms."""
    def call():
        if torch.are_deterministic_algorithms_enabled():
            raise error
        return torch.zeros(4), torch.ones(4)
    return call


def _execution_error(cause: Exception) -> ExecutionError:
    try:
        raise ExecutionError("rank 0, step 3 (sdpfa_bwd) failed") from cause
    except ExecutionError as err:
        return err


CUDNN_REFUSAL = "the cuDNN attention backward is not deterministic"


@pytest.mark.parametrize("error, reason", [
    (RuntimeError("no deterministic implementation\nmore"), "no deterministic implementation"),
    (InputError(CUDNN_REFUSAL), CUDNN_REFUSAL),
    (_execution_error(InputError(CUDNN_REFUSAL)), CUDNN_REFUSAL),
], ids=["torch", "meshfuse", "meshfuse_in_a_step"])
def test_a_refusal_to_run_deterministically_is_reported_as_not_run(error, reason):
    found = check_same_seed(_refused_when_deterministic(error), NAMES)
    assert found["deterministic"] == f"not run: {reason}"
    assert all(r["bitwise"] for r in found["default"].values())
    assert not torch.are_deterministic_algorithms_enabled()  # restored


@pytest.mark.parametrize("error", [ValueError("a bug"), _execution_error(ValueError("a bug"))],
                         ids=["raised", "in_a_step"])
def test_other_errors_of_the_deterministic_run_propagate(error):
    with pytest.raises(type(error)):
        check_same_seed(_refused_when_deterministic(error), NAMES)
