"""``PythonProfiler``: nvFuser's profiler context, reporting what meshfuse can see.

nvFuser's ``with PythonProfiler() as prof: fd.execute(...)`` lists the kernels that ran in
``prof.profile.kernel_profiles``, each with the ``scheduler`` that made it; communications
have ``scheduler == "communication"``. meshfuse runs PyTorch kernels, which it does not
profile; here the list holds one entry per collective that ran (from
:func:`meshfuse.runtime.comm.collectives.record_communications`), so that counting communications
reads as in nvFuser. Use ``torch.profiler`` for the compute kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Self

from meshfuse.runtime.comm.collectives import Communication, record_communications


@dataclasses.dataclass(frozen=True)
class KernelProfile:
    """One profiled kernel: a collective, its kind (``"allreduce"``, ...) and its traffic."""

    name: str
    scheduler: str
    communication: Communication


@dataclasses.dataclass
class FusionProfile:
    """What ran inside the profiler's ``with`` block."""

    kernel_profiles: list[KernelProfile] = dataclasses.field(default_factory=list)


class PythonProfiler(contextlib.AbstractContextManager):
    """Records the communications of the executions inside its ``with`` block."""

    def __init__(self) -> None:
        self.profile = FusionProfile()
        self._recording = None
        self._comms = None

    def __enter__(self) -> Self:
        self._recording = record_communications()
        self._comms = self._recording.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._recording.__exit__(*exc)
        self.profile.kernel_profiles = [KernelProfile(c.kind, "communication", c)
                                        for c in self._comms]
