"""A bad input on one rank is a typed error on every rank, never a hang: the table of classes.

Each row of :data:`CASES` is one class of mistake. Every rank builds the same sharded fusion;
the *culprit* (the last rank) makes the mistake while the others pass good shards (rows marked
``everywhere`` are mistakes every rank makes alike, such as a bad option). Every rank must
raise the row's error type, the culprit's message must contain the row's words, and the other
ranks' message must name the culprit (``rank N``): they learn of it in the cross-rank
agreement (``meshfuse.runtime.interpreter.agreement``) instead of waiting in a collective.
Afterwards every rank runs the fusion with good inputs, so the ranks are still in step.

Ranks that disagree on the fusion itself (mesh order, mesh shape, schedule) are at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from meshfuse import (
    DataType,
    DefinitionError,
    DeviceMesh,
    ExecutionError,
    FusionDefinition,
    InputError,
    ParallelType,
    ScheduleError,
)
from meshfuse.errors import MeshfuseError
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.pending import in_flight

MX = ParallelType.mesh_x
ROWS, COLS = 4, 6  # the local shard of the sharded input: [ROWS, COLS] of a [ROWS * d, COLS]


def _shard_rows(tvs, mesh: DeviceMesh) -> None:
    for tv in tvs:
        tv.set_device_mesh(mesh)
        tv.outer_split(0, mesh.size)
        tv.axis(0).parallelize(MX)


def relu(d: int, shape=(None, COLS), dtype=DataType.Float, **kwargs):
    """``T1 = relu(T0)``, T0 of global shape ``[ROWS * d, COLS]`` (axis 0 symbolic unless
    ``shape`` says otherwise), rows sharded over every rank; and each rank's good inputs."""
    shape = [ROWS * d if e is None else e for e in shape]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, dtype=dtype, **kwargs)
        y = fd.ops.relu(x)
        fd.add_output(y)
    _shard_rows((x, y), DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, *shape[1:]).to(dtype.torch_dtype)]


def symbolic_relu(d: int):
    return relu(d, shape=(-1, COLS))


def add(d: int):
    """``T2 = add(T0, T1)``, both ``[-1, COLS]`` with rows sharded."""
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([-1, COLS]), fd.define_tensor([-1, COLS])
        y = fd.ops.add(x, w)
        fd.add_output(y)
    _shard_rows((x, w, y), DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)]


def scaled(d: int):
    """``T1 = mul(T0, S1)`` with a Double scalar input S1."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS * d, COLS])
        s = fd.define_scalar(dtype=DataType.Double)
        y = fd.ops.mul(x, s)
        fd.add_output(y)
    _shard_rows((x, y), DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, COLS), 2.0]


def bshe(d: int):
    """BSHE-declared ``[2, 4d, 3, 5]`` sharded on axis 1, allocated as its loop domain."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([2, 4 * d, 3, 5], stride_order=[3, 1, 2, 0])
        y = fd.ops.relu(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(range(d)))
        tv.outer_split(1, d)
        tv.axis(1).parallelize(MX)
        tv.reorder({2: 3, 3: 2})
        tv.set_allocation_as_loop()
    return fd, [torch.randn(2, 3, 4, 5).permute(0, 2, 1, 3)]


def on_rank_zero(d: int):
    """``T1 = relu(T0)`` on ``DeviceMesh([0])``: the other ranks pass None and get nothing."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS])
        y = fd.ops.relu(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh([0]))
    good = torch.randn(ROWS, COLS) if Communicator.instance().rank == 0 else None
    return fd, [good]


def broadcast_axis(d: int):
    return relu(d, shape=(None, 1))


def embedding(d: int):
    """``T2 = embedding_fwd(T0, T1)``: Int ids ``[-1, 3]`` with rows sharded, the table
    ``[10, COLS]`` replicated."""
    with FusionDefinition() as fd:
        ids = fd.define_tensor([-1, 3], dtype=DataType.Int)
        w = fd.define_tensor([10, COLS])
        y = fd.ops.embedding_fwd(ids, w)
        fd.add_output(y)
    _shard_rows((ids, y), DeviceMesh(range(d)))
    w.set_device_mesh(DeviceMesh(range(d)))
    return fd, [torch.randint(0, 10, (ROWS, 3)), torch.randn(10, COLS)]


def lookup_along(op: str):
    """``T2 = op(T0, T1, 1)`` (take_along_axis or gather): arg ``[-1, COLS]`` and an Int
    index ``[-1, 3]``, rows sharded."""
    def fusion(d: int):
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, COLS])
            index = fd.define_tensor([-1, -1], dtype=DataType.Int)
            y = getattr(fd.ops, op)(x, index, 1)
            fd.add_output(y)
        _shard_rows((x, index, y), DeviceMesh(range(d)))
        return fd, [torch.randn(ROWS, COLS), torch.randint(0, COLS, (ROWS, 3))]
    return fusion


def index_select(d: int):
    """``T2 = index_select(T0, T1, 1)``: rows of T0 sharded, a replicated Int index."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, COLS])
        index = fd.define_tensor([-1], dtype=DataType.Int)
        y = fd.ops.index_select(x, index, 1)
        fd.add_output(y)
    _shard_rows((x, y), DeviceMesh(range(d)))
    index.set_device_mesh(DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, COLS), torch.randint(0, COLS, (5,))]


