"""Tests of bnlab.nets.init: each scheme's moments against its formula, with tolerances from the sampling
error of the estimator (stated per test), exact structure where there is one, and seeding.

Tolerance derivation: for n iid entries the sample mean has std σ/√n and the sample second moment has
relative std sqrt(Var(x²)/n)/E x² = sqrt(2/n) for a centred Gaussian and sqrt(4/5/n) for a centred
uniform (E x⁴ = a⁴/5, E x² = a²/3).  Every bound below is 5 of these standard deviations (a false
failure has probability < 1e-6), and each is far below the change a wrong formula makes (a factor
fan_out/fan_in, 2, or a missing √ — ≥ 20 %).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from bnlab.nets import INITS, init_weights_, initializable_layers

F64 = torch.float64


def _second_moment_ok(x: torch.Tensor, want: float, rel_std_per_sqrt_n: float) -> None:
    n = x.numel()
    tol = 5 * rel_std_per_sqrt_n / math.sqrt(n)
    got = float((x.double() ** 2).mean())
    assert abs(got / want - 1) < tol, (got, want, tol)


def test_gaussian_weight_and_bias_moments_linear_and_conv():
    lin = nn.Linear(400, 500, dtype=F64)
    init_weights_(lin, "gaussian", sigma_w2=2.0, sigma_b2=0.0, generator=1)
    w = lin.weight.detach()
    _second_moment_ok(w, 2.0 / 400, math.sqrt(2))  # 200 000 entries: ±1.6 %
    assert abs(float(w.mean())) < 5 * math.sqrt(2.0 / 400 / w.numel())
    assert torch.count_nonzero(lin.bias) == 0  # σ_b² = 0 → zero biases
    wide_bias = nn.Linear(4, 20000, dtype=F64)
    init_weights_(wide_bias, "gaussian", sigma_w2=1.0, sigma_b2=0.5, generator=2)
    _second_moment_ok(wide_bias.bias.detach(), 0.5, math.sqrt(2))  # 20 000 entries: ±5 %
    conv = nn.Conv2d(16, 64, 5, dtype=F64)  # fan_in = 16·25 = 400
    init_weights_(conv, "gaussian", sigma_w2=2.0, generator=3)
    _second_moment_ok(conv.weight.detach(), 2.0 / 400, math.sqrt(2))  # 25 600 entries: ±4.4 %


@pytest.mark.parametrize("shape", [(30, 50), (50, 30), (40, 40)])
def test_orthogonal_is_sigma_w_times_a_semi_orthogonal_matrix(shape):
    lin = nn.Linear(shape[1], shape[0], dtype=F64)
    init_weights_(lin, "orthogonal", sigma_w2=2.0, generator=0)
    w = lin.weight.detach()
    gram = w @ w.T if shape[0] <= shape[1] else w.T @ w
    torch.testing.assert_close(gram, 2.0 * torch.eye(min(shape), dtype=F64), rtol=0, atol=1e-12)
    conv = nn.Conv2d(8, 16, 3, dtype=F64)  # (16, 72) flattened: orthonormal rows
    init_weights_(conv, "orthogonal", sigma_w2=1.0, generator=0)
    wf = conv.weight.detach().reshape(16, -1)
    torch.testing.assert_close(wf @ wf.T, torch.eye(16, dtype=F64), rtol=0, atol=1e-12)


def test_glorot_uniform_bound_and_variance():
    lin = nn.Linear(300, 700, dtype=F64)  # 210 000 entries
    init_weights_(lin, "glorot_uniform", generator=4)
    a = math.sqrt(6 / (300 + 700))
    w = lin.weight.detach()
    assert float(w.abs().max()) <= a and float(w.abs().max()) > 0.999 * a
    _second_moment_ok(w, a * a / 3, math.sqrt(0.8))  # ±1 %
    assert torch.count_nonzero(lin.bias) == 0


def test_asym_uniform_is_daneshmands_u_0_2_over_sqrt_d():
    lin = nn.Linear(256, 800, dtype=F64)  # 204 800 entries, c = 2/√256 = 0.125
    init_weights_(lin, "asymmetric_uniform", generator=5)
    w = lin.weight.detach()
    c = 2 / math.sqrt(256)
    assert float(w.min()) >= 0 and float(w.max()) <= c
    n = w.numel()
    # mean c/2 with std (c/√12)/√n; variance c²/12 (the same as PyTorch's default, Daneshmand §5)
    assert abs(float(w.mean()) - c / 2) < 5 * c / math.sqrt(12 * n)
    centred = w - c / 2
    _second_moment_ok(centred, c * c / 12, math.sqrt(0.8))
    assert float(w.var()) == pytest.approx(1 / (3 * 256), rel=0.02)


@pytest.mark.parametrize("make", [lambda: nn.Linear(7, 5), lambda: nn.Conv2d(3, 4, 3), lambda: nn.Conv1d(2, 6, 5)])
def test_torch_default_equals_reset_parameters_drawn_from_the_same_seed(make):
    # PyTorch's reset_parameters draws from the global generator; the same Mersenne-Twister sequence
    # from a private generator with the same seed must give the same numbers (no BLAS involved)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        ref = make()
    mod = make()
    init_weights_(mod, "torch_default", generator=torch.Generator().manual_seed(11))
    assert torch.equal(mod.weight, ref.weight) and torch.equal(mod.bias, ref.bias)


def test_seeding_and_the_global_generator_is_untouched():
    # (the constructors draw from the global generator themselves; init_weights_ must not)
    a, b, c = (nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Conv1d(1, 2, 3)) for _ in range(3))
    state = torch.random.get_rng_state()
    for m, gen in ((a, 3), (b, torch.Generator().manual_seed(3)), (c, 4)):
        init_weights_(m, "gaussian", generator=gen)
    assert torch.equal(torch.random.get_rng_state(), state)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(a[0].weight, c[0].weight)
    assert len(initializable_layers(a)) == 2
    assert torch.equal(a[1].weight, torch.ones(6))  # normalization layers are left alone


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("he",), {}, "scheme"),
        (("gaussian",), dict(sigma_w2=0.0), "sigma_w2"),
        (("gaussian",), dict(sigma_b2=-1.0), "sigma_b2"),
        (("torch_default",), dict(sigma_w2=2.0), "sigma_w2"),
        (("gaussian",), dict(generator=-1), "generator"),
        (("gaussian",), dict(generator="seed"), "generator"),
    ],
)
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_weights_(nn.Linear(2, 2), *args, **kwargs)
    with pytest.raises(ValueError, match="module"):
        init_weights_(np.zeros(3), "gaussian")
    assert set(INITS) == {"gaussian", "orthogonal", "glorot_uniform", "torch_default", "asymmetric_uniform"}


@pytest.mark.parametrize("nets_scheme,sim_scheme,sigma_w2", [("gaussian", "gaussian", 2.0),
                                                             ("asymmetric_uniform", "asymmetric_uniform", 1.0)])
def test_same_moments_as_the_simulators_ensemble_draws(nets_scheme, sim_scheme, sigma_w2):
    # bnlab.sim.init draws the same schemes batched over networks; the two must agree on the first two
    # moments (each estimate within 5σ of the formula, as above: 120 000 entries each → ±1.3 % / ±1 %)
    from bnlab.sim import init_weights

    lin = nn.Linear(300, 400, dtype=F64)
    init_weights_(lin, nets_scheme, sigma_w2=sigma_w2, generator=6)
    ens = init_weights(sim_scheme, 1, 300, 400, sigma_w2=sigma_w2, generator=torch.Generator().manual_seed(6),
                       dtype=F64)
    for w in (lin.weight.detach(), ens[0].T):
        assert w.shape == (400, 300)
        if nets_scheme == "gaussian":
            _second_moment_ok(w, sigma_w2 / 300, math.sqrt(2))
        else:
            c = 2 / math.sqrt(300)
            assert float(w.min()) >= 0 and float(w.max()) <= c
            _second_moment_ok(w - c / 2, c * c / 12, math.sqrt(0.8))
