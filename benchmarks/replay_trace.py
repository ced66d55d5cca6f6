"""Why the automatic CUDA graphs of a training loop replay, capture or fall back to the
interpreter, call by call (a diagnosis for the benchmarks; nothing here changes what runs).

    tracer = ReplayTrace()
    with tracer:
        for step in range(steps):
            tracer.step = step
            train_step()
    print("\\n".join(tracer.report(from_step=2)))

Each call of an :class:`~meshfuse.runtime.replay.automatic.AutoReplay` is recorded with its
outcome (``replayed``, ``captured``, ``interpreted``) and, where it did not replay a graph
it had, why: the graph's own previous outputs still held (which of them), or a *blocker*'s
(a graph captured later into the shared pool, whose outputs lie in memory this graph's
replay writes: :mod:`meshfuse.runtime.replay.pools`), or new input addresses (which
positions differ from the nearest captured set, and whether the new address is a live
graph's output).
"""

from __future__ import annotations

import collections
from typing import Any, Self

import torch

from meshfuse.runtime.replay import automatic


def _held(graph) -> list[int]:
    """The positions of ``graph``'s outputs whose memory something outside still holds."""
    held = {s for s, n in zip(graph._storages, graph._baseline)
            if torch._C._storage_Use_Count(s) != n}
    return [j for j, t in enumerate(graph._outputs)
            if t is not None and t.untyped_storage()._cdata in held]


class ReplayTrace:
    """Records every automatic-replay call made inside ``with`` (see the module doc)."""

    def __init__(self) -> None:
        self.step = 0
        self.events: list[dict] = []
        self._labels: dict[int, str] = {}  # id(AutoReplay) -> label
        self._graph_labels: dict[int, str] = {}  # id(_Graph) -> label
        self._saved: tuple | None = None

    def _label(self, replay, donating: bool) -> str:
        label = self._labels.get(id(replay))
        if label is None:
            kind = "bwd" if donating else "fwd"
            label = f"p{len(self._labels)}-{kind}-{len(replay._program.steps)}steps"
            self._labels[id(replay)] = label
        return label

    def _graph_label(self, graph) -> str:
        return self._graph_labels.get(id(graph), "?")

    def __enter__(self) -> Self:
        run, captured = automatic.AutoReplay.run, automatic.AutoReplay._captured
        self._saved = (run, captured)
        trace = self

        def traced_run(replay, inputs, staged=(), donating=False, overwrite=()):
            return trace._run(run, replay, inputs, staged, donating, overwrite)

        def traced_captured(replay, inputs, staged, kind, overwrite=frozenset(), buffer=0):
            graph = captured(replay, inputs, staged, kind, overwrite, buffer)
            if graph is not None:
                n = sum(1 for k in trace._graph_labels.values()
                        if k.startswith(trace._labels.get(id(replay), "?") + "#"))
                trace._graph_labels[id(graph)] = f"{trace._labels.get(id(replay), '?')}#{n}"
            return graph

        automatic.AutoReplay.run = traced_run
        automatic.AutoReplay._captured = traced_captured
        return self

    def __exit__(self, *exc) -> None:
        automatic.AutoReplay.run, automatic.AutoReplay._captured = self._saved

    def _run(self, run, replay, inputs, staged, donating, overwrite):
        label = self._label(replay, donating)
        if replay.reason is not None or automatic._PAUSED[0]:
            return run(replay, inputs, staged, donating, overwrite)
        key, _, _, graphs = replay._find(inputs, staged, overwrite)
        detail: dict[str, Any] = {}
        if graphs is None:  # a set of input addresses no graph was captured for
            detail["moved"] = self._moved(replay, key, inputs)
        else:
            detail["graphs"] = [self._state(g) for g in graphs]
        before = replay.graphs
        outputs = run(replay, inputs, staged, donating, overwrite)
        outcome = "interpreted" if outputs is None else \
            "captured" if replay.graphs > before else "replayed"
        self.events.append({"step": self.step, "program": label, "outcome": outcome,
                            **detail})
        return outputs

    def _state(self, graph) -> dict:
        blockers = [b() for b in graph.blockers]
        return {"graph": self._graph_label(graph), "own_held": _held(graph),
                "blockers_held": {self._graph_label(b): _held(b) for b in blockers
                                  if b is not None and _held(b)}}

    def _moved(self, replay, key: tuple, inputs) -> list[str]:
        """How this call's key differs from the nearest key a graph of ``replay`` was
        captured for (a stack's layers share one: the nearest is this layer's own): the
        inputs at other addresses, and whether each now lies at a live graph's output."""
        n = len(inputs)
        captured = [k for k in replay._graphs if len(k) == len(key)]
        if not captured:
            return ["no graph captured yet"]
        nearest = min(captured, key=lambda k: sum(a != b for a, b in zip(k[:n], key[:n])))
        moved = []
        for i, (a, b) in enumerate(zip(nearest[:n], key[:n])):
            if a != b:
                where = "a graph's output" if isinstance(b, int) and \
                    b in automatic._GRAPH_OUTPUTS else "elsewhere"
                shape = tuple(inputs[i].shape) if isinstance(inputs[i], torch.Tensor) else ""
                moved.append(f"input {i} {shape} moved to {where}")
        return moved or ["same addresses, other key values (copied inputs, deterministic mode)"]

    def report(self, from_step: int = 2, limit: int = 60) -> list[str]:
        """Per step: how many calls replayed, captured, interpreted; then the calls from
        ``from_step`` on that did not replay, with why (at most ``limit``)."""
        lines = []
        by_step = collections.defaultdict(collections.Counter)
        for e in self.events:
            by_step[e["step"]][e["outcome"]] += 1
        for step in sorted(by_step):
            lines.append(f"step {step}: " + ", ".join(
                f"{n} {k}" for k, n in sorted(by_step[step].items())))
        late = [e for e in self.events if e["step"] >= from_step and e["outcome"] != "replayed"]
        for e in late[:limit]:
            why = e.get("moved") or e.get("graphs")
            lines.append(f"  step {e['step']} {e['program']}: {e['outcome']}: {why}")
        if len(late) > limit:
            lines.append(f"  ... {len(late) - limit} more")
        return lines
