"""CUDA-graph replay: programs captured once (``cuda_graph=True``), the automatic replay of
cached programs, whole training steps (``capture_step``), and the random streams that stay
right across replays."""

from meshfuse.runtime.replay.automatic import AutoReplay, GraphBudget, replay_lines, replay_wanted
from meshfuse.runtime.replay.graphs import GraphedProgram
from meshfuse.runtime.replay.step import capture_step
from meshfuse.runtime.replay.streams import draws_random

__all__ = ["AutoReplay", "GraphBudget", "GraphedProgram", "capture_step", "draws_random",
           "replay_lines", "replay_wanted"]
