"""The MoE block against torchtitan's ``MoE`` (its PyPI package) on the same weights and
tokens: meshfuse expert-parallel over the test's CPU ranks, torchtitan on whole tensors.
torchtitan's experts compute their grouped GEMMs in bfloat16 (``GroupedExperts`` casts), so
outputs and gradients agree to bfloat16's precision; the routing (float32 scores) agrees
exactly."""

from __future__ import annotations

import pytest
import torch
from mesh_helpers import mesh_1d

from meshfuse import FusionDefinition, shard_tensor
from meshfuse.examples.moe import PARAMS, MoEConfig, define_moe_block, expert_parallel, init_params

moe = pytest.importorskip("torchtitan.models.common.moe")
token_dispatcher = pytest.importorskip("torchtitan.models.common.token_dispatcher")
feed_forward = pytest.importorskip("torchtitan.models.common.feed_forward")
linear = pytest.importorskip("torchtitan.models.common.linear")

# torchtitan's parameter of each of ours
NAMES = {"gate": "router.gate.weight", "w1": "routed_experts.inner_experts.w1_EFD",
         "w2": "routed_experts.inner_experts.w2_EDF", "w3": "routed_experts.inner_experts.w3_EFD",
         "shared_w1": "shared_experts.w1.weight", "shared_w2": "shared_experts.w2.weight",
         "shared_w3": "shared_experts.w3.weight"}


def _torchtitan_moe(cfg: MoEConfig):
    h, e, f, s = cfg.dim, cfg.experts, cfg.ffn, cfg.shared_ffn

    def lin(i, o):
        return linear.Linear.Config(in_features=i, out_features=o)

    experts = moe.RoutedExperts.Config(
        inner_experts=moe.GroupedExperts.Config(dim=h, hidden_dim=f, num_experts=e),
        token_dispatcher=token_dispatcher.LocalTokenDispatcher.Config(num_experts=e,
                                                                      top_k=cfg.top_k))
    router = moe.TokenChoiceTopKRouter.Config(
        num_experts=e, gate=lin(h, e), top_k=cfg.top_k, score_func=cfg.score,
        route_norm=cfg.normalize, route_scale=cfg.scale)
    shared = feed_forward.FeedForward.Config(w1=lin(h, s), w2=lin(s, h), w3=lin(h, s))
    return moe.MoE(moe.MoE.Config(num_experts=e, routed_experts=experts, router=router,
                                  load_balance_coeff=None, shared_experts=shared))


@pytest.mark.mpi
def test_expert_parallel_block_equals_torchtitans_moe(multidevice_test):
    cfg = MoEConfig(dim=32, experts=6, ffn=16, top_k=2, shared_ffn=32, score="sigmoid")
    tokens, rank = 12, multidevice_test.rank
    params = init_params(cfg)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, cfg.dim, generator=gen, dtype=torch.float64)
    dy = torch.randn(tokens, cfg.dim, generator=gen, dtype=torch.float64)

    titan = _torchtitan_moe(cfg)
    with torch.no_grad():
        for ours, theirs in NAMES.items():
            titan.get_parameter(theirs).copy_(params[ours].float())
    x_titan = x.float().reshape(1, tokens, cfg.dim).requires_grad_()
    y_titan = titan(x_titan)
    y_titan.backward(dy.float().reshape(1, tokens, cfg.dim))

    with FusionDefinition() as fd:
        tv, y_tv, counts = define_moe_block(fd, cfg, tokens)
    expert_parallel(tv, y_tv, counts, mesh_1d(multidevice_test))
    glob = {"x": x, **params}
    local = [shard_tensor(glob[n], tv[n], rank).requires_grad_() for n in ["x", *PARAMS]]
    y, _ = fd.as_autograd_function()(local)
    y.backward(shard_tensor(dy, y_tv, rank))

    close = {"rtol": 3e-2, "atol": 3e-2}  # bfloat16 experts
    torch.testing.assert_close(y.detach().float(),
                               shard_tensor(y_titan.detach()[0], y_tv, rank), **close)
    torch.testing.assert_close(local[0].grad.float(),
                               shard_tensor(x_titan.grad[0], tv["x"], rank), **close)
    for leaf, name in zip(local[1:], PARAMS):
        theirs = titan.get_parameter(NAMES[name]).grad
        torch.testing.assert_close(leaf.grad.float(), shard_tensor(theirs, tv[name], rank),
                                   **close, msg=lambda m, n=name: f"{n}: {m}")
