"""User mistakes raise meshfuse's typed errors, whose messages name what is wrong.

One case per class of mistake: bad definitions (``DefinitionError``, raised when the op is
added), bad schedules (``ScheduleError``) and bad inputs to ``execute`` (``InputError``,
raised before anything runs). Each case lists words its message must contain: the op, the
tensor, the axis, the offending values. ``pytest.raises`` of the meshfuse type also checks
that no bare PyTorch exception escapes.
"""

from __future__ import annotations

import re
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
    TensorView,
)
from meshfuse.ir.iter_domain import IterDomain


def assert_says(error: Exception, words) -> None:
    message = str(error)
    missing = [w for w in words if w not in message]
    assert not missing, f"message lacks {missing}: {message}"


def matrix(fd, shape=(4, 6), dtype=DataType.Float, **kwargs) -> TensorView:
    return fd.define_tensor(list(shape), dtype=dtype, **kwargs)


def cube(fd) -> TensorView:
    return matrix(fd, (2, 3, 4))


# ----------------------------------------------------------------------------------------------
# Bad definitions: each case builds inside `with FusionDefinition() as fd` and must raise.

CUDA = torch.cuda.is_available()
Cases = dict[str, tuple[Callable, tuple[str, ...], pytest.MarkDecorator]]


def _registrar(cases: Cases) -> Callable:
    """A decorator factory: ``@case(*words)`` records the decorated build in ``cases`` under
    its name, with the words its error must contain (``needs_cuda``: skipped without CUDA)."""
    def case(*words: str, needs_cuda: bool = False):
        def register(build):
            marks = pytest.mark.skipif(needs_cuda and not CUDA, reason="needs a CUDA device")
            cases[build.__name__] = (build, words, marks)
            return build

        return register

    return case


DEFINITION_CASES: Cases = {}
definition_case = _registrar(DEFINITION_CASES)


@definition_case("sum", "unknown argument 'dim'", "dims=None")
def unknown_argument(fd):
    fd.ops.sum(matrix(fd), dim=[1])


@definition_case("add", "missing argument 'b'", "add(a, b)")
def missing_argument(fd):
    fd.ops.add(matrix(fd))


@definition_case("relu", "at most 1", "got 2")
def too_many_arguments(fd):
    x = matrix(fd)
    fd.ops.relu(x, x)


@definition_case("add", "argument 'a' twice")
def argument_twice(fd):
    x = matrix(fd)
    fd.ops.add(x, a=x)


@definition_case("sum", "'dims'", "static Python value", "T0")
def attr_given_a_tensor(fd):
    x = matrix(fd)
    fd.ops.sum(x, dims=x)


@definition_case("sum", "'x'", "must be a tensor", "2.5")
def tensor_given_a_number(fd):
    fd.ops.sum(2.5)   # (unary pointwise ops take numbers, as nvFuser's do: a 0-d result)


@definition_case("add", "'b'", "a tensor, a scalar or a number", "'one'")
def operand_given_a_string(fd):
    fd.ops.add(matrix(fd), "one")


@definition_case("sdpfa_fwd", "'dropout_p'", "scalar")
def scalar_given_a_tensor(fd):
    q = matrix(fd, (1, 2, 8, 4))
    fd.ops.sdpfa_fwd(q, q, q, dropout_p=q)


@definition_case("cat", "'xs'", "list of tensors")
def tensor_list_given_a_tensor(fd):
    fd.ops.cat(matrix(fd), 0)


@definition_case("add", "output axis 0", "extent 4", "extent 5", "broadcast axis")
def binary_shape_mismatch(fd):
    fd.ops.add(matrix(fd, (4, 6)), matrix(fd, (5, 6)))


@definition_case("mul", "output axis 1", "extent 6", "extent 4")
def binary_trailing_axes_mismatch(fd):
    fd.ops.mul(matrix(fd, (4, 6)), matrix(fd, (4,)))


@definition_case("sum", "axis 2", "out of range", "2 axes", "[-2, 2)")
def reduction_axis_out_of_range(fd):
    fd.ops.sum(matrix(fd), dims=[2])


