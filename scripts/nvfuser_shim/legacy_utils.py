"""What nvFuser's legacy multi-device tests (January 2025) import from their ``utils``
helpers, written for meshfuse (see ``scripts/nvfuser_tests.sh``)."""

import torch


def is_pre_ampere() -> bool:
    """True on a GPU older than Ampere (compute capability 8); False on CPU ranks."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)
