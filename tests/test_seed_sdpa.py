"""The seed test (nvFuser's ``test_sdpa_loop_split``, from its DID loop split for SDPA), body
unchanged apart from the imports, completed with input construction and the comparison with
the unsharded reference."""

import pytest
import torch

import meshfuse as nvfuser
from meshfuse import DataType, FusionDefinition
from meshfuse.examples.seed_sdpa import QkvFormat, random_inputs, reference
from meshfuse.testing import utils


@pytest.mark.skipif(
    utils.is_pre_ampere(),
    reason="Flash Attention is only supported on Ampere and newer devices.",
)
@pytest.mark.parametrize("qkv_format", [QkvFormat.BHSE, QkvFormat.BSHE])
@pytest.mark.mpi
def test_sdpa_loop_split(multidevice_test, qkv_format: QkvFormat):
    d, b, s, h, e = multidevice_test.size, 2, 1024, 12, 768
    if h % d != 0:
        pytest.skip(f"We only support even split, so {h} has to be divisible by {d}.")
    mesh = nvfuser.DeviceMesh(range(d))

    class Model(FusionDefinition):
        def __init__(self, qkv_format: QkvFormat):
            super().__init__()
            self._qkv_format = qkv_format

        def definition(self) -> None:
            match self._qkv_format:
                case QkvFormat.BHSE:
                    stride_order = [3, 2, 1, 0]
                case QkvFormat.BSHE:
                    stride_order = [3, 1, 2, 0]

            self.q, self.k, self.v, self.out_grad = [
                self.define_tensor(
                    shape=[b, h, s, e // h],
                    dtype=DataType.BFloat16,
                    stride_order=stride_order,
                )
                for _ in range(4)
            ]

            # TODO(#3123): support sharded dropout and change this to a
            # positive probability.
            dropout_p = self.define_scalar(0.0, dtype=DataType.Double)
            is_causal = self.define_scalar(True, dtype=DataType.Bool)
            self.attn, self.log_sumexp, seed, offset = self.ops.sdpfa_fwd(
                self.q, self.k, self.v, dropout_p, is_causal, scale=None
            )

            self.q_grad, self.k_grad, self.v_grad = self.ops.sdpfa_bwd(
                self.out_grad,
                self.q,
                self.k,
                self.v,
                self.attn,
                self.log_sumexp,
                dropout_p,
                is_causal,
                seed,
                offset,
                scale=None,
            )

            self.add_output(self.attn)
            for grad in [self.q_grad, self.k_grad, self.v_grad]:
                self.add_output(grad)

        def multidevice_schedule(self) -> None:
            for t in [
                self.q,
                self.k,
                self.v,
                self.attn,
                self.log_sumexp,
                self.out_grad,
                self.q_grad,
                self.k_grad,
                self.v_grad,
            ]:
                self.sched._set_device_mesh(t, mesh)
                self.sched.split(t, 1, d, False)
                self.sched.parallelize(t, 1, nvfuser.ParallelType.mesh_x)
                if self._qkv_format == QkvFormat.BSHE:
                    # The loop domain is: {i{B}, i{DIDx}, i{H//D}, i{S}, i{E//H}}
                    # Reorder i{S} in the allocation domain for BHSE: {i{DIDx}, i{B}, i{S}, i{H//D}, i{E//H}}
                    self.sched.reorder(t, {2: 3, 3: 2})
                self.sched.set_allocation_as_loop(t)

    # Not in the seed text: inputs, execution and the comparison with the reference.
    fd = Model(qkv_format)
    q, k, v, out_grad = random_inputs(b, h, s, e, device=multidevice_test.device)
    if qkv_format == QkvFormat.BSHE:
        q, k, v, out_grad = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, out_grad))
    fd.define()
    inputs = [multidevice_test.shard_tensor(t, tv)
              for t, tv in zip((q, k, v, out_grad), (fd.q, fd.k, fd.v, fd.out_grad))]
    outputs = fd.execute(inputs)

    # Heads never mix in attention: the unsharded computation restricted to this rank's heads
    # is the reference of its shard (on CPU ranks, computing every head on every rank was
    # most of this test's time).
    heads = slice(multidevice_test.rank * (h // d), (multidevice_test.rank + 1) * (h // d))
    expected = reference(*(t[:, heads] for t in (q, k, v, out_grad)))
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
        if qkv_format == QkvFormat.BSHE:
            assert out.transpose(1, 2).is_contiguous(), f"{out.stride()} is not BSHE"
        else:
            assert out.is_contiguous()
