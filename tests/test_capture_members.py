"""``NamedMembers``: a parallelized module's parameters and buffers by name, found once and
read where they live, as ``named_parameters``/``named_buffers`` give them after any change."""

from __future__ import annotations

import torch

from meshfuse.capture.members import NamedMembers


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(2)])
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(3))


def _expected(module: torch.nn.Module) -> tuple[dict, dict]:
    return (dict(module.named_parameters(remove_duplicate=False)),
            dict(module.named_buffers(remove_duplicate=False)))


def _same(got: tuple[dict, dict], want: tuple[dict, dict]) -> bool:
    return all(g.keys() == w.keys() and all(g[k] is w[k] for k in w)
               for g, w in zip(got, want))


def test_members_follow_every_change_of_the_module():
    model, members = _Tied(), NamedMembers()
    assert _same(members.read(model), _expected(model))
    assert "head.weight" in members.read(model)[0]  # a tied weight under each name
    model.layers[1].weight = torch.nn.Parameter(torch.zeros(3, 3))  # replaced in place
    assert _same(members.read(model), _expected(model))
    model.layers[0] = torch.nn.Linear(3, 3)  # a submodule replaced
    assert _same(members.read(model), _expected(model))
    model.layers[0].weight.data = torch.ones(3, 3)  # new values, the same tensor
    assert _same(members.read(model), _expected(model))
    del model.layers[1].bias  # deleted: no registration hook runs
    assert _same(members.read(model), _expected(model))
    model.layers[0].bias = None
    assert _same(members.read(model), _expected(model))
    model.scale = torch.full((3,), 2.0)  # a buffer replaced
    assert _same(members.read(model), _expected(model))
    model.layers.append(torch.nn.Linear(3, 3))
    assert _same(members.read(model), _expected(model))
    model.layers[2].register_parameter("extra", torch.nn.Parameter(torch.ones(1)))
    assert _same(members.read(model), _expected(model))
    other = _Tied()
    assert _same(members.read(other), _expected(other))


def test_members_install_no_process_wide_hook():
    """Regression (an H200 run, 2026-12-04): a registration hook counting changes made
    ``torch.compile`` of a ``transformers`` Llama in the same process recompile at every
    step (its forward slices its layer list, which registers a new container), then fall
    back to eager at the recompile limit."""
    from torch.nn.modules import module as torch_module

    hooks = [torch_module._global_module_registration_hooks,
             torch_module._global_parameter_registration_hooks,
             torch_module._global_buffer_registration_hooks]
    before = [len(h) for h in hooks]
    model = _Tied()
    NamedMembers().read(model)
    assert [len(h) for h in hooks] == before


def test_the_members_make_no_reference_cycle():
    """The members' places hold the submodules weakly: a parallelized module whose members
    were read is freed when its last reference goes, as before (strong ones made a cycle
    through its own state, left to the garbage collector)."""
    import weakref

    import meshfuse

    model = meshfuse.parallelize(torch.nn.Sequential(torch.nn.Linear(3, 3)),
                                 meshfuse.DeviceMesh([0]), {})
    model._meshfuse.members.read(model)
    alive = weakref.ref(model)
    del model
    assert alive() is None