def cross_entropy(d: int):
    """Per-row cross entropy of logits ``[-1, COLS]`` at Int targets ``[-1]``, rows sharded."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, COLS])
        target = fd.define_tensor([-1], dtype=DataType.Int)
        y = fd.ops.cross_entropy(x, target, reduction="none")
        fd.add_output(y)
    _shard_rows((x, target, y), DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, COLS), torch.randint(0, COLS, (ROWS,))]


def chunked(d: int):
    """``chunk`` of T0 ``[-1, COLS]`` (rows sharded) into 3 column pieces, summed."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, COLS])
        a, b, c = fd.ops.chunk(x, 3, 1)
        fd.add_output(fd.ops.add(fd.ops.add(a, b), c))
    _shard_rows((x,), DeviceMesh(range(d)))
    return fd, [torch.randn(ROWS, COLS)]


@dataclasses.dataclass(frozen=True)
class Case:
    """One class of mistake: the fusion, what the culprit passes instead of its good inputs
    (or the execute options every rank passes), the error and the words it must say."""

    fusion: Callable[[int], tuple]
    bad: Callable[[list], list] | None
    error: type[MeshfuseError]
    words: tuple[str, ...]
    options: dict = dataclasses.field(default_factory=dict)
    needs_ranks: bool = False  # a disagreement between ranks: nothing to say on one rank

    @property
    def everywhere(self) -> bool:
        return self.bad is None


def _replace(i: int, value_of: Callable) -> Callable[[list], list]:
    return lambda good: [value_of(x) if j == i else x for j, x in enumerate(good)]


def first(value_of: Callable) -> Callable[[list], list]:
    """The good inputs with the first one replaced by ``value_of(good first input)``."""
    return _replace(0, value_of)


