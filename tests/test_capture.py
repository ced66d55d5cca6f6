"""Capture on small modules written here: graph breaks (values, gradients, the warning, the
strict error, where they run), the op table's checks, plans, and ``explain()``."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from capture_checks import check_gradients
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DefinitionError, DeviceMesh
from meshfuse.capture.partition import Break, Segment, fold, partition, simplify, static_nodes
from meshfuse.capture.plan import ModelOutline, resolve_plan
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.trace import capture
from meshfuse.dtensor import mesh_to_torch
from meshfuse.errors import GraphBreakError
from meshfuse.runtime.comm.collectives import record_communications

E, HIDDEN = 8, 10  # HIDDEN shards unevenly over 3 and 4 ranks


class Odd(torch.nn.Module):
    """An op meshfuse has no rule for (a running sum over the features)."""

    def forward(self, h):
        return torch.cumsum(h, -1) / h.shape[-1]


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.odd = Odd()
        self.down = torch.nn.Linear(HIDDEN, E)

    def forward(self, x):
        return x + self.down(self.odd(F.gelu(self.up(x))))


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(), x


PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}


def _toy():
    torch.manual_seed(0)
    return Toy()


# ----- graph breaks, on ranks --------------------------------------------------------------

@pytest.mark.mpi
def test_a_graph_break_runs_the_pytorch_op_with_the_right_values(multidevice_test):
    reference = _toy()
    mesh = DeviceMesh(range(multidevice_test.size))
    model = meshfuse.parallelize(copy.deepcopy(reference), mesh, PLAN)
    x = torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, y = model(x)
    messages = [str(w.message) for w in caught if w.category is GraphBreakWarning]
    assert len(messages) == 1  # listed once, each op with its module path
    assert "aten.cumsum.default in layers.0.odd" in messages[0]
    assert "aten.cumsum.default in layers.1.odd" in messages[0]
    expected_loss, expected_y = reference(x)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected_loss.backward()
    check_gradients(model, reference)


@pytest.mark.mpi
def test_strict_raises_one_error_naming_every_op_and_module(multidevice_test):
    mesh = DeviceMesh(range(multidevice_test.size))
    model = meshfuse.parallelize(_toy(), mesh, PLAN, strict=True)
    with pytest.raises(GraphBreakError) as error:
        model(torch.randn(4, E))
    assert "aten.cumsum.default in layers.0.odd" in str(error.value)
    assert "aten.cumsum.default in layers.1.odd" in str(error.value)


@pytest.mark.mpi
def test_without_breaks_the_module_is_one_fusion_and_explains_itself(multidevice_test):
    """No break: one fusion per layer (the second layer's program is the first's: built
    once), then the loss; the communications are Megatron's (one allreduce per layer
    forward, one per layer backward for the input gradient); ``explain()`` lists the
    parameters' placements and the fusions."""

    class Plain(Toy):
        def __init__(self):
            super().__init__()
            for layer in self.layers:
                layer.odd = torch.nn.Identity()

    torch.manual_seed(0)
    reference = Plain()
    mesh = DeviceMesh(range(multidevice_test.size))
    model = meshfuse.parallelize(copy.deepcopy(reference), mesh, PLAN,
                                 example_inputs=(torch.randn(4, E),))
    x = torch.randn(4, E, requires_grad=True)
    with record_communications() as forward:
        loss, _ = model(x)
    with record_communications() as backward:
        loss.backward()
    expected, _ = reference(x.detach())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    crossing = [c.kind for c in forward if len(c.ranks) > 1]
    assert crossing == (["allreduce"] * 2 if multidevice_test.size > 1 else [])
    crossing = [c.kind for c in backward if len(c.ranks) > 1]
    # Backward: each column-parallel input's gradient is partial: one allreduce per layer.
    assert crossing == (["allreduce"] * 2 if multidevice_test.size > 1 else [])
    text = model.explain()
    assert "3 fusion(s), 0 graph break(s)" in text
    assert "layers.0.up.weight [10, 8] [Shard(dim=0)]" in text
    assert "layers.1.down.weight [8, 10] [Shard(dim=1)]" in text
    assert "fusion 0: 4 ops over layers.0" in text and "fusion 1: 4 ops over layers.1" in text
    # Layer 0 reads the module's input, layer 1 layer 0's output: they lie alike (replicated)
    # here, so layer 1 runs layer 0's program.
    assert "the program of fusion 0 (an identical block, built once)" in text


def _check_against(model, reference, x) -> None:
    """``model``'s loss and every parameter's gradient are ``reference``'s on ``x``."""
    loss = model(x)
    expected = reference(x)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    check_gradients(model, reference)


