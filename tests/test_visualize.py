"""``meshfuse.visualize``: golden tables of who holds which block, and the picture."""

from __future__ import annotations

import re

import pytest
import torch
from mesh_helpers import MX, MY, shard

import meshfuse
from meshfuse import DataType, DeviceMesh, FusionDefinition, InputError
from meshfuse.visualize import blocks


def _tensor(shape: list[int]):
    """A fusion with one input of ``shape`` (returned) and its negation as output."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape, dtype=DataType.Float)
        fd.add_output(fd.ops.neg(x))
    return fd, x


def _text(obj, **kw) -> str:
    return meshfuse.visualize(obj, print_=False, **kw)


def test_block_shards_of_a_vector():
    _, x = _tensor([12])
    shard(x, 0, DeviceMesh(range(4)))
    assert _text(x) == "\n".join([
        "T0 [12] Float, mesh [0, 1, 2, 3], placements [S(0)]",
        "  0:3 | 3:6 | 6:9 | 9:12",
        "  0   | 1   | 2   | 3",
    ])


def test_cyclic_shards_of_a_vector():
    _, x = _tensor([12])
    shard(x, 0, DeviceMesh(range(4)), inner=True)
    assert _text(x) == "\n".join([
        "T0 [12] Float, mesh [0, 1, 2, 3], placements [S(0)c]",
        "  0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 | 11",
        "  0 | 1 | 2 | 3 | 0 | 1 | 2 | 3 | 0 | 1 | 2  | 3",
    ])


def test_rows_in_blocks_columns_cyclic():
    _, x = _tensor([8, 6])
    shard(x, 0, DeviceMesh(range(2)))
    x.split(2, 3, inner_split=True)  # a serial split: columns stay whole
    assert _text(x) == "\n".join([
        "T0 [8, 6] Float, mesh [0, 1], placements [S(0)]",
        "      | 0:6",
        "  0:4 | 0",
        "  4:8 | 1",
    ])


def test_two_splits_of_one_axis_over_a_2x2_mesh():
    """Rows split by 2 over mesh_y, then each half by 2 over mesh_x: quarters, in rank order
    of (y, x)."""
    _, x = _tensor([16, 4])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    x.set_device_mesh(mesh)
    x.outer_split(0, 2)
    x.axis(0).parallelize(MY)
    x.outer_split(1, 2)
    x.axis(1).parallelize(MX)
    assert _text(x) == "\n".join([
        "T0 [16, 4] Float, mesh [[0, 1], [2, 3]], placements [S(0), S(0)]",
        "        | 0:4",
        "    0:4 | 0",
        "    4:8 | 1",
        "   8:12 | 2",
        "  12:16 | 3",
    ])


def test_two_splits_block_then_cyclic():
    """Rows in two blocks over mesh_y; within a block, every other row over mesh_x."""
    _, x = _tensor([8])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    x.set_device_mesh(mesh)
    x.outer_split(0, 2)
    x.axis(0).parallelize(MY)
    x.split(1, 2, inner_split=True)
    x.axis(2).parallelize(MX)
    assert _text(x) == "\n".join([
        "T0 [8] Float, mesh [[0, 1], [2, 3]], placements [S(0), S(0)c]",
        "  0 | 1 | 2 | 3 | 4 | 5 | 6 | 7",
        "  0 | 1 | 0 | 1 | 2 | 3 | 2 | 3",
    ])


def test_a_2x2_mesh_rows_and_cyclic_columns():
    _, x = _tensor([4, 6])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    shard(x, 0, mesh, MY)
    shard(x, 1, mesh, MX, inner=True)
    assert _text(x) == "\n".join([
        "T0 [4, 6] Float, mesh [[0, 1], [2, 3]], placements [S(0), S(1)c]",
        "      | 0 | 1 | 2 | 3 | 4 | 5",
        "  0:2 | 0 | 1 | 0 | 1 | 0 | 1",
        "  2:4 | 2 | 3 | 2 | 3 | 2 | 3",
    ])


def test_a_2x2_mesh_with_replicas():
    _, x = _tensor([4, 6])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    shard(x, 1, mesh, MX)
    assert _text(x) == "\n".join([
        "T0 [4, 6] Float, mesh [[0, 1], [2, 3]], placements [R, S(1)]",
        "      | 0:3 | 3:6",
        "  0:4 | 0,2 | 1,3",
    ])


def test_higher_rank_draws_the_chosen_axes():
    _, x = _tensor([2, 4, 6])
    mesh = DeviceMesh(range(2))
    shard(x, 1, mesh)
    assert _text(x, axes=(1, 2)) == "\n".join([
        "T0 [2, 4, 6] Float, mesh [0, 1], placements [S(1)]; drawn: axes 1, 2",
        "      | 0:6",
        "  0:2 | 0",
        "  2:4 | 1",
    ])
    # Axis 1, sharded, is not drawn: each cell lists every rank holding part of it.
    assert _text(x, axes=(0, 2)).splitlines()[1:] == ["      | 0:6", "  0:2 | 0,1"]


def test_many_blocks_are_elided():
    _, x = _tensor([40])
    shard(x, 0, DeviceMesh(range(2)), inner=True)
    text = _text(x)
    assert text.splitlines()[1].endswith("| 15 | ...")
    assert text.splitlines()[-1] == "  (40 blocks along axis 0; the first 16 shown)"


def test_a_whole_fusion_and_a_symbolic_shape():
    fd, x = _tensor([-1, 4])
    shard(x, 0, DeviceMesh(range(2)))
    with pytest.raises(InputError, match="axis 0 of T0 is symbolic; pass the global shape"):
        _text(x)
    assert _text(x, shape=[6, 4]).splitlines()[2:] == ["  0:3 | 0", "  3:6 | 1"]
    with pytest.raises(InputError, match="axis 0 of T0 is symbolic"):
        _text(fd)
    fd2, y = _tensor([6, 4])
    shard(y, 0, DeviceMesh(range(2)))
    text = _text(fd2)
    assert [line for line in text.splitlines() if line.startswith("T")] == [
        "T0 [6, 4] Float, mesh [0, 1], placements [S(0)]",
        "T1 [6, 4] Float, mesh [0, 1], placements [S(0)]",
    ]


def test_bad_axes():
    _, x = _tensor([2, 4, 6])
    with pytest.raises(InputError, match=r"axes=\[0, 3\] for T0, which has 3 axes"):
        _text(x, axes=(0, 3))
    with pytest.raises(InputError, match="one or two distinct axes"):
        _text(x, axes=(0, 1, 2))


def test_owners_cover_every_element_once_per_replica():
    _, x = _tensor([6, 10])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    shard(x, 0, mesh, MY, inner=True)
    shard(x, 1, mesh, MX)
    b = blocks(x)
    covered = torch.zeros(6, 10, dtype=torch.int64)
    for r, row in zip(b.rows, b.owners):
        for c, owners in zip(b.cols, row):
            covered[r.start:r.stop, c.start:c.stop] += len(owners)
    assert covered.eq(1).all()


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    _, x = _tensor([4, 6])
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    shard(x, 0, mesh, MY)
    shard(x, 1, mesh, MX, inner=True)
    path = tmp_path / "shards.png"
    meshfuse.visualize(x, png=str(path), print_=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rich_colours_the_table_on_a_terminal(monkeypatch, capsys):
    pytest.importorskip("rich")
    _, x = _tensor([4, 6])
    shard(x, 1, DeviceMesh(range(2)))
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")
    text = meshfuse.visualize(x)
    shown = capsys.readouterr().out
    assert "\x1b[" in shown  # colours
    plain = re.sub(r"\x1b\[[0-9;]*m", "", shown)
    assert plain.strip().splitlines() == text.splitlines()


def _many(vectors: int = 2):
    """A fusion of five 2-D inputs (rows or columns split over a 2x2 mesh's rows) and
    ``vectors`` 1-D ones, with their outputs: 5 + vectors inputs, as many outputs."""
    mesh = DeviceMesh(torch.arange(4).reshape(2, 2))
    with FusionDefinition() as fd:
        xs = [fd.define_tensor([8, 16], name=f"x{i}") for i in range(5)]
        vs = [fd.define_tensor([12], name=f"v{i}") for i in range(vectors)]
        for t in xs + vs:
            fd.add_output(fd.ops.neg(t))
    for i, x in enumerate(xs):
        shard(x, i % 2, mesh, MY)
    for v in vs:
        shard(v, 0, mesh, MX)
    return fd


def test_the_panels_of_many_tensors_are_laid_out_in_rows():
    from meshfuse.visualize import MAX_COLUMNS, PANEL, STRIP, _tensors, panel_grid

    views = [blocks(tv) for tv in _tensors(_many())]
    # x0..x4, v0, v1, then their outputs: rows of 4, the last holding only vectors
    assert [len(b.axes) for b in views] == [2] * 5 + [1, 1] + [2] * 5 + [1, 1]
    assert panel_grid(views) == (MAX_COLUMNS, [PANEL[1]] * 3 + [STRIP])
    assert panel_grid(views[:3]) == (3, [PANEL[1]])  # a few tensors: one row, as before
    assert panel_grid(views[5:7]) == (2, [STRIP])


def test_png_of_many_tensors_is_a_grid_readable_at_its_size(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "many.png"
    meshfuse.visualize(_many(), png=str(path), print_=False)
    height, width = imread(str(path)).shape[:2]
    assert (width, height) == (4 * 504, round((3 * 3.6 + 1.6 + 0.4) * 120))  # 120 dpi


def test_a_1d_tensor_is_drawn_as_a_strip_without_a_second_axis(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt
    from matplotlib.image import imread

    from meshfuse.visualize import _draw

    _, v = _tensor([12])
    shard(v, 0, DeviceMesh(range(3)))
    b = blocks(v)
    fig, ax = plt.subplots()
    _draw(ax, b, sorted({o for row in b.owners for o in row}))
    assert not ax.get_yaxis().get_visible() and not ax.spines["left"].get_visible()
    assert ax.get_xaxis().get_visible() and ax.get_box_aspect() < 0.2
    plt.close(fig)
    path = tmp_path / "vector.png"
    meshfuse.visualize(v, png=str(path), print_=False)
    height, width = imread(str(path)).shape[:2]
    assert height < width / 2  # a strip, not a square panel
