"""Checkpoints (meshfuse.checkpoint) on CPU ranks: a stack of MLP blocks
(tests/checkpoint_layouts.py) trained 5 AdamW steps under one layout, saved, and resumed
under every layout the world size allows (one device, tensor parallel blocks or cyclic, FSDP
with uneven shards, FSDP x TP 2x2): the next 5 steps' losses equal the uninterrupted run
bitwise under the same layout, the next 3 within 1e-6 relative under each other one. The
bytes each rank writes and reads are those of the shards it holds (replicas written once,
read once per host); bad checkpoints raise CheckpointError on every rank with the model and
optimizer unchanged; partial loads. Moving a checkpoint between world sizes:
tests/test_checkpoint_sizes.py; into torchtitan-style DTensor modules and back:
tests/test_checkpoint_interop.py; random layouts: tests/test_fuzz_checkpoint.py."""

from __future__ import annotations

import collections
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from checkpoint_layouts import FFN, LR, B, E, build
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DeviceMesh, checkpoint
from meshfuse.checkpoint.chunks import chunks_of
from meshfuse.errors import CheckpointError
from meshfuse.examples.llama import LlamaConfig, LlamaModel
from meshfuse.examples.llama import init_parameters as llama_parameters
from meshfuse.examples.train_fsdp import parse_args as fsdp_args
from meshfuse.examples.train_fsdp import train as train_fsdp
from meshfuse.runtime.comm.collectives import record_communications

# Tests that need no more than one or two world sizes to prove their point skip the others
# (Hugging Face: an uneven tensor parallel split); tests/test_checkpoint_sizes.py moves checkpoints between world sizes.
FIRST = {1: "one", 2: "tp", 3: "fsdp", 4: "dp2tp2"}  # the layout each world trains first


def _layouts(world: int) -> list[str]:
    kinds = ["one", "fsdp"] + (["tp", "cyclic"] if world > 1 else [])
    return kinds + (["dp2tp2"] if world == 4 else [])


def _shared_dir(test) -> str:
    """A fresh directory, the same on every rank."""
    path = tempfile.mkdtemp(prefix="meshfuse-ckpt-") if test.rank == 0 else None
    return test.communicator.allgather_object(path)[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@pytest.mark.mpi
def test_resume_under_every_layout(multidevice_test):
    world = multidevice_test.size
    model, opt, step = build(FIRST[world], world)
    for i in range(5):
        step(i)
    path = _shared_dir(multidevice_test)
    with record_communications() as log:
        checkpoint.save(path, model, opt, extra={"step": 5, "data": {"position": 5}})
    assert not list(log)  # nothing gathered: each rank writes its own shards
    drawn = torch.rand(4)  # what torch's generator gives next (dropout seeds come from it)
    uninterrupted = [step(i) for i in range(5, 10)]
    for kind in _layouts(world):
        other, other_opt, other_step = build(kind, world)
        with torch.no_grad():
            for p in other.parameters():
                p.fill_(0.5)  # not the saved values
        result = checkpoint.load(path, other, other_opt)
        assert result.extra == {"step": 5, "data": {"position": 5}}
        assert torch.equal(torch.rand(4), drawn)  # the random state is the saved one
        if kind == FIRST[world]:
            resumed = [other_step(i) for i in range(5, 10)]
            assert resumed == uninterrupted, kind  # bitwise
        else:  # 3 steps under each other layout, to keep the test short
            resumed = [other_step(i) for i in range(5, 8)]
            torch.testing.assert_close(resumed, uninterrupted[:3], rtol=1e-6, atol=0,
                                       msg=kind)


def _held(model, opt) -> int:
    """The tensor bytes of this rank's shards of the model and the optimizer."""
    state = checkpoint.state_dict(model, opt)
    return sum(v.nbytes for v in state.values() if isinstance(v, checkpoint.ShardedValue))


def _exclusive(test, model, opt) -> int:
    """The tensor bytes of the boxes only this rank holds (no other rank has a replica)."""
    state = checkpoint.state_dict(model, opt)
    mine = {(name, c.offsets, c.sizes): math.prod(c.sizes) * v.local.element_size()
            for name, v in state.items() if isinstance(v, checkpoint.ShardedValue)
            for c in v.chunks}
    held = collections.Counter(box for boxes in test.communicator.allgather_object(list(mine))
                               for box in boxes)
    return sum(size for box, size in mine.items() if held[box] == 1)


def _global_bytes(model, opt) -> int:
    state = checkpoint.state_dict(model, opt)
    return sum(int(torch.Size(v.shape).numel()) * v.local.element_size()
               for v in state.values() if isinstance(v, checkpoint.ShardedValue))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_bytes_written_and_read_are_the_shards_held(multidevice_test, kind):
    world = multidevice_test.size
    if kind == "tp" and world == 1:
        pytest.skip("tensor parallel needs 2 ranks")
    model, opt, step = build(kind, world)
    step(0)
    path = _shared_dir(multidevice_test)
    written = checkpoint.save(path, model, opt).bytes_written
    everyone = multidevice_test.communicator.allgather_object(written)
    assert sum(everyone) == _global_bytes(model, opt)  # every element once, replicas too
    held, own = _held(model, opt), _exclusive(multidevice_test, model, opt)
    assert own <= written <= held  # its own boxes, and of the replicas some (DCP balances)
    if kind == "fsdp":  # all sharded but AdamW's scalar steps (4 bytes each, written once)
        assert held - own == 4 * len(list(model.parameters())) * (world > 1)
    read = checkpoint.load(path, model, opt)
    assert read.bytes_read == read.bytes_needed  # the same boxes: nothing read in vain
    assert own <= read.bytes_read <= held  # whole tensors: one rank of the host reads each
    reads = multidevice_test.communicator.allgather_object(read.bytes_read)
    assert sum(reads) == sum(everyone)  # each element once (replicas once: one host here)
    first, second = _shared_dir(multidevice_test), _shared_dir(multidevice_test)
    pending = checkpoint.async_save(first, model, opt)
    with torch.no_grad():  # training goes on: the save holds host copies
        for p in model.parameters():
            p.add_(1.0)
    again = checkpoint.async_save(second, model, opt, previous=pending)
    assert again.buffers is pending.buffers and again.result().bytes_written == written
    params = [p.detach().clone() for p in model.parameters()]
    checkpoint.load(first, model, opt)  # the values before the additions
    for p, later in zip(model.parameters(), params):
        assert torch.equal(p + 1.0, later)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])


