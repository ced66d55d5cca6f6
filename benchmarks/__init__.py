"""meshfuse benchmarks: ``python -m benchmarks.run`` (see ``benchmarks/README.md``).

Layout: ``run`` (entry point), ``context`` (processes, devices, environment), ``timing``
(measuring one callable), ``harness`` (measuring a list of variants into records, errors
included), ``report`` (JSON, markdown, PNG, console), ``fusions`` (the meshfuse programs) and
``cases/`` (one module per case family, with its PyTorch baselines).

Importing this package sets :data:`NCCL_ENV_DEFAULTS` and :data:`CPU_BLAS_ENV_DEFAULTS` (each
unless already set), before any of its modules imports torch.
"""

import os

# Multicast (NVLS) off on every path NCCL, symmetric memory and NVSHMEM could take.
NCCL_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# oneMKL's reproducible mode: CPU runs check that one seed gives the same bits twice
# (``benchmarks/reproducibility.py``), and by default oneMKL (dynamic threads, no conditional
# numerical reproducibility) does not promise that; see docs/dropout.md.
CPU_BLAS_ENV_DEFAULTS = {
    "MKL_CBWR": "AUTO,STRICT",
    "MKL_DYNAMIC": "FALSE",
}


def set_env_defaults() -> None:
    """Sets each of :data:`NCCL_ENV_DEFAULTS` and :data:`CPU_BLAS_ENV_DEFAULTS` that the
    environment does not set."""
    for name, value in {**NCCL_ENV_DEFAULTS, **CPU_BLAS_ENV_DEFAULTS}.items():
        os.environ.setdefault(name, value)


set_env_defaults()
