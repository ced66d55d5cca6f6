"""The language model ops of the capture's table: embedding (vocabulary-parallel where the
plan shards the table's rows), constant padding of the labels and cross entropy on class
indices (loss parallel where the logits' vocabulary is sharded) run inside fusions, with
the unsharded module's values and gradients."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshfuse
from meshfuse import DeviceMesh
from meshfuse.capture.partition import fold, partition, simplify, static_nodes
from meshfuse.capture.program import GraphBreakWarning
from meshfuse.capture.trace import capture
from meshfuse.runtime.comm.collectives import record_communications

V, E, B, S = 16, 8, 2, 6


class TinyLM(torch.nn.Module):
    """Embedding, a projection, a head; the loss of Hugging Face's causal LMs (labels padded
    with the ignored index, shifted by one)."""

    def __init__(self, padding_idx=None, class_weights=False, return_logits=False, **loss):
        super().__init__()
        self.return_logits = return_logits
        self.embed = torch.nn.Embedding(V, E, padding_idx=padding_idx)
        self.proj = torch.nn.Linear(E, E)
        self.head = torch.nn.Linear(E, V, bias=False)
        self.loss = loss
        self.register_buffer("weights", torch.rand(V) if class_weights else None)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.proj(self.embed(ids))))
        shifted = F.pad(labels, (0, 1), value=self.loss.get("ignore_index", -100))[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(),
                               weight=self.weights, **self.loss)
        return (loss, logits) if self.return_logits else loss


def _inputs(ignored=-100):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = ignored
    ids[1, 1] = 0  # the padding row, where there is one
    return ids, labels


def _breaks(module):
    captured = capture(module, _inputs(module.loss.get("ignore_index", -100)), {})
    simplify(captured.graph)
    buffers = dict(module.named_buffers())
    inputs = {**{p: buffers[n] for p, n in captured.buffers.items()}, **captured.constants}
    constants = fold(static_nodes(captured), inputs)
    return [str(b.node.target) for b in partition(captured.graph, constants).breaks]


def test_embedding_pad_and_cross_entropy_have_rules():
    assert _breaks(TinyLM(padding_idx=0, ignore_index=-100, label_smoothing=0.1)) == []


def test_class_weights_and_a_frequency_scaled_embedding_stay_breaks():
    module = TinyLM(class_weights=True)
    module.embed.scale_grad_by_freq = True
    assert _breaks(module) == ["aten.embedding.default", "aten.cross_entropy_loss.default"]


VOCAB_PARALLEL = {"embed": RowwiseParallel(input_layouts=Replicate()),
                  "head": ColwiseParallel()}
LOSSES = {"mean": {"label_smoothing": 0.1}, "sum": {"reduction": "sum", "ignore_index": 3}}


@pytest.mark.mpi
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_vocab_parallel_embedding_and_loss_match_the_module(multidevice_test, loss,
                                                            padding_idx):
    torch.manual_seed(0)
    reference = TinyLM(padding_idx=padding_idx, **LOSSES[loss])
    inputs = _inputs(LOSSES[loss].get("ignore_index", -100))
    mesh = DeviceMesh(range(multidevice_test.size))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)  # no break anywhere
        model = meshfuse.parallelize(copy.deepcopy(reference), mesh, VOCAB_PARALLEL)
        # The ids on the model's device (a CUDA model's table meets CPU ids in the trace).
        here = [t.to(next(model.parameters()).device) for t in inputs]
        model(*here)  # build
        with record_communications() as forward:
            out = model(*here)
    with record_communications() as backward:
        out.backward()
    expected = reference(*inputs)
    expected.backward()
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor().cpu(), ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if multidevice_test.size == 1:
        assert _traffic(forward) == _traffic(backward) == Counter()
        return
    rows = B * S * 4  # one float32 per token
    # Forward: the vocabulary-parallel lookup gives each rank the rows of its own tokens
    # (zeros elsewhere): one allreduce of the activations [B, S, E]. Loss parallel on the
    # head's vocabulary shards: the max, the sum of exponentials and the target's logit are
    # partial over the classes, one allreduce of a value per token each.
    assert _traffic(forward) == Counter({("allreduce", rows * E): 1, ("allreduce", rows): 3})
    # Backward: the column-parallel head's input gradient is a partial sum (Megatron's
    # allreduce); the loss's gradient is pointwise on each shard, and the embedding's
    # gradient lands on the rows each rank holds: no traffic for either.
    assert _traffic(backward) == Counter({("allreduce", rows * E): 1})


def _traffic(comms) -> Counter:
    return Counter((c.kind, c.bytes) for c in comms if len(c.ranks) > 1)


def test_a_loss_parallel_model_returning_its_logits(multidevice_test):
    """A model that returns its vocabulary-sharded logits beside the loss (as
    ``transformers``' causal language models do), with loss parallel: values and gradients
    are the module's, and the backward communicates as without the logits returned (the
    loss-parallel op keeps its gradient shard: recomputing it from the logits would run
    its per-token reductions again)."""
    torch.manual_seed(0)
    reference = TinyLM(return_logits=True)
    inputs = _inputs()
    mesh = DeviceMesh(range(multidevice_test.size))
    model = meshfuse.parallelize(copy.deepcopy(reference), mesh, VOCAB_PARALLEL)
    here = [t.to(next(model.parameters()).device) for t in inputs]
    model(*here)  # build
    loss, logits = model(*here)
    with record_communications() as backward:
        (2 * loss + logits.full_tensor().sum() if isinstance(logits, DTensor)
         else 2 * loss + logits.sum()).backward()
    expected, expected_logits = reference(*inputs)
    (2 * expected + expected_logits.sum()).backward()
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(got.cpu(), ref.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if multidevice_test.size > 1:
        # as without the logits returned: the head's input gradient, a partial sum
        assert _traffic(backward) == Counter({("allreduce", B * S * 4 * E): 1})
