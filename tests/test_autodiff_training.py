"""Training through derived backwards: a 2-block GPT stack (layer norm, causal attention
through ``sdpfa_fwd``, MLP, residuals), each block a :class:`~meshfuse.FusionModule`, tensor
and sequence parallel, trained 20 steps with AdamW from the same initialization as the same
stack in plain PyTorch on one device: every step's loss agrees within 1e-5 relative in
float32. The training is :func:`meshfuse.examples.train_gpt.train`, the script that runs in
bf16 on GPUs (``torchrun --nproc-per-node 2 -m meshfuse.examples.train_gpt --dtype bfloat16``).
"""

from __future__ import annotations

import pytest

from meshfuse.examples.train_gpt import main, train


@pytest.mark.mpi
def test_two_block_stack_trains_like_pytorch(multidevice_test):
    losses = train(steps=20)
    assert len(losses) == 20
    for step, (loss, ref_loss) in enumerate(losses):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
    # the losses move: the comparison is of a training, not of twenty initial losses
    assert losses[-1][1] < losses[0][1]


def test_script_reports_and_fails_above_its_tolerance(tmp_path, capsys):
    assert main(["--steps", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "train_gpt.json").exists()
    assert "largest relative difference" in capsys.readouterr().out
    assert main(["--steps", "2", "--rtol", "-1"]) == 1
