"""bnlab.advise on networks and settings where one part cannot be measured as first tried: the other parts still
run, the failing part says why (never the whole advice lost, never a traceback), the module is unchanged."""
import copy
import json

import pytest
import torch
from torch import nn

from bnlab.advice import advise
from bnlab.nets import BNMLP, MLP


def _xy(n=16, d=12, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


def test_a_deep_bn_mlp_whose_float32_hessian_overflows_is_measured_in_float64():
    # the audit's D1: depth 100, width 16, B = 8 — the Hessian product overflows float32 (λmax ≈ 1e23), and the
    # whole advice used to be lost with it
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    model = BNMLP(16, 10, depth=100, width=16, seed=0)
    before = copy.deepcopy(model.state_dict())
    a = advise(model, (x, y), draws=2, skip=("batch_size",))
    assert a.gradients is not None and a.rank is not None and not a.not_evaluated
    lr = a.learning_rate
    assert any("measured in float64" in n for n in lr.notes)
    assert lr.lambda_max > 3.4e38 ** 0.5 and 0 < lr.eta_star_free < float("inf")
    assert next(model.parameters()).dtype == torch.float32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_part_that_overflows_even_in_float64_is_reported_not_evaluated_and_the_others_print(monkeypatch):
    import bnlab.fisher

    dtypes = []

    def overflowing(*args, dtype=None, **kwargs):
        dtypes.append(dtype)
        raise bnlab.fisher.CurvatureOverflowError(f"the hessian matrix-vector product is not finite in {dtype}: it "
                                                  "overflows (...)")

    monkeypatch.setattr(bnlab.fisher, "curvature_spectrum", overflowing)
    x, y = _xy()
    a = advise(MLP(12, [10, 10], 3, norm="bn", seed=1), (x, y), draws=2, skip=("batch_size",))
    assert dtypes == [None, torch.float64]  # the model's own dtype first, then float64
    assert a.learning_rate is None and "float64 too" in a.not_evaluated["learning_rate"]
    assert a.verdicts()["learning_rate"].startswith("not evaluated: ")
    assert a.gradients is not None and a.rank is not None
    text = a.to_text()
    assert "3. Learning rate" in text and "not evaluated: " in text and "4. Rank" in text
    d = json.loads(json.dumps(a.to_dict()))
    assert "learning_rate" in d["not_evaluated"] and d["learning_rate"] is None
    assert "Not evaluated." in a.to_html()


def test_other_curvature_errors_are_not_swallowed(monkeypatch):
    import bnlab.fisher

    def bad(*args, **kwargs):
        raise ValueError("targets are not allowed: something the caller must fix")

    monkeypatch.setattr(bnlab.fisher, "curvature_spectrum", bad)
    x, y = _xy()
    with pytest.raises(ValueError, match="something the caller must fix"):
        advise(MLP(12, [10, 10], 3, norm="bn", seed=1), (x, y), skip=("gradients", "rank", "batch_size"))


def test_a_tol_lanczos_cannot_reach_reports_the_part_not_evaluated(capsys, monkeypatch):
    # the audit's D5: --tol 1e-12 in float32 ended in a RuntimeError traceback after the other parts had run.
    # Whether Lanczos reaches 1e-12 within its 300 products depends on the rounding (the thread count, the BLAS):
    # it did in one full-suite run, so the non-convergence is curvature_spectrum's own error, raised here.
    import bnlab.fisher
    from bnlab.cli import main

    def unreached(*args, tol, **kwargs):
        raise bnlab.fisher.LanczosNotConvergedError(f"Lanczos did not reach tol={tol:g} in 300 products; raise "
                                                    "maxiter or tol, or use method='arpack'")

    monkeypatch.setattr(bnlab.fisher, "curvature_spectrum", unreached)
    code = main(["advise", "--model", "mlp", "--depth", "3", "--width", "32", "--input-shape", "64", "-B", "8",
                 "--skip", "gradients,rank,batch_size", "--tol", "1e-12", "--quiet", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    d = json.loads(out)
    reason = d["not_evaluated"]["learning_rate"]
    assert "did not reach tol=1e-12" in reason and "raise tol" in reason and d["learning_rate"] is None
    assert "maxiter" not in reason  # not an option of advise
    assert d["verdicts"]["learning_rate"].startswith("not evaluated: ")
