"""Paper-scale grids trained as ensembles: the grouping, and ensemble = one network per cell on reduced grids.

A *reduced paper grid* keeps the paper grid's structure — its cells, their grouping into tasks
(:func:`bnlab.experiments.spec.cell_tasks` at ``paper`` scale), the optimizer, batch sizes and the
hyperparameter that varies across columns — with tiny sizes (width, images, steps) and a small data set,
so that both routes run in seconds: each group through the experiment's ``run_group`` (one batched
ensemble, :func:`bnlab.nets.train_ensemble`) and each of its cells alone through ``run_cell``.

Tolerances.  The cells train in float32.  The two routes do the same arithmetic except that a batched
product may sum in another order than a single one (tests/nets/test_ensemble.py): each such sum of k
terms differs by at most k·u, u = 2⁻²⁴ ≈ 6e-8, and in practice by ~√k·u (≈ 2e-6 for the widest sums
here, k = 784 inputs).  A few SGD/RMSProp steps amplify that by less than 10³ (the float32 ensemble
tests' bound), so losses agree to 1e-4 relative — measured: ≤ 3e-7 — while a wrong learning rate,
data order or missed step changes them by ≥ 1e-3.  Accuracies count argmax agreements, which a
perturbation of 1e-4 flips only for an input whose two top logits tie that closely: allowed one input.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bnlab.experiments import get_experiment
from bnlab.experiments.spec import cell_tasks

LOSS_RTOL = 1e-4

TRAINABILITY = ["yang2019-fig3a", "yang2019-fig3b", "yang2019-fig3c", "yang2019-fig3d", "yang2019-fig5a",
                "yang2019-fig5b", "yang2019-fig5c", "yang2019-fig5d", "yang2019-fig5c-sigma4"]


def _xkey(name: str) -> str:
    if name == "yang2019-fig5c-sigma4":
        return "eps"
    return {"a": "gamma", "b": "beta", "c": "eps", "d": "eps"}[name[-1]] if "fig5" in name else "bn_batch"


@pytest.mark.parametrize("name", TRAINABILITY)
def test_trainability_paper_grids_train_each_column_as_one_ensemble(name):
    exp = get_experiment(name)
    cells = exp.grid("paper")
    tasks = cell_tasks(exp, cells, "paper")
    xkey = _xkey(name)
    columns = {(c[xkey], c.get("sigma_w2")) for c in cells}  # 5c-sigma4: an ε grid per σ_w²
    assert len(tasks) == len(columns) < len(cells)
    for task in tasks:
        members = [cells[i] for i in task]
        rest = [{k: v for k, v in c.items() if k not in ("depth", "seed")} for c in members]
        assert all(r == rest[0] for r in rest)  # one column: they differ in depth and seed only
        assert len({(c["depth"], c["seed"]) for c in members}) == len(members)
    # (small scale: a cell is a whole column; a Fig. 5 panel's columns train together, a Fig. 3 column
    # alone — tests/reproductions/test_trainability_groups.py)


def test_daneshmand_fig1_paper_grid_groups_each_norm_and_depth():
    exp = get_experiment("daneshmand2020-fig1")
    cells = exp.grid("paper")
    tasks = cell_tasks(exp, cells, "paper")
    assert len(tasks) == 2 * 6 and all(len(t) == 3 * 5 for t in tasks)
    for task in tasks:
        assert len({(cells[i]["norm"], cells[i]["depth"]) for i in task}) == 1
    assert all(len(t) == 1 for t in cell_tasks(exp, exp.grid("small"), "small"))


def _assert_same(group_metrics: dict, cell_metrics: dict, n_eval: int) -> None:
    assert set(group_metrics) == set(cell_metrics)
    for k, a in group_metrics.items():
        b = cell_metrics[k]
        if k in ("final_train_loss", "test_loss") and a is not None and b is not None:
            assert a == pytest.approx(b, rel=LOSS_RTOL), k
        elif k in ("test_accuracy", "train_accuracy") and a is not None and b is not None:
            assert abs(a - b) <= 1.0 / n_eval + 1e-12, k
        else:
            assert a == b, k


#: the digits test split's size (359 of the 1797 images): the accuracies' denominator.  (397 was asked
#: for before, and the cells use at most what the split has, so "one image" was read as 1/397 < 1/359:
#: a one-image difference failed on an AVX-512 machine, where the depth-10 cell of fig3b flips one.)
_DIGITS_TEST = 359


def _reduced_trainability(name: str) -> list[dict]:
    """Two columns × three depths of the paper grid, on digits (64 features), width 16, 6 steps."""
    exp = get_experiment(name)
    xkey = _xkey(name)
    cells = exp.grid("paper")
    xs = sorted({c[xkey] for c in cells})[:2]
    out = []
    for c in cells:
        if c[xkey] in xs and c["depth"] in (2, 5, 10):
            c = {k: v for k, v in c.items() if k != "epochs"}
            c.update(dataset="digits", width=16, n_train=1400, n_test=_DIGITS_TEST, steps=6)
            out.append(c)
    return out


def test_the_reduced_grid_tests_on_the_whole_digits_test_split():
    from bnlab.reproductions.trainability import load_dataset_subset

    _, (x_test, _), _ = load_dataset_subset("digits", 1400, 10**6)
    assert x_test.shape[0] == _DIGITS_TEST


@pytest.mark.parametrize("name", ["yang2019-fig3a", "yang2019-fig3b", "yang2019-fig3c", "yang2019-fig5a"])
def test_trainability_ensemble_equals_one_network_per_cell_on_a_reduced_paper_grid(name):
    # 3a: SGD; 3b: a fixed batch of 1000 with BN over sub-batches; 3c: RMSProp; 5a: tanh with γ per column
    exp = get_experiment(name)
    cells = _reduced_trainability(name)
    tasks = cell_tasks(exp, cells, "paper")
    assert len(tasks) == 2 and all(len(t) == 3 for t in tasks)
    for task in tasks:
        grouped = exp.run_group([cells[i] for i in task])
        for i, metrics in zip(task, grouped):
            alone = exp.run_cell(cells[i])
            assert alone["steps"] == 6 and not alone["skipped"]
            _assert_same(metrics, alone, _DIGITS_TEST)


def _fake_fashion_mnist(monkeypatch):
    """A 28×28 stand-in for Fashion-MNIST (sklearn's digits, each pixel 3×3, padded): the equivalence is
    about arithmetic, not data, and the real set takes ~20 s to read on a loaded 2-core machine."""
    from sklearn.datasets import load_digits

    import bnlab.data
    from bnlab.data import Dataset

    d = load_digits()
    img = np.kron(d.images / 16.0, np.ones((3, 3)))  # 24×24
    img = np.pad(img, ((0, 0), (2, 2), (2, 2)))[:, None].astype(np.float32)
    ds = Dataset("fashion_mnist", "train", torch.from_numpy(img), torch.from_numpy(d.target.astype(np.int64)), 10,
                 tuple(str(k) for k in range(10)), "sklearn digits, upsampled (test stand-in)")
    real = bnlab.data.load_dataset

    def load(name, split="train", **kw):
        return ds if name == "fashion_mnist" else real(name, split, **kw)

    monkeypatch.setattr(bnlab.data, "load_dataset", load)


def test_daneshmand_fig1_ensemble_equals_one_network_per_cell_on_a_reduced_paper_grid(monkeypatch):
    _fake_fashion_mnist(monkeypatch)
    exp = get_experiment("daneshmand2020-fig1")
    cells = []
    for c in exp.grid("paper"):
        if c["depth"] in (2, 8) and c["seed"] in (0, 1):
            c = {k: v for k, v in c.items() if k != "epochs"}
            c.update(width=16, n_train=512, n_eval=256, steps=6)
            cells.append(c)
    tasks = cell_tasks(exp, cells, "paper")
    assert len(tasks) == 4 and all(len(t) == 6 for t in tasks)  # (bn, none) × (2, 8); 3 lr × 2 seeds each
    for task in tasks:
        grouped = exp.run_group([cells[i] for i in task])
        for i, metrics in zip(task, grouped):
            _assert_same(metrics, exp.run_cell(cells[i]), 256)


# --------------------------------------------------------------------------- chunked figures
def _close(a, b, key: str = "", n_images: int = 256) -> None:
    """Nested metrics equal to the rounding of batched products: numbers to LOSS_RTOL (with a 1e-6 floor
    for values near zero, e.g. cosines), accuracies to one image of ``n_images``, everything else exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), key
        for k in a:
            if k != "seconds":  # the training's own wall time
                _close(a[k], b[k], k, n_images)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), key
        for x, y in zip(a, b):
            _close(x, y, key, n_images)
    elif isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
        if "accuracy" in key:
            assert abs(a - b) <= 1.0 / n_images + 1e-12, key
        elif np.isnan(a) or np.isnan(b):
            assert np.isnan(a) and np.isnan(b), key
        else:
            assert a == pytest.approx(b, rel=LOSS_RTOL, abs=1e-6), key
    else:
        assert a == b, key


