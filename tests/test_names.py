"""Names users can follow: ``define_tensor(name=)``, ``FusionModule`` parameter names, and a
derived backward whose tensors are named after their primals (``grad_wq``, ``x.T``), the same
names in its print, its ``explain`` and its errors."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from mesh_helpers import mesh_1d, shard

import meshfuse
from meshfuse import DefinitionError, FusionDefinition, InputError
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.testing.utils import current_device


def _lines(text: str, prefix: str = "  ") -> list[str]:
    """The expression lines of a printed fusion (its domains left out)."""
    return [ln for ln in text.splitlines()
            if ln.startswith(prefix) and not ln.startswith("   ")
            and not re.match(r"  (logical|loop|sharding|allocation|\w+_split|merge)\b", ln)]


def _mlp(names: bool = True):
    """The README's MLP, its input and first weight named ``x`` and ``wq`` (or not)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([8, 16], name="x" if names else None)
        wq = fd.define_tensor([32, 16], name="wq" if names else None)
        w2 = fd.define_tensor([16, 32])
        h = fd.ops.gelu(fd.ops.linear(x, wq), approximate="tanh")
        fd.add_output(fd.ops.linear(h, w2))
    return fd, x, wq, w2


def test_define_tensor_names_print_and_keep_the_automatic_numbers():
    fd, *_ = _mlp()
    assert _lines(str(fd)) == [
        "  input x: tensor",
        "  input wq: tensor",
        "  input T2: tensor",  # numbered as if x and wq were T0 and T1
        "  T3 = linear(x, wq, None)",
        "  T4 = gelu(T3, approximate='tanh')",
        "  T5 = linear(T4, T2, None)",
        "  outputs: T5",
    ]
    rows = fd.explain().splitlines()
    assert rows[3].startswith("  x   ") and rows[6].endswith("linear(x, wq)")


@pytest.mark.parametrize("name, why", [
    ("T3", "automatic"), ("S0", "automatic"), ("", "letters"), ("a b", "letters"),
    ("3x", "letters"), (3, "letters"), ("x(1)", "letters")])
def test_names_that_cannot_name_a_tensor(name, why):
    with FusionDefinition() as fd, pytest.raises(
            DefinitionError, match=f"name={re.escape(repr(name))}.*{why}"):
        fd.define_tensor([2], name=name)


def test_one_name_per_tensor():
    with FusionDefinition() as fd:
        fd.define_tensor([2], name="x")
        with pytest.raises(DefinitionError, match="'x' is taken by another tensor"):
            fd.define_tensor([2], name="x")
        fd.define_tensor([2], name="layers.0.wq")  # a module path names a tensor too


def test_the_derived_backward_names_each_tensor_after_its_primal():
    fd, *_ = _mlp()
    assert _lines(str(meshfuse.vjp(fd, remat="recompute"))) == [
        "  input grad_T5: tensor",  # the cotangent of the output T5
        "  input T2: tensor",  # residuals keep their forward names
        "  input T3: tensor",
        "  input wq: tensor",
        "  input x: tensor",
        "  grad_T4 = matmul(grad_T5, T2)",
        "  T4 = gelu(T3, approximate='tanh')",  # recomputed: the forward's name
        "  grad_T5.T = permute(grad_T5, dims=[1, 0])",
        "  grad_T2 = matmul(grad_T5.T, T4)",
        "  grad_T3 = gelu_backward(grad_T4, T3, approximate='tanh')",
        "  grad_x = matmul(grad_T3, wq)",
        "  grad_T3.T = permute(grad_T3, dims=[1, 0])",
        "  grad_wq = matmul(grad_T3.T, x)",
        "  outputs: grad_x, grad_wq, grad_T2",
    ]


def test_contributions_are_numbered_steps_of_their_gradient():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 3], name="x")
        w = fd.define_tensor([3, 5], name="w")
        y = fd.ops.matmul(fd.ops.mul(x, x), w)
        fd.add_output(fd.ops.sum(fd.ops.add(y, 1.0), [1]))
    assert _lines(str(meshfuse.vjp(fd, remat="recompute")))[3:] == [
        "  grad_T4 = broadcast_in_dim(grad_T5, shape=[-1, 5], broadcast_dims=[0])",
        "  T2 = mul(x, x)",
        "  w.T = permute(w, dims=[1, 0])",
        "  grad_T2 = matmul(grad_T4, w.T)",
        "  T2.T = permute(T2, dims=[1, 0])",
        "  grad_w.1 = matmul(T2.T, grad_T4)",
        "  grad_x.1 = mul(grad_T2, x)",
        "  grad_x.2 = mul(grad_T2, x)",
        "  grad_x = add(grad_x.1, grad_x.2)",
        "  grad_w = broadcast_in_dim(grad_w.1, shape=[-1, 5], broadcast_dims=[0, 1])",
        "  outputs: grad_x, grad_w",
    ]


def test_the_names_do_not_depend_on_which_inputs_are_differentiated():
    # FusionFunction derives for the inputs that require grad: an error of that backward
    # names what print(meshfuse.vjp(fd, wrt)) shows, whatever the subset.
    fd, _x, wq, _ = _mlp()
    lines = _lines(str(meshfuse.vjp(fd, wrt=[wq])))
    assert "  grad_wq = matmul(grad_T3.T, x)" in lines and "  outputs: grad_wq" in lines
    assert not any("grad_x" in ln for ln in lines)


def test_automatic_names_of_the_compiled_backward_never_repeat_a_given_one():
    fd, *_ = _mlp(names=False)
    bwd = meshfuse.vjp(fd)  # its residuals are named T0..T3 as in the forward
    compiled = bwd.compiled().fusion
    names = [tv.name for tv in compiled.tensors()]
    assert len(names) == len(set(names)), names
    assert {"T0", "T1", "T2", "T3", "grad_T0", "grad_T5"} <= set(names)


