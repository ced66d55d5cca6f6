"""A machine's measured speeds, read from a calibration file (JSON, committed under
``meshfuse/cost/data/``; ``benchmarks/calibrate.py`` measures and fits one).

A calibration holds, for one device type and element type:

- ``gemm``: the parameters of the GEMM model (:mod:`.kernels`): the rate of full waves of
  tiles (``tflops``), the tile the library mostly runs (``tile``, ``[rows, columns]`` of the
  output) and the units that run tiles at once (``units``: streaming multiprocessors), a
  tile's fixed cost (``tile_us``: its prologue and epilogue) and the least time of a call
  (``floor_us``: what the host takes to issue it);
- ``attention``: the fused causal attention kernel's rate by head dimension (``tflops``,
  forward FLOPs per second on whole blocks) and its ``floor_us``; then either the query and
  key blocks' rows (``block``), the query blocks that run at once (``slots``) and a query
  block's fixed cost in key blocks' work (``block_cost``) (the scheduled model), or, in the
  older form, the sequence length its per-row overhead equals (``seq_overhead``);
- ``memory``: what a copy moves per second, reads and writes together (``gb_per_s``), a
  memory-bound kernel's ``floor_us``, and per kernel kind the bytes it moves over the least
  it must (``kernels``: kind -> {row length: factor}; a softmax that reads its rows three
  times has a factor near 2);
- ``collectives``: per kind (``allreduce``, ``allgather``, ``reduce_scatter``, ``alltoall``,
  ``p2p``) and group size, measured points ``[message bytes, bus GB/s]`` (nccl-tests'
  convention: a message is the whole buffer, the output of an allgather, the input of a
  reduce-scatter) and a latency in microseconds;
- ``links``: the bandwidth a group of ranks gets per rank when it stays in a node or crosses
  nodes (bus GB/s), and the node size: what a collective of a group size nobody measured is
  estimated from, and what projection to larger machines changes;
- ``overlap``: the share of a transfer's time that the kernels running beside it lose
  (``contention``: 1, nothing hidden; 0, everything), for the process group's collectives
  beside GEMMs and for copy-engine transfers, and ``async_contention`` for collectives issued
  ahead of their use (FSDP's gathers one layer ahead, gradient reductions);
- ``host``: fixed host costs (``loop_chunk_us``: one chunk of a stream loop).

Every figure may be ``{"value": ..., "source": ...}``, the source saying where it came from
(a benchmark result file, a fit, or an assumption).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshfuse.errors import InputError

DATA = Path(__file__).parent / "data"
KINDS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "p2p")
KERNELS = ("pointwise", "gelu", "silu", "layer_norm", "rms_norm", "softmax", "sum")
BY_DEVICE = {"cuda": "h200", "cpu": "cpu_gloo"}  # the calibration each device type reads


@dataclasses.dataclass(frozen=True)
class GemmFit:
    """The GEMM model's parameters (see the module doc)."""

    tflops: float
    tile: tuple[int, int]
    units: int
    tile_us: float
    floor_us: float
    alternatives: tuple[tuple[int, int], ...] = ()  # other tiles the library may pick


@dataclasses.dataclass(frozen=True)
class AttentionFit:
    """The attention model's parameters: rate by head dimension, the per-row overhead as a
    sequence length, the least time of a call."""

    tflops: Mapping[int, float]
    seq_overhead: float
    floor_us: float
    block: int = 0  # > 0: the scheduled model (query and key blocks of this many rows)
    slots: int = 0  # query blocks that run at once (streaming multiprocessors x blocks each)
    block_cost: float = 0.0  # a query block's fixed cost, in key blocks' work


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """Memory-bound kernels: a copy's bandwidth, a call's least time, and per kernel kind
    its moved-over-least-bytes factors by row length."""

    gb_per_s: float
    floor_us: float
    kernels: Mapping[str, Mapping[int, float]]


@dataclasses.dataclass(frozen=True)
class CollectiveCurve:
    """One collective kind on one group size: measured ``(bytes, bus GB/s)`` points in
    increasing size and a fixed latency."""

    points: tuple[tuple[float, float], ...]
    latency_us: float


