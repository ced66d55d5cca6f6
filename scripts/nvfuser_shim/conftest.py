"""Root conftest of a scratch copy of nvFuser's tests (see ``scripts/nvfuser_tests.sh``):
nvFuser's module names import meshfuse; on CPU ranks, CUDA calls become no-ops."""

import contextlib
import importlib.util
import os
import time
import types

import pytest
import torch

import meshfuse.testing.nvfuser_alias as alias

alias.install()

# Test files whose optional dependency is missing are left out rather than failing to import.
collect_ignore = [
    path for path, module in (("multidevice/test_deepseek_v3.py", "transformers"),
                              ("multidevice/test_transformer_engine.py", "transformer_engine"))
    if importlib.util.find_spec(module) is None
]

if os.environ.get("MESHFUSE_NVFUSER_CPU") == "1":
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.cudart = lambda: types.SimpleNamespace(cudaProfilerStart=lambda: None,
                                                     cudaProfilerStop=lambda: None)

    class _InOrderStream:
        """``torch.cuda.Stream`` on a CPU rank: work runs in order, so waits do nothing."""

        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

    torch.cuda.Stream = _InOrderStream
    torch.cuda.current_stream = lambda *args, **kwargs: _InOrderStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()

try:
    import pytest_benchmark  # noqa: F401
except ImportError:
    class _Benchmark:
        """pytest-benchmark's ``pedantic`` where the plugin is missing: runs and prints."""

        def __init__(self, name: str) -> None:
            self.name = name

        def pedantic(self, fn, rounds: int = 1, **kwargs):
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                result = fn()
                times.append(time.perf_counter() - start)
            print(f"{self.name}: median {sorted(times)[len(times) // 2] * 1e3:.2f} ms "
                  f"over {rounds} rounds")
            return result

    @pytest.fixture
    def benchmark(request):
        return _Benchmark(request.node.name)
