"""An error raised inside one stage in the middle of a pipeline step, on one rank: that rank
raises it, every other rank raises it too (``ExecutionError`` naming the rank and the error)
within seconds, not at the transfers' timeout while waiting for a message that never comes;
the next step raises at once until ``Communicator.recover()`` on every rank, after which
steps run and their losses are those of the unsplit model."""

from __future__ import annotations

import time

import pytest
import torch

from meshfuse.errors import CommunicationError, ExecutionError
from meshfuse.parallel.stages import PipelineRunner, schedule
from meshfuse.runtime.comm.communicator import Communicator

WIDTH, ROWS, MICROBATCHES = 4, 8, 4


class _Fails(torch.autograd.Function):
    """The identity, whose backward raises."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("a stage's own error in its backward")


class _Stage(torch.nn.Module):
    """A linear layer that raises, once, in its ``fail_at``-th forward (or in the backward
    of that forward's output, ``in_backward``)."""

    def __init__(self, index: int, fail_at: int | None = None, in_backward: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            weights = torch.randn(WIDTH, WIDTH + 1,
                                  generator=torch.Generator().manual_seed(index))
            self.linear.weight.copy_(weights[:, :WIDTH])
            self.linear.bias.copy_(weights[:, WIDTH])
        self.fail_at, self.in_backward, self.calls = fail_at, in_backward, 0

    def forward(self, x):
        self.calls += 1
        y = torch.tanh(self.linear(x))
        if self.calls == self.fail_at:
            if not self.in_backward:
                raise ValueError("a stage's own error")
            y = _Fails.apply(y)
        return y


def _loss(y, t):
    return (y - t).pow(2).mean()


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def _reference_loss(stages: int) -> float:
    x, t = _data()
    for i in range(stages):
        x = _Stage(i)(x)
    return _loss(x, t).item()


def _first_error(runner, x, t, steps: int) -> tuple[int, Exception] | None:
    """The step (counted from 0) at which ``runner`` first raised, and its error."""
    for step in range(steps):
        try:
            runner.step(x, t)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            return step, error
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["forward of the last stage", "backward of the first",
                                   "forward of every stage"])
def test_a_stage_error_mid_step_is_raised_on_every_rank(multidevice_test, where):
    """Every rank that waits for a message of the failed rank raises its error in that
    step; one that may have got all it needed before the failure (at 3 ranks and more, the
    middle and last stages when the first fails in its backward of the second microbatch,
    after its last forward) raises it in that step if one of its sends is still waiting for
    the failed rank to take it (gloo's larger sends wait for their receive), else in the
    next step, whose messages never come. Where every stage
    fails alike the ranks are out of step all the same (the receives each left posted would
    take the next step's messages)."""
    d, rank = multidevice_test.size, multidevice_test.rank
    if d == 1:
        pytest.skip("one stage: no other rank to tell")
    failing = d - 1 if where.startswith("forward of the last") else 0
    every = where.endswith("every stage")
    stage = _Stage(rank, fail_at=2 if rank == failing or every else None,
                   in_backward=where.startswith("backward"))
    runner = PipelineRunner(schedule("1F1B", d, MICROBATCHES), {rank: stage}, _loss)
    x, t = _data()
    start = time.monotonic()
    step, error = _first_error(runner, x, t, steps=2)
    assert time.monotonic() - start < 30  # the transfers' timeout is 120 s
    if every:  # its own error, or that of a rank that failed before it read its message
        assert step == 0 and "a stage's own error" in str(error), error
    elif rank == failing:
        assert step == 0 and isinstance(error, ValueError), error
    else:
        assert isinstance(error, ExecutionError), error
        assert str(error).startswith(f"rank {failing}: ValueError: a stage's own error")
        may_be_late = where.startswith("backward") and d > 2 and rank > 0
        assert step in ((0, 1) if may_be_late else (0,)), (step, error)
    with pytest.raises(CommunicationError, match="out of step"):
        runner.step(x, t)
    Communicator.instance().recover()
    stage.fail_at = None  # (a rank told before its own failure never ran that forward)
    stage.zero_grad()
    loss = runner.step(x, t)
    if rank == d - 1:
        assert abs(loss.item() - _reference_loss(d)) <= 1e-6
    else:
        assert loss is None
    assert stage.linear.weight.grad is not None
