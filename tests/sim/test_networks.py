"""The batched simulator against an independent one-network-at-a-time implementation, and its contracts."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.activations import get_activation
from bnlab.sim import (
    EnsembleResult,
    bsb1_projection,
    cross_batch_correlation,
    init_weights,
    simulate,
    weight_gradient_norm_sq,
)


def _naive(trace, phi, k, b, eps, normalization="bn", residual_scale=None):
    """One network at a time, torch.nn.BatchNorm1d (training mode) and explicit ops, float64.

    Returns per-network, per-layer q, c, ‖δ‖², ‖∂L/∂W‖² (mean over batches, each with its own
    loss and its own W.grad from autograd) and the centered cross-batch correlation (pairs (0, j))."""
    act = get_activation(phi)
    rec = trace[0]
    x_all, ws, v_all = rec["inputs"], rec["weights"], rec["readout"]
    n, rows, _ = x_all.shape
    depth = len(ws)
    out = {key: np.zeros((n, depth)) for key in ("q", "c", "g", "wg", "rho")}
    width = ws[0].shape[-1]
    for i in range(n):
        per_batch = []
        for j in range(k):
            wl = [w[i].detach().clone().double().requires_grad_(True) for w in ws]
            x = x_all[i, j * b : (j + 1) * b].double()
            # torch refuses eps = 0 in training mode; 1e-14 changes 1/sqrt(var) by ~1e-14 relative
            bn = torch.nn.BatchNorm1d(width, affine=False, eps=max(eps, 1e-14), momentum=None,
                                      dtype=torch.float64).train()
            hs = []
            a = x
            for layer in range(depth):
                h = a @ wl[layer]
                if residual_scale is not None and layer > 0:
                    h = hs[-1] + residual_scale * h
                h.retain_grad()
                hs.append(h)
                if normalization == "bn":
                    u = bn(h)
                elif normalization == "bn_nomean":
                    u = h / torch.sqrt((h * h).mean(0) + eps)  # Daneshmand et al. 2020: no centering
                else:
                    u = h
                a = act.torch(u)
            loss = (v_all[i, j * b : (j + 1) * b].double() * hs[-1]).sum()
            loss.backward()
            per_batch.append((hs, wl))
        for layer in range(depth):
            qs, cs, gs, wgs = [], [], [], []
            for hs, wl in per_batch:
                h = hs[layer].detach()
                cov = h @ h.T / width
                qq = cov.diagonal().mean()
                off = (cov.sum() - cov.diagonal().sum()) / (b * (b - 1))
                qs.append(qq.item())
                cs.append((off / qq).item())
                gs.append(hs[layer].grad.pow(2).sum().item())
                wgs.append(wl[layer].grad.pow(2).sum().item())
            out["q"][i, layer] = np.mean(qs)
            out["c"][i, layer] = np.mean(cs)
            out["g"][i, layer] = np.mean(gs)
            out["wg"][i, layer] = np.mean(wgs)
            if k > 1:
                h0 = per_batch[0][0][layer].detach()
                rhos = []
                for hs, _ in per_batch[1:]:
                    h1 = hs[layer].detach()
                    c0, c1 = h0 - h0.mean(0), h1 - h1.mean(0)
                    rhos.append(((c0 * c1).sum() / torch.sqrt((c0 * c0).sum() * (c1 * c1).sum())).item())
                out["rho"][i, layer] = np.mean(rhos)
    return out


@pytest.mark.parametrize(
    "phi,eps,k,normalization,residual",
    [("relu", 0.0, 2, "bn", None), ("tanh", 1e-3, 3, "bn", None), ("relu", 0.0, 1, "none", None),
     ("identity", 0.0, 2, "bn", 0.5), ("identity", 0.0, 2, "bn_nomean", None)],
)
def test_matches_naive_per_network_loop(phi, eps, k, normalization, residual):
    # Both routes compute the same finite networks in float64; they differ only in the order
    # of floating-point operations, so they agree to ~1e-12 relative (tolerance 1e-9).
    b, width, depth, n = 5, 12, 4, 3
    trace = []
    init = "asymmetric_uniform" if normalization == "bn_nomean" else "gaussian"
    res = simulate(phi, b, width, depth, n, eps=eps, num_batches=k, norm=normalization,
                   residual_scale=residual, init=init, seed=3, dtype="float64", _trace=trace)
    ref = _naive(trace, phi, k, b, eps, normalization, residual)
    np.testing.assert_allclose(res.q, ref["q"], rtol=1e-9)
    np.testing.assert_allclose(res.c, ref["c"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.grad_norm_sq, ref["g"], rtol=1e-9)
    np.testing.assert_allclose(res.weight_grad_norm_sq, ref["wg"], rtol=1e-9)
    if k > 1:
        np.testing.assert_allclose(res.cross_batch_corr, ref["rho"], rtol=1e-9, atol=1e-12)


def test_same_seed_same_numbers_and_chunking_invariant():
    kw = dict(num_batches=2, seed=11, dtype="float64")
    a = simulate("relu", 6, 16, 5, 7, **kw)
    b = simulate("relu", 6, 16, 5, 7, **kw)
    # a memory bound forcing one network per chunk (one network needs ≈ 108 kB here, autograd's records
    # included; a bound below that is refused): per-network generators give the same networks
    c = simulate("relu", 6, 16, 5, 7, max_memory_bytes=150_000, **kw)
    assert c.chunks == 7 and a.chunks <= torch.get_num_threads()  # one chunk per CPU thread
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        # same seed, same random numbers; a BLAS does not promise bit-identical sums between calls (MKL varies with memory alignment), so equal to rounding
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(getattr(a, field), getattr(c, field), rtol=1e-12)
    d = simulate("relu", 6, 16, 5, 7, num_batches=2, seed=12, dtype="float64")
    assert not np.allclose(a.q, d.q)


def test_float32_matches_float64():
    # Same networks (weights are drawn in float32 for both); float32 rounding (2^-24 ≈ 6e-8) grows
    # through depth 8 and the gradient explosion by at most a few hundred ulps: rtol 1e-4.
    # Explicit weights: conditional sampling gives the same law in both dtypes but not the same
    # draws (the QR basis of rank-deficient directions, e.g. δ ⊥ 1 after BN, is set by rounding).
    kw = dict(num_batches=2, seed=5, weight_sampling="explicit")
    a = simulate("tanh", 8, 64, 8, 4, dtype="float64", **kw)
    b = simulate("tanh", 8, 64, 8, 4, dtype="float32", **kw)
    for field in ("q", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        np.testing.assert_allclose(getattr(b, field), getattr(a, field), rtol=1e-4)
    np.testing.assert_allclose(b.c, a.c, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu_statistically():
    # Different random streams on the two devices: compare ensemble statistics, not numbers.
    # The Monte Carlo error of the mean of c over 64 networks x 256 neurons is ~ 3e-3.
    a = simulate("relu", 8, 256, 10, 64, seed=0, device="cpu", dtype="float32")
    b = simulate("relu", 8, 256, 10, 64, seed=0, device="cuda", dtype="float32")
    assert b.q[:, -1].mean() == pytest.approx(a.q[:, -1].mean(), abs=0.02)
    assert b.c[:, -1].mean() == pytest.approx(a.c[:, -1].mean(), abs=0.02)


def test_gram_trick_weight_gradient_equals_autograd(rng):
    a = torch.tensor(rng.standard_normal((3, 5, 7)))
    w = torch.tensor(rng.standard_normal((3, 7, 4)), requires_grad=True)
    v = torch.tensor(rng.standard_normal((3, 5, 4)))
    h = torch.bmm(a, w)
    h.retain_grad()
    (v * torch.tanh(h)).sum().backward()
    expected = w.grad.pow(2).sum((1, 2))
    torch.testing.assert_close(weight_gradient_norm_sq(a, h.grad), expected, rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(2, 9), q=st.floats(0.1, 5), c=st.floats(-0.1, 0.9), noise=st.floats(0, 1))
def test_bsb1_projection_is_orthogonal(b, q, c, noise):
    gen = np.random.default_rng(b)
    e = gen.standard_normal((b, b)) * noise
    e = e + e.T
    cov = q * ((1 - c) * np.eye(b) + c * np.ones((b, b))) + e
    qq, cc, res = bsb1_projection(torch.tensor(cov))
    proj = qq.item() * ((1 - cc.item()) * np.eye(b) + cc.item() * np.ones((b, b)))
    # residual orthogonal to the BSB1 space spanned by I and 11ᵀ
    r = cov - proj
    assert abs(np.trace(r)) < 1e-9 * (1 + abs(cov).sum())
    assert abs(r.sum()) < 1e-9 * (1 + abs(cov).sum())
    assert res.item() == pytest.approx((r**2).sum(), rel=1e-9, abs=1e-12)


def test_bsb1_residual_of_a_nearly_bsb1_float32_covariance_has_no_cancellation():
    # Off-diagonal entries within 1e-4 of their mean next to a diagonal 0.7 above it: the residual
    # ‖Σ − BSB1‖² ≈ 5e-6 must come from the off-diagonal deviations themselves (float64 reference on
    # the same float32 entries, rtol 1e-6), not from subtracting the diagonal's ≈ 16 from a total
    # (that version was off by 1.5 % here).
    g = torch.Generator().manual_seed(0)
    b = 32
    noise = 1e-4 * torch.randn(b, b, generator=g, dtype=torch.float64)
    cov = (0.3 + 0.7 * torch.eye(b, dtype=torch.float64) + (noise + noise.T) / 2).float()
    qq, cc, res = bsb1_projection(cov)
    c64 = cov.double()
    proj = qq * ((1 - cc) * torch.eye(b, dtype=torch.float64) + cc)
    assert res.item() == pytest.approx(((c64 - proj) ** 2).sum().item(), rel=1e-6)


def test_cross_batch_correlation_of_identical_and_independent_batches(rng):
    h = torch.tensor(rng.standard_normal((2, 8, 4000)))
    assert cross_batch_correlation(h, 3.0 * h + 1.0).numpy() == pytest.approx(1.0)
    z = torch.tensor(rng.standard_normal((2, 8, 4000)))
    # independent: mean 0, sd ≈ 1/sqrt(7·4000) ≈ 0.006 → |ρ| < 0.04 (6 sd)
    assert np.all(np.abs(cross_batch_correlation(h, z).numpy()) < 0.04)


@pytest.mark.parametrize("init", ["gaussian", "orthogonal", "uniform", "asymmetric_uniform"])
def test_init_moments(init):
    g = torch.Generator().manual_seed(0)
    w = init_weights(init, 4, 200, 100, sigma_w2=2.0, generator=g, dtype=torch.float64)
    assert w.shape == (4, 200, 100)
    # 80000 entries: the sample variance has relative sd ≈ sqrt(2/80000) ≈ 0.005 (0.004 for
    # uniform); tolerance 0.03 = 6 sd.
    if init == "asymmetric_uniform":
        # U[0, 2σ_w/sqrt(d)]: mean σ_w/sqrt(d), variance σ_w²/(3d)
        assert w.min() >= 0
        assert w.mean().item() == pytest.approx(math.sqrt(2.0 / 200), rel=0.01)
        assert w.var().item() == pytest.approx(2.0 / (3 * 200), rel=0.03)
    else:
        assert abs(w.mean().item()) < 6 * math.sqrt(2.0 / 200 / 80000)
        assert w.var().item() == pytest.approx(2.0 / 200, rel=0.03)
    if init == "orthogonal":
        gram = w.transpose(1, 2) @ w  # orthonormal columns scaled by σ_w
        torch.testing.assert_close(gram, 2.0 * torch.eye(100, dtype=torch.float64).expand(4, 100, 100))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(width=0), "width"),
        (dict(depth=0), "depth"),
        (dict(networks=0), "networks"),
        (dict(init="xavier"), "init"),
        (dict(device="cuda"), "device"),
        (dict(device="tpu"), "device"),
        (dict(dtype="float16"), "dtype"),
        (dict(batch_size=1), "batch_size"),
        (dict(eps=-1.0), "eps"),
        (dict(norm="layer"), "norm"),
        (dict(inputs=np.zeros((3, 5))), "inputs"),
        (dict(inputs=np.ones((4, 5))), "inputs"),  # identical samples: BN would divide 0 by 0
        (dict(bn_gamma=0.0), "bn_gamma"),  # every layer after the first sees identical samples
        (dict(phi="nonsense_fn(x)"), "phi"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(kwargs, name):
    if name == "device" and kwargs["device"] == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    args = dict(phi="relu", batch_size=4, width=8, depth=3, networks=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name if name != "phi" else None):
        simulate(**args)


def test_degenerate_batches_are_fine_where_nothing_divides_by_their_spread():
    # the two errors above apply only where BN with eps = 0 would divide by zero
    for kw in (dict(bn_gamma=0.0, eps=0.1), dict(bn_gamma=0.0, depth=2), dict(inputs=np.ones((4, 5)), eps=0.1)):
        args = dict(phi="relu", batch_size=4, width=8, depth=3, networks=2)
        args.update(kw)
        res = simulate(**args)
        assert np.all(np.isfinite(res.q))


def test_bsb1_distance_decomposition():
    res = simulate("relu", 6, 32, 4, 3, seed=0, measure_gradients=False)
    assert isinstance(res, EnsembleResult) and res.grad_norm_sq is None
    # recompute ‖Σ^L − Σ*‖/‖Σ*‖ directly from the stored final covariances of batch 0
    q_star, c_star = 0.5, 0.25
    target = q_star * ((1 - c_star) * np.eye(6) + c_star * np.ones((6, 6)))
    direct = np.linalg.norm(res.final_covariance - target, axis=(1, 2)) / np.linalg.norm(target)
    np.testing.assert_allclose(res.bsb1_distance(q_star, c_star)[:, -1], direct, rtol=1e-10)


def test_orthogonal_equals_householder_qr_with_positive_diagonal():
    # CholeskyQR2 and LAPACK Householder QR (signs fixed so diag R > 0) give the same unique
    # factor; both are backward stable here (cond ~ 1e2), so they agree to ~1e-12.
    from bnlab.sim.init import _cholesky_qr

    g = torch.randn(3, 50, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    torch.testing.assert_close(_cholesky_qr(_cholesky_qr(g)), q, rtol=0, atol=1e-12)
    # a rank-deficient matrix makes the Cholesky fail: the Householder fallback still returns
    # orthonormal columns
    g[0, :, 1] = g[0, :, 0]
    q2 = _cholesky_qr(g)
    torch.testing.assert_close(q2.transpose(1, 2) @ q2, torch.eye(30, dtype=torch.float64).expand(3, 30, 30),
                               rtol=0, atol=1e-12)


def test_diagonal_and_off_diagonal_variances_of_the_last_covariance():
    # diag_var / offdiag_var (Fig. 1c: BSB1 → BSB2) against a direct computation from the final
    # batch covariances, per network, float64 rounding
    res = simulate("relu", 7, 40, 4, 3, seed=2, dtype="float64")
    cov = res.final_covariance
    q = np.einsum("nii->n", cov) / 7
    off = cov[:, ~np.eye(7, dtype=bool)]
    np.testing.assert_allclose(res.offdiag_var[:, -1], off.var(-1) / q**2, rtol=1e-10)
    np.testing.assert_allclose(res.diag_var[:, -1], np.diagonal(cov, axis1=1, axis2=2).var(-1) / q**2, rtol=1e-10)


@pytest.mark.parametrize("normalization, b", [("bn", 4), ("bn", 6), ("bn_nomean", 4)])
def test_gradient_tail_index_premise_batch_variances_are_generalized_chi_square(normalization, b):
    """The premise of EnsembleResult.grad_norm_tail_index: given its input, a layer's neurons are iid
    N(0, s²·a aᵀ) over the batch, so a neuron's (centered, for "batch") sum of squares is a
    generalized χ² with B − 1 (B) degrees of freedom — the number that sets the tail index of the
    BN gain 1/σ², through the law's lower tail P(ss < t) ∝ t^(dof/2).

    At three deep layers, N = 3000 neurons each, pooled through the probability integral transform
    of the law with the measured covariance (2·10⁵ Monte Carlo draws per layer):
    * the whole law: Kolmogorov–Smirnov against uniform, p > 1e-3 (conservative with estimated
      parameters, Lilliefors);
    * the lower tail: the count below each layer's 5 % quantile is Binomial(9000, 0.05) under the
      law, |z| < 4 (measured |z| ≤ 2.3).  With one degree of freedom too many (the same mean spread
      over one more direction) the count at *that* law's 5 % quantile is far above 5 % (z > 5;
      measured 7.3 at B = 6, 13.5 at B = 4): the test tells B − 1 from B."""
    from scipy.stats import kstest

    layers = (10, 20, 30)
    res = simulate("relu", b, 3000, 30, 1, norm=normalization, seed=3, dtype="float64",
                   record_layers=layers, measure_gradients=False)
    assert res.grad_norm_tail_index == ((b - 1) / 2 if normalization == "bn" else b / 2)
    rng = np.random.default_rng(0)
    dof = b - 1 if normalization == "bn" else b
    u, below, below_wrong, n = [], 0, 0, 0
    for layer in layers:
        h = res.hidden[layer][0]  # (B, N): the neurons are the columns
        if normalization == "bn":
            h = h - h.mean(0)
        ss = (h * h).sum(0)
        lam = np.sort(np.clip(np.linalg.eigvalsh(h @ h.T / h.shape[1]), 0.0, None))[::-1][:dof]
        ref = np.sort(rng.chisquare(1, (200_000, dof)) @ lam)
        u.append(np.searchsorted(ref, ss) / ref.size)
        below += int((ss < np.quantile(ref, 0.05)).sum())
        lam_wrong = np.append(lam, lam.mean()) * (lam.sum() / (lam.sum() + lam.mean()))
        wrong = rng.chisquare(1, (200_000, dof + 1)) @ lam_wrong
        below_wrong += int((ss < np.quantile(wrong, 0.05)).sum())
        n += ss.size
    assert kstest(np.concatenate(u), "uniform").pvalue > 1e-3
    sd = math.sqrt(n * 0.05 * 0.95)
    assert abs(below - 0.05 * n) / sd < 4
    assert (below_wrong - 0.05 * n) / sd > 5


def test_gradient_tail_index_values():
    kw = dict(measure_gradients=False, seed=0)
    assert simulate("relu", 4, 16, 2, 1, **kw).grad_norm_tail_index == 1.5
    assert simulate("relu", 4, 16, 2, 1, norm="bn_nomean", **kw).grad_norm_tail_index == 2.0
    assert simulate("relu", 4, 16, 2, 1, eps=1e-3, **kw).grad_norm_tail_index == math.inf
    assert simulate("relu", 4, 16, 2, 1, norm="none", **kw).grad_norm_tail_index == math.inf
    # fewer directions than the batch: the rank of a aᵀ caps the degrees of freedom
    assert simulate("relu", 8, 3, 2, 1, **kw).grad_norm_tail_index == 1.5
    assert simulate("relu", 8, 16, 2, 1, input_dim=2, **kw).grad_norm_tail_index == 1.0


def test_grad_explosion_rate_uses_the_tail_interval_where_the_variance_is_infinite():
    kw = dict(seed=0, dtype="float32")
    assert simulate("relu", 4, 32, 8, 20, **kw).grad_explosion_rate().ci_method == "tail_bootstrap_t"
    assert simulate("relu", 4, 32, 8, 19, **kw).grad_explosion_rate().ci_method == "percentile_bootstrap"
    assert simulate("relu", 8, 32, 8, 20, **kw).grad_explosion_rate().ci_method == "percentile_bootstrap"
    assert simulate("relu", 4, 32, 8, 20, eps=1e-3, **kw).grad_explosion_rate().ci_method == "percentile_bootstrap"
    res = simulate("relu", 4, 32, 8, 20, **kw)
    assert res.grad_explosion_rate(tail_index=None).ci_method == "percentile_bootstrap"
    assert res.grad_explosion_rate(estimator="log_mean").ci_method == "percentile_bootstrap"