CASES: dict[str, Case] = {
    # kinds of value
    "list_for_a_tensor": Case(relu, first(lambda x: x.tolist()), InputError, ("T0", "list")),
    "numpy_for_a_tensor": Case(relu, first(lambda x: x.cpu().numpy()), InputError,
                               ("T0", "ndarray")),
    "float_for_a_tensor": Case(relu, first(lambda x: 1.5), InputError, ("T0", "float")),
    "string_for_a_tensor": Case(relu, first(lambda x: "x"), InputError, ("T0", "str")),
    "none_for_a_held_tensor": Case(relu, first(lambda x: None), InputError, ("T0", "NoneType")),
    "dict_for_a_tensor": Case(relu, first(lambda x: {"x": x}), InputError, ("T0", "dict")),
    "tuple_for_a_tensor": Case(relu, first(lambda x: (x,)), InputError, ("T0", "tuple")),
    "set_for_a_tensor": Case(relu, first(lambda x: {1, 2}), InputError, ("T0", "set")),
    "tensor_for_a_scalar": Case(scaled, _replace(1, lambda s: torch.ones(2)), InputError,
                                ("S0", "scalar", "[2]")),
    "string_for_a_scalar": Case(scaled, _replace(1, lambda s: "two"), InputError,
                                ("S0", "Double scalar", "str")),
    "none_for_a_scalar": Case(scaled, _replace(1, lambda s: None), InputError,
                              ("S0", "NoneType")),
    # counts
    "too_few_inputs": Case(add, lambda good: good[:1], InputError, ("got 1 inputs", "takes 2")),
    "too_many_inputs": Case(relu, lambda good: good * 2, InputError, ("got 2 inputs", "takes 1")),
    "no_inputs": Case(relu, lambda good: [], InputError, ("got 0 inputs",)),
    # dtypes
    "int64_for_float": Case(relu, first(lambda x: x.long()), InputError,
                            ("T0", "torch.int64", ".to(torch.float32)")),
    "float64_for_float": Case(relu, first(lambda x: x.double()), InputError,
                              ("T0", "torch.float64")),
    "bfloat16_for_float": Case(relu, first(lambda x: x.bfloat16()), InputError,
                               ("T0", "torch.bfloat16")),
    "float16_for_float": Case(relu, first(lambda x: x.half()), InputError,
                              ("T0", "torch.float16")),
    "int32_for_float": Case(relu, first(lambda x: x.int()), InputError, ("T0", "torch.int32")),
    "uint8_for_float": Case(relu, first(lambda x: x.to(torch.uint8)), InputError,
                            ("T0", "torch.uint8")),
    "bool_for_float": Case(relu, first(lambda x: x > 0), InputError, ("T0", "torch.bool")),
    "complex_for_float": Case(relu, first(lambda x: x.to(torch.complex64)), InputError,
                              ("T0", "torch.complex64")),
    "float_for_bfloat16": Case(lambda d: relu(d, dtype=DataType.BFloat16),
                               first(lambda x: x.float()), InputError,
                               ("T0", "BFloat16", "torch.float32")),
    # ranks and extents
    "one_axis_too_many": Case(relu, first(lambda x: x[..., None]), InputError,
                              ("T0", "2 axes", f"[{ROWS}, {COLS}, 1]")),
    "one_axis_too_few": Case(relu, first(lambda x: x.flatten()), InputError, ("T0", "2 axes")),
    "zero_dim_tensor": Case(relu, first(lambda x: x.sum()), InputError, ("T0", "2 axes")),
    "one_row_more": Case(relu, first(lambda x: torch.randn(ROWS + 1, COLS, device=x.device)),
                         InputError,
                         ("T0", "axis 0", f"{ROWS + 1}")),
    "one_row_less": Case(relu, first(lambda x: x[1:]), InputError,
                         ("T0", "axis 0", f"{ROWS - 1}")),
    "no_rows": Case(relu, first(lambda x: x[:0]), InputError, ("T0", "axis 0")),
    "wrong_static_extent": Case(relu, first(lambda x: x[:, 1:]), InputError,
                                ("T0", "axis 1", f"{COLS - 1}", f"{COLS}")),
    "broadcast_axis_not_one": Case(broadcast_axis, first(lambda x: x.expand(ROWS, 3).clone()),
                                   InputError, ("T0", "axis 1", "broadcast")),
    # (a row more on the last rank fits no split; a row fewer would be a valid uneven w of
    # one row fewer than x, refused alike on every rank: operands that do not broadcast)
    "symbolic_extents_disagree": Case(add, _replace(1, lambda w: torch.cat([w, w[:1]])),
                                      InputError, ("add", "T0", "T1", "axis 0")),
    # One row more on the last rank: no split gives the ranks' shards (one row fewer there
    # is an uneven split, whose extent the ranks learn from each other's shards: valid).
    "symbolic_local_shape_differs": Case(symbolic_relu, first(lambda x: torch.cat([x, x[:1]])),
                                         InputError, ("input T0", "axis 0"), needs_ranks=True),
    "symbolic_dtype_differs": Case(symbolic_relu, first(lambda x: x.double()), InputError,
                                   ("T0", "float64")),
    # memory layouts
    "transposed_for_contiguous": Case(lambda d: relu(d, contiguity=True),
                                      first(lambda x: x.t().contiguous().t()), InputError,
                                      ("T0", "strides")),
    "bhse_for_bshe": Case(bshe, first(lambda x: x.contiguous()), InputError,
                          ("T0", "strides", "memory order")),
    "every_other_row": Case(lambda d: relu(d, contiguity=True),
                            first(lambda x: torch.randn(2 * ROWS, COLS, device=x.device)[::2]),
                            InputError,
                            ("T0", "strides")),
    # lookups, cross entropy and chunks (the ops of a language model)
    "float_ids_for_embedding": Case(embedding, first(lambda x: x.float()), InputError,
                                    ("T0", "Int", "torch.float32", ".to(torch.int64)")),
    "int32_ids_for_int": Case(embedding, first(lambda x: x.int()), InputError,
                              ("T0", "torch.int32")),
    "float_table_rows_short": Case(embedding, _replace(1, lambda w: w[:9]), InputError,
                                   ("T1", "axis 0", "9")),
    "float_index_for_gather": Case(lookup_along("gather"), _replace(1, lambda i: i.float()),
                                   InputError, ("T1", "Int", "torch.float32")),
    "index_longer_than_arg": Case(lookup_along("gather"),
                                  _replace(1, lambda i: torch.cat([i, i[:1]])),
                                  InputError, ("gather", "axis 0", "index", "at most")),
    "take_along_index_rows_differ": Case(lookup_along("take_along_axis"),
                                         _replace(1, lambda i: torch.cat([i, i[:1]])),
                                         InputError, ("take_along_axis", "axis 0", "index")),
    "index_select_float_index": Case(index_select, _replace(1, lambda i: i.float()),
                                     InputError, ("T1", "Int", "torch.float32")),
    "index_select_index_of_two_axes": Case(index_select, _replace(1, lambda i: i[None]),
                                           InputError, ("T1", "1 axes")),
    "float_targets_for_cross_entropy": Case(cross_entropy, _replace(1, lambda t: t.float()),
                                            InputError, ("T1", "Int", "torch.float32")),
    "targets_rows_differ": Case(cross_entropy, _replace(1, lambda t: torch.cat([t, t[:1]])),
                                InputError, ("axis 0",)),
    "chunk_columns_short": Case(chunked, first(lambda x: x[:, 1:]), InputError,
                                ("T0", "axis 1", f"{COLS - 1}", f"{COLS}")),
    # options (every rank passes the same bad option)
    "negative_timeout": Case(relu, None, InputError, ("timeout=-1", "positive number"),
                             {"timeout": -1}),
    "zero_timeout": Case(relu, None, InputError, ("timeout=0",), {"timeout": 0}),
    "string_timeout": Case(relu, None, InputError, ("timeout='5'",), {"timeout": "5"}),
    "bool_timeout": Case(relu, None, InputError, ("timeout=True",), {"timeout": True}),
}


