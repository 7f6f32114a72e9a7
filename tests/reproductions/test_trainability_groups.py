"""Small-scale trainability columns trained together: which columns group, and a group = its columns alone.

At ``small`` and ``medium`` scale a cell is a whole column (every depth × seed of one x); at ``small`` scale the
columns of a heatmap that differ only in γ, β or ε — per-network constants of one BN-MLP stack — train as one ensemble
(:func:`bnlab.reproductions.trainability.ensemble_group`, :func:`run_trainability_group`).

Tolerances, as in tests/reproductions/test_paper_scale.py: the routes do the same float32 arithmetic except
that a batched product over more networks may sum in another order (≤ k·u per sum of k terms, u = 2⁻²⁴,
k ≤ 64 here); a few SGD steps amplify that by < 10³, so losses agree to 1e-4 relative, while a wrong γ,
β, ε, learning rate or data order changes them by ≥ 1e-3 (checked below: a group built with the columns'
settings swapped fails the comparison).  An accuracy may flip one test input whose top logits tie that closely.
"""
from __future__ import annotations

import pytest

from bnlab.experiments import get_experiment
from bnlab.experiments.spec import cell_tasks
from bnlab.reproductions.trainability import PER_NETWORK, ensemble_group, run_trainability_group

LOSS_RTOL = 1e-4
N_TEST = 359

FIG5 = ["yang2019-fig5a", "yang2019-fig5b", "yang2019-fig5c", "yang2019-fig5d", "yang2019-fig5c-sigma4"]
FIG3 = ["yang2019-fig3a", "yang2019-fig3b", "yang2019-fig3c", "yang2019-fig3d"]


@pytest.mark.parametrize("name", FIG5)
def test_a_fig5_panel_trains_its_columns_as_one_ensemble_at_small_scale(name):
    exp = get_experiment(name)
    cells = exp.grid("small")
    assert len(cells) >= 2 and all("depths" in c for c in cells)
    assert cell_tasks(exp, cells, "small") == [list(range(len(cells)))]
    # they differ only in per-network constants of the stack
    rest = [{k: v for k, v in c.items() if k not in PER_NETWORK} for c in cells]
    assert all(r == rest[0] for r in rest)
    # medium: a task per column (deeper, layer-bound grids; the workers share the columns)
    medium = exp.grid("medium")
    assert [len(t) for t in cell_tasks(exp, medium, "medium")] == [1] * len(medium)


@pytest.mark.parametrize("name", FIG3)
@pytest.mark.parametrize("scale", ["small", "medium"])
def test_fig3_columns_differ_in_b_and_are_never_grouped(name, scale):
    exp = get_experiment(name)
    cells = exp.grid(scale)
    assert len({c["bn_batch"] for c in cells}) == len(cells)
    assert [len(t) for t in cell_tasks(exp, cells, scale)] == [1] * len(cells)


def test_the_group_key_ignores_only_per_network_settings():
    col = dict(dataset="digits", phi="tanh", gamma=1.0, beta=0.0, eps=1e-3, width=16, bn_batch=16, batch_size=16,
               optimizer="sgd", lr=0.05, steps=6, n_train=1438, n_test=N_TEST, depths=[2, 4], seeds=[0])
    key = ensemble_group(col, "small")
    assert key is not None
    for k, v in (("gamma", 0.5), ("beta", 0.3), ("eps", 0.1), ("depths", [3]), ("seeds", [1]), ("device", "cuda")):
        assert ensemble_group(dict(col, **{k: v}), "small") == key, k
    for k, v in (("lr", 0.1), ("bn_batch", 8), ("batch_size", 32), ("steps", 7), ("width", 8), ("phi", "relu"),
                 ("sigma_w2", 4.0), ("optimizer", "rmsprop"), ("n_train", 100)):
        assert ensemble_group(dict(col, **{k: v}), "small") != key, k
    # single-network cells group at paper scale only, by column (not across γ, β, ε)
    single = {k: v for k, v in col.items() if k not in ("depths", "seeds")} | {"depth": 2, "seed": 0}
    assert ensemble_group(single, "small") is None and ensemble_group(col, "paper") is None
    assert ensemble_group(col, "medium") is None
    assert ensemble_group(dict(single, depth=5, seed=1), "paper") == ensemble_group(single, "paper")
    assert ensemble_group(dict(single, gamma=0.5), "paper") != ensemble_group(single, "paper")


def _reduced(name: str) -> list[dict]:
    """The panel's small columns on digits (64 features), width 16, depths (2, 5), 6 steps."""
    out = []
    for c in get_experiment(name).grid("small"):
        out.append(dict(c, dataset="digits", width=16, n_train=1438, n_test=N_TEST, steps=6, depths=[2, 5]))
    return out


def _assert_same(grouped: dict, alone: dict) -> None:
    assert grouped["skipped"] is alone["skipped"] is False
    assert len(grouped["networks"]) == len(alone["networks"])
    for a, b in zip(grouped["networks"], alone["networks"]):
        assert set(a) == set(b)
        for k, x in a.items():
            y = b[k]
            if k in ("final_train_loss", "test_loss") and x is not None and y is not None:
                assert x == pytest.approx(y, rel=LOSS_RTOL), k
            elif k == "test_accuracy" and x is not None and y is not None:
                assert abs(x - y) <= 1.0 / N_TEST + 1e-12, k
            else:
                assert x == y, k


@pytest.mark.parametrize("name", ["yang2019-fig5a", "yang2019-fig5c-sigma4"])
def test_a_group_gives_each_column_what_it_gets_alone(name):
    # 5a: tanh with γ per column; 5c-sigma4: tanh at σ_w² = 4 with ε per column
    exp = get_experiment(name)
    cells = _reduced(name)
    grouped = exp.run_group(cells)
    assert len(grouped) == len(cells)
    for cell, metrics in zip(cells, grouped):
        alone = exp.run_cell(cell)
        assert [(n["depth"], n["seed"]) for n in alone["networks"]] == [(2, 0), (5, 0)]
        _assert_same(metrics, alone)


def test_the_comparison_sees_a_column_trained_with_another_columns_setting():
    # the same comparison fails when a column is trained with its neighbour's γ: it can tell them apart
    exp = get_experiment("yang2019-fig5a")
    cells = _reduced("yang2019-fig5a")
    swapped = [dict(cells[0], gamma=cells[1]["gamma"])] + cells[1:]
    grouped = exp.run_group(swapped)
    with pytest.raises(AssertionError):
        _assert_same(grouped[0], exp.run_cell(cells[0]))


@pytest.mark.parametrize("change,match", [
    ({"lr": 0.5}, "differ in more than"),
    ({"bn_batch": 8, "batch_size": 8}, "differ in more than"),
])
def test_cells_that_do_not_share_a_stack_are_refused(change, match):
    cells = _reduced("yang2019-fig5a")
    with pytest.raises(ValueError, match=match):
        run_trainability_group([cells[0], dict(cells[1], **change)])


def test_single_networks_and_columns_are_not_mixed_and_an_empty_group_is_refused():
    col = _reduced("yang2019-fig5a")[0]
    single = {k: v for k, v in col.items() if k not in ("depths", "seeds")} | {"depth": 2, "seed": 0}
    with pytest.raises(ValueError, match="mix single networks and columns"):
        run_trainability_group([col, single])
    with pytest.raises(ValueError, match="at least one cell"):
        run_trainability_group([])