class Masked(torch.nn.Module):
    """A break (``cumsum``) on a sharded value whose result only masks: no gradient comes
    back through it (a router's threshold, as in PhiMoE's)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, E)

    def forward(self, x):
        h = self.up(x)
        keep = torch.cumsum(h, -1) > 0
        return self.down(h * keep).sum()


@pytest.mark.mpi
def test_a_break_no_gradient_comes_back_through_passes_none_on(multidevice_test):
    torch.manual_seed(0)
    reference = Masked()
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        _check_against(model, reference, torch.randn(4, E))


class Gated(torch.nn.Module):
    """Axes of extent 1 that a computation made, which PyTorch broadcasts: a gate ``linear``
    to one feature times a value (Qwen2-MoE's shared expert), and padding wider than one
    (Qwen3-Next's convolution pads its sequence)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(E, 1, bias=False)
        self.up = torch.nn.Linear(E, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN + 5, E)

    def forward(self, x):
        h = torch.sigmoid(self.gate(x)) * self.up(x)
        h = F.pad(h, (2, 3), value=0.5)
        edge = x[:, :1].expand(-1, E)  # a one-wide slice expanded
        return (self.down(h) * edge).sum()


@pytest.mark.mpi
def test_computed_axes_of_extent_one_broadcast_as_in_pytorch(multidevice_test):
    torch.manual_seed(0)
    reference = Gated()
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {"up": ColwiseParallel(output_layouts=Replicate())})
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        _check_against(model, reference, torch.randn(4, E))


class SoftStacked(torch.nn.Module):
    """``softplus`` (PyTorch's default, and ``beta`` 2 with threshold 3: past it the input
    itself, where ``exp`` of a large input would overflow) and ``stack``, of column-parallel
    projections (Qwen3.5's gated delta-net computes its decay with ``softplus``; models
    ``stack`` their heads' or experts' outputs)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(E, HIDDEN)
        self.b = torch.nn.Linear(E, HIDDEN)
        self.scale = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        # an input that reaches the threshold exactly (1.5 * 2), and beta x far past it
        edge = torch.tensor([1.5, 100.0, -100.0, 0.0, 3.0] * 2)[:HIDDEN] * self.scale
        parts = [F.softplus(self.a(x), beta=2.0, threshold=3.0), F.softplus(self.b(x)),
                 F.softplus(edge, beta=2.0, threshold=3.0).expand(x.shape[0], HIDDEN)]
        return torch.stack(parts, dim=-2).pow(2).sum()


@pytest.mark.mpi
def test_softplus_and_stack_translate_with_pytorch_values_and_gradients(multidevice_test):
    torch.manual_seed(0)
    reference = SoftStacked()
    with torch.no_grad():
        reference.a.weight.mul_(4)  # a's outputs past the threshold too
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {"a": ColwiseParallel(), "b": ColwiseParallel()})
    x = torch.randn(4, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        _check_against(model, reference, x)
    with record_communications() as comms:  # stacked where they lie: the sum's reduction
        model(x)
    assert [c.kind for c in comms] == (["allreduce"] if multidevice_test.size > 1 else [])


class Convolved(torch.nn.Module):
    """A short causal depthwise convolution over the sequence of projected channels (the
    conv1d of Mamba-style and gated delta-net layers: ``conv(x)[..., :length]``), dilated
    or not; and one that is not depthwise (``groups=1``), a graph break."""

    def __init__(self, dilation=1, depthwise=True):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.conv = torch.nn.Conv1d(HIDDEN, HIDDEN, 4, groups=HIDDEN if depthwise else 1,
                                    padding=3 * dilation, dilation=dilation)
        self.down = torch.nn.Linear(HIDDEN, E)

    def forward(self, x):
        h = self.conv(self.up(x).transpose(1, 2))[..., :x.shape[1]]
        return self.down(F.silu(h).transpose(1, 2)).pow(2).sum()


@pytest.mark.mpi
@pytest.mark.parametrize("dilation", [1, 2])
def test_a_depthwise_conv1d_runs_in_fusions_channel_parallel(multidevice_test, dilation):
    """The channels sharded by the projection before it (and the filters with them): the
    convolution's slices and products are local, the module's values and gradients."""
    torch.manual_seed(0)
    reference = Convolved(dilation)
    plan = {"up": ColwiseParallel(), "conv.weight": [Shard(0)], "conv.bias": [Shard(0)],
            "down": RowwiseParallel()}
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), plan)
    x = torch.randn(2, 7, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        _check_against(model, reference, x)
    assert model.get_parameter("conv.weight").placements == (Shard(0),)
    with record_communications() as comms:  # the filters are read where they lie
        model(x).backward()
    assert [c.kind for c in comms] == (["allreduce"] if multidevice_test.size > 1 else [])


def test_a_conv1d_mixing_channels_is_a_graph_break():
    torch.manual_seed(0)
    reference = Convolved(depthwise=False)
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(range(1)), {})
    x = torch.randn(2, 7, E)
    with pytest.warns(GraphBreakWarning, match=r"aten.conv1d.default in conv: conv1d other "
                                               r"than depthwise"):
        model(x)
    _check_against(model, reference, x)


class Counting(torch.nn.Module):
    """A forward that writes a buffer in place: how many times each feature of the hidden
    layer was positive (a MoE router's token counts, torchtitan's ``tokens_per_expert``)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, E)
        self.register_buffer("positive", torch.zeros(HIDDEN))

    def forward(self, x):
        h = F.gelu(self.up(x))
        self.positive.add_((h > 0).sum(0))  # a mutation the trace records (under no_grad:
        # an in-place op its graph break runs on the buffer itself)
        return self.down(h)


