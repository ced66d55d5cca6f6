# ruff: noqa: S102 (a program is code: running exactly the lines of its reproduction)
"""Random meshfuse programs for the differential fuzzer (``test_fuzz.py``).

A :class:`Program` is code: each statement is one line of FusionDefinition code and the same
computation as plain torch code, over named values (``t0``, ``t1``...). The generator
(:func:`generate`, seeded) runs the torch line of each statement as it goes, so it knows every
value's global shape and can pick the next op's arguments; then it writes a schedule (meshes,
splits, parallelized axes) for some tensors of the fusion, as tensor-method calls. Running a
program (``fuzz_runner.run_program``) executes the definition and schedule lines into a
FusionDefinition, the torch lines on the global inputs, and compares; :meth:`Program.repro`
prints all of it as one runnable script.

Programs are valid by construction: shapes broadcast, reductions have axes, divisions have
denominators away from zero, and discontinuous ops (comparisons) read only values computed
without a reduction (whose rounding could differ between the sharded and the global run).
"""

from __future__ import annotations

import dataclasses
import math
import random

import fuzz_heads
import fuzz_indexing
import fuzz_overlap
import fuzz_precision
import fuzz_symbolic
import fuzz_typed
import torch

from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType, ScheduleError
from meshfuse.autodiff.derivation import REMAT_POLICIES

UNARY = ["abs", "atan", "cos", "erf", "exp", "neg", "relu", "sigmoid", "silu", "sin", "tanh"]
TORCH_UNARY = {"silu": "torch.nn.functional.silu"}
BINARY = ["add", "maximum", "minimum", "mul", "sub"]
REDUCTIONS = ["max", "mean", "min", "prod", "sum"]
TORCH_REDUCTION = {"max": "torch.amax", "min": "torch.amin", "mean": "torch.mean",
                   "sum": "torch.sum"}
EXTENTS = [2, 4, 8]  # divided by 2 and 4 or not (2 at 4 ranks)
UNEVEN_EXTENTS = [3, 5, 6]
PT = {"x": ParallelType.mesh_x, "y": ParallelType.mesh_y}


@dataclasses.dataclass(frozen=True)
class Features:
    """What the generator may use beyond block shards of divisible extents.

    Attributes:
        uneven: extents the split factor does not divide (uneven shards).
        any_to_any: cyclic (inner) splits, an axis split twice, partial results pinned on
            intermediates (tensors of one op disagree in pattern, not only in axis), and the
            2x2 mesh at 4 ranks (changes over both of its axes at once).
        integers: integer (int64, int32) and boolean inputs, with integer arithmetic,
            reductions (partial integer maxima), comparisons, logical ops, ``where`` on
            them, and casts into the floating-point part of the program.
        extrema: ``add``/``sub`` of two reductions of one kind over the same axes (partial
            maxima, minima or products where the reduced axes are sharded: only partial
            sums may be added before their reduction).
        low_precision: the floating-point inputs in one half-precision dtype (BFloat16 or
            Half, per program; some stay Float), casts down to it, and the torch code
            computing in float32 where meshfuse does (nvFuser's promotion); compared with
            dtype-appropriate tolerances (``fuzz_precision.py``).
        differentiable: programs to differentiate (``test_fuzz_autodiff.py``): no attention
            backward statement (``sdpfa_bwd`` has no derivative), and the torch code detaches
            attention's log-sum-exp, which meshfuse, as PyTorch's attention kernels, does not
            differentiate.
        overlap: stream-parallel loops forced (``fuzz_overlap.py``): more ``linear``/``matmul``
            statements, ``set_overlap(True)`` on their tensors or on random ones, and a drawn
            ``MESHFUSE_OVERLAP_CHUNKS`` while the program is built and run.
        stream_axes: with ``overlap``, some GEMMs' first operand also gets its rows on
            ``ParallelType.stream`` (a loop the user schedules).
        indexing: integer index inputs (in range) and the ops that read them
            (``fuzz_indexing.py``): ``embedding_fwd``, ``take_along_axis``, ``index_select``
            and ``cross_entropy`` on class indices; the schedules split the looked-up axes
            (a vocabulary) like any other.
        symbolic: some programs declare their inputs' extents ``-1`` (symbolic until
            execute), drawn after the rest by a generator of their own
            (``fuzz_symbolic.py``): the same seed's program otherwise.
        heads: grouped-query attention (projected or not), batched matmuls summed over
            their batch, ``linear`` with leading weight axes (``fuzz_heads.py``).
        remat: the derived backward's rematerialization policy drawn per program
            (:attr:`Program.remat`, from ``meshfuse.autodiff.derivation.REMAT_POLICIES``, by a
            generator of its own: the same seed's program otherwise); off: the default.

    Each adds statements to the generator only when on, so that programs drawn without it
    (the seeds of ``test_fuzz_regressions.py``) stay as they were drawn.
    """

    uneven: bool = False
    any_to_any: bool = False
    integers: bool = False
    extrema: bool = False
    differentiable: bool = False
    low_precision: bool = False
    overlap: bool = False
    stream_axes: bool = False
    indexing: bool = False
    symbolic: bool = False
    heads: bool = False
    remat: bool = False


