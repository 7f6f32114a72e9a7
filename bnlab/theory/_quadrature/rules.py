"""One-dimensional quadrature rules and weights of the theory (private; the floor of :mod:`bnlab.theory`).

Nothing here knows φ or imports anything from :mod:`bnlab.theory`: these are tables of nodes and weights
(universal constants, or functions of B alone) that the routes above integrate their φ against.

* tanh-sinh (double-exponential) rules on (0, 1) and on panels [a, b]: on a panel whose integrand is
  analytic inside (kinks and algebraic endpoint singularities allowed at the panel ends) the error decays
  like exp(−c/h), so halving h roughly squares it and the difference of two levels is a (conservative)
  error estimate;
* Gauss–Legendre and Gauss–Jacobi rules on (0, 1);
* the angular weight sin^k θ of one coordinate of the batchnorm sphere (Yang et al. 2019, Thm F.5),
  normalized on its own rule;
* radial rules: the scale s(u) of ε > 0 averaged over u ~ Gamma((B−1)/2) (Eq. 7), the χ²_{B−1} law of
  ‖g‖² (§3.1.2 "Effect of ε"), and the moments E[T^p] of T ~ Beta(1, (B−3)/2) and E[r^{−p}] of r ~ χ_{B−1}.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

__all__ = [
    "tanh_sinh_rule",
    "tanh_sinh_unit",
    "tanh_sinh_panel",
    "gauss_legendre_unit",
    "jacobi_rule_unit",
    "log_sin",
    "sin_power_weight",
    "sin_power_panels",
    "eps_scale_rule",
    "chi2_log_rule",
    "beta_moment",
    "chi_inverse_moment",
]


# ---------------------------------------------------------------------------
# tanh-sinh
# ---------------------------------------------------------------------------
def tanh_sinh_rule(h: float, half_width: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tanh–sinh rule on (0, 1) with step ``h`` over |kh| ≤ ``half_width``: (t, 1 − t, weights), read-only."""
    n = int(math.ceil(half_width / h))
    k = np.arange(-n, n + 1) * h
    u = 0.5 * math.pi * np.sinh(k)
    t = 1.0 / (1.0 + np.exp(-2.0 * u))
    one_minus_t = 1.0 / (1.0 + np.exp(2.0 * u))
    w = h * 0.5 * math.pi * np.cosh(k) / np.cosh(u) ** 2 * 0.5
    keep = (w > 1e-300) & (t > 0) & (one_minus_t > 0)
    out = (t[keep], one_minus_t[keep], w[keep])
    for a in out:
        a.setflags(write=False)
    return out