class Summed(torch.nn.Sequential):
    def forward(self, x):
        return super().forward(x).sum()


@pytest.mark.mpi
def test_a_buffer_the_forward_writes_in_place_is_written(multidevice_test):
    """Each call's new value of the buffer is written into the module's, as the module's
    own forward writes it; loss and gradients are the module's."""
    torch.manual_seed(0)
    reference = Summed(Counting())
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {"0.up": ColwiseParallel(), "0.down": RowwiseParallel()})
    for seed in range(2):
        x = torch.randn(4, E, generator=torch.Generator().manual_seed(seed))
        _check_against(model, reference, x)
        assert reference[0].positive.sum() > 0
        torch.testing.assert_close(model[0].positive, reference[0].positive)


class Normed(torch.nn.Module):
    """A batch norm between two Linears: in training its batch's statistics (and the running
    ones updated in place), in evaluation the running ones."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(E, HIDDEN, bias=False)  # (a bias's gradient: zero)
        self.norm = torch.nn.BatchNorm1d(HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, E)

    def forward(self, x):
        return self.down(torch.tanh(self.norm(self.up(x))))


@pytest.mark.mpi
@pytest.mark.parametrize("first", ["train", "eval"])
def test_train_and_eval_each_run_their_own_program(multidevice_test, first):
    """A module switched between ``train()`` and ``eval()`` runs the program of its mode
    (the trace records batch norm's and dropout's mode: the program captured in one mode
    ran in the other, silently); in training batch norm's backward runs (its graph break
    saved the running statistics, which the forward then wrote: autograd refused), and the
    running statistics are the module's after each training call."""
    torch.manual_seed(0)
    reference = Summed(Normed())
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {"0.up": ColwiseParallel(), "0.down": RowwiseParallel()})
    modes = [first, "eval" if first == "train" else "train", first]
    with record_communications() as communications:
        for seed, mode in enumerate(modes):
            for m in (model, reference):
                m.train(mode == "train")
            x = torch.randn(6, E, generator=torch.Generator().manual_seed(seed))
            if mode == "train":
                _check_against(model, reference, x)
            else:
                with torch.no_grad():
                    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
            for name in ("running_mean", "running_var"):
                torch.testing.assert_close(getattr(model[0].norm, name),
                                           getattr(reference[0].norm, name))
    if multidevice_test.size > 1:
        assert any(len(c.ranks) > 1 for c in communications)


@pytest.mark.mpi
def test_buffers_written_in_place_are_refused_by_a_pipeline(multidevice_test):
    if multidevice_test.size != 2:
        pytest.skip("two pipeline stages")
    torch.manual_seed(0)
    mesh = mesh_to_torch(DeviceMesh(range(2)), mesh_dim_names=("pp",))
    spec = meshfuse.PipelineSpec(split_points=[1], loss_fn=lambda out, target: out.sum())
    model = torch.nn.Sequential(Counting(), torch.nn.Linear(E, E))
    pipe = meshfuse.parallelize(model, mesh, {}, pipeline=spec)
    with pytest.raises(DefinitionError, match=r"modifies its buffer\(s\) \['0.positive'\] in "
                                              r"place .* which a pipeline does not carry out"):
        pipe.step(torch.randn(4, E), torch.zeros(4))


# ----- partition and the op table, one process ---------------------------------------------

def _captured(module, *args):
    captured = capture(module, args, {})
    simplify(captured.graph)
    inputs = {**{p: dict(module.named_buffers())[n] for p, n in captured.buffers.items()},
              **captured.constants}
    constants = fold(static_nodes(captured), inputs)
    return captured, constants, partition(captured.graph, constants)


def test_breaks_split_the_program_only_where_data_flows_through_them():
    """The toy: layer 0's up, then its cumsum (a break), layer 0's down with layer 1's up
    (one fusion per layer), the second cumsum, the rest (layer 1's down, then the loss)."""
    _, _, parts = _captured(_toy(), torch.randn(4, E))
    steps = [s.block if isinstance(s, Segment) else "break" for s in parts.steps]
    assert steps == ["layers.0", "break", "layers.0", "layers.1", "break", "layers.1",
                     "the top module"]


