"""Times from a calibration: compute kernels from their fitted models (:mod:`.kernels`: GEMMs
by waves of tiles, attention by head dimension and sequence, memory-bound kernels by the
bytes they really move), communication from bus bandwidth, and overlap.

- a **collective** of ``S`` bytes over ``n`` ranks takes ``latency + S f / busbw(S, n)``,
  ``f`` being nccl-tests' bus factor (``2 (n - 1) / n`` for an allreduce, ``(n - 1) / n`` for
  an allgather, reduce-scatter or all-to-all, 1 for a point-to-point send): the alpha-beta
  model, its bandwidth read off the measured points of that kind and group size (log-linear
  between two points, the nearest beyond them; a measured point's bandwidth holds its
  latency, so the latency is added only below the smallest point), or, for a group nobody
  measured, the links' bandwidth inside a node or across nodes;
- **overlap** of ``t_x`` compute with ``t_c`` communication: ``max(t_x, t_c) + c min(t_x,
  t_c)``, ``c`` the calibration's contention (1: nothing hides; 0: the shorter hides whole).

Times are in seconds.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from meshfuse.cost.calibration import Calibration, CollectiveCurve, for_device
from meshfuse.cost.kernels import attention_seconds, gemm_seconds, memory_seconds
from meshfuse.errors import InputError

BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Times of ops and communications on the machine ``calibration`` describes."""

    calibration: Calibration

    @classmethod
    def for_device(cls, device_type: str) -> CostModel:
        return cls(for_device(device_type))

    # compute

    def gemm(self, m: int, n: int, k: int, itemsize: int | None = None) -> float:
        """Seconds of one GEMM ``[m, k] @ [k, n]`` (:func:`.kernels.gemm_seconds`)."""
        cal = self.calibration
        return gemm_seconds(cal.gemm, cal.memory, m, n, k, itemsize or cal.dtype_bytes)

    def gemm_tflops(self, m: int, n: int, k: int) -> float:
        """The rate a GEMM ``[m, k] @ [k, n]`` runs at, in TFLOP/s."""
        return 2.0 * m * n * k / self.gemm(m, n, k) / 1e12

    def attention(self, flops: float, seq: int | None = None,
                  head_dim: int | None = None) -> float:
        """Seconds of a fused causal attention call of ``flops`` on sequences of ``seq``
        with heads of ``head_dim`` (:func:`.kernels.attention_seconds`)."""
        return attention_seconds(self.calibration.attention, flops, seq, head_dim)

    def memory_bound(self, nbytes: float, kind: str = "pointwise",
                     row: int | None = None) -> float:
        """Seconds of a memory-bound kernel of ``kind`` whose inputs and outputs total
        ``nbytes``, on rows of ``row`` elements (:func:`.kernels.memory_seconds`)."""
        return memory_seconds(self.calibration.memory, nbytes, kind, row)

    @property
    def launch(self) -> float:
        """The least seconds of a memory-bound kernel."""
        return self.calibration.memory.floor_us * 1e-6

    # communication

    def bus_bandwidth(self, kind: str, nbytes: float, ranks: int,
                      crosses_nodes: bool | None = None) -> float:
        """Bus GB/s of collective ``kind`` of ``nbytes`` over ``ranks`` (see the module doc);
        ``crosses_nodes``: the group spans nodes (None: when larger than a node)."""
        links = self.calibration.links
        if crosses_nodes is None:
            crosses_nodes = ranks > links.gpus_per_node
        if crosses_nodes:
            return links.inter_node_gb_per_s
        curve = self._curve(kind, ranks)
        if curve is None:
            return links.intra_node_gb_per_s
        return _interpolate(curve, nbytes)

    def collective(self, kind: str, nbytes: float, ranks: int,
                   crosses_nodes: bool | None = None) -> float:
        """Seconds of collective ``kind`` (``allreduce``, ``allgather``, ``reduce_scatter``,
        ``alltoall``, ``p2p``) of ``nbytes`` (nccl-tests' message size) over ``ranks``."""
        if kind not in BUS_FACTOR:
            raise InputError(f"collective {kind!r}: the cost model knows {sorted(BUS_FACTOR)}")
        if ranks < 2 or nbytes <= 0:
            return 0.0
        if crosses_nodes is None:
            crosses_nodes = ranks > self.calibration.links.gpus_per_node
        bw = self.bus_bandwidth(kind, nbytes, ranks, crosses_nodes)
        moved = nbytes * BUS_FACTOR[kind](ranks) / (bw * 1e9)
        curve = None if crosses_nodes else self._curve(kind, ranks)
        if curve is not None and nbytes >= curve.points[0][0]:
            return moved  # the measured bandwidth holds the latency already
        return self.latency(kind, ranks) + moved

    def latency(self, kind: str, ranks: int) -> float:
        curve = self._curve(kind, ranks)
        us = curve.latency_us if curve is not None else self.calibration.links.latency_us
        return us * 1e-6

    def _curve(self, kind: str, ranks: int) -> CollectiveCurve | None:
        by_size = self.calibration.collectives.get(kind, {})
        return by_size.get(ranks)

    # overlap

    def overlapped(self, compute: float, comm: float, contention: float | None = None) -> float:
        """Seconds of ``compute`` with ``comm`` running beside it (module doc)."""
        c = self.calibration.overlap.get("async_contention", 1.0) if contention is None \
            else contention
        return max(compute, comm) + c * min(compute, comm)


def _interpolate(curve: CollectiveCurve, nbytes: float) -> float:
    """Bus GB/s at ``nbytes``: log-linear between the measured points, the nearest beyond."""
    sizes = [b for b, _ in curve.points]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        return curve.points[0][1]
    if i == len(sizes):
        return curve.points[-1][1]
    (b0, w0), (b1, w1) = curve.points[i - 1], curve.points[i]
    t = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return w0 + t * (w1 - w0)
