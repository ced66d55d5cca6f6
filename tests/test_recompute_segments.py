"""Recomputation across fused segments (``meshfuse.runtime.interpreter.recompute``): a cheap
value that a segment reads from an earlier one is computed again in the reader where that
moves fewer bytes.

Checked: a layer norm's centred input and normalized input (float32, the activation's
size), made before a matrix product and read after it, are recomputed after it from the
half-precision input and the statistics that segment reads anyway: the first segment writes
neither, the values are the interpreter's and PyTorch's; the same in the derived backward of
a layer norm feeding a linear layer (gradients against torch autograd); a value whose
recomputation would read more bytes than it moves, or needs an input no longer alive, is not
recomputed; a program without slot sizes is left as it is; frees follow the new last
readers. Compiled with ``aot_eager`` (the segments' graphs as Inductor gets them).
"""

from __future__ import annotations

import itertools

import torch

from meshfuse import DataType, FusionDefinition
from meshfuse.runtime.interpreter.executor import Slot, Step
from meshfuse.runtime.interpreter.fused import FUSED
from meshfuse.runtime.interpreter.recompute import recomputed_in_readers

BACKEND = "aot_eager"
ROWS, COLS, OUT = 16, 32, 8


class _NormProductNorm(FusionDefinition):
    """``(n @ w.T) * c + n + (x + mean) * rstd`` where ``c = x - mean`` and ``n = c * rstd``
    (float32) are made before the product from a bfloat16 ``x``, and read after it with
    ``x`` and the statistics: what a layer norm's recomputation in a backward does."""

    def definition(self) -> None:
        self.x = self.define_tensor([ROWS, COLS], dtype=DataType.BFloat16)
        self.mean = self.define_tensor([ROWS, 1], dtype=DataType.Float)
        self.rstd = self.define_tensor([ROWS, 1], dtype=DataType.Float)
        self.w = self.define_tensor([COLS, COLS], dtype=DataType.BFloat16)
        o = self.ops
        centred = o.sub(o.cast(self.x, DataType.Float), self.mean)
        normed = o.mul(centred, self.rstd)
        product = o.linear(o.cast(normed, DataType.BFloat16), self.w)
        after = o.mul(o.cast(product, DataType.Float), centred)
        # read after the product too (the norm's backward reads x and its statistics)
        shifted = o.mul(o.add(o.cast(self.x, DataType.Float), self.mean), self.rstd)
        self.add_output(o.add(o.add(after, normed), shifted))


def _norm_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16)
    mean = x.float().mean(1, keepdim=True)
    rstd = (x.float().var(1, keepdim=True, unbiased=False) + 1e-5).rsqrt()
    return [x, mean, rstd, torch.randn(COLS, COLS, generator=gen).to(torch.bfloat16)]


def _segments(fd) -> tuple:
    """The fused program of ``fd``'s one signature, and its segments' records."""
    (program, _), = fd._get_runner()._fused.values()
    return program, [s for s in program.steps if s.op == FUSED]


def test_a_norms_centred_and_normalized_input_are_recomputed_after_the_product():
    fd = _NormProductNorm()
    inputs = _norm_inputs()
    want, = fd.execute(inputs, compile=False)
    got, = fd.execute(inputs, compile=BACKEND)
    torch.testing.assert_close(got, want)
    x, mean, rstd, w = inputs
    centred = x.float() - mean
    normed = centred * rstd
    reference = (normed.bfloat16() @ w.T).float() * centred + normed + (x.float() + mean) * rstd
    torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-2)
    program, (before, after) = _segments(fd)
    # the first segment writes the product's bfloat16 operand alone; the second reads x,
    # mean, rstd and the product, and recomputes the float32 values itself
    assert len(before.outputs) == 1
    float_values = {s for s, n in program.slot_bytes.items() if n == ROWS * COLS * 4}
    assert not float_values & set(before.outputs)
    assert not float_values & {a.index for a in after.args}
    assert "recomputed" in after.label
    # the cast of x to float32, the sub and the mul
    assert "3 steps recomputed in later segments" in fd.explain(inputs)


