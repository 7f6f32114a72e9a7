"""Typed cells (bnlab.experiments.cells): declared once, parsed once by the engine, refused with a clear
message, and never a change to what the store keeps (cell keys)."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import pytest

from bnlab.experiments import Cell, Experiment, cell_key, cell_param, list_experiments, parse_cell, run_sweep
from bnlab.experiments.spec import SCALES
from bnlab.experiments.store import ResultsStore


@dataclass(frozen=True, kw_only=True)
class ToyCell(Cell):
    width: int = cell_param(minimum=1)
    lr: float = cell_param(minimum=0.0, strict_minimum=True)
    seed: int = cell_param(minimum=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
    depths: tuple[int, ...] | None = cell_param(None, minimum=1)
    steps: int | None = None
    epochs: float | None = None
    gamma: float | Literal["inf"] | None = cell_param(None, minimum=0.0, strict_minimum=True)

    def check(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"steps={self.steps} and epochs={self.epochs} are not allowed together")


GOOD = {"width": 8, "lr": 0.1, "seed": 3}


@pytest.mark.parametrize("bad, key, allowed", [
    (dict(GOOD, colour="red"), "'colour'", "declares only"),               # unknown key
    ({"width": 8, "seed": 3}, "'lr'", "is missing"),                        # missing key
    (dict(GOOD, width="8"), "'width'='8'", "expected an integer"),        # wrong type (a string)
    (dict(GOOD, width=8.0), "'width'=8.0", "expected an integer"),        # a float is not an int
    (dict(GOOD, width=True), "'width'=True", "expected an integer"),      # nor is a bool
    (dict(GOOD, width=0), "'width'=0", "expected an integer >= 1"),       # out of range
    (dict(GOOD, lr=0.0), "'lr'=0.0", "> 0"),                              # strict lower bound
    (dict(GOOD, optimizer="adamw"), "'optimizer'='adamw'", "one of 'sgd', 'adam'"),
    (dict(GOOD, depths=[2, 0]), "'depths'=[2, 0]", "a list of integers (each >= 1)"),
    (dict(GOOD, depths=4), "'depths'=4", "a list of integers"),
    (dict(GOOD, steps=3, epochs=1.0), "steps=3 and epochs=1.0", "not allowed together"),  # check()
    (dict(GOOD, gamma="infinite"), "'gamma'='infinite'", "a finite real number > 0 or 'inf' or null"),
    (dict(GOOD, gamma=-1.0), "'gamma'=-1.0", "a finite real number > 0 or 'inf'"),
])
def test_a_bad_cell_is_refused_naming_experiment_key_value_and_what_is_allowed(bad, key, allowed):
    with pytest.raises(ValueError) as info:
        parse_cell(ToyCell, bad, experiment="toy-exp")
    text = str(info.value)
    assert text.startswith("experiment 'toy-exp': ")
    assert key in text and allowed in text


def test_a_good_cell_is_typed_and_keeps_its_dict():
    params = dict(GOOD, depths=[2, 4], lr=1)  # an int where a float is declared: accepted as 1.0
    cell = ToyCell.parse(params, experiment="toy-exp")
    assert ToyCell.parse(dict(GOOD, gamma="inf")).gamma == "inf" and ToyCell.parse(dict(GOOD, gamma=2)).gamma == 2.0
    assert (cell.width, cell.lr, cell.depths, cell.optimizer, cell.steps) == (8, 1.0, (2, 4), "sgd", None)
    assert isinstance(cell.lr, float) and isinstance(cell.depths, tuple)
    # the stored dict comes back exactly (an int stays an int: the key would change otherwise)
    assert cell.params == params and cell_key(cell.params) == cell_key(params)
    assert ToyCell.parse(cell) is cell  # parsed once: a typed cell passes through
    # a cell built in code: its set fields, tuples as JSON lists
    assert ToyCell(width=2, lr=0.5, seed=0, depths=(1, 2)).params == {
        "width": 2, "lr": 0.5, "seed": 0, "optimizer": "sgd", "depths": [1, 2]}


def test_an_undeclarable_field_type_is_refused():
    @dataclass(frozen=True)
    class Bad(Cell):
        table: dict = None

    with pytest.raises(TypeError, match="Bad.table"):
        parse_cell(Bad, {})
    with pytest.raises(ValueError, match="cell="):
        Experiment(name="x", paper="p", figure="f", title="t", claim="c", grid=lambda s: [], run_cell=len,
                   plot=lambda r, o: [], cell=dict)


# ----------------------------------------------------------------------------- the engine hand-off
def _toy_grid(scale: str) -> list[dict]:
    return [dict(GOOD, seed=0), dict(GOOD, seed=1, depths=[2]), dict(GOOD, seed=2, width="wide")]


def _toy_run(cell) -> dict:
    assert isinstance(cell, ToyCell), f"run_cell got {type(cell).__name__}, not the declared cell"
    return {"width_times_seed": cell.width * cell.seed, "depths": list(cell.depths or ())}


TOY = Experiment(name="bnlab-test-typed-cells", paper="p", figure="f", title="typed", claim="c", grid=_toy_grid,
                 run_cell=_toy_run, plot=lambda records, outdir: [], cell=ToyCell)


def test_engine_hands_run_cell_the_parsed_cell_and_records_a_refused_one(tmp_path):
    path = tmp_path / "toy.sqlite"
    summary = run_sweep(TOY, "small", store=path, serial=True, progress=False)
    assert (summary.done, summary.failed) == (2, 1)
    cells = _toy_grid("small")
    with ResultsStore(path, readonly=True) as st:
        rows = {r.key: r for r in st.cells()}
    # the store keeps the grid's dicts under their keys: typing the cells changed neither
    assert set(rows) == {cell_key(c) for c in cells}
    for c in cells:
        assert dict(rows[cell_key(c)].params) == c
    assert rows[cell_key(cells[1])].metrics == {"width_times_seed": 8, "depths": [2]}
    error = rows[cell_key(cells[2])].error
    assert "ValueError: experiment 'bnlab-test-typed-cells': cell parameter 'width'='wide' is not allowed" in error


def test_engine_without_a_declared_cell_still_hands_over_the_dict(tmp_path):
    seen = []

    def run(params):
        seen.append(type(params))
        return {}

    exp = Experiment(name="bnlab-test-untyped", paper="p", figure="f", title="t", claim="c",
                     grid=lambda s: [{"seed": 0}], run_cell=run, plot=lambda r, o: [])
    run_sweep(exp, "small", store=tmp_path / "u.sqlite", serial=True, progress=False)
    assert seen == [dict]


# ----------------------------------------------------------------------------- every registered grid
def _declared():
    return [(n, e) for n, e in list_experiments().items() if e.cell is not None]


def test_the_trainability_family_is_declared():
    names = {n for n, _ in _declared()}
    assert {"yang2019-fig3a", "yang2019-fig3d", "yang2019-fig5a", "yang2019-fig5c-sigma4"} <= names


@pytest.mark.parametrize("scale", SCALES)
def test_every_registered_grid_parses_and_keeps_its_keys(scale):
    """Every cell of every declared experiment's grid is accepted (a refused real cell would fail a sweep),
    and what the engine stores for it — its dict, its key — is what it was before cells were typed: the
    parsed cell gives back the very dict (``cell.params``), so ``cell_key`` cannot move.  (Checked once
    against main 8271aa6 for all 78 small and paper grids, 2974 keys: identical.)"""
    checked = 0
    for name, exp in _declared():
        for params in exp.grid(scale):
            cell = parse_cell(exp.cell, params, experiment=name)
            assert cell.params == params and cell_key(cell.params) == cell_key(params)
            checked += 1
    assert checked > 0


def test_trainability_cell_choices_match_the_library():
    from bnlab.data import DATASET_NAMES
    from bnlab.reproductions.trainability import OPTIMIZER_NAMES, TrainabilityCell

    hints = typing.get_type_hints(TrainabilityCell)
    assert set(typing.get_args(hints["dataset"])) == set(DATASET_NAMES)
    assert set(typing.get_args(hints["optimizer"])) == set(OPTIMIZER_NAMES)


def test_spelled_out_choices_match_the_library():
    """Choices a reproduction spells out (importing the library's tuple at module level would import torch
    when the registry discovers the reproductions) agree with the library's."""
    from bnlab.optim.training import TRAIN_NORMS
    from bnlab.reproductions.lange_common import LangeCell
    from bnlab.reproductions.lange_small_batch import SmallBatchCell

    assert set(typing.get_args(typing.get_type_hints(LangeCell)["norm"])) == set(TRAIN_NORMS)
    assert set(typing.get_args(typing.get_type_hints(SmallBatchCell)["norm"])) == set(TRAIN_NORMS) | {"bn4"}


