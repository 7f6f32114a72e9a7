r"""Batch symmetry breaking: BSB1 versus BSB2 fixed points (Yang et al. 2019, §3.1, Fig. 1c,d, Apps. F.3, J, K).

Stability of the BSB1 fixed point
---------------------------------
The BSB1 fixed point Σ* of Σ ↦ V_{B_φ}(Σ) (ε = 0) attracts nearby covariances iff the
eigenvalues λ_L↑ and λ_M↑ of G^{⊗2}∘J∘G^{⊗2}, J = dV_{φ∘n}/dΣ at Σ*, are < 1 (the RG
eigenvalue is 0: BN removes the scale; Thm 3.6, the discussion after Thm 3.8, App. F.3.2).

We compute them from the spherical form of V (Thm 3.3).  Differentiating Eq. 10 at
eᵀΣe = μ*I in a direction Δ with tr Δ = 0 gives

    J{Δ} = (B − 1)/(2μ*) · E_{v̂} [ (v̂ᵀΔv̂) φ(√B v̂)^{⊗2} ],   v̂ ~ Unif(unit sphere of im G),

and, the eigenspaces being orthogonal, each eigenvalue is the average Rayleigh quotient
over an orthonormal basis of its eigenspace:
λ_X = (B−1)/(2μ* dim X) E⟨P_X(v̂v̂ᵀ), ψψᵀ⟩ with ψ = Gφ(√B v̂).  With the projections
P_L(X) = G D_X G/(1 − 2/B) (D_X the traceless part of diag X) and
P_M = I − P_G − P_L on {X = GXG}:

    λ_L↑ = E[ B Σ_i v̂_i² ψ_i² − ‖ψ‖² ] / (2 (B−2) μ*),
    λ_M↑ = (B−1)/(μ* B(B−3)) · E[ (v̂·φ)² − ‖ψ‖²/(B−1) − B/(B−2) (Σ_i v̂_i²ψ_i² − ‖ψ‖²/B) ].

By exchangeability every term reduces to one- and two-coordinate expectations
(E v̂_1²φ_1², E φ_1², E φ_1φ_2, E v̂_1²φ_1φ_2, E v̂_1φ_1v̂_2φ_2), computed with the 2-D
sphere rule of :mod:`bnlab.theory.epsilon` (spectral for smooth φ; for positive-homogeneous
φ the radial part is an exact Beta moment and only the angle is integrated, accuracy
≈ 1e−12 for α ≥ 1, ≈ 1e−9 for α ≥ 0.5).  For φ = id both equal (B − 1)/(B + 1); for
relu they reproduce Thm 3.7 (checked in the tests to 1e−10).

Iterating the dynamics
----------------------
:func:`fixed_point_kind` confirms the verdict by iterating Σ^l = V_{B_φ}(Σ^{l−1}) from a
generic (Wishart) Σ⁰ with a Monte Carlo map (seeded; the sampling noise plays the role of
the finite-width weight randomness that breaks the symmetry in real networks, App. J)
and measuring the distance of the normalized G-projected Σ^L from G.

BSB2 fixed points (App. K)
--------------------------
Thm K.5 gives the \widehat{BSB2}^1_B fixed point in closed form:
d* = (φ(√(B−1))² + φ(−√(B−1))²)/2,
c* = (φ(√(B−1))φ(−1/√(B−1)) + φ(−√(B−1))φ(1/√(B−1)))/2,
b* = (φ(−1/√(B−1))² + φ(1/√(B−1))²)/2, with G Σ* G = λ* q̂q̂ᵀ (Thm K.4),
λ* = (B−1)/B (d* − 2c* + b*).  Checked in the tests by applying a Monte Carlo map to Σ*.

Errata / remarks on the paper
-----------------------------
* Thm K.5 calls the fixed point "unique"; it is unique among \widehat{BSB2}^1 matrices, and it
  is a fixed point for every φ (also those with an attracting BSB1 point), so its existence
  says nothing about which fixed point the dynamics select.
* App. K's backward formula for the \widehat{BSB2}^1 point writes "\widehat{BSB}" for
  "\widehat{BSB2}" (typo only).

References
----------
Yang et al. 2019: Thm 3.3 (Eq. 10), Thm 3.6, Thm 3.7, Thm 3.8 and the discussion after it,
App. F.1 (Cor. F.3), App. F.3.2, App. J, Defn K.1, Thms K.4 and K.5, Fig. 1c,d.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from bnlab._validation import check_int, check_real
from bnlab.activations import Activation, get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._quadrature.rules import beta_moment
from bnlab.theory._quadrature.sphere import angle_rule, pair_nodes
from bnlab.theory._routes import MAX_MONTECARLO_SECONDS
from bnlab.theory.batchnorm_map import _montecarlo as _transform_montecarlo
from bnlab.theory.epsilon import _forward_gap, _is_homogeneous
from bnlab.theory.forward import _forward_eigenvalues
from bnlab.theory.vphi import _homogeneous_fixed_point

__all__ = [
    "BSB1Stability",
    "bsb1_stability",
    "fixed_point_kind",
    "alpha_transition",
    "BSB2FixedPoint",
    "bsb2_fixed_point",
]


@dataclass(frozen=True)
class BSB1Stability:
    """Forward eigenvalues of the linearized BN dynamics at the BSB1 fixed point (ε = 0).

    Attributes
    ----------
    batch_size:
        B.
    lambda_L, lambda_M:
        λ_L↑ and λ_M↑ (Yang et al. 2019, Thm 3.6/3.8).  ``lambda_M`` is NaN-free: for
        B = 3 the M eigenspace has dimension B(B−3)/2 = 0 and ``lambda_M`` is 0.0.
    mu_star:
        q*(1 − c*) of the BSB1 fixed point.
    attracting:
        max(λ_L↑, λ_M↑) < 1.
    """

    batch_size: int
    lambda_L: float
    lambda_M: float
    mu_star: float

    @property
    def attracting(self) -> bool:
        return max(self.lambda_L, self.lambda_M) < 1.0

    @property
    def lambda_max(self) -> float:
        return max(self.lambda_L, self.lambda_M)


@dataclass(frozen=True)
class BSB2FixedPoint:
    r"""The \widehat{BSB2}^1_B fixed point of Thm K.5.

    Σ* = [[d, c 1ᵀ], [c 1, b 11ᵀ]] (one dominant sample, first), with G Σ* G = λ* q̂q̂ᵀ,
    q̂ = (1, −1/(B−1), …, −1/(B−1)) √((B−1)/B).
    """

    batch_size: int
    d: float
    c: float
    b: float
    lambda_star: float

    @property
    def matrix(self) -> np.ndarray:
        bsz = self.batch_size
        m = np.full((bsz, bsz), self.b)
        m[0, 1:] = m[1:, 0] = self.c
        m[0, 0] = self.d
        return m

    @property
    def q_hat(self) -> np.ndarray:
        bsz = self.batch_size
        q = np.full(bsz, -1.0 / (bsz - 1))
        q[0] = 1.0
        return q * math.sqrt((bsz - 1) / bsz)


def _sphere_terms(phi: Activation, b: int):
    """(a1, e1, e12, a12, b12) = E v̂1²φ1², E φ1², E φ1φ2, E v̂1²φ1φ2, E v̂1φ1v̂2φ2."""
    vh2 = (b - 1) / b
    root = math.sqrt(b - 1)
    if _is_homogeneous(phi):
        # φ(√(B−1)√T cos θ) = (B−1)^{α/2} T^{α/2} φ(cos θ); each term is T^{α} or T^{α+1}
        a = phi.homogeneity
        c1, c2, w = angle_rule(b, 256, True)
        p1, p2 = phi(c1), phi(c2)
        amp = (b - 1) ** a
        m0, m1 = beta_moment(b, a), beta_moment(b, a + 1)
        return (
            amp * m1 * vh2 * float(w @ (c1 * c1 * p1 * p1)),
            amp * m0 * float(w @ (p1 * p1)),
            amp * m0 * float(w @ (p1 * p2)),
            amp * m1 * vh2 * float(w @ (c1 * c1 * p1 * p2)),
            amp * m1 * vh2 * float(w @ (c1 * p1 * c2 * p2)),
        )
    x1, x2, w = (arr[0] for arr in pair_nodes(phi, b, np.array([root])))
    p1, p2 = phi(root * x1), phi(root * x2)
    return (
        vh2 * float(w @ (x1 * x1 * p1 * p1)),
        float(w @ (0.5 * (p1 * p1 + p2 * p2))),
        float(w @ (p1 * p2)),
        vh2 * float(w @ (x1 * x1 * p1 * p2)),
        vh2 * float(w @ (x1 * p1 * x2 * p2)),
    )


def _stability(phi: Activation, b: int) -> BSB1Stability:
    """λ_L↑, λ_M↑, μ* (see :func:`bsb1_stability`), or a ``ValueError`` when they are not finite.

    An overflowing φ makes the sums inf/NaN; the check below reports it, so NumPy's own overflow
    warnings would only be noise before it — and a NaN eigenvalue must never read as "not attracting"."""
    with np.errstate(over="ignore", invalid="ignore"):
        st = _stability_values(phi, b)
    if not (math.isfinite(st.lambda_L) and math.isfinite(st.lambda_M)):
        raise ValueError(
            f"the forward eigenvalues of phi={phi.spec!r} at batch_size={b} are not finite (λ_L={st.lambda_L!r}, "
            f"λ_M={st.lambda_M!r}): φ overflows or is not square-integrable on the batchnorm sphere, so the BSB1/BSB2 "
            "verdict cannot be computed"
        )
    return st


def _resolved_stability(phi: Activation, b: int) -> BSB1Stability:
    """:func:`_stability`, or a ``ValueError`` when max(λ_L↑, λ_M↑) is 1 to within float64 rounding.

    A ValueError if not finite: an overflow must never read as "not attracting".  And 1 − λ_L↑ ≈ 2.27/B for
    relu: beyond B ≈ 1e15 it is below float64's resolution and λ rounds to 1, which would read as "not
    attracting" (BSB2) for a φ whose BSB1 point attracts at every B.  Every BSB1/BSB2 verdict (here and in
    :func:`bnlab.theory.analyze`) goes through this function."""
    st = _stability(phi, b)
    if abs(st.lambda_max - 1.0) <= _UNRESOLVED_MARGIN:
        raise ValueError(
            f"batch_size={b} is not allowed for the BSB1/BSB2 verdict of phi={phi.spec!r}: max(λ_L↑, λ_M↑) = "
            f"{st.lambda_max!r} is 1 to within float64 rounding (its distance from 1 shrinks like 1/B), so whether "
            "the BSB1 fixed point attracts cannot be computed; use batch_size <= 1e14"
        )
    return st


def _stability_values(phi: Activation, b: int) -> BSB1Stability:
    if phi.homogeneity is not None and phi.homogeneous_coeffs is not None and b >= 4 and (b - 1) / 2.0 > phi.homogeneity:
        # positive-homogeneous φ: the closed forms (Thm 3.7 for relu/identity, Thm F.33 otherwise).  The
        # sphere sums below cancel like B·1e-16 while 1 − λ_L↑ ≈ 2.27/B for relu (issue 13: relu at
        # B = 3e8 came out BSB2); the closed forms keep λ_L↑ = 1 − gap correctly rounded to B = 1e12.  Under
        # this condition the forward route "auto" is exactly these ("closed" for relu/identity, else "laplace":
        # bnlab.theory._routes.plan_route), so the choice is made there, once
        fw = _forward_eigenvalues(phi, b, "auto")
        q, qc = _homogeneous_fixed_point(phi, b)  # the closed BSB1 fixed point (Thm F.8)
        return BSB1Stability(batch_size=b, lambda_L=fw.lambda_L, lambda_M=fw.lambda_M, mu_star=float(q) - float(qc))
    a1, e1, e12, a12, b12 = _sphere_terms(phi, b)
    mu = float(_forward_gap(phi, b, np.array([1.0]))[0])  # d − f without cancellation
    if not mu > 0:
        raise ValueError(f"phi={phi.spec!r} is constant on the batch sphere: the BSB1 fixed point is degenerate (μ* = 0)")
    psi2 = (b - 1) * mu  # E‖Gφ‖²
    vpsi = b * a1 - 2 * (a1 + (b - 1) * a12) + (e1 + (b - 1) * e12) / b  # E Σ v̂_i² ψ_i²
    lam_l = (b * vpsi - psi2) / (2 * (b - 2) * mu)
    if b > 3:
        vphi2 = b * a1 + b * (b - 1) * b12  # E (v̂·φ)²
        lam_m = (b - 1) / (mu * b * (b - 3)) * (vphi2 - psi2 / (b - 1) - b / (b - 2) * (vpsi - psi2 / b))
    else:
        lam_m = 0.0
    return BSB1Stability(batch_size=b, lambda_L=float(lam_l), lambda_M=float(lam_m), mu_star=mu)


def bsb1_stability(phi, batch_size) -> BSB1Stability:
    r"""Forward eigenvalues λ_L↑, λ_M↑ at the BSB1 fixed point, by 2-D sphere quadrature.

    Parameters
    ----------
    phi : Activation or str
    batch_size : int
        B ≥ 3 (B = 3 warns; λ_M is 0 there since the M eigenspace is empty).

    Returns
    -------
    BSB1Stability

    Accuracy
    --------
    ≈ 1e−12 for smooth φ and for positive-homogeneous φ of degree ≥ 1 (verified against
    Thm 3.7 for relu to 1e−14); ≤ 2e−7 for relu(x + 2) (kink-aligned rule, measured
    against a finer rule at B = 8, 32); algebraic (≈1e−5) for kinks of user-defined φ.

    References
    ----------
    Yang et al. 2019, Thm 3.3, Thm 3.6, Thm 3.7, Thm 3.8, App. F.3.
    """
    phi = get_activation(phi)
    b = check_batch_size(batch_size)
    return _stability(phi, b)


def _generic_start(b: int, rng: np.random.Generator) -> np.ndarray:
    a = rng.standard_normal((b, 2 * b))
    return a @ a.T / (2 * b)


def _bsb1_deviation(sigma: np.ndarray) -> float:
    """‖S − G‖_F/‖G‖_F with S = GΣG normalized to trace B − 1 (0 iff Σ is BSB1)."""
    b = sigma.shape[0]
    g = np.eye(b) - 1.0 / b
    s = g @ sigma @ g
    s = s * (b - 1) / np.trace(s)
    return float(np.linalg.norm(s - g) / math.sqrt(b - 1))


def _iterate_kind(phi: Activation, b: int, depth: int, seed, n_samples: int, threshold: float = 0.3):
    """Iterate the MC map from a generic Σ⁰; return (kind, deviation averaged over the last layers)."""
    rng = np.random.default_rng(seed)
    sigma = _generic_start(b, rng)
    devs = []
    tail = max(1, depth // 5)
    for layer in range(depth):
        sigma, _ = _transform_montecarlo(phi, sigma, b, 0.0, n_samples, rng)
        sigma = 0.5 * (sigma + sigma.T)
        if layer >= depth - tail:
            devs.append(_bsb1_deviation(sigma))
    dev = float(np.mean(devs))
    return ("BSB1" if dev < threshold else "BSB2"), dev


#: Seconds of one core per unit n_samples·B² of one Monte Carlo layer of the confirmation (two B×B
#: BLAS products per sample chunk; measured 2.0e-10 at B = 512, 5.8e-10 at B = 128, tanh, float64)
_ITERATION_SECONDS_PER_UNIT = 2e-10
#: The confirmation's distance from BSB1 has a sampling floor √(B/n_samples) (measured 0.039, 0.079,
#: 0.114 at B = 32, 128, 256 with 20 000 samples: exactly √(B/n)); above half the 0.3 threshold the
#: iterated verdict would be noise, so it is refused rather than reported
_NOISE_FLOOR_LIMIT = 0.15


def _check_iteration_cost(b: int, depth: int, n_samples: int) -> None:
    """Refuse a confirmation that would take minutes, exhaust memory or be decided by sampling noise."""
    secs = depth * n_samples * float(b) ** 2 * _ITERATION_SECONDS_PER_UNIT
    floor = math.sqrt(b / n_samples)
    if secs > MAX_MONTECARLO_SECONDS:
        raise ValueError(
            f"batch_size={b} is not allowed with depth={depth} and n_samples={n_samples}: confirming the verdict by "
            f"iterating the Monte Carlo map costs depth·n_samples·B² (about {secs:.3g} s, > "
            f"{MAX_MONTECARLO_SECONDS:.0f} s; B×B covariances of {8 * float(b) ** 2 / 2**30:.3g} GiB each); use "
            "depth=None for the stability verdict alone (exact closed forms for relu-like φ, quadrature otherwise, "
            "any batch_size), or a smaller depth"
        )
    if floor > _NOISE_FLOOR_LIMIT:
        raise ValueError(
            f"n_samples={n_samples} is too small for batch_size={b}: the iterated distance from BSB1 has a sampling "
            f"floor √(B/n_samples) = {floor:.3g}, too close to the 0.3 threshold for a verdict; use n_samples >= "
            f"{math.ceil(b / _NOISE_FLOOR_LIMIT**2)} or depth=None (stability verdict alone)"
        )


def fixed_point_kind(phi, batch_size, *, depth=60, seed=0, n_samples=20_000) -> str:
    r"""Whether the BN dynamics (ε = 0) from a generic Σ⁰ converge to a BSB1 or a BSB2 fixed point.

    The verdict comes from the stability of the BSB1 fixed point (``"BSB1"`` iff
    max(λ_L↑, λ_M↑) < 1, see :func:`bsb1_stability`) and is confirmed by iterating the
    dynamics ``depth`` layers from a generic Σ⁰ with a seeded Monte Carlo map (App. F.1, K).
    If the two disagree a ``RuntimeWarning`` names both; the stability verdict is returned
    unless max λ is within 1e−3 of 1, where finite iterations are the better guide and
    their verdict is returned.

    Parameters
    ----------
    phi : Activation or str
    batch_size : int
        B ≥ 3.
    depth : int or None
        Layers to iterate for the confirmation (≥ 1); ``None`` skips it.  The confirmation costs
        depth·n_samples·B² and needs n_samples ≥ B/0.15² ≈ 44.4·B (its sampling floor √(B/n_samples) must
        stay below half its 0.3 threshold): beyond either (the defaults allow B ≤ 450) it raises
        ``ValueError`` before allocating anything; the stability verdict (``depth=None``) works at
        any B (tested to B = 10¹²).
    seed : int or numpy.random.Generator seed
        Seed of Σ⁰ and of the Monte Carlo map.
    n_samples : int
        Samples per layer of the Monte Carlo map (≥ 1000).

    Returns
    -------
    str
        ``"BSB1"`` or ``"BSB2"``.

    References
    ----------
    Yang et al. 2019, Thm 3.8 discussion, App. F.3.2, App. J, App. K, Fig. 1c,d.
    """
    phi = get_activation(phi)
    b = check_batch_size(batch_size)
    if depth is not None:
        depth = check_int("depth", depth, minimum=1)
    n_samples = check_int("n_samples", n_samples, minimum=1000)
    if depth is not None:
        _check_iteration_cost(b, depth, n_samples)  # before the stability part: fail fast, allocate nothing
    st = _resolved_stability(phi, b)
    kind = "BSB1" if st.attracting else "BSB2"
    if depth is None:
        return kind
    it_kind, dev = _iterate_kind(phi, b, depth, seed, n_samples)
    if it_kind != kind:
        warnings.warn(
            f"fixed_point_kind({phi.spec!r}, B={b}): stability of BSB1 says {kind} "
            f"(λ_L={st.lambda_L:.6g}, λ_M={st.lambda_M:.6g}) but {depth} iterated layers say {it_kind} "
            f"(distance from BSB1 {dev:.3g}); increase depth near the transition",
            RuntimeWarning,
            stacklevel=2,
        )
        if abs(st.lambda_max - 1.0) < 1e-3:
            return it_kind
    return kind


#: |max(λ_L↑, λ_M↑) − 1| at or below which float64 cannot tell an attracting BSB1 point (8 ulp of 1)
_UNRESOLVED_MARGIN = 8 * 2.220446049250313e-16

#: largest α scanned by :func:`alpha_transition`
_ALPHA_MAX = 64.0


def _alpha_relu_lambda(alpha: float, b: int) -> float:
    return _stability(get_activation("alpha_relu", alpha=alpha), b).lambda_max


def alpha_transition(batch_size, *, rtol=1e-6) -> float:
    r"""α_transition(B): the degree α of α-ReLU (relu^α) where the BSB1 fixed point loses stability.

    Root of max(λ_L↑, λ_M↑)(α) = 1 (Fig. 1c,d; App. F.3.2) by Brent's method on a bracket
    found by scanning α upward from 1 (relu, which is BSB1 for every B ≥ 3) by factors
    1.25 up to α = 64.  Below the returned α the dynamics converge to BSB1, above it they
    break the symmetry (BSB2).  The transition is driven by λ_L↑ (the "winner-take-all"
    fluctuation of the diagonal); for B = 3 and 4 λ_L↑ stays below 1 for all scanned α
    and a ValueError says so.

    Parameters
    ----------
    batch_size : int
        B ≥ 3.
    rtol : float
        Relative tolerance on α (1e−12 ≤ rtol < 1).

    Returns
    -------
    float

    Accuracy
    --------
    |error| ≤ rtol·α + (quadrature error of λ ≈ 1e−12)/|dλ/dα|.

    References
    ----------
    Yang et al. 2019, §3.1 ("α_transition(B)"), Fig. 1c,d, App. F.3.2.
    """
    b = check_batch_size(batch_size)
    rtol = check_real("rtol", rtol, minimum=1e-12, maximum=0.5)

    def excess(alpha):
        return _alpha_relu_lambda(alpha, b) - 1.0

    lo = 1.0
    if excess(lo) >= 0:
        raise ValueError(f"batch_size={b}: relu (α = 1) is already not BSB1-stable; no transition above α = 1")
    hi = lo
    while True:
        hi = min(lo * 1.25, _ALPHA_MAX)
        if excess(hi) > 0:
            break
        if hi >= _ALPHA_MAX:
            raise ValueError(
                f"batch_size={b} has no BSB1→BSB2 transition for α ≤ {_ALPHA_MAX:g}: max(λ_L, λ_M) = "
                f"{excess(hi) + 1:.6g} < 1 there (for B = 3 and B = 4 λ_L↑ stays below 1 as α grows)"
            )
        lo = hi
    from scipy.optimize import brentq  # here: scipy.optimize takes ≈1 s to import, and only α_transition needs it

    return float(brentq(excess, lo, hi, rtol=max(rtol, 4 * np.finfo(float).eps), xtol=1e-14))


def bsb2_fixed_point(phi, batch_size) -> BSB2FixedPoint:
    r"""The \widehat{BSB2}^1_B fixed point of Eq. 43 (Yang et al. 2019, Thm K.5; structure Thm K.4).

    Parameters
    ----------
    phi : Activation or str
    batch_size : int
        B ≥ 3.

    Returns
    -------
    BSB2FixedPoint
        (d*, c*, b*, λ*); ``.matrix`` is Σ* with the dominant sample first.

    Accuracy
    --------
    Closed form: exact to rounding.

    Raises
    ------
    ValueError
        If λ* = 0 (φ(√(B−1)) = φ(−1/√(B−1)) and φ(−√(B−1)) = φ(1/√(B−1))): then Σ* is
        constant on im G and BN of it is undefined.
    """
    phi = get_activation(phi)
    b = check_batch_size(batch_size)
    r = math.sqrt(b - 1)
    hi_p, hi_m = float(phi(np.array(r))), float(phi(np.array(-r)))
    lo_p, lo_m = float(phi(np.array(1 / r))), float(phi(np.array(-1 / r)))
    d = 0.5 * (hi_p**2 + hi_m**2)
    c = 0.5 * (hi_p * lo_m + hi_m * lo_p)
    bb = 0.5 * (lo_m**2 + lo_p**2)
    lam = (b - 1) / (2 * b) * ((hi_p - lo_m) ** 2 + (hi_m - lo_p) ** 2)
    if not lam > 0:
        raise ValueError(f"phi={phi.spec!r}: the BSB2^1 candidate has λ* = 0 (degenerate), no BN fixed point")
    return BSB2FixedPoint(batch_size=b, d=d, c=c, b=bb, lambda_star=lam)
