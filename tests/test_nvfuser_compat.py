"""nvFuser's frontend spellings and semantics: module layout, Communicator methods, dtype
promotion, execute's options and return type, and the ops nvFuser programs use (3-D linear
weights, [DIDx, b, h, s, e] attention, grouped_mm, rfactor), sharded against unsharded."""

import importlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from mesh_helpers import mesh_1d, shard

import meshfuse
from meshfuse import DataType, FusionDefinition, ParallelType, ShardingError
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing import nvfuser_alias

MX = ParallelType.mesh_x


@pytest.fixture(autouse=True)
def same_random_tensors_on_every_rank():
    torch.manual_seed(0)


# ----- module layout ----------------------------------------------------------------------
def test_alias_imports_meshfuse_modules_themselves():
    nvfuser_alias.install()
    try:
        nvfuser_direct = importlib.import_module("nvfuser_direct")
        utils = importlib.import_module("nvfuser_direct.pytorch_utils")
        assert nvfuser_direct is meshfuse
        assert utils is meshfuse.pytorch_utils
        assert utils.torch_dtype_to_nvfuser_dtype(torch.bfloat16) is DataType.BFloat16
        assert utils.torch_dtype_to_nvfuser_dtype(float) is DataType.Double
        assert importlib.import_module("nvfuser").multidevice.DeviceMesh is meshfuse.DeviceMesh
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in nvfuser_alias.ALIASES]:
            del sys.modules[name]


def test_dtype_is_callable_as_in_nvfuser():
    with FusionDefinition() as fd:
        x = fd.define_tensor([2], dtype=DataType.Half)
    assert x.dtype() is DataType.Half is x.dtype


@pytest.mark.mpi
def test_communicator_methods(multidevice_test):
    comm = meshfuse.multidevice.Communicator.instance()
    assert comm is meshfuse.Communicator.instance()
    assert (comm.size(), comm.rank()) == (multidevice_test.size, multidevice_test.rank)
    assert 0 <= comm.local_rank() < comm.local_size() <= comm.size()
    comm.barrier()


# ----- promotion ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16])
def test_low_precision_arithmetic_computes_and_returns_float(dtype):
    with FusionDefinition() as fd:
        a, b = fd.define_tensor([4], dtype=dtype), fd.define_tensor([4], dtype=dtype)
        outs = [fd.ops.add(a, b), fd.ops.mul(a, 3.0), fd.ops.neg(a), fd.ops.exp(a),
                fd.ops.relu(a), fd.ops.abs(a), fd.ops.where(fd.ops.gt(a, b), a, b),
                fd.ops.lt(a, b)]
        for o in outs:
            fd.add_output(o)
    x = torch.tensor([1.0, 2.0, 3.0, 2049.0]).to(dtype.torch_dtype)
    y = torch.tensor([1e-3, 1.0, -1.0, 1.0]).to(dtype.torch_dtype)
    got = fd.execute([x, y])
    float_results = [x.float() + y.float(), x.float() * 3.0, -x.float(), x.float().exp()]
    for out, ref in zip(got, float_results):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref)
    assert [o.dtype for o in got[4:]] == [x.dtype, x.dtype, x.dtype, torch.bool]
    assert [o.dtype.torch_dtype for o in outs] == [o.dtype for o in got]


@pytest.mark.parametrize("op", ["add", "mul", "sub", "div", "atan2", "maximum", "pow"])
@pytest.mark.parametrize("a_shape, b_shape", [([2, 3], [2, 3]), ([2, 3], [2, 1]), ([2, 3], []),
                                              ([], [2, 3]), ([], [])])
@pytest.mark.parametrize("b_dtype", [DataType.BFloat16, DataType.Half, DataType.Float,
                                     DataType.Double, DataType.Int32])
def test_mixed_operands_compute_in_float_as_if_each_were_converted(op, a_shape, b_shape,
                                                                   b_dtype):
    """A BFloat16 operand with another of any dtype and rank (0-d ones too, which PyTorch's
    promotion treats apart): the result is the op on the operands converted to float32
    each, bit for bit (meshfuse converts at most one and lets promotion read the others)."""
    with FusionDefinition() as fd:
        a = fd.define_tensor(a_shape, dtype=DataType.BFloat16)
        b = fd.define_tensor(b_shape, dtype=b_dtype)
        fd.add_output(getattr(fd.ops, op)(a, b))
    x = (torch.randn(a_shape) * 3).bfloat16()
    y = (torch.rand(b_shape) * 3 + 1).to(b_dtype.torch_dtype)
    out, = fd.execute([x, y])

    def widened(t):
        return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t

    expected = getattr(torch, op)(widened(x), widened(y))
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


# ----- execute: options, outputs, CPU scalars --------------------------------------------------
def _relu_fusion():
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.relu(fd.define_tensor([-1])))
    return fd


