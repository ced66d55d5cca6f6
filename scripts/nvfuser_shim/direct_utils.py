"""What nvFuser's multi-device tests import from their ``python.direct_utils`` helpers,
written for meshfuse (see ``scripts/nvfuser_tests.sh``)."""

import torch


def is_pre_ampere() -> bool:
    """True on a GPU older than Ampere (compute capability 8); False on CPU ranks."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)


def create_sdpa_rng_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """A philox seed ([2], uint64) and offset ([], uint64), as PyTorch's flash kernels give."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = torch.randint(0, 2**31, (2,), device=device).to(torch.uint64)
    offset = torch.randint(0, 2**31, (), device=device).to(torch.uint64)
    return seed, offset
