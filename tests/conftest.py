import os

import numpy as np
import pytest

# Keep BLAS/torch from oversubscribing the 2-core CI machine when Dask workers run too.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def rng():
    return np.random.default_rng(20191201)