@dataclasses.dataclass
class Value:
    name: str
    tensor: torch.Tensor
    exact: bool  # computed without reductions: comparisons of it are stable
    is_input: bool = False
    broadcast: tuple[bool, ...] = ()  # meshfuse's broadcast axes (extent 1 is not enough)


@dataclasses.dataclass
class Program:
    """A program: inputs, statements, outputs and schedule, all as code lines."""

    seed: int
    world_size: int
    inputs: list[tuple[str, tuple[int, ...]]]
    fd_lines: list[str]
    torch_lines: list[str]
    outputs: list[str]
    schedule: list[str] = dataclasses.field(default_factory=list)
    meshes: dict[str, list] = dataclasses.field(default_factory=dict)
    mode: str = ""
    features: set[str] = dataclasses.field(default_factory=set)
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)  # input -> DataType name
    # input -> its stride_order (nvFuser's: axis i's rank, the outermost highest); absent:
    # contiguous in logical order
    layouts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Features.indexing: index inputs -> the bound of their values, drawn in [0, bound)
    index_high: dict[str, int] = dataclasses.field(default_factory=dict)
    low: str = ""  # Features.low_precision: the program's half-precision DataType name
    overlap_chunks: int = 0  # Features.overlap: MESHFUSE_OVERLAP_CHUNKS of its run (0: unset)
    # Features.symbolic: input -> its declared shape, -1 where symbolic (absent: static)
    symbolic: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    remat: str = "recompute"  # Features.remat: the derived backward's policy

    def dtype(self, name: str) -> str:
        """The DataType name of input ``name`` (Float unless the generator chose another)."""
        return self.dtypes.get(name, "Float")

    def definition_code(self) -> str:
        lines = [f"{n} = fd.define_tensor({self.symbolic.get(n, list(s))}, "
                 f"dtype=DataType.{self.dtype(n)}"
                 + (f", stride_order={self.layouts[n]})" if n in self.layouts else ")")
                 for n, s in self.inputs]
        lines += self.fd_lines
        lines += [f"fd.add_output({o})" for o in self.outputs]
        return "\n".join(lines)

    def mesh_code(self) -> str:
        return "\n".join(f"{n} = DeviceMesh({m})" for n, m in self.meshes.items())

    def repro(self, check: str | None = None) -> str:
        """A runnable script: ``torchrun --nproc-per-node N repro.py`` (or ``python repro.py``
        at world size 1). ``check`` is its end, run with ``reference``, ``inputs``, ``fd``,
        ``compiled``, ``held`` and ``local`` (this rank's shards) defined; default
        :data:`FORWARD_CHECK`, which executes the fusion and compares its outputs."""
        body = "\n".join("    " + line for line in self.torch_lines)
        fd_body = "\n".join("    " + line for line in self.definition_code().split("\n"))
        names = ", ".join(n for n, _ in self.inputs)
        shapes = ", ".join(input_code(list(s), self.dtype(n), self.layouts.get(n),
                                      self.index_high.get(n)) for n, s in self.inputs)
        return f"""# meshfuse fuzz program: seed {self.seed}, world size {self.world_size}, {self.mode}
{fuzz_overlap.repro_lines(self)}import math
import torch
import meshfuse
from meshfuse import DataType, DeviceMesh, FusionDefinition, ParallelType
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.comm.communicator import Communicator


@torch.no_grad()
def reference({names}):
{body}
    return [{", ".join(self.outputs)}]


rank = Communicator.instance().rank
gen = torch.Generator().manual_seed({self.seed})
inputs = [{shapes}]
{self.mesh_code()}
with FusionDefinition() as fd:
{fd_body}
{self.schedule_code()}
compiled = compiled_for(fd.fusion)  # every tensor has its mesh there
held = [compiled[tv].mesh is None or rank in compiled[tv].mesh for tv in fd.fusion.inputs()]
local = [meshfuse.shard_tensor(x, tv, rank) if h else
         torch.empty(x.shape, dtype=x.dtype, device="meta")  # symbolic extents: see execute
         if any(i.extent is None for i in tv.logical) else None
         for x, tv, h in zip(inputs, fd.fusion.inputs(), held)]
{FORWARD_CHECK if check is None else check}"""

    def schedule_code(self) -> str:
        return "\n".join(self.schedule)