def test_trainability_cell_refuses_with_the_experiment_name():
    from bnlab.reproductions.trainability import TrainabilityCell

    exp = list_experiments()["yang2019-fig3a"]
    good = exp.grid("small")[0]
    for bad, needle in [
        (dict(good, bn_batch="8"), "cell parameter 'bn_batch'='8' is not allowed: expected an integer >= 2"),
        (dict(good, lr_per_b=1e-3), "cell parameter 'lr_per_b'=0.001 is not allowed"),
        ({k: v for k, v in good.items() if k != "width"}, "cell parameter 'width' is missing"),
        (dict(good, depth=4), "give depth and seed (one network) or depths and seeds"),
        (dict(good, epochs=1.0), "give exactly one of 'steps' and 'epochs'"),
        (dict(good, batch_size=good["bn_batch"] + 1), "expected a multiple of bn_batch"),
    ]:
        with pytest.raises(ValueError) as info:
            parse_cell(TrainabilityCell, bad, experiment="yang2019-fig3a")
        assert str(info.value).startswith("experiment 'yang2019-fig3a': ") and needle in str(info.value)


def test_choices_from_a_library_tuple():
    from bnlab.reproductions.daneshmand2020_fig5 import ARCHS, ConvRankCell

    good = list_experiments()["daneshmand2020-fig5"].grid("small")[0]
    with pytest.raises(ValueError) as info:
        parse_cell(ConvRankCell, dict(good, arch="vgg12"), experiment="daneshmand2020-fig5")
    assert "cell parameter 'arch'='vgg12' is not allowed: expected one of " + ", ".join(map(repr, ARCHS)) \
        in str(info.value)

    @dataclass(frozen=True)
    class Bad(Cell):
        width: int = cell_param(1, choices=("a",))

    with pytest.raises(TypeError, match="choices= applies to a str field"):
        parse_cell(Bad, {})


def test_discovering_the_declared_reproductions_imports_no_torch():
    """Cell kinds are declared at module level, so what they import is paid by every registry lookup (and by
    each plan's child process): discovering every reproduction must not import torch."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom bnlab.experiments import list_experiments\nfrom bnlab.experiments.registry import "
            "discovery_errors\nexps = list_experiments()\nassert not discovery_errors(), discovery_errors()\n"
            "print(sum(e.cell is not None for e in exps.values()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ), check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"


def test_validation_cell_kinds_match_the_cells_it_runs():
    from bnlab.reproductions.advise_validation import CELLS, ValidationCell

    assert set(typing.get_args(typing.get_type_hints(ValidationCell)["cell"])) == set(CELLS)
