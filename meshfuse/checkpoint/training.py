"""``--save DIR`` / ``--resume DIR`` for training scripts, in two calls.

A script adds the options (:func:`add_arguments`), asks where to start
(:func:`resume`: the saved step, the model, optimizer and random state restored, whatever
mesh the checkpoint was saved on) and saves after its last step (:func:`save_at`: the
step and the data position, which for the examples' synthetic data is the step)::

    start = resume(args.resume, model, opt)
    for step in range(start, args.steps):
        ...
    save_at(args.save, model, opt, args.steps)
"""

from __future__ import annotations

import argparse

import torch

from meshfuse.checkpoint.api import load, save


def add_arguments(parser: argparse.ArgumentParser, save: str = "--save",
                  resume: str = "--resume") -> None:
    """Adds the options ``save`` and ``resume`` (``--save DIR``, ``--resume DIR``: read as
    ``args.save`` and ``args.resume``) to ``parser``."""
    parser.add_argument(save, dest="save", metavar="DIR", default=None,
                        help="after the last step, save a checkpoint (model, optimizer, "
                             "random state, step) to DIR")
    parser.add_argument(resume, dest="resume", metavar="DIR", default=None,
                        help="start from the checkpoint in DIR (saved on any mesh), at its "
                             "step; --steps counts from 0, so train --steps minus its step")


def resume(directory: str | None, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None = None) -> int:
    """The step to start at: 0 without ``directory``; else the checkpoint's step, with
    ``model``, ``optimizer`` and the random state loaded from it."""
    if not directory:
        return 0
    extra = load(directory, model, optimizer).extra or {}
    return int(extra.get("step", 0))


def save_at(directory: str | None, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None, step: int) -> None:
    """Saves a checkpoint of the state after ``step`` steps to ``directory`` (if given)."""
    if directory:
        save(directory, model, optimizer, extra={"step": step, "data": {"next_step": step}})