FORWARD_CHECK = """outs = fd.execute(local)
for out, ref, tv in zip(outs, reference(*inputs), fd.fusion.outputs()):
    if compiled[tv].mesh is None or rank in compiled[tv].mesh:
        torch.testing.assert_close(out, meshfuse.shard_tensor(ref, tv, rank), rtol=1e-4,
                                   atol=1e-4)
print("rank", rank, "ok")
"""


INPUT_CODE = {
    "Float": "torch.randn({shape}, generator=gen)",
    "Int": "torch.randint(-4, 5, {shape}, generator=gen)",
    "Int32": "torch.randint(-4, 5, {shape}, generator=gen, dtype=torch.int32)",
    "Bool": "torch.rand({shape}, generator=gen) > 0.5",
    "BFloat16": "torch.randn({shape}, generator=gen).bfloat16()",
    "Half": "torch.randn({shape}, generator=gen).half()",
}


def input_code(shape: list[int], dtype: str, stride_order: list[int] | None = None,
               high: int | None = None) -> str:
    """The torch expression drawing a global input of ``shape`` and ``dtype`` from ``gen``,
    laid out by ``stride_order`` (drawn in memory order, then permuted to logical order);
    an index input (``high`` given) has integers in ``[0, high)``."""
    if high is not None:
        torch_dtype = "torch.int32" if dtype == "Int32" else "torch.int64"
        return f"torch.randint(0, {high}, {shape}, generator=gen, dtype={torch_dtype})"
    if stride_order is None:
        return INPUT_CODE[dtype].format(shape=shape)
    memory = sorted(range(len(shape)), key=lambda a: -stride_order[a])  # outermost first
    drawn = INPUT_CODE[dtype].format(shape=[shape[a] for a in memory])
    return f"{drawn}.permute({', '.join(str(memory.index(a)) for a in range(len(shape)))})"


def draw_input(shape: list[int], dtype: str, gen: torch.Generator,
               stride_order: list[int] | None = None, high: int | None = None) -> torch.Tensor:
    return eval(input_code(shape, dtype, stride_order, high), {"torch": torch, "gen": gen})


