"""The cost estimate that picks a context-parallel strategy (``context_parallel="auto"``).

Each strategy's time for one attention call (forward or backward) on ``n`` ranks is estimated
from the message sizes and three speed constants of the machine (:class:`Machine`): the
attention kernel's FLOP/s on one device, the link's bytes/s between two devices, and a fixed
cost per message (launch and latency). The constants default per device type to those of its
committed calibration (:mod:`meshfuse.cost`) and can be set
with ``MESHFUSE_CP_KERNEL_TFLOPS``, ``MESHFUSE_CP_LINK_GBPS`` and ``MESHFUSE_CP_LATENCY_US``
(the ``context_parallel`` benchmark measures them: a kernel's time and a block transfer's).

- ``ring``: ``n`` steps; a step's transfer overlaps its compute, so it costs
  ``max(compute, transfer)``. The forward moves k/v at every step but the last. The backward
  moves k/v at step 0 (under the first part of the own block), k/v and the dk/dv
  accumulators (float32 beyond two ranks) at the steps between, and the accumulators home
  at the last (under the rest of the own block).
- ``allgather``: the gathers (and the backward's reduce-scatters) first, then all of the
  compute: their sum.
- ``alltoall``: four all-to-alls in the forward (q, k, v in, the output back), nine in the
  backward, none overlapped; the compute is balanced whatever the layout.

Causal work on a block layout is uneven: the rank with the last block does ``(2n - 1) / n``
times the mean; a zig-zag layout is balanced.
"""

from __future__ import annotations

import dataclasses
import os

from meshfuse.cost import CostModel
from meshfuse.ops.attention.sequence import ALLGATHER, ALLTOALL, RING


@dataclasses.dataclass(frozen=True)
class Machine:
    """Speeds the estimate uses: attention FLOP/s of one device, link bytes/s, seconds per
    message."""

    kernel_flops: float
    link_bytes: float
    latency: float


def _from_calibration(device_type: str) -> Machine:
    """The speeds of ``device_type``'s committed calibration (:mod:`meshfuse.cost`): the
    attention kernel's measured throughput, a point-to-point send's bandwidth between two
    ranks of a node and its latency."""
    model = CostModel.for_device(device_type)
    return Machine(kernel_flops=model.calibration.attention_tflops * 1e12,
                   link_bytes=model.bus_bandwidth("p2p", 0, 2) * 1e9,
                   latency=model.latency("p2p", 2))


DEFAULTS = {"cuda": _from_calibration("cuda"), "cpu": _from_calibration("cpu")}


def machine(device_type: str) -> Machine:
    """The constants for ``device_type`` ("cuda" or "cpu"), with the environment's
    overrides."""
    base = DEFAULTS.get(device_type, DEFAULTS["cpu"])

    def env(name: str, scale: float, default: float) -> float:
        value = os.environ.get(name)
        return float(value) * scale if value else default

    return Machine(env("MESHFUSE_CP_KERNEL_TFLOPS", 1e12, base.kernel_flops),
                   env("MESHFUSE_CP_LINK_GBPS", 1e9, base.link_bytes),
                   env("MESHFUSE_CP_LATENCY_US", 1e-6, base.latency))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call as a rank of the mesh axis sees it: ``heads`` local query heads
    (after any head sharding) and ``kv_heads`` key/value heads (fewer in grouped-query
    attention; None: as many), ``batch``, global sequence ``seq``, head dims, element size,
    ``n`` ranks on the sequence axis; ``kv_seq``: the key sequence when it is of another
    length (cross attention)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    value_dim: int
    itemsize: int
    n: int
    causal: bool
    backward: bool
    balanced: bool  # the layout balances causal work (zig-zag)
    kv_heads: int | None = None
    kv_seq: int | None = None  # the key sequence (cross attention; None: ``seq``)

    @property
    def flops(self) -> float:
        """The call's FLOPs over all ranks (the backward costs 2.5 forwards); causal: the
        query/key pairs the top-left aligned mask keeps."""
        keys = self.kv_seq or self.seq
        pairs = float(self.seq * keys)
        if self.causal:
            seen = min(self.seq, keys)  # a triangle, then rows that see every key
            pairs = seen * seen / 2 + max(self.seq - keys, 0) * keys
        forward = 2.0 * self.batch * self.heads * pairs * (self.head_dim + self.value_dim)
        return forward * (2.5 if self.backward else 1.0)

    def block_bytes(self, itemsize: int | None = None) -> float:
        """k and v of one rank's sequence block."""
        rows = self.batch * (self.kv_heads or self.heads) * (self.kv_seq or self.seq) / self.n
        return rows * (self.head_dim + self.value_dim) * (itemsize or self.itemsize)

    def query_bytes(self) -> float:
        """q and the output (of v's head dim: as k and v) of one rank's sequence block."""
        rows = self.batch * self.heads * self.seq / self.n
        return rows * (self.head_dim + self.value_dim) * self.itemsize


def estimate(strategy: str, p: Problem, m: Machine) -> float:
    """Seconds ``strategy`` takes for the call ``p`` on machine ``m``."""
    skew = 1.0 if p.balanced or not p.causal else (2 * p.n - 1) / p.n
    compute = p.flops / p.n / m.kernel_flops
    if p.n == 1:
        return compute
    if strategy == RING:
        step = compute * skew / p.n
        blocks = p.block_bytes() / m.link_bytes + 2 * m.latency
        if not p.backward:  # n - 1 steps move k/v under their kernels
            return (p.n - 1) * max(step, blocks) + step
        # The sums travel in the inputs' dtype on a ring of two (two terms each), else float32.
        sums = p.block_bytes(None if p.n <= 2 else 4) / m.link_bytes + 2 * m.latency
        return max(step, blocks) + (p.n - 2) * max(step, blocks + sums) + max(step, sums)
    if strategy == ALLGATHER:
        moved = (p.n - 1) * p.block_bytes()
        if p.backward:
            moved += (p.n - 1) * p.block_bytes(4)
        messages = 4 if p.backward else 2
        return compute * skew + moved / m.link_bytes + messages * m.latency
    assert strategy == ALLTOALL
    # One [b, h, s/n, e] tensor with q's heads and one with k's; all but 1/n of it moves.
    query, key = (x / 2 * (p.n - 1) / p.n for x in (p.query_bytes(), p.block_bytes()))
    # Forward: q and the output, k and v; backward: the output gradient, q, the output, the
    # log-sum-exp (counted as one) and dq, and k, v, dk, dv.
    queries, keys = (5, 4) if p.backward else (2, 2)
    moved = queries * query + keys * key
    return compute + moved / m.link_bytes + (queries + keys) * m.latency


def choose(p: Problem, m: Machine, allowed: tuple[str, ...]) -> tuple[str, dict[str, float]]:
    """The allowed strategy of least estimated time, and every allowed one's estimate."""
    estimates = {s: estimate(s, p, m) for s in allowed}
    return min(estimates, key=estimates.get), estimates
