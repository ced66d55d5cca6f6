"""A layout's step time and memory per rank, from the cost model (:mod:`meshfuse.cost`).

For ``N`` tokens per rank and step (the batch split over the data-parallel ranks, the
sequence over the context-parallel ones), a block costs per step:

- **compute**: its GEMMs (split over ``tp``) by the GEMM model (waves of tiles), forward once
  and backward twice; attention at the kernel's rate for the head dimension and sequence
  (backward 2.5 forwards), or, under context parallelism, the context estimate of the
  chosen strategy (:func:`meshfuse.parallel.context.cost.estimate`, on this model's
  figures); the memory-bound kernels (norms by their calibrated kind, residuals, RoPE and
  activations as elementwise ones) by the bytes they move;
- **tp**: two allgathers and two reduce-scatters of the ``[N, hidden]`` residual stream in
  the forward, as many in the backward, not hidden (NCCL beside cuBLAS hides nothing:
  ``overlap.process_group_beside_gemm``); or, with ``overlap``, each as a stream loop of
  ``tp`` chunks beside its GEMMs (the block's GEMMs spread over its 8 loops) moved by the
  copy engines (inside a node only), timed by the overlap estimate
  (:meth:`meshfuse.parallel.overlap.cost.OverlapCost.estimate_ms`) on this model's figures;
- **dp** (FSDP): the block's parameters gathered in the forward and again in the backward,
  its gradients reduce-scattered, issued a layer ahead: what the block's compute does not
  hide, at ``overlap.async_contention``;
- **ddp** (and ``cp``'s ranks, which hold the same parameters): the gradients all-reduced
  once per step beside the backward;
- **pp**: the blocks split over the stages so that the slowest stage, the last holding the
  LM head, is fastest (:func:`stage_split`); the step is that stage's time times ``1 +
  (p - 1) / (v m)`` (the bubble; ``m`` microbatches of one sequence, ``v`` = 2 interleaved),
  plus the activations sent between stages. A rank's memory is that of the stage of most
  blocks.

Memory per rank: parameters, gradients and Adam's state at 16 bytes a parameter (fp32
master, gradient and two moments) divided by ``tp`` and ``dp``; FSDP's two gathered blocks;
per block the activations its backward reads (with flash attention no score matrix) for the
microbatches in flight, or only the block's input when recomputed.
"""

from __future__ import annotations

import dataclasses
import math

from meshfuse.cost import CostModel
from meshfuse.parallel.context.cost import Machine, Problem, estimate
from meshfuse.parallel.overlap.cost import OverlapCost
from meshfuse.planner.layouts import Layout
from meshfuse.planner.spec import TransformerSpec

STATE_BYTES = 16  # per parameter: fp32 master, gradient, Adam's two moments


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """Seconds and bytes per rank and step of a layout, without recomputation; ``None``
    fields of an infeasible layout's are absent (``infeasible`` says why)."""

    layout: Layout
    step_s: float = math.inf
    memory_bytes: float = math.inf
    recompute_s: float = 0.0  # the step time one recomputed block adds
    recompute_saves: float = 0.0  # the bytes one recomputed block frees
    blocks: int = 0  # blocks on a rank (a pipeline stage's)
    parts: dict = dataclasses.field(default_factory=dict)  # seconds by kind
    comm_bytes: dict = dataclasses.field(default_factory=dict)  # bytes by role
    infeasible: str = ""
    memory_parts: dict = dataclasses.field(default_factory=dict)  # bytes by kind
    stages: tuple[int, ...] = ()  # blocks per pipeline stage


