"""``meshfuse.visualize``: which rank holds which block of a tensor, as a table or a picture.

Like DTensor's ``visualize_sharding`` and JAX's ``visualize_array_sharding``, for any meshfuse
schedule: block and cyclic splits, several splits of one axis, 1-, 2- and 3-D meshes, replicas
and partial results. A 1-D tensor is drawn as one row of blocks; a 2-D tensor as a grid (rows:
axis 0, columns: axis 1); for more axes, pass the two to draw (``axes=(1, 2)``), by default
the sharded ones. A cell lists every rank that holds that block: several ranks for replicas,
and, when an axis that is not drawn is sharded too, every rank holding part of it.

The text needs nothing beyond torch. ``png=path`` also saves a picture (matplotlib, the
``viz`` extra); ``rich`` (also in ``viz``) colours the table when printing to a terminal.

Example (rows of a ``[8, 12]`` tensor split over 2 ranks, columns cyclically over 2 more)::

    >>> print(visualize(tv, print_=False))
    T0 [8, 12] Float, mesh [[0, 1], [2, 3]], placements [S(0), S(1)c]
          | 0 | 1 | 2 | 3 | ...
      0:4 | 0 | 1 | 0 | 1 | ...
      4:8 | 2 | 3 | 2 | 3 | ...
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import torch

from meshfuse.errors import InputError
from meshfuse.ir.fusion import Fusion, partial_reduce_op
from meshfuse.ir.layout import derived_extents, local_indices
from meshfuse.ir.placement import Shard, placements
from meshfuse.ir.tensor_view import TensorView
from meshfuse.passes.pipeline import compiled_for
from meshfuse.runtime.interpreter.binding import device_coords

MAX_BLOCKS = 16  # blocks drawn along one axis in the text; the rest is elided


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Who holds what in a 1-D or 2-D view of a tensor.

    ``rows`` and ``cols`` are runs of global indices along the drawn axes (one row,
    ``range(1)``, for a 1-D view) over which the owners do not change; ``owners[i][j]`` are
    the ranks holding block ``(rows[i], cols[j])``, ascending; ``empty`` the ranks of the
    mesh holding none (the short end of an uneven split).
    """

    title: str
    axes: tuple[int, ...]
    rows: tuple[range, ...]
    cols: tuple[range, ...]
    owners: tuple[tuple[tuple[int, ...], ...], ...]
    empty: tuple[int, ...] = ()


def visualize(obj, axes: Sequence[int] | None = None, shape: Sequence[int] | None = None,
              png: str | None = None, print_: bool = True) -> str:
    """Shows which rank holds which block of a tensor, or of each input and output of a fusion.

    Args:
        obj: a scheduled TensorView, or a FusionDefinition (or Fusion): its inputs and
            outputs, one table each. Tensors the user did not schedule are shown as sharding
            propagation shards them.
        axes: the one or two logical axes to draw (a tensor of more than 2 axes); default:
            its sharded axes, else its last two.
        shape: the global shape, needed when the tensor has symbolic (``-1``) extents.
        png: a file to save the picture to (needs matplotlib).
        print_: print the table (coloured by ``rich`` on a terminal when it is installed).

    Returns:
        The plain-text tables.

    Raises:
        InputError: for bad ``axes`` or ``shape``, or a symbolic extent without ``shape``.
    """
    tensors = _tensors(obj)
    views = [blocks(tv, axes if len(tensors) == 1 else None,
                    shape if len(tensors) == 1 else None) for tv in tensors]
    text = "\n\n".join(format_blocks(b) for b in views)
    if print_:
        _print(views, text)
    if png is not None:
        save_png(views, png)
    return text


def blocks(tv: TensorView, axes: Sequence[int] | None = None,
           shape: Sequence[int] | None = None) -> Blocks:
    """The ownership of ``tv``'s blocks along ``axes`` (see :func:`visualize`)."""
    tv = _final(tv)
    ids = tv.materialized()
    extents = _extents(tv, shape)
    drawn = _drawn_axes(tv, axes)
    ranks = tv.mesh.device_ids if tv.mesh is not None else (0,)
    # holds[a][r, i]: rank number r holds index i of drawn axis a.
    holds = []
    for a in drawn:
        n = extents[ids[a]]
        rows = []
        for r in ranks:
            index = None if tv.mesh is None else \
                local_indices(tv, ids[a], extents, device_coords(tv, r))
            row = torch.ones(n, dtype=torch.bool)
            if index is not None:
                row = torch.zeros(n, dtype=torch.bool)
                row[index] = True
            rows.append(row)
        holds.append(torch.stack(rows))
    if len(holds) == 1:
        holds.insert(0, torch.ones(len(ranks), 1, dtype=torch.bool))
    rows, cols = _runs(holds[0]), _runs(holds[1])
    owners = tuple(
        tuple(tuple(r for k, r in enumerate(ranks) if holds[0][k, i.start] and holds[1][k, j.start])
              for j in cols)
        for i in rows)
    held = {r for row in owners for o in row for r in o}
    empty = tuple(r for r in ranks if r not in held)
    return Blocks(_title(tv, ids, extents, drawn), drawn, rows, cols, owners, empty)