def _run(fd, inputs, options):
    return fd.execute(inputs, **options)


def on_device(inputs: list, multidevice_test) -> list:
    """``inputs`` with their tensors moved to this rank's device (its GPU under NCCL)."""
    return [x.to(multidevice_test.device) if isinstance(x, torch.Tensor) else x for x in inputs]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_on_one_rank_is_an_error_on_every_rank(multidevice_test, name):
    case = CASES[name]
    d, rank = multidevice_test.size, multidevice_test.rank
    culprit = d - 1
    if case.needs_ranks and d < 2:
        pytest.skip("needs two ranks to disagree")
    fd, good = case.fusion(d)
    good = on_device(good, multidevice_test)
    mine = good if case.everywhere or rank != culprit else case.bad(good)
    with pytest.raises(case.error) as info:
        _run(fd, mine, case.options)
    message = str(info.value)
    if case.everywhere or rank == culprit:
        missing = [w for w in case.words if w not in message]
        assert not missing, f"{missing} not in: {message}"
    if not case.everywhere and d > 1:
        assert f"rank {culprit}" in message, message
    outputs = fd.execute(good)  # the ranks are still in step
    assert len(outputs) == 1


def test_junk_off_the_mesh_is_an_error_on_its_rank_only(multidevice_test):
    """A rank outside a fusion's meshes takes no part in its agreement (a pipeline stage's
    fusion is never called by the other stages' ranks): its bad input is its own error, and
    the fusion's ranks run without waiting for it."""
    d, rank = multidevice_test.size, multidevice_test.rank
    if d < 2:
        pytest.skip("needs a rank off the mesh")
    fd, good = on_rank_zero(d)
    good = on_device(good, multidevice_test)
    if rank == d - 1:
        with pytest.raises(InputError, match="T0.*str"):
            fd.execute(["junk"])
    else:
        out, = fd.execute(good)
        if rank == 0:
            torch.testing.assert_close(out, good[0].relu())


# ----- ranks that build different fusions ------------------------------------------------------

