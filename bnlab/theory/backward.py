"""Gradient backpropagation in batchnorm networks at the BSB1 fixed point (Yang et al. 2019, §3.1.2, App. G, L).

Definition
----------
Under gradient independence the covariance Π^l of the backpropagated
gradients obeys Π^l = V_{B_φ'}(Σ*)†{Π^{l+1}} = G^{⊗2} ∘ F(Σ*){Π^{l+1}}
(Eqs. 17, 18), with F(Σ*) ultrasymmetric; G^{⊗2}∘F has eigenspaces RG, L, M
(Thm 3.6, E.62) with eigenvalues λ_G↓ (the *gradient explosion rate*: the
gradient norm squared grows as λ_G↓^L with depth L), λ_L↓, λ_M↓.

Writing |Gh| = √μ* r, n(Gh) = √B u (r ~ χ_{B−1} independent of u uniform on
the unit sphere of the sum-zero hyperplane), d(φ∘n)/dz = √B/(√μ* r)·D P_u with
D = diag φ'(√B u), P_u = G − uuᵀ, and E[r⁻²] = 1/(B−3):

    G^{⊗2}∘F{Π} = B/((B−3)μ*) · E_u[P_u D Π D P_u]          (App. G.1.1)

Methods
-------
``"sphere"`` (App. G.1.1): the ten brackets of F reduced to 2-d integrals
and Thm E.62 (≈1e-10 relative; needs φ' square integrable, e.g. relu^α with α > 1/2).
``"gegenbauer"``: λ_G↓ by Thm 3.9 / G.5 (λ_L↓, λ_M↓ have no Gegenbauer form in
the paper: they are returned as None).  ``"closed"``: relu (Thm 3.10 for λ_G↓,
Thm G.12 with α = 1 for λ_L↓, λ_M↓) and identity (λ_G↓ = (B−2)/(B−3),
λ_L↓ = λ_M↓ = (B² − 2B − 1)/(B² − 2B − 3), from the sphere's fourth moments).
``"laplace"``: Thm G.12 for every positive-homogeneous φ of degree α > 1/2
(≈1e-13).  ``"montecarlo"``: traces of u ↦ P_u D · D P_u over each eigenspace, from
uniform samples of the sphere, with standard errors.  ``"auto"``: closed (relu,
identity), else laplace (other positive-homogeneous φ, (B−1)/2 > α), else sphere.  For ε > 0 :func:`gradient_explosion_rate` delegates to
:func:`bnlab.theory.epsilon.epsilon_analysis`.

B = 3: E[r⁻²] = ∞ for r ~ χ_2, so the mean field backward map diverges (the
paper conjectures, from simulations, explosion similar to B = 4; App. J): a
``ValueError`` explains it.

Errata found while checking the printed formulas numerically
------------------------------------------------------------
(see ``tests/theory/test_backward.py`` for the checks)
* Thm 3.10 / Eq. 19 and Thm G.12 (α = 1) agree with the spherical integral
  to 1e-12 for 4 ≤ B ≤ 128.
* App. L states the weight-gradient norm as ⟨Π^l, μ*G⟩ = μ* tr Π^l; this holds
  for Π^l ∈ H_B^G, i.e. from the second backward step on (Π^L itself need not
  be G-projected).

References
----------
Yang et al. 2019, §3.1.2, Thms 3.9, 3.10, G.5, G.12, App. G.1.1, App. L.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bnlab._validation import check_int, check_real
from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._quadrature.sphere import SphereGrid, conditional_coefficients, ratio_stats, sample_sphere, sphere_grid_for
from bnlab.theory._routes import DYNAMICS_METHODS, Dynamics, check_finite_result, plan_route
from bnlab.theory.epsilon import _epsilon_analysis
from bnlab.theory.forward import _forward_moments_sphere
from bnlab.theory.gegenbauer import RULE_RTOL, _dynamics_series
from bnlab.theory.ultrasymmetric import projected_eigenvalues
from bnlab.theory.vphi import _homogeneous_kernel_values, _relu_arccos_kernel

__all__ = [
    "BackwardEigenvalues",
    "backward_eigenvalues",
    "gradient_explosion_rate",
    "weight_gradient_norms",
    "BACKWARD_METHODS",
]

BACKWARD_METHODS = DYNAMICS_METHODS


@dataclass(frozen=True)
class BackwardEigenvalues:
    """Eigenvalues of G^{⊗2}∘F(Σ*) on RG (``lambda_G`` = gradient explosion rate λ_G↓), L and M.

    ``lambda_L``/``lambda_M`` are None when the method does not give them
    (gegenbauer) or M is empty; ``stderr`` holds Monte Carlo standard errors
    of (λ_G, λ_L, λ_M); ``truncation_error`` (gegenbauer only, else None) bounds
    the absolute error of λ_G from truncating the series (the two-point tail; see
    :func:`bnlab.theory.gegenbauer.oscillating_tail_bound`).
    """

    lambda_G: float
    lambda_L: float | None
    lambda_M: float | None
    method: str
    stderr: tuple[float, float, float] | None = None
    truncation_error: float | None = None


def _require_b4(b: int):
    if b < 4:
        raise ValueError(
            f"batch_size={b} is not allowed for the backward dynamics: with B = 3, E[|Gh|⁻²] diverges "
            "(r ~ χ_2), so the mean field gradient covariance is infinite (Yang et al. 2019, App. J); "
            "use batch_size >= 4"
        )


def _check_derivative_integrable(act):
    hom = act.homogeneity
    if hom is not None and hom <= 0.5:
        raise ValueError(
            f"phi={act.spec!r} has a derivative of degree {hom - 1:g} that is not square integrable "
            "(Thm 3.9 needs φ'(√(B−1)x) ∈ L²): the gradient explosion rate is infinite; use a degree > 1/2"
        )


def _check_backward_preconditions(act, b: int):
    _require_b4(b)
    _check_derivative_integrable(act)


_BACKWARD = Dynamics("the backward eigenvalues", "Thms 3.10, G.12", check=_check_backward_preconditions,
                      montecarlo_batch_power=2)  # a B×B matrix per sample


# -- sphere -------------------------------------------------------------------
def _sphere_brackets(grid: SphereGrid, g1: np.ndarray, g2: np.ndarray) -> np.ndarray:
    """The eleven brackets of the backward map (App. G; order [11|11], [11|22], [11|12], [11|23], [12|11],
    [12|33], [12|12], [12|21], [12|13], [12|34], [12|31]) from g_1 = φ'(√B u_1) per run and
    g_2 = φ'(√B u_2) per node, with the projections P_ij = δ_ij − u_i u_j of Ã = P_u D G."""
    x = grid.x_distinct
    c1, c2 = conditional_coefficients(grid.batch_size)
    a0, a1, a2 = grid.power_sums(None, 2)
    s0, s1, s2, s3 = grid.power_sums(g2, 3)
    gg = g1 * g1
    ox = 1.0 - x * x
    return np.array([
        (gg * ox * ox) @ a0,  # g1² (1−x²)²
        (gg * x * x) @ a2,  # g1² x² y²
        -((g1 * ox * x) @ s1),  # −g1 g2 (1−x²) x y
        c1 * ((g1 * x) @ (ox * s1 - s3)),  # g1 g2 x y e33
        -((gg * ox * x) @ a1),  # −g1² (1−x²) x y
        -c1 * ((gg * x * x) @ (x * a1 + a2)),  # g1² x² y e3
        (g1 * ox) @ (s0 - s2),  # g1 g2 (1−x²)(1−y²)
        (g1 * x * x) @ s2,  # g1 g2 x² y²
        c1 * ((g1 * ox) @ (x * s1 + s2)),  # −g1 g2 (1−x²) y e3
        c2 * ((g1 * x) @ ((2.0 * x * x - 1.0) * s1 + 2.0 * x * s2 + 2.0 * s3)),  # g1 g2 x y e34
        -c1 * ((g1 * x * x) @ (x * s1 + s2)),  # g1 g2 x² y e3
    ])