def format_blocks(b: Blocks, max_blocks: int = MAX_BLOCKS) -> str:
    """``b`` as an ASCII grid: column heads are index ranges of the last drawn axis, row heads
    those of the first (none for a 1-D view); at most ``max_blocks`` runs per axis."""
    rows, cols = b.rows[:max_blocks], b.cols[:max_blocks]
    head = [""] + [_span(c) for c in cols]
    body = [[_span(r) if len(b.axes) == 2 else ""] + [_ranks(o) for o in owners[:max_blocks]]
            for r, owners in zip(rows, b.owners)]
    more_cols = len(b.cols) > max_blocks
    if more_cols:
        head.append("...")
        body = [line + ["..."] for line in body]
    if len(b.rows) > max_blocks:
        body.append(["..."] + [""] * (len(head) - 1))
    if len(b.axes) == 1:  # one row: no row heads
        head, body = head[1:], [line[1:] for line in body]
    widths = [max(len(line[c]) for line in [head, *body]) for c in range(len(head))]
    lines = [b.title]
    for line in [head, *body]:
        first = line[0].rjust(widths[0]) if len(b.axes) == 2 else line[0].ljust(widths[0])
        cells = [first] + [c.ljust(w) for c, w in zip(line[1:], widths[1:])]
        lines.append(("  " + " | ".join(cells)).rstrip())
    notes = [f"{len(b.cols)} blocks along axis {b.axes[-1]}" if more_cols else "",
             f"{len(b.rows)} blocks along axis {b.axes[0]}" if len(b.rows) > max_blocks else ""]
    if b.empty:
        notes.append(f"ranks {_ranks(b.empty)} hold nothing" if len(b.empty) > 1
                     else f"rank {b.empty[0]} holds nothing")
    notes = [n for n in notes if n]
    if notes:
        shown = f"; the first {max_blocks} shown" if len(b.cols) > max_blocks or \
            len(b.rows) > max_blocks else ""
        lines.append(f"  ({', '.join(notes)}{shown})")
    return "\n".join(lines)


