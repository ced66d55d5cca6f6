"""The thread a backward through meshfuse's autograd nodes runs on: the caller's.

PyTorch's autograd engine runs the nodes of a CUDA tensor's backward on a thread of its own
per device: ``loss.backward()`` hands the work over to that thread, which takes the GIL to
run a Python node (meshfuse's: :class:`~meshfuse.autodiff.function.FusionFunction`), and
hands the end back. Measured on an H200 host (``benchmarks/host_profile.py``), an empty
autograd function of 13 inputs cost 278 us per forward and backward that way and 134 us with
the backward on the calling thread, and the small GPT layer's step 657 against 410 us of
host time: the two hand-overs are a quarter of a small layer's step, and the GPU idles
through them when the step is host-bound. A backward whose nodes all run on the CPU already
runs on the calling thread; so does any backward where
``torch.autograd.set_multithreading_enabled(False)`` holds, the engine's documented switch.

So a call of a meshfuse autograd function with grad mode on turns that switch off for the
calling thread (:func:`run_backward_here`): each later backward of that thread runs its
nodes in order on it, with the same streams and the same results. What it gives up is the
engine running the nodes of several devices' backward at once on their threads, which a
process driving one GPU never does. ``MESHFUSE_BACKWARD_THREAD=device`` keeps PyTorch's
default (read at a thread's first call).
"""

from __future__ import annotations

import os

import torch

from meshfuse.errors import InputError

BACKWARD_THREAD_ENV = "MESHFUSE_BACKWARD_THREAD"


def run_backward_here() -> None:
    """Turns the engine's device threads off for this thread, unless off already or
    ``MESHFUSE_BACKWARD_THREAD=device`` says to keep them (see the module doc)."""
    if torch.autograd.is_multithreading_enabled() and _calling_thread_wanted():
        torch.autograd.set_multithreading_enabled(False)  # set at once, for this thread


def _calling_thread_wanted() -> bool:
    value = os.environ.get(BACKWARD_THREAD_ENV, "").strip().lower()
    if value in ("", "calling"):
        return True
    if value == "device":
        return False
    raise InputError(f"{BACKWARD_THREAD_ENV}={value!r}: use 'calling' (the default: a backward "
                     "runs on the thread that calls it) or 'device' (PyTorch's engine threads)")