class _Gen:
    """Builds one program statement by statement (see the module doc)."""

    def __init__(self, rng: random.Random, seed: int, features: Features):
        self.rng = rng
        self.gen = torch.Generator().manual_seed(seed)
        self.uneven = features.uneven
        self.differentiable = features.differentiable
        self.dtypes: dict[str, str] = {}
        self.values: list[Value] = []
        self.inputs: list[tuple[str, tuple[int, ...]]] = []
        self.fd_lines: list[str] = []
        self.torch_lines: list[str] = []
        self.env: dict = {"torch": torch, "math": math}
        self.features: set[str] = set()
        self.unused_outputs: list[str] = []
        self.count = 0
        self.probe = FusionDefinition()  # the definition so far, for meshfuse's axis kinds
        self.probe_env = {"fd": self.probe, "DataType": DataType}
        self.low = ""  # the half-precision dtype of Features.low_precision (fuzz_precision)
        self.index_high: dict[str, int] = {}  # Features.indexing: index inputs' bounds

    # ----- values --------------------------------------------------------------------
    def _name(self) -> str:
        self.count += 1
        return f"t{self.count - 1}"

    def extent(self) -> int:
        pool = EXTENTS + (UNEVEN_EXTENTS if self.uneven else [])
        return self.rng.choice(pool)

    def new_input(self, shape: tuple[int, ...], dtype: str | None = None,
                  high: int | None = None) -> Value:
        """A new input; an index one (integers in ``[0, high)``) with ``high``."""
        dtype = dtype or (fuzz_precision.input_dtype(self) if self.low else "Float")
        name = self._name()
        t = draw_input(list(shape), dtype, self.gen, high=high)
        if high is not None:
            self.index_high[name] = high
        self.env[name] = t
        self.inputs.append((name, tuple(shape)))
        if dtype != "Float":
            self.dtypes[name] = dtype
        self.probe_env[name] = self.probe.define_tensor(list(shape),
                                                        dtype=getattr(DataType, dtype))
        v = Value(name, t, exact=True, is_input=True, broadcast=tuple(e == 1 for e in shape))
        self.values.append(v)
        return v

    def random_input(self, ndim: int | None = None) -> Value:
        ndim = self.rng.randint(1, 3) if ndim is None else ndim
        return self.new_input(tuple(self.extent() for _ in range(ndim)))

    def emit(self, fd: str, torch_code: str, outs: list[str], exact: bool) -> list[Value]:
        """Adds a statement whose outputs are ``outs`` (names), runs its torch code."""
        with torch.no_grad():
            exec(torch_code, self.env)
        exec(fd, self.probe_env)
        if self.low:  # torch's dtypes made meshfuse's; rounding makes floats inexact
            torch_code = fuzz_precision.matched(self, torch_code, outs)
        self.fd_lines.append(fd)
        self.torch_lines.extend(torch_code.split("\n"))
        made = []
        for name in outs:
            kinds = tuple(i.is_broadcast for i in self.probe_env[name].materialized())
            inexact = self.low and self.env[name].is_floating_point()
            v = Value(name, self.env[name], exact and not inexact, broadcast=kinds)
            self.values.append(v)
            made.append(v)
        return made

    def fresh(self, n: int = 1) -> list[str]:
        names = []
        for _ in range(n):
            name = self._name()
            self.env[name] = None
            names.append(name)
        return names

    def pick(self, pred=lambda v: True, dtypes=None) -> Value | None:
        dtypes = dtypes or ((torch.float32, fuzz_precision.LOW[self.low]) if self.low
                            else (torch.float32,))
        choices = [v for v in self.values if v.tensor.dtype in dtypes and pred(v)]
        if not choices:
            return None
        # Prefer recent values, so that programs are chains rather than piles of inputs.
        weights = [1 + i for i in range(len(choices))]
        return self.rng.choices(choices, weights)[0]

    def pick_or_input(self, pred=lambda v: True, ndim=None) -> Value:
        v = self.pick(pred) if self.rng.random() < 0.85 else None
        return v if v is not None else self.random_input(ndim)

    def partner(self, a: Value) -> Value:
        """A value that broadcasts with ``a``: an existing one of its shape, or a new input
        with some axes of extent 1, or fewer axes."""
        shape = tuple(a.tensor.shape)
        same = self.pick(lambda v: tuple(v.tensor.shape) == shape and v is not a)
        if same is not None and self.rng.random() < 0.5:
            return same
        if not shape:
            return self.new_input(())
        new = [1 if self.rng.random() < 0.35 else e for e in shape]
        if self.rng.random() < 0.3:
            new = new[self.rng.randint(1, len(new)):]
        return self.new_input(tuple(new))

    # ----- statements ----------------------------------------------------------------
    def unary(self) -> None:
        x = self.pick_or_input()
        op = self.rng.choice(UNARY)
        (y,) = self.fresh()
        fn = TORCH_UNARY.get(op, f"torch.{op}")
        self.emit(f"{y} = fd.ops.{op}({x.name})", f"{y} = {fn}({x.name})", [y], x.exact)

    def binary(self) -> None:
        a = self.pick_or_input()
        (y,) = self.fresh()
        op = self.rng.choice(BINARY)
        if self.rng.random() < 0.15:
            c = self.rng.choice([0.5, 2.0, -1.5])
            self.emit(f"{y} = fd.ops.{op}({a.name}, {c})",
                      f"{y} = torch.{op}({a.name}, torch.tensor({c}))", [y], a.exact)
            return
        b = self.partner(a)
        if self.rng.random() < 0.5:
            a, b = b, a
        self.emit(f"{y} = fd.ops.{op}({a.name}, {b.name})",
                  f"{y} = torch.{op}({a.name}, {b.name})", [y], a.exact and b.exact)

    def divide(self) -> None:
        a = self.pick_or_input()
        b = self.partner(a)
        d, y = self.fresh(2)
        self.emit(f"{d} = fd.ops.add(fd.ops.abs({b.name}), 1.0)",
                  f"{d} = torch.abs({b.name}) + 1.0", [d], b.exact)
        self.emit(f"{y} = fd.ops.div({a.name}, {d})", f"{y} = torch.div({a.name}, {d})", [y],
                  a.exact and b.exact)

    def where(self) -> None:
        a = self.pick_or_input()
        b = self.partner(a)
        c = self.pick(lambda v: v.exact and _broadcasts(v, a, b)) or \
            self.new_input(tuple(a.tensor.shape))
        cond, y = self.fresh(2)
        d = self.pick(lambda v: v.exact and v.tensor.shape == c.tensor.shape
                      and v.broadcast == c.broadcast)  # else cond may not broadcast
        if d is not None and self.rng.random() < 0.3:
            self.emit(f"{cond} = fd.ops.logical_and(fd.ops.gt({c.name}, 0.0), "
                      f"fd.ops.lt({d.name}, 0.5))",
                      f"{cond} = torch.logical_and({c.name} > 0.0, {d.name} < 0.5)", [cond], True)
        else:
            self.emit(f"{cond} = fd.ops.gt({c.name}, 0.0)", f"{cond} = {c.name} > 0.0", [cond],
                      True)
        self.emit(f"{y} = fd.ops.where({cond}, {a.name}, {b.name})",
                  f"{y} = torch.where({cond}, {a.name}, {b.name})", [y],
                  a.exact and b.exact)

    def cast(self) -> None:
        x = self.pick_or_input()
        mid, y = self.fresh(2)
        dtype, torch_dtype = self.rng.choice([("Double", "float64"), ("BFloat16", "bfloat16")])
        self.emit(f"{mid} = fd.ops.cast({x.name}, DataType.{dtype})",
                  f"{mid} = {x.name}.to(torch.{torch_dtype})", [mid], x.exact)
        self.emit(f"{y} = fd.ops.cast({mid}, DataType.Float)", f"{y} = {mid}.float()", [y],
                  x.exact)

    def reduction(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1)
        n = x.tensor.ndim
        if n == 0:
            x = self.random_input()
            n = x.tensor.ndim
        keep = self.rng.random() < 0.4
        if self.rng.random() < 0.15:
            dims = None
        else:
            dims = sorted(self.rng.sample(range(n), self.rng.randint(1, n)))
        if self.rng.random() < 0.25:
            return self._var_mean(x, dims, keep)
        op = self.rng.choice(REDUCTIONS)
        (y,) = self.fresh()
        self.emit(f"{y} = fd.ops.{op}({x.name}, dims={dims}, keepdim={keep})",
                  f"{y} = {_reduce_code(op, x, dims, keep)}", [y], False)

    def _var_mean(self, x: Value, dims, keep: bool) -> None:
        var, mean = self.fresh(2)
        all_dims = list(range(x.tensor.ndim)) if dims is None else dims
        count = math.prod(x.tensor.shape[d] for d in all_dims)
        correction = self.rng.choice([0, 1]) if count > 1 else 0
        self.emit(f"{var}, {mean} = fd.ops.var_mean({x.name}, dims={dims}, "
                  f"correction={correction}, keepdim={keep})",
                  f"{var}, {mean} = torch.var_mean({x.name}, dim={all_dims}, "
                  f"correction={correction}, keepdim={keep})", [var, mean], False)
        self.features.add("var_mean")

    def reshape(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1)
        shape = list(x.tensor.shape)
        if not shape:
            return
        merge = len(shape) >= 2 and self.rng.random() < 0.5
        if merge:
            a = self.rng.randrange(len(shape) - 1)
            new = shape[:a] + [shape[a] * shape[a + 1]] + shape[a + 2:]
        else:
            splittable = [a for a, e in enumerate(shape) if e >= 4 and e % 2 == 0]
            if not splittable:
                return
            a = self.rng.choice(splittable)
            f = self.rng.choice([f for f in (2, 3, 4) if shape[a] % f == 0 and shape[a] > f])
            new = shape[:a] + [f, shape[a] // f] + shape[a + 1:]
        (y,) = self.fresh()
        self.emit(f"{y} = fd.ops.reshape({x.name}, new_shape={new})",
                  f"{y} = {x.name}.reshape({new})", [y], x.exact)

    def permute(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 2)
        dims = list(range(x.tensor.ndim))
        self.rng.shuffle(dims)
        (y,) = self.fresh()
        self.emit(f"{y} = fd.ops.permute({x.name}, dims={dims})", f"{y} = {x.name}.permute({dims})",
                  [y], x.exact)

    def slice(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1)
        shape = list(x.tensor.shape)
        if not shape:
            return
        starts, ends, steps = [0] * len(shape), list(shape), [1] * len(shape)
        a = self.rng.randrange(len(shape))
        if shape[a] >= 2:
            starts[a] = self.rng.randrange(shape[a] - 1)
            ends[a] = self.rng.randint(starts[a] + 1, shape[a])
            steps[a] = self.rng.choice([1, 1, 2])
        (y,) = self.fresh()
        index = ", ".join(f"{s}:{e}:{st}" for s, e, st in zip(starts, ends, steps))
        self.emit(f"{y} = fd.ops.slice({x.name}, start_indices={starts}, end_indices={ends}, "
                  f"strides={steps})", f"{y} = {x.name}[{index}]", [y], x.exact)

    def cat(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1)
        shape = list(x.tensor.shape)
        if not shape:
            return
        a = self.rng.randrange(len(shape))
        other = shape[:a] + [self.extent()] + shape[a + 1:]
        if 1 in shape:  # a broadcast axis must stay one in both
            other = [1 if e == 1 else o for e, o in zip(shape, other)]
            if shape[a] == 1:
                return
        b = self.new_input(tuple(other), _dtype_name(x))
        (y,) = self.fresh()
        self.emit(f"{y} = fd.ops.cat([{x.name}, {b.name}], dim={a})",
                  f"{y} = torch.cat([{x.name}, {b.name}], {a})", [y], x.exact)

    def matmul(self) -> None:
        x = self.pick_or_input(lambda v: 2 <= v.tensor.ndim <= 3 and 1 not in v.tensor.shape)
        if x.tensor.ndim < 2 or 1 in x.tensor.shape:
            x = self.random_input(2)
        k = x.tensor.shape[-1]
        (y,) = self.fresh()
        if self.rng.random() < 0.5:
            w = self.new_input((self.extent(), k), _dtype_name(x))
            bias = self.new_input((w.tensor.shape[0],), _dtype_name(x)) \
                if self.rng.random() < 0.5 else None
            b = "None" if bias is None else bias.name
            self.emit(f"{y} = fd.ops.linear({x.name}, {w.name}, {b})",
                      f"{y} = torch.nn.functional.linear({x.name}, {w.name}, {b})", [y], False)
        else:
            w = self.new_input((k, self.extent()), _dtype_name(x))
            self.emit(f"{y} = fd.ops.matmul({x.name}, {w.name})",
                      f"{y} = torch.matmul({x.name}, {w.name})", [y], False)

    def softmax(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1)
        if x.tensor.ndim == 0:
            return
        a = self.rng.randrange(x.tensor.ndim)
        m, e, s, y = self.fresh(4)
        self.emit(f"{m} = fd.ops.max({x.name}, dims=[{a}], keepdim=True)",
                  f"{m} = torch.amax({x.name}, dim=[{a}], keepdim=True)", [m], False)
        self.emit(f"{e} = fd.ops.exp(fd.ops.sub({x.name}, {m}))",
                  f"{e} = torch.exp({x.name} - {m})", [e], False)
        self.emit(f"{s} = fd.ops.sum({e}, dims=[{a}], keepdim=True)",
                  f"{s} = torch.sum({e}, dim=[{a}], keepdim=True)", [s], False)
        self.emit(f"{y} = fd.ops.div({e}, {s})", f"{y} = {e} / {s}", [y], False)

    def layer_norm(self) -> None:
        x = self.pick_or_input(lambda v: v.tensor.ndim >= 1 and v.tensor.shape[-1] > 1)
        if x.tensor.ndim == 0 or x.tensor.shape[-1] == 1:
            return
        var, mean, y = self.fresh(3)
        self.emit(f"{var}, {mean} = fd.ops.var_mean({x.name}, dims=[-1], correction=0, "
                  "keepdim=True)",
                  f"{var}, {mean} = torch.var_mean({x.name}, dim=[-1], correction=0, "
                  "keepdim=True)", [var, mean], False)
        self.emit(f"{y} = fd.ops.mul(fd.ops.sub({x.name}, {mean}), "
                  f"fd.ops.rsqrt(fd.ops.add({var}, 1e-5)))",
                  f"{y} = ({x.name} - {mean}) * torch.rsqrt({var} + 1e-5)", [y], False)

    def broadcast(self) -> None:
        x = self.pick_or_input(lambda v: 1 <= v.tensor.ndim <= 2)
        if not 1 <= x.tensor.ndim <= 2:
            return
        shape = list(x.tensor.shape)
        at = self.rng.randint(0, len(shape))
        out = shape[:at] + [self.extent()] + shape[at:]
        dims = [d for d in range(len(out)) if d != at]
        view = shape[:at] + [1] + shape[at:]
        (y,) = self.fresh()
        self.emit(f"{y} = fd.ops.broadcast_in_dim({x.name}, shape={out}, broadcast_dims={dims})",
                  f"{y} = {x.name}.reshape({view}).expand({out})", [y], x.exact)

    def attention(self) -> None:
        b, h = self.rng.choice([1, 2]), self.rng.choice([2, 4])
        s, e = self.rng.choice([4, 8]), self.rng.choice([4, 8])
        skv = self.rng.choice([s, s, 8 if s == 4 else 4])
        causal = s == skv and self.rng.random() < 0.4
        q = self.pick(lambda v: tuple(v.tensor.shape) == (b, h, s, e)) or \
            self.new_input((b, h, s, e))
        k, v = (self.new_input((b, h, skv, e), _dtype_name(q)) for _ in range(2))
        attn, lse, seed, off = self.fresh(4)
        scores = f"({q.name} @ {k.name}.transpose(-2, -1)) / math.sqrt({e})"
        if causal:
            scores += f" + torch.full(({s}, {s}), float('-inf')).triu(1)"
        detached = ".detach()" if self.differentiable else ""
        self.emit(f"{attn}, {lse}, {seed}, {off} = fd.ops.sdpfa_fwd({q.name}, {k.name}, "
                  f"{v.name}, 0.0, {causal}, None)",
                  f"{attn} = torch.nn.functional.scaled_dot_product_attention({q.name}, "
                  f"{k.name}, {v.name}, is_causal={causal})\n"
                  f"{lse} = torch.logsumexp({scores}, -1){detached}\n{seed} = {off} = None",
                  [attn, lse], False)
        self.values = [x for x in self.values if x.name not in (seed, off)]
        self.features.add("sdpa_causal" if causal else "sdpa")
        if self.rng.random() < 0.5 or self.differentiable:
            return
        go = self.new_input((b, h, s, e), _dtype_name(q))
        gq, gk, gv = self.fresh(3)
        leaves = f"_q, _k, _v = ({q.name}.detach().requires_grad_(), " \
                 f"{k.name}.detach().requires_grad_(), {v.name}.detach().requires_grad_())"
        with_grad = (f"with torch.enable_grad():\n    {gq}, {gk}, {gv} = torch.autograd.grad("
                     f"torch.nn.functional.scaled_dot_product_attention(_q, _k, _v, "
                     f"is_causal={causal}), (_q, _k, _v), {go.name})")
        self.emit(f"{gq}, {gk}, {gv} = fd.ops.sdpfa_bwd({go.name}, {q.name}, {k.name}, "
                  f"{v.name}, {attn}, {lse}, 0.0, {causal}, {seed}, {off}, None)",
                  f"{leaves}\n{with_grad}", [gq, gk, gv], False)
        self.unused_outputs.extend([gk, gv])
        self.features.add("sdpa_bwd")

    def integers(self) -> None:
        fuzz_typed.integers(self)

    def extrema(self) -> None:
        fuzz_typed.extrema(self, _reduce_code)

    def downcast(self) -> None:
        fuzz_precision.downcast(self)

    def indexing(self) -> None:
        fuzz_indexing.indexing(self)

    def grouped_attention(self) -> None:
        fuzz_heads.grouped_attention(self)

    def batched_matmul(self) -> None:
        fuzz_heads.batched_matmul(self)

    def lead_linear(self) -> None:
        fuzz_heads.lead_linear(self)


def _dtype_name(v: Value) -> str:
    """The DataType name of ``v``'s dtype (a new operand of an op that does not promote)."""
    return DataType.from_torch(v.tensor.dtype).name


def _reduce_code(op: str, x: Value, dims, keep: bool) -> str:
    """torch's ``op`` reduction of ``x`` over ``dims`` (None: all)."""
    all_dims = list(range(x.tensor.ndim)) if dims is None else dims
    if op != "prod":
        return f"{TORCH_REDUCTION[op]}({x.name}, dim={all_dims}, keepdim={keep})"
    code = x.name
    for d in sorted(all_dims, reverse=True):
        code = f"torch.prod({code}, {d}, keepdim={keep})"
    return code


def _broadcasts(*values: Value) -> bool:
    """Whether meshfuse and torch broadcast ``values`` together: aligned on the right, the
    axes that are not broadcast axes have one extent (meshfuse), and so do the axes of an
    extent other than 1 (torch: an expanded broadcast axis does not broadcast)."""
    ndim = max(v.tensor.ndim for v in values)
    for axis in range(1, ndim + 1):
        present = [v for v in values if v.tensor.ndim >= axis]
        extents = {v.tensor.shape[-axis] for v in present if not v.broadcast[-axis]}
        torch_extents = {v.tensor.shape[-axis] for v in present} - {1}
        if len(extents) > 1 or len(torch_extents) > 1:
            return False
    return True


STATEMENTS = {  # name: weight
    "unary": 5, "binary": 6, "divide": 1, "where": 2, "cast": 1, "reduction": 5,
    "reshape": 2, "permute": 2, "slice": 2, "cat": 1, "matmul": 3, "softmax": 1,
    "layer_norm": 1, "broadcast": 1, "attention": 1,
}


# Statements of the optional features (Features.integers, Features.extrema).
FEATURE_STATEMENTS = {"integers": {"integers": 4}, "extrema": {"extrema": 2},
                      "low_precision": {"downcast": 4}, "indexing": {"indexing": 4},
                      "heads": {"grouped_attention": 6, "batched_matmul": 6, "lead_linear": 6}}


def generate(seed: int, world_size: int, features: Features | None = None) -> Program:
    """A random program (see the module doc), the same on every rank for one seed."""
    features = Features() if features is None else features
    rng = random.Random(seed * 7919 + world_size)
    g = _Gen(rng, seed, features)
    if features.low_precision:
        g.low = rng.choice(list(fuzz_precision.LOW))
    statements = dict(STATEMENTS)
    for feature, extra in FEATURE_STATEMENTS.items():
        if getattr(features, feature):
            statements.update(extra)
    if features.overlap:
        statements["matmul"] = fuzz_overlap.GEMM_WEIGHT
    names, weights = zip(*sorted(statements.items()))
    for _ in range(rng.randint(1, 4)):
        getattr(g, rng.choices(names, weights)[0])()
    if features.overlap and not any(".linear(" in line or ".matmul(" in line
                                    for line in g.fd_lines):
        g.matmul()  # a loop needs a GEMM
    computed = [v for v in g.values if not v.is_input]
    if not computed:
        g.unary()
        computed = [v for v in g.values if not v.is_input]
    outputs = [computed[-1].name]
    extra = [v.name for v in computed[:-1] if v.tensor.dtype == torch.float32
             or v.tensor.dtype == fuzz_precision.LOW.get(g.low)]
    extra += [n for n in g.unused_outputs if n not in outputs]
    if extra and rng.random() < 0.5:
        outputs.append(rng.choice(extra))
    outputs = list(dict.fromkeys(outputs))
    program = Program(seed, world_size, g.inputs, g.fd_lines, g.torch_lines, outputs,
                      features=g.features, dtypes=g.dtypes, low=g.low,
                      index_high=g.index_high)
    from fuzz_schedules import schedule_program

    schedule_program(program, rng, features)
    if features.overlap:
        fuzz_overlap.add_overlap(program, rng, {v.name: v for v in g.values}, features.uneven,
                                 features.stream_axes)
    if features.symbolic:
        fuzz_symbolic.choose(program)
    if features.remat:
        program.remat = random.Random(seed * 7919 + world_size + 1).choice(REMAT_POLICIES)
    return program


def build(program: Program) -> tuple[FusionDefinition, dict]:
    """The program's FusionDefinition, scheduled; and the namespace of its tensors."""
    env = {"DataType": DataType, "DeviceMesh": DeviceMesh, "ParallelType": ParallelType,
           "math": math, "torch": torch}
    exec(program.mesh_code(), env)
    with FusionDefinition() as fd:
        env["fd"] = fd
        exec(program.definition_code(), env)
    exec(program.schedule_code(), env)
    return fd, env


def reference(program: Program, grad: bool = False, double: bool = False
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The global inputs and the outputs computed by plain torch; with ``grad``, the
    floating-point inputs are leaves that require grad and the outputs are recorded by
    autograd (to differentiate with ``torch.autograd.grad``); with ``double``, the float32
    inputs are float64 (the program computes in float64 up to its own casts)."""
    gen = torch.Generator().manual_seed(program.seed)
    env = {"torch": torch, "math": math}
    inputs = []
    for name, shape in program.inputs:
        x = draw_input(list(shape), program.dtype(name), gen, program.layouts.get(name),
                       program.index_high.get(name))
        if double and x.dtype == torch.float32:
            x = x.double()
        env[name] = x.requires_grad_() if grad and x.is_floating_point() else x
        inputs.append(env[name])
    with torch.set_grad_enabled(grad):
        exec("\n".join(program.torch_lines), env)
    return inputs, [env[o] for o in program.outputs]


__all__ = ["Features", "Program", "ScheduleError", "build", "generate", "reference"]