@definition_case("max", "axis -3", "out of range")
def reduction_negative_axis_out_of_range(fd):
    fd.ops.max(matrix(fd), dims=[-3])


@definition_case("var_mean", "[1, -1]", "twice")
def reduction_axis_named_twice(fd):
    fd.ops.var_mean(matrix(fd), dims=[1, -1])


@definition_case("mean", "Int", "floating-point")
def mean_of_integers(fd):
    fd.ops.mean(matrix(fd, dtype=DataType.Int), dims=[0])


@definition_case("permute", "[0, 0, 1]", "permutation of range(3)")
def permute_repeats_an_axis(fd):
    fd.ops.permute(cube(fd), [0, 0, 1])


@definition_case("permute", "[1, 0]", "permutation of range(3)")
def permute_too_few_axes(fd):
    fd.ops.permute(cube(fd), [1, 0])


@definition_case("permute", "axis 3", "out of range", "3 axes")
def permute_axis_out_of_range(fd):
    fd.ops.permute(cube(fd), [0, 1, 3])


@definition_case("permute", "dims", "list of ints", "1")
def permute_dims_not_a_list(fd):
    fd.ops.permute(matrix(fd), 1)


@definition_case("reshape", "[4, 6]", "24 elements", "[5, 5]")
def reshape_changes_element_count(fd):
    fd.ops.reshape(matrix(fd), [5, 5])


@definition_case("reshape", "[-1, -1]", "one -1")
def reshape_two_inferred_extents(fd):
    fd.ops.reshape(matrix(fd), [-1, -1])


@definition_case("reshape", "new_shape", "list of ints", "None")
def reshape_shape_not_ints(fd):
    fd.ops.reshape(matrix(fd), [None, 4])


@definition_case("define_tensor", "stride_order [1, 0]", "range(3)")
def stride_order_wrong_rank(fd):
    fd.define_tensor([2, 3, 4], stride_order=[1, 0])


@definition_case("define_tensor", "stride_order [0, 0]", "permutation")
def stride_order_not_a_permutation(fd):
    fd.define_tensor([4, 6], stride_order=[0, 0])


@definition_case("define_tensor", "contiguity has 1 entries for 2 axes")
def contiguity_wrong_length(fd):
    fd.define_tensor([4, 6], contiguity=[True])


@definition_case("define_tensor", "shape entry 1", "0", "-1 (symbolic)")
def shape_entry_zero(fd):
    fd.define_tensor([4, 0])


@definition_case("define_tensor", "dtype must be a DataType", "torch.float32")
def define_tensor_torch_dtype(fd):
    fd.define_tensor([4, 6], dtype=torch.float32)


@definition_case("define_scalar", "needs a dtype")
def scalar_input_without_dtype(fd):
    fd.define_scalar()


@definition_case("add_output", "not a tensor of this fusion")
def add_output_of_a_foreign_tensor(fd):
    with FusionDefinition() as other:
        foreign = other.ops.relu(matrix(other))
    fd.add_output(foreign)


@definition_case("relu", "'x'", "another fusion")
def foreign_tensor_as_an_argument(fd):
    with FusionDefinition() as other:
        foreign = matrix(other)
    fd.ops.relu(foreign)


@definition_case("add_output", "not a tensor of this fusion")
def add_output_of_a_scalar(fd):
    fd.add_output(fd.define_scalar(1.5))


@definition_case("add_output", "not produced by the fusion")
def output_not_produced_by_the_fusion(fd):
    fd.add_output(TensorView(fd.fusion, [IterDomain(4)], DataType.Float))


@definition_case("matmul", "contracted", "axis 1", "6", "5")
def matmul_contraction_mismatch(fd):
    fd.ops.matmul(matrix(fd, (4, 6)), matrix(fd, (5, 3)))


@definition_case("matmul", "one dtype", "Float", "BFloat16")
def matmul_mixed_dtypes(fd):
    fd.ops.matmul(matrix(fd, (4, 6)), matrix(fd, (6, 3), DataType.BFloat16))


