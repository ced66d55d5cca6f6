"""meshfuse: one tensor program, written with global shapes, run across a mesh of devices.

Programs written for nvFuser's Python frontends run with ``import meshfuse as nvfuser_direct``
(the current one: ``nvfuser.multidevice.DeviceMesh``, ``execute_with_dtensors``, ...) or
``import meshfuse as nvfuser`` (the legacy one: ``fd.sched.*``, ``nvfuser.DeviceMesh``,
``nvfuser.Communicator``, outputs with ``.local``); ``meshfuse.testing.nvfuser_alias`` makes
those module names import meshfuse.
"""

import importlib

from meshfuse import multidevice, pytorch_utils  # noqa: F401  (nvFuser's submodules)
from meshfuse import ops as _ops  # noqa: F401  (registers every op)
from meshfuse.autodiff.module import FusionModule
from meshfuse.dtypes import DataType
from meshfuse.errors import (
    CommunicationError,
    DefinitionError,
    ExecutionError,
    InputError,
    MeshfuseError,
    ScheduleError,
    ShardingError,
)
from meshfuse.frontend.backward import vjp
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.frontend.multidevice_executor import CommunicatorBackend
from meshfuse.frontend.outputs import DistributedTensor
from meshfuse.ir.memory_type import MemoryType
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.multidevice import Communicator, Sharding
from meshfuse.profiler import PythonProfiler
from meshfuse.runtime.replay.step import capture_step
from meshfuse.sharding import shard_tensor, unshard_tensor
from meshfuse.visualize import visualize

# nvFuser's names for the same things.
Tensor = TensorView

# DTensor interop (meshfuse.dtensor) is imported on first use: torch.distributed.tensor
# costs about a third of `import meshfuse`, and a program without DTensors never needs it.
_DTENSOR_NAMES = ("execute_with_dtensors", "mesh_from_torch", "mesh_to_torch",
                  "schedule_from_placements", "to_placements")


# Bringing a PyTorch model (meshfuse.capture: torch.export, DTensor) is imported on first use
# too.
_CAPTURE_NAMES = {"parallelize": "meshfuse.capture.parallelize",
                  "PipelineSpec": "meshfuse.capture.pipeline",
                  "backend": "meshfuse.capture.backend",
                  "plan": "meshfuse.planner.search"}  # the planner, on first use too


def __getattr__(name: str):
    if name in _DTENSOR_NAMES:
        return getattr(importlib.import_module("meshfuse.dtensor"), name)
    if name in _CAPTURE_NAMES:
        return getattr(importlib.import_module(_CAPTURE_NAMES[name]), name)
    raise AttributeError(f"module 'meshfuse' has no attribute {name!r}")

__all__ = [
    "CommunicationError",
    "Communicator",
    "CommunicatorBackend",
    "DataType",
    "DefinitionError",
    "DeviceMesh",
    "DistributedTensor",
    "ExecutionError",
    "FusionDefinition",
    "FusionModule",
    "InputError",
    "MemoryType",
    "MeshfuseError",
    "ParallelType",
    "PipelineSpec",
    "PythonProfiler",
    "Scalar",
    "ScheduleError",
    "Sharding",
    "ShardingError",
    "Tensor",
    "TensorView",
    "backend",
    "capture_step",
    "execute_with_dtensors",
    "mesh_from_torch",
    "mesh_to_torch",
    "parallelize",
    "schedule_from_placements",
    "shard_tensor",
    "to_placements",
    "unshard_tensor",
    "visualize",
    "vjp",
]
