"""The Llama-family example fully sharded over ``dp`` (:mod:`meshfuse.examples.llama` with a
:class:`~meshfuse.parallel.fsdp.NamedMesh`): each fusion (the embedding, every block, the
head) a :class:`~meshfuse.autodiff.fsdp_module.FullyShardedModule` whose one layer is its
parameters, composed with HSDP (``replicate``), context parallelism (``cp``: the sequence
split, ring attention) and tensor + sequence parallelism (``tp``).

20 AdamW steps with gradient clipping, every step's loss within 1e-5 relative of the
plain-PyTorch twin on one device, at: dp=2; dp=3 (uneven: 98 vocabulary rows, 16 key/value
rows, 3 sequences); dp=4, replicate=2 x dp=2 and dp=2 x tp=2 (one test, 4 ranks); dp=2 x
cp=2 x tp=2 (8 ranks, ``--world-sizes 8``). Each rank's parameter + gradient + AdamW bytes
are within 1/dp of the replicated model's plus the padding of uneven shards, and the
gathered parameters alive at once at most two layers'. One step's communications, on each
dimension's groups: per fusion one allgather forward and one backward and one
reduce-scatter over dp (HSDP: one allreduce across replicas), the loss's allreduces."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from meshfuse.examples.llama import (
    LlamaConfig,
    LlamaModel,
    block_parameter_shapes,
    init_parameters,
)
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.examples.train_llama import device_mesh, synthetic_batch, train
from meshfuse.parallel.fsdp import GATHERED
from meshfuse.runtime.comm.collectives import record_communications

CFG = LlamaConfig(vocab=98, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=8,
                  rope_theta=500000.0)
STEPS, MAX_NORM = 20, 0.5
MESHES = {2: ["dp=2"], 3: ["dp=3"], 4: ["dp=4", "replicate=2,dp=2", "dp=2,tp=2"],
          8: ["dp=2,cp=2,tp=2"]}


def _sizes(spec: str) -> dict[str, int]:
    sizes = {"replicate": 1, "dp": 1, "cp": 1, "tp": 1}
    sizes.update({k: int(v) for k, v in (p.split("=") for p in spec.split(","))})
    return sizes


def _batch(sizes: dict[str, int]) -> int:
    copies = sizes["dp"] * sizes["replicate"]
    return 2 * copies if sizes["dp"] != 3 else 3


def _layers() -> list[list[tuple[int, ...]]]:
    """The shapes of each fusion's parameters (a layer: one gather, one reduce-scatter)."""
    return [[(CFG.vocab, CFG.hidden)], *[list(block_parameter_shapes(CFG).values())] *
            CFG.layers, [(CFG.hidden,), (CFG.vocab, CFG.hidden)]]


def _padded(layer, d: int) -> int:
    """A layer's gathered bytes, each parameter's rows padded to d equal shards."""
    return sum(math.ceil(s[0] / d) * d * math.prod(s[1:]) * 4 for s in layer)


def _check_memory(account: dict[str, int], sizes: dict[str, int]) -> None:
    """Parameters, gradients and AdamW's two moments: this rank's shards, within 1/dp of
    the replicated model's bytes plus the padding of one bucket (the largest layer's)."""
    d = sizes["dp"]
    state = account["parameters"] + account["gradients"] + account["optimizer_state"]
    whole = sum(t.numel() * 4 for t in init_parameters(CFG).values())
    pad = max(_padded(layer, d) - sum(math.prod(s) * 4 for s in layer) for layer in _layers())
    # tp splits the parameters further (those it splits: at most 1/dp of the rest)
    assert account["gradients"] == account["parameters"]
    assert account["optimizer_state"] == 2 * account["parameters"]
    assert state <= 4 * (whole / d + pad), (state, whole, pad)
    if sizes["tp"] == sizes["cp"] == 1:  # every element held once per replica
        total = torch.tensor(state)
        dist.all_reduce(total)
        assert total.item() == 4 * whole * sizes["replicate"]


@pytest.mark.mpi
def test_llama_fsdp_trains_like_one_device(multidevice_test):
    """Every mesh of this world size, one after the other."""
    if multidevice_test.size not in MESHES:
        pytest.skip("no mesh of this world size")
    for spec in MESHES[multidevice_test.size]:
        sizes = _sizes(spec)
        losses, reference, account = train(CFG, steps=STEPS, batch=_batch(sizes),
                                           mesh=sizes, max_norm=MAX_NORM)
        _check_memory(account, sizes)
        if multidevice_test.rank == 0:
            for i, (mine, theirs) in enumerate(zip(losses, reference, strict=True)):
                assert abs(mine - theirs) <= 1e-5 * abs(theirs), (spec, i, mine, theirs)
            assert reference[-1] < reference[0]  # it trains