def _disagreeing_relu(multidevice_test, schedule: Callable) -> FusionDefinition:
    """``relu`` of a ``[4d, 6d]`` input, scheduled by ``schedule(x, y, culprit)``."""
    if multidevice_test.size < 2:
        pytest.skip("needs two ranks to disagree")
    d = multidevice_test.size
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS * d, COLS * d])
        y = fd.ops.relu(x)
        fd.add_output(y)
    schedule(x, y, multidevice_test.rank == d - 1)
    return fd


def _mesh_order(x, y, culprit):
    ids = list(range(Communicator.instance().size))
    _shard_rows((x, y), DeviceMesh(ids[::-1] if culprit else ids))


def _mesh_shape(x, y, culprit):
    ids = list(range(Communicator.instance().size))
    _shard_rows((x, y), DeviceMesh([ids] if culprit else ids))


def _schedule(x, y, culprit):
    mesh = DeviceMesh(range(Communicator.instance().size))
    for tv in (x, y):
        tv.set_device_mesh(mesh)
        if culprit:  # shards the other axis
            tv.outer_split(1, mesh.size)
            tv.axis(1).parallelize(MX)
        else:
            tv.outer_split(0, mesh.size)
            tv.axis(0).parallelize(MX)


def _no_schedule(x, y, culprit):
    if not culprit:
        _shard_rows((x, y), DeviceMesh(range(Communicator.instance().size)))
    else:
        for tv in (x, y):
            tv.set_device_mesh(DeviceMesh(range(Communicator.instance().size)))


@pytest.mark.parametrize("schedule, subject", [
    (_mesh_order, "the mesh of T0"),
    (_mesh_shape, "the mesh of T0"),
    (_schedule, "the schedule of T0"),
    (_no_schedule, "the schedule of T0"),
], ids=["mesh_order", "mesh_shape", "schedule", "missing_schedule"])
def test_ranks_that_build_different_fusions(multidevice_test, schedule, subject):
    """Every rank raises InputError naming what differs and the culprit, before any
    collective of the program (no hang, no gloo abort)."""
    fd = _disagreeing_relu(multidevice_test, schedule)
    culprit = multidevice_test.size - 1
    with pytest.raises(InputError) as info:
        fd.execute([torch.randn(ROWS, COLS * multidevice_test.size,
                                device=multidevice_test.device)])
    message = str(info.value)
    for word in (f"ranks disagree on {subject}", f"rank {culprit} has", "same fusion"):
        assert word in message, message


def test_a_definition_error_is_raised_on_every_rank(multidevice_test):
    """An op refused while defining raises on each rank by itself (no communication), and
    executing inside the ``with`` block is refused on every rank."""
    with pytest.raises(DefinitionError, match="not finished"), FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS])
        fd.add_output(fd.ops.relu(x))
        fd.execute([torch.randn(ROWS, COLS, device=multidevice_test.device)])
    with pytest.raises(DefinitionError, match="not finished"), FusionDefinition() as fd:
        fd.explain()


@pytest.mark.parametrize("op", ["chunk", "split"])
def test_pieces_of_a_symbolic_axis_are_refused_on_every_rank(multidevice_test, op):
    """chunk and split need the split axis's extent (their pieces' extents are part of the
    fusion): each rank refuses the definition by itself, naming the axis and the fix."""
    with pytest.raises(DefinitionError) as info, FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, -1])
        fd.ops.chunk(x, 3, 1) if op == "chunk" else fd.ops.split(x, [2, 4], 1)
    for word in (op, "axis 1", "symbolic", "static one in define_tensor"):
        assert word in str(info.value), info.value


def test_a_schedule_error_on_one_rank_is_raised_on_every_rank(multidevice_test):
    """The culprit's schedule puts mesh_y on a 1-D mesh; the build fails there, and the
    other ranks raise the same ScheduleError naming it."""
    d = multidevice_test.size
    culprit = d - 1

    def schedule(x, y, is_culprit):
        _shard_rows((x, y), DeviceMesh(range(d)))
        if is_culprit:
            x.axis(0).parallelize(ParallelType.mesh_y)

    if d < 2:
        pytest.skip("needs two ranks to disagree")
    fd = _disagreeing_relu(multidevice_test, schedule)
    with pytest.raises(ScheduleError) as info:
        fd.execute([torch.randn(ROWS, COLS * d, device=multidevice_test.device)])
    assert "mesh_y" in str(info.value) and f"rank {culprit}" in str(info.value)