def _unchanged(model, opt, snapshot) -> None:
    params, states = snapshot
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    for p, state in zip(model.parameters(), states):
        assert opt.state[p].keys() == state.keys()
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def _refused(path: str, model, opt, message: str, **options) -> None:
    """``load`` raises a CheckpointError matching ``message`` (on this rank: every rank
    runs it) and leaves ``model`` and ``opt`` as they were."""
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path, model, opt, **options)
    _unchanged(model, opt, before)


def _on_rank0(change) -> None:
    """``change()`` on rank 0 only (a file every rank reads), between barriers."""
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        change()
    _barrier()


def _trained(kind: str, world: int, **sizes):
    model, opt, step = build(kind, world, **sizes)
    step(0)
    return model, opt


@pytest.mark.mpi
def test_bad_checkpoints_raise_on_every_rank_and_change_nothing(multidevice_test):
    world = multidevice_test.size
    kind = "tp" if world > 1 else "one"
    model, opt, step = build(kind, world)
    step(0)
    path, weights = _shared_dir(multidevice_test), _shared_dir(multidevice_test)
    checkpoint.save(path, model, opt)
    checkpoint.save(weights, model)  # no optimizer
    target, target_opt = _trained(kind, world)
    cases = [
        (_trained(kind, world, layers=1), "holds 6 tensors the model lacks \\(1_b1"),
        (_trained(kind, world, layers=3), "lacks 6 of the model's tensors \\(2_b1"),
        (_trained(kind, world, embed=E + 1),
         "0_ln_w has global shape \\[5\\] in checkpoint .* but \\[6\\]"),
        (_trained(kind, world, dtype=torch.float64),
         "0_ln_w is torch.float32 in checkpoint .* but torch.float64"),
    ]
    for (m, o), message in cases:
        _refused(path, m, o, message)
    _refused(weights, target, target_opt, "holds no optimizer state")
    _refused(os.path.join(path, "nowhere"), target, target_opt, "no checkpoint at")
    data = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "rb") as f:
        original = f.read()

    def overwrite(content: bytes):
        def change():
            with open(data, "wb") as f:
                f.write(content)
        return change
    # the first item's bytes garbled: only DCP's read (torch.load of the item) finds it
    _on_rank0(overwrite(b"\0" * 64 + original[64:]))
    _refused(path, target, target_opt, "reading checkpoint .* failed .* truncated or corrupt")
    _on_rank0(overwrite(original[:size // 2]))  # a save cut short: found from the metadata
    _refused(path, target, target_opt, "is truncated: __0_0.distcp has \\d+ bytes but .* ends")
    _on_rank0(lambda: os.remove(data))
    _refused(path, target, target_opt, "lacks its data file __0_0.distcp")
    _on_rank0(overwrite(original))
    checkpoint.load(path, target, target_opt)  # whole again: it loads
    _on_rank0(lambda: os.truncate(os.path.join(path, ".metadata"), 40))
    _refused(path, target, target_opt, "metadata of checkpoint .* cannot be read")


def _by_name(model, opt) -> dict[str, tuple]:
    return {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for n, p in model.named_parameters()}


def _holds(model, opt, values: dict[str, tuple], names=None) -> None:
    """``model``'s parameters named ``names`` (default: all of ``values``) and their
    optimizer state are ``values``'."""
    params = dict(model.named_parameters())
    for name in values if names is None else names:
        p, (value, state) = params[name], values[name]
        assert torch.equal(p, value), name
        assert opt.state[p].keys() == state.keys(), name
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items()), name


@pytest.mark.mpi
def test_partial_loads(multidevice_test):
    """The weights without the optimizer, a subset of the tensors (``only``), a model with
    tensors the checkpoint lacks (``allow_partial``) or without some it holds
    (``strict=False``): what is loaded equals the saved values, the rest keeps its own."""
    world = multidevice_test.size
    kind = "tp" if world > 1 else "one"
    model, opt = _trained(kind, world)
    path, weights = _shared_dir(multidevice_test), _shared_dir(multidevice_test)
    checkpoint.save(path, model, opt)
    checkpoint.save(weights, model)
    saved = _by_name(model, opt)

    def fresh(layers: int = 2):
        m, o, s = build(kind, world, layers=layers)
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(0.5)
        s(1)  # an optimizer state of its own
        return m, o, _by_name(m, o)

    def mixed(loaded: dict, own: dict) -> dict:  # the loaded weights, the own optimizer
        return {n: (loaded[n][0], own[n][1]) for n in loaded}

    m, o, own = fresh()
    checkpoint.load(weights, m)  # the weights only: the optimizer untouched
    _holds(m, o, mixed(saved, own))
    m, o, own = fresh()
    checkpoint.load(weights, m, o, allow_partial=True)
    _holds(m, o, mixed(saved, own))
    m, o, own = fresh()
    only = ["1_w1", "0_ln_b"]
    checkpoint.load(path, m, o, only=only)
    _holds(m, o, saved, only)
    _holds(m, o, own, [n for n in own if n not in only])
    _refused(path, m, o, "only= names 9_w1, which the model lacks", only=["9_w1"])
    deeper, deeper_opt, own = fresh(layers=3)
    _refused(path, deeper, deeper_opt, "lacks 6 of the model's tensors")
    checkpoint.load(path, deeper, deeper_opt, allow_partial=True)
    _holds(deeper, deeper_opt, saved)  # layers 0 and 1
    _holds(deeper, deeper_opt, own, [n for n in own if n.startswith("2_")])
    shallow, shallow_opt, _ = fresh(layers=1)
    checkpoint.load(path, shallow, shallow_opt, strict=False)  # the saved layer 1 left out
    _holds(shallow, shallow_opt, saved, [n for n in saved if n.startswith("0_")])


@pytest.mark.mpi
def test_hugging_face_export_and_import(multidevice_test):
    """The Llama example (tensor parallel over every rank) exported as safetensors with
    ``LlamaForCausalLM``'s names loads into transformers' model; imported into a model of
    other values, every shard is the export's. At 3 ranks only: its tensor parallel split
    (6 query heads, 2 key/value heads over 3 ranks) is the least regular one."""
    world = multidevice_test.size
    if world != 3:
        pytest.skip("3 ranks prove it (the export gathers whatever split the model has)")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file  # installed with transformers

    cfg = LlamaConfig(vocab=98, hidden=48, heads=6, kv_heads=2, ffn=96, seq=12)
    params = llama_parameters(cfg, seed=1)
    mesh = DeviceMesh(range(world))
    model = LlamaModel(cfg, 2, params, mesh)
    path = _shared_dir(multidevice_test)
    checkpoint.export_hf(path, model)
    exported = load_file(os.path.join(path, "model.safetensors"))
    assert exported.keys() == params.keys()
    assert all(torch.equal(exported[n], params[n]) for n in params)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, tie_word_embeddings=False))
    hf.load_state_dict(exported, strict=True)
    fresh = LlamaModel(cfg, 2, llama_parameters(cfg, seed=2), mesh)
    checkpoint.import_hf(path, fresh)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(CheckpointError, match="lacks 2 of the model's tensors"):
        _barrier()
        if multidevice_test.rank == 0:
            save_file({n: v for n, v in exported.items() if "layers.1.mlp.up" not in n
                       and "layers.0.mlp.up" not in n},
                      os.path.join(path, "model.safetensors"))
        _barrier()
        checkpoint.import_hf(path, fresh)


