"""Data shared by the training tests of bnlab.nets."""
from __future__ import annotations

import numpy as np


def digits(dtype=np.float32):
    """sklearn's 8x8 digits (1797 samples, 64 features in [0, 1]) — bundled, no download — shuffled with
    seed 0 and split 1400 / 397: ``((x_train, y_train), (x_test, y_test))`` with x of ``dtype``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(dtype)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
