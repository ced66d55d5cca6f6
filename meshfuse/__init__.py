"""meshfuse: one tensor program, written with global shapes, run across a mesh of devices.

``import meshfuse as nvfuser`` serves programs written for nvFuser's Python frontend:
``FusionDefinition``, ``DataType``, ``ParallelType``, ``DeviceMesh``.
"""

from meshfuse import ops as _ops  # noqa: F401  (registers every op)
from meshfuse.autodiff.api import vjp
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
from meshfuse.frontend.fusion_definition import FusionDefinition
from meshfuse.ir.parallel_type import ParallelType
from meshfuse.ir.tensor_view import Scalar, TensorView
from meshfuse.mesh import DeviceMesh
from meshfuse.sharding import shard_tensor, unshard_tensor
from meshfuse.visualize import visualize

__all__ = [
    "CommunicationError",
    "DataType",
    "DefinitionError",
    "DeviceMesh",
    "ExecutionError",
    "FusionDefinition",
    "FusionModule",
    "InputError",
    "MeshfuseError",
    "ParallelType",
    "Scalar",
    "ScheduleError",
    "ShardingError",
    "TensorView",
    "shard_tensor",
    "unshard_tensor",
    "visualize",
    "vjp",
]