class _TorchMlp(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(E, FFN)
        self.down = torch.nn.Linear(FFN, E)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))).pow(2).mean()


@pytest.mark.mpi
def test_a_parallelized_pytorch_module_resumes_and_exports(multidevice_test):
    """``meshfuse.parallelize``'s DTensor parameters and AdamW's DTensor moments: saved,
    loaded into the module built from other values, the next step's loss bitwise equal;
    exported with the module's own names. At 2 ranks (even DTensor shards) and 3 (uneven)."""
    from safetensors.torch import load_file  # installed with transformers

    world = multidevice_test.size
    if world not in (2, 3):
        pytest.skip("an even (2 ranks) and an uneven (3 ranks) split prove it")
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    x = torch.randn(B, E, generator=torch.Generator().manual_seed(3))

    def build(seed: int):
        model = meshfuse.parallelize(_TorchMlp(seed), DeviceMesh(range(world)), plan)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def step(model, opt) -> float:
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        return loss.item()

    model, opt = build(0)
    step(model, opt)
    path = _shared_dir(multidevice_test)
    checkpoint.save(path, model, opt)
    checkpoint.export_hf(path, model)
    saved = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    expected = step(model, opt)
    other, other_opt = build(1)
    checkpoint.load(path, other, other_opt)
    assert step(other, other_opt) == expected
    exported = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(exported) == sorted(saved)  # the module's names: up.weight, down.bias...
    assert all(torch.equal(exported[n], saved[n]) for n in saved)


