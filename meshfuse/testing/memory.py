"""``LiveBytes``: the peak of the bytes held by live tensors, on any device (the CPU included).

``torch.cuda.max_memory_allocated`` answers "how much memory did this need" on a GPU only;
tests of memory behaviour (a backward that frees what it saved after its last use, a
communication that does not copy its input) must run on CPU-only machines too. Inside a
``with LiveBytes() as m:`` block, every tensor storage an op allocates is counted from its
allocation until it is freed (when its last tensor dies), and ``m.peak`` is the largest total
seen after any op. Storages that existed before the block (inputs, parameters) are not
counted, nor are an op's internal temporaries: what is measured is what the program keeps
alive between ops, which is what a caching allocator's peak follows.

Example:
    >>> with LiveBytes() as m:
    ...     y = (x @ w).relu()
    >>> m.peak   # bytes: the matmul's output and relu's output, both alive at relu
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages allocated inside the block while they live.

    Attributes:
        live: bytes held now by storages allocated inside the block.
        peak: the largest ``live`` seen after an op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        results = out if isinstance(out, tuple | list) else (out,)
        for index, result in enumerate(results):
            # An output that aliases an argument (a view, an in-place op) allocates nothing.
            if index < len(returns) and returns[index].alias_info is not None:
                continue
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self._count(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._counted:
            return
        self._counted.add(storage)
        size = storage.nbytes()
        self.live += size
        weakref.finalize(storage, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size
