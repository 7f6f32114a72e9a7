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
