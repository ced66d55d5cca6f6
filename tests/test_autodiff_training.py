"""Training through derived backwards: a 2-block GPT stack (layer norm, causal attention
through ``sdpfa_fwd``, MLP, residuals), each block a :class:`~meshfuse.FusionModule`, tensor
and sequence parallel, trained 20 steps with AdamW from the same initialization as the same
stack in plain PyTorch on one device: every step's loss agrees within 1e-5 relative in
float32. The training is :func:`meshfuse.examples.train_gpt.train`, the script that runs in
bf16 on GPUs (``torchrun --nproc-per-node 2 -m meshfuse.examples.train_gpt --dtype bfloat16``).
"""

from __future__ import annotations

import pytest

from meshfuse.examples.train_gpt import BF16_PRECISION, StepLosses, main, train, verdict


@pytest.mark.mpi
def test_two_block_stack_trains_like_pytorch(multidevice_test):
    losses = train(steps=20)
    assert len(losses) == 20
    for step, s in enumerate(losses):
        assert abs(s.meshfuse - s.pytorch) <= 1e-5 * abs(s.pytorch), (step, s)
        assert s.dtensor is None  # no twin in float32
    # the losses move: the comparison is of a training, not of twenty initial losses
    assert losses[-1].pytorch < losses[0].pytorch
    assert verdict(losses) == {"ok": True, "bound": 1e-5, "direct": pytest.approx(
        max(abs(s.meshfuse - s.pytorch) / abs(s.pytorch) for s in losses))}


def test_bf16_bound_is_twice_dtensors_difference_at_least_bf16_precision():
    """In bf16 the bound is read off DTensor's twin: twice its largest relative difference
    from PyTorch, never below bf16's relative precision."""
    wide = [StepLosses(1.0, 1.0, 1.02), StepLosses(2.0 * 1.03, 2.0, 2.0)]
    check = verdict(wide)
    assert check["bound"] == pytest.approx(0.04) and check["dtensor"] == pytest.approx(0.02)
    assert check["direct"] == pytest.approx(0.03) and check["ok"]
    assert not verdict([StepLosses(1.05, 1.0, 1.02)])["ok"]
    close = [StepLosses(1.003, 1.0, 1.0)]
    assert verdict(close) == {"ok": True, "bound": BF16_PRECISION,
                              "direct": pytest.approx(0.003), "dtensor": 0.0}
    assert not verdict(close, rtol=1e-3)["ok"]


def test_script_reports_and_fails_above_its_tolerance(tmp_path, capsys):
    assert main(["--steps", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "train_gpt.json").exists()
    assert "largest relative difference" in capsys.readouterr().out
    assert main(["--steps", "2", "--rtol", "-1"]) == 1