def test_a_shard_is_cut_into_the_boxes_of_its_index_runs():
    """Block: one box; cyclic: a box per run; several axes: the product; none: no box."""
    block = chunks_of((6, 4), [torch.arange(2, 4), None])
    assert [(c.offsets, c.sizes, c.start) for c in block] == [((2, 0), (2, 4), (0, 0))]
    cyclic = chunks_of((8, 3), [torch.tensor([1, 2, 5, 6]),
                                                   torch.tensor([0, 2])])
    assert [(c.offsets, c.sizes, c.start) for c in cyclic] == [
        ((1, 0), (2, 1), (0, 0)), ((1, 2), (2, 1), (0, 1)),
        ((5, 0), (2, 1), (2, 0)), ((5, 2), (2, 1), (2, 1))]
    assert chunks_of((4,), None) == ()
    local = torch.arange(8.0).reshape(4, 2)
    value = checkpoint.ShardedValue(local, (8, 3), cyclic)
    assert torch.equal(value.piece((5, 2)), local[2:4, 1:2])
    assert value.nbytes == 8 * 4


@pytest.mark.mpi
def test_the_fsdp_script_resumes_on_another_mesh(multidevice_test):
    """``train_fsdp --save`` on one mesh, ``--resume`` on another of the same ranks: the
    resumed steps are within the script's 1e-5 of PyTorch trained without a break (the
    reference replays the saved steps). In the ranks of one test run: dp2 x tp2 to dp4 at
    4 ranks; tests/test_checkpoint_sizes.py runs the script across world sizes."""
    world = multidevice_test.size
    if world != 4:
        pytest.skip("dp2 x tp2 to dp4 needs 4 ranks")
    path = _shared_dir(multidevice_test)
    first, then = "dp=2,tp=2", "dp=4"
    common = ["--layers", "1", "--embed", "16", "--seq", "8", "--batch", "3"]
    saved = train_fsdp(fsdp_args(["--mesh", first, "--steps", "2", "--save", path, *common],
                                 world))
    resumed = train_fsdp(fsdp_args(["--mesh", then, "--steps", "4", "--resume", path,
                                    *common], world))
    # Without the saved state, step 2 would start from the initial weights while the
    # reference has trained 2 steps: far outside 1e-5.
    assert saved["ok"] and resumed["ok"] and len(resumed["losses"]) == 2