def test_nvfuser_execute_options_are_ignored_with_one_warning():
    fd = _relu_fusion()
    x = torch.tensor([-1.0, 2.0])
    with pytest.warns(UserWarning, match="disable:compat_test_option"):
        (out,) = fd.execute([x], _disable_options=["compat_test_option"])
    torch.testing.assert_close(out, x.relu())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the second time, no warning
        fd.execute([x], _disable_options=["compat_test_option"])


def test_cpu_scalar_input_beside_other_inputs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        s = fd.define_tensor([], dtype=DataType.Float, is_cpu=True)
        fd.add_output(fd.ops.mul(x, s))
    (out,) = fd.execute([torch.arange(3.0), torch.tensor(2.0)])
    torch.testing.assert_close(out, torch.arange(3.0) * 2)
    with pytest.raises(meshfuse.DefinitionError, match="0-d"):
        FusionDefinition().define_tensor([2], is_cpu=True)


@pytest.mark.mpi
def test_outputs_answer_the_legacy_distributed_tensor_api(multidevice_test):
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([4, 6]), fd.define_tensor([2 * d, 6])
        col = fd.ops.linear(x, w)
        fd.add_output(col)
        fd.add_output(fd.ops.sum(col, [1]))
        x.set_device_mesh(mesh)
        shard(w, 0, mesh)
    gx, gw = (torch.randn(shape).to(multidevice_test.device) for shape in ((4, 6), (2 * d, 6)))
    col, total = fd.execute([gx, multidevice_test.shard_tensor(gw, w)])
    assert col.axis_sharded_on(MX) == 1 and total.axis_sharded_on(MX) == -1
    assert col.mesh == mesh and type(col.local) is torch.Tensor
    ref = F.linear(gx, gw)
    torch.testing.assert_close(col.local, ref.chunk(d, 1)[multidevice_test.rank])
    torch.testing.assert_close(total.local, ref.sum(1))


def test_legacy_device_mesh_shard_tensor_takes_the_rank_third():
    t = torch.arange(8).reshape(4, 2)
    assert meshfuse.DeviceMesh(range(2)).shard_tensor(t, 0, 1).tolist() == [[4, 5], [6, 7]]


