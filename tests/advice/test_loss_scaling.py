"""nn.MSELoss (torch's mean over the K outputs too) has 2/K times the curvature of ½‖f − y‖²: the measured λmax and
the mean field bound are both rescaled (the audit's D11: only the measured one was, a 4× mismatch at K = 8)."""
import pytest
import torch
from torch import nn

from bnlab.advice import advise
from bnlab.nets import MLP


def test_the_mean_field_bound_is_rescaled_with_the_measured_curvature():
    g = torch.Generator().manual_seed(0)
    k = 8
    x, y = torch.randn(32, 12, generator=g), nn.functional.one_hot(torch.randint(0, k, (32,), generator=g), k).float()
    skip = ("gradients", "rank", "batch_size")
    half = advise(MLP(12, [10, 10], k, norm="bn", seed=1), (x, y), loss="mse", momentum=0.9, tol=1e-6,
                  skip=skip).learning_rate
    torch_mse = advise(MLP(12, [10, 10], k, norm="bn", seed=1), (x, y), loss=nn.MSELoss(), momentum=0.9, tol=1e-6,
                       skip=skip)
    lr = torch_mse.learning_rate
    assert lr.lambda_max == pytest.approx(2 / k * half.lambda_max, rel=1e-4)
    for mode in ("eval", "train"):
        assert lr.bound[mode]["lambda_max"] == pytest.approx(2 / k * half.bound[mode]["lambda_max"], rel=1e-12)
        assert lr.bound[mode]["eta_star"] == pytest.approx(2 * 1.9 / lr.bound[mode]["lambda_max"], rel=1e-12)
    assert lr.bound["scale"] == 2 / k and "scale" not in half.bound
    assert "× 0.25 for your loss" in torch_mse.to_text()
