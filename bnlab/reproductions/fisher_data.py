"""Data shared by the Fisher paper's training reproductions (Figs. 3 and 4): cached MNIST subsets."""
from __future__ import annotations

import functools

__all__ = ["mnist_subsets"]


@functools.lru_cache(maxsize=2)
def mnist_subsets(n_train: int, n_test: int):
    """Standardized MNIST subsets (seed 0), cached: loading costs ≈ 1 s of CPU, more than a small cell's training."""
    from bnlab.data import load_dataset, standardize

    tr = load_dataset("mnist", "train").subset(n_train, seed=0)
    te = load_dataset("mnist", "test").subset(n_test, seed=0)
    return standardize(tr, te)