class _NormMlp(FusionDefinition):
    """A layer norm (bfloat16 in and out, float32 inside) feeding ``tanh(h @ w1.T) @ w2.T``:
    in the backward, the norm's output is recomputed for ``w1``'s gradient before the
    product that gives the norm's backward its cotangent."""

    def definition(self) -> None:
        self.x = self.define_tensor([ROWS, COLS], dtype=DataType.BFloat16)
        self.g = self.define_tensor([COLS], dtype=DataType.BFloat16)
        self.w1 = self.define_tensor([OUT, COLS], dtype=DataType.BFloat16)
        self.w2 = self.define_tensor([OUT, OUT], dtype=DataType.BFloat16)
        o = self.ops
        xf = o.cast(self.x, DataType.Float)
        var, mean = o.var_mean(xf, [1], correction=0, keepdim=True)
        normed = o.mul(o.sub(xf, mean), o.rsqrt(o.add(var, 1e-5)))
        h = o.cast(o.mul(normed, o.cast(self.g, DataType.Float)), DataType.BFloat16)
        a = o.cast(o.tanh(o.linear(h, self.w1)), DataType.BFloat16)
        self.add_output(o.linear(a, self.w2))


def test_the_derived_backward_of_a_layer_norm_recomputes_after_the_products():
    """The backward's segment after the input gradient's product reads no float32 value of
    the activation's size from the segment before it; the gradients are torch's."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(COLS, generator=gen)).to(torch.bfloat16)
    w1 = (torch.randn(OUT, COLS, generator=gen) / COLS ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(OUT, OUT, generator=gen) / OUT ** 0.5).to(torch.bfloat16)
    dy = torch.randn(ROWS, OUT, generator=gen).to(torch.bfloat16)
    # (remat="recompute": the norm's output is recomputed, not saved as the default saves it)
    function = _NormMlp().define().as_autograd_function(compile=BACKEND, remat="recompute")
    leaves = [t.clone().requires_grad_() for t in (x, g, w1, w2)]
    got = torch.autograd.grad(function(leaves)[0], leaves, dy)
    ref_leaves = [t.float().requires_grad_() for t in (x, g, w1, w2)]
    rx, rg, rw1, rw2 = ref_leaves
    ref_y = torch.tanh(torch.nn.functional.layer_norm(rx, [COLS], rg, eps=1e-5) @ rw1.T) @ rw2.T
    want = torch.autograd.grad(ref_y, ref_leaves, dy.float())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)
    (compiled,) = function._derivations.values()
    (program, _), = compiled._backward._fused.values()
    segments = [s for s in program.steps if s.op == FUSED]
    assert len(segments) >= 2 and any("recomputed" in s.label for s in segments)
    activation_floats = {s for s, n in program.slot_bytes.items() if n == ROWS * COLS * 4}
    for first, second in itertools.pairwise(segments):
        assert not activation_floats & set(first.outputs) & {a.index for a in second.args}


def _step(op, reads, outputs, free=()):
    return Step(op, tuple(Slot(r) for r in reads), {}, tuple(outputs), tuple(free), op)


def _program():
    """exp(x) -> neg -> tanh (a segment), a product of the tanh, then a segment reading the
    neg and the product; every slot of 4 bytes but where a test says otherwise."""
    steps = [_step("exp", [0], [1]), _step("neg", [1], [2]), _step("tanh", [2], [7]),
             _step("linear", [7, 9], [3], free=[7]), _step("mul", [3, 2], [4], free=[2, 3]),
             _step("abs", [4], [5], free=[4])]
    calls = [torch.exp, torch.neg, torch.tanh, torch.nn.functional.linear, torch.mul,
             torch.abs]
    return steps, calls, [[0, 1, 2], [3], [4, 5]], [True, False, True]


def _x_read_at_the_end(steps, calls, runs, segments):
    """The program with a last step reading x (slot 0): x alive at the reader."""
    return (steps + [_step("abs", [0], [6], free=[0])], calls + [torch.abs], runs + [[6]],
            segments + [False])


def test_recomputes_where_it_moves_fewer_bytes_and_its_inputs_are_alive():
    program = _x_read_at_the_end(*_program())
    # 4 bytes of x read against the 8 of %2 written and read back
    moved = recomputed_in_readers(*program, dict.fromkeys(range(10), 4), {5, 6}, 10)
    reader = [moved.steps[i] for i in moved.runs[2]]
    assert [s.op for s in reader] == ["exp", "neg", "mul", "abs"]
    assert reader[0].args == (Slot(0),) and reader[1].args == (Slot(10),)
    assert reader[2].args == (Slot(3), Slot(11)) and moved.num_slots == 12
    assert reader[2].free == (3,)  # %2 is read by nothing now: the first segment keeps it
    gen = torch.Generator().manual_seed(0)
    inputs = {0: torch.randn(4, 4, generator=gen), 9: torch.randn(4, 4, generator=gen)}
    plain = recomputed_in_readers(*program, {}, {5, 6}, 10)
    torch.testing.assert_close(_run(moved, dict(inputs))[5], _run(plain, dict(inputs))[5])


def test_an_input_only_segments_read_lives_on_to_the_reader():
    """x, last read by the first segment, is read by the reader instead (freed there): no
    library call between reads it, so nothing can have written it in place."""
    steps, calls, runs, segments = _program()
    moved = recomputed_in_readers(steps, calls, runs, segments, dict.fromkeys(range(10), 4),
                                  {5}, 10)
    reader = [moved.steps[i] for i in moved.runs[2]]
    assert [s.op for s in reader] == ["exp", "neg", "mul", "abs"]
    assert reader[0].free == (0,) and 0 not in moved.steps[moved.runs[0][0]].free


def test_a_segment_left_with_nothing_to_do_is_dropped():
    """A segment whose every output is recomputed where it is read (a segment of views
    before attention) runs no more: its steps go, and its input is freed by the reader."""
    steps = [_step("neg", [0], [1]), _step("abs", [1], [2], free=[0]),
             _step("linear", [3, 9], [4], free=[3]), _step("mul", [4, 2], [5], free=[2, 4])]
    calls = [torch.neg, torch.abs, torch.nn.functional.linear, torch.mul]
    moved = recomputed_in_readers(steps, calls, [[0, 1], [2], [3]], [True, False, True],
                                  dict.fromkeys(range(10), 4), {5}, 10)
    assert [[moved.steps[i].op for i in run] for run in moved.runs] == \
        [["linear"], ["neg", "abs", "mul"]]
    reader = [moved.steps[i] for i in moved.runs[1]]
    assert 0 in reader[0].free and reader[2].free == (4,)
    gen = torch.Generator().manual_seed(0)
    inputs = {0: torch.randn(4, 4, generator=gen), 3: torch.randn(4, 4, generator=gen),
              9: torch.randn(4, 4, generator=gen)}
    plain = recomputed_in_readers(steps, calls, [[0, 1], [2], [3]], [True, False, True], {},
                                  {5}, 10)
    torch.testing.assert_close(_run(moved, dict(inputs))[5], _run(plain, dict(inputs))[5])


def test_a_value_only_dead_steps_read_is_freed_where_it_is_made():
    """A product's result read only by a segment whose result nothing reads: the segment
    goes, and the product's result is freed right after the product (not held to the end
    of the program, as a value that nothing reads would be)."""
    steps = [_step("linear", [0, 9], [1]), _step("neg", [1], [2], free=[1]),
             _step("abs", [2], [3], free=[2]), _step("exp", [0], [4], free=[0])]
    calls = [torch.nn.functional.linear, torch.neg, torch.abs, torch.exp]
    moved = recomputed_in_readers(steps, calls, [[0], [1, 2], [3]], [False, True, True],
                                  dict.fromkeys(range(10), 4), {4}, 10)
    assert [s.op for s in moved.steps] == ["linear", "exp"] and moved.dropped == 2
    assert moved.steps[0].free == (1,)


def test_not_recomputed_where_it_costs_more_or_an_input_may_have_changed():
    steps, calls, runs, segments = _program()
    sizes = dict.fromkeys(range(10), 4)
    # x read last by a library call between the segments (which may write it in place)
    between = (steps[:4] + [_step("linear", [0, 9], [8], free=[0])] + steps[4:],
               calls[:4] + [torch.nn.functional.linear] + calls[4:],
               [[0, 1, 2], [3], [4], [5, 6]], [True, False, False, True])
    assert recomputed_in_readers(*between, sizes, {5, 8}, 10).steps == between[0]
    program = _x_read_at_the_end(steps, calls, runs, segments)
    # x alive, but of 32 bytes: more than the 8 that recomputing %2 saves
    assert recomputed_in_readers(*program, {**sizes, 0: 32}, {5, 6}, 10).steps == program[0]
    # %2 also read by a later step outside the segments (4 bytes saved, not 8)
    read_later = (program[0] + [_step("neg", [2], [8])], program[1] + [torch.neg],
                  program[2] + [[7]], program[3] + [False])
    assert recomputed_in_readers(*read_later, sizes, {5, 6, 8}, 10).steps == read_later[0]
    # no sizes: left as it is
    assert recomputed_in_readers(*program, {}, {5, 6}, 10).steps == program[0]
    # a slot defined twice (%2 again, in the first segment): which value would a copy read?
    twice = ([*program[0][:3], _step("abs", [1], [2]), *program[0][3:]],
             [*program[1][:3], torch.abs, *program[1][3:]],
             [[0, 1, 2, 3], [4], [5, 6], [7]], program[3])
    assert recomputed_in_readers(*twice, sizes, {5, 6}, 10).steps == twice[0]


def _run(moved, slots: dict) -> dict:
    """Runs the steps in order on ``slots`` (slot -> value), honouring their frees."""
    for step, call in zip(moved.steps, moved.calls):
        slots[step.outputs[0]] = call(*(slots[a.index] for a in step.args))
        for s in step.free:
            del slots[s]
    return slots


def test_a_long_chain_of_layers_recomputes_in_each_and_keeps_its_values():
    """Thirty layers of ``exp -> neg -> tanh`` (a segment), a product of the tanh, then
    ``product * neg + x`` (a segment): each layer's reader recomputes its neg from x (read
    there anyway) with the frees right (the run below deletes each freed value: a value
    read after its free would fail), and the values are those of the program as it was."""
    steps, calls, runs, segments = [], [], [], []
    x, n, weight = 0, 1, 999
    for _ in range(30):
        a, b, c, p, m, out = n, n + 1, n + 2, n + 3, n + 4, n + 5
        base = len(steps)
        steps += [_step("exp", [x], [a]), _step("neg", [a], [b]), _step("tanh", [b], [c]),
                  _step("linear", [c, weight], [p], free=[c]),
                  _step("mul", [p, b], [m], free=[p, b]), _step("add", [m, x], [out], free=[m, x])]
        calls += [torch.exp, torch.neg, torch.tanh, torch.nn.functional.linear, torch.mul,
                  torch.add]
        runs += [[base, base + 1, base + 2], [base + 3], [base + 4, base + 5]]
        segments += [True, False, True]
        x, n = out, n + 6
    sizes = dict.fromkeys(range(n + 1), 4) | {weight: 4}
    moved = recomputed_in_readers(steps, calls, runs, segments, sizes, {x}, n + 1)
    copies = [s for s in moved.steps if s.label.startswith("recomputed:")]
    assert len(copies) == 60  # exp and neg again in each layer's reader
    gen = torch.Generator().manual_seed(0)
    inputs = {0: torch.randn(4, 4, generator=gen) / 4,
              weight: torch.randn(4, 4, generator=gen) / 4}
    plain = recomputed_in_readers(steps, calls, runs, segments, {}, {x}, n + 1)
    torch.testing.assert_close(_run(moved, dict(inputs))[x], _run(plain, dict(inputs))[x])


class _ScaledNormProduct(FusionDefinition):
    """A value made from a scalar input before a product and read after it."""

    def definition(self) -> None:
        self.x = self.define_tensor([ROWS, COLS], dtype=DataType.BFloat16)
        self.scale = self.define_scalar(dtype=DataType.Float)
        self.w = self.define_tensor([COLS, COLS], dtype=DataType.BFloat16)
        o = self.ops
        scaled = o.mul(o.cast(self.x, DataType.Float), self.scale)
        product = o.linear(o.cast(scaled, DataType.BFloat16), self.w)
        after = o.mul(o.cast(product, DataType.Float), scaled)
        self.add_output(o.add(after, o.cast(self.x, DataType.Float)))


def test_a_value_made_from_a_scalar_input_is_not_recomputed():
    """A segment compiles once per value of its scalar inputs (up to a few, then runs
    uncompiled): a scalar that changes from step to step must not spread to the segments
    that read what it made. The value crosses memory as before."""
    fd = _ScaledNormProduct()
    x, _, _, w = _norm_inputs()
    want, = fd.execute([x, 0.5, w], compile=False)
    got, = fd.execute([x, 0.5, w], compile=BACKEND)
    torch.testing.assert_close(got, want)
    _, (before, after) = _segments(fd)
    assert "recomputed" not in after.label and len(before.outputs) == 2