@lru_cache(maxsize=32)
def tanh_sinh_unit(level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nodes on (0, 1) as (t, 1 − t) pairs and weights, step h = 2^{-level}.

    Node t_k = 1/(1 + exp(−π sinh(kh))) is x_k = tanh(π/2 sinh(kh)) mapped to (0, 1);
    1 − t_k is computed separately so that distances to both ends are exact.
    The range |kh| ≤ 3.2 makes the omitted weights < 1e-20.
    """
    return tanh_sinh_rule(2.0**-level, 3.2)


def tanh_sinh_panel(a, b, level: int):
    """Nodes and weights of the tanh-sinh rule on [a, b] (a, b broadcastable arrays).

    Returns (x, w) with a trailing node axis: x = a + (b − a) t.
    """
    t, s, w = tanh_sinh_unit(level)
    a = np.asarray(a, dtype=np.float64)[..., None]
    b = np.asarray(b, dtype=np.float64)[..., None]
    length = b - a
    # near the right end use b − (b−a)(1−t) to keep precision there
    x = np.where(t < 0.5, a + length * t, b - length * s)
    return x, length * w


# ---------------------------------------------------------------------------
# Gauss rules on (0, 1)
# ---------------------------------------------------------------------------
@lru_cache(maxsize=16)
def gauss_legendre_unit(n: int):
    """Gauss–Legendre on (0, 1) as (t, 1 − t, weights), t increasing; 1 − t from the nodes' own complement."""
    z, wz = special.roots_legendre(n)
    out = (0.5 * (1.0 + z), 0.5 * (1.0 - z), 0.5 * wz)
    for arr in out:
        arr.setflags(write=False)
    return out


def jacobi_rule_unit(n: int, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Jacobi rule on [0, 1] for the *normalized* weight ∝ (1−x)^a x^b (Golub–Welsch)."""
    k = np.arange(n, dtype=np.float64)
    s = 2.0 * k + a + b
    with np.errstate(invalid="ignore", divide="ignore"):
        alpha = np.where(s * (s + 2.0) != 0, (b * b - a * a) / (s * (s + 2.0)), (b - a) / (a + b + 2.0))
    alpha[0] = (b - a) / (a + b + 2.0)
    kk = np.arange(1, n, dtype=np.float64)
    ss = 2.0 * kk + a + b
    with np.errstate(invalid="ignore", divide="ignore"):
        beta = 4.0 * kk * (kk + a) * (kk + b) * (kk + a + b) / (ss * ss * (ss + 1.0) * (ss - 1.0))
    beta[0] = 4.0 * (1.0 + a) * (1.0 + b) / ((2.0 + a + b) ** 2 * (3.0 + a + b))
    # map y ∈ [−1, 1] to x = (1 + y)/2: diagonal (1 + α)/2, off-diagonal √β/2
    from scipy.linalg import eigh_tridiagonal  # here: only the Fourier routes need it, and it is slow to import

    nodes, vecs = eigh_tridiagonal((1.0 + alpha) / 2.0, np.sqrt(beta) / 2.0)
    w = vecs[0] ** 2
    return np.clip(nodes, 0.0, 1.0), w / w.sum()


# ---------------------------------------------------------------------------
# the angular weight sin^k θ
# ---------------------------------------------------------------------------
def log_sin(theta):
    """log sin θ on [0, π], accurate near θ = π/2 (where the weights of large B concentrate)."""
    theta = np.asarray(theta, dtype=np.float64)
    delta = 0.5 * math.pi - theta
    near = np.abs(delta) < 0.5
    with np.errstate(divide="ignore"):
        far_val = np.log(np.sin(np.where(near, 1.0, theta)))
    near_val = np.log1p(-2.0 * np.sin(0.5 * np.where(near, delta, 0.0)) ** 2)
    return np.where(near, near_val, far_val)


def sin_power_weight(theta, power: float, quad_w):
    """Quadrature weights times sin^k θ, normalized so that they sum to 1 along the last axes.

    Normalizing with the same rule (instead of by Z = √π Γ((k+1)/2)/Γ(k/2+1))
    avoids the cancellation of two log-gammas of size ~k log k for large B and
    cancels the quadrature error of the weight itself.
    """
    if power == 0:
        w = np.asarray(quad_w, dtype=np.float64)
    else:
        lw = power * log_sin(theta)
        lw = np.where(np.isfinite(lw), lw, -np.inf)
        lw = lw - np.max(lw, axis=-1, keepdims=True)
        w = quad_w * np.exp(lw)
    return w / np.sum(w, axis=-1, keepdims=True)


def sin_power_panels(ends, power: float, level: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes θ of the tanh-sinh rule (``level``) on the panels between consecutive ``ends`` and their weights
    times sin^power θ, normalized to sum 1 (:func:`sin_power_weight`): the rule for one angle of the sphere,
    cut where the integrand has kinks."""
    ends = np.asarray(ends, dtype=np.float64)
    theta, w = tanh_sinh_panel(ends[:-1], ends[1:], level)
    theta, w = theta.ravel(), w.ravel()
    return theta, sin_power_weight(theta, power, w)


# ---------------------------------------------------------------------------
# radial rules and moments
# ---------------------------------------------------------------------------
def eps_scale_rule(batch_size: int, mu: float, eps: float):
    """Nodes s(u) and weights of E_u[f(s(u))], u ~ Gamma((B−1)/2, 1), s(u) = √(2uμ/(2uμ + Bε)).

    The scale by which ε > 0 multiplies batchnorm's output (Yang et al. 2019, Eq. 7) at GΣG = μG.
    Trapezoid rule in y = log u: the integrand u^k e^{−u} f(s(u)) is analytic
    in the strip |Im y| < π/2 whatever ε (the pole of s at u = −Bε/(2μ) sits
    at Im y = π), so the rule converges exponentially, e^{−2π(π/2)/h}, even
    for tiny ε (a Gauss–Laguerre rule in u converges only as fast as
    −Bε/(2μ) is far from 0).  Step h = min(1/4, 1/(2√k)) resolves the peak of
    width 1/√k for large B; nodes with weight < 1e-20 of the largest are
    dropped; weights are normalized by their sum.  Accuracy ≲ 1e-14.
    ε = 0: the single node s = 1.
    """
    if eps == 0.0:
        return np.ones(1), np.ones(1)
    k = 0.5 * (batch_size - 1)
    h = min(0.25, 0.5 / math.sqrt(k))
    y_mode = math.log(k)
    y_lo = y_mode - max(50.0 / k, 14.0 / math.sqrt(k))
    y_hi = math.log(k + 14.0 * math.sqrt(k) + 50.0)
    y = np.arange(y_lo, y_hi + h, h)
    logw = k * y - np.exp(y)
    logw -= logw.max()
    keep = logw > math.log(1e-20)
    u = np.exp(y[keep])
    w = np.exp(logw[keep])
    w /= w.sum()
    s = np.sqrt(2.0 * u * mu / (2.0 * u * mu + batch_size * eps))
    return s, w


@lru_cache(maxsize=64)
def chi2_log_rule(dof: int):
    """Nodes Q and weights for E_{Q~χ²_dof} g(Q): trapezoid rule in x = log Q.

    The density of log Q, exp((dof/2) x − e^x/2 − log(2^{dof/2} Γ(dof/2))), is entire
    and decays doubly exponentially, so the trapezoid rule converges geometrically;
    the step min(0.25, 0.5/√dof) keeps the error below 1e−12 for integrands
    analytic in the strip |Im x| < π/2 (see :mod:`bnlab.theory.epsilon`).
    """
    # the χ² quantiles at 1e-18 (scipy.stats.chi2.ppf/isf are these; scipy.stats itself is slow to import)
    lo = 2.0 * special.gammaincinv(0.5 * dof, 1e-18)
    hi = 2.0 * special.gammainccinv(0.5 * dof, 1e-18)
    x_lo, x_hi = math.log(lo), math.log(hi)
    step = min(0.25, 0.5 / math.sqrt(dof))
    n = int(math.ceil((x_hi - x_lo) / step)) + 1
    x = np.linspace(x_lo, x_hi, n)
    h = x[1] - x[0]
    logq = (dof / 2.0) * x - np.exp(x) / 2.0 - (dof / 2.0) * math.log(2.0) - special.gammaln(dof / 2.0)
    wts = h * np.exp(logq)
    keep = wts > 1e-17 * wts.max()  # nodes that cannot change a double-precision sum
    wts = wts[keep] / wts[keep].sum()  # removes the 1e−18 truncation bias
    q = np.exp(x[keep])
    q.setflags(write=False)
    wts.setflags(write=False)
    return q, wts


def beta_moment(batch_size: int, p: float) -> float:
    """E[T^p] for T ~ Beta(1, (B−3)/2) (T ≡ 1 for B = 3): Γ(1+p)Γ(1+b)/Γ(1+p+b), b = (B−3)/2.

    T is the squared radius of the projection of a uniform point of S^{B−2} onto a 2-plane."""
    b = (batch_size - 3) / 2.0
    return math.exp(special.gammaln(1 + p) + special.gammaln(1 + b) - special.gammaln(1 + p + b))


def chi_inverse_moment(batch_size: int, power: float) -> float:
    """E[r^{−p}] for r ~ χ_{B−1}: 2^{−p/2} Γ((n−p)/2)/Γ(n/2), n = B − 1 (inf when p ≥ n)."""
    n = batch_size - 1
    if power >= n:
        return math.inf
    # Γ-ratios via the Pochhammer symbol: differences of log-gammas lose ~1e-10 at B ~ 1e5
    return 2.0 ** (-0.5 * power) / special.poch((n - power) / 2.0, power / 2.0)
