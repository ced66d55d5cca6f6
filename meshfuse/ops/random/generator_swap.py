"""Running a fused CUDA kernel on a chosen random stream, leaving torch's generator alone.

PyTorch's fused attention forwards (cuDNN, flash, memory-efficient) take no seed: they draw
their dropout mask from the device's default CUDA generator (its Philox seed and offset) and
return the state they used, which their backward takes back as tensors. To make such a kernel
draw from a stream of meshfuse's choosing, :class:`GeneratorSwap` points the default generator
at a private generator seeded with the stream's key for the duration of the call, then points
it back: the user's generator (its seed and offset) is untouched, whatever the kernel did.

The swap exchanges generator *state objects* (``graphsafe_get_state``/``graphsafe_set_state``:
a pointer each way, no tensor made, nothing copied), so a call costs a few microseconds of
host time. Where a torch build lacks them the state is saved and restored as a tensor
(``get_state``/``set_state``). One :class:`GeneratorSwap` per device is made on first use and
kept (:func:`generator_swap`); a program's fused dropout keeps one of its own per attention step.

**Inside a CUDA graph.** A generator cannot be seeded while a graph is captured, and a
captured kernel would replay the seed it was captured with, unless its generator is
*registered* with the graph before the capture: PyTorch then makes the captured kernel read
its Philox seed and offset from device memory, which each replay fills from the generator's
seed and offset of that moment (and then advances the offset past what the graph drew).
So a swap whose private generator was registered with the graph being captured
(:meth:`GeneratorSwap.capturing`) swaps it in without seeding it, and whoever replays the
graph seeds it (:meth:`GeneratorSwap.seed`) before each replay: the replayed kernel then
draws from ``(key, 0)``, as :meth:`GeneratorSwap.run` makes it draw outside a graph. Inside
any other capture, a dropout kernel is refused (the graph would replay one mask forever).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshfuse.errors import InputError

_MAX_SEED = 2**63 - 1  # a Philox seed as torch's manual_seed takes it


class GeneratorSwap:
    """The default generator of one device and a private one to swap in; see the module doc.
    The device is a CUDA device (what the fused kernels draw from), or the CPU, whose default
    generator ``torch.rand`` and friends draw from (tests use it to stand for a kernel)."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            self._default = torch.cuda.default_generators[index]
        else:
            self._default = torch.default_generator
        self._own = torch.Generator(device=device)
        self._cuda = device.type == "cuda"
        self.exchanges_states = _exchanges_states(self._default)
        self._registered = False  # its generator is registered with the graph being captured

    @property
    def generator(self) -> torch.Generator:
        """The private generator the kernel draws from (what a CUDA graph registers)."""
        return self._own

    def seed(self, key: int) -> None:
        """Seeds the private generator with ``key`` (Philox seed ``key mod 2**63``, offset
        0), as :meth:`run` does before its kernel: what a replayed graph's kernel draws from
        when its graph is replayed next."""
        self._own.manual_seed(key & _MAX_SEED)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Within: :meth:`run` may be captured into a CUDA graph, which the caller promises
        has this swap's generator registered (``graph.register_generator_state``)."""
        self._registered = True
        try:
            yield
        finally:
            self._registered = False

    def run(self, key: int, kernel: Callable[..., Any], *args: Any) -> Any:
        """``kernel(*args)`` with the default generator seeded with ``key`` (Philox seed
        ``key mod 2**63``, offset 0), restored afterwards, also when the kernel raises.

        Inside a CUDA graph capture (see the module doc) the generator is swapped in
        unseeded: ``key`` is the replay's to set, through :meth:`seed`.

        Raises:
            InputError: inside a CUDA graph capture that this swap's generator is not
                registered with (:meth:`capturing`): the graph would replay one mask on
                every replay.
        """
        if self._cuda and torch.cuda.is_current_stream_capturing():
            if not (self._registered and self.exchanges_states):
                raise InputError(
                    "sdpfa_fwd: dropout_p > 0 inside a CUDA graph capture is not supported "
                    "(the graph would replay one mask forever); run without "
                    "cuda_graph=True (execute replays dropout from a graph by itself)"
                )
            return self._swapped(kernel, *args)
        if not self.exchanges_states:
            return self._run_saving_tensors(key, kernel, *args)
        self._own.manual_seed(key & _MAX_SEED)
        return self._swapped(kernel, *args)

    def _swapped(self, kernel: Callable[..., Any], *args: Any) -> Any:
        """``kernel(*args)`` with the default generator's state exchanged for the private
        generator's, then back (also when the kernel raises)."""
        default, own = self._default, self._own
        saved = default.graphsafe_get_state()
        default.graphsafe_set_state(own)
        try:
            return kernel(*args)
        finally:
            default.graphsafe_set_state(saved)

    def _run_saving_tensors(self, key: int, kernel: Callable[..., Any], *args: Any) -> Any:
        default = self._default
        saved = default.get_state()
        default.manual_seed(key & _MAX_SEED)
        try:
            return kernel(*args)
        finally:
            default.set_state(saved)


def _exchanges_states(generator) -> bool:
    """Whether ``generator`` supports swapping state objects (tried once, harmlessly)."""
    try:
        generator.graphsafe_set_state(generator.graphsafe_get_state())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


_SWAPS: dict[torch.device, GeneratorSwap] = {}


def generator_swap(device: torch.device) -> GeneratorSwap:
    """The :class:`GeneratorSwap` of ``device``, made on first use."""
    swap = _SWAPS.get(device)
    if swap is None:
        swap = _SWAPS[device] = GeneratorSwap(device)
    return swap
