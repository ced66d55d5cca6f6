"""The Llama-family example (:mod:`meshfuse.examples.llama`): trained 20 AdamW steps tensor +
sequence parallel, vocabulary sharded, cross entropy on class indices, against
``transformers.LlamaForCausalLM`` loaded with the same state dict on one device (per-step
losses within 1e-5 relative in float32); one step's communications counted per fusion (each
block: Megatron's 2 allgathers and 2 reduce-scatters forward, and again in the backward);
``python -m meshfuse.examples.train_llama`` run at 2 CPU ranks and refusing bad meshes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from meshfuse.examples import train_llama
from meshfuse.examples.llama import LlamaConfig, LlamaModel, init_parameters
from meshfuse.examples.llama_torch import LlamaTorch
from meshfuse.examples.train_llama import parse_mesh, synthetic_batch, train
from meshfuse.ir.mesh import DeviceMesh
from meshfuse.runtime.comm.collectives import record_communications
from meshfuse.runtime.replay import automatic

transformers = pytest.importorskip("transformers")

BATCH = 2


def _config(world: int) -> LlamaConfig:
    """Tiny, with fewer key/value heads than query heads; vocabularies uneven over 3 and 4
    ranks. At 3 ranks 6 query heads (2 per rank) over 2 key/value heads: replicated k/v,
    as at 4 ranks."""
    if world == 3:
        return LlamaConfig(vocab=98, hidden=48, layers=2, heads=6, kv_heads=2, ffn=96, seq=12,
                           rope_theta=500000.0)
    return LlamaConfig(vocab=98, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=16,
                       rope_theta=500000.0)


class HfLlama(torch.nn.Module):
    """``LlamaForCausalLM`` of ``cfg``, called ``(ids, targets)`` for the mean cross entropy
    of its logits; its state dict has the example's names."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq,
            rms_norm_eps=cfg.eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
            attention_bias=False, mlp_bias=False, attn_implementation="eager",
            torch_dtype=cfg.torch_dtype)
        self.hf = transformers.LlamaForCausalLM(hf_cfg).to(cfg.torch_dtype)

    def state_dict(self, *args, **kwargs):
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict: bool = True):
        return self.hf.load_state_dict(state, strict=strict)

    def forward(self, ids, targets):
        logits = self.hf(ids).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_plain_pytorch_twin_is_llama_for_causal_lm():
    """The script's single-device baseline equals ``LlamaForCausalLM`` (loss and every
    gradient) with the same state dict: the same RoPE, GQA, norms and names."""
    cfg = _config(1)
    params = init_parameters(cfg)
    twin, hf = LlamaTorch(cfg), HfLlama(cfg)
    twin.load_state_dict(params)
    hf.load_state_dict(params)
    ids, targets = synthetic_batch(cfg, BATCH, 0)
    losses = [m(ids, targets) for m in (twin, hf)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    grads = dict(twin.named_parameters()), dict(hf.hf.named_parameters())
    assert grads[0].keys() == grads[1].keys()
    for name, p in grads[0].items():
        torch.testing.assert_close(p.grad, grads[1][name].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_llama_trains_like_transformers(multidevice_test):
    """20 AdamW steps, TP + SP over all ranks, vocabulary sharded: each step's loss within
    1e-5 relative of ``LlamaForCausalLM``'s, and the losses fall."""
    cfg = _config(multidevice_test.size)
    losses, reference, account = train(cfg, steps=20, batch=BATCH, reference=HfLlama)
    assert account["optimizer_state"] >= 2 * account["parameters"]  # exp_avg, exp_avg_sq
    if multidevice_test.rank != 0:
        assert reference is None
        return
    assert len(losses) == len(reference) == 20
    for i, (mine, theirs) in enumerate(zip(losses, reference)):
        assert abs(mine - theirs) <= 1e-5 * abs(theirs), (i, mine, theirs)
    assert reference[-1] < 0.9 * reference[0]  # the comparison is of a training


@pytest.mark.mpi
def test_captured_steps_train_as_the_plain_ones(multidevice_test, monkeypatch):
    """``--cuda-graph``: the steps replayed from one CUDA graph (forward, backward, clipping
    and AdamW, NCCL's collectives among several GPUs) give each step's loss within 1e-5
    relative of the plain steps', and one graph is captured."""
    if multidevice_test.device.type != "cuda":
        pytest.skip("capture_step captures CUDA graphs: CUDA only (--cuda-graph is refused "
                    "without a GPU: test_script_trains_at_four_ranks_and_refuses_bad_meshes)")
    made, capture_step = [], train_llama.capture_step

    def recorded(step_fn, *args, **kwargs):
        made.append(capture_step(step_fn, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(train_llama, "capture_step", recorded)
    cfg = _config(multidevice_test.size)
    plain, _, _ = train(cfg, steps=8, batch=BATCH, reference=None, max_norm=1.0)
    graphed, _, _ = train(cfg, steps=8, batch=BATCH, reference=None, max_norm=1.0,
                          cuda_graph=True)
    assert len(made) == 1 and made[0].graphs == 1
    for i, (a, b) in enumerate(zip(plain, graphed)):
        assert abs(a - b) <= 1e-5 * abs(a), (i, a, b)
    assert graphed[-1] < graphed[0]


def _kinds(comms) -> Counter:
    return Counter(c.kind for c in comms if len(c.ranks) > 1)


@pytest.mark.mpi
def test_one_step_communicates_as_megatron(multidevice_test):
    """Per block, forward: the two norms' outputs allgathered, the o and down products
    reduce-scattered onto the sequence (k/v replicated where the ranks do not divide the
    key/value heads add nothing); the embedding's partial lookups reduce-scattered; the head
    gathers its norm's output and reduces per-token values only (loss parallel). The
    backward: the transposes, per block 2 allgathers and 2 reduce-scatters again, and the
    replicated norm weights' gradients allreduced."""
    cfg, d = _config(multidevice_test.size), multidevice_test.size
    model = LlamaModel(cfg, BATCH, init_parameters(cfg), DeviceMesh(range(d)),
                       multidevice_test.device)
    ids, targets = (t.to(multidevice_test.device) for t in synthetic_batch(cfg, BATCH, 0))
    with record_communications() as embed:
        x = model.embed(ids)
    blocks = []
    for block in model.blocks:
        with record_communications() as comms:
            x = block(x, model.cos, model.sin)
        blocks.append(_kinds(comms))
    with record_communications() as head:
        loss = model.head(x, targets)
    with record_communications() as backward:
        loss.backward()
    if d == 1:
        assert not any(map(_kinds, (embed, head, backward))) and not any(blocks)
        return
    megatron = Counter({"allgather": 2, "reduce_scatter": 2})
    assert blocks == [megatron] * cfg.layers
    assert _kinds(embed) == Counter({"reduce_scatter": 1})
    # loss parallel: the max, the sum of exponentials and the target logit, one value per
    # token each; no row of logits leaves its rank
    itemsize = cfg.torch_dtype.itemsize
    tokens = BATCH * cfg.seq
    assert _kinds(head) == Counter({"allgather": 1, "allreduce": 3})
    assert [c.bytes for c in head if c.kind == "allreduce"] == [tokens * itemsize] * 3
    # backward: per block and at the head, the cotangent gathered into the row-parallel
    # products (the embedding's too, for its table's gradient) and the gathered norm outputs'
    # gradients reduce-scattered; allreduced: the RMSNorm weights' gradients (replicated; a
    # block's two in one bucket, the final norm's alone) and, where k/v are replicated, the
    # gradients of k and v (each rank's query heads' part, summed). The loss's max is a
    # constant of the gradient (stop_gradient): no per-token value is reduced again.
    bwd = _kinds(backward)
    assert (bwd["allgather"], bwd["reduce_scatter"]) == (2 * cfg.layers + 1,) * 2, bwd
    sizes = sorted(c.bytes for c in backward if c.kind == "allreduce")
    kv_replicated = cfg.kv_heads % d != 0
    kv_grads = 2 * BATCH * cfg.kv_heads * cfg.seq * cfg.head_dim if kv_replicated else 0
    weights = ((2 * cfg.layers + 1) * cfg.hidden + cfg.layers * kv_grads) * itemsize
    assert sum(sizes) == weights, sizes
    assert len(sizes) <= 1 + cfg.layers * (1 + 2 * kv_replicated), sizes


@pytest.mark.mpi
def test_every_program_of_a_step_is_judged_for_cuda_graph_replay(multidevice_test,
                                                                  monkeypatch):
    """Regression (the example under CUDA-graph replay on an H200: ``ValueError: 'rng_seed'
    is not in list``, a vocabulary-sharded lookup taken for a random op): each program of a
    training step (forward and derived backward of every fusion) is judged as on a CUDA
    device; none is refused for random numbers (the example draws none), and at one rank,
    where nothing communicates, every one may replay."""
    judged, original = [], automatic.why_not_replayed

    def judge(program, device):
        judged.append(original(program, torch.device("cuda")))
        return original(program, device)

    cfg, d = _config(multidevice_test.size), multidevice_test.size
    monkeypatch.setattr(automatic, "why_not_replayed", judge)
    model = LlamaModel(cfg, BATCH, init_parameters(cfg), DeviceMesh(range(d)),
                       multidevice_test.device)
    ids, targets = (t.to(multidevice_test.device) for t in synthetic_batch(cfg, BATCH, 0))
    model(ids, targets).backward()
    assert len(judged) >= 2 * (cfg.layers + 2)  # embed, blocks, head; forward and backward
    assert not any("random" in reason for reason in judged if reason), judged
    if d == 1:
        assert judged == [None] * len(judged), judged


def test_mesh_argument():
    assert parse_mesh("tp=2") == {"replicate": 1, "dp": 1, "cp": 1, "tp": 2}
    assert parse_mesh("dp=2, tp=2") == {"replicate": 1, "dp": 2, "cp": 1, "tp": 2}
    assert parse_mesh("replicate=2,dp=2,cp=2") == {"replicate": 2, "dp": 2, "cp": 2, "tp": 1}
    for bad in ("tp", "pp=2", "tp=0", "tp=2,tp=2", "tp=x"):
        with pytest.raises(Exception, match="mesh dimension|positive|twice"):
            parse_mesh(bad)


def _script(*args: str, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "meshfuse.examples.train_llama", *args], check=False,
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.exclusive
def test_script_trains_at_four_ranks_and_refuses_bad_meshes(tmp_path):
    """The README's command at 4 CPU ranks (gloo, fully sharded over dp x tensor parallel
    over tp, gradients clipped) with a few steps: exit 0, the memory account and the
    comparison printed, the JSON and the loss curve written. Bad meshes: one line on
    stderr, exit 2, before any rank starts."""
    done = _script("--mesh", "dp=2,tp=2", "--steps", "3", "--max-norm", "1.0", "--out",
                   str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 3: parameters" in done.stdout and "ok" in done.stdout, done.stdout
    assert (tmp_path / "train_llama.png").stat().st_size > 0
    assert (tmp_path / "train_llama.json").exists()
    for mesh, words in (("dp=3", "dp divides"), ("tp=2,xp=2", "NAME=SIZE"),
                        ("tp=8", "divides --heads"), ("tp=3", "divides --heads"),
                        ("replicate=2", "give dp=N too"), ("dp=0", "positive integer"),
                        ("dp=2,dp=2", "given twice")):
        bad = _script("--mesh", mesh, timeout=120)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and words in lines[0], bad.stderr
    bad = _script("--mesh", "tp=2", "--cuda-graph", timeout=120)  # (no GPU here)
    assert bad.returncode == 2 and "no GPU" in bad.stderr, bad.stderr
    # under a launcher of 3 ranks, a mesh of 2 does not match
    bad = _script("--mesh", "tp=2", timeout=120, WORLD_SIZE="3", RANK="0")
    assert bad.returncode == 2 and "launcher started 3" in bad.stderr, bad.stderr
