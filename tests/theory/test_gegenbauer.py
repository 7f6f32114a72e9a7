"""Gegenbauer coefficients (Yang et al. 2019, Thm 3.4, App. E.4) against independent routes."""
import math
import warnings

import numpy as np
import pytest
from scipy import special

from bnlab.activations import get_activation
from bnlab.theory.gegenbauer import (
    GegenbauerTruncationWarning,
    gegenbauer_basis_at,
    gegenbauer_coefficients,
    gegenbauer_orthonormal_coefficients,
    gegenbauer_quadratic_form,
    gegenbauer_series_moments,
    normalized_gegenbauer,
    oscillating_tail_bound,
)
from bnlab.theory.spherical import isotropic_transform_entries


@pytest.mark.parametrize("b", [4, 7, 16])
def test_normalized_recurrence_vs_scipy(b):
    # independent: scipy's eval_gegenbauer; R_l is bounded by 1, so an absolute 1e-12.
    lam = (b - 3) / 2
    t = np.linspace(-1, 1, 9)
    r = normalized_gegenbauer(b, 12, t)
    ref = np.array([special.eval_gegenbauer(l, lam, t) / special.eval_gegenbauer(l, lam, 1.0) for l in range(12)])
    assert np.allclose(r, ref, atol=1e-12)
    basis = gegenbauer_basis_at(b, 12, t)
    c = lam / (lam + np.arange(12))
    assert np.allclose(basis, np.array([special.eval_gegenbauer(l, lam, t) for l in range(12)]) / c[:, None], rtol=1e-12)


@pytest.mark.parametrize("b", [4, 8, 32])
def test_identity_coefficients_closed_form(b):
    # √(B−1)x = a_1 (1/c_1) C_1(x) with C_1 = 2λx, 1/c_1 = (λ+1)/λ  ⇒  a_1 = 1/√(B−1), all other a_l = 0.
    a = gegenbauer_coefficients("identity", b, n_terms=6)
    assert a[1] == pytest.approx(1 / math.sqrt(b - 1), rel=1e-13)
    assert np.allclose(np.delete(a, 1), 0.0, atol=1e-14)


@pytest.mark.parametrize("phi", ["tanh", "sin", "gelu", "sigmoid"])
def test_series_reconstructs_phi(phi):
    # Σ a_l (1/c_l) C_l(x) = φ(√(B−1)x) pointwise.  The automatic truncation controls the
    # L²(μ_B) tail only (pointwise error near |x| → 1 is larger, ~1e-6 at 15 terms for gelu, as
    # the weight is small there); with 40 terms the geometric decay leaves < 1e-11 everywhere.
    b = 8
    a = gegenbauer_coefficients(phi, b, n_terms=40)
    x = np.linspace(-0.95, 0.95, 13)
    series = a @ gegenbauer_basis_at(b, a.size, x)
    assert np.allclose(series, get_activation(phi)(math.sqrt(b - 1) * x), atol=1e-11)


@pytest.mark.parametrize("phi", ["tanh", "relu"])
@pytest.mark.parametrize("b", [5, 32])
def test_parseval_and_quadratic_forms_vs_sphere(phi, b):
    # Thm 3.4: q* = Σ a_l² C_l(1)/c_l, q*c* = Σ a_l² C_l(−1/(B−1))/c_l, against Thm F.5 (sphere).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GegenbauerTruncationWarning)
        bl = gegenbauer_orthonormal_coefficients(phi, b)
        al = gegenbauer_coefficients(phi, b, n_terms=bl.size)
    d, o, _ = isotropic_transform_entries(get_activation(phi), b)
    q, qc = gegenbauer_quadratic_form(bl, b, np.array([1.0, -1.0 / (b - 1)]))
    q2, qc2 = gegenbauer_quadratic_form(al, b, np.array([1.0, -1.0 / (b - 1)]), orthonormal=False)
    # smooth φ: tail < 1e-12 relative; relu: Parseval tail ~ n^-2 ≈ 1e-8 (B=32) at 1024 terms
    tol = 1e-11 if phi == "tanh" else 1e-7
    assert q == pytest.approx(d, rel=tol) and q2 == pytest.approx(d, rel=tol)
    assert qc == pytest.approx(o, rel=1e-10, abs=1e-12) and qc2 == pytest.approx(o, rel=1e-10, abs=1e-12)