def infeasibility(spec: TransformerSpec, layout: Layout) -> str:
    """Why ``layout`` cannot run ``spec`` ("" when it can)."""
    t, c, p = (layout.size(r) for r in ("tp", "cp", "pp"))
    data = layout.size("dp") * layout.size("ddp")
    checks = [(spec.heads % t == 0 and spec.ffn % t == 0, (f"tp {t} does not divide both heads "
               f"{spec.heads} and ffn {spec.ffn}")),
              (spec.batch % data == 0, (f"batch {spec.batch} does not split over {data} "
               "data-parallel ranks")),
              (spec.seq % (2 * c if c > 1 else 1) == 0 and spec.seq % t == 0,
               f"sequence {spec.seq} does not split over cp {c} (two blocks a rank) and tp {t}"),
              (layout.cp_strategy != "alltoall" or (spec.heads // t) % c == 0,
               f"alltoall needs the {spec.heads // t} local heads divisible by cp {c}"),
              (p == 1 or spec.batch // data >= p, (f"{spec.batch // data} microbatches for "
               f"{p} stages")),
              (p == 1 or spec.layers >= p * (2 if layout.schedule == "interleaved" else 1),
               f"{spec.layers} layers for {p} stages")]
    return next((why for ok, why in checks if not ok), "")


def layout_cost(spec: TransformerSpec, layout: Layout, model: CostModel) -> LayoutCost:
    """The cost of one layout (see the module doc)."""
    why = infeasibility(spec, layout)
    if why:
        return LayoutCost(layout, infeasible=why)
    g = _Geometry(spec, layout, model)
    if layout.overlap and g.crosses("tp"):
        return LayoutCost(layout, infeasible="the copy engines reach the GPUs of one node only")
    compute_f, compute_b = g.compute()
    tp = g.tensor_parallel(g.gemm_flops)
    gather, scatter = g.fsdp()
    block = compute_f + compute_b + tp
    fsdp_exposed = model.overlapped(block, gather + scatter) - block if gather else 0.0
    head = g.head()
    g.stages = stage_split(spec.layers, g.p, block + fsdp_exposed, head)
    g.blocks = max(g.stages)
    stage = max(n * (block + fsdp_exposed) + (head if i == len(g.stages) - 1 else 0.0)
                for i, n in enumerate(g.stages))
    reduce = g.gradient_allreduce()
    exposed_reduce = model.overlapped(g.blocks * compute_b, reduce) - g.blocks * compute_b
    optimizer, p2p = g.optimizer(), g.pipeline_sends()
    step = stage * g.bubble + exposed_reduce + optimizer + p2p
    parts = {"compute": g.blocks * (compute_f + compute_b) + head, "tp": g.blocks * tp,
             "dp": g.blocks * fsdp_exposed, "ddp": exposed_reduce, "pp bubble":
             stage * (g.bubble - 1) + p2p, "optimizer": optimizer}
    memory = g.memory()
    return LayoutCost(layout, step, sum(memory.values()), compute_f + tp / 2,
                      g.recompute_saves(), g.blocks, parts, g.comm_bytes(), "", memory,
                      g.stages)


def stage_split(layers: int, stages: int, block_s: float, head_s: float) -> tuple[int, ...]:
    """Blocks per pipeline stage, the last holding the LM head: the split whose slowest
    stage is fastest (the last takes ``k`` blocks, the others share the rest evenly; every
    ``k`` is tried)."""
    if stages == 1:
        return (layers,)

    def slowest(k: int) -> float:
        return max(math.ceil((layers - k) / (stages - 1)) * block_s, k * block_s + head_s)

    last = min(range(1, math.ceil(layers / stages) + 1), key=lambda k: (slowest(k), -k))
    rest, extra = divmod(layers - last, stages - 1)
    return tuple(rest + (i < extra) for i in range(stages - 1)) + (last,)


