"""The Llama-family example fully sharded over ``dp`` (:mod:`meshfuse.examples.llama` with a
:class:`~meshfuse.parallel.fsdp.NamedMesh`): each fusion (the embedding, every block, the
head) a :class:`~meshfuse.autodiff.fsdp_module.FullyShardedModule` whose one layer is its
parameters, composed with tensor + sequence parallelism over ``tp``. Trained with AdamW and
gradient clipping like the plain-PyTorch twin on one device (per-step losses within 1e-5
relative), at dp=2, dp=3 (uneven: 98 vocabulary rows, 3 sequences), dp=4 and dp=2 x tp=2; one
step's communications on the dp groups (one allgather per fusion forward and one backward,
one reduce-scatter per fusion) and each rank's parameter bytes (1/dp of the model's)."""

from __future__ import annotations

import math

import pytest
import torch

from meshfuse.examples.llama import LlamaConfig, LlamaModel, init_parameters
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.examples.train_llama import device_mesh, synthetic_batch, train
from meshfuse.runtime.comm.collectives import record_communications

CFG = LlamaConfig(vocab=98, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=8,
                  rope_theta=500000.0)
MESHES = {2: [{"dp": 2, "tp": 1}], 3: [{"dp": 3, "tp": 1}],
          4: [{"dp": 2, "tp": 2}, {"dp": 4, "tp": 1}]}
ALL = [f"dp={m['dp']},tp={m['tp']}" for ms in MESHES.values() for m in ms]


def _mesh(spec: str) -> dict[str, int]:
    return {k: int(v) for k, v in (p.split("=") for p in spec.split(","))}


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ALL)
def test_llama_fsdp_trains_like_one_device(multidevice_test, spec):
    sizes = _mesh(spec)
    if math.prod(sizes.values()) != multidevice_test.size:
        pytest.skip(f"{spec} runs at another world size")
    batch = 2 * sizes["dp"] if sizes["dp"] != 3 else 3
    losses, reference, account = train(CFG, steps=5, batch=batch, mesh=sizes, max_norm=0.5)
    whole = sum(t.numel() * 4 for t in init_parameters(CFG).values())
    # each rank: at most ceil(rows / dp) rows of each parameter (1/dp, plus uneven padding)
    bound = sum(math.ceil(t.shape[0] / sizes["dp"]) * t[0].numel() * 4
                for t in init_parameters(CFG).values())
    assert account["parameters"] <= bound < whole
    assert account["gradients"] == account["parameters"]
    if multidevice_test.rank == 0:
        for i, (mine, theirs) in enumerate(zip(losses, reference, strict=True)):
            assert abs(mine - theirs) <= 1e-5 * abs(theirs), (i, mine, theirs)


@pytest.mark.mpi
def test_llama_fsdp_communicates_per_fusion(multidevice_test):
    """One step at dp over every rank: per fusion (embedding, 2 blocks, head), one allgather
    of its parameters forward, one again backward, one reduce-scatter of their gradients;
    the loss's two allreduces (the mean cross entropy: the sum over the tokens and their
    count, which ignore_index makes data dependent); nothing else."""
    d = multidevice_test.size
    if d == 1:
        pytest.skip("nothing is sharded on one rank")
    model = LlamaModel(CFG, d, init_parameters(CFG), device_mesh({"dp": d, "tp": 1}, d))
    ids, targets = synthetic_batch(CFG, d, 0)
    with record_communications() as log:
        loss = model(ids, targets)
        forward = [c.kind for c in log]
        loss.backward()
    backward = [c.kind for c in log][len(forward):]
    fusions = CFG.layers + 2
    assert sorted(forward) == ["allgather"] * fusions + ["allreduce"] * 2
    assert sorted(backward) == ["allgather"] * fusions + ["reduce_scatter"] * fusions
    ref = LlamaTorch(CFG)
    ref.load_state_dict(init_parameters(CFG))
    torch.testing.assert_close(loss, ref(ids, targets), rtol=1e-5, atol=1e-6)
