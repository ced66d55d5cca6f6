"""The fully sharded training script (``python -m meshfuse.examples.train_fsdp``): a GPT
stack on a dp x tp mesh trains like PyTorch on one device, reports each rank's memory and
writes its losses and their picture; a bad mesh is one line and exit status 2."""

from __future__ import annotations

import json

import pytest

from meshfuse.examples.train_fsdp import parse_args, run_rank


@pytest.mark.mpi
def test_script_trains_on_dp_by_tp(multidevice_test, tmp_path, capsys):
    d = multidevice_test.size
    mesh = "dp=2,tp=2" if d == 4 else f"dp={d}"
    out = tmp_path / "run"
    args = parse_args(["--mesh", mesh, "--steps", "3", "--out", str(out)], d)
    assert run_rank(args) == 0
    printed = capsys.readouterr().out
    assert "gathered parameters (peak)" in printed
    if multidevice_test.rank == 0:
        record = json.loads((out / "train_fsdp.json").read_text())
        assert record["ok"] and len(record["losses"]) == 3
        assert (out / "train_fsdp.png").exists()


@pytest.mark.parametrize(("argv", "world", "message"), [
    (["--mesh", "dp=2,tp=2"], 3, "has 4 devices but the launcher started 3 ranks"),
    (["--mesh", "dp2"], None, "write NAME=SIZE pairs"),
    (["--mesh", "dp=2,dp=2"], None, "each name once"),
    (["--mesh", "pp=2"], None, "name the dimensions dp"),
    (["--embed", "30", "--heads", "4"], None, "not a multiple of --heads"),
])
def test_a_bad_option_is_one_line_and_exit_2(argv, world, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv, world)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
