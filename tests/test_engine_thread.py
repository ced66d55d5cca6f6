"""The thread a backward through meshfuse's autograd nodes runs on
(``meshfuse.autodiff.engine_thread``): the caller's, unless ``MESHFUSE_BACKWARD_THREAD=device``.

Checked, each in a thread of its own (the switch is per thread): a call with grad mode on
turns the engine's device threads off for its thread, and the gradients are PyTorch's; a
call under ``no_grad`` and a call with ``device`` leave them on; a new thread starts with
them on; a bad value is a typed error naming the variable. On a GPU: the node's backward
runs on the thread that called ``backward()``, or on the engine's thread with ``device``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from meshfuse import DataType, FusionDefinition, InputError
from meshfuse.autodiff.engine_thread import BACKWARD_THREAD_ENV


class _Scaled(FusionDefinition):
    def definition(self) -> None:
        self.x = self.define_tensor([4, 3], dtype=DataType.Float)
        self.w = self.define_tensor([3], dtype=DataType.Float)
        self.add_output(self.ops.mul(self.ops.tanh(self.x), self.w))


def _in_a_thread(work):
    """``work()``'s result, run on a new thread (whose autograd switches are fresh)."""
    result, error = [], []

    def run():
        try:
            result.append(work())
        except Exception as e:  # noqa: BLE001 (handed to the test's thread)
            error.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _call(device="cpu", grad=True):
    """The function's gradients on ``device``, the thread its backward ran on, this
    thread's ident, whether the engine's device threads are on after the call, and the
    leaves (under ``no_grad``: the idents and the switch only)."""
    function = _Scaled().define().as_autograd_function()
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 3, generator=gen).to(device).requires_grad_(),
            torch.randn(3, generator=gen).to(device).requires_grad_())
    with torch.set_grad_enabled(grad):
        y = function([x, w])[0]
    threads_on = torch.autograd.is_multithreading_enabled()
    if not grad:
        return None, None, threading.get_ident(), threads_on
    ran_on = []
    y.register_hook(lambda g: ran_on.append(threading.get_ident()))
    grads = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    return grads, ran_on[0], threading.get_ident(), threads_on, x, w


def test_a_call_with_grad_runs_its_threads_backwards_on_it():
    grads, ran_on, me, threads_on, x, w = _in_a_thread(_call)
    assert not threads_on and ran_on == me
    rx, rw = x.detach().requires_grad_(), w.detach().requires_grad_()
    want = torch.autograd.grad(torch.tanh(rx) * rw, [rx, rw], torch.ones(4, 3))
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r)
    assert _in_a_thread(torch.autograd.is_multithreading_enabled)  # a new thread: untouched


def test_no_grad_and_the_device_setting_keep_torchs_threads(monkeypatch):
    assert _in_a_thread(lambda: _call(grad=False))[3]
    monkeypatch.setenv(BACKWARD_THREAD_ENV, "device")
    assert _in_a_thread(_call)[3]
    monkeypatch.setenv(BACKWARD_THREAD_ENV, "sideways")
    with pytest.raises(InputError, match=BACKWARD_THREAD_ENV):
        _in_a_thread(_call)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_backward_runs_on_the_calling_thread(monkeypatch):
    _, ran_on, me, threads_on, *_ = _in_a_thread(lambda: _call("cuda"))
    assert ran_on == me and not threads_on
    monkeypatch.setenv(BACKWARD_THREAD_ENV, "device")
    _, ran_on, me, threads_on, *_ = _in_a_thread(lambda: _call("cuda"))
    assert ran_on != me and threads_on  # the engine's thread for the device
