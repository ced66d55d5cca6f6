"""The typed errors of meshfuse.

Every user mistake is reported as a subclass of :class:`MeshfuseError` whose message names the
op, tensor or axis at fault, shows the offending values and says how to fix it. Bare ``assert``
is kept for internal invariants only.
"""


class MeshfuseError(Exception):
    """Base class of every error meshfuse raises for a user mistake."""


class DefinitionError(MeshfuseError):
    """A fusion definition is malformed: bad op arguments, mismatched shapes, bad outputs."""


class ScheduleError(MeshfuseError):
    """A schedule (split, merge, reorder, parallelize, allocation, mesh) is invalid."""


class ShardingError(MeshfuseError):
    """Shardings of tensors are inconsistent or need a resharding meshfuse cannot do."""


class InputError(MeshfuseError):
    """The tensors passed to ``execute`` do not match the definition or its schedule."""


class CommunicationError(MeshfuseError):
    """A collective failed, or ranks disagree in a way that would make a collective hang."""


class ExecutionError(MeshfuseError):
    """A step of the per-rank program failed; the message names the step and the rank."""


class GraphBreakError(DefinitionError):
    """A captured model has ops meshfuse has no rule for and the capture was ``strict``; the
    message lists each with its module path."""


class CheckpointError(MeshfuseError):
    """A checkpoint does not fit the model it is loaded into (a name missing or extra, another
    shape or dtype), or cannot be read (a missing, truncated or corrupt file); raised on every
    rank before any parameter is overwritten."""