def test_no_agreement_collective_on_cached_calls_or_when_off(multidevice_test, monkeypatch):
    """The agreement costs one small collective per new signature (and one per build), none
    on a cached call, none with ``check_ranks=False``."""
    d = multidevice_test.size
    calls = []
    gather = Communicator.agreement_allgather
    monkeypatch.setattr(Communicator, "agreement_allgather",
                        lambda self, *a, **k: calls.append(1) or gather(self, *a, **k))
    fd, good = relu(d)
    good = on_device(good, multidevice_test)
    fd.execute(good)
    first = len(calls)
    fd.execute(good)
    assert len(calls) == first
    assert first == (2 if d > 1 else 0)  # the build and the first signature
    fd, good = relu(d)
    fd.execute(on_device(good, multidevice_test), check_ranks=False)
    assert len(calls) == first
    monkeypatch.setenv("MESHFUSE_CHECK_RANKS", "0")
    fd, good = relu(d)
    fd.execute(on_device(good, multidevice_test))
    assert len(calls) == first



_TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "all_to_all_single", "broadcast", "barrier",
                      "send", "recv")


def test_a_cached_call_runs_only_the_programs_collectives(multidevice_test, monkeypatch):
    """Every torch.distributed call of a cached call is one the communication recorder
    reports (the program's allreduce): the agreement adds nothing; the first call of a new
    signature adds exactly its one small allgather."""
    d = multidevice_test.size
    calls = []
    for name in _TORCH_COLLECTIVES:
        real = getattr(torch.distributed, name)
        monkeypatch.setattr(torch.distributed, name,
                            lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, COLS * d])
        fd.add_output(fd.ops.sum(x, dims=[1]))
    _shard_columns(x, DeviceMesh(range(d)))
    device = multidevice_test.device
    local = torch.ones(ROWS, COLS, device=device)
    fd.execute([local])  # the build and the first signature agree
    for shape in ((ROWS, COLS), (ROWS, COLS), (2 * ROWS, COLS)):
        calls.clear()
        with record_communications() as comms:
            (out,) = fd.execute([torch.ones(*shape, device=device)])
        assert out.tolist() == [float(COLS * d)] * shape[0]
        assert [c.kind for c in comms] == (["allreduce"] if d > 1 else [])
        agreement = ["all_gather"] if d > 1 and shape[0] == 2 * ROWS else []  # new signature
        assert calls == agreement + ["all_reduce"] * (d > 1), calls


def _shard_columns(x, mesh: DeviceMesh) -> None:
    x.set_device_mesh(mesh)
    x.outer_split(1, mesh.size)
    x.axis(1).parallelize(MX)


def test_nothing_in_flight_after_execute_returns_or_raises(multidevice_test):
    """The sum's allreduce is launched first and runs while ``fmod(x, 0)`` fails: the
    program waits for it before the ExecutionError leaves ``execute``; a good run leaves
    nothing in flight either."""
    d = multidevice_test.size
    if multidevice_test.device.type == "cuda" and d > 1:
        pytest.skip("an integer fmod by zero raises on the CPU only, and NCCL between several "
                    "ranks needs the inputs on the GPU")
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS * d], dtype=DataType.Int)
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
        fd.add_output(fd.ops.fmod(x, 0))
    mesh = DeviceMesh(range(d))
    x.set_device_mesh(mesh)
    x.outer_split(1, d)
    x.axis(1).parallelize(MX)
    s.set_device_mesh(mesh)
    local = torch.ones(ROWS, COLS, dtype=torch.int64)
    with record_communications() as comms, pytest.raises(ExecutionError, match="fmod"):
        fd.execute([local])
    assert in_flight() == 0
    assert [c.kind for c in comms] == (["allreduce"] if d > 1 else [])
    with FusionDefinition() as fd:
        x = fd.define_tensor([ROWS, COLS * d])
        s = fd.ops.sum(x, dims=[1])
        fd.add_output(s)
    x.set_device_mesh(mesh)
    x.outer_split(1, d)
    x.axis(1).parallelize(MX)
    s.set_device_mesh(mesh)
    (out,) = fd.execute([torch.ones(ROWS, COLS)])
    assert in_flight() == 0
    assert out.tolist() == [float(COLS * d)] * ROWS
