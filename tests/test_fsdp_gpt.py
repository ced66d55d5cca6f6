"""Fully sharded data parallelism composed with context and tensor parallelism on the GPT
stack (examples/gpt_stack.py: layer norms, causal attention, MLPs, an MSE loss): at each
world size a mesh of named dimensions (dp, cp, tp), the loss and every parameter's gradient
of the first step checked against the unsharded model in PyTorch, then a few AdamW steps with
clipping, each step's communications counted per mesh dimension: one allgather per layer
forward and one per layer backward over dp, one reduce-scatter per layer over dp, the ring
transfers of context-parallel attention over cp, the tensor-parallel ones over tp.
``--world-sizes 8`` runs dp x cp x tp 2x2x2; 3 ranks, FSDP with uneven shards."""

from __future__ import annotations

import pytest
import torch

from meshfuse.autodiff.fsdp_module import FullyShardedModule
from meshfuse.examples.gpt import parameter_shapes
from meshfuse.examples.gpt_stack import GptStack, stack_parameters, torch_loss
from meshfuse.parallel.fsdp import NamedMesh
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.sharding import shard_tensor

B, S, E, HEADS, LAYERS, STEPS, LR, MAX_NORM = 2, 8, 8, 2, 2, 4, 1e-2, 0.5
REPLICATED = 4  # of a block's 6 parameters replicated over tp and cp, those summed alone

# the meshes each world size runs (3: E = 8 rows and 32 over 3 ranks, uneven shards)
MESHES = {1: ["dp=1"], 2: ["dp=2", "dp=1,cp=2"], 3: ["dp=3"],
          4: ["dp=2,cp=2", "dp=1,cp=2,tp=2", "dp=2,tp=2"], 8: ["dp=2,cp=2,tp=2"]}
ALL = sorted({m for ms in MESHES.values() for m in ms})


def _model(mesh: NamedMesh):
    tp = "tp" if "tp" in mesh.names else None
    cp = "cp" if "cp" in mesh.names else None
    fd = GptStack(B, S, E, HEADS, LAYERS, mesh, tp, cp=cp)
    tvs, init = fd.parameter_inputs(), stack_parameters(E, LAYERS)
    layers = [[f"{k}_{n}" for n in parameter_shapes(E)] for k in range(LAYERS)]
    model = FullyShardedModule(fd, {n: (tvs[n], init[n]) for n in tvs}, layers,
                               [fd.input, fd.target], mesh)
    return fd, tvs, model, mesh


def _batch(step: int):
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(B, S, E, generator=gen), torch.randn(B, S, E, generator=gen)


def _by_axis(comms, mesh: NamedMesh, name: str) -> list[str]:
    if name not in mesh.names:
        return []
    return [c.kind for c in comms if c.mesh_axis == mesh.axis(name)]


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ALL)
def test_dp_cp_tp_like_one_device(multidevice_test, spec):
    d = multidevice_test.size
    if spec not in MESHES.get(d, []):
        pytest.skip(f"{spec} runs at another world size")
    fd, tvs, model, mesh = _model(NamedMesh.parse(spec, d))
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in stack_parameters(E, LAYERS).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.values(), lr=LR)
    for step in range(STEPS):
        x, target = _batch(step)
        with record_communications() as log:
            loss = model(model.shard_input(fd.input, x), model.shard_input(fd.target, target))
            forward = list(log)
            loss.backward()
        backward = log[len(forward):]
        expected = torch_loss(x, target, ref, LAYERS, HEADS)
        expected.backward()
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()), step
        if step == 0:
            for name, tv in tvs.items():  # each rank's gradient shard: the whole gradient's
                want = shard_tensor(ref[name].grad, model.sharded.storage(tv))
                torch.testing.assert_close(getattr(model, name).grad, want,
                                           rtol=1e-4, atol=1e-5, msg=name)
        _check_communications(mesh, forward, backward)
        model.clip_grad_norm_(MAX_NORM)
        torch.nn.utils.clip_grad_norm_(ref.values(), MAX_NORM)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def _check_communications(mesh: NamedMesh, forward, backward) -> None:
    """Per step, on each dimension's groups: dp, one allgather per layer each way and one
    reduce-scatter per layer (its weights' sums over cp and tp ranks that split the tokens
    folded in: one allreduce per layer over each), the loss's allreduce; cp, the ring's k/v
    transfers of each layer's attention; tp, each layer's two gathers and two
    reduce-scatters of the sequence-parallel residual stream, forward and backward."""
    def on(comms, name):
        return [c.kind for c in comms if c.mesh_axis == mesh.axis(name)]

    n = {name: mesh.size(name) for name in mesh.names}
    fwd, bwd = on(forward, "dp"), on(backward, "dp")
    loss = ["allreduce"]  # the mean over the batch (and the sequence) split
    if n["dp"] > 1:
        assert sorted(fwd) == ["allgather"] * LAYERS + loss
        assert sorted(bwd) == ["allgather"] * LAYERS + ["reduce_scatter"] * LAYERS
    else:
        assert not fwd and not bwd
    for name in ("cp", "tp"):
        if n.get(name, 1) == 1:
            continue
        if name == "cp":  # the ring's k/v blocks (and their gradients in the backward)
            own = ["recv", "send"] * 2 * LAYERS * (n["cp"] - 1)
            own_backward = own * 2
        else:  # sequence parallel: each layer's two gathers and two reduce-scatters; the
            # backward transposes them and gathers the activations again (remat)
            own = ["allgather", "reduce_scatter"] * 2 * LAYERS
            own_backward = own + ["allgather"] * 2 * LAYERS
        assert sorted(on(forward, name)) == sorted(own + loss)
        sums = [k for k in on(backward, name) if k == "allreduce"]
        assert sorted(k for k in on(backward, name) if k != "allreduce") == sorted(own_backward)
        # the weights' partial sums over the ranks that split the tokens: folded into the
        # layer's reduce-scatter bucket (one allreduce per layer), else one per parameter.
        # On dp x cp x tp the parameters replicated over both cp and tp (norms, row-parallel
        # biases) are summed over each by one allreduce per parameter (not bucketed yet).
        split = [k for k in ("cp", "tp") if n.get(k, 1) > 1]
        if n["dp"] > 1 and len(split) == 1:
            assert len(sums) == LAYERS
        elif n["dp"] > 1:
            assert len(sums) == LAYERS * (1 + REPLICATED) if name == "cp" else \
                len(sums) == LAYERS * REPLICATED
        else:
            assert len(sums) > LAYERS