@dataclasses.dataclass(frozen=True)
class Links:
    """Bus bandwidth per rank inside a node and across nodes, and ranks per node."""

    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    gpus_per_node: int
    latency_us: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A machine's speeds (see the module doc)."""

    name: str
    device: str
    dtype_bytes: int
    peak_tflops: float
    gemm: GemmFit
    attention: AttentionFit
    memory: MemoryFit
    collectives: Mapping[str, Mapping[int, CollectiveCurve]]
    links: Links
    overlap: Mapping[str, float]
    host: Mapping[str, float]
    copy_engine_gb_per_s: float

    @property
    def attention_tflops(self) -> float:
        """The attention kernel's rate at the largest calibrated head dimension."""
        return self.attention.tflops[max(self.attention.tflops)]

    @property
    def memory_gb_per_s(self) -> float:
        return self.memory.gb_per_s

    def with_links(self, intra_node_gb_per_s: float | None = None,
                   inter_node_gb_per_s: float | None = None,
                   gpus_per_node: int | None = None) -> Calibration:
        """This calibration on a machine of other links (projection to a cluster)."""
        links = dataclasses.replace(
            self.links,
            intra_node_gb_per_s=intra_node_gb_per_s or self.links.intra_node_gb_per_s,
            inter_node_gb_per_s=inter_node_gb_per_s or self.links.inter_node_gb_per_s,
            gpus_per_node=gpus_per_node or self.links.gpus_per_node)
        return dataclasses.replace(self, links=links)


def load(name_or_path: str | Path) -> Calibration:
    """The calibration named ``name`` (a file of ``meshfuse/cost/data/``: ``"h200"``,
    ``"cpu_gloo"``) or at a path.

    Raises:
        InputError: for a missing file or one without the fields the module doc lists.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = DATA / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in DATA.glob("*.json"))
        raise InputError(f"calibration {str(name_or_path)!r}: no file {path}; give a path or "
                         f"one of {known} (benchmarks/calibrate.py writes one)")
    return from_dict(json.loads(path.read_text()), path.stem)


def for_device(device_type: str) -> Calibration:
    """The committed calibration of a device type (``"cuda"``: the H200's; others: the CPU
    ranks' over gloo)."""
    return load(BY_DEVICE.get(device_type, "cpu_gloo"))


def _value(entry: Any) -> float:
    return float(entry["value"] if isinstance(entry, Mapping) else entry)


def _by_int(entries: Mapping[str, Any]) -> dict[int, float]:
    return {int(k): _value(v) for k, v in entries.items() if k != "source"}


def _compute(data: Mapping[str, Any]) -> tuple[GemmFit, AttentionFit, MemoryFit]:
    g, a, m = data["gemm"], data["attention"], data["memory"]
    gemm = GemmFit(_value(g["tflops"]), (int(g["tile"][0]), int(g["tile"][1])),
                   int(g["units"]), _value(g["tile_us"]), _value(g["floor_us"]),
                   tuple((int(a), int(b)) for a, b in g.get("alternatives", ())))
    attention = AttentionFit(_by_int(a["tflops"]), _value(a.get("seq_overhead", 0.0)),
                             _value(a["floor_us"]), int(_value(a.get("block", 0))),
                             int(_value(a.get("slots", 0))), _value(a.get("block_cost", 0.0)))
    kernels = {kind: _by_int(m["kernels"][kind]) for kind in KERNELS}
    if not all(kernels.values()) or not attention.tflops:
        raise ValueError("memory.kernels and attention.tflops need one point each at least")
    return gemm, attention, MemoryFit(_value(m["gb_per_s"]), _value(m["floor_us"]), kernels)


def from_dict(data: Mapping[str, Any], name: str = "calibration") -> Calibration:
    """A calibration from the JSON's dict (see the module doc)."""
    try:
        gemm, attention, memory = _compute(data)
        curves = {
            kind: {int(n): CollectiveCurve(tuple((float(b), float(bw)) for b, bw in
                                                 sorted(c["points"])), float(c["latency_us"]))
                   for n, c in by_size.items()}
            for kind, by_size in data["collectives"].items()}
        links = data["links"]
        return Calibration(
            name=name, device=data["device"], dtype_bytes=int(data["dtype_bytes"]),
            peak_tflops=_value(data["peak_tflops"]), gemm=gemm, attention=attention,
            memory=memory, collectives=curves,
            links=Links(_value(links["intra_node_gb_per_s"]),
                        _value(links["inter_node_gb_per_s"]), int(links["gpus_per_node"]),
                        _value(links["latency_us"])),
            overlap={k: _value(v) for k, v in data["overlap"].items()},
            host={k: _value(v) for k, v in data["host"].items()},
            copy_engine_gb_per_s=_value(data["copy_engine_gb_per_s"]))
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise InputError(f"calibration {name!r}: missing or malformed field {error}; see "
                         "meshfuse/cost/calibration.py for the format") from None