def test_chunked_figures_group_by_architecture_at_paper_scale_only():
    for name, sizes in (("daneshmand2020-fig6", [15, 10, 5]), ("daneshmand2020-fig4", [6, 3] * 4)):
        exp = get_experiment(name)
        cells = exp.grid("paper")
        assert all(c["data_order"] == "per_chunk" for c in cells)
        assert [len(t) for t in cell_tasks(exp, cells, "paper")] == sizes
        assert all("data_order" not in c for c in exp.grid("small"))
        assert all(len(t) == 1 for t in cell_tasks(exp, exp.grid("small"), "small"))
    fc = get_experiment("lange-fc")
    cells = fc.grid("paper")
    tasks = cell_tasks(fc, cells, "paper")
    grouped = sorted((cells[t[0]]["batch_size"], cells[t[0]]["norm"]) for t in tasks if len(t) > 1)
    # vanilla, BN and LN train their five seeds together; BN at batch 1 (a failure cell), Batch Renorm and BNP alone
    assert grouped == sorted([(60, "none"), (60, "bn"), (60, "ln"), (6, "none"), (6, "bn"), (6, "ln"), (1, "none"),
                              (1, "ln")])
    assert all(len(t) == 5 for t in tasks if len(t) > 1)
    assert all("data_order" not in c for c in fc.grid("small"))


