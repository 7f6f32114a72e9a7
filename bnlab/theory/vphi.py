"""The coordinatewise Gaussian kernel V_φ(Σ) = E[φ(h)φ(h)ᵀ], h ~ N(0, Σ).

Yang et al. 2019, Defn 3.1.  Two routes:

``"closed"``
    * positive-homogeneous φ of degree α > 0, φ(x) = a ρ_α(x) − b ρ_α(−x)
      (relu, identity, leaky relu, abs, α-relu; Yang et al. 2019 Prop. E.17,
      Cor. E.19, Defn E.20): V_φ(Σ)_ij = (Σ_ii Σ_jj)^{α/2} k_φ(c_ij), with
      c_ij = Σ_ij / √(Σ_ii Σ_jj) and k_φ(c) = (a² + b²) k_α(c) − 2ab k_α(−c),
      k_α(c) = E[ρ_α(x) ρ_α(y)] for unit-variance Gaussians of correlation c
      (= c_α J_α(c) in the paper's notation).  k_α is evaluated for every
      real α > 0 from the series of the bivariate normal density, summed in
      closed form by Gauss hypergeometric functions after Euler's
      transformation:

          k_α(c) = 2^{α−2}/π · [Γ((α+1)/2)² ₂F₁(−α/2, −α/2; 1/2; c²)
                                + 2c Γ(α/2+1)² ₂F₁((1−α)/2, (1−α)/2; 3/2; c²)],

      which is regular on the whole of [−1, 1] (no (1 − c²) prefactor, so no
      cancellation near |c| = 1).  For α = 1 it reduces to the arccosine
      kernel of Cho & Saul (2009), J_1(c) = (√(1−c²) + (π − arccos c)c)/π.
    * erf (Williams 1997): E[erf(γx) erf(γy)] = (2/π) arcsin(2γ²Σ_ij /
      √((1 + 2γ²Σ_ii)(1 + 2γ²Σ_jj))).
    * identity: V_φ(Σ) = γ²Σ exactly.
    Accuracy: a few ulp for identity/erf; ≲ 1e-14 relative for the
    homogeneous family (scipy's ``hyp2f1``), checked against J_1, J_2 of
    Prop. E.10 and against the quadrature route in the tests.

``"quadrature"``
    Any φ.  For each pair (i, j) the 2-D Gaussian integral is written in polar
    coordinates of the whitened variables, (h_i, h_j) = L (r cos θ, r sin θ)
    with L the 2 × 2 Cholesky factor; the θ-circle is split at the four
    angles where h_i = 0 or h_j = 0 (so a kink of φ at 0 — relu, α-relu,
    abs — lies on a panel boundary) and every panel, and the radial integral
    on [0, 10] (the omitted Gaussian tail is < e^{−50}), uses the tanh-sinh
    rule, which converges exponentially even with algebraic endpoint
    singularities (α-relu with α < 1).  Accuracy: ≲ 1e-12 relative for φ
    analytic away from 0 and growing at most polynomially (measured in the
    tests on relu, α-relu(0.5), tanh, sin, gelu against closed forms and
    against a higher quadrature level).  Kinks of φ away from 0 (e.g. relu
    with β ≠ 0) and fast-growing φ are integrated with algebraic accuracy
    only.  Cost: ≈ 4·10⁴ evaluations of φ per pair, vectorized in chunks.

``"auto"``: ``"closed"`` when a closed form exists, else ``"quadrature"``.

Zero-variance coordinates are allowed: h_i = 0 almost surely, so the entries
are φ(0)φ(h_j) averaged over h_j.

Errata found in the paper while implementing this module
-------------------------------------------------------
* Prop. E.23 states J'_φ(c) = (2α+1)(1−c²)^{-1}((a²+b²)J_{α+1}(c) + 2abJ_{α+1}(−c)) − cJ_φ(c);
  from Prop. E.16 the last term must also be divided by (1 − c²) and
  multiplied by (2α+1): J'_φ(c) = (2α+1)(1−c²)^{-1}[(a²+b²)J_{α+1}(c) + 2abJ_{α+1}(−c) − cJ_φ(c)].
  (Not used here; recorded for the dynamics code.)
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special

from bnlab._validation import check_choice, check_psd_matrix
from bnlab.activations import Activation, get_activation
from bnlab.theory._quadrature.rules import tanh_sinh_panel, tanh_sinh_unit

__all__ = ["gaussian_kernel", "KERNEL_METHODS", "has_closed_form", "homogeneous_kernel"]

KERNEL_METHODS = ("auto", "closed", "quadrature")

_RADIAL_CUTOFF = 10.0


def has_closed_form(phi: Activation) -> bool:
    """Whether :func:`gaussian_kernel` has a closed form for ``phi``."""
    return _kernel_closed_form(phi) is not None


def _kernel_closed_form(phi: Activation) -> str | None:
    """Which closed form of the Gaussian kernel V_φ applies: 'identity', 'erf', 'homogeneous' or None."""
    if phi.beta != 0.0:
        return None
    if phi.name == "identity":
        return "identity"
    if phi.name == "erf":
        return "erf"
    if phi.homogeneity is not None and phi.homogeneous_coeffs is not None and phi.homogeneity > 0:
        return "homogeneous"
    return None


# ---------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------
def alpha_relu_kernel(alpha: float, c):
    """k_α(c) = E[ρ_α(x)ρ_α(y)], (x, y) standard bivariate normal with correlation c (= c_α J_α(c))."""
    return alpha_kernel_hypergeometric(alpha, np.clip(np.asarray(c, dtype=np.float64), -1.0, 1.0))


def alpha_kernel_hypergeometric(alpha: float, c):
    """The two-₂F₁ form of k_α(c), evaluated as given: real c ∈ [−1, 1], or complex c off
    (−∞, −1] ∪ [1, ∞) (principal branches: its analytic continuation, used by :mod:`.fourier`)."""
    z = c * c
    g0 = math.exp(2.0 * special.gammaln(0.5 * (alpha + 1.0)))
    g1 = math.exp(2.0 * special.gammaln(0.5 * alpha + 1.0))
    f0 = special.hyp2f1(-0.5 * alpha, -0.5 * alpha, 0.5, z)
    f1 = special.hyp2f1(0.5 * (1.0 - alpha), 0.5 * (1.0 - alpha), 1.5, z)
    return 2.0 ** (alpha - 2.0) / math.pi * (g0 * f0 + 2.0 * c * g1 * f1)


def alpha_relu_second_moment(alpha: float) -> float:
    """c_α = E[ρ_α(x)²] = 2^{α−1} Γ(α + 1/2)/√π, x ~ N(0, 1) (Yang et al. 2019, Defn E.7)."""
    return math.exp((alpha - 1.0) * math.log(2.0) + special.gammaln(alpha + 0.5) - 0.5 * math.log(math.pi))


def _relu_arccos_kernel(c: float) -> tuple[float, float]:
    """J_1(c) = (√(1−c²) + (π − arccos c) c)/π and J_1'(c) = (π − arccos c)/π (Cho & Saul 2009),
    as 2 k_1(c) and 2 k_0(c) with k_α = :func:`alpha_relu_kernel` (c_1 = 1/2; Price: k_1' = k_0).
    Agrees with the elementary form to 2e-16 at c = −1/(B−1).  The kernel of the closed forms of the
    dynamics for relu (Yang et al. 2019, Thms 3.7, 3.10, 3.11)."""
    return 2.0 * float(alpha_relu_kernel(1.0, c)), 2.0 * float(alpha_relu_kernel(0.0, c))


def homogeneous_kernel(phi: Activation, c):
    """k_φ(c) = E[φ(x)φ(y)] for unit-variance Gaussians of correlation c, φ positive-homogeneous.

    k_φ(c) = (a² + b²) k_α(c) − 2ab k_α(−c) = c_α J_φ(c) (Yang et al. 2019, Defn E.20).
    """
    alpha = float(phi.homogeneity)
    a, b = phi.homogeneous_coeffs
    c = np.asarray(c, dtype=np.float64)
    return (a * a + b * b) * alpha_relu_kernel(alpha, c) - 2.0 * a * b * alpha_relu_kernel(alpha, -c)


# ---------------------------------------------------------------------------
# what the closed forms of the fixed point and the dynamics need of a positive-homogeneous φ
# ---------------------------------------------------------------------------
def _k_alpha_b(alpha: float, b: int) -> float:
    """K_{α,B} = c_α Γ((B−1)/2)/Γ((B−1)/2 + α) ((B−1)/2)^α (Yang et al. 2019, Defn F.6)."""
    h = 0.5 * (b - 1)
    # log Γ(h+α) − log Γ(h) for large h without cancellation: poch is exact-ratio based
    ratio = special.poch(h, alpha)
    return alpha_relu_second_moment(alpha) * math.exp(alpha * math.log(h) - math.log(ratio))


def _homogeneous_fixed_point(act: Activation, b: int) -> tuple[float, float]:
    """(q*, q*c*) of the BSB1 fixed point for positive-homogeneous φ of degree α (Yang et al. 2019, Thm F.8):
    q* = K_{α,B} J_φ(1), q*c* = K_{α,B} J_φ(−1/(B−1)), evaluated as (K_{α,B}/c_α)·k_φ(c) with k_φ = c_α J_φ."""
    alpha = float(act.homogeneity)
    k = _k_alpha_b(alpha, b) / alpha_relu_second_moment(alpha)
    return k * float(homogeneous_kernel(act, 1.0)), k * float(homogeneous_kernel(act, -1.0 / (b - 1)))


def _homogeneous_kernel_values(act, b: int) -> dict:
    """c_α, J_φ(1), J_φ(ξ), J'_φ(ξ), J'_φ(0) (ξ = −1/(B−1)) and μ* for φ = aρ_α − bρ_α(−·): what the Laplace
    closed forms of the dynamics need (Thms F.33, G.12, H.14).

    c_α J_φ(c) = k_φ(c) = E φ(x)φ(y) for unit Gaussians of correlation c (Defn E.7, E.9,
    :func:`bnlab.theory.vphi.homogeneous_kernel`, hypergeometric closed form), and by Price's
    theorem k_φ'(c) = α²((a²+b²) k_{α−1}(c) + 2ab k_{α−1}(−c)) (valid for |c| < 1, α > 0).
    μ* = q*(1 − c*) from the closed BSB1 fixed point (Thm F.8, :func:`_homogeneous_fixed_point`).
    """
    al = float(act.homogeneity)
    a, bb = act.homogeneous_coeffs
    ca = alpha_relu_second_moment(al)
    xi = -1.0 / (b - 1)

    def dk(c):
        return al * al * ((a * a + bb * bb) * alpha_relu_kernel(al - 1.0, c) + 2 * a * bb * alpha_relu_kernel(al - 1.0, -c))

    q, qc = _homogeneous_fixed_point(act, b)
    c = qc / q if q != 0 else float("nan")
    return dict(
        alpha=al, c_alpha=ca, J1=float(homogeneous_kernel(act, 1.0)) / ca, Jxi=float(homogeneous_kernel(act, xi)) / ca,
        dJxi=float(dk(xi)) / ca, dJ0=float(dk(0.0)) / ca, mu=q * (1.0 - c),
    )


def _closed(phi: Activation, sigma: np.ndarray, kind: str) -> np.ndarray:
    if kind == "identity":
        return phi.gamma**2 * sigma
    d = np.diag(sigma).copy()
    if kind == "erf":
        g2 = phi.gamma**2
        s = 1.0 + 2.0 * g2 * d
        arg = 2.0 * g2 * sigma / np.sqrt(np.outer(s, s))
        return (2.0 / math.pi) * np.arcsin(np.clip(arg, -1.0, 1.0))
    alpha = float(phi.homogeneity)
    pos = d > 0
    sd = np.sqrt(np.where(pos, d, 1.0))
    corr = sigma / np.outer(sd, sd)
    corr = np.clip(corr, -1.0, 1.0)
    np.fill_diagonal(corr, 1.0)
    scale = np.outer(np.where(pos, d, 0.0) ** (0.5 * alpha), np.where(pos, d, 0.0) ** (0.5 * alpha))
    return scale * homogeneous_kernel(phi, corr)


# ---------------------------------------------------------------------------
# quadrature
# ---------------------------------------------------------------------------
def _pair_quadrature(phi: Activation, s11, s12, s22, level: int = 4) -> np.ndarray:
    """E[φ(x)φ(y)] for (x, y) ~ N(0, [[s11, s12], [s12, s22]]), vectorized over pairs."""
    s11 = np.asarray(s11, dtype=np.float64)
    s12 = np.asarray(s12, dtype=np.float64)
    s22 = np.asarray(s22, dtype=np.float64)
    l11 = np.sqrt(np.clip(s11, 0.0, None))
    l21 = np.where(l11 > 0, s12 / np.where(l11 > 0, l11, 1.0), 0.0)
    l22 = np.sqrt(np.clip(s22 - l21 * l21, 0.0, None))
    # kink angles: cos θ = 0 and l21 cos θ + l22 sin θ = 0
    t1 = np.full_like(l11, 0.5 * math.pi)
    t2 = np.mod(np.arctan2(-l21, l22), math.pi)  # in [0, π)
    cuts = np.sort(np.stack([np.zeros_like(t1), t1, t2, t1 + math.pi, t2 + math.pi], axis=-1), axis=-1)
    cuts = np.concatenate([cuts, np.full_like(t1, 2.0 * math.pi)[..., None]], axis=-1)
    theta, wtheta = tanh_sinh_panel(cuts[..., :-1], cuts[..., 1:], level)  # (P, 5, n)
    theta = theta.reshape(theta.shape[0], -1)
    wtheta = wtheta.reshape(wtheta.shape[0], -1)
    r, wr = tanh_sinh_panel(0.0, _RADIAL_CUTOFF, level)
    wr = wr * r * np.exp(-0.5 * r * r)
    ct, st = np.cos(theta), np.sin(theta)
    ux = l11[:, None] * ct  # (P, nθ)
    uy = l21[:, None] * ct + l22[:, None] * st
    fx = phi(ux[:, :, None] * r)  # (P, nθ, nr)
    fy = phi(uy[:, :, None] * r)
    inner = np.einsum("ptr,r->pt", fx * fy, wr)
    return np.einsum("pt,pt->p", inner, wtheta) / (2.0 * math.pi)


def _quadrature(phi: Activation, sigma: np.ndarray, level: int = 4) -> np.ndarray:
    b = sigma.shape[0]
    iu, ju = np.triu_indices(b)
    out = np.empty(iu.size)
    n_nodes = 5 * len(tanh_sinh_unit(level)[0]) ** 2
    chunk = max(1, int(4e6 // n_nodes))
    for start in range(0, iu.size, chunk):
        sl = slice(start, start + chunk)
        i, j = iu[sl], ju[sl]
        out[sl] = _pair_quadrature(phi, sigma[i, i], sigma[i, j], sigma[j, j], level)
    res = np.empty((b, b))
    res[iu, ju] = out
    res[ju, iu] = out
    return res


def gaussian_kernel(phi, Sigma, *, method: str = "auto") -> np.ndarray:
    """V_φ(Σ) = E[φ(h)φ(h)ᵀ], h ~ N(0, Σ), φ applied coordinatewise.

    Parameters
    ----------
    phi : str, Activation or callable
        The nonlinearity (anything :func:`bnlab.activations.get_activation` accepts).
    Sigma : (B, B) array_like
        Symmetric positive semi-definite covariance; singular and zero-variance
        entries are allowed.
    method : {"auto", "closed", "quadrature"}
        See the module docstring.  ``"closed"`` raises ``ValueError`` when φ has
        no closed form.

    Returns
    -------
    ndarray, shape (B, B)
        V_φ(Σ), symmetric PSD, float64.

    Accuracy
    --------
    closed: ≲ 1e-14 relative; quadrature: ≲ 1e-12 relative for φ analytic away
    from 0 with polynomial growth (see module docstring).

    References
    ----------
    Yang et al. 2019, Defn 3.1, Prop. E.10, Cor. E.19; Cho & Saul 2009; Williams 1997.
    """
    method = check_choice("method", method, KERNEL_METHODS)
    act = get_activation(phi)
    sigma = check_psd_matrix("Sigma", Sigma)
    kind = _kernel_closed_form(act)
    if method == "closed" and kind is None:
        raise ValueError(
            f"method='closed' is not allowed for phi={act.spec!r}: V_phi has a closed form only for "
            "positive-homogeneous phi (relu, alpha_relu, leaky_relu, abs, identity) and erf (with beta=0); "
            "use method='quadrature' or 'auto'"
        )
    if method == "quadrature" or (method == "auto" and kind is None):
        return _quadrature(act, sigma)
    return _closed(act, sigma, kind)
