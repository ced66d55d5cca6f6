"""Attention dropout, reproducible and shard-independent where promised.

- Heads that do not divide over the ranks (uneven shards, an empty one at 4 ranks): the
  global mode is bitwise the unsharded run; the shard mode still gives every head its own
  mask, with gradients that match that mask.
- On CUDA, each fused kernel (cuDNN, flash, memory-efficient) and the math kernel: one seed
  gives the same forward bits (the same masks) twice, and the same gradient bits under
  ``torch.use_deterministic_algorithms(True)``; by default flash's backward adds ``q_grad``
  with atomics, so the gradients then agree to rounding only (``benchmarks/reproducibility``).
"""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import mesh_1d
from test_attention_dropout import (
    OFFSET,
    SCHEDULES,
    SEED,
    Dropout,
    _assert_close,
    _gather,
    _global_inputs,
    _kept,
    _reference_grads,
    _run,
    _schedule,
    _Unsharded,
)

from benchmarks.reproducibility import check_same_seed, deterministic_algorithms
from meshfuse import DeviceMesh
from meshfuse.errors import InputError, MeshfuseError
from meshfuse.examples.seed_sdpa import QkvFormat, random_inputs
from meshfuse.ops.attention.backends import ENV_VAR as BACKEND_ENV
from meshfuse.sharding import shard_tensor

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["shard", "global"])
def test_heads_that_do_not_divide(multidevice_test, mode):
    d = multidevice_test.size
    b, h = 2, 2 * d + 1
    inputs = _global_inputs(b, h)
    fd = Dropout(b, h, mode=mode)
    _schedule(fd, mesh_1d(multidevice_test), SCHEDULES["heads"])
    local, outputs = _run(multidevice_test, fd, inputs)
    if mode == "global":
        expected = Dropout(b, h, mode="global").execute(inputs + [SEED, OFFSET])
        for out, ref, tv in zip(outputs, expected, fd.fusion.outputs()):
            mine = shard_tensor(ref.cpu(), tv, multidevice_test.rank).to(out.device)
            assert torch.equal(out, mine), tv.name
        return
    attn, *grads = outputs
    keep = _kept(attn, False)
    _, ref_grads = _reference_grads(*local, keep, False)
    for name, grad, ref in zip(("q_grad", "k_grad", "v_grad"), grads, ref_grads):
        assert grad.shape == ref.shape
        if ref.numel():  # at 4 ranks the last holds no head
            _assert_close(name, grad, ref)
    patterns = _gather(multidevice_test, keep, fd.attn).flatten(0, 1).flatten(1)
    assert len({tuple(p.tolist()) for p in patterns}) == b * h, "two heads share a mask"


@cuda_only
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient", "math"])
def test_each_cuda_kernel_same_seed_same_bits(kernel, monkeypatch):
    """The seed program (one GPU) with dropout 0.1 and ``kernel`` forced; see the doc."""
    b, h, s, e = 2, 12, 1024, 768
    fd = _Unsharded(QkvFormat.BHSE, DeviceMesh([0]), b, h, s, e, dropout_p=0.1)
    inputs = random_inputs(b, h, s, e, device="cuda")
    monkeypatch.setenv(BACKEND_ENV, kernel)
    try:
        fd.execute(inputs)  # the first call binds the kernel
    except InputError as err:
        pytest.skip(f"{kernel} does not run here: {err}")
    monkeypatch.delenv(BACKEND_ENV)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the math kernel's matmuls
    names = ("attn", "q_grad", "k_grad", "v_grad")
    if kernel == "cudnn":  # its backward is not deterministic: refused under the switch
        found = check_same_seed(lambda: fd.execute(inputs), names, deterministic_check=False)
        assert found["default"]["attn"]["bitwise"]
        with deterministic_algorithms(True), pytest.raises(MeshfuseError, match="not determin"):
            fd.execute(inputs)
        return
    found = check_same_seed(lambda: fd.execute(inputs), names)
    assert found["default"]["attn"]["bitwise"]
    assert not isinstance(found["deterministic"], str), found["deterministic"]
    if kernel == "math":
        assert all(r["bitwise"] for r in found["default"].values())