# ----- ops nvFuser programs use ----------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("bshe", [False, True], ids=["BHSE", "BSHE"])
def test_attention_with_a_logical_device_axis(multidevice_test, bshe):
    """q/k/v [d, b, h/d, s, e] with the device axis leading: head-parallel attention."""
    d, b, h, s, e = multidevice_test.size, 2, 2 * multidevice_test.size, 16, 8
    order = [4, 3, 1, 2, 0] if bshe else [4, 3, 2, 1, 0]
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        q, k, v, g = (fd.define_tensor([-1, b, h // d, s, e], stride_order=order)
                      for _ in range(4))
        attn, lse, seed, offset = fd.ops.sdpfa_fwd(q, k, v, 0.0, True)
        grads = fd.ops.sdpfa_bwd(g, q, k, v, attn, lse, 0.0, True, seed, offset)
        for o in (attn, *grads):
            fd.add_output(o)
        for t in (q, k, v, g):
            t.set_device_mesh(mesh)
            t.axis(0).parallelize(MX)
    full = [torch.randn(b, h, s, e).to(multidevice_test.device) for _ in range(4)]
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    ref_attn = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref_grads = torch.autograd.grad(ref_attn, leaves, full[3])

    def mine(t):  # [b, h, s, e] -> this rank's [1, b, h/d, s, e] in the declared layout
        t = t.reshape(b, d, h // d, s, e).transpose(0, 1)[multidevice_test.rank:][:1]
        memory = sorted(range(5), key=lambda a: -order[a])
        return t.permute(memory).contiguous().permute([memory.index(a) for a in range(5)])

    outs = fd.execute([mine(t) for t in full])
    for out, ref in zip(outs, (ref_attn.detach(), *ref_grads)):
        torch.testing.assert_close(out, mine(ref), rtol=1e-4, atol=1e-5)


def _grouped_fusion(d):
    g, k, n = 3, 4 * d, 2 * d
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, k])
        w = fd.define_tensor([g, k, n])
        offsets = fd.define_tensor([g], dtype=DataType.Int32)
        fd.add_output(fd.ops.grouped_mm(x, w, offsets))
    return fd, x, w, offsets


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", ["column", "row"])
def test_grouped_mm_sharded(multidevice_test, parallel):
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    fd, x, w, offsets = _grouped_fusion(d)
    for t in (x, w, offsets):
        t.set_device_mesh(mesh)
    if parallel == "column":
        shard(w, 2, mesh)
    else:
        shard(x, 1, mesh)
        shard(w, 1, mesh)
    device = multidevice_test.device
    gx, gw = torch.randn(7, 4 * d).to(device), torch.randn(3, 4 * d, 2 * d).to(device)
    ends = torch.tensor([2, 2, 7], dtype=torch.int32, device=device)  # an empty middle group
    ref = torch.cat([gx[:2] @ gw[0], gx[2:7] @ gw[2]])
    with record_communications() as comms:
        (out,) = fd.execute([multidevice_test.shard_tensor(gx, x),
                             multidevice_test.shard_tensor(gw, w), ends])
    expected = ref.chunk(d, 1)[multidevice_test.rank] if parallel == "column" else ref
    torch.testing.assert_close(out, expected)
    wanted = ["allreduce"] if parallel == "row" and d > 1 else []
    assert [c.kind for c in comms] == wanted


@pytest.mark.mpi
def test_grouped_mm_refuses_sharded_rows(multidevice_test):
    mesh = mesh_1d(multidevice_test)
    if multidevice_test.size == 1:
        pytest.skip("a shard of one device is the whole tensor")
    fd, x, w, offsets = _grouped_fusion(multidevice_test.size)
    for t in (x, w, offsets):
        t.set_device_mesh(mesh)
    shard(x, 0, mesh)
    d, device = mesh.size, multidevice_test.device
    with pytest.raises(ShardingError, match="rows"):
        fd.execute([torch.randn(2, 4 * d, device=device),
                    torch.randn(3, 4 * d, 2 * d, device=device),
                    torch.tensor([1, 2, 2 * d], dtype=torch.int32, device=device)])


@pytest.mark.mpi
@pytest.mark.parametrize("legacy", [False, True], ids=["method", "fd.sched"])
def test_rfactor_makes_the_allreduce_explicit(multidevice_test, legacy):
    """Row-parallel matmul: out [M, N, r{K}] split by d, rfactor'd; the local part partial."""
    d = multidevice_test.size
    mesh = mesh_1d(multidevice_test)
    with FusionDefinition() as fd:
        x, w = fd.define_tensor([3, 4 * d]), fd.define_tensor([4 * d, 5])
        out = fd.ops.matmul(x, w)
        fd.add_output(out)
        shard(x, 1, mesh)
        shard(w, 0, mesh)
        out.outer_split(-1, d)
        local = fd.sched.rfactor(out, [-1]) if legacy else out.rfactor(axes=[-1])
        local.set_device_mesh(mesh)
        local.axis(-2).parallelize(MX)
    assert out.definition.op.name == "set" and local.definition.op.name == "matmul"
    gx, gw = (torch.randn(shape).to(multidevice_test.device) for shape in ((3, 4 * d), (4 * d, 5)))
    with record_communications() as comms:
        (got,) = fd.execute([multidevice_test.shard_tensor(gx, x),
                             multidevice_test.shard_tensor(gw, w)])
    torch.testing.assert_close(got, gx @ gw)
    assert [c.kind for c in comms] == (["allreduce"] if d > 1 else [])


def test_rfactor_refuses_an_iteration_axis():
    with FusionDefinition() as fd:
        out = fd.ops.sum(fd.define_tensor([4, 6]), [1])
        fd.add_output(out)
        with pytest.raises(meshfuse.ScheduleError, match="not a reduction"):
            out.rfactor(axes=[0])


def test_symbolic_sizes_as_shape_arguments():
    """fd.ops.shape/size of symbolic axes in broadcast_in_dim and slice, as nvFuser writes
    a layer norm's affine step and a gating slice."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 3, 4])
        w = fd.define_tensor([4])
        y = fd.ops.mul(x, fd.ops.broadcast_in_dim(w, shape=fd.ops.shape(x), broadcast_dims=[-1]))
        rows, cols = fd.ops.size(x, 0), fd.ops.size(x, 1)
        assert cols == 3 and fd.ops.size(x, 2) == 4
        fd.add_output(fd.ops.slice(y, [0, 0, 1], [rows, cols, 3]))
        fd.add_output(fd.ops.slice(y, [0, -1, 0], [rows, cols, 4]))
    gx, gw = torch.randn(2, 3, 4), torch.randn(4)
    a, b = fd.execute([gx, gw])
    torch.testing.assert_close(a, (gx * gw)[..., 1:3])
    torch.testing.assert_close(b, (gx * gw)[:, -1:])


def test_reshape_of_symbolic_extents():
    """nvFuser programs flatten [-1, -1, e] to [-1, e] (a linear's backward); a split of one
    symbolic axis works too, and a merge with a split of a static axis beside it (resolved
    when defined: tests/test_symbolic_reshape.py)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, 4])
        fd.add_output(fd.ops.reshape(x, [-1, 4]))
        fd.add_output(fd.ops.reshape(fd.define_tensor([-1, 6]), [2, 3, 6]))
        fd.add_output(fd.ops.reshape(x, [-1, 2, 2]))
    gx, gz = torch.randn(2, 3, 4), torch.randn(6, 6)
    a, b, c = fd.execute([gx, gz])
    torch.testing.assert_close(a, gx.reshape(-1, 4))
    torch.testing.assert_close(b, gz.reshape(2, 3, 6))
    torch.testing.assert_close(c, gx.reshape(-1, 2, 2))
