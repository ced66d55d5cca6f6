"""Communication: the communicator and its process groups, the collectives a program runs,
copy-engine transports and symmetric memory, and resharding, planned as steps and lowered to
collectives on this rank's groups."""

from meshfuse.runtime.comm.collectives import Group, group_along
from meshfuse.runtime.comm.communicator import Communicator
from meshfuse.runtime.comm.reshard_lowering import lower_reshard

__all__ = ["Communicator", "Group", "group_along", "lower_reshard"]