def _check_one_ahead(forward, backward, starts: list[int], dp: int) -> None:
    """Fusion k + 1's gather (the dp allgathers in order) is launched while fusion k runs
    (after its start, before fusion k + 1's); in the backward, fusion k - 1's regather
    before fusion k's reduce-scatter (which ends fusion k's backward)."""
    gathers = [i for i, c in enumerate(forward) if c.kind == "allgather" and c.mesh_axis == dp]
    assert len(gathers) == len(starts), (gathers, starts)
    assert starts[0] <= gathers[0] < gathers[1] < starts[1]
    for k in range(1, len(starts) - 1):
        assert starts[k] <= gathers[k + 1] < starts[k + 1], (k, gathers, starts)
    kinds = [c.kind for c in backward if c.mesh_axis == dp]
    regathers = [i for i, k in enumerate(kinds) if k == "allgather"]
    reductions = [i for i, k in enumerate(kinds) if k == "reduce_scatter"]
    for k in range(len(reductions) - 1):  # the last fusion first
        assert regathers[k + 1] < reductions[k], kinds


def _on(log, mesh, name: str) -> list[str]:
    if name not in getattr(mesh, "names", ()):
        return []
    return sorted(c.kind for c in log if c.mesh_axis == mesh.axis(name))


@pytest.mark.mpi
def test_llama_fsdp_communicates_per_fusion(multidevice_test):
    """One step on each mesh: per fusion (embedding, 2 blocks, head), over dp one allgather
    of its parameters forward, one again backward, one reduce-scatter of their gradients
    (HSDP: and one allreduce of the shards across replicas); the loss's two allreduces (the
    mean cross entropy: the sum over the tokens and their count, which ignore_index makes
    data dependent); nothing else on dp. Each fusion's gather is launched one fusion ahead:
    in the forward after the fusion before it started and before it starts itself; in the
    backward before the reduce-scatter that ends the backward of the fusion after it. The
    gathered parameters alive at once: at most two layers'. The loss that of the model on
    one device."""
    d = multidevice_test.size
    if d == 1 or d not in MESHES:
        pytest.skip("nothing is sharded on one rank")
    fusions = CFG.layers + 2
    for spec in MESHES[d]:
        sizes = _sizes(spec)
        mesh = device_mesh(sizes, d)
        model = LlamaModel(CFG, _batch(sizes), init_parameters(CFG), mesh)
        ids, targets = synthetic_batch(CFG, _batch(sizes), 0)
        model(ids, targets).backward()  # builds the programs whose gathers are prefetched
        GATHERED.reset_peak()
        start = GATHERED.live
        starts: list[int] = []
        modules = [model.embed, *model.blocks, model.head]
        with record_communications() as log:
            hooks = [m.register_forward_pre_hook(
                lambda *_, s=starts, log=log: s.append(len(log))) for m in modules]
            loss = model(ids, targets)
            forward = list(log)
            loss.backward()
        for h in hooks:
            h.remove()
        backward = log[len(forward):]
        _check_one_ahead(forward, backward, starts, mesh.axis("dp"))
        assert GATHERED.live == start  # every gathered parameter freed
        largest = max(_padded(layer, sizes["dp"]) for layer in _layers())
        assert largest // sizes["dp"] < GATHERED.peak - start <= 2 * largest, spec
        # the loss's reshape of the logits merges the batch (split over dp, and replicate:
        # HSDP) with the sequence and keeps the split: the logits are never gathered, the
        # loss's two sums are allreduced over each of them
        assert _on(forward, mesh, "dp") == sorted(["allgather"] * fusions + ["allreduce"] * 2), \
            (spec, _on(forward, mesh, "dp"))
        kinds = _on(backward, mesh, "dp")
        assert kinds.count("reduce_scatter") == kinds.count("allgather") == fusions, \
            (spec, kinds)
        if sizes["replicate"] > 1:  # the loss's sums; one allreduce per fusion backward
            assert _on(forward, mesh, "replicate") == ["allreduce"] * 2, _on(forward, mesh,
                                                                             "replicate")
            assert _on(backward, mesh, "replicate") == ["allreduce"] * fusions, \
                _on(backward, mesh, "replicate")
        if sizes["cp"] > 1:  # each block's attention: a ring of k/v blocks over cp
            ring = _on(forward, mesh, "cp")
            assert ring.count("send") == ring.count("recv") >= 2 * CFG.layers, ring
        ref = LlamaTorch(CFG)
        ref.load_state_dict(init_parameters(CFG))
        torch.testing.assert_close(loss, ref(ids, targets), rtol=1e-5, atol=1e-6)