def _reduced_daneshmand(name: str, kinds) -> list[dict]:
    cells = []
    for c in get_experiment(name).grid("paper"):
        if c["seed"] in (0, 1) and c["kind"] in kinds and c["depth"] in (8, 32):
            c = dict(c, width=8, depth=2 if c["depth"] == 32 else 3, n_train=256, n_eval=128, n_test=128, steps=6)
            if "track_steps" in c:
                c["track_steps"] = [2, 6]
            cells.append(c)
    return cells


@pytest.mark.parametrize("name,kinds", [
    ("daneshmand2020-fig6", ("vanilla", "bn")),
    pytest.param("daneshmand2020-fig6", ("vanilla", "pretrain25", "pretrain75", "bn", "bn_asym", "bn_nomean"),
                 marks=pytest.mark.slow),
    pytest.param("daneshmand2020-fig4", ("vanilla", "pretrain25", "bn"), marks=pytest.mark.slow),
])
def test_daneshmand_chunked_ensemble_equals_one_network_per_cell(name, kinds, monkeypatch):
    # the tracked curves (r(H_L), gradient alignment, batch-statistics accuracy) and the final metrics
    _fake_fashion_mnist(monkeypatch)
    exp = get_experiment(name)
    cells = _reduced_daneshmand(name, kinds)
    tasks = cell_tasks(exp, cells, "paper")
    assert all(len(t) > 1 for t in tasks)
    for task in tasks:
        grouped = exp.run_group([cells[i] for i in task])
        for i, metrics in zip(task, grouped):
            alone = exp.run_cell(cells[i])
            # tracked to the last step: fig6's cells at track_steps [2, 6] (and step 0), fig4's at its own
            # schedule (0, 1, 3, 6 for 6 steps)
            curve = alone["r_through_training"]
            assert "loss_curve" in alone and len(curve) >= 3 and curve[-1][0] == cells[i]["steps"]
            _close(metrics, alone)


def _fake_mnist(monkeypatch, n: int = 300):
    """300 digits upsampled to 28×28 as MNIST (train and test): 5 steps per epoch at batch 60, 50 at 6."""
    from sklearn.datasets import load_digits

    import bnlab.data
    from bnlab.data import Dataset

    d = load_digits()
    img = np.pad(np.kron(d.images / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))[:n, None].astype(np.float32)
    ds = Dataset("mnist", "train", torch.from_numpy(img), torch.from_numpy(d.target[:n].astype(np.int64)), 10,
                 tuple(str(k) for k in range(10)), "sklearn digits, upsampled (test stand-in)")
    real = bnlab.data.load_dataset
    monkeypatch.setattr(bnlab.data, "load_dataset",
                        lambda name, split="train", **kw: ds if name == "mnist" else real(name, split, **kw))


@pytest.mark.parametrize("name,epochs", [("lange-fc", {60: 2}),
                                         pytest.param("lange-fc", {60: 2, 6: 1, 1: 0.1}, marks=pytest.mark.slow),
                                         pytest.param("lange-fig5", {128: 2, 2: 0.1}, marks=pytest.mark.slow)])
def test_lange_chunked_ensemble_equals_one_network_per_cell(name, epochs, monkeypatch):
    # per-epoch test accuracy and training loss, final metrics; seeds 0 and 1 of every chunked (batch, method)
    # at the batch sizes in ``epochs`` (the default suite: batch 60, two chunks of 5 steps)
    _fake_mnist(monkeypatch)
    exp = get_experiment(name)
    cells = [dict(c, epochs=epochs[c["batch_size"]]) for c in exp.grid("paper")
             if c["seed"] in (0, 1) and c["batch_size"] in epochs]
    # Not BN at batch 6: with the paper's η = 0.05 there, training on this stand-in data is chaotic — measured
    # with bnlab.nets.train alone in float64, scaling the first layer's weights by 1 + 1e-13 moves the weights
    # by 0.8 within 50 steps (at batch 60: by 1e-13) — so the routes' rounding differences grow to O(1) and
    # the comparison would test the chaos, not the routes (BN's ensemble route is checked at batch 60)
    tasks = [t for t in cell_tasks(exp, cells, "paper")
             if len(t) > 1 and (cells[t[0]]["batch_size"], cells[t[0]]["norm"]) != (6, "bn")]
    assert tasks
    for task in tasks:
        grouped = exp.run_group([cells[i] for i in task])
        for i, metrics in zip(task, grouped):
            alone = exp.run_cell(cells[i])
            assert alone["trainable"] and alone["epochs"]
            _close(metrics, alone, n_images=300)
