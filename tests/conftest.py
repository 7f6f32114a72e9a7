import os

import numpy as np
import pytest

# Keep BLAS/torch from oversubscribing the 2-core CI machine when Dask workers run too.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def rng():
    return np.random.default_rng(20191201)


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test (as the report's workers run), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
