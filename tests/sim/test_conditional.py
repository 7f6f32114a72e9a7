"""Gaussian layers sampled from their conditional law (bnlab.sim.conditional) against explicit weights.

Two independent checks:

1. Algebra, exactly: replaying the layer's random numbers, the weight matrix
   W = s·QZ + (I − QQᵀ)·s·(Q_δ Z')ᵀ is an explicit matrix with a W = the layer's output and
   δ Wᵀ = the layer's input gradient (to rounding, 1e-12 in float64).  This pins the
   formulas, not the law.
2. Law, statistically: whole ensembles simulated with explicit iid Gaussian weights and with
   conditional sampling (different random draws) have the same per-layer means of every
   measured quantity, within a two-sample z-test.
"""
import math

import numpy as np
import pytest
import torch

from bnlab.sim import simulate
from bnlab.sim import conditional
from bnlab.sim.conditional import conditional_gaussian_layer


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _sign_normalized_qr(x):
    q, r = torch.linalg.qr(x)
    signs = torch.diagonal(r, dim1=-2, dim2=-1).sign()
    return q * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2)


def _replayed_weights(a, delta, fan_out, sigma_w2, seeds, mean_free_batch=None):
    """The explicit W (n, d, N) behind a conditional layer's draws, float64: W = s·QZ + (I − QQᵀ)W̃
    with aᵀ = QR (diag R ≥ 0) and W̃ᵀ = s·Q_D Z' on the row space of δ, where Dᵀ = Q_D R_D
    (diag R_D ≥ 0) and D is δ without the last row of each batch if the rows of δ sum to zero
    per batch (mean_free_batch = B), else D = δ; then δW̃ᵀ = s·T R_Dᵀ Z' is the layer's U."""
    n, rows, d = a.shape
    s = math.sqrt(sigma_w2 / d)
    replay = _gens(seeds)
    q = _sign_normalized_qr(a.detach().transpose(1, 2))
    z = torch.stack([torch.empty(q.shape[-1], fan_out).normal_(generator=g) for g in replay]).double()
    kept = delta
    if mean_free_batch is not None:
        b = mean_free_batch
        kept = delta.view(n, rows // b, b, -1)[:, :, : b - 1].reshape(n, rows - rows // b, -1)
    q_d = _sign_normalized_qr(kept.transpose(1, 2))  # (n, N, m')
    z2 = torch.stack([torch.empty(kept.shape[1], d).normal_(generator=g) for g in replay]).double()
    w_fresh = s * (q_d @ z2[:, : q_d.shape[-1]]).transpose(1, 2)
    proj = torch.eye(d, dtype=torch.float64) - q @ q.transpose(1, 2)
    return s * q @ z + proj @ w_fresh


@pytest.mark.parametrize(
    "rows,d,fan_out,duplicate,route,mean_free_batch",
    [(5, 12, 9, "column", "cholesky", None),  # rank-deficient column space must not matter
     (6, 6, 3, None, "cholesky", None),  # rows = d (I − QQᵀ = 0: U does not enter)
     (6, 12, 3, None, "cholesky", None),  # rows > N: δδᵀ singular, its factor from Householder QR
     (12, 20, 5, None, "cholesky", 3),  # rows − k > N after deflation: Householder QR of D
     (5, 12, 9, "delta_zero_row", "cholesky", None),  # δδᵀ singular in network 1 only: its fallback
     (8, 12, 9, None, "cholesky", 4),  # rows of δ sum to zero per batch of 4: null space deflated
     (8, 12, 5, None, "cholesky", 2),  # deflated, and rows − k = 4 ≤ N = 5
     (5, 12, 9, "row", "householder", None),  # a aᵀ singular: Householder route
     (12, 7, 10, None, "householder", 3),  # rows > d, deflated δ
     (12, 7, 10, None, "householder", None)],  # rows > d, rows > N
)
def test_output_and_input_gradient_are_those_of_one_explicit_matrix(rows, d, fan_out, duplicate, route,
                                                                    mean_free_batch):
    n, sigma_w2 = 3, 1.7
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, rows, d))
    if duplicate == "column":
        a_np[:, :, 0] = a_np[:, :, 1]
    elif duplicate == "row":
        a_np[:, 0] = a_np[:, 1]
    assert (conditional._gram_cholesky(torch.tensor(a_np))[1] is not None) == (route == "cholesky")
    a = torch.tensor(a_np, requires_grad=True)
    delta_np = rng.standard_normal((n, rows, fan_out))
    if mean_free_batch is not None:
        blocks = delta_np.reshape(n, rows // mean_free_batch, mean_free_batch, fan_out)
        delta_np = (blocks - blocks.mean(2, keepdims=True)).reshape(n, rows, fan_out)
    if duplicate == "delta_zero_row":
        delta_np[1, 2] = 0.0  # a zero pivot: the Cholesky factorization of network 1 fails exactly
        assert (torch.linalg.cholesky_ex(torch.tensor(delta_np @ delta_np.transpose(0, 2, 1)))[1] != 0).tolist() \
            == [False, True, False]
    delta = torch.tensor(delta_np)
    h = conditional_gaussian_layer(a, fan_out, sigma_w2, _gens([11, 12, 13]), mean_free_batch=mean_free_batch)
    (grad,) = torch.autograd.grad(h, a, delta)
    w = _replayed_weights(a, delta, fan_out, sigma_w2, [11, 12, 13], mean_free_batch)
    torch.testing.assert_close(h.detach(), a.detach() @ w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, delta @ w.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_cholesky_and_householder_routes_realize_the_same_network(monkeypatch, dtype, rtol):
    # Same draws, same W: the two routes differ only by rounding.  Inputs as in a BN network near
    # its BSB1 fixed point (relu of standardized, correlated pre-activations), rows = 64, d = 256,
    # κ(a) ≈ 10.  rtol: float64 rounding × κ² ≈ 1e-14·100; float32 ≈ 6e-8·κ²·(a few) (the
    # Cholesky route's error bound, module docstring).
    n, rows, d, fan_out = 4, 64, 256, 200
    g = torch.Generator().manual_seed(5)
    corr = 0.5 * torch.eye(rows, dtype=torch.float64) + 0.5
    pre = torch.linalg.cholesky(corr) @ torch.randn(n, rows, d, generator=g, dtype=torch.float64)
    pre = (pre - pre.mean(1, keepdim=True)) / pre.std(1, keepdim=True)
    a_np = torch.relu(pre).to(dtype)
    delta = torch.randn(n, rows, fan_out, generator=g, dtype=torch.float64).to(dtype)
    out = {}
    for route in ("cholesky", "householder"):
        if route == "householder":
            monkeypatch.setattr(conditional, "_gram_cholesky", lambda a: (None, None))
        else:
            assert conditional._gram_cholesky(a_np)[1] is not None
        a = a_np.clone().requires_grad_(True)
        h = conditional_gaussian_layer(a, fan_out, 1.3, _gens([1, 2, 3, 4]))
        out[route] = (h.detach(), torch.autograd.grad(h, a, delta)[0])
    for x, y in zip(out["cholesky"], out["householder"]):
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * y.abs().max().item())


def test_ill_conditioned_inputs_take_the_householder_route():
    # a = U diag(σ) Vᵀ with κ(a) = 1e5: u·κ² ≈ 1e-6 in float64 (Cholesky route allowed) but
    # ≈ 6e2 in float32 (Householder route)
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(2, 8, 8, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(2, 100, 8, generator=g, dtype=torch.float64))
    a = u @ torch.diag(torch.logspace(0, -5, 8, dtype=torch.float64)) @ v.transpose(1, 2)
    assert conditional._gram_cholesky(a)[1] is not None
    assert conditional._gram_cholesky(a.float())[1] is None
    assert conditional._gram_cholesky(a[:, :, :6])[1] is None  # rows > d


def _zscores(x, y):
    """Two-sample z statistics of per-layer means over independent networks (rows of x, y)."""
    se = np.sqrt(x.var(0, ddof=1) / len(x) + y.var(0, ddof=1) / len(y))
    return (x.mean(0) - y.mean(0)) / se


@pytest.mark.parametrize("phi,k,residual", [("relu", 2, None), ("tanh", 1, None), ("identity", 2, 0.7)])
def test_same_law_as_explicit_gaussian_weights(phi, k, residual):
    # 300 networks each: per-layer means of log‖δ‖², log‖∂L/∂W‖², q, c (and the cross-batch
    # correlation) must agree within |z| < 4.5 (~40 comparisons; false alarm p ≈ 3e-4 in all).
    # Power: dropping the projection (I − QQᵀ) inflates each layer's gradient by ≈ 1 + rows/d
    # (25 % at rows = 16, d = 64), i.e. z ≈ 30 by the last layer; dropping the fresh part U
    # shrinks it by ≈ rows/d per layer.  Both were checked to fail this test.
    kw = dict(num_batches=k, input_correlation=0.5, residual_scale=residual, dtype="float64")
    ex = simulate(phi, 8, 64, 8, 300, weight_sampling="explicit", seed=1, **kw)
    co = simulate(phi, 8, 64, 8, 300, weight_sampling="conditional", seed=2, **kw)
    assert ex.config["weight_sampling"] == "explicit" and co.config["weight_sampling"] == "conditional"
    pairs = [(np.log(ex.grad_norm_sq), np.log(co.grad_norm_sq)),
             (np.log(ex.weight_grad_norm_sq[:, 1:]), np.log(co.weight_grad_norm_sq[:, 1:])),
             (ex.q, co.q), (ex.c[:, 1:], co.c[:, 1:])]
    if k > 1:
        pairs.append((ex.cross_batch_corr, co.cross_batch_corr))
    for x, y in pairs:
        z = _zscores(x, y)
        assert np.all(np.abs(z) < 4.5), z


@pytest.mark.parametrize("weight_sampling", ["conditional", "explicit"])
def test_thread_count_does_not_change_the_numbers(weight_sampling):
    # With ≥ 2 CPU threads, chunks of networks run concurrently and the QRs of a chunk are split
    # over a thread pool: same numbers as one thread (up to BLAS blocking, rtol 1e-10).
    kw = dict(seed=4, dtype="float64", weight_sampling=weight_sampling, num_batches=2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = simulate("relu", 6, 40, 5, 5, **kw)
        torch.set_num_threads(2)
        b = simulate("relu", 6, 40, 5, 5, **kw)
        assert torch.get_num_threads() == 2  # restored after the parallel section
    finally:
        torch.set_num_threads(old)
    assert a.chunks == 1 and b.chunks == 2
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-10)


def test_reproducible_and_chunking_invariant():
    kw = dict(num_batches=2, seed=4, dtype="float64", weight_sampling="conditional")
    a = simulate("relu", 6, 40, 5, 5, **kw)
    b = simulate("relu", 6, 40, 5, 5, **kw)
    c = simulate("relu", 6, 40, 5, 5, max_memory_bytes=1, **kw)
    assert c.chunks == 5
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        # same seed, same random numbers; a BLAS does not promise bit-identical sums between calls (MKL varies with memory alignment), so equal to rounding
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(getattr(a, field), getattr(c, field), rtol=1e-12)


def test_auto_choice_and_bad_input():
    assert simulate("relu", 4, 32, 3, 2).config["weight_sampling"] == "conditional"  # rows 4 ≤ 32/4
    assert simulate("relu", 9, 32, 3, 2).config["weight_sampling"] == "explicit"  # rows 9 > 8
    assert simulate("relu", 4, 32, 3, 2, init="orthogonal").config["weight_sampling"] == "explicit"
    with pytest.raises(ValueError, match="weight_sampling='conditional' is not allowed with init='uniform'"):
        simulate("relu", 4, 32, 3, 2, init="uniform", weight_sampling="conditional")
    with pytest.raises(ValueError, match="weight_sampling"):
        simulate("relu", 4, 32, 3, 2, weight_sampling="implicit")
    with pytest.raises(ValueError, match="fan_out"):
        conditional_gaussian_layer(torch.zeros(1, 2, 3), 0, 1.0, _gens([0]))
    with pytest.raises(ValueError, match="sigma_w2"):
        conditional_gaussian_layer(torch.zeros(1, 2, 3), 2, float("nan"), _gens([0]))
    with pytest.raises(ValueError, match="grams"):
        conditional_gaussian_layer(torch.zeros(1, 2, 3), 4, 1.0, _gens([0]), grams=[])
    with pytest.raises(ValueError, match="mean_free_batch=3"):
        conditional_gaussian_layer(torch.zeros(1, 2, 3), 4, 1.0, _gens([0]), mean_free_batch=3)  # 3 ∤ 2 rows
    with pytest.raises(ValueError, match="mean_free_batch"):
        conditional_gaussian_layer(torch.zeros(1, 2, 3), 4, 1.0, _gens([0]), mean_free_batch=0)


def test_second_backward_pass_is_refused():
    # a second pass would draw a W̃ inconsistent with the first: autograd must refuse it
    a = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
    h = conditional_gaussian_layer(a, 4, 1.0, _gens([0]))
    h.sum().backward()
    with pytest.raises(RuntimeError):
        h.sum().backward()


@pytest.mark.parametrize("k,residual", [(1, None), (2, 0.6)])
def test_weight_gradient_from_the_layers_grams_equals_the_direct_measurement(monkeypatch, k, residual):
    # Conditional layers hand over a aᵀ (RᵀR or the Cholesky route's Gram) and δδᵀ = R_δᵀR_δ;
    # the simulator's ‖∂L/∂W‖² from them must equal ⟨a aᵀ, δδᵀ⟩ computed from a and δ (float64
    # rounding), including the residual factor r² and the per-batch blocks for k = 2.
    kw = dict(num_batches=k, residual_scale=residual, seed=3, dtype="float64", weight_sampling="conditional")
    fast = simulate("relu", 6, 48, 5, 3, **kw)
    original = conditional.conditional_gaussian_layer

    def without_grams(a, fan_out, sigma_w2, generators, *, grams=None, mean_free_batch=None):
        return original(a, fan_out, sigma_w2, generators, mean_free_batch=mean_free_batch)

    monkeypatch.setattr("bnlab.sim.networks.conditional_gaussian_layer", without_grams)
    direct = simulate("relu", 6, 48, 5, 3, **kw)
    np.testing.assert_allclose(fast.weight_grad_norm_sq, direct.weight_grad_norm_sq, rtol=1e-10)
    np.testing.assert_allclose(fast.grad_norm_sq, direct.grad_norm_sq, rtol=1e-12)
