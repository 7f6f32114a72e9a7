"""Private helpers shared by the dynamics modules (forward, backward, cross_batch).

The Gegenbauer coefficients themselves come from the core module
:mod:`bnlab.theory.gegenbauer` (public, separately tested); what lives here is
only what the dynamics need on top of it:

* :func:`_gegenbauer_energy` — the coefficients in both normalizations, log N_l,
  P_l(−1/(B−1)) and the single-point moments E f², E x² f², E(1−x²)f'² in one call
  (:class:`_GegenbauerSeries`; B ≥ 4 through the core; B = 3, where the core's
  normalization c_{B−1,l} = (B−3)/(B−3+2l) vanishes, by the Chebyshev special case).
  The moments sum the tails of the single-point parts of every series exactly, which
  is what makes the routes accurate for φ with a kink (algebraic coefficient decay);
  it replaced an Aitken/Richardson extrapolation of truncated sums (relu λ_G↓: 2e-5
  at B = 128, 7e-4 at B = 1024 with 400/800/1600 terms; now ≤ 1e-15 with 400);
* :func:`_relu_arccos_kernel` — J_1 and J_1' of relu through
  :func:`bnlab.theory.vphi.alpha_relu_kernel`.
* the numerical engine of the spherical / Monte Carlo / Laplace routes
  (:func:`_sphere_grid`, :func:`_conditional_moments`, :func:`_radial_inverse_moment`,
  :func:`_sample_sphere`, :func:`_ratio_stats`, :func:`_montecarlo_samples`,
  :func:`_laplace_kernel_values`, :func:`_require_laplace`), moved unchanged from :mod:`.forward`;
* the one prologue of the three public entry points, :func:`_choose_route`: φ resolved once
  (:func:`bnlab.activations.get_activation`), B and the method checked, the route chosen
  ("auto": :func:`_relu_or_identity` closed forms, else the sphere) and its own preconditions
  checked; each dynamics states only what differs (:class:`_Dynamics`).

Measured agreement of the core's coefficients with the former dynamics-private
Gauss–Jacobi quadrature (relu, tanh, sin, gelu, alpha_relu(0.5); B = 4, 8, 32,
128, 1024; 50 to 1603 terms): max |Δb_l| / ‖b‖ ≤ 1e-11 wherever the old one was
finite; the core's Parseval residual is ≤ 1e-15 for tanh at B = 32, 128 where
the old quadrature overshot by 2e-11, and the old Gauss–Jacobi rule returned
NaN at B = 1024 with ≥ 403 terms (scipy's roots_jacobi fails for large
exponents), which the core does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import special

from bnlab._validation import check_choice, check_int
from bnlab.theory._checks import check_batch_size
from bnlab.theory._linalg import _tanh_sinh_step
from bnlab.theory.gegenbauer import (
    RULE_RTOL as _RULE_RTOL,
    SeriesMoments,
    gegenbauer_series_moments,
    normalized_gegenbauer,
    oscillating_tail_bound,
)
from bnlab.theory.vphi import alpha_relu_kernel

__all__: list[str] = []

_ALL_METHODS = ("auto", "closed", "laplace", "fourier", "sphere", "gegenbauer", "montecarlo")

MAX_QUADRATURE_BATCH = 2048  # the Gauss–Jacobi weights (∝ 2^{(B−5)/2}) overflow beyond this


def _log_harmonic_dimension(l: np.ndarray, batch_size: int) -> np.ndarray:
    """log N_l with N_l = c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(1) = (B−3+2l)/(B−3) · (B−3)_l / l!
    (the dimension of degree-l spherical harmonics on S^{B−2}); B = 3: N_0 = 1, N_l = 2.

    Kept in log form (N_l overflows float64 for large B·l); the core module has the
    same quantity only privately (:func:`bnlab.theory.gegenbauer._log_c_at_one_over_c`)
    and without the B = 3 case.
    """
    l = np.asarray(l, dtype=np.float64)
    if batch_size == 3:
        return np.where(l == 0, 0.0, math.log(2.0))
    lam2 = batch_size - 3.0
    logc1 = special.gammaln(l + lam2) - special.gammaln(lam2) - special.gammaln(l + 1.0)
    return np.log((lam2 + 2.0 * l) / lam2) + logc1


def _chebyshev_coefficients(act, n_terms: int, n_nodes: int | None = None) -> tuple[np.ndarray, SeriesMoments]:
    """B = 3 only: b_l = E[φ(√2 cos θ) P_l(cos θ)] with θ uniform on [0, π] and the
    orthonormal P_0 = 1, P_l = √2 cos(lθ) (the core refuses B = 3), and the moments
    E f², E x² f² on the same rule (see :class:`bnlab.theory.gegenbauer.SeriesMoments`).

    Gauss–Legendre on θ ∈ [0, π/2] and [π/2, π] separately, so a kink of φ at 0
    (θ = π/2) sits on a panel edge and the rule converges geometrically on each
    panel; n_nodes ≥ 2 n_terms + 200 resolves cos(lθ) for l < n_terms.
    """
    if n_nodes is None:
        n_nodes = max(2 * n_terms + 200, 400)
    x, w = special.roots_legendre(n_nodes)
    half = 0.25 * math.pi
    theta = np.concatenate([half * (x + 1.0), half * (x + 1.0) + 2.0 * half])
    wt = np.concatenate([w, w]) * half / math.pi  # uniform probability on [0, π]
    fx = act(math.sqrt(2.0) * np.cos(theta))
    f = fx * wt
    l = np.arange(n_terms, dtype=np.float64)
    out = np.cos(np.outer(l, theta)) @ f
    out[1:] *= math.sqrt(2.0)
    ff = f * fx
    return out, SeriesMoments(float(np.sum(ff)), float(np.sum(ff * np.cos(theta) ** 2)))


# The head of a series counts as converged when its relative Parseval tail is below this; then the
# truncated sums are used as they are (bit-identical to the plain series for analytic φ, whose
# coefficients decay geometrically), otherwise the tails are summed through the moments.
_CONVERGED_PARSEVAL_RTOL = 1e-12


@dataclass(frozen=True)
class _GegenbauerSeries:
    """Head (l < n) of the Gegenbauer series of φ on the batchnorm sphere and the moments that sum its tails.

    a: the paper's coefficients, φ(√(B−1)x) = Σ a_l c_{B−1,l}⁻¹ C_l^{((B−3)/2)}(x) (Thm 3.4);
    logn: log N_l; coef: the orthonormal b_l = a_l √N_l; pxi: R_l(ξ) = C_l(ξ)/C_l(1) at
    ξ = −1/(B−1); moments: E f², E x² f², E(1−x²)f'² (:class:`~bnlab.theory.gegenbauer.SeriesMoments`);
    summed: whether the head is unconverged, so that :meth:`single_point` returns the moment.

    Why this sums the tails (Yang et al. 2019, Thms 3.4, 3.8, 3.9, F.13, F.22, F.24, G.5).  Every
    series of the theory is a quadratic form in b whose weights split into a *single-point* part
    (no R_l(ξ)) and a *two-point* part (a factor R_l(ξ) or R_{l+2}(ξ), from the addition theorem
    E_v F(ê_1·v)H(ê_2·v) = Σ_l F_l H_l R_l(ξ)).  The single-point part is a moment of one
    coordinate, E_μ[f² p(x)] or E_μ[(1−x²)f'²], which the quadrature rule of the coefficients gives
    to 1e-14 whatever the smoothness of φ; the two-point part converges like |R_l(ξ)| b_l² l^k,
    with |R_l(ξ)| ≲ l^{−(B−3)/2} (far faster for l ≲ B).  For φ with a kink b_l² ~ l^{−4} only once
    l ≫ B (relu: b_l² l⁴ is still growing at l = 800 for B = 1024), so the plain sums converge like
    n^{−3} (Parseval) and n^{−1} (Σ l(l+B−3) b_l²) from a large constant and no power-law tail model
    is asymptotic at affordable n for large B; the moments need no model.
    """

    a: np.ndarray
    logn: np.ndarray
    coef: np.ndarray
    pxi: np.ndarray
    moments: SeriesMoments
    summed: bool

    def single_point(self, head_sum: float, moment: float) -> float:
        """The full single-point series: its moment when the head is unconverged, else the head's sum."""
        return float(moment) if self.summed else float(head_sum)

    def two_point_bound(self, tail: float) -> float:
        """Bound on the neglected two-point tail Σ_{l≥n} c_l R_l(ξ), given Σ_{l≥n} |c_l| ≤ ``tail``
        (:func:`bnlab.theory.gegenbauer.oscillating_tail_bound`)."""
        return oscillating_tail_bound(self.pxi, tail)

    @property
    def parseval_tail(self) -> float:
        """Σ_{l≥n} b_l² = E f² − Σ_{l<n} b_l² (≥ 0 up to rounding)."""
        return max(self.moments.second - float(np.sum(self.coef**2)), 0.0)


def _gegenbauer_energy(act, batch_size: int, n_terms: int, *, dirichlet: bool = False) -> _GegenbauerSeries:
    """The first ``n_terms`` Gegenbauer coefficients of φ(√(B−1)x) with their moments (:class:`_GegenbauerSeries`).

    b_l from :func:`bnlab.theory.gegenbauer.gegenbauer_series_moments` (B ≥ 4) or the Chebyshev
    special case (B = 3, where the core's normalization c_{B−1,l} = (B−3)/(B−3+2l) vanishes);
    R_l(ξ) from :func:`bnlab.theory.gegenbauer.normalized_gegenbauer`.  ``dirichlet`` also
    evaluates E(1−x²)f'² (B ≥ 4).  Accuracy: that of the core, ≈1e-14 ‖φ‖ per coefficient and
    ≈1e-14 relative for the moments.
    """
    b = batch_size
    l = np.arange(n_terms)
    logn = _log_harmonic_dimension(l, b)
    xi = -1.0 / (b - 1)
    if b == 3:
        bcoef, mom = _chebyshev_coefficients(act, n_terms)
        pxi = np.cos(l * math.acos(xi))  # P_l = T_l (λ = 0)
    else:
        bcoef, mom = gegenbauer_series_moments(act, b, n_terms, dirichlet=dirichlet)
        pxi = normalized_gegenbauer(b, n_terms, np.array(xi))
    a = bcoef * np.exp(-0.5 * logn)
    head = float(np.sum(bcoef**2))
    summed = mom.second - head > _CONVERGED_PARSEVAL_RTOL * abs(mom.second)
    return _GegenbauerSeries(a, logn, bcoef, pxi, mom, bool(summed))


def _default_terms(act, batch_size: int) -> int:
    # smooth φ: coefficients decay geometrically; kinks (homogeneous φ): the single-point tails are
    # summed through the moments and the two-point remainder decays like R_l(ξ) ~ l^{−(B−3)/2}
    # (_GegenbauerSeries).  That is slowest at B ≤ 5, where the remainder of λ_G↓ for relu decays only
    # like n^{−3/2} with an oscillating phase (measured 8e-8 at 400 terms, 1e-8 at 1000, 3e-9 at
    # 1600 for B = 4): 1000 terms there (0.2 s); at B ≥ 8 400 terms leave ≤ 3e-11.
    if act.homogeneity is None and not getattr(act, "kinks", ()):
        return 160  # smooth: geometric decay
    return 1000 if batch_size <= 5 else 400


def _relu_arccos_kernel(c: float) -> tuple[float, float]:
    """J_1(c) = (√(1−c²) + (π − arccos c) c)/π and J_1'(c) = (π − arccos c)/π (Cho & Saul 2009),
    as 2 k_1(c) and 2 k_0(c) with k_α = :func:`bnlab.theory.vphi.alpha_relu_kernel`
    (c_1 = 1/2; Price: k_1' = k_0).  Agrees with the elementary form to 2e-16 at c = −1/(B−1)."""
    return 2.0 * float(alpha_relu_kernel(1.0, c)), 2.0 * float(alpha_relu_kernel(0.0, c))


# ---------------------------------------------------------------------------
# numerical engine shared by forward.py, backward.py and cross_batch.py (moved from forward.py)
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _SphereGrid:
    """Nodes (x, y) = (u_1, u_2), weights w (Σw = 1) and squared whitened radius s.

    The Jacobi rule carries a factor s^beta in its weight: integrands must be
    divided by ``s**beta`` (see :meth:`expect`).  ``s`` is None for rules with β = 0 that
    do not carry it (the kink-split rule of :mod:`._kinks`).

    ``starts`` (kink-split rules of :mod:`._kinks` only): the nodes come in runs of equal x (the
    outer variable of an iterated rule); ``starts`` are the first node of each run.  Every integrand
    of the routes is F(u_1) G(u_2) P(u_1, u_2) with P a polynomial of degree ≤ 3 in u_2 (the other
    coordinates enter through the conditional moments of :func:`_conditional_moments`, quadratic in
    (u_1, u_2)), so it is Σ_runs F(x_r) Σ_j p_j(x_r) S_j(x_r) with the per-run sums
    S_j = Σ_inner w G(y) y^j (:meth:`power_sums`): F is evaluated once per run (:attr:`x_distinct`,
    a few hundred points instead of tens of thousands) and G once per node.  The same sum,
    reordered (agreement with the node-by-node sum ≤ 2e-15 relative).  A rule without runs is
    treated as one run per node.
    """

    batch_size: int
    beta: float
    x: np.ndarray
    y: np.ndarray
    w: np.ndarray
    s: np.ndarray | None
    starts: np.ndarray | None = None
    #: kink rule: every run is a whole number of panels of ``panel_size`` consecutive nodes, and
    #: ``run_panels`` are the first panel of each run (sums over a run are sums over panels, then runs)
    panel_size: int | None = None
    run_panels: np.ndarray | None = None
    #: kink rule: panel p's nodes are y = lo_p + len_p τ_t with the same τ for every panel (``panel_lo``,
    #: ``panel_len``, ``tau``), so Σ_t w v y^j = Σ_i C(j, i) lo_p^{j−i} len_p^i Σ_t (w v) τ_t^i: one BLAS
    #: product (panels × nodes)·(nodes × powers) instead of a (powers × nodes) array per function
    panel_lo: np.ndarray | None = None
    panel_len: np.ndarray | None = None
    tau: np.ndarray | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def expect(self, values: np.ndarray) -> np.ndarray:
        if self.beta != 0.0:
            values = values / self.s**self.beta
        return values @ self.w

    @property
    def x_distinct(self) -> np.ndarray:
        """u_1 once per run (every node when the rule has no runs)."""
        return self.x if self.starts is None else self.x[self.starts]

    def _weighted_powers(self, k: int) -> np.ndarray:
        """(k+1, nodes): (w / s^β) y^j, j = 0…k, made once per rule."""
        key = ("powers", k)
        if key not in self._cache:
            wt = self.w / self.s**self.beta if self.beta != 0.0 else self.w
            rows = [wt]
            for _ in range(k):
                rows.append(rows[-1] * self.y)
            arr = np.stack(rows)
            arr.setflags(write=False)
            self._cache[key] = arr
        return self._cache[key]

    def _per_run(self, arr: np.ndarray) -> np.ndarray:
        if self.starts is None:
            return arr
        if self.panel_size is not None:  # contiguous sums over each panel's nodes, then the few panels of a run
            per_panel = arr.reshape(arr.shape[0], -1, self.panel_size).sum(axis=2)
            return np.add.reduceat(per_panel, self.run_panels, axis=1)
        return np.add.reduceat(arr, self.starts, axis=1)

    def _panel_power_sums(self, values: np.ndarray | None, k: int) -> np.ndarray:
        wv = self.w if values is None else self.w * values
        tau_pows = self._cache.get(("tau", k))
        if tau_pows is None:
            tau_pows = self._cache[("tau", k)] = np.vander(self.tau, k + 1, increasing=True)
        m = wv.reshape(-1, self.panel_size) @ tau_pows  # (panels, k+1): Σ_t w v τ^i
        lo, ln = self.panel_lo, self.panel_len
        out = np.empty((k + 1, m.shape[0]))
        lo_pow = [np.ones_like(lo)]
        ln_pow = [np.ones_like(ln)]
        for _ in range(k):
            lo_pow.append(lo_pow[-1] * lo)
            ln_pow.append(ln_pow[-1] * ln)
        for j in range(k + 1):
            acc = np.zeros_like(lo)
            for i in range(j + 1):
                acc += math.comb(j, i) * lo_pow[j - i] * ln_pow[i] * m[:, i]
            out[j] = acc
        return np.add.reduceat(out, self.run_panels, axis=1)

    def power_sums(self, values: np.ndarray | None, k: int) -> np.ndarray:
        """(k+1, runs): Σ over each run of (w / s^β) y^j ``values`` (values at the nodes' u_2; None: 1)."""
        if self.tau is not None:
            if values is None:
                key = ("run powers", k)
                if key not in self._cache:
                    arr = self._panel_power_sums(None, k)
                    arr.setflags(write=False)
                    self._cache[key] = arr
                return self._cache[key]
            return self._panel_power_sums(values, k)
        if values is None:
            key = ("run powers", k)
            if key not in self._cache:
                arr = self._per_run(self._weighted_powers(k))
                arr.setflags(write=False)
                self._cache[key] = arr
            return self._cache[key]
        return self._per_run(self._weighted_powers(k) * values)


@lru_cache(maxsize=64)
def _sphere_grid(batch_size: int, beta: float = 0.0, n_s: int = 48, h_theta: float = 1.0 / 12) -> _SphereGrid:
    """Quadrature for E over u uniform on S^{B−2} ⊂ W of functions of (u_1, u_2) (and, via
    :func:`_conditional_moments`, quadratic in the other coordinates).

    (u_1, u_2) = M^{1/2} √s (cos θ, sin θ) with M = I_2 − 11ᵀ/B; the density is
    (a+1)(1−s)^a ds dθ/2π with a = (B−5)/2 (projection of the uniform measure
    on S^{n−1}, n = B−1, onto a 2-plane).  s: Gauss–Jacobi with weight
    (1−s)^a s^beta (exact for s^beta·polynomial: positive-homogeneous φ).
    θ: the circle is cut where u_1 = 0 or u_2 = 0 (the kinks of relu-like φ)
    and each arc is integrated by tanh–sinh quadrature, which converges
    exponentially even with algebraic endpoint singularities (relu^α, its
    derivative); arcs 3, 4 are arcs 1, 2 shifted by π with the same relative
    nodes, so the rule is symmetric under u → −u and smooth integrands are
    smooth functions of s.  B = 3: the circle, s ≡ 1.
    """
    b = int(batch_size)
    if b > MAX_QUADRATURE_BATCH:
        raise ValueError(
            f"batch_size={b} is not allowed for the quadrature methods: expected batch_size <= "
            f"{MAX_QUADRATURE_BATCH} (method='closed' covers relu and identity at any B)"
        )
    r1 = math.sqrt(1.0 - 2.0 / b)
    msq = 0.5 * np.array([[r1 + 1.0, r1 - 1.0], [r1 - 1.0, r1 + 1.0]])
    ta, tb = sorted(math.atan2(row[0], -row[1]) % math.pi for row in msq)
    # the |kh| ≤ 3.3 range keeps the omitted weights below 1e-22
    xs, xcs, ws = _tanh_sinh_step(h_theta, 3.3)
    thetas, tw = [], []
    for shift in (0.0, math.pi):
        for lo, hi in ((ta, tb), (tb, ta + math.pi)):
            length = hi - lo
            thetas.append(np.where(xs <= 0.5, lo + length * xs, hi - length * xcs) + shift)
            tw.append(ws * length)
    theta = np.concatenate(thetas)
    wtheta = np.concatenate(tw) / (2.0 * math.pi)
    if b == 3:
        s, w_s = np.array([1.0]), np.array([1.0])
        beta = 0.0
    else:
        if beta <= -1.0:
            raise ValueError(f"the radial exponent {beta} makes the spherical integral diverge")
        a = (b - 5) / 2.0
        z, wz = special.roots_jacobi(n_s, a, beta)
        s = 0.5 * (z + 1.0)
        # Jacobi weight (1−z)^a (1+z)^β dz = 2^{a+β+1} (1−s)^a s^β ds; density (a+1)(1−s)^a
        w_s = wz * math.exp(-(a + beta + 1) * math.log(2.0)) * (a + 1.0)
    uv = msq @ np.stack([np.cos(theta), np.sin(theta)])
    rs = np.sqrt(s)
    return _SphereGrid(
        b,
        float(beta),
        np.outer(rs, uv[0]).ravel(),
        np.outer(rs, uv[1]).ravel(),
        np.outer(w_s, wtheta).ravel(),
        np.repeat(s, theta.size),
    )


def _conditional_coefficients(batch_size: int) -> tuple[float, float]:
    """(1/m, 1/(m(m−1))), m = B − 2, the factors of the conditional moments written as polynomials:
    with e3, e33, e34 of :func:`_conditional_moments`,
    e3 = −(x + y)/m,  e33 = (1 − x² − y²)/m,  e34 = (2x² + 2xy + 2y² − 1)/(m(m−1))  (e34 = 0 for m = 1)
    (expand ρ² = 1 − x² − y² − (x + y)²/m; checked against :func:`_conditional_moments` in the tests)."""
    m = batch_size - 2.0
    return 1.0 / m, (1.0 / (m * (m - 1.0)) if m > 1 else 0.0)


def sphere_brackets_forward(grid: _SphereGrid, f1: np.ndarray, f2: np.ndarray) -> np.ndarray:
    """[E f_1², E f_1 f_2, E f_1² x², E f_1² y², E f_1² xy, E f_1² y e3, E f_1 f_2 x², E f_1 f_2 e33,
    E f_1 f_2 xy, E f_1 f_2 x e3, E f_1 f_2 e34] (App. F.3.1) from f_1 = f(√B u_1) per run and
    f_2 = f(√B u_2) per node (see :class:`_SphereGrid`)."""
    x = grid.x_distinct
    c1, c2 = _conditional_coefficients(grid.batch_size)
    a0, a1, a2 = grid.power_sums(None, 2)
    s0, s1, s2 = grid.power_sums(f2, 2)
    ff = f1 * f1
    return np.array([
        ff @ a0,
        f1 @ s0,
        (ff * x * x) @ a0,
        ff @ a2,
        (ff * x) @ a1,
        -c1 * (ff @ (x * a1 + a2)),
        (f1 * x * x) @ s0,
        c1 * (f1 @ ((1.0 - x * x) * s0 - s2)),
        (f1 * x) @ s1,
        -c1 * ((f1 * x) @ (x * s0 + s1)),
        c2 * (f1 @ ((2.0 * x * x - 1.0) * s0 + 2.0 * x * s1 + 2.0 * s2)),
    ])


def sphere_brackets_backward(grid: _SphereGrid, g1: np.ndarray, g2: np.ndarray) -> np.ndarray:
    """The eleven brackets of the backward map (App. G; order [11|11], [11|22], [11|12], [11|23], [12|11],
    [12|33], [12|12], [12|21], [12|13], [12|34], [12|31]) from g_1 = φ'(√B u_1) per run and
    g_2 = φ'(√B u_2) per node, with the projections P_ij = δ_ij − u_i u_j of Ã = P_u D G."""
    x = grid.x_distinct
    c1, c2 = _conditional_coefficients(grid.batch_size)
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


def sphere_marginals(grid: _SphereGrid, values: np.ndarray) -> tuple[float, float]:
    """(E v(u_1), E v(u_1) u_1²) from v per run."""
    x = grid.x_distinct
    a0 = grid.power_sums(None, 0)[0]
    return float(values @ a0), float((values * x * x) @ a0)


def _conditional_moments(x, y, batch_size: int):
    """E[u_3 | u_1, u_2], E[u_3² | ·], E[u_3 u_4 | ·] for u uniform on S^{B−2} ⊂ W.

    The other m = B − 2 coordinates w satisfy Σw = σ := −(x + y) and
    |w|² = 1 − x² − y²; w = σ/m·1 + z with z uniform on a sphere of radius ρ,
    ρ² = 1 − x² − y² − σ²/m, in the (m−1)-dim space 1^⊥, so
    E z_i z_j = ρ²/(m−1)·(δ_ij − 1/m).
    """
    m = batch_size - 2
    sig = -(x + y)
    rho2 = 1.0 - x * x - y * y - sig * sig / m
    e3 = sig / m
    e33 = e3 * e3 + rho2 / m
    e34 = e3 * e3 - rho2 / (m * (m - 1)) if m > 1 else np.zeros_like(e3)
    return e3, e33, e34


def _radial_inverse_moment(batch_size: int, power: float) -> float:
    """E[r^{−p}] for r ~ χ_{B−1}: 2^{−p/2} Γ((n−p)/2)/Γ(n/2), n = B − 1 (inf when p ≥ n)."""
    n = batch_size - 1
    if power >= n:
        return math.inf
    # Γ-ratios via the Pochhammer symbol: differences of log-gammas lose ~1e-10 at B ~ 1e5
    return 2.0 ** (-0.5 * power) / special.poch((n - power) / 2.0, power / 2.0)


def _sample_sphere(batch_size: int, n_samples: int, rng: np.random.Generator) -> np.ndarray:
    """n × B samples of u uniform on the unit sphere of the sum-zero hyperplane."""
    z = rng.standard_normal((n_samples, batch_size))
    z -= z.mean(axis=1, keepdims=True)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def _ratio_stats(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """Ratio of means and its delta-method standard error."""
    n = num.size
    r = num.mean() / den.mean()
    resid = num - r * den
    return float(r), float(resid.std(ddof=1) / (abs(den.mean()) * math.sqrt(n)))


def _relu_or_identity(act) -> str | None:
    """'relu' or 'identity' when φ is one of them up to a positive scale (which batchnorm ignores), else None.

    These are the φ for which the dynamics (Thms 3.7, 3.10, 3.11, G.12, H.6) have closed forms.
    """
    if act.homogeneity != 1.0 or act.homogeneous_coeffs is None:
        return None
    a, b = act.homogeneous_coeffs
    if a > 0 and b == 0.0:
        return "relu"
    if a > 0 and b == a:
        return "identity"
    return None


def _check_method(method, allowed, what: str) -> str:
    method = check_choice("method", method, _ALL_METHODS)
    if method not in allowed:
        raise ValueError(
            f"method={method!r} is not allowed for {what}: the paper's {method} method is only developed for the "
            f"fixed point here; expected one of {', '.join(map(repr, allowed))}"
        )
    return method


#: Routes of the three dynamics (forward, backward, cross-batch); "fourier" is developed for the fixed point only.
DYNAMICS_METHODS = ("auto", "closed", "laplace", "sphere", "gegenbauer", "montecarlo")


@dataclass(frozen=True)
class _Dynamics:
    """What differs between the forward, backward and cross-batch routes' preconditions.

    what: the quantity, for messages; closed_refs: the theorems of its closed forms;
    closed_min_batch: the smallest B of the closed forms; gegenbauer_min_batch: that of the
    Gegenbauer route; check: extra preconditions on (act, B), run before anything else.
    """

    what: str
    closed_refs: str
    closed_min_batch: int = 3
    gegenbauer_min_batch: int = 3
    check: object = None
    #: the power p of B in the Monte Carlo route's work per sample (B^p elementwise operations)
    montecarlo_batch_power: int = 1


@dataclass(frozen=True)
class _Route:
    """The resolved φ, the checked B and the chosen route (never "auto") with its own arguments."""

    act: object
    batch_size: int
    method: str
    relu_or_identity: str | None
    n_terms: int | None = None
    n_samples: int | None = None
    rng: object = None


def _choose_route(phi, batch_size, method, dynamics: _Dynamics, *, n_terms=None, n_samples=None, seed=None) -> _Route:
    """The one prologue of :func:`~bnlab.theory.forward_eigenvalues`, :func:`~bnlab.theory.backward_eigenvalues`
    and :func:`~bnlab.theory.cross_batch_analysis`: resolve φ (once, :func:`bnlab.activations.get_activation`),
    check B and the method, pick the route ("auto": the closed form for relu and identity where it applies,
    else the spherical integral) and check what that route needs (its B range, a positive-homogeneous φ for
    Laplace, the number of Gegenbauer terms, the Monte Carlo sample size and seed)."""
    from bnlab.activations import get_activation

    act = get_activation(phi)
    b = check_batch_size(batch_size)
    if dynamics.check is not None:
        dynamics.check(act, b)
    method = _check_method(method, DYNAMICS_METHODS, dynamics.what)
    kind = _relu_or_identity(act)
    if method == "auto":
        if kind is not None and b >= max(4, dynamics.closed_min_batch):
            method = "closed"
        elif _laplace_applies(act, b):
            # every other positive-homogeneous φ (leaky relu, abs, relu^α): the Laplace closed forms (Thms F.33,
            # G.12, H.14; hypergeometric kernels, ≈1e-13, agree with the sphere and Gegenbauer routes to ≤ 1e-12
            # at 4 ≤ B ≤ 128, tests/theory/test_kinks.py) — no quadrature of φ' singular at its kink (relu^α, α < 1)
            method = "laplace"
        else:
            method = "sphere"
    route = dict(act=act, batch_size=b, method=method, relu_or_identity=kind)
    if method == "closed":
        if kind is None:
            raise ValueError(
                f"method='closed' is not available for phi={act.spec!r}: {dynamics.what} have closed forms for relu "
                f"and identity only ({dynamics.closed_refs}); use method='sphere' or 'gegenbauer'"
            )
        if b < dynamics.closed_min_batch:
            raise ValueError(
                f"method='closed' needs batch_size >= {dynamics.closed_min_batch} ({dynamics.closed_refs} assume "
                f"B > {dynamics.closed_min_batch - 1}); got batch_size={b}"
            )
    elif method == "laplace":
        _require_laplace(act, b, dynamics.what)
    elif method == "gegenbauer":
        if b > MAX_QUADRATURE_BATCH:
            raise ValueError(f"batch_size={b} is not allowed for method='gegenbauer': expected <= {MAX_QUADRATURE_BATCH}")
        if b < dynamics.gegenbauer_min_batch:
            # Thm 3.8 / F.22 divide by B − 3 (c_{B−1,l} = (B−3)/(B−3+2l) vanishes at B = 3)
            raise ValueError(
                f"batch_size={b} is not allowed for method='gegenbauer': the Gegenbauer route needs batch_size >= "
                f"{dynamics.gegenbauer_min_batch} (Thm 3.8 divides by B − 3); use method='sphere' for batch_size={b}"
            )
        route["n_terms"] = _default_terms(act, b) if n_terms is None else check_int("n_terms", n_terms, minimum=4)
    elif method == "montecarlo":
        route["n_samples"], route["rng"] = _montecarlo_samples(n_samples, seed)
        _check_montecarlo_work(route["n_samples"], b, dynamics)
    return _Route(**route)


#: Seconds of one core per unit of Monte Carlo work n_samples·B^p, measured on tanh (B = 64…256,
#: float64, this package's chunked routes): ≈1e-7 for the O(B) routes (fixed point, forward,
#: cross-batch), ≈1.5e-8 per B² for the backward route's B×B matrix per sample.
_MONTECARLO_SECONDS_PER_UNIT = {1: 1e-7, 2: 1.5e-8}
#: Monte Carlo runs estimated above this many seconds are refused up front instead of running for minutes.
MAX_MONTECARLO_SECONDS = 60.0


def montecarlo_seconds(n_samples: int, b: int, batch_power: int = 1) -> float:
    """Estimated one-core seconds of a Monte Carlo route with work n_samples·B^batch_power."""
    return float(n_samples) * float(b) ** batch_power * _MONTECARLO_SECONDS_PER_UNIT[batch_power]


def check_montecarlo_cost(n_samples: int, b: int, what: str, batch_power: int = 1) -> None:
    """Refuse a Monte Carlo run whose estimated time exceeds :data:`MAX_MONTECARLO_SECONDS`."""
    secs = montecarlo_seconds(n_samples, b, batch_power)
    if secs > MAX_MONTECARLO_SECONDS:
        most = int(n_samples * MAX_MONTECARLO_SECONDS / secs)
        raise ValueError(
            f"batch_size={b} is not allowed for method='montecarlo' with n_samples={n_samples}: {what} would take "
            f"about {secs:.0f} s (> {MAX_MONTECARLO_SECONDS:.0f} s); use n_samples <= {max(most, 0)} (standard "
            "errors grow as 1/sqrt(n_samples)) or a deterministic method ('auto', 'sphere', 'gegenbauer')"
        )


def _check_montecarlo_work(n_samples: int, b: int, dynamics: "_Dynamics") -> None:
    check_montecarlo_cost(n_samples, b, dynamics.what, dynamics.montecarlo_batch_power)


def _montecarlo_samples(n_samples, seed):
    n = check_int("n_samples", n_samples, minimum=100)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return n, rng


def _laplace_kernel_values(act, b: int) -> dict:
    """c_α, J_φ(1), J_φ(ξ), J'_φ(ξ), J'_φ(0) (ξ = −1/(B−1)) and μ* for φ = aρ_α − bρ_α(−·).

    c_α J_φ(c) = k_φ(c) = E φ(x)φ(y) for unit Gaussians of correlation c (Defn E.7, E.9,
    :func:`bnlab.theory.vphi.homogeneous_kernel`, hypergeometric closed form), and by Price's
    theorem k_φ'(c) = α²((a²+b²) k_{α−1}(c) + 2ab k_{α−1}(−c)) (valid for |c| < 1, α > 0).
    μ* = q*(1 − c*) from the closed BSB1 fixed point (Thm F.8).
    """
    from bnlab.theory.fixed_point import bsb1_fixed_point
    from bnlab.theory.vphi import alpha_relu_kernel, alpha_relu_second_moment, homogeneous_kernel

    al = float(act.homogeneity)
    a, bb = act.homogeneous_coeffs
    ca = alpha_relu_second_moment(al)
    xi = -1.0 / (b - 1)

    def dk(c):
        return al * al * ((a * a + bb * bb) * alpha_relu_kernel(al - 1.0, c) + 2 * a * bb * alpha_relu_kernel(al - 1.0, -c))

    fp = bsb1_fixed_point(act, b, method="closed")
    return dict(
        alpha=al, c_alpha=ca, J1=float(homogeneous_kernel(act, 1.0)) / ca, Jxi=float(homogeneous_kernel(act, xi)) / ca,
        dJxi=float(dk(xi)) / ca, dJ0=float(dk(0.0)) / ca, mu=fp.q_star * (1.0 - fp.c_star),
    )


def _laplace_applies(act, b: int) -> bool:
    """Whether the Laplace closed forms apply: φ positive-homogeneous of degree α with (B−1)/2 > α, B ≥ 4."""
    return (
        act.homogeneity is not None and act.homogeneous_coeffs is not None and b >= 4
        and (b - 1) / 2.0 > act.homogeneity
    )


def _require_laplace(act, b: int, what: str):
    if act.homogeneity is None or act.homogeneous_coeffs is None:
        raise ValueError(
            f"method='laplace' does not apply to phi={act.spec!r}: the Laplace method needs a positive-homogeneous φ "
            f"(relu, leaky_relu, alpha_relu, abs, identity); use method='sphere' or 'gegenbauer' for {what}"
        )
    if not (b - 1) / 2.0 > act.homogeneity:
        raise ValueError(f"method='laplace' needs (B−1)/2 > α (Thm F.33); got batch_size={b}, α={act.homogeneity:g}")


def _check_finite(act, b, method, *values):
    for v in values:
        if v is not None and not math.isfinite(v):
            raise ValueError(
                f"the eigenvalues for phi={act.spec!r}, batch_size={b} by method={method!r} are not finite: "
                "φ is not square-integrable against the spherical measure (Thm 3.9 assumptions)"
            )