@definition_case("linear", "bias", "[3]", "[4]")
def linear_bias_wrong_extent(fd):
    fd.ops.linear(matrix(fd, (4, 6)), matrix(fd, (3, 6)), matrix(fd, (4,)))


@definition_case("where", "cond must be Bool", "Float")
def where_condition_not_bool(fd):
    x = matrix(fd)
    fd.ops.where(x, x, 0.5)


@definition_case("cast", "dtype must be a DataType", "torch.bfloat16")
def cast_to_a_torch_dtype(fd):
    fd.ops.cast(matrix(fd), torch.bfloat16)


@definition_case("slice", "axis 1", "[2, 7)", "<= 6")
def slice_out_of_bounds(fd):
    # nvFuser's default normalization clamps bounds as Python does; manual ones are checked.
    fd.ops.slice(matrix(fd), [0, 2], [4, 7], manual_normalization=1)


@definition_case("slice", "stride 0", "axis 1", "positive")
def slice_zero_stride(fd):
    fd.ops.slice(matrix(fd), [0, 0], [4, 6], [1, 0])


@definition_case("squeeze", "axis 0", "extent 4")
def squeeze_an_axis_not_of_extent_one(fd):
    fd.ops.squeeze(matrix(fd), [0])


@definition_case("broadcast_in_dim", "input axis 0", "extent 6", "asks for 5")
def broadcast_in_dim_changes_an_extent(fd):
    fd.ops.broadcast_in_dim(matrix(fd, (6,)), [4, 5], [1])


@definition_case("broadcast_in_dim", "broadcast_dims [2]", "2-axis")
def broadcast_in_dim_axis_out_of_range(fd):
    fd.ops.broadcast_in_dim(matrix(fd, (6,)), [4, 6], [2])


@definition_case("expand", "fewer axes", "[6]")
def expand_to_fewer_axes(fd):
    fd.ops.expand(matrix(fd), [6])


@definition_case("cat", "axis 1", "tensor 1", "extent 5", "6")
def cat_extent_mismatch(fd):
    fd.ops.cat([matrix(fd, (2, 6)), matrix(fd, (3, 5))], 0)


@definition_case("gelu", "'none' or 'tanh'", "'fast'")
def gelu_unknown_approximation(fd):
    fd.ops.gelu(matrix(fd), "fast")


@definition_case("sdpfa_fwd", "q", "[batch, heads, sequence, head_dim]", "2 axes")
def attention_of_a_matrix(fd):
    x = matrix(fd)
    fd.ops.sdpfa_fwd(x, x, x)


@definition_case("sdpfa_fwd", "heads (axis 1) of k is 3", "q's is 2")
def attention_heads_mismatch(fd):
    q = matrix(fd, (1, 2, 8, 4))
    fd.ops.sdpfa_fwd(q, matrix(fd, (1, 3, 8, 4)), matrix(fd, (1, 3, 8, 4)))


@pytest.mark.parametrize("case", list(DEFINITION_CASES))
def test_bad_definition(case):
    build, words, _ = DEFINITION_CASES[case]
    with pytest.raises(DefinitionError) as info, FusionDefinition() as fd:
        build(fd)
    assert_says(info.value, words)


def test_unknown_op_is_an_attribute_error():
    """``fd.ops`` is a namespace: an unknown name is an AttributeError (``hasattr`` works)."""
    fd = FusionDefinition()
    assert not hasattr(fd.ops, "frobnicate")
    with pytest.raises(AttributeError, match="no op 'frobnicate'"):
        fd.ops.frobnicate(1)


# ----------------------------------------------------------------------------------------------
# Bad schedules: raised by the scheduling call itself, or by execute before running.

SCHEDULE_CASES: Cases = {}
schedule_case = _registrar(SCHEDULE_CASES)


@schedule_case("factor must be a positive int", "0")
def split_by_zero(fd):
    matrix(fd).outer_split(0, 0)


