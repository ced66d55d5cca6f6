"""Small helpers that tests written for nvFuser's suite expect under ``utils``."""

import torch


def is_pre_ampere() -> bool:
    """True on a CUDA GPU older than Ampere (no flash attention there); False on CPU, where
    meshfuse uses PyTorch's CPU flash kernel."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major < 8
