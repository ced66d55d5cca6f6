"""While ``torch.profiler`` records, each step of a program is a range named after it
(``meshfuse.runtime.interpreter.step_names``) holding that step's operators; outside a
profile nothing is wrapped, and profiling changes no value nor communication."""

from __future__ import annotations

import pytest
import torch
from test_explain import _mlp  # the README's Megatron MLP (an allreduce at 2 ranks)

from meshfuse import DeviceMesh, FusionDefinition, shard_tensor
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.interpreter.step_names import LONGEST, PREFIX, step_name
from meshfuse.testing.utils import current_device


def _inputs(fd: FusionDefinition, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [shard_tensor(torch.randn([i.extent for i in tv.materialized()], generator=gen),
                         tv, rank).to(current_device()) for tv in fd.fusion.inputs()]


def _program(fd: FusionDefinition):
    (program,) = fd._get_runner()._programs.values()
    return program


def _profiled(call):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = call()
    return result, prof.events()


def _under(event, name: str) -> bool:
    """Whether ``event`` runs inside a range called ``name`` (its CPU parents')."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def test_each_step_is_a_range_holding_its_operators():
    fd = _mlp(DeviceMesh([0]))
    inputs = _inputs(fd, 0)
    plain = fd.execute(inputs)
    program = _program(fd)
    assert program._profiled is None  # nothing wrapped outside a profile
    profiled, events = _profiled(lambda: fd.execute(inputs))
    torch.testing.assert_close(profiled, plain, rtol=0, atol=0)
    names = [step_name(i, len(program.steps), s.label) for i, s in enumerate(program.steps)]
    ranges = [e.name for e in events if e.name.startswith(PREFIX)]
    assert ranges == names
    linear = next(i for i, s in enumerate(program.steps) if s.op == "linear")
    assert "linear" in names[linear]
    products = [e for e in events if e.name in ("aten::addmm", "aten::mm", "aten::linear")]
    assert products and all(any(_under(e, n) for n in names) for e in products)
    assert any(_under(e, names[linear]) for e in products)
    fd.execute(inputs)  # back outside the profile: the plain program again
    assert _program(fd) is program


def test_a_long_label_is_cut_and_names_stay_apart():
    name = step_name(3, 40, "x" * 500)
    assert len(name) == len(f"{PREFIX}3 of 40: ") + LONGEST and name.endswith("...")
    assert step_name(3, 40, "a") != step_name(3, 41, "a")  # another program's step 3


@pytest.mark.mpi
def test_profiling_changes_no_value_nor_communication(multidevice_test):
    size, rank = multidevice_test.size, multidevice_test.rank
    fd = _mlp(DeviceMesh(range(size)))
    inputs = _inputs(fd, rank)
    with record_communications() as plain_comms:
        plain = fd.execute(inputs)
    with record_communications() as profiled_comms:
        profiled, events = _profiled(lambda: fd.execute(inputs))
    torch.testing.assert_close(profiled, plain, rtol=0, atol=0)
    assert profiled_comms == plain_comms
    if size > 1:
        assert [c.kind for c in plain_comms] == ["allreduce"]
        reshard = next(i for i, s in enumerate(_program(fd).steps) if s.op == "reshard")
        steps = len(_program(fd).steps)
        assert any(e.name.startswith(f"{PREFIX}{reshard} of {steps}: ") for e in events)
