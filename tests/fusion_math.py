"""Math written with fusion ops, shared by the tests that spell out backward passes."""

import math


def gelu_tanh_derivative(ops, x):
    """d/dx of 0.5 x (1 + tanh(u)), u = c (x + a x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) u'.

    ``ops`` is a FusionDefinition's ``ops``; the result is a tensor of the fusion.
    """
    c, a = math.sqrt(2 / math.pi), 0.044715
    x2 = ops.mul(x, x)
    t = ops.tanh(ops.mul(ops.mul(x, ops.add(ops.mul(x2, a), 1.0)), c))
    du = ops.mul(ops.add(ops.mul(x2, 3 * a), 1.0), c)
    dtanh = ops.mul(ops.mul(ops.sub(1.0, ops.mul(t, t)), du), ops.mul(x, 0.5))
    return ops.add(ops.mul(ops.add(t, 1.0), 0.5), dtanh)