def _backward_moments_sphere(act, b: int):
    """The eleven brackets of the backward map (App. G; [12|31] ≠ [12|13], see the ultrasymmetric errata)
    by :func:`_sphere_brackets`."""
    hom = act.homogeneity
    grid = sphere_grid_for(act, b, float(hom) - 1.0 if hom is not None else 0.0)  # split at kinks
    sb = math.sqrt(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        g1 = act.derivative(sb * grid.x_distinct)  # once per distinct u_1 (a run of the kink rule)
        g2 = act.derivative(sb * grid.y)
    return _sphere_brackets(grid, g1, g2)


def _mu_star_sphere(act, b: int) -> float:
    m = _forward_moments_sphere(act, b)
    return float(m[0] - m[1])


def _backward_sphere(act, b: int):
    k = b / ((b - 3.0) * _mu_star_sphere(act, b))
    return projected_eigenvalues(k * _backward_moments_sphere(act, b), b)


# -- Monte Carlo -----------------------------------------------------------------
def _backward_montecarlo(act, b: int, n_samples: int, rng, chunk: int | None = None):
    """Traces of X ↦ Ã X Ãᵀ (Ã = P_u D G) over RG, L, M per sample; ratio to E|Gφ(√B u)|²."""
    sums = {"G": [], "L": [], "M": [], "den": []}
    g_mat = np.eye(b) - 1.0 / b
    if chunk is None:
        chunk = max(16, 2_000_000 // (b * b))  # ≈ 16 MB per (chunk, B, B) array
    done = 0
    while done < n_samples:
        n = min(chunk, n_samples - done)
        u = sample_sphere(b, n, rng)
        d = act.derivative(math.sqrt(b) * u)
        f = act(math.sqrt(b) * u)
        gf = f - f.mean(axis=1, keepdims=True)
        p = g_mat[None] - u[:, :, None] * u[:, None, :]
        pd = p * d[:, None, :]
        at = pd - pd.mean(axis=2, keepdims=True)  # P D G: right-multiplying by G removes row means, O(B²)
        fro = np.einsum("nij,nij->n", at, at)
        tr = np.einsum("nii->n", at)
        tr2 = np.einsum("nij,nji->n", at, at)
        diag2 = np.einsum("nii->ni", at) ** 2
        t_h = 0.5 * (tr * tr + tr2)
        t_g = fro / (b - 1)
        t_l = (diag2.sum(axis=1) - fro / b) / (1.0 - 2.0 / b)
        sums["G"].append(t_g)
        sums["L"].append(t_l)
        sums["M"].append(t_h - t_g - t_l)
        sums["den"].append((gf * gf).sum(axis=1) / (b - 1))  # μ*
        done += n
    arr = {k: np.concatenate(v) for k, v in sums.items()}
    k = b / (b - 3.0)
    dims = {"G": 1.0, "L": b - 1.0, "M": b * (b - 3) / 2.0}
    out, err = [], []
    for s in ("G", "L", "M"):
        r, e = ratio_stats(k * arr[s] / dims[s], arr["den"])
        out.append(r)
        err.append(e)
    return out, tuple(err)


# -- closed forms ------------------------------------------------------------------
def _backward_closed(kind: str, b: int):
    if kind == "identity":
        lam_g = (b - 2.0) / (b - 3.0)
        lam = (b * b - 2.0 * b - 1.0) / (b * b - 2.0 * b - 3.0)
        return lam_g, lam, lam
    j1, dj1 = _relu_arccos_kernel(-1.0 / (b - 1))
    lam_g = ((b - 1.0 + dj1) / (1.0 - j1) - 1.0) / (b - 3.0)  # Thm 3.10, Eq. 19
    # Thm G.12 with α = 1, J_φ = J_1 (J_1(1) = 1)
    alpha = 1.0
    den = 1.0 - j1
    lam_l = (
        -2 * alpha**2 * (b - 2) * (b - 1 + alpha) / ((b - 3) * (b - 1) * (b - 1 + 2 * alpha))
        + 2
        * (alpha**2 * (3 * b - 4) + alpha * (3 * b * b - 11 * b + 8) + (b - 3) * (b - 1) ** 2)
        / ((b - 3) * (b - 1) ** 2 * (b - 1 + 2 * alpha))
        * dj1
        / den
        + alpha**2 * (b - 2) * (b - 3 + 2 * alpha) / ((2 * alpha - 1) * (b - 3) * (b - 1)) / den
    )
    lam_m = (
        b * (b * b + 2 * (alpha - 2) * b + 2 * (alpha - 3) * alpha + 3) / ((b - 3) * (b - 1) * (b - 1 + 2 * alpha)) * dj1 / den
    )
    return lam_g, lam_l, lam_m


def _backward_laplace(act, b: int):
    """Thm G.12 for φ positive-homogeneous of degree α > 1/2 (verified against the sphere to 1e-13)."""
    v = _homogeneous_kernel_values(act, b)
    al, j1, d = v["alpha"], v["J1"], v["J1"] - v["Jxi"]
    dj = v["dJxi"]
    lam_g = ((b - 3 + 2 * al) * ((2 * al - 1) * dj + al**2 * (b - 1) * j1)) / (
        (2 * al - 1) * (b - 3) * (b - 1) * d
    ) - al**2 / (b - 3)
    lam_l = (
        -2 * al**2 * (b - 2) * (b - 1 + al) / ((b - 3) * (b - 1) * (b - 1 + 2 * al))
        + 2 * (al**2 * (3 * b - 4) + al * (3 * b * b - 11 * b + 8) + (b - 3) * (b - 1) ** 2)
        / ((b - 3) * (b - 1) ** 2 * (b - 1 + 2 * al)) * dj / d
        + al**2 * (b - 2) * (b - 3 + 2 * al) / ((2 * al - 1) * (b - 3) * (b - 1)) * j1 / d
    )
    lam_m = b * (b * b + 2 * (al - 2) * b + 2 * (al - 3) * al + 3) / ((b - 3) * (b - 1) * (b - 1 + 2 * al)) * dj / d
    return lam_g, lam_l, lam_m


# -- Gegenbauer ----------------------------------------------------------------------
def _gradient_rate_gegenbauer(act, b: int, n_terms: int) -> tuple[float, float]:
    """Thm 3.9 / G.5: λ_G↓ = Σ_l ε_l/(B−3) b_l² (1 − R_l(ξ)) / Σ_l b_l² (1 − R_l(ξ)),
    ε_l = l(l+B−3), ξ = −1/(B−1) (a_l² N_l = b_l², N_l(1 − P_l(ξ)) in the paper's normalization).

    Returns (λ_G↓, bound on its truncation error).  The single-point parts are summed exactly
    (:class:`bnlab.theory.gegenbauer._GegenbauerSeries`): Σ_l b_l² = E f² (Parseval) and
    Σ_l ε_l b_l² = E(1−x²)f'² (ε_l are the eigenvalues of −Δ on S^{B−2} and f(u_1) is zonal, so
    this is the Dirichlet energy E|∇_S f|²), which leaves only the two-point sums with R_l(ξ).
    Without this, φ' with a jump (relu) gives ε_l b_l² ~ l^{−2} and a truncation error ~ 1/n.
    """
    s = _dynamics_series(act, b, n_terms, dirichlet=True)
    l = np.arange(n_terms, dtype=np.float64)
    e2 = s.coef * s.coef
    eps2 = l * (l + b - 3.0) * e2
    den = s.single_point(np.sum(e2), s.moments.second) - float(np.sum(e2 * s.pxi))
    num = s.single_point(np.sum(eps2), s.moments.dirichlet) - float(np.sum(eps2 * s.pxi))
    lam = num / ((b - 3.0) * den)
    # neglected: Σ_{l≥n} b_l² R_l(ξ) and Σ_{l≥n} ε_l b_l² R_l(ξ), bounded by max|R_l(ξ)| × the tails
    d_den = s.two_point_bound(s.parseval_tail)
    d_num = s.two_point_bound(max(s.moments.dirichlet - float(np.sum(eps2)), 0.0))
    err = (d_num / ((b - 3.0) * den) + abs(lam) * d_den / den) if s.summed else 0.0
    return float(lam), float(err + RULE_RTOL * abs(lam))


# -- public ---------------------------------------------------------------------------
def backward_eigenvalues(
    phi, batch_size: int, *, method: str = "auto", n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> BackwardEigenvalues:
    """Eigenvalues λ_G↓ (gradient explosion rate), λ_L↓, λ_M↓ of the backward dynamics at the BSB1 fixed point.

    Parameters
    ----------
    phi, method, n_terms, n_samples, seed :
        As in :func:`bnlab.theory.forward_eigenvalues` (the three dynamics share one prologue).
    batch_size : int
        B ≥ 4 (B = 3: the mean field backward map diverges, ``ValueError``).

    Returns
    -------
    BackwardEigenvalues

    Accuracy
    --------
    closed: rounding; sphere: ≈1e-10 relative (but only algebraic in the radial
    rule for non-homogeneous φ with a kink, e.g. selu: 1e-4 at B = 32);
    gegenbauer: ≈1e-12 (smooth φ); relu-like φ (relu, leaky relu, abs, relu^α with
    α > ½) with the default terms (1000 for B ≤ 5, else 400), measured vs Thms
    3.10/G.12: ≤ 2e-8 (B = 4), ≤ 2e-10 (B = 5), ≤ 3e-11 (B = 8), ≤ 1e-15
    (32 ≤ B ≤ 1024), because Σ b_l² and
    Σ l(l+B−3) b_l² are summed exactly (Parseval, Dirichlet energy; see
    :func:`_gradient_rate_gegenbauer`) and only the R_l(ξ)-weighted tail is
    truncated; ``truncation_error`` bounds it.  montecarlo: the returned standard errors.

    References
    ----------
    Yang et al. 2019, Thms 3.9, 3.10, G.5, G.12, App. G.1.1.
    """
    act, b = get_activation(phi), check_batch_size(batch_size)
    return _backward_eigenvalues(act, b, method, n_terms=n_terms, n_samples=n_samples, seed=seed)


def _backward_eigenvalues(
    act, b: int, method: str = "auto", *, n_terms: int | None = None, n_samples: int = 200_000, seed=0
) -> BackwardEigenvalues:
    """The kernel of :func:`backward_eigenvalues`: φ resolved and B checked; the route chosen and run."""
    r = plan_route(act, b, method, _BACKWARD, n_terms=n_terms, n_samples=n_samples, seed=seed)
    method = r.method
    stderr = trunc = None
    if method == "closed":
        lam_g, lam_l, lam_m = _backward_closed(r.relu_or_identity, b)
    elif method == "laplace":
        lam_g, lam_l, lam_m = _backward_laplace(act, b)
    elif method == "sphere":
        ev = _backward_sphere(act, b)
        lam_g, lam_l, lam_m = ev.lambda_G, ev.lambda_L, ev.lambda_M
    elif method == "gegenbauer":
        lam_g, trunc = _gradient_rate_gegenbauer(act, b, r.n_terms)
        lam_l, lam_m = None, None
    else:
        (lam_g, lam_l, lam_m), stderr = _backward_montecarlo(act, b, r.n_samples, r.rng)
    check_finite_result(act, b, method, lam_g, lam_l, lam_m)
    f = lambda v: None if v is None else float(v)  # noqa: E731
    return BackwardEigenvalues(float(lam_g), f(lam_l), f(lam_m), method, stderr, trunc)


def gradient_explosion_rate(
    phi, batch_size: int, *, eps: float = 0.0, sigma_w2: float = 1.0, method: str = "auto"
) -> float:
    """The gradient explosion rate λ_G↓: E|∇_{h^l} L|² grows as λ_G↓^{L−l} (Yang et al. 2019, Thm 3.9).

    Parameters
    ----------
    phi, batch_size, method :
        As in :func:`backward_eigenvalues`.
    eps : float
        Batchnorm ε ≥ 0.  For ε > 0 the fixed point and rate depend on σ_w²
        and the computation is delegated to
        :func:`bnlab.theory.epsilon.epsilon_analysis` (§3.1.2 "Effect of ε").
    sigma_w2 : float
        Weight variance σ_w² > 0 (irrelevant when ε = 0: batchnorm is scale invariant).

    Returns
    -------
    float
        λ_G↓ > 1 for every non-constant φ with a BSB1 fixed point (Thm 3.9);
        relu: decreases to π/(π−1) ≈ 1.467 (Thm 3.10); identity: (B−2)/(B−3).
    """
    eps = check_real("eps", eps, minimum=0.0)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    act, b = get_activation(phi), check_batch_size(batch_size)
    if eps > 0.0:
        return float(_epsilon_analysis(act, b, eps, sigma_w2).grad_explosion_rate)
    return _backward_eigenvalues(act, b, method).lambda_G


def weight_gradient_norms(phi, batch_size: int, depth: int, *, method: str = "auto") -> np.ndarray:
    """Predicted per-layer weight-gradient second moments relative to the last layer (Yang et al. 2019, App. L).

    Definition: for a depth-``depth`` network at the BSB1 fixed point,
    E[(∂L/∂W^l_{αβ})²] = ⟨Π^l, Σ*⟩ = μ* tr Π^l (App. L), and since the trace
    of Π only sees its RG component, which G^{⊗2}∘F multiplies by λ_G↓,
    tr Π^l = λ_G↓^{depth−l} tr Π^{depth} once Π is G-projected (from the
    second-to-last layer on).  Returns the array
    ``r[l−1] = E(∂L/∂W^l)² / E(∂L/∂W^depth)² = λ_G↓^{depth−l}`` for
    l = 1, …, depth (so r[-1] = 1 and r[0] = λ_G↓^{depth−1}), assuming
    Π^{depth} ∈ H_B^G.

    Returns
    -------
    numpy.ndarray of shape (depth,), float64 (overflows to inf only beyond ~1e308).
    """
    d = check_int("depth", depth, minimum=1)
    rate = gradient_explosion_rate(phi, batch_size, method=method)
    return np.power(rate, np.arange(d - 1, -1, -1, dtype=np.float64))
