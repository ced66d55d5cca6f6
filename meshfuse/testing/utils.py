"""Small helpers that tests written for nvFuser's suite expect under ``utils``."""

import torch


def is_pre_ampere() -> bool:
    """True on a CUDA GPU older than Ampere (no flash attention there); False on CPU, where
    meshfuse uses PyTorch's CPU flash kernel."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major < 8


def current_device() -> torch.device:
    """This process's device: its current GPU when there is one (the multi-device fixture
    selects one GPU per rank), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
