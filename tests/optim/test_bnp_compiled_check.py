"""BNP's compiled and captured dense step check their first call against the uncompiled core.

``bnlab.optim._compiled`` runs the first call of each new compiled program (shapes, dtypes, constants)
and the first replay of each CUDA graph beside the uncompiled functional core on copies of the
arguments, and compares (``bnlab._inductor.disagreement``: statistics against what the core changed,
preconditioned gradients against their own size, per layer; κ = 1e-6 in float64).  Here the compiled
code is stood in for by the core with one layer's preconditioned gradient doubled (a wrong result of
the kind a miscompilation gives: a whole buffer off), or by the core itself (a correct compilation):
seconds, no C++ build.  The comparison itself is tested in ``tests/nets/test_ensemble_verify.py``.

Tolerance of the route comparisons: ``test_bnp_routes._tol`` (derived there).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch

from bnlab.optim import BNPreconditioner
from bnlab.optim import _compiled
from bnlab.optim import _functional as F

from .test_bnp_routes import _assert_same, _mlp, _tol, _train


def _core_then(factor: float):
    """A stand-in for the compiled core: the core, then layer 0's preconditioned weight gradient × factor."""
    def fn(xs, means, variances, gws, gbs, *rest):
        skipped = F.dense_steps_(xs, means, variances, gws, gbs, *rest)
        gws[0].mul_(factor)
        return skipped
    return fn


def _compiled_against_eager(batches, expect: str | None) -> None:
    """Train two copies of the test network on ``batches``, one by the compiled route (a RuntimeWarning
    matching ``expect``, or none at all), one by the eager route, and compare them."""
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5)
    if expect is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _train(a, pa, batches)
    else:
        with pytest.warns(RuntimeWarning, match=expect):
            _train(a, pa, batches)
    _train(b, pb, batches)
    _assert_same(a, pa, b, pb, _tol(16, 300))


def _batches(sizes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0 for n in sizes]


def test_a_wrong_compiled_step_is_caught_and_the_core_takes_over(monkeypatch):
    monkeypatch.setattr(_compiled, "_STATE", {"fn": _core_then(2.0)})
    # the first step's results are the core's, and every later step runs the core uncompiled
    _compiled_against_eager(_batches([16, 16, 5]),
                            r"compiled dense step disagreed .*gws.*\[0\].*core uncompiled from now on")
    assert _compiled._STATE["failed"] is F.dense_steps_
    assert [c["agrees"] for c in _compiled._STATE["checks"]] == [False]


def test_a_correct_compiled_step_is_checked_once_per_program(monkeypatch):
    # a stand-in that is not the core object (so it is "compiled") and computes what it computes: one
    # check per new program (batch 16, then 5), none for a repeated one, no warning
    monkeypatch.setattr(_compiled, "_STATE", {"fn": _core_then(1.0)})
    _compiled_against_eager(_batches([16, 16, 5, 16, 5]), None)
    checks = _compiled._STATE["checks"]
    assert [c["agrees"] for c in checks] == [True, True] and all(c["worst"] < 1e-3 for c in checks)
    assert "failed" not in _compiled._STATE


def test_the_first_replay_of_a_graph_is_checked(monkeypatch):
    # the capture stood in for on the CPU (as test_bnp_captured.py): a "graph" replays the captured call,
    # here with layer 0's gradient doubled — a fault of the capture, not of the compiled function (the
    # core itself, not checked as compiled).  Its first replay (the second step) disagrees: the core's
    # results are kept, every graph dropped, and later steps run uncaptured
    def capture(call):
        def replay():
            call()
            call.__self__.gws[0].mul_(2.0)
        return replay

    monkeypatch.setattr(_compiled, "_STATE", {"fn": F.dense_steps_})
    monkeypatch.setattr(_compiled, "_GRAPHS", OrderedDict())
    monkeypatch.setattr(_compiled, "capturable", lambda device: True)
    monkeypatch.setattr(_compiled, "_capture", capture)
    _compiled_against_eager(_batches([16, 16, 16]), r"captured dense step disagreed .*stays compiled, uncaptured")
    assert _compiled._STATE["no_graph"] and not _compiled._GRAPHS
    assert [(c["what"], c["agrees"]) for c in _compiled._STATE["checks"]] == [("captured", False)]