def test_large_b_tanh_finite():
    b = 1024
    bl = gegenbauer_orthonormal_coefficients("tanh", b)
    a = gegenbauer_coefficients("tanh", b, n_terms=bl.size)
    assert np.all(np.isfinite(bl)) and np.all(np.isfinite(a))
    d, o, _ = isotropic_transform_entries(get_activation("tanh"), b)
    assert np.sum(bl**2) == pytest.approx(d, rel=1e-11)


def test_slow_convergence_warns_with_tail():
    with pytest.warns(GegenbauerTruncationWarning, match="tail"):
        c = gegenbauer_coefficients("relu", 8, max_terms=64)
    assert c.size == 64


def test_odd_and_even_symmetry():
    # tanh is odd: even-degree coefficients vanish; |x| even: odd ones vanish
    a = gegenbauer_coefficients("tanh", 9, n_terms=10)
    assert np.allclose(a[0::2], 0.0, atol=1e-15)
    b = gegenbauer_coefficients("abs", 9, n_terms=10)
    assert np.allclose(b[1::2], 0.0, atol=1e-15)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: gegenbauer_coefficients("tanh", 3), "B = 3"),
        (lambda: gegenbauer_coefficients("tanh", 2), "batch_size=2"),
        (lambda: gegenbauer_coefficients("tanh", 8, rtol=0.0), "rtol"),
        (lambda: gegenbauer_coefficients("tanh", 8, n_terms=0), "n_terms"),
        (lambda: gegenbauer_basis_at(1024, 800, np.array([1.0])), "overflows"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_large_b_many_terms_finite_parseval_and_consistent():
    # Regression: at B = 1024 the orthonormal P_l(1)² = C_l(1)/c_l ~ binom(l+1020, l) passes
    # e^{1420} beyond l ≈ 1030, so evaluating P_l alone overflowed (inf·0 = NaN for 567 of
    # 1600 coefficients).  The weighted recurrence keeps every coefficient finite.
    b = 1024
    bl = gegenbauer_orthonormal_coefficients("relu", b, n_terms=1600)
    assert np.all(np.isfinite(bl))
    # Parseval against the exact E[relu(√(B−1)x)²] = (B−1)/2 · E_μ[x²] = 1/2 (E_μ x² = 1/(B−1)).
    # Σ b_l² can only fall short of it by the tail: relu's kink gives b_l² ~ l^{-3}, tail ~ n^{-2};
    # the module documents ≈1e-6 at 1024 terms, so at 1600 terms 0 ≤ tail ≤ 1e-6 (measured 3.2e-7).
    # It may exceed 1/2 only by rounding: 1600 terms each with error ≲ 1e-14 ‖φ‖ ⇒ 1e-12 slack.
    tail = 0.5 - np.sum(bl**2)
    assert -1e-12 <= tail <= 0.5e-6
    # Fewer terms use a coarser quadrature level (_level_for(400) = 11 vs 13); where both
    # are accurate (l < 400) they agree to the per-coefficient quadrature error ≈1e-14·‖φ‖.
    bl400 = gegenbauer_orthonormal_coefficients("relu", b, n_terms=400)
    assert np.allclose(bl[:400], bl400, rtol=0, atol=1e-13)


def test_large_b_many_terms_parseval_smooth_vs_quad():
    # Smooth φ: the series is complete to < 1e-15 long before 1600 terms, so Σ b_l² must equal
    # E_μ[tanh(√(B−1)x)²], here by scipy's adaptive quad in x with the log-gamma normalized weight
    # (error estimate ~1e-14); the sum's rounding is ≲ 1e-13, hence rel 1e-11.
    from scipy import integrate

    b = 1024
    bl = gegenbauer_orthonormal_coefficients("tanh", b, n_terms=1600)
    assert np.all(np.isfinite(bl))
    log_z = special.betaln(0.5, (b - 2) / 2)

    def integrand(x):
        return math.exp((b - 4) / 2 * math.log1p(-x * x) - log_z) * math.tanh(math.sqrt(b - 1) * x) ** 2

    ref, _err = integrate.quad(integrand, -1, 1, points=[0], epsabs=0, epsrel=1e-13, limit=200)
    assert np.sum(bl**2) == pytest.approx(ref, rel=1e-11)


# --- tails summed through the moments (SeriesMoments) -----------------------------------------
def _jacobi_x2(bl, b):
    # ‖J b‖² with x P_l = √β_{l+1} P_{l+1} + √β_l P_{l−1}: the coefficients of x·f, summed independently
    lam = (b - 3) / 2
    l = np.arange(1, bl.size + 1, dtype=float)
    sb = np.sqrt(l * (l + 2 * lam - 1) / (4 * (l + lam) * (l + lam - 1)))  # sb[l-1] = √β_l
    xf = np.zeros(bl.size + 1)
    xf[1:] += sb * bl  # b_l → degree l+1 with √β_{l+1}
    xf[: bl.size - 1] += sb[: bl.size - 1] * bl[1:]  # b_{l+1} → degree l with √β_{l+1}
    return float(np.sum(xf**2))


@pytest.mark.parametrize("phi", ["tanh", "gelu"])
@pytest.mark.parametrize("b", [5, 32])
def test_series_moments_equal_the_converged_sums(phi, b):
    # For analytic φ the series has converged (tail < 1e-15) at 80 terms, so each moment must equal
    # the sum it stands for: Parseval, ‖Jb‖² (Jacobi matrix) and the Dirichlet form Σ l(l+B−3) b_l².
    bl, mom = gegenbauer_series_moments(phi, b, 80, dirichlet=True)
    l = np.arange(bl.size)
    assert mom.second == pytest.approx(np.sum(bl**2), rel=1e-13)
    assert mom.x_second == pytest.approx(_jacobi_x2(bl, b), rel=1e-13)
    assert mom.dirichlet == pytest.approx(np.sum(l * (l + b - 3) * bl**2), rel=1e-12)


@pytest.mark.parametrize("b", [8, 128])
def test_relu_moments_closed_form_and_slow_raw_tails(b):
    # relu(√(B−1)x): E f² = 1/2, E x² f² = (B−1)/2 E x⁴ = 3/(2(B+1)), E(1−x²) f'² = (B−1)/2 (1 − 1/(B−1)) = (B−2)/2
    # (E_μ x² = 1/(B−1), E_μ x⁴ = 3/((B−1)(B+1))).  The raw sums fall short by the algebraic tails
    # (b_l² ~ l^{−4} once l ≫ B): the Dirichlet tail Σ_{l≥n} l(l+B−3) b_l² ~ 1/n is what the moments remove.
    n = 200
    bl, mom = gegenbauer_series_moments("relu", b, n, dirichlet=True)
    assert mom.second == pytest.approx(0.5, rel=1e-14)
    assert mom.x_second == pytest.approx(1.5 / (b + 1), rel=1e-13)
    assert mom.dirichlet == pytest.approx((b - 2) / 2, rel=1e-13)
    l = np.arange(n)
    dir_tail = mom.dirichlet - np.sum(l * (l + b - 3) * bl**2)
    assert 1e-3 * mom.dirichlet < dir_tail < 1e-1 * mom.dirichlet  # measured 3.5e-3 (B=8), 1.1e-2 (B=128)


@pytest.mark.parametrize("alpha", [0.55, 0.75, 1.5])
@pytest.mark.parametrize("b", [5, 128])
def test_dirichlet_moment_of_relu_alpha_closed_form(alpha, b):
    # f = (B−1)^{α/2} x_+^α: E(1−x²)f'² = (B−1)^α α² E[x^{2α−2}(1−x²); x > 0]
    #   = (B−1)^α α²/2 · B(α−½, B/2)/B(½, (B−2)/2)   (μ_B ∝ (1−x²)^{(B−4)/2}).
    # For α < 1 the integrand is singular at the kink (|x|^{2α−2}); a rule stopping at |x| ≈ 1e-17 loses
    # 5e-4 (α = 0.6) to 5e-2 (α = 0.55) of it — the moment's own rule reaches |x| ≈ 1e-300 (measured ≤ 3e-14).
    _, mom = gegenbauer_series_moments(get_activation("alpha_relu", alpha=alpha), b, 50, dirichlet=True)
    log_ratio = special.betaln(alpha - 0.5, b / 2) - special.betaln(0.5, (b - 2) / 2)
    exact = (b - 1) ** alpha * alpha**2 / 2 * math.exp(log_ratio)
    assert mom.dirichlet == pytest.approx(exact, rel=1e-12)


def test_oscillating_tail_bound_covers_the_true_two_point_tail():
    # Σ_{l≥n} b_l² R_l(ξ) for relu at B = 4 (slowest decay, R_l(ξ) ~ l^{-1/2}): the sum over
    # n ≤ l < 600 (the rest is ≲ 1e-13) vs the bound from the first n terms and the Parseval tail
    b, n = 4, 150
    bl = gegenbauer_orthonormal_coefficients("relu", b, n_terms=600)
    r = normalized_gegenbauer(b, 600, np.array(-1.0 / (b - 1)))
    true_tail = abs(np.sum(bl[n:] ** 2 * r[n:]))
    bound = oscillating_tail_bound(r[:n], 0.5 - np.sum(bl[:n] ** 2))
    assert true_tail <= bound <= 1e-8  # measured 5.8e-11 ≤ 3.6e-9


@pytest.mark.parametrize("alpha, b, ref_method, documented", [
    (1.5, 4, "sphere", 2e-8), (2.0, 8, "laplace", 3e-11), (2.5, 32, "laplace", 1e-12), (3.0, 128, "laplace", 1e-12),
])
def test_gegenbauer_smooth_kink_relu_alpha_meets_accuracy_and_bound(alpha, b, ref_method, documented):
    """relu^α, α ≥ 1.5: b_l² ~ l^{−2α−2} passes the Parseval convergence test, but the Dirichlet series Σ ε_l b_l²
    of λ_G↓'s numerator converges like n^{−(2α−2)}; its plain head was used and truncation_error reported 0 + 1e-12
    (α = 1.5, B = 4: 3.9e-7 off, 3.2e-12 reported).  Now the Dirichlet moment is used whenever its own head is
    unconverged, and a plain head's neglected tail is counted in the bound.

    Tolerances: |Gegenbauer − reference| ≤ truncation_error + the reference's error (Laplace closed forms ≈1e-15,
    the sphere rule ≤ 1e-12 relative for relu-like φ: 1e-12·|ref|), and the relative error ≤ the documented
    accuracy of docs/theory-methods.md (B = 4: 2e-8, B = 8: 3e-11, B = 32, 128: 1e-12; measured now ≤ 4e-12,
    ≤ 1.1e-12, ≤ 6e-13)."""
    a = get_activation("alpha_relu", alpha=alpha)
    from bnlab.theory import backward_eigenvalues, forward_eigenvalues
    from bnlab.theory.cross_batch import cross_batch_analysis

    ref, geg = (backward_eigenvalues(a, b, method=m) for m in (ref_method, "gegenbauer"))
    ref_err = 1e-12 * abs(ref.lambda_G)
    assert abs(geg.lambda_G - ref.lambda_G) <= geg.truncation_error + ref_err
    assert abs(geg.lambda_G / ref.lambda_G - 1.0) <= documented
    rf, gf = (forward_eigenvalues(a, b, method=m) for m in (ref_method, "gegenbauer"))
    assert abs(gf.lambda_L - rf.lambda_L) <= gf.truncation_error + 1e-12 * abs(rf.lambda_L)
    assert abs(gf.lambda_M - rf.lambda_M) <= gf.truncation_error + 1e-12 * abs(rf.lambda_M)
    rc, gc = (cross_batch_analysis(a, b, method=m) for m in (ref_method, "gegenbauer"))
    assert abs(gc.rate - rc.rate) <= gc.truncation_error + 1e-12 * abs(rc.rate)
