"""Checks shared by the tests of ``meshfuse.parallelize``."""

import torch
from torch.distributed.tensor import DTensor


def check_gradients(model: torch.nn.Module, reference: torch.nn.Module,
                    norm_tolerance: float | None = None) -> None:
    """The parallelized ``model`` has ``reference``'s parameters under their names, each a
    DTensor whose gradient is laid out as it is and whose whole value is ``reference``'s
    (element-wise; or, given ``norm_tolerance``, within it relative to the gradient's norm:
    a model computing in bfloat16 inside, whose roundings float32's reorderings flip)."""
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert p.grad.placements == p.placements, name
        if norm_tolerance is None:
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        else:
            error = (p.grad.full_tensor() - ref.grad).norm() / ref.grad.norm()
            assert error <= norm_tolerance, f"{name}: {error:.1e}"
