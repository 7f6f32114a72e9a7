"""Spherical integration for the batchnorm transform (Yang et al. 2019, Thm 3.3, App. E.3, Thm F.5).

Batchnorm is the projection G followed by a projection onto the sphere of
radius √B, so V_Bφ(Σ) is an integral over S^{B−2} (Thm 3.3 / Prop. E.34):

    V_Bφ(Σ) = E_{v ~ S^{B−2}} φ(√B 𝔢 v)^{⊗2} 𝒦(v; Σ),
    𝒦(v; Σ) = det(𝔢ᵀΣ𝔢)^{-1/2} (vᵀ(𝔢ᵀΣ𝔢)^{-1}v)^{-(B−1)/2}.

Two evaluation schemes:

**Isotropic Σ (GΣG = μG, which includes every BSB1 Σ) — deterministic, ≈1e-13.**
Then 𝒦 ≡ 1 and the rows of √B𝔢 are √(B−1) u_i with unit u_i, u_i·u_j = −1/(B−1),
so (Thm F.5, written in angles adapted to one pair of rows)

    diagonal  = Z₁⁻¹ ∫₀^π sin^{B−3}θ φ(√(B−1) cos θ)² dθ,
    off-diag. = Z₁⁻¹Z₂⁻¹ ∫₀^π∫₀^π sin^{B−3}θ sin^{B−4}ψ
                φ(√(B−1) cos θ) φ(√(B−1)(ρ cos θ + √(1−ρ²) sin θ cos ψ)) dψ dθ,

with ρ = −1/(B−1), Z₁ = √π Γ((B−2)/2)/Γ((B−1)/2), Z₂ = √π Γ((B−3)/2)/Γ((B−2)/2)
(for B = 3 the ψ-"sphere" S⁰ is the two points ψ ∈ {0, π}).  The θ-range is
split at θ = π/2 and the ψ-range at the angle where the second argument
vanishes, so a kink of φ at 0 (relu, α-relu, abs) sits on panel ends; each
panel uses the tanh-sinh rule (exponential convergence even for the
√-singularity of α-relu(½)), the weights are evaluated in log space (B up to
10⁶ without overflow), and the level is raised until two successive levels
agree to ``tol`` (relative, default 1e-12); their difference is returned as the error estimate.  With
ε > 0 the norm no longer cancels: the arguments are multiplied by
s(u) = √(2uμ/(2uμ + Bε)) and averaged over u = ‖x‖²/2 ~ Gamma((B−1)/2)
with the trapezoid rule in log u (exponentially convergent for every ε > 0,
≲ 1e-14; see :func:`bnlab.theory._quadrature.rules.eps_scale_rule`).

**General Σ — randomized quasi-Monte Carlo.**  The change of variables
v ↦ Lv/‖Lv‖ (L Lᵀ = 𝔢ᵀΣ𝔢) has Jacobian 𝒦(v; Σ), so the spherical integral
equals E_x φ(√B 𝔢Lx/‖Lx‖)^{⊗2}, x ~ N(0, I_{B−1}); this is evaluated with
scrambled Sobol points (``n_points`` per replicate, 8 independent
scramblings); the standard error across replicates is the error estimate.
Accuracy: typically 1e-5–1e-6 relative with 2^16 points per replicate for
kinked φ, better for smooth φ; cost O(n_points · B²).

Errata found in the paper
-------------------------
* App. E.3, Eq. (34) prints (𝔢v)₂ = cos θ₁ − √((B−2)/(B−1)) sin θ₁ cos θ₂,
  (𝔢v)₃ = cos θ₁ + sin θ₁ cos θ₂ − …; with 𝔢 of Eq. (33) the terms coming
  from earlier columns carry their normalizations:
  (𝔢v)₂ = cos θ₁/√(B(B−1)) − √((B−2)/(B−1)) sin θ₁ cos θ₂ (which is what
  ζ₂ of Thm F.5 uses, correctly), (𝔢v)₃ = cos θ₁/√(B(B−1)) +
  sin θ₁ cos θ₂/√((B−1)(B−2)) − √((B−3)/(B−2)) sin θ₁ sin θ₂ cos θ₃, etc.
  (checked numerically in tests/theory/test_batchnorm_map.py).
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special

from bnlab.activations import Activation
from bnlab.theory._linalg import im_g_basis
from bnlab.theory._quadrature.kinks import theta_cuts
from bnlab.theory._quadrature.rules import eps_scale_rule, sin_power_panels, sin_power_weight, tanh_sinh_panel

__all__ = ["isotropic_transform_entries", "qmc_transform"]

_MAX_LEVEL = 7


def _diag_integral(phi: Activation, batch_size: int, level: int, scales, sweights) -> float:
    a = math.sqrt(batch_size - 1.0)
    # panels end at θ = π/2 (φ's kink at 0) and at arccos(k/a) for kinks k ≠ 0 (bnlab.theory._quadrature.kinks)
    ends = np.array(sorted({0.0, 0.5 * math.pi, math.pi, *theta_cuts(phi, a)}))
    theta, w = sin_power_panels(ends, batch_size - 3.0, level)
    arg = a * np.cos(theta)[:, None] * scales[None, :]
    vals = phi(arg) ** 2 @ sweights
    return float(vals @ w)


def _offdiag_integral(phi: Activation, batch_size: int, level: int, scales, sweights) -> float:
    b = batch_size
    a = math.sqrt(b - 1.0)
    rho = -1.0 / (b - 1.0)
    srho = math.sqrt(1.0 - rho * rho)
    # θ-panels end where φ's first argument vanishes (θ = π/2) and where the kink
    # curve of the second argument enters/leaves the ψ-range (sin θ_c = |ρ|):
    # the inner ψ-integral is not smooth in θ there.
    tc = math.asin(abs(rho))
    cut_set = {0.0, tc, 0.5 * math.pi, math.pi - tc, math.pi}
    # kinks k ≠ 0 (bnlab.theory._quadrature.kinks): φ's first argument a cos θ = k, and the kink curve
    # a(ρ cos θ + √(1−ρ²) sin θ cos ψ) = k enters/leaves the ψ-range: cos(θ ∓ δ) = k/a, ρ = cos δ
    kinks = [k for k in phi.kinks if k != 0.0]
    delta = math.acos(rho)
    for k in kinks:
        if abs(k) < a:
            ak = math.acos(k / a)
            cut_set.add(ak)
            for cand in (delta + ak, delta - ak, -delta + ak, -delta - ak, 2 * math.pi - delta - ak):
                cand = cand % (2.0 * math.pi)
                if 0.0 < cand < math.pi:
                    cut_set.add(cand)
    cuts = np.array(sorted(cut_set))
    theta, wt = sin_power_panels(cuts, b - 3.0, level)
    ct, st = np.cos(theta), np.sin(theta)
    if b == 3:
        psi = np.array([[0.0, math.pi]] * theta.size)
        wp = np.full_like(psi, 0.5)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            cpsi0 = np.where(st > 0, -rho * ct / (srho * np.where(st > 0, st, 1.0)), 2.0)
        psi0 = np.arccos(np.clip(cpsi0, -1.0, 1.0))
        psis = [psi0]
        for k in kinks:  # ψ where the second argument crosses the kink k (0 or π when it does not)
            with np.errstate(divide="ignore", invalid="ignore"):
                ck = np.where(st > 0, (k / a - rho * ct) / (srho * np.where(st > 0, st, 1.0)), 2.0)
            psis.append(np.arccos(np.clip(ck, -1.0, 1.0)))
        inner_ends = np.sort(np.stack([np.zeros_like(psi0), *psis, np.full_like(psi0, math.pi)], axis=-1), axis=-1)
        lo, hi = inner_ends[:, :-1], inner_ends[:, 1:]  # empty panels (lo = hi) carry zero weight
        psi, wp = tanh_sinh_panel(lo, hi, level)  # (nθ, 2, nψ)
        psi = psi.reshape(theta.size, -1)
        wp = wp.reshape(theta.size, -1)
        wp = sin_power_weight(psi, b - 4.0, wp)
    x1 = a * ct  # (nθ,)
    x2 = a * (rho * ct[:, None] + srho * st[:, None] * np.cos(psi))  # (nθ, nψ)
    f1 = phi(x1[:, None] * scales[None, :])  # (nθ, nr)
    f2 = phi(x2[:, :, None] * scales[None, None, :])  # (nθ, nψ, nr)
    inner = np.einsum("tpr,tp,tr,r->t", f2, wp, f1, sweights)
    return float(inner @ wt)


def isotropic_transform_entries(
    phi: Activation, batch_size: int, *, mu: float = 1.0, eps: float = 0.0, tol: float = 1e-12
) -> tuple[float, float, float]:
    """(diagonal, off-diagonal, abs_error) of V_Bφ(Σ) for any Σ with GΣG = μG.

    With ε = 0 the result does not depend on μ (Thm F.5).  ``abs_error`` is the
    difference between the last two quadrature levels (max over both entries).
    """
    b = int(batch_size)
    alpha = phi.homogeneity
    if eps > 0 and alpha is not None and alpha > 0 and phi.homogeneous_coeffs is not None:
        # φ(s x) = s^α φ(x) for s > 0: the radial average factors out exactly
        scales, sweights = eps_scale_rule(b, mu, eps)
        factor = float(np.sum(sweights * scales ** (2.0 * alpha)))
        d, o, err = isotropic_transform_entries(phi, b, mu=mu, eps=0.0, tol=tol)
        return factor * d, factor * o, factor * err
    scales, sweights = eps_scale_rule(b, mu, eps)
    if eps > 0 and any(k != 0.0 for k in phi.kinks):
        # kinks away from 0 move with the radial scale s (φ(s x) is kinked at k/s): integrate each
        # scale with its own cuts, as the ε = 0 entries of x ↦ φ(s x) (bnlab.theory._quadrature.kinks)
        parts = np.array(
            [isotropic_transform_entries(phi.with_affine(float(sc), 0.0), b, eps=0.0, tol=tol) for sc in scales]
        )
        d, o = sweights @ parts[:, 0], sweights @ parts[:, 1]
        return float(d), float(o), float(sweights @ parts[:, 2])
    prev = None
    level = 3
    while True:
        d = _diag_integral(phi, b, level, scales, sweights)
        o = _offdiag_integral(phi, b, level, scales, sweights) if b > 1 else 0.0
        if prev is not None:
            err = max(abs(d - prev[0]), abs(o - prev[1]))
            scale = max(abs(d), abs(o), 1e-300)
            # with ε > 0 each node also carries the radial rule: cap one level lower
            if err <= tol * scale or level >= (_MAX_LEVEL if eps == 0 else _MAX_LEVEL - 2):
                return d, o, err
        prev = (d, o)
        level += 1


def qmc_transform(
    phi: Activation,
    sigma: np.ndarray,
    *,
    eps: float = 0.0,
    n_points: int = 2**16,
    n_replicates: int = 8,
    seed=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Randomized QMC estimate of V_Bφ(Σ) and its standard error (general Σ).

    See the module docstring; points are x = Φ⁻¹(Sobol) in R^{B−1}, pushed to
    z = 𝔢 L x with L Lᵀ = 𝔢ᵀΣ𝔢, and B_φ = φ(√B z / √(‖z‖² + Bε)).
    """
    from scipy.stats import qmc  # imported lazily: scipy.stats is slow to import

    b = sigma.shape[0]
    e = im_g_basis(b)
    sq = e.T @ sigma @ e
    w, u = np.linalg.eigh(sq)
    lmat = e @ (u * np.sqrt(np.clip(w, 0.0, None)))  # B × (B−1)
    rng = np.random.default_rng(seed)
    m = max(int(round(math.log2(max(n_points, 2)))), 1)
    ests = []
    for _ in range(n_replicates):
        sob = qmc.Sobol(d=b - 1, scramble=True, seed=rng)
        acc = np.zeros((b, b))
        n_total = 2**m
        chunk = max(1, min(n_total, int(2e6 // b)))
        pts = sob.random_base2(m)
        for start in range(0, n_total, chunk):
            x = special.ndtri(np.clip(pts[start : start + chunk], 1e-300, 1 - 1e-16))
            z = x @ lmat.T
            nrm = np.sqrt(np.einsum("nb,nb->n", z, z) + b * eps)
            y = phi(math.sqrt(b) * z / nrm[:, None])
            acc += y.T @ y
        ests.append(acc / n_total)
    ests = np.asarray(ests)
    return ests.mean(axis=0), ests.std(axis=0, ddof=1) / math.sqrt(n_replicates)
