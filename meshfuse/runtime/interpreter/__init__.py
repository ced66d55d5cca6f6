"""The per-rank program: binding of extents and local layouts, the ranks' agreement on their
inputs, the program's ``Step`` records and their executor, fused segments, allreduce buckets."""

from meshfuse.runtime.interpreter.agreement import (
    agreed_inputs,
    agreement_ranks,
    exchanged,
    input_facts,
    out_of_step,
)
from meshfuse.runtime.interpreter.binding import (
    Binding,
    bind,
    check_inputs,
    check_strides,
    has_symbolic_extents,
    held_here,
    is_cpu_scalar,
    local_context,
    local_extents,
    required_device,
    shard_extents,
    sharded_symbolic_axes,
)
from meshfuse.runtime.interpreter.bucketing import bucket_lines
from meshfuse.runtime.interpreter.executor import Program
from meshfuse.runtime.interpreter.fused import FUSED, CompileStats, fuse_program
from meshfuse.runtime.interpreter.host_time import HostLog
from meshfuse.runtime.interpreter.program import build_program

__all__ = ["FUSED", "Binding", "CompileStats", "HostLog", "Program", "agreed_inputs",
           "agreement_ranks", "bind",
           "bucket_lines", "build_program", "check_inputs", "check_strides", "exchanged",
           "fuse_program", "has_symbolic_extents", "held_here", "input_facts", "is_cpu_scalar",
           "local_context", "local_extents", "out_of_step", "required_device",
           "shard_extents", "sharded_symbolic_axes"]
