"""The Mixtral-like example (meshfuse.examples.mixtral): attention tensor + sequence
parallel, experts expert-parallel over the same ranks, trained 10 AdamW steps in float32
against the same model in plain PyTorch on one device."""

from __future__ import annotations

import pytest
import torch

from meshfuse import DeviceMesh
from meshfuse.examples.mixtral import MixtralConfig, MixtralModel, MixtralTorch, init_parameters
from meshfuse.examples.train_llama import step, synthetic_batch
from meshfuse.runtime.comm.collectives import record_communications


@pytest.mark.mpi
def test_mixtral_trains_like_pytorch(multidevice_test):
    """Each step's loss within 1e-5 relative of the single-device model's; 5 experts (the
    ranks do not divide them: at 4 ranks, 2, 2, 1, 0), top 2, Mixtral's renormalized softmax
    routing; each block's experts exchange their tokens (one split-size exchange and two
    ragged all-to-alls per block, forward and backward)."""
    d = multidevice_test.size
    cfg = MixtralConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=16, seq=16,
                        experts=5, top_k=2)
    params = init_parameters(cfg)
    model = MixtralModel(cfg, params, DeviceMesh(range(d)), multidevice_test.device)
    ref = MixtralTorch(cfg)
    ref.load_state_dict(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for i in range(10):
        ids, targets = synthetic_batch(cfg, 1, i)
        with record_communications() as comms:
            losses.append(step(model, opt, ids.to(multidevice_test.device),
                               targets.to(multidevice_test.device)))
        ref_losses.append(step(ref, ref_opt, ids, targets))
        kinds = [c.kind for c in comms]
        want = 2 * cfg.layers if d > 1 else 0  # forward and backward of each block
        assert kinds.count("split_sizes") == want and kinds.count("ragged_all_to_all") == \
            2 * want
    for i, (mine, theirs) in enumerate(zip(losses, ref_losses)):
        assert abs(mine - theirs) <= 1e-5 * abs(theirs), (i, mine, theirs)
    assert ref_losses[-1] < 0.98 * ref_losses[0]  # a training, not a standstill