class _Geometry:
    """The sizes a layout gives one rank, and the pieces of its cost."""

    def __init__(self, spec: TransformerSpec, layout: Layout, model: CostModel) -> None:
        self.spec, self.layout, self.model = spec, layout, model
        self.t, self.c, self.p = (layout.size(r) for r in ("tp", "cp", "pp"))
        self.d, self.r = layout.size("dp"), layout.size("ddp")
        self.sequences = spec.batch // (self.d * self.r)  # per rank and step
        self.tokens = self.sequences * spec.seq / self.c
        self.blocks = math.ceil(spec.layers / self.p)  # until the split is known
        self.stages: tuple[int, ...] = (spec.layers,)
        self.v = 2 if layout.schedule == "interleaved" else 1
        self.micro = self.sequences if self.p > 1 else 1
        self.bubble = 1 + (self.p - 1) / (self.v * self.micro)
        self.nodes = model.calibration.links.gpus_per_node
        self.b = spec.dtype_bytes

    def crosses(self, role: str) -> bool:
        return self.layout.crosses_nodes(role, self.nodes)

    def compute(self) -> tuple[float, float]:
        """Seconds of one block's forward and backward compute per step."""
        s, m = self.spec, self.model
        n, t, h, f = int(self.tokens / self.micro), self.t, s.hidden, s.ffn
        kv = s.kv_width // t if s.kv_heads % t == 0 else s.kv_width
        # (output, input) features of each linear on a rank: column-parallel outputs and
        # row-parallel inputs split over tp
        linears = [(h // t, h), (kv, h), (kv, h), (h, h // t), (f // t, h), (h, f // t)]
        if s.gated:
            linears.append((f // t, h))
        gemms = sum(m.gemm(n, out, inp) for out, inp in linears)
        self.gemm_flops = 3 * sum(2.0 * n * out * inp for out, inp in linears) * self.micro
        # the two norms (RMS for a gated, Llama-family block) read and write [n, h]; the
        # residuals, RoPE and activations are elementwise
        norm = "rms_norm" if s.gated else "layer_norm"
        pointwise = 2 * m.memory_bound(2 * h * n * self.b / t, norm, h) + \
            m.memory_bound((8 * h + 4 * s.ffn) * n * self.b / t)
        fwd_attention, bwd_attention = self.attention()
        forward = gemms + pointwise + fwd_attention
        backward = 2 * gemms + 2 * pointwise + bwd_attention
        return forward * self.micro, backward * self.micro

    def attention(self) -> tuple[float, float]:
        """Seconds of one microbatch's attention forward and backward."""
        s, m = self.spec, self.model
        heads = s.heads // self.t
        flops = 2.0 * (self.sequences / self.micro) * heads * s.seq * s.seq * s.head_dim
        if self.c == 1:
            return (m.attention(flops, s.seq, s.head_dim),
                    m.attention(2.5 * flops, s.seq, s.head_dim))
        crosses = self.crosses("cp")
        machine = Machine(m.calibration.attention_tflops * 1e12,
                          m.bus_bandwidth("p2p", 1 << 20, self.c, crosses) * 1e9,
                          m.latency("p2p", self.c))
        kv = s.kv_heads // self.t if s.kv_heads % self.t == 0 else s.kv_heads
        times = [estimate(self.layout.cp_strategy, Problem(
            int(self.sequences / self.micro), heads, s.seq, s.head_dim, s.head_dim, self.b,
            self.c, True, backward, self.layout.cp_strategy == "ring", kv), machine)
            for backward in (False, True)]
        return times[0], times[1]

    def tensor_parallel(self, gemm_flops: float) -> float:
        """Seconds one block's TP+SP collectives (forward and backward) add to a step beside
        its ``gemm_flops`` (see the module doc)."""
        if self.t == 1:
            return 0.0
        message = self.tokens / self.micro * self.spec.hidden * self.b
        m, crosses = self.model, self.crosses("tp")
        if self.layout.overlap:
            cal = m.calibration
            cost = OverlapCost(cal.copy_engine_gb_per_s, cal.gemm.tflops,
                               cal.host["copy_engine_chunk_us"],
                               cal.overlap["copy_engine_beside_gemm"])
            loops = 8 * self.micro  # 2 gathers and 2 reduce-scatters each way
            moved = message * (self.t - 1) / self.t
            _, looped = cost.estimate_ms(gemm_flops / loops, moved, self.t)
            gemm_ms = gemm_flops / loops / (cost.gemm_tflops * 1e12) * 1e3
            return loops * (looped - gemm_ms) * 1e-3
        one = m.collective("allgather", message, self.t, crosses) + \
            m.collective("reduce_scatter", message, self.t, crosses)
        return 4 * one * self.micro

    def block_bytes(self) -> float:
        """One block's parameters on a TP rank, in the compute dtype."""
        return self.spec.block_parameters() / self.t * self.b

    def fsdp(self) -> tuple[float, float]:
        """Seconds of one block's FSDP gathers (forward and backward) and gradient
        reduce-scatter per step."""
        if self.d == 1:
            return 0.0, 0.0
        m, crosses = self.model, self.crosses("dp")
        gather = m.collective("allgather", self.block_bytes(), self.d, crosses)
        return 2 * gather, m.collective("reduce_scatter", self.block_bytes(), self.d, crosses)

    def gradient_allreduce(self) -> float:
        """Seconds of the step's gradient allreduce over the replicas (ddp and cp ranks)."""
        ranks = self.r * self.c
        if ranks == 1:
            return 0.0
        grads = self.blocks * self.block_bytes() / self.d
        crosses = self.crosses("ddp") or self.crosses("cp")
        return self.model.collective("allreduce", grads, ranks, crosses)

    def head(self) -> float:
        """Seconds of the LM head's GEMMs (forward and backward) on a stage."""
        s = self.spec
        if not s.vocab:
            return 0.0
        return 3 * self.model.gemm(int(self.tokens), max(s.vocab // self.t, 1), s.hidden)

    def optimizer(self) -> float:
        params = self.blocks * self.spec.block_parameters() / self.t / self.d
        return self.model.memory_bound(2 * STATE_BYTES * params)

    def pipeline_sends(self) -> float:
        if self.p == 1:
            return 0.0
        message = self.tokens / self.micro * self.spec.hidden * self.b / self.t
        one = self.model.collective("p2p", message, 2, self.crosses("pp"))
        return 2 * self.micro * self.v * one

    def activation_bytes(self) -> float:
        """Bytes one block keeps for its backward, for the microbatches in flight."""
        s = self.spec
        per_token = 6 * s.hidden + 2 * s.kv_width + (3 if s.gated else 2) * s.ffn
        in_flight = min(self.p * self.v, self.micro) if self.p > 1 else 1
        return per_token * self.tokens / self.micro * in_flight * self.b / self.t

    def recompute_saves(self) -> float:
        kept = self.spec.hidden * self.tokens / self.micro * self.b / self.t
        return self.activation_bytes() - kept

    def memory(self) -> dict[str, float]:
        """Bytes on a rank by kind: parameters with their gradients and optimizer state
        (sharded over tp and dp), FSDP's gathered blocks, activations, logits."""
        s = self.spec
        params = self.blocks * s.block_parameters() + 2 * s.vocab * s.hidden / self.p
        return {"state": STATE_BYTES * params / self.t / self.d,
                "gathered": 2 * self.block_bytes() if self.d > 1 else 0.0,
                "activations": self.blocks * self.activation_bytes(),
                "logits": self.tokens / self.micro * s.vocab / self.t * 4}

    def comm_bytes(self) -> dict[str, float]:
        """Bytes each role's collectives move per rank and step."""
        message = self.tokens * self.spec.hidden * self.b
        grads = self.blocks * self.block_bytes() / self.d
        out = {"tp": 8 * self.blocks * message * (self.t - 1) / self.t if self.t > 1 else 0,
               "dp": 3 * self.blocks * self.block_bytes() * (self.d - 1) / self.d,
               "ddp": 2 * grads * (self.r * self.c - 1) / (self.r * self.c),
               "pp": 2 * message / self.t if self.p > 1 else 0}
        return {k: v for k, v in out.items() if v}