@schedule_case("axis 5", "T0", "2 axes")
def reorder_axis_out_of_range(fd):
    matrix(fd).reorder({0: 5})


@schedule_case("merge", "T0", "not adjacent")
def merge_axes_not_adjacent(fd):
    cube(fd).merge(0, 2)


@schedule_case("axis 0", "T0", "broadcast axis", "DIDx", "one device")
def parallelize_a_broadcast_axis(fd):
    """Legal over a mesh axis of one device (nvFuser's d == 1), not over two."""
    x = matrix(fd, (1, 6))
    x.set_device_mesh(DeviceMesh([0, 1]))
    x.parallelize(0, ParallelType.mesh_x)
    fd.add_output(fd.ops.relu(x))
    fd.execute([torch.randn(1, 6)])


@schedule_case("DIDx", "used twice", "T0")
def one_parallel_type_twice(fd):
    x = matrix(fd, (4, 6)).outer_split(0, 2).outer_split(2, 2)
    x.parallelize(0, ParallelType.mesh_x)
    x.parallelize(2, ParallelType.mesh_x)


@schedule_case("set_device_mesh", "DeviceMesh", "[0, 1]")
def mesh_not_a_device_mesh(fd):
    matrix(fd).set_device_mesh([0, 1])


@schedule_case("expected a ParallelType", "'DIDx'")
def parallelize_with_a_string(fd):
    matrix(fd).parallelize(0, "DIDx")


@schedule_case("axis 1", "T0", "DIDx", "no device mesh", "set_device_mesh")
def parallelize_without_a_mesh(_):
    with FusionDefinition() as fd:  # finished before execute
        x = matrix(fd).outer_split(1, 2)
        x.parallelize(1, ParallelType.mesh_x)
        fd.add_output(fd.ops.relu(x))
    fd.execute([torch.randn(4, 6)])


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_bad_schedule(case):
    build, words, _ = SCHEDULE_CASES[case]
    with pytest.raises(ScheduleError) as info, FusionDefinition() as fd:
        build(fd)
    assert_says(info.value, words)


# ----------------------------------------------------------------------------------------------
# Bad inputs: each case defines a fusion and returns the inputs execute must refuse.

INPUT_CASES: Cases = {}
input_case = _registrar(INPUT_CASES)


def relu_of(fd, x: TensorView) -> TensorView:
    out = fd.ops.relu(x)
    fd.add_output(out)
    return out


@input_case("got 0 inputs", "takes 1", "T0")
def wrong_number_of_inputs(fd):
    relu_of(fd, matrix(fd))
    return []


@input_case("input T0", "Float", "torch.int64", ".to(torch.float32)")
def wrong_dtype(fd):
    relu_of(fd, matrix(fd))
    return [torch.ones(4, 6, dtype=torch.int64)]


@input_case("input T0", "2 axes", "[4, 6, 1]")
def wrong_rank(fd):
    relu_of(fd, matrix(fd))
    return [torch.randn(4, 6, 1)]


@input_case("input T0", "axis 1", "local extent 5", "the definition says 6")
def wrong_static_extent(fd):
    relu_of(fd, matrix(fd))
    return [torch.randn(4, 5)]


@input_case("input T0", "torch.Tensor", "list")
def a_list_for_a_tensor(fd):
    relu_of(fd, matrix(fd))
    return [[[1.0] * 6] * 4]


@input_case("input T0", "torch.Tensor", "ndarray")
def a_numpy_array_for_a_tensor(fd):
    relu_of(fd, matrix(fd))
    return [torch.randn(4, 6).numpy()]


@input_case("input T1", "cpu", "cuda", "one device", needs_cuda=True)
def inputs_on_different_devices(fd):
    fd.add_output(fd.ops.add(matrix(fd), matrix(fd)))
    return [torch.randn(4, 6, device="cuda"), torch.randn(4, 6)]


