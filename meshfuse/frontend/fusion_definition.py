"""``FusionDefinition``: define a fusion with global shapes, schedule it, execute it.

Two styles, one semantics (docs/design.md, section 2)::

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.relu(x))
    out, = fd.execute([torch.randn(4, 8)])

    class Model(FusionDefinition):
        def definition(self):            # uses self.define_tensor, self.ops.*
            ...
        def multidevice_schedule(self):  # optional; uses self.sched.* or tensor methods
            ...
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, Self

import torch

from meshfuse.autodiff.derivation import DEFAULT_REMAT
from meshfuse.autodiff.function import FusionFunction
from meshfuse.dtypes import DataType
from meshfuse.engine.explaining import BUILD_FAILURES, preview, unbuilt
from meshfuse.engine.runner import FusionRunner
from meshfuse.errors import DefinitionError, InputError
from meshfuse.frontend.options import ignored_options
from meshfuse.frontend.outputs import Sharding, as_distributed
from meshfuse.frontend.schedule import Schedule
from meshfuse.ir.fusion import Fusion, checked_name
from meshfuse.ir.iter_domain import IterDomain, IterType
from meshfuse.ir.tensor_view import Allocation, Scalar, TensorView
from meshfuse.ops.namespace import Ops, scalar_dtype
from meshfuse.ops.user_tensor import UserTensorView
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.interpreter.agreement import agreed_build


class FusionDefinition:
    """A fusion under construction, and the entry point to run it.

    ``execute`` builds on first use (runs ``definition``/``multidevice_schedule`` of a
    subclass, checks the schedule, derives layouts), then caches one per-rank program per
    input signature.
    """

    def __init__(self) -> None:
        self.fusion = Fusion()
        self.ops = Ops(self.fusion)
        self.sched = Schedule()
        self._defined = False
        self._open = False  # inside ``with FusionDefinition() as fd:``
        self._runner = None
        self._shardings = None

    @classmethod
    def from_fusion(cls, fusion: Fusion, runner=None) -> Self:
        """A definition of an existing fusion (one a transformation built, such as the
        backward from :func:`meshfuse.vjp`); it prints, explains and executes like any.
        ``runner``: the fusion's runner, when it was already compiled."""
        fd = cls()
        fd.fusion = fusion
        fd.ops = Ops(fusion)
        fd._defined = True
        fd._runner = runner
        return fd

    # ----- the two styles ----------------------------------------------------------------
    def __enter__(self) -> Self:
        self._open = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._open = False
        self._defined = True

    def definition(self) -> None:
        """Override in a subclass to define the fusion with ``self.define_tensor``, ``self.ops``."""

    def multidevice_schedule(self) -> None:
        """Override in a subclass to schedule tensors (``self.sched.*`` or tensor methods)."""

    def define(self) -> FusionDefinition:
        """Runs ``definition()`` and ``multidevice_schedule()`` of a subclass once (``execute``
        does it too); call it to get at the tensors (``self.q``...) before executing."""
        if not self._defined:
            self.definition()
            self.multidevice_schedule()
            self._defined = True
        return self

    # ----- definition --------------------------------------------------------------------
    def define_tensor(
        self,
        shape: Sequence[int] = (),
        contiguity: bool | Sequence[bool | None] | None = None,
        dtype: DataType = DataType.Float,
        stride_order: Sequence[int] | None = None,
        symbolic_sizes: Sequence[int] | None = None,
        is_cpu: bool = False,
        name: str | None = None,
    ) -> TensorView:
        """Declares a tensor input of the fusion with its *global* shape.

        Args:
            shape: one entry per axis: ``-1`` symbolic (bound at execute), ``1`` a broadcast
                axis, any other positive value a static global extent.
            contiguity: ``True`` if a dimension's stride must be dense, ``False``/``None`` if it
                may be larger; one flag for all, or one per axis *in memory order* (outermost
                first). Default: any strides that follow ``stride_order``.
            dtype: the element type.
            stride_order: ``stride_order[i]`` is the rank of axis ``i`` counted from the
                innermost (``0`` = smallest stride); default row-major ``[n-1, ..., 0]``.
                ``[3, 1, 2, 0]`` on ``[b, h, s, e]`` is the BSHE layout.
            symbolic_sizes: nvFuser's older name for ``shape``.
            is_cpu: a 0-d tensor that stays on the CPU while the other inputs are on a GPU
                (a scalar such as an RNG seed, as nvFuser takes it); only 0-d tensors can be.
            name: what prints, errors and ``explain`` call the tensor (``"wq"``), and after
                which a derived backward names its gradient (``grad_wq``); default ``T<n>``.
                Letters, digits, ``_`` and ``.``, not of the form ``T<n>``, one per tensor.

        Returns:
            The TensorView, also appended to the fusion's inputs.
        """
        shape = list(symbolic_sizes if symbolic_sizes is not None else shape)
        if not isinstance(dtype, DataType):
            raise DefinitionError(f"define_tensor: dtype must be a DataType, got {dtype!r}")
        ids = []
        for axis, extent in enumerate(shape):
            if not isinstance(extent, int) or isinstance(extent, bool) or extent == 0 or extent < -1:
                raise DefinitionError(
                    f"define_tensor: shape entry {axis} is {extent!r}; use -1 (symbolic), 1 "
                    "(broadcast) or a positive global extent"
                )
            if extent == 1:
                ids.append(IterDomain(1, IterType.Broadcast))
            else:
                ids.append(IterDomain(None if extent == -1 else extent))
        if is_cpu and shape:
            raise DefinitionError(
                f"define_tensor: is_cpu=True is for 0-d scalar tensors, got shape {shape}; "
                "declare a CPU tensor with shape=[]"
            )
        order = self._memory_order(len(shape), stride_order)
        contig = self._contiguity(len(shape), contiguity)
        allocation = Allocation(
            tuple(ids[a] for a in order),
            tuple(None if ids[a].is_broadcast else c for a, c in zip(order, contig)),
        )
        tv = UserTensorView(self.fusion, ids, dtype, allocation)
        tv.is_cpu = bool(is_cpu)
        self.fusion.add_input(tv)
        if name is not None:
            self.fusion.set_name(tv, checked_name(name))
        return tv

    def from_pytorch(self, t: torch.Tensor, static_sizes: bool = False,
                     name: str | None = None) -> TensorView:
        """A tensor input shaped like ``t`` (symbolic extents unless ``static_sizes``), with
        its dtype and memory order (and ``name``, as ``define_tensor`` takes it)."""
        order = sorted(range(t.ndim), key=lambda a: (t.stride(a), -a))
        stride_order = [order.index(a) for a in range(t.ndim)]
        shape = [(e if static_sizes or e == 1 else -1) for e in t.shape]
        return self.define_tensor(shape, dtype=DataType.from_torch(t.dtype),
                                  stride_order=stride_order, name=name)

    @staticmethod
    def _memory_order(ndim: int, stride_order: Sequence[int] | None) -> list[int]:
        if stride_order is None:
            return list(range(ndim))
        stride_order = list(stride_order)
        if sorted(stride_order) != list(range(ndim)):
            raise DefinitionError(
                f"define_tensor: stride_order {stride_order} must be a permutation of "
                f"range({ndim}) (one rank per axis, 0 = innermost)"
            )
        return sorted(range(ndim), key=lambda a: -stride_order[a])

    @staticmethod
    def _contiguity(ndim: int, contiguity) -> list[bool]:
        if contiguity is None or isinstance(contiguity, bool):
            return [bool(contiguity)] * ndim
        contiguity = list(contiguity)
        if len(contiguity) != ndim:
            raise DefinitionError(
                f"define_tensor: contiguity has {len(contiguity)} entries for {ndim} axes; give "
                "one per axis in memory order, or one bool"
            )
        return [bool(c) for c in contiguity]

    def define_scalar(self, value: Any = None, dtype: DataType | None = None) -> Scalar:
        """A scalar: a constant when ``value`` is given, else an input of the fusion (bound
        from ``execute``'s inputs, in definition order with the tensors)."""
        if dtype is None:
            if value is None:
                raise DefinitionError("define_scalar: a scalar input needs a dtype")
            dtype = scalar_dtype(value)
        if not isinstance(dtype, DataType):
            raise DefinitionError(f"define_scalar: dtype must be a DataType, got {dtype!r}")
        s = Scalar(dtype, value)
        return self.fusion.add_constant(s) if value is not None else self.fusion.add_input(s)

    def add_output(self, tv: TensorView) -> None:
        """Marks ``tv`` as an output; ``execute`` returns outputs in the order added."""
        if not isinstance(tv, TensorView) or tv.fusion is not self.fusion:
            raise DefinitionError(
                f"add_output: {tv!r} is not a tensor of this fusion; pass a value returned by "
                "define_tensor or fd.ops of this FusionDefinition"
            )
        if tv.definition is None and tv not in self.fusion.inputs():
            raise DefinitionError(f"add_output: {tv.name} is not produced by the fusion")
        self.fusion.add_output(tv)

    # ----- running -----------------------------------------------------------------------
    def execute(
        self,
        inputs: Sequence[Any],
        *,
        device: Any = None,
        save_repro_inputs: bool = False,
        _enable_options: Sequence[str] = (),
        _disable_options: Sequence[str] = (),
        **options,
    ) -> list[torch.Tensor]:
        """Runs the fusion on this rank's local shards of ``inputs``; returns local outputs.

        Each output is a :class:`~meshfuse.frontend.outputs.DistributedTensor`: this rank's
        ``torch.Tensor``, which also has nvFuser's legacy ``.local``, ``.mesh`` and
        ``.axis_sharded_on(pt)``. With DTensor inputs, the outputs are DTensors (see
        :mod:`meshfuse.dtensor`).

        Args:
            inputs: tensors (this rank's shards, laid out as the schedule says) and scalar
                values, in the order they were defined; or DTensors, whose placements give
                the schedule of each unscheduled input.
            device, save_repro_inputs, _enable_options, _disable_options: nvFuser's options,
                accepted so that its programs run; they have no meaning here (the inputs'
                device is the device) and are ignored, with a warning naming them once.
            options: ``check_ranks`` (default True, or ``$MESHFUSE_CHECK_RANKS``; ``0``
                turns it off): when the fusion is built and on the first call with each new
                input signature, the ranks compare the fusion (ops, meshes, schedules) and
                the inputs' dtypes and global shapes in one small collective, and an error
                any rank raises before running is raised on every rank (see
                ``docs/reliability.md``); cached calls communicate nothing for it.
                ``timeout`` (seconds; default ``$MESHFUSE_TIMEOUT`` or 300): how long a
                collective may wait for the other ranks before every rank still running
                raises CommunicationError naming the step and the missing rank.
                ``cuda_graph=True`` captures this rank's program into a CUDA graph on the first
                call with these input shapes (and scalar values) and replays it afterwards:
                one launch instead of one per op, for programs whose time is mostly launch
                overhead. Inputs are copied in and outputs copied out, so results are never
                overwritten by a later call; the graph keeps one run's memory while cached.
                Every rank must pass the same option. CUDA tensors only.
                By default (``cuda_graph=None`` or ``"auto"``), a cached call on CUDA
                replays the program from a CUDA graph without copies where that is safe (no
                communication, no random numbers, inputs where a captured call had them, no
                earlier result still held; otherwise the interpreter runs); ``False`` (or
                ``MESHFUSE_CUDA_GRAPH=0`` for every program) turns it off. See
                docs/fusion.md.
                ``compile=True`` runs each run of fusible ops (pointwise, reductions, shape
                ops) as one segment compiled by ``torch.compile`` (Inductor), cached per input
                signature; a string names another torch.compile backend; ``False`` the
                interpreter; the default comes from ``MESHFUSE_COMPILE`` (unset:
                ``"auto"``, Inductor on CUDA tensors, the interpreter on CPU ones). See
                docs/fusion.md.
        """
        self._check_finished("execute")
        if device is not None or save_repro_inputs or _enable_options or _disable_options:
            ignored_options(device=device, save_repro_inputs=save_repro_inputs,
                            _enable_options=_enable_options, _disable_options=_disable_options)
        if _may_hold_dtensors():
            dtensor = importlib.import_module("meshfuse.dtensor")  # deferred: see below
            if dtensor.has_dtensors(inputs):
                return dtensor.execute_with_dtensors(self, inputs, **options)
        runner = self._get_runner(options.get("check_ranks"))
        if self._shardings is None:
            compiled = runner.compiled
            self._shardings = [Sharding(compiled[tv]) for tv in self.fusion.outputs()]
        return as_distributed(runner.execute(inputs, **options), self._shardings)

    @property
    def built(self) -> bool:
        """Whether the fusion was compiled (by ``execute``, ``explain`` or ``compiled``):
        from then on its schedule is fixed."""
        return self._runner is not None

    def _check_finished(self, method: str) -> None:
        if self._open:
            raise DefinitionError(
                f"{method} called inside the `with FusionDefinition() as fd:` block: the "
                f"definition is not finished yet; call fd.{method}(...) after the block"
            )

    def _get_runner(self, check_ranks: bool | None = None) -> FusionRunner:
        """The runner, built on first use on every rank alike (see
        :func:`~meshfuse.runtime.interpreter.agreement.agreed_build`)."""
        if self._runner is None:
            self.define()
            communicator = None
            if any(tv.mesh is not None for tv in self.fusion.tensors()):
                communicator = Communicator.instance()
            self._runner = agreed_build(communicator, self.fusion,
                                        lambda: FusionRunner(self.fusion), check_ranks)
        return self._runner

    def compiled(self):
        """The fusion as compiled for this process's world (built on first use, as
        ``execute`` does): a :class:`~meshfuse.passes.pipeline.CompiledFusion`, whose
        ``[tv]`` gives the compiled counterpart of a tensor of this definition (its
        propagated sharding, the communications around it). The definition itself is never
        changed by compiling."""
        return self._get_runner().compiled

    def as_autograd_function(self, wrt: Sequence[TensorView] | None = None,
                             remat: str = DEFAULT_REMAT,
                             keep_residuals: bool = False,
                             compile: bool | str | None = None) -> FusionFunction:
        """This fusion as a ``torch.autograd.Function``: a callable taking the inputs
        ``execute`` takes and returning its outputs, whose ``backward`` runs the derived
        backward fusion (``meshfuse.vjp``).

        Args:
            wrt: the inputs that may get gradients (default: every floating-point tensor
                input); one gets a gradient when its tensor requires grad.
            remat: ``"recompute_fused"`` (default: the cheap pointwise and shape results
                that the forward's fused kernels never write to memory are recomputed in
                the backward; a matrix product's operands are saved; matrix products and
                collectives never run again), ``"recompute"`` (every cheap result
                recomputed, for less memory),
                ``"recompute_gathers"`` (the forward's collectives too) or ``"save"`` (every
                intermediate the backward reads is saved).
            keep_residuals: keep what the backward reads until the autograd node dies, so
                that it may backward more than once (``retain_graph=True``); by default the
                backward frees each saved value after its last use, and runs once.
            compile: how the forward and backward programs run, as ``execute``'s
                ``compile`` (default ``MESHFUSE_COMPILE``, unset: Inductor's fused segments
                on CUDA, the interpreter on the CPU; True: Inductor everywhere).

        Example:
            >>> f = fd.as_autograd_function()
            >>> out, = f([x.requires_grad_(), w.requires_grad_()])
            >>> out.sum().backward()   # x.grad, w.grad: this rank's shards, laid out alike

        Gradients follow DTensor's semantics of replicas: a replicated output's cotangent is
        the same on every rank and stands for the one global cotangent; a replicated input's
        gradient comes back complete on every rank; a sharded input's as this rank's shard.
        """
        self.define()
        return FusionFunction(self.fusion, wrt, remat, keep_residuals, compile)

    def explain(self, inputs: Sequence[Any] | None = None, verbose: bool = False, *,
                world_size: int | None = None, rank: int = 0) -> str:
        """What the program does on this rank, as text; runs no kernel.

        One line per tensor in program order (global shape, dtype, mesh, placements such as
        ``[S(1), R]``, local shape on this rank, memory order), then the communications this
        rank will run, with their groups and bytes. Extents come from ``inputs`` (this
        rank's, as for ``execute``; the program is built and reused by ``execute``), else
        from the definition's static extents, symbolic ones named. ``verbose=True`` adds
        every tensor's domains and, with ``inputs``, the program's steps.

        ``world_size=N`` previews the plan of ``rank`` (default 0) of ``N`` ranks from this
        one process, starting no rank: what that rank's ``fd.explain()`` prints in a run
        on ``N`` ranks (meshes of up to ``N`` devices; extents from the definition).

        A fusion that cannot be built (or, with ``inputs``, whose program cannot be built
        for them, such as a derived backward that needs a communication the engine cannot
        place) is not an error here: the text shows its tensors with the placements decided
        so far, then the reason, which ``execute`` raises.
        """
        self._check_finished("explain")
        self.define()
        if world_size is not None:
            if inputs is not None:
                raise InputError(
                    "explain: world_size= previews the plan from the definition's extents; "
                    "leave out the inputs, or call explain(inputs) on each rank of a run"
                )
            return preview(self.fusion, world_size, rank, verbose)
        try:
            runner = self._get_runner()
        except BUILD_FAILURES as error:
            return unbuilt(self.fusion, error)
        return runner.explain(inputs, verbose)

    def __repr__(self) -> str:
        self.define()
        return str(self.fusion)


def _may_hold_dtensors() -> bool:
    """Whether the inputs may hold a DTensor: not unless torch.distributed.tensor was
    imported (by whoever made one). meshfuse.dtensor, which imports it, is imported only then:
    it costs about a third of ``import meshfuse``."""
    return "torch.distributed.tensor" in sys.modules
