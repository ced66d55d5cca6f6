"""Statements of the fuzzer's ``indexing`` feature (``fuzz_programs.Features.indexing``),
functions of the generator ``g`` (``fuzz_programs._Gen``): lookups at integer positions
drawn in range (index inputs of Int or Int32), whose looked-up axis the schedules may split
like any other (a vocabulary split: partial lookups):

- ``embedding_fwd`` of ids of one or two axes into a new ``[V, E]`` table;
- ``take_along_axis`` and ``index_select`` of a value along a random axis;
- ``cross_entropy`` of ``[N, C]`` logits on class indices, with a random reduction,
  ``label_smoothing`` and ``ignore_index`` (0, a class that occurs, or -100, none); a sum
  with no ignored class reads the logits rounded to bfloat16 and widened back (Hugging
  Face's ``logits.float()``: the op reads the bfloat16 values through the cast).

A lookup is exact (a partial lookup adds zeros), so its results may be compared.
"""

from __future__ import annotations


def indexing(g) -> None:
    """One indexing statement."""
    g.rng.choice([_embedding, _embedding, _take_along_axis, _index_select, _cross_entropy,
                  _cross_entropy])(g)
    g.features.add("indexing")


def _index_dtype(g) -> str:
    return g.rng.choice(["Int", "Int32"])


def _embedding(g) -> None:
    vocab, hidden = g.extent(), g.extent()
    ids = g.new_input(tuple(g.extent() for _ in range(g.rng.randint(1, 2))), _index_dtype(g),
                      high=vocab)
    weight = g.new_input((vocab, hidden))
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.embedding_fwd({ids.name}, {weight.name})",
           f"{y} = torch.nn.functional.embedding({ids.name}.long(), {weight.name})", [y],
           weight.exact)


def _lookup_source(g):
    x = g.pick_or_input(lambda v: v.tensor.ndim >= 1 and not any(v.broadcast))
    if x.tensor.ndim == 0 or any(x.broadcast):
        x = g.random_input(2)
    return x, g.rng.randrange(x.tensor.ndim)


def _take_along_axis(g) -> None:
    x, dim = _lookup_source(g)
    shape = list(x.tensor.shape)
    shape[dim] = g.extent()
    index = g.new_input(tuple(shape), _index_dtype(g), high=x.tensor.shape[dim])
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.take_along_axis({x.name}, {index.name}, {dim})",
           f"{y} = torch.take_along_dim({x.name}, {index.name}.long(), {dim})", [y], x.exact)


def _index_select(g) -> None:
    x, dim = _lookup_source(g)
    index = g.new_input((g.extent(),), _index_dtype(g), high=x.tensor.shape[dim])
    (y,) = g.fresh()
    g.emit(f"{y} = fd.ops.index_select({x.name}, {index.name}, {dim})",
           f"{y} = torch.index_select({x.name}, {dim}, {index.name})", [y], x.exact)


def _cross_entropy(g) -> None:
    logits = g.pick(lambda v: v.tensor.ndim == 2 and not any(v.broadcast)) \
        if g.rng.random() < 0.5 else None
    logits = logits or g.new_input((g.extent(), g.extent()))
    rows, classes = logits.tensor.shape
    target = g.new_input((rows,), _index_dtype(g), high=classes)
    ignore = g.rng.choice([-100, 0])
    # Every row may be ignored (ignore_index 0): no mean there (0 / 0).
    reduction = g.rng.choice(["sum", "none"] + (["mean", "mean"] if ignore < 0 else []))
    smoothing = g.rng.choice([0.0, 0.0, 0.1])
    name = logits.name
    if reduction == "sum" and ignore < 0:  # (no new draw: the seeds' programs stay theirs)
        # Hugging Face's loss: logits rounded to bfloat16 and widened again, which the
        # cross entropy reads through (it keeps a bfloat16 gradient).
        narrow, name = g.fresh(2)
        g.emit(f"{narrow} = fd.ops.cast({logits.name}, DataType.BFloat16)",
               f"{narrow} = {logits.name}.to(torch.bfloat16)", [narrow], False)
        g.emit(f"{name} = fd.ops.cast({narrow}, DataType.Float)", f"{name} = {narrow}.float()",
               [name], False)
    (y,) = g.fresh()
    args = f"reduction={reduction!r}, ignore_index={ignore}, label_smoothing={smoothing}"
    g.emit(f"{y} = fd.ops.cross_entropy({name}, {target.name}, {args})",
           f"{y} = torch.nn.functional.cross_entropy({name}, {target.name}.long(), "
           f"{args})", [y], False)
    g.features.add("cross_entropy")
