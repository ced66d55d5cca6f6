"""``MemoryType``: where a tensor's buffer lives (nvFuser's ``MemoryType``).

meshfuse allocates every buffer with PyTorch, so only the multi-device distinction has an
effect: ``symmetric`` asks for a buffer every rank can address (torch's symmetric memory,
``torch.distributed._symmetric_memory``), which communications over
``CommunicatorBackend.cuda`` use. Where symmetric memory is not available (a CPU, a machine
without multicast or peer access), the buffer is an ordinary one and the communications run
over the process group: the results are the same (see ``docs/overlap.md``).
"""

import enum


class MemoryType(enum.Enum):
    """The memory a tensor's buffer is allocated in."""

    local = "local"
    shared = "shared"
    global_ = "global"
    symmetric = "symmetric"

    # nvFuser's C++ spellings, as aliases.
    Local = "local"  # noqa: PIE796
    Shared = "shared"  # noqa: PIE796
    Global = "global"  # noqa: PIE796
    Symmetric = "symmetric"  # noqa: PIE796
