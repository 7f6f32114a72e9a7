"""The one route from ``curvature`` / ``loss`` names to the curvature operator's class (bnlab.fisher.spectrum).

The products themselves are checked against dense matrices in test_spectrum.py; here: each name pair
picks the class whose product is that curvature's, the operator built through the public
``curvature_operator`` is an instance of it, and an unknown name is a ValueError naming the argument.
"""
import pytest
import torch

from bnlab.fisher import CURVATURES, LOSSES, curvature_operator
from bnlab.fisher.spectrum import (_CrossEntropyGGNOperator, _CurvatureOperator, _EmpiricalFisherOperator,
                                   _FisherOperator, _HessianOperator, _MSEGGNOperator, _operator_class)

EXPECTED = {
    ("fisher", "mse"): _FisherOperator,
    ("fisher", "cross_entropy"): _FisherOperator,
    ("ggn", "mse"): _MSEGGNOperator,
    ("ggn", "cross_entropy"): _CrossEntropyGGNOperator,
    ("hessian", "mse"): _HessianOperator,
    ("hessian", "cross_entropy"): _HessianOperator,
    ("empirical_fisher", "mse"): _EmpiricalFisherOperator,
    ("empirical_fisher", "cross_entropy"): _EmpiricalFisherOperator,
}


def test_every_public_name_pair_has_its_class():
    assert set(EXPECTED) == {(c, l) for c in CURVATURES for l in LOSSES}


@pytest.mark.parametrize("curvature,loss", sorted(EXPECTED))
def test_each_name_maps_to_its_class(curvature, loss):
    cls = _operator_class(curvature, loss)
    assert cls is EXPECTED[(curvature, loss)]
    assert issubclass(cls, _CurvatureOperator) and cls.curvature == curvature
    # the public constructor goes through the same route and keeps the names it was given
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64) if loss == "mse" else torch.tensor([0, 1, 1, 0, 1])
    core = curvature_operator(model, x, y, curvature=curvature, loss=loss).curvature_info
    assert type(core) is cls and core.curvature == curvature and core.loss == loss


@pytest.mark.parametrize("curvature,loss,argument", [
    ("kfac", "mse", "curvature"), ("Fisher", "mse", "curvature"), (None, "mse", "curvature"),
    ("fisher", "nll", "loss"), ("ggn", "MSE", "loss"),
])
def test_an_unknown_name_is_a_value_error_naming_the_argument(curvature, loss, argument):
    with pytest.raises(ValueError, match=rf"^{argument}=.* is not allowed: expected one of"):
        _operator_class(curvature, loss)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    with pytest.raises(ValueError, match=rf"^{argument}=.* is not allowed"):
        curvature_operator(model, torch.randn(4, 3, dtype=torch.float64), curvature=curvature, loss=loss)