def test_a_break_reading_only_inputs_runs_before_the_first_fusion():

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # scale_grad_by_freq has no meshfuse rule: the lookup is a break.
            self.embed = torch.nn.Embedding(16, E, scale_grad_by_freq=True)
            self.proj = torch.nn.Linear(E, E)

        def forward(self, ids):
            return self.proj(self.embed(ids))

    _, _, parts = _captured(Lookup(), torch.randint(0, 16, (2, 3)))
    assert [type(s) for s in parts.steps] == [Break, Segment]
    assert parts.breaks[0].path == "embed"


class Attend(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask == "causal" else \
            torch.ones(s, s, dtype=torch.bool).triu()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask,breaks", [("causal", 0), ("other", 1)])
def test_attention_takes_a_constant_causal_mask_and_breaks_on_another(mask, breaks):
    """The mask, built from shapes only, is folded at capture; the causal one becomes
    ``is_causal=True``, another mask runs as PyTorch's attention."""
    q = torch.randn(1, 2, 4, 8)
    _, constants, parts = _captured(Attend(mask), q, q, q)
    assert len(parts.breaks) == breaks
    assert any(v.dtype is torch.bool for v in constants.values() if isinstance(v, torch.Tensor))


# ----- plans -------------------------------------------------------------------------------

OUTLINE = ModelOutline(
    {"": "Model", "embed": "Embedding", "q": "Linear", "o": "Linear", "c_attn": "Conv1D"},
    {"embed.weight": 2, "q.weight": 2, "q.bias": 1, "o.weight": 2, "o.bias": 1,
     "c_attn.weight": 2, "c_attn.bias": 1})


def test_plans_in_hugging_face_strings_dtensor_styles_and_placements():
    plan = resolve_plan(OUTLINE, {"embed": "embedding_rowwise", "q": ColwiseParallel(),
                                  "o": "rowwise", "c_attn": "colwise",
                                  "c_attn.bias": [Replicate()]}, 1)
    p = plan.parameters
    assert p["embed.weight"] == (Shard(0),)
    assert (p["q.weight"], p["q.bias"]) == ((Shard(0),), (Shard(0),))
    assert (p["o.weight"], p["o.bias"]) == ((Shard(1),), (Replicate(),))
    assert p["c_attn.weight"] == (Shard(1),)  # GPT-2's Conv1D holds [in, out]
    assert p["c_attn.bias"] == (Replicate(),)
    assert plan.modules["o"].outputs == Replicate()  # Megatron's allreduce after o
    assert plan.modules["q"].inputs is None  # replicated already: no redistribution


def test_a_plan_key_matching_nothing_or_an_unknown_style_is_a_definition_error():
    with pytest.raises(DefinitionError, match="match no module or parameter"):
        resolve_plan(OUTLINE, {"layers.*.mlp": "colwise"}, 1)
    with pytest.raises(DefinitionError, match="Hugging Face styles"):
        resolve_plan(OUTLINE, {"q": "packed_colwise"}, 1)


def test_a_single_process_parallelizes_without_initializing_torch_distributed():
    """A fresh process that never called ``init_process_group`` parallelizes a model on a
    one-device mesh (meshfuse's communicator makes the group, as a fusion's ``execute``
    does) instead of failing in torch's DeviceMesh ("Default process group has not been
    initialized"), and computes what the module computes."""
    script = (
        "import torch, meshfuse\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),"
        " torch.nn.Linear(8, 2))\n"
        "x = torch.randn(3, 4)\n"
        "expected = model(x)\n"
        "parallel = meshfuse.parallelize(model, meshfuse.DeviceMesh(range(1)), {})\n"
        "out = parallel(x)\n"
        "out = out.full_tensor() if hasattr(out, 'full_tensor') else out\n"
        "torch.testing.assert_close(out, expected)\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_trained_transformers_model_is_freed_with_its_last_reference():
    """After a training step (the capture, its programs, a backward), a parallelized
    ``transformers`` Llama goes when its last reference does, with no garbage collection:
    ``torch.export``'s tracer leaves reference cycles that hold the traced module (its
    wrapper's ``_export_root``), which kept the model and its parameters' memory until
    Python's next full collection; the capture collects them."""
    import gc
    import weakref

    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    gc.collect()
    gc.disable()
    try:
        model = meshfuse.parallelize(transformers.LlamaForCausalLM(config),
                                     meshfuse.DeviceMesh([0]), {})
        model(input_ids=ids, labels=ids).loss.backward()
        alive = weakref.ref(model)
        parameter = weakref.ref(next(model.parameters()))
        del model
        assert alive() is None and parameter() is None
    finally:
        gc.enable()
