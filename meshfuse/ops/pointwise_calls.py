"""Calling a torch pointwise function on local tensors as meshfuse's pointwise ops mean it.

A pointwise op's declaration (:mod:`meshfuse.ops.pointwise`) gives its torch function; these
wrappers make that function take what a fusion passes it, where PyTorch's own calling
conventions differ from nvFuser's:

- :func:`pointwise_call` (:func:`keeps_repeats`): nvFuser's expanded broadcast axes, stride-0
  axes of any extent that broadcast like extent 1, each value computed once;
- :func:`in_float`: Half and BFloat16 operands computed in float32 (nvFuser's rule for
  arithmetic), converting at most one operand;
- :func:`numbers_accepted` and :func:`number_as_tensor`: Python numbers in any position, as
  0-d tensors where the torch function takes none.
"""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def in_float(fn):
    """``fn`` with Half and BFloat16 tensor operands computed in float32 (the result is then
    float32, as the shape rule says).

    At most one operand is converted (none where a float32 one decides the promotion
    already): PyTorch's type promotion then computes in float32, reading the other
    half-precision operands as they are (an exact conversion inside the kernel), so the
    result is the one of converting each, without a conversion pass per operand."""

    def call(*operands):
        return fn(*_promoted_once(operands))

    call.__name__ = fn.__name__
    return call


def _promoted_once(operands: tuple) -> list:
    """``operands`` with at most one tensor converted to float32, so that PyTorch's
    promotion computes the op in float32 (see :func:`in_float`)."""
    tensors = [x for x in operands if isinstance(x, torch.Tensor)]
    if not any(x.dtype in _LOW_PRECISION for x in tensors):
        return list(operands)
    # A 0-d tensor does not promote a tensor with axes of the same kind: the operand that
    # decides must have axes, unless none has.
    deciding = [x for x in tensors if x.ndim] or tensors
    if any(x.dtype == torch.float32 for x in deciding):
        return list(operands)
    chosen = [x for x in deciding if x.dtype in _LOW_PRECISION][:1] or \
        [x for x in tensors if x.dtype in _LOW_PRECISION]
    return [x.float() if any(x is c for c in chosen) else x for x in operands]


def number_as_tensor(fn):
    """``fn`` applied to a Python number as a 0-d tensor (a unary op of a scalar)."""

    def call(x):
        return fn(x if isinstance(x, torch.Tensor) else torch.tensor(x))

    call.__name__ = fn.__name__
    return call


def numbers_accepted(fn, number_first: bool, number_second: bool):
    """``fn`` made to accept a Python number in either position.

    A number where ``fn`` takes none becomes a 0-d tensor of the promoted dtype on the other
    operand's device; two numbers become a result tensor, as the shape rule says (a 0-d one).
    """

    def call(a, b):
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a = torch.tensor(a)
        if not isinstance(a, torch.Tensor) and not number_first:
            a = torch.tensor(a, dtype=torch.result_type(a, b), device=b.device)
        if not isinstance(b, torch.Tensor) and not number_second:
            b = torch.tensor(b, dtype=torch.result_type(a, b), device=a.device)
        return fn(a, b)

    call.__name__ = fn.__name__
    return call


def _repeated(x) -> bool:
    """Whether tensor ``x`` has a stride-0 axis of extent above 1 (its values repeat)."""
    return isinstance(x, torch.Tensor) and 0 in x.stride() and \
        any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape))


def pointwise_call(fn, *operands, out_shapes=None, **kwargs):
    """``fn(*operands)`` for a pointwise ``fn``, with nvFuser's expanded broadcast axes.

    A new axis of ``broadcast_in_dim`` with an extent above 1 is an expanded broadcast axis:
    its tensor holds that extent as a stride-0 view (every element the same), and a
    pointwise op broadcasts it against any extent. PyTorch broadcasts only extent 1, so each
    stride-0 axis is cut to one element, ``fn`` runs on what is left (each value once), and
    its result is expanded back: along an axis where some operand's values vary, to that
    operand's extent; where all repeat, to their (expanded) extent, as a stride-0 view again.

    With ``out_shapes`` (the op's local output shape, given where an operand has an expanded
    broadcast axis: ``OpDef.expands_broadcasts``), that shape decides instead of strides: an
    expanded axis may have been materialized (by a communication), and next to a shard its
    local extent (the global one) differs from the output's, which may be 1.
    """
    if out_shapes is not None:
        return _to_shape(fn, operands, tuple(out_shapes[0]), kwargs)
    if not any(_repeated(x) for x in operands):
        return fn(*operands, **kwargs)
    tensors = [x for x in operands if isinstance(x, torch.Tensor)]
    ndim = max(x.ndim for x in tensors)
    shape = [1] * ndim
    varying = [False] * ndim
    cut = []
    for x in operands:
        if not isinstance(x, torch.Tensor):
            cut.append(x)
            continue
        for axis, (n, stride) in enumerate(zip(x.shape, x.stride())):
            out = axis + ndim - x.ndim
            repeats = stride == 0 and n > 1
            if n != 1 and not varying[out]:  # an empty shard (0) varies too
                shape[out], varying[out] = n, not repeats
            if repeats:
                x = x.narrow(axis, 0, 1)
        cut.append(x)
    result = fn(*cut, **kwargs)
    return result.expand(shape) if tuple(result.shape) != tuple(shape) else result


def _to_shape(fn, operands: tuple, shape: tuple[int, ...], kwargs: dict):
    """``fn(*operands)`` computed for a result of local ``shape``: an operand's axis of
    another extent than the result's, and not 1, is an expanded broadcast axis (every
    element the same), cut to one element; the result is expanded to ``shape``."""
    cut = []
    for x in operands:
        if isinstance(x, torch.Tensor):
            for axis, n in enumerate(x.shape):
                if n not in (1, shape[axis + len(shape) - x.ndim]):
                    x = x.narrow(axis, 0, 1)
        cut.append(x)
    result = fn(*cut, **kwargs)
    return result.expand(shape) if tuple(result.shape) != shape else result


def keeps_repeats(fn):
    """``fn`` run through :func:`pointwise_call`."""

    def call(*operands, **kwargs):
        return pointwise_call(fn, *operands, **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    return call
