"""Nothing changed that should not have: theory, simulation and training against a recorded baseline.

``baseline.json`` was recorded by ``_record.py`` on the code before the structural change of the
``bnlab/nets`` issue (φ resolution, the training loop moved out of ``bnlab.sim``).

Tolerances:
* theory — 1e-12 relative (plus 1e-15 absolute for exact zeros): float64 NumPy/SciPy routes with no
  BLAS reductions long enough to reorder beyond a few ulps;
* simulation — 1e-8 relative: float64 networks of depth ≤ 6 whose matmuls BLAS may sum in another
  order (≈1e-15 per product, amplified by at most the depth's condition);
* training — 1e-7 relative on the loss history of 30 float64 steps (reordered sums grow through the
  steps but stay far below this), test accuracy within one of the 40 test samples (a tie in argmax
  may flip under reordering).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.regression import _record

BASELINE = json.loads((Path(__file__).with_name("baseline.json")).read_text())


def _close(a, b, rtol, atol):
    if a is None or b is None or isinstance(a, str) or isinstance(a, dict):
        return a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, rtol, atol) for x, y in zip(a, b))
    if not math.isfinite(a) or not math.isfinite(b):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= atol + rtol * abs(b)


def test_theory_outputs_unchanged():
    now = _record.theory_records()
    assert len(now) == len(BASELINE["theory"])
    for new, old in zip(now, BASELINE["theory"]):
        for key, want in old["values"].items():
            got = new["values"][key]
            assert _close(got, want, 1e-12, 1e-15), (old["phi"], old["batch_size"], old["method"], key, got, want)


def test_seeded_simulations_unchanged():
    now = _record.sim_records()
    for new, old in zip(now, BASELINE["simulate"]):
        for key, want in old["values"].items():
            np.testing.assert_allclose(new["values"][key], want, rtol=1e-8, atol=1e-14, err_msg=f"{old['case']} {key}")


def test_seeded_training_unchanged():
    now = _record.train_records()
    for new, old in zip(now, BASELINE["train"]):
        np.testing.assert_allclose(new["values"]["history"], old["values"]["history"], rtol=1e-7)
        np.testing.assert_allclose(new["values"]["readout_norm"], old["values"]["readout_norm"], rtol=1e-7)
        assert abs(new["values"]["test_accuracy"] - old["values"]["test_accuracy"]) <= 1 / 40 + 1e-12
