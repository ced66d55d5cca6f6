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

    def call(x, **kwargs):
        return fn(x if isinstance(x, torch.Tensor) else torch.tensor(x), **kwargs)

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


def pointwise_call(fn, *operands, out_shape=None, **kwargs):
    """``fn(*operands)`` for a pointwise ``fn``, with nvFuser's expanded broadcast axes.

    A new axis of ``broadcast_in_dim`` with an extent above 1 is an expanded broadcast axis:
    its tensor holds that extent as a stride-0 view (every element the same), and a
    pointwise op broadcasts it against any extent. PyTorch broadcasts only extent 1, so each
    stride-0 axis is cut to one element, ``fn`` runs on what is left (each value once), and
    its result is expanded back: along an axis where some operand's values vary, to that
    operand's extent; where all repeat, to their (expanded) extent, as a stride-0 view again.

    ``out_shape`` (the output's local shape, where the runtime gives it) settles two cases
    the operands cannot: an operand's extent 1 may be a rank's one-element shard of an
    unevenly split axis rather than a broadcast (the output has extent 1 there, not the
    expanded operand's; or 0, an empty shard); and operands whose extents above 1 differ along an axis are an
    expanded broadcast made contiguous (a communication's result) beside this rank's shard
    (the operands of another extent than the output's are cut to one element). Only those
    cases read it: a stream loop runs the op on chunks of the shape it gives.
    """
    if out_shape is not None:
        operands = _fitted(operands, out_shape)
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
            if n > 1 and not varying[out]:
                shape[out], varying[out] = n, not repeats
            if repeats:
                x = x.narrow(axis, 0, 1)
        cut.append(x)
    if out_shape is not None and len(out_shape) == ndim:
        shape = [m if m in (0, 1) else n for n, m in zip(shape, out_shape)]
    result = fn(*cut, **kwargs)
    return result.expand(shape) if tuple(result.shape) != tuple(shape) else result


def _fitted(operands: tuple, shape) -> tuple:
    """``operands``, each cut to one element along an axis where the operands' extents
    above 1 differ and its own is not the output's (``shape``, aligned on the right): an
    expanded broadcast axis made contiguous, whose values repeat."""
    tensors = [x for x in operands if isinstance(x, torch.Tensor)]
    if len(tensors) < 2 or not all(x.ndim <= len(shape) for x in tensors):
        return operands
    fitted = []
    for x in operands:
        if isinstance(x, torch.Tensor):
            offset = len(shape) - x.ndim
            for axis, n in enumerate(x.shape):
                out = axis + offset
                others = {t.shape[out - len(shape) + t.ndim] for t in tensors
                          if out - len(shape) + t.ndim >= 0} - {1}
                if len(others) > 1 and n not in (1, shape[out]):
                    x = x.narrow(axis, 0, 1)
        fitted.append(x)
    return tuple(fitted)


def keeps_repeats(fn):
    """``fn`` run through :func:`pointwise_call`, given the output's local shape (its op is
    declared ``needs_out_shape``)."""

    def call(*operands, out_shapes, **kwargs):
        return pointwise_call(fn, *operands, out_shape=out_shapes[0], **kwargs)

    call.__name__ = getattr(fn, "__name__", "call")
    return call
