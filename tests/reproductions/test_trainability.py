"""Tests of the optimizer-name mapping of bnlab.reproductions.trainability (the library takes factories)."""
from __future__ import annotations

import pytest
import torch

from bnlab.reproductions.trainability import OPTIMIZER_NAMES, optimizer_factory


def test_names_map_to_the_papers_optimizers():
    p = [torch.nn.Parameter(torch.zeros(3))]
    sgd = optimizer_factory("sgd", 0.1)(p)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["lr"] == 0.1 and sgd.defaults["momentum"] == 0.0
    rms = optimizer_factory("rmsprop", 1e-3)(p)
    # TensorFlow's RMSProp defaults, as the paper's experiments used (torch's own: alpha 0.99, eps 1e-8)
    assert type(rms) is torch.optim.RMSprop
    assert (rms.defaults["alpha"], rms.defaults["eps"], rms.defaults["lr"]) == (0.9, 1e-10, 1e-3)
    assert OPTIMIZER_NAMES == ("sgd", "rmsprop")


@pytest.mark.parametrize("args,match", [(("adam", 0.1), "optimizer"), (("sgd", -1.0), "lr"),
                                        (("sgd", float("nan")), "lr"), (("sgd", 0.1, 2.0), "momentum")])
def test_bad_names_and_rates(args, match):
    with pytest.raises(ValueError, match=match):
        optimizer_factory(*args)


def test_ensemble_column_matches_single_cells():
    # one column (depths × seeds) trained as one ensemble gives each network's single-cell metrics:
    # float32 training, 30 steps — the losses agree to ~1e-6 (float32 rounding of batched vs single
    # products amplified by a few steps: asserted at 1e-4 relative), the accuracies to a few test
    # images at most (359 images: 2/359 ≈ 0.006; a net whose margins are all ≥ 1e-4 flips none)
    from bnlab.experiments.spec import Record
    from bnlab.reproductions.trainability import expand_records, run_trainability_cell

    base = dict(dataset="digits", phi="relu", gamma=1.0, beta=0.0, eps=1e-3, width=16, bn_batch=16, batch_size=16,
                optimizer="sgd", lr=0.05, steps=30, n_train=1438, n_test=359)
    col = dict(base, depths=[2, 4], seeds=[0, 1])
    out = run_trainability_cell(col)
    recs = expand_records([Record(col, out)])
    assert sorted((r.params["depth"], r.params["seed"]) for r in recs) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    for r in recs:
        single = run_trainability_cell(dict(base, depth=r.params["depth"], seed=r.params["seed"]))
        assert r.metrics["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=0.006)
        assert r.metrics["final_train_loss"] == pytest.approx(single["final_train_loss"], rel=1e-4)
        assert r.metrics["steps"] == single["steps"] == 30
