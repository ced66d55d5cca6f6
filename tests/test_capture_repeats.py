"""Repeated layers traced once: a stack of identical blocks runs the Python of its first
block only during the capture (the others are copies of its graph with their own parameters),
and computes what the module computes; a block that differs is traced itself."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from capture_checks import check_gradients
from test_autograd_replay import AddressGraph, fake_cuda  # noqa: F401 - a fixture
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.autodiff import function as autodiff_function
from meshfuse.capture import program as capture_program
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.repeats import repeated_layers
from meshfuse.capture.trace import _from_exported, capture, module_path
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device

E, HIDDEN, LAYERS = 8, 10, 16  # HIDDEN shards unevenly over 3 and 4 ranks
# the blocks whose forward ran, in order (by object: a forward computing with its layer_idx
# would make every layer trace itself, a copy's trace being the template's)
CALLED: list = []


class Block(torch.nn.Module):
    def __init__(self, index: int, hidden: int = HIDDEN, scale: float = 1.0):
        super().__init__()
        self.layer_idx = index  # differs per layer: an index, allowed
        self.scale = scale
        self.up = torch.nn.Linear(E, hidden)
        self.down = torch.nn.Linear(hidden, E)
        self.norm = torch.nn.LayerNorm(E)
        # Each layer's own buffer (a copy reads its own, not the first layer's).
        self.register_buffer("shift", torch.full((E,), 0.1 * index))

    def forward(self, x, table, *, gain=None):
        CALLED.append(self)
        h = F.silu(self.up(self.norm(x + self.shift) * table)) * self.scale
        return x + self.down(h) * gain, None  # a non-tensor output rides along


class Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.embed = torch.nn.Linear(E, E)
        self.layers = torch.nn.ModuleList(blocks)
        self.register_buffer("table", torch.linspace(0.5, 1.5, E))

    def forward(self, x):
        x = self.embed(x)
        gain = torch.ones(E, device=x.device) * 0.5  # folded at capture, read by every layer
        for layer in self.layers:
            x, _ = layer(x, self.table, gain=gain)
        return (x * x).mean(), x


def _calls(model: Stack) -> collections.Counter:
    """Forward calls since ``CALLED`` was cleared, by layer index."""
    return collections.Counter(list(model.layers).index(b) for b in CALLED)


PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}


def _stack(odd: int | None = None) -> Stack:
    """``LAYERS`` blocks; block ``odd`` (if given) has another ``scale``."""
    torch.manual_seed(0)
    return Stack([Block(i, scale=2.0 if i == odd else 1.0) for i in range(LAYERS)])


def _signature(graph) -> collections.Counter:
    return collections.Counter(
        (str(n.target), module_path(n), tuple(getattr(n.meta.get("val"), "shape", ())))
        for n in graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("odd", [None, 5])
def test_identical_layers_run_their_python_once_and_give_the_whole_graph(odd):
    model, x = _stack(odd), torch.randn(2, 3, E)
    traced = [0] if odd is None else [0, odd]  # the layer that differs traces itself
    assert repeated_layers(model) == {
        "layers.0": [f"layers.{i}" for i in range(LAYERS) if i not in traced]}
    CALLED.clear()
    captured = capture(model, (x,), {})
    assert _calls(model) == dict.fromkeys(traced, 1)
    CALLED.clear()
    whole = _from_exported(torch.export.export(model, (x,), strict=False))
    assert len(_calls(model)) == LAYERS
    # The copies are the layers' own: same ops, module paths (layers.7.up) and shapes.
    assert _signature(captured.graph) == _signature(whole.graph)
    read = {a.name for n in captured.graph.nodes if n.op == "call_function"
            for a in n.all_input_nodes}
    assert all(p in read for p in captured.parameters), "every layer reads its parameters"


def test_a_layer_with_another_shape_or_a_hook_is_not_a_copy():
    blocks = [Block(i, hidden=HIDDEN if i != 2 else HIDDEN + 2) for i in range(4)]
    assert repeated_layers(Stack(blocks)) == {"layers.0": ["layers.1", "layers.3"]}
    blocks = [Block(i) for i in range(4)]
    blocks[1].up.register_forward_hook(lambda *a: None)
    assert repeated_layers(Stack(blocks)) == {"layers.0": ["layers.2", "layers.3"]}


class PrivatelyScaled(Block):
    """A block whose forward reads a private attribute set per layer (``self._gain``)."""

    def __init__(self, index: int, gain: float):
        super().__init__(index)
        self._gain = gain

    def forward(self, x, table, *, gain=None):
        y, extra = super().forward(x, table, gain=gain)
        return y * self._gain, extra


def test_layers_differing_in_a_private_attribute_are_not_copies():
    """Private attributes count as public ones do (a copy traced as the template would take
    the template's ``_gain``): the layers that differ trace themselves, and the parallelized
    module computes the module's values; those alike still group, and so do helper modules
    held in a private dict (Llama's ``_kernel_funcs``: one instance per layer, no state)."""
    torch.manual_seed(0)
    reference = Stack([PrivatelyScaled(i, 2.0 if i == 2 else 1.0) for i in range(4)])
    assert repeated_layers(reference) == {"layers.0": ["layers.1", "layers.3"]}
    for block in reference.layers:
        block._helpers = {"silu": torch.nn.SiLU()}
    assert repeated_layers(reference) == {"layers.0": ["layers.1", "layers.3"]}
    reference.layers[3]._helpers = {"silu": torch.nn.GELU()}
    assert repeated_layers(reference) == {"layers.0": ["layers.1"]}
    reference = reference.to(current_device())
    x = torch.randn(2, 3, E).to(current_device())
    parallel = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh([0]), {})
    torch.testing.assert_close(parallel(x)[1], reference(x)[1])


class ScaledByIndex(Block):
    """A block whose forward computes with its layer index (as ImageGPT's attention divides
    by ``layer_idx + 1``): its copies would take the template's index."""

    def forward(self, x, table, *, gain=None):
        y, extra = super().forward(x, table, gain=gain)
        return y / float(self.layer_idx + 1), extra


def test_a_forward_computing_with_its_layer_index_traces_every_layer():
    """The layers group as copies (only their index differs), but the template's forward
    reads the index: the capture traces every layer, and computes the module's values."""
    torch.manual_seed(0)
    model = Stack([ScaledByIndex(i) for i in range(4)])
    assert repeated_layers(model) == {"layers.0": ["layers.1", "layers.2", "layers.3"]}
    x = torch.randn(2, 3, E)
    CALLED.clear()
    capture(model, (x,), {})
    # the template once in the attempt, then every layer
    assert _calls(model) == {0: 2, 1: 1, 2: 1, 3: 1}
    assert all(type(b.layer_idx) is int for b in model.layers)  # given back as they were
    torch.manual_seed(0)
    reference = Stack([ScaledByIndex(i) for i in range(4)]).to(current_device())
    x = x.to(current_device())
    parallel = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh([0]), {})
    torch.testing.assert_close(parallel(x)[1], reference(x)[1])


