"""Failure handling: typed failures of a rank's program, errors raised on one rank only (so
that the others do not wait for it in a collective), and the notice board they post to."""

from meshfuse.runtime.faults.failures import OutOfStep, checked_timeout
from meshfuse.runtime.faults.lone_failures import BEFORE_RUNNING

__all__ = ["BEFORE_RUNNING", "OutOfStep", "checked_timeout"]
