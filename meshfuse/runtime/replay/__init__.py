"""CUDA-graph replay: programs captured once (``cuda_graph=True``), the automatic replay of
cached programs, and the random streams that stay right across replays."""

from meshfuse.runtime.replay.automatic import AutoReplay, GraphBudget, replay_lines, replay_wanted
from meshfuse.runtime.replay.graphs import GraphedProgram

__all__ = ["AutoReplay", "GraphBudget", "GraphedProgram", "replay_lines", "replay_wanted"]
