"""``meshfuse.parallelize(module, mesh, plan, fsdp="dp")`` on a small random
``transformers.LlamaForCausalLM``: parameters DTensors sharded on their first axis over dp
(and as the plan says over tp), the inputs' batch split over dp; logits, loss and every
gradient equal the unsharded module's, AdamW steps follow its losses, and the parameters'
gathers (and, on a 1-D mesh, the gradients' reduce-scatters) run on the dp groups. At 2
ranks FSDP alone, 3 (uneven shards), and 4 as dp=2 x tp=2 with the model's own tp plan:
there a parameter the plan splits on its first axis over tp holds a block of rows of its tp
shard (FSDP2's ``_StridedShard(0, split_factor=2)`` over dp), so its gather is an allgather
over dp and its gradient a reduce-scatter over dp, as every other parameter's."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.dtensor import mesh_to_torch
from meshfuse.errors import ScheduleError
from meshfuse.runtime.comm.collectives import record_communications

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, SEQ = 128, 32, 8
MESHES = {2: ["dp=2"], 3: ["dp=3"], 4: ["dp=2,tp=2"]}
ALL = [m for ms in MESHES.values() for m in ms]


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False)
    return transformers.LlamaForCausalLM(config)


def _parallel(spec: str, world: int):
    sizes = {k: int(v) for k, v in (p.split("=") for p in spec.split(","))}
    mesh = mesh_to_torch(DeviceMesh(torch.arange(world).reshape(tuple(sizes.values()))),
                         mesh_dim_names=tuple(sizes))
    reference = _llama()
    plan = reference.tp_plan if "tp" in sizes else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, plan, fsdp="dp")
    return reference, model, sizes


def _inputs(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=g),
            torch.randint(0, VOCAB, (batch, SEQ), generator=g))


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ALL)
def test_fsdp_of_a_transformers_llama(multidevice_test, spec):
    d = multidevice_test.size
    if spec not in MESHES.get(d, []):
        pytest.skip(f"{spec} runs at another world size")
    reference, model, sizes = _parallel(spec, d)
    dp = list(sizes).index("dp")
    for name, p in model.named_parameters():  # FSDP2's layout: Shard(0) over dp
        assert isinstance(p, DTensor) and isinstance(p.placements[dp], Shard | _StridedShard)
        assert p.placements[dp].dim == 0, name
        rows = math.ceil(p.shape[0] / math.prod(sizes.values()))
        if p.placements[-1] != Shard(0):
            rows = math.ceil(p.shape[0] / sizes["dp"])
        assert p.to_local().shape[0] <= rows, name
        strided = isinstance(p.placements[dp], _StridedShard)
        assert strided == ("tp" in sizes and p.placements[-1] == Shard(0)), name
    batch = 2 * sizes["dp"] if sizes["dp"] != 3 else 3
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(3):
        ids, labels = _inputs(batch, step)
        with record_communications() as log, warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphBreakWarning)
            out = model(input_ids=ids, labels=labels)
            loss = _whole(out.loss)
            loss.backward()
        expected = reference(input_ids=ids, labels=labels)
        expected.loss.backward()
        torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
        if step == 0:
            torch.testing.assert_close(_whole(out.logits), expected.logits, rtol=1e-5,
                                       atol=1e-5)
            for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                assert p.grad.placements == p.placements, name
                torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-4,
                                           atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            on_dp = [c.kind for c in log if c.mesh_axis == dp]
            params = len(list(model.parameters()))
            # every parameter gathered over dp before use (forward, and again in the
            # backward), one collective each (captured fusions are not bucketed by layer)
            assert on_dp.count("allgather") >= params
            # every gradient reduce-scattered back over dp by meshfuse, one collective each
            # (at dp x tp too: a tp-sharded parameter's over dp within its tp shard)
            assert on_dp.count("reduce_scatter") == params
            assert on_dp.count("allgather") + on_dp.count("reduce_scatter") + \
                on_dp.count("allreduce") == len(on_dp)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


@pytest.mark.mpi
@pytest.mark.parametrize("remat", [None, "recompute", "recompute_fused", "recompute_gathers"])
def test_fsdp_gathers_again_in_the_backward_only_with_recompute_gathers(multidevice_test,
                                                                        remat):
    """``parallelize(..., fsdp="dp", remat=...)``: ``recompute_gathers``, the default with
    ``fsdp``, frees each gathered parameter after the forward and gathers every one again
    in the backward (FSDP2's ``reshard_after_forward=True``); ``recompute`` and
    ``recompute_fused`` keep them for the backward (no collective runs twice; a gathered
    norm weight, read by pointwise ops only, too). The gradients are the module's either
    way."""
    if multidevice_test.size != 2:
        pytest.skip("at 2 ranks")
    mesh = mesh_to_torch(DeviceMesh(range(2)), mesh_dim_names=("dp",))
    reference = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, {}, fsdp="dp",
                                     remat=remat)
        ids, labels = _inputs(4, 0)
        with record_communications() as forward:
            out = model(input_ids=ids, labels=labels)
        with record_communications() as backward:
            _whole(out.loss).backward()
    reference(input_ids=ids, labels=labels).loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    params = len(list(model.parameters()))
    gathered = [c.kind for c in forward].count("allgather")
    again = [c.kind for c in backward].count("allgather")
    assert gathered == params
    assert again == (params if remat in (None, "recompute_gathers") else 0), (remat, again)
    assert [c.kind for c in backward].count("reduce_scatter") == params


@pytest.mark.mpi
def test_fsdp_dimension_errors(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("the errors at 2 ranks")
    mesh = mesh_to_torch(DeviceMesh(range(2)), mesh_dim_names=("tp",))
    with pytest.raises(ScheduleError, match="no such dimension"):
        meshfuse.parallelize(_llama(), mesh, {}, fsdp="dp")
    mesh = mesh_to_torch(DeviceMesh(range(2)), mesh_dim_names=("dp",))
    with pytest.raises(ScheduleError, match="last dimension"):
        meshfuse.parallelize(_llama(), mesh, {"lm_head": "colwise_rep"}, fsdp="dp")
