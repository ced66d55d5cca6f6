"""A kernel run on a chosen random stream (``GeneratorSwap``), and the per-signature dropout of
a fused kernel (``FusedDropout``).

On CPU, ``torch.rand`` stands for a fused kernel: it draws from the device's default
generator, as cuDNN and flash attention draw their masks from the CUDA one. The same tests run
against the CUDA generator on a GPU host.
"""

from __future__ import annotations

import pytest
import torch

from meshfuse.errors import InputError
from meshfuse.ir.global_index import GlobalIndex
from meshfuse.ops.attention.backends import AttentionBackend
from meshfuse.ops.attention.dropout import (
    FusedDropout,
    attention_site,
    check_kernel_form,
    kernel_state,
)
from meshfuse.ops.random.generator_swap import GeneratorSwap, generator_swap

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _draw(device):
    return torch.rand(64, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_same_key_same_draws_and_the_generator_left_alone(device):
    swap = GeneratorSwap(torch.device(device))
    torch.manual_seed(11)
    expected_next = _draw(device)
    torch.manual_seed(11)
    first = swap.run(5, _draw, device)
    again = swap.run(5, _draw, device)
    other = swap.run(6, _draw, device)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # The user's generator continues as if nothing had drawn from it.
    assert torch.equal(_draw(device), expected_next)


@pytest.mark.parametrize("device", DEVICES)
def test_the_generator_is_restored_when_the_kernel_raises(device):
    swap = GeneratorSwap(torch.device(device))

    def failing():
        _draw(device)
        raise RuntimeError("kernel failed")

    torch.manual_seed(3)
    expected = _draw(device)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError, match="kernel failed"):
        swap.run(9, failing)
    assert torch.equal(_draw(device), expected)


def test_one_swap_per_device():
    assert generator_swap(torch.device("cpu")) is generator_swap(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_swaps_state_objects_and_refuses_graph_capture(monkeypatch):
    swap = GeneratorSwap(torch.device("cuda"))
    assert swap.exchanges_states  # the cheap path: no state tensor made per call
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(InputError, match="CUDA graph"):
        swap.run(1, _draw, "cuda")


def _site(heads: range):
    """The dropout site of a shard holding ``heads`` of a [2, 8, 16, 4] attention."""
    index = GlobalIndex((2, 8, 16, 4), (None, torch.tensor(list(heads)), None, None))
    return attention_site("shard", index, 16)


def _fake_flash(device):
    """A stand-in for flash attention's forward: a 'mask' drawn from the default generator,
    and an RNG state in flash's (and nvFuser's) form."""
    def kernel(*args):
        state = torch.zeros(2, dtype=torch.uint64, device=device)
        return _draw(device), None, state, state[0]
    return kernel


@pytest.mark.parametrize("device", DEVICES)
def test_fused_dropout_draws_one_stream_per_shard_position(device):
    kernel = _fake_flash(device)
    first, second = (FusedDropout(_site(h), AttentionBackend.FLASH, torch.device(device))
                     for h in (range(4), range(4, 8)))
    a = first.forward(kernel, 99, 3)[0]
    assert torch.equal(first.forward(kernel, 99, 3)[0], a)  # the same seed: the same mask
    assert not torch.equal(second.forward(kernel, 99, 3)[0], a)  # another shard
    assert not torch.equal(first.forward(kernel, 99, 4)[0], a)  # another offset
    assert not torch.equal(first.forward(kernel, 98, 3)[0], a)  # another seed


def test_fused_dropout_key_is_the_sites_stream():
    site = _site(range(4, 8))
    dropout = FusedDropout(site, AttentionBackend.FLASH, torch.device("cpu"))
    for seed, offset in ((1, 0), (1, 0), (2, 0), (2, 5), (1, 0)):
        assert dropout.key(seed, offset) == site.stream(seed, offset)
    assert site.words == (0, 4, 0)
    assert attention_site("global", site.index, 16).words == ()


def _fake_cudnn(device):
    """A stand-in for cuDNN attention's forward: its RNG state is two ``[1]`` int64 tensors."""
    def kernel(*args):
        return (_draw(device), None, torch.tensor([7], device=device),
                torch.tensor([0], device=device))
    return kernel


def test_kernel_form_passes_the_kernels_state_through():
    """In kernel form the forward's RNG state is the kernel's own tensors (no join), and the
    backward takes them as they are; otherwise it is joined into nvFuser's [2] uint64 form,
    which the backward splits back."""
    site, cpu, cudnn = _site(range(4)), torch.device("cpu"), AttentionBackend.CUDNN
    kernel = _fake_cudnn("cpu")
    _, _, seed, offset = FusedDropout(site, cudnn, cpu, kernel_form=True).forward(kernel, 1, 0)
    assert (seed.dtype, seed.tolist(), offset.tolist()) == (torch.int64, [7], [0])
    assert kernel_state(cudnn, seed, offset, 0.1, cpu, kernel_form=True) == (seed, offset)
    check_kernel_form(cudnn, seed, offset)
    _, _, pair, zero = FusedDropout(site, cudnn, cpu).forward(kernel, 1, 0)
    assert (pair.dtype, pair.view(torch.int64).tolist(), zero.ndim) == (torch.uint64, [7, 0], 0)
    back = kernel_state(cudnn, pair, zero, 0.1, cpu)
    assert [t.tolist() for t in back] == [[7], [0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_captured_draw_replays_the_seed_set_before_each_replay():
    """PyTorch's graph-safe RNG, as the automatic replay uses it: a kernel captured through a
    swap whose generator is registered with the graph draws, at each replay, from the seed
    given to the swap before it, exactly as an eager run with that key; the user's generator
    is left alone."""
    swap = GeneratorSwap(torch.device("cuda"))
    expected = {key: swap.run(key, _draw, "cuda") for key in (3, 4)}
    torch.cuda.manual_seed(9)
    user = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(9)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(swap.generator)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        swap.run(0, _draw, "cuda")  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    with swap.capturing(), torch.cuda.graph(graph):
        out = swap.run(0, _draw, "cuda")  # the key is the replay's to set
    for key in (3, 4, 3):
        swap.seed(key)
        graph.replay()
        assert torch.equal(out, expected[key])
    assert torch.equal(torch.rand(8, device="cuda"), user)