@pytest.mark.parametrize("by_index", [False, True])
def test_imagegpt_traces_its_layers_once_unless_it_scales_by_their_index(monkeypatch, by_index):
    """ImageGPT's forward writes in place (its functional pass traces the exported program
    again, reading the templates' records: done inside ``traced_once``) and, with
    ``scale_attn_by_inverse_layer_idx``, divides its attention by ``layer_idx + 1``: then
    each layer traces itself. Logits and gradients are the module's either way."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ImageGPTConfig(
        vocab_size=33, n_positions=16, n_embd=16, n_layer=3, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=by_index)
    torch.manual_seed(0)
    reference = transformers.ImageGPTForCausalImageModeling(config).to(current_device())
    block = type(reference.transformer.h[0])
    calls = []
    forward = block.forward
    monkeypatch.setattr(block, "forward", lambda self, *a, **k: calls.append(self)
                        or forward(self, *a, **k))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ids = ids.to(current_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh([0]), {})
        calls.clear()
        logits = model(input_ids=ids, use_cache=False).logits
    assert len(calls) == (1 + 3 if by_index else 1)  # (the template in the attempt, then all)
    expected = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    logits.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    check_gradients(model, reference)


@pytest.mark.mpi
@pytest.mark.parametrize("odd", [None, 5])
def test_a_stack_traced_once_computes_the_modules_values_and_gradients(multidevice_test, odd):
    reference = _stack(odd).to(current_device())
    mesh = DeviceMesh(range(multidevice_test.size))
    model = meshfuse.parallelize(copy.deepcopy(reference), mesh, PLAN)
    x = torch.randn(2, 3, E, generator=torch.Generator().manual_seed(1)).to(current_device())
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        with record_communications() as forward:
            loss, y = model(x)
    expected, expected_y = reference(x)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    loss.backward()
    expected.backward()
    check_gradients(model, reference)
    # Megatron's: one allreduce per layer (after its row-parallel down projection).
    crossing = [c.kind for c in forward if len(c.ranks) > 1]
    assert crossing == (["allreduce"] * LAYERS if multidevice_test.size > 1 else [])


def _count_calls(monkeypatch, owner, name: str, counts: collections.Counter) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


@pytest.mark.mpi
def test_the_work_of_capture_and_build_does_not_grow_with_depth(multidevice_test, monkeypatch):
    """Issue 32's depth target (capture + build of 32 layers within 3x of 2, timed by
    ``benchmarks/capture_depth.py``) through what it counts: at 2 and 6 layers of a
    ``transformers`` Llama, one decoder layer's Python is traced, the trace lifts the
    parameters of one layer (the others' are hidden from it), and as many fusions are built
    and as many backwards derived; only the copies of the traced graph grow."""
    transformers = pytest.importorskip("transformers")
    layer_class = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    mesh = DeviceMesh(range(multidevice_test.size))
    found = {}
    for layers in (2, 6):
        counts: collections.Counter = collections.Counter()
        _count_calls(monkeypatch, layer_class, "forward", counts)
        _count_calls(monkeypatch, capture_program, "build_segment", counts)
        _count_calls(monkeypatch, autodiff_function, "derive", counts)
        lifted = []
        export = torch.export.export

        def counting_export(*args, _lifted=lifted, _export=export, **kwargs):
            exported = _export(*args, **kwargs)
            _lifted.append(len(exported.graph_signature.parameters))
            return exported

        monkeypatch.setattr(torch.export, "export", counting_export)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        torch.manual_seed(0)
        reference = transformers.LlamaForCausalLM(config).to(current_device())
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, {
            "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel()})
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        ids = ids.to(current_device())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        monkeypatch.undo()
        expected = reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        program = model._meshfuse.last
        layer_steps = [s for s in program.partition.segments if "layers" in s.block]
        assert len(layer_steps) == layers  # one fusion per layer, each run
        found[layers] = (dict(counts), lifted, len(program.built))
    assert found[2] == found[6]
    counts, lifted, _ = found[2]
    assert counts["forward"] == 1 and lifted == [9 + 3]  # a layer's 9, embedding, norm, head


@pytest.mark.mpi
def test_every_layer_of_a_parallelized_stack_replays(multidevice_test, fake_cuda):  # noqa: F811
    """The stack's identical layers share one autograd function (built once): with the
    automatic replay deciding as on CUDA (a stand-in graph on the CPU), each layer's
    forward and backward replay from the second training step on (one graph per layer,
    not the few of one call site), and training matches the module's."""
    if current_device().type == "cuda":
        pytest.skip("stand-in graphs of CPU tensors: on CUDA the real graphs replay "
                    "(tests/test_autograd_replay.py)")
    reference = _stack()
    model = meshfuse.parallelize(copy.deepcopy(reference), DeviceMesh(
        range(multidevice_test.size)), {})
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, reference)]
    x = torch.randn(2, 3, E, generator=torch.Generator().manual_seed(1))
    replays = []
    for _ in range(3):
        before = AddressGraph.replays
        for m, opt in zip((model, reference), opts):
            opt.zero_grad()
            loss, _ = m(x)
            loss.backward()
            opt.step()
            if m is model:
                replays.append(AddressGraph.replays - before)
                mine = loss
        torch.testing.assert_close(mine, loss, rtol=1e-5, atol=1e-6)
    program = model._meshfuse.last
    (layer,) = [f for key, (_, f) in program.built.items()
                if program.ran[next(s.index for s in program.partition.segments
                                    if s.block == "layers.3")] == key]
    assert replays[0] == 0 and replays[2] >= 2 * LAYERS, replays
    # the third step's calls of the layers' forward and backward programs, all replayed
    text = "\n".join(layer.call_lines())
    assert text.count(f"(over {LAYERS} calls) (one graph launch)") == 2
    assert "host time per autograd node call" in text
