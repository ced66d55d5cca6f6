"""Training through derived backwards: a 2-block GPT stack (layer norm, causal attention
through ``sdpfa_fwd``, MLP, residuals), each block a :class:`~meshfuse.FusionModule`,
tensor and sequence parallel, trained with AdamW from the same initialization as the same
stack in plain PyTorch on one device: the losses of every step agree.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse import DataType, DeviceMesh, FusionModule, shard_tensor
from meshfuse.examples.gpt import GptBlock, init_parameters, torch_block
from meshfuse.testing.utils import current_device

B, S, E, HEADS = 2, 16, 32, 4
STEPS = 20
LR = 1e-3


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, E, generator=gen), torch.randn(B, S, E, generator=gen)


@pytest.mark.mpi
def test_two_block_stack_trains_like_pytorch(multidevice_test):
    mesh = DeviceMesh(range(multidevice_test.size))
    inits = [init_parameters(E, seed=layer) for layer in range(2)]
    blocks = [GptBlock(B, S, E, HEADS, DataType.Float, mesh, sequence_parallel=True,
                       output_replicated=layer == 1) for layer in range(2)]
    modules = torch.nn.ModuleList(
        FusionModule(block, {n: (block.define().params[n], init[n]) for n in init})
        for block, init in zip(blocks, inits))
    modules.to(current_device())
    reference = [torch.nn.ParameterDict({n: torch.nn.Parameter(t.clone()) for n, t in i.items()})
                 for i in inits]
    opt = torch.optim.AdamW(modules.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW([p for d in reference for p in d.values()], lr=LR)
    for step in range(STEPS):
        x, target = _data(step)
        local_x = shard_tensor(x, blocks[0].x, multidevice_test.rank).to(current_device())
        y = modules[1](modules[0](local_x))  # block 1's output is replicated
        loss = (y - target.to(y.device)).pow(2).mean()
        ref_y = torch_block(torch_block(x, dict(reference[0]), HEADS), dict(reference[1]), HEADS)
        ref_loss = (ref_y - target).pow(2).mean()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=0,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        for o, value in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            value.backward()
            o.step()