@input_case("input T0", "strides [60, 20, 5, 1]", "memory order", "[60, 5, 15, 1]")
def bhse_tensor_for_a_bshe_declaration(fd):
    relu_of(fd, matrix(fd, (2, 3, 4, 5), stride_order=[3, 1, 2, 0]))
    return [torch.randn(2, 3, 4, 5)]


@input_case("input T0", "strides [1, 4]", "dense", "[6, 1]")
def transposed_tensor_for_a_contiguous_declaration(fd):
    relu_of(fd, matrix(fd, contiguity=True))
    return [torch.randn(6, 4).t()]


@input_case("input T0", "axis 0", "broadcast axis", "extent 4")
def broadcast_axis_given_a_larger_extent(fd):
    relu_of(fd, matrix(fd, (1, 6)))
    return [torch.randn(4, 6)]


@input_case("add", "extent 4", "extent 5", "input sizes")
def symbolic_extents_that_disagree(fd):
    fd.add_output(fd.ops.add(matrix(fd, (-1, 6)), matrix(fd, (-1, 6))))
    return [torch.randn(4, 6), torch.randn(5, 6)]


@input_case("matmul", "contracted", "6", "5")
def symbolic_contraction_that_disagrees(fd):
    fd.add_output(fd.ops.matmul(matrix(fd, (4, -1)), matrix(fd, (-1, 3))))
    return [torch.randn(4, 6), torch.randn(5, 3)]


@input_case("input S0", "scalar", "[2]")
def a_tensor_for_a_scalar(fd):
    fd.add_output(fd.ops.mul(matrix(fd), fd.define_scalar(dtype=DataType.Double)))
    return [torch.randn(4, 6), torch.randn(2)]


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=marks) for name, (_, _, marks) in INPUT_CASES.items()]
)
def test_bad_input(case):
    build, words, _ = INPUT_CASES[case]
    with FusionDefinition() as fd:
        inputs = build(fd)
    with pytest.raises(InputError) as info:
        fd.execute(inputs)
    assert_says(info.value, words)


def test_bad_input_then_good_input():
    """A refused input leaves the fusion usable (nothing half-built is cached)."""
    with FusionDefinition() as fd:
        x = relu_of(fd, matrix(fd, (-1, 6)))
    with pytest.raises(InputError):
        fd.execute([torch.randn(4, 5)])
    (out,) = fd.execute([torch.randn(4, 6)])
    assert out.shape == (4, 6) and x.ndim == 2


def test_failing_kernel_is_an_execution_error_naming_the_step():
    """A data-dependent failure of a torch kernel is reported with the step that ran it."""
    with FusionDefinition() as fd:
        x = matrix(fd, dtype=DataType.Int)
        fd.add_output(fd.ops.fmod(x, 0))
    with pytest.raises(ExecutionError) as info:
        fd.execute([torch.ones(4, 6, dtype=torch.int64)])
    assert_says(info.value, ("rank 0", "step 0", "fmod(T0, 0)", "ZeroDivisionError"))


def test_scalar_input_that_is_not_a_number():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2], dtype=DataType.Float)
        scale = fd.define_scalar(dtype=DataType.Double)
        fd.add_output(fd.ops.mul(x, scale))
    with pytest.raises(InputError, match=r"input S0 is a Double scalar; got str"):
        fd.execute([torch.ones(2), "two"])


@pytest.mark.parametrize("kwargs, words", [
    ({"dropout_p": 1.5}, "dropout_p must be a number in [0, 1)"),
    ({"is_causal": "yes"}, "is_causal must be a bool"),
    ({"scale": -1.0}, "scale must be a positive number"),
], ids=["dropout", "causal", "scale"])
def test_attention_scalar_arguments_are_checked_when_added(kwargs, words):
    fd = FusionDefinition()
    q, k, v = (fd.define_tensor([1, 2, 8, 4], dtype=DataType.BFloat16) for _ in range(3))
    args = {"dropout_p": 0.0, "is_causal": True, "scale": None} | kwargs
    with pytest.raises(DefinitionError, match=re.escape(f"sdpfa_fwd: {words}")):
        fd.ops.sdpfa_fwd(q, k, v, **args)