def test_an_error_of_the_backward_names_what_its_print_and_explain_show():
    fd, *_ = _mlp()
    bwd = meshfuse.vjp(fd, remat="recompute")  # (its inputs: those listed above)
    args = [torch.randn(8, 16), torch.randn(16, 32), torch.randn(8, 32),
            torch.randn(32, 15), torch.randn(8, 16)]  # wq with 15 columns, not 16
    with pytest.raises(InputError, match="input wq axis 1") as error:
        bwd.execute(args)
    text = bwd.explain(args)  # the plan, then the same reason
    assert text.splitlines()[-1] == f"no program for these inputs on rank 0: InputError: " \
        f"{error.value}"
    assert "  wq " in text and "  input wq: tensor" in str(bwd)


def test_a_fusion_module_names_its_parameter_inputs():
    fd, _x, wq, w2 = _mlp()
    layer = meshfuse.FusionModule(fd, {"w_up": (wq, torch.randn(32, 16)),
                                       "w_down": (w2, torch.randn(16, 32))})
    # x and wq keep the names define_tensor gave; w2 takes its parameter's
    assert [v.name for v in fd.fusion.inputs()] == ["x", "wq", "w_down"]
    assert "  outputs: grad_x, grad_wq, grad_w_down" in _lines(str(meshfuse.vjp(fd)))
    out = layer(torch.randn(8, 16))
    out.sum().backward()
    assert layer.w_down.grad.shape == (16, 32) and layer.w_up.grad.shape == (32, 16)


def test_a_fusion_module_leaves_names_it_cannot_give():
    fd, _x, wq, w2 = _mlp(names=False)
    meshfuse.FusionModule(fd, {"T7": (wq, torch.randn(32, 16)), "w": (w2, torch.randn(16, 32))})
    assert [v.name for v in fd.fusion.inputs()] == ["T0", "T1", "w"]


@pytest.mark.mpi
def test_a_sharded_backward_explains_and_runs_with_the_names(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    mesh = mesh_1d(multidevice_test)
    fd, x, wq, w2 = _mlp()
    shard(wq, 0, mesh)  # column-parallel, then row-parallel
    shard(w2, 1, mesh)
    bwd = meshfuse.vjp(fd)
    text = bwd.explain()
    assert text == meshfuse.vjp(fd, world_size=size).explain(world_size=size, rank=rank)
    listed = [ln for ln in text.splitlines() if " = reshard(" in ln and "over mesh axis" in ln]
    # the input gradient of the column-parallel linear is summed over the ranks
    assert [ln.split(":")[0] for ln in listed] == (
        ["  grad_x = reshard(" + ln.split("reshard(")[1].split(")")[0] + ")" for ln in listed])
    assert len(listed) == (1 if size > 1 else 0)
    gen = torch.Generator().manual_seed(0)
    gx, gq, g2 = (torch.randn(*s, generator=gen)
                  for s in ((8, 16), (32, 16), (16, 32)))
    local = [multidevice_test.shard_tensor(t, tv).to(current_device()).requires_grad_()
             for t, tv in ((gx, x), (gq, wq), (g2, w2))]
    f = fd.as_autograd_function()
    out, = f(local)
    with record_communications() as comms:
        out.sum().backward()
    assert Counter(c.kind for c in comms) == (Counter(allreduce=1) if size > 1 else Counter())
    ref = [t.clone().requires_grad_() for t in (gx, gq, g2)]
    torch.nn.functional.linear(torch.nn.functional.gelu(
        ref[0] @ ref[1].T, approximate="tanh"), ref[2]).sum().backward()
    for got, want, tv in zip(local, ref, (x, wq, w2)):
        torch.testing.assert_close(got.grad.cpu(), multidevice_test.shard_tensor(want.grad, tv))


def test_names_survive_the_clone_of_the_forward():
    fd, *_ = _mlp()
    bwd = meshfuse.vjp(fd, remat="recompute")
    assert [v.name for v in bwd.forward.fusion.inputs()] == ["x", "wq", "T2"]
    assert [v.name for v in bwd.forward.fusion.outputs()] == ["T5", "T3"]  # T3: a residual


def test_op_results_named_by_name():
    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 3], name="x")
        wq = fd.define_tensor([5, 3], name="wq")
        q = fd.ops.linear(x, wq, name="q")
        var, _ = fd.ops.var_mean(q, [1], keepdim=True, name=["var", None])
        fd.add_output(fd.ops.rms_norm(fd.ops.add(q, var), name="y"))  # a composite's result
    lines = _lines(str(fd))
    assert lines[2:4] == ["  q = linear(x, wq, None)",
                          "  var, T4 = var_mean(q, dims=[1], correction=1, keepdim=True)"]
    assert lines[-2:] == ["  y = mul(T5, T9)", "  outputs: y"]
    backward = _lines(str(meshfuse.vjp(fd)))
    assert backward[0] == "  input grad_y: tensor"
    assert "  grad_q = add(grad_T5, grad_q.5)" in backward
    assert "  grad_wq = matmul(grad_q.T, x)" in backward


@pytest.mark.parametrize("name, match", [
    (["a", "b"], "gives 2 names to 1 outputs"), ("T9", "name='T9' cannot name a tensor"),
    ("x", "'x' is taken by another tensor")])
def test_bad_op_result_names(name, match):
    with FusionDefinition() as fd:
        x = fd.define_tensor([4], name="x")
        with pytest.raises(DefinitionError, match=match):
            fd.ops.neg(x, name=name)