def save_png(views: Sequence[Blocks], path: str) -> None:
    """Draws each view as a grid of coloured blocks (one colour per set of owners) and saves
    the figure to ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("visualize(png=...) needs matplotlib: pip install "
                          "'meshfuse[viz]' (or matplotlib)") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    columns, heights = panel_grid(views)
    fig, axs = plt.subplots(len(heights), columns, squeeze=False,
                            figsize=(PANEL[0] * columns, sum(heights) + 0.4),
                            gridspec_kw={"height_ratios": heights})
    # One colour per set of owners, the same in every panel.
    kinds = sorted({o for b in views for row in b.owners for o in row})
    for k, ax in enumerate(axs.flat):
        if k < len(views):
            _draw(ax, views[k], kinds)
        else:
            ax.set_axis_off()
    fig.suptitle("numbers: the ranks holding each block", fontsize=9, y=0.005, va="bottom")
    fig.tight_layout(rect=(0, 0.4 / (sum(heights) + 0.4), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


PANEL = (4.2, 3.6)  # inches per panel of a 2-D view; a row of 1-D views only is lower
STRIP = 1.6
MAX_COLUMNS = 4


def panel_grid(views: Sequence[Blocks]) -> tuple[int, list[float]]:
    """The picture's layout: panels per row (at most ``MAX_COLUMNS``, so that a fusion of
    many tensors stays readable at its natural size), and each row's height in inches (a
    row holding only 1-D views is a strip)."""
    columns = min(len(views), MAX_COLUMNS)
    rows = [views[i:i + columns] for i in range(0, len(views), columns)]
    return columns, [STRIP if all(len(b.axes) == 1 for b in row) else PANEL[1]
                     for row in rows]


def _draw(ax, b: Blocks, kinds: list[tuple[int, ...]]) -> None:
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator

    palette = colormaps["tab20"].colors
    for i, r in enumerate(b.rows):
        for j, c in enumerate(b.cols):
            owner = b.owners[i][j]
            k = kinds.index(owner)
            color = palette[(2 * k + k // 10) % len(palette)]
            ax.add_patch(_rectangle(c, r, color))
            if len(b.rows) * len(b.cols) <= 64:
                ax.text(c.start + len(c) / 2, r.start + len(r) / 2, _ranks(owner),
                        ha="center", va="center", fontsize=11, color="white",
                        fontweight="bold")
    ax.set_xlim(0, b.cols[-1].stop)
    ax.set_ylim(b.rows[-1].stop, 0)
    ax.set_title(b.title.split(", mesh")[0] + "\n" + b.title.split("placements ")[-1],
                 fontsize=10)
    ax.set_xlabel(f"axis {b.axes[-1]}")
    for axis in (ax.xaxis, ax.yaxis):  # indices: whole ticks
        axis.set_major_locator(MaxNLocator(integer=True))
    if len(b.axes) == 2:
        ax.set_ylabel(f"axis {b.axes[0]}")
    else:  # one row of blocks: no second axis, and a strip rather than a square
        ax.get_yaxis().set_visible(False)
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        ax.set_box_aspect(0.12)


def _rectangle(c: range, r: range, color):
    from matplotlib.patches import Rectangle

    return Rectangle((c.start, r.start), len(c), len(r), facecolor=color, edgecolor="white",
                     linewidth=1.5)


def _print(views: Sequence[Blocks], text: str) -> None:
    try:
        from rich.console import Console
    except ImportError:
        print(text)
        return
    if not sys.stdout.isatty():
        print(text)
        return
    console = Console()
    styles = ["on blue", "on green", "on magenta", "on dark_orange", "on red", "on cyan",
              "on purple", "on yellow4"]
    for line in text.splitlines():
        console.print(_coloured(line, styles), highlight=False)


def _coloured(line: str, styles: list[str]):
    from rich.text import Text

    parts = line.split(" | ")
    text = Text(parts[0])
    for part in parts[1:]:
        text.append(" | ")
        first = part.strip().split(",")[0].split("-")[0]
        style = styles[int(first) % len(styles)] if first.isdigit() and ":" not in part else ""
        text.append(part, style=style)
    return text


def _tensors(obj) -> list[TensorView]:
    if isinstance(obj, TensorView):
        return [obj]
    fusion = getattr(obj, "fusion", obj)
    if not isinstance(fusion, Fusion):
        raise InputError(f"visualize takes a TensorView or a fusion, got {type(obj).__name__}")
    seen = [v for v in fusion.inputs() if isinstance(v, TensorView) and v.logical]
    return seen + [o for o in fusion.outputs() if o not in seen and o.logical]


def _final(tv: TensorView) -> TensorView:
    """``tv``'s compiled counterpart: sharded as propagation shards it (``tv`` itself is not
    changed)."""
    return compiled_for(tv.fusion)[tv]


def _extents(tv: TensorView, shape: Sequence[int] | None) -> dict:
    ids = tv.materialized()
    if shape is not None and len(shape) != len(ids):
        raise InputError(f"visualize: {tv.name} has {len(ids)} axes; shape={list(shape)} has "
                         f"{len(shape)}")
    given = dict(zip(ids, shape)) if shape is not None else {}
    logical = {}
    for axis, id_ in enumerate(ids):
        n = given.get(id_, id_.extent)
        if n is None:
            raise InputError(f"visualize: axis {axis} of {tv.name} is symbolic; pass the global "
                             "shape, e.g. visualize(tv, shape=[...])")
        logical[id_] = n
    for id_ in tv.logical:  # reduction IDs: any extent their splits divide
        logical.setdefault(id_, id_.extent or 1)
    return derived_extents(tv, logical)


def _drawn_axes(tv: TensorView, axes: Sequence[int] | None) -> tuple[int, ...]:
    ndim = len(tv.materialized())
    if ndim == 0:
        raise InputError(f"visualize: {tv.name} is 0-D; there are no blocks to draw")
    if axes is None:
        sharded = [] if tv.mesh is None else sorted(
            {p.axis for p in placements(tv) if isinstance(p, Shard)})
        axes = sharded[:2] if sharded else range(max(0, ndim - 2), ndim)
        if len(axes) == 1 and ndim > 1:
            other = axes[0] + 1 if axes[0] + 1 < ndim else axes[0] - 1
            axes = sorted([axes[0], other])
    axes = tuple(axes)
    if not 1 <= len(axes) <= 2 or len(set(axes)) != len(axes) or \
            any(not 0 <= a < ndim for a in axes):
        raise InputError(f"visualize: axes={list(axes)} for {tv.name}, which has {ndim} axes; "
                         f"give one or two distinct axes in 0..{ndim - 1}")
    return tuple(sorted(axes))


def _runs(holds: torch.Tensor) -> tuple[range, ...]:
    """Maximal runs of indices whose column of ``holds`` (ranks x indices) is the same."""
    n = holds.shape[1]
    changes = [0] + [i for i in range(1, n) if not torch.equal(holds[:, i], holds[:, i - 1])]
    return tuple(range(a, b) for a, b in zip(changes, changes[1:] + [n]))


def _title(tv: TensorView, ids, extents, drawn) -> str:
    shape = [extents[i] for i in ids]
    if tv.mesh is None:
        return f"{tv.name} {shape} {tv.dtype.name}, no mesh (one device holds it all)"
    mesh = repr(tv.mesh).removeprefix("DeviceMesh(").removesuffix(")")
    where = f"{tv.name} {shape} {tv.dtype.name}, mesh {mesh}, placements ["
    where += ", ".join(map(str, placements(tv, partial_reduce_op(tv)))) + "]"
    if len(ids) > 2:
        where += f"; drawn: axes {', '.join(map(str, drawn))}"
    return where


def _span(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}:{r.stop}"


def _ranks(owners: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``; no owner (an empty block) -> ``"-"``."""
    if not owners:
        return "-"
    runs = [[owners[0], owners[0]]]
    for r in owners[1:]:
        if r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}"
                    for a, b in runs)
