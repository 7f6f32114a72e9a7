"""Rules on the batchnorm sphere (private; the floor of :mod:`bnlab.theory`, Yang et al. 2019, Thm 3.3, App. F.3).

The spherical routes (fixed point Thm F.5, forward App. F.3.1, backward Thm 3.9 / App. G,
cross-batch Thm 3.11 / App. H, ε > 0 §3.1.2) integrate functions of (u_1, u_2), the first two coordinates
of u uniform on the unit sphere of the sum-zero hyperplane of R^B, or of one coordinate u_1.  This module
holds their rules, as nodes and weights; it imports only the one-dimensional rules of :mod:`.rules` and
the kink cuts of :mod:`.kinks`.

* :class:`SphereGrid` — nodes (u_1, u_2), weights and, for iterated rules, the runs of equal u_1 that let
  a function of u_1 be evaluated once per run;
* :func:`sphere_grid` — the (s, θ) rule: Gauss–Jacobi in the squared radius s (exact for s^β ×
  polynomial: positive-homogeneous φ) and tanh-sinh arcs in θ cut where u_1 = 0 or u_2 = 0;
* :func:`cartesian_sphere_grid` — the Cartesian rule with every panel ending at a kink (below), B ≥ 4;
* :func:`circle_grid` — B = 3, where the sphere is a circle: tanh-sinh arcs ending at every kink;
* :func:`sphere_grid_for` — which of the two a φ needs;
* :func:`conditional_moments` — the other coordinates given (u_1, u_2), which every integrand of the
  routes reduces to;
* the pair rules of the ε > 0 routes (:func:`pair_rule`, :func:`angle_rule`, :func:`kinked_pair_nodes`,
  :func:`pair_nodes`): (x_1, x_2) = √T (cos θ, cos(θ − θ_0)) with T ~ Beta(1, (B−3)/2);
* Monte Carlo on the sphere: :func:`sample_sphere`, :func:`ratio_stats`.

The kink-split rule
-------------------
The spherical routes (fixed point Thm F.5, forward App. F.3.1, backward Thm 3.9 / App. G,
cross-batch Thm 3.11 / App. H) integrate functions of (u_1, u_2), the first two coordinates of u
uniform on the unit sphere of the sum-zero hyperplane of R^B, or of one coordinate u_1.  Their
rules in :func:`sphere_grid` and :mod:`bnlab.theory.spherical` are cut where u_1 = 0 or u_2 = 0 only:
exact for positive-homogeneous φ (the radial part is a Jacobi weight s^β), but a kink of
φ(√B u_1) at u_1 = k ≠ 0 (relu(γx + β), leaky relu with β) crosses their (s, θ) cells along a
curve, and a non-homogeneous φ kinked at 0 (selu, elu) is not polynomial in s along a ray, so
the rules converge only algebraically there (λ_G↓ of relu(x + 1) at B = 32: 6e-4 off; selu:
1e-4).  Here the integrals are iterated in Cartesian coordinates with every panel ending at a
kink, so each panel's integrand is smooth up to algebraic endpoint singularities, which
tanh-sinh quadrature integrates at its exponential rate (and Gauss–Legendre, with far fewer
nodes, once the density's endpoint exponent is large: see below).

Density of (x, y) = (u_1, u_2) (projection of the uniform measure on S^{B−2} ⊂ W onto a
2-plane; B ≥ 4): with M = I_2 − 11ᵀ/B, Q(x, y) = (x, y) M⁻¹ (x, y)ᵀ = x² + y² + (x + y)²/(B−2),

    p(x, y) = (a + 1)/(π √det M) · (1 − Q)^a  on Q < 1,   a = (B − 5)/2,  det M = 1 − 2/B,

which is the (s, θ) density (a+1)(1−s)^a ds dθ/2π of :func:`sphere_grid`
written in Cartesian coordinates.  For fixed x, 1 − Q = p_B (y − y₋)(y₊ − y) with p_B = (B−1)/(B−2),
so the inner panels carry the exact distances to y± (the (1 − Q)^a singularity at B = 4 is then
integrated to full precision); the outer variable ranges over |x| ≤ √((B−1)/B) and is cut at the
kinks k and where a kink line y = k enters or leaves the ellipse (Q(x, k) = 1), where the inner
integral is not smooth in x.  Each panel gets the same rule on (0, 1): Gauss–Legendre for
16 ≤ B ≤ 512 (the panels' integrands are analytic up to their ends but for the density's (1 − Q)^a,
smooth there once a = (B − 5)/2 ≥ 5.5; 16–64 nodes per panel, :data:`_GAUSS_NODES`), tanh-sinh
otherwise (algebraic endpoint behaviour at small B, :data:`_STEPS`).

Where the integrand is singular at a kink, the tanh-sinh nodes reach 5e-62 of a panel's length
from its ends (half-width 4.5 instead of 3.2), so that φ' singular at a kink at 0 (relu^α, ½ < α < 1: (φ')² ~ |x|^{2α−2}) loses nothing
(the rule of :func:`sphere_grid` stops at 2e-17: relu^0.6 λ_G↓ 5e-4 off).  A
kink k ≠ 0 with φ' singular there is resolved only to |x − k| ≈ 1e-16 |k| (rounding of k + t):
such φ are outside the measured accuracy (see docs/theory-methods.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy import special

from bnlab.theory._quadrature.kinks import single_kink_off_zero, smoothness
from bnlab.theory._quadrature.rules import gauss_legendre_unit, tanh_sinh_rule

__all__ = [
    "MAX_QUADRATURE_BATCH",
    "SphereGrid",
    "sphere_grid",
    "cartesian_sphere_grid",
    "sphere_grid_for",
    "circle_grid",
    "conditional_coefficients",
    "conditional_moments",
    "angle_rule",
    "pair_rule",
    "kinked_pair_nodes",
    "pair_nodes",
    "sample_sphere",
    "ratio_stats",
]

MAX_QUADRATURE_BATCH = 2048  # the Gauss–Jacobi weights (∝ 2^{(B−5)/2}) overflow beyond this
#: the highest power of u_2 in the routes' power sums (the backward brackets' y³): the panel rule's tables are
#: made once for this k and cut for smaller k (:meth:`SphereGrid.power_sums`)
_PANEL_POWERS = 3


@dataclass(frozen=True)
class SphereGrid:
    """Nodes (x, y) = (u_1, u_2), weights w (Σw = 1) and squared whitened radius s.

    The Jacobi rule carries a factor s^beta in its weight: integrands must be
    divided by ``s**beta`` (see :meth:`expect`).  ``s`` is None for rules with β = 0 that
    do not carry it (the kink-split rule of this module).

    ``starts`` (kink-split rules of this module only): the nodes come in runs of equal x (the
    outer variable of an iterated rule); ``starts`` are the first node of each run.  Every integrand
    of the routes is F(u_1) G(u_2) P(u_1, u_2) with P a polynomial of degree ≤ 3 in u_2 (the other
    coordinates enter through the conditional moments of :func:`conditional_moments`, quadratic in
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
        # every k ≤ _PANEL_POWERS is computed as k = _PANEL_POWERS and cut: one set of tables per rule
        # (τ powers, binomial shifts) serves the routes' k = 0, 2, 3 instead of one set per k, and the
        # extra powers cost nothing next to the pass over the nodes
        kk = max(k, _PANEL_POWERS)
        wv = self.w if values is None else self.w * values
        m = wv.reshape(-1, self.panel_size) @ self._tau_powers(kk)  # (panels, kk+1): Σ_t w v τ^i
        # Σ_t w v y^j with y = lo + len·τ: Σ_i C(j, i) lo^{j−i} len^i m_i, one (kk+1)×(kk+1) matrix per panel
        sums = np.einsum("jip,pi->jp", self._binomial_shift(kk), m)[: k + 1]
        return np.add.reduceat(sums, self.run_panels, axis=1)

    def _tau_powers(self, k: int) -> np.ndarray:
        key = ("tau", k)
        if key not in self._cache:
            self._cache[key] = np.vander(self.tau, k + 1, increasing=True)
        return self._cache[key]

    def _binomial_shift(self, k: int) -> np.ndarray:
        """(k+1, k+1, panels): C(j, i) lo^{j−i} len^i for i ≤ j, else 0 — made once per rule."""
        key = ("shift", k)
        if key not in self._cache:
            lo_pow = np.vander(self.panel_lo, k + 1, increasing=True).T  # (k+1, panels)
            ln_pow = np.vander(self.panel_len, k + 1, increasing=True).T
            shift = np.zeros((k + 1, k + 1, self.panel_lo.size))
            for j in range(k + 1):
                for i in range(j + 1):
                    shift[j, i] = math.comb(j, i) * lo_pow[j - i] * ln_pow[i]
            shift.setflags(write=False)
            self._cache[key] = shift
        return self._cache[key]

    def power_sums(self, values: np.ndarray | None, k: int) -> np.ndarray:
        """(k+1, runs): Σ over each run of (w / s^β) y^j ``values`` (values at the nodes' u_2; None: 1)."""
        if self.tau is not None:
            if values is None:
                kk = max(k, _PANEL_POWERS)  # one table for every k ≤ _PANEL_POWERS (cut below)
                key = ("run powers", kk)
                if key not in self._cache:
                    arr = self._panel_power_sums(None, kk)
                    arr.setflags(write=False)
                    self._cache[key] = arr
                return self._cache[key][: k + 1]
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
def sphere_grid(batch_size: int, beta: float = 0.0, n_s: int = 48, h_theta: float = 1.0 / 12) -> SphereGrid:
    """Quadrature for E over u uniform on S^{B−2} ⊂ W of functions of (u_1, u_2) (and, via
    :func:`conditional_moments`, quadratic in the other coordinates).

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
    xs, xcs, ws = tanh_sinh_rule(h_theta, 3.3)
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
    return SphereGrid(
        b,
        float(beta),
        np.outer(rs, uv[0]).ravel(),
        np.outer(rs, uv[1]).ravel(),
        np.outer(w_s, wtheta).ravel(),
        np.repeat(s, theta.size),
    )


# tanh-sinh on (0, 1) for integrands singular at a kink: half-width 4.5 (nodes reach t ≈ 5e-62; omitted
# weights < 1e-60); the step by B: _STEPS
_HALF_WIDTH = 4.5

#: tanh-sinh step of the kink-split rule by the largest B it serves where Gauss–Legendre is not used (B < 16,
#: B > 512, and integrands singular at a kink; the density is a peak of width ~B^{−1/2}: the step shrinks with
#: B).  Measured: the largest relative change of q*, q*c*, λ_L↑, λ_M↑, λ_G↓, λ_L↓, λ_M↓, c_CB*, λ_M̃ against
#: step 1/40, worst over relu(γx + β) for (1, 1), (1, −0.5), (2, 0.5), (0.5, 2), leaky relu with β = 0.5, selu,
#: elu, relu^0.6, relu(x − 0.3) + 0.1x: step 1/6 ≤ 1.2e-12 for 5 ≤ B ≤ 8 (1/5: 7e-10 at 8); 1/7 ≤ 4.3e-13 for
#: B ≤ 12; 1/8 ≤ 3.9e-13 for B ≤ 16 (6e-10 at 32); 1/16 ≤ 5e-14 for 33 ≤ B ≤ 256; B = 4, where the density
#: (1 − Q)^{−1/2} is singular at the ellipse: ≈ 3e-9 with 1/16
_STEPS = ((4, 1.0 / 16.0), (8, 1.0 / 6.0), (12, 1.0 / 7.0), (16, 1.0 / 8.0), (256, 1.0 / 16.0))


#: Gauss–Legendre nodes per panel by the largest B they serve (16 ≤ B ≤ 512, integrands bounded at the
#: kinks).  Every panel ends at a kink, a crossing of a kink line with the ellipse, the density's maximum or
#: the ellipse, so its integrand is analytic inside and up to its ends except the density's (1 − Q)^a
#: factor at the ellipse, a = (B − 5)/2: smooth enough from B ≈ 16 on for Gauss–Legendre to converge
#: fast, and far fewer nodes than tanh-sinh, which spends half of its on the ellipse end where the
#: integrand vanishes.  Measured (largest relative change of the nine quantities against tanh-sinh with
#: step 1/40, worst over relu(γx + β) for (1, 1), (1, −0.5), (2, 0.5), (0.5, 2), leaky relu with β = 0.5,
#: selu, elu, relu(x − 0.3) + 0.1x): B = 16: 24 nodes 1e-13 (20: 1e-12); B = 20: 20 nodes 9e-15 (16: 2e-13);
#: B = 24, 32: 16 nodes ≤ 2.4e-14 (B = 36: 4.5e-13, 40: 5e-12, so not beyond 32); B = 64: 24 nodes 5e-15
#: (20: 4e-13); B = 128: 32 nodes 3e-14 (24: 1e-11); B = 256: 48 nodes 5e-14; B = 512: 64 nodes 9e-14
#: (32: 2e-9).  Below B = 16 (a < 5.5: 48 nodes leave 2e-13 at
#: B = 12, 5e-5 at B = 5) and above 512 the tanh-sinh steps of _STEPS are used.
_GAUSS_NODES = ((19, 24), (23, 20), (32, 16), (64, 24), (128, 32), (256, 48), (512, 64))
_GAUSS_MIN_BATCH = 16


def _panels(lo: float, hi: float, cuts) -> list[tuple[float, float]]:
    pts = sorted({lo, hi, *(c for c in cuts if lo < c < hi)})
    return [(a, b) for a, b in zip(pts[:-1], pts[1:]) if b > a]


#: Gauss–Legendre nodes per panel for analytic φ (:func:`bnlab.theory._quadrature.kinks.analytic`) by the
#: largest B they serve (16 ≤ B ≤ 512): the panels end at u_1 = 0, the density's maximum and the ellipse only,
#: and the nodes resolve φ(√B u), whose scale shrinks like B^{−1/2}.  Measured: the largest relative change of
#: the nine quantities (q*, c*, λ_L↑, λ_M↑, λ_G↓, λ_L↓, λ_M↓, c_CB* relative to q*, λ_M̃) against tanh-sinh panels
#: with step 1/48, worst over tanh, tanh(2x) + 0.1x, gelu, erf, sin, sigmoid, softplus, silu, exp(−x²) + 0.3x,
#: cos x + x: B = 16 … 32: 32 nodes ≤ 8e-13 (the steep tanh(2x) + 0.1x at B = 32; the registry's smooth φ
#: ≤ 4e-14; 24 nodes: 2e-8); B = 48, 64: 48 nodes ≤ 6e-14 (40: 2e-12 at 64); B = 96 … 192: 64 nodes ≤ 1e-13
#: (48: 2e-12 at 128); B = 256: 96 nodes 1e-13, B = 384, 512: 96 nodes ≤ 5e-13 (the bound is rounding: 128
#: and 160 nodes give 1e-12).  The (s, θ) rule that served these φ before is off by 7e-11 at B = 32, 3e-8 at
#: 64 and 2e-5 at 512 on tanh(2x) + 0.1x (its tanh-sinh arcs in θ resolve φ(√B u) only near their ends).
_SMOOTH_GAUSS_NODES = ((32, 32), (64, 48), (192, 64), (512, 96))
_SMOOTH_GAUSS_MIN_BATCH = 16


def _kink_unit_rule(batch_size: int, singular: bool, piecewise_analytic: bool = False) -> tuple:
    # integrand singular at a kink (relu^α's φ'): tanh-sinh with half-width 4.5; φ analytic on either side of
    # its kinks: Gauss–Legendre for 16 ≤ B ≤ 512 (_GAUSS_NODES); else tanh-sinh with half-width 3.2 (omitted
    # weights < 1e-20) and the step by B from _STEPS (1/32 beyond B = 256)
    if piecewise_analytic and not singular and _GAUSS_MIN_BATCH <= batch_size <= _GAUSS_NODES[-1][0]:
        return ("gauss", next(n for most, n in _GAUSS_NODES if batch_size <= most))
    step = next((h for most, h in _STEPS if batch_size <= most), 1.0 / 32.0)
    return ("tanh-sinh", step, _HALF_WIDTH if singular else 3.2)


def _smooth_unit_rule(batch_size: int) -> tuple | None:
    """The panel rule for analytic φ at B (Gauss–Legendre, :data:`_SMOOTH_GAUSS_NODES`), None outside its range."""
    if not _SMOOTH_GAUSS_MIN_BATCH <= batch_size <= _SMOOTH_GAUSS_NODES[-1][0]:
        return None
    return ("gauss", next(n for most, n in _SMOOTH_GAUSS_NODES if batch_size <= most))


def _unit_nodes(unit: tuple):
    """(t, 1 − t, weights) on (0, 1) of a panel rule key: tables of universal constants (no φ, no B), cached."""
    if unit[0] == "gauss":
        return gauss_legendre_unit(unit[1])
    return _tanh_sinh_nodes(unit[1], unit[2])


@lru_cache(maxsize=16)
def _tanh_sinh_nodes(step: float, half_width: float):
    return tanh_sinh_rule(step, half_width)


@lru_cache(maxsize=64)
def cartesian_sphere_grid(batch_size: int, kinks: tuple[float, ...], unit: tuple):
    """A :class:`SphereGrid` (β = 0) for E over (u_1, u_2), iterated in Cartesian coordinates and cut at
    u_1, u_2 ∈ ``kinks``, with the panel rule ``unit`` (a key: ``("gauss", n)`` or ``("tanh-sinh", step,
    half_width)``).

    ``kinks`` are the kinks of the integrand in u (i.e. those of φ divided by √B); every outer panel also ends
    at u_1 = 0 and every inner one at the density's maximum.  B ≥ 4.  Accuracy on the quantities of nine kinked
    φ with the rules of :func:`sphere_grid_for` (see :data:`_STEPS`, :data:`_GAUSS_NODES`; change against
    tanh-sinh with step 1/40): ≈ 3e-9 at B = 4 (the density (1 − Q)^{−1/2} is singular on the ellipse),
    ≤ 1.2e-12 for 5 ≤ B ≤ 15, ≤ 4.1e-13 for 16 ≤ B ≤ 512 (Gauss–Legendre panels; the bound is relu^0.6's
    tanh-sinh rule, the others ≤ 1e-13); analytic φ without cuts: :data:`_SMOOTH_GAUSS_NODES`; the constant and
    x⁴ integrate to ≤ 1e-14.
    """
    b = int(batch_size)
    if b < 4:
        raise ValueError("the kink-split spherical rule needs batch_size >= 4")
    a = 0.5 * (b - 5)
    pb = (b - 1.0) / (b - 2.0)
    r = 1.0 / (b - 2.0)
    xmax = math.sqrt((b - 1.0) / b)
    const = (a + 1.0) / (math.pi * math.sqrt(1.0 - 2.0 / b))
    ks = [float(k) for k in kinks]
    # outer cuts: kinks in x and where the line y = k meets the ellipse: p x² + 2 r k x + p k² − 1 = 0
    cuts = list(ks) + [0.0]
    for k in ks:
        disc = r * r * k * k - pb * (pb * k * k - 1.0)
        if disc > 0:
            sq = math.sqrt(disc)
            cuts += [(-r * k - sq) / pb, (-r * k + sq) / pb]
    t, tc, wt = _unit_nodes(unit)
    half = int(np.searchsorted(t, 0.5))  # t increases: nodes below 1/2 measured from the lower end, the rest from the upper
    outer = np.array(_panels(-xmax, xmax, cuts))
    olo, ohi = outer[:, :1], outer[:, 1:]
    olen = ohi - olo
    x = np.concatenate([olo + olen * t[:half], ohi - olen * tc[half:]], axis=1).ravel()
    wx = (olen * wt).ravel()
    # inner: y between the roots y± of p y² + 2 r x y + p x² − 1 = 0
    disc = np.maximum(pb - (pb * pb - r * r) * x * x, 0.0)
    sq = np.sqrt(disc)
    ylo = (-r * x - sq) / pb
    yhi = (-r * x + sq) / pb
    kin = np.array(sorted(k for k in set(ks) if abs(k) < xmax), dtype=np.float64)
    # panel ends per outer node: y₋, every kink and the density's maximum y_c = −r x/p_B (for large B the
    # density is a peak of width ~B^{−1/2}, which the tanh-sinh nodes resolve only near panel ends), y₊;
    # points outside (y₋, y₊) are clipped onto its ends, making empty panels of zero weight (vectorized)
    yc = -r * x / pb
    if kin.size:
        inner = np.clip(np.column_stack([np.broadcast_to(kin, (x.size, kin.size)), yc]), ylo[:, None], yhi[:, None])
        ends = np.column_stack([ylo, np.sort(inner, axis=1), yhi])
    else:  # analytic φ: the maximum alone, no sort (the same ends)
        ends = np.column_stack([ylo, np.clip(yc, ylo, yhi), yhi])
    # only the non-empty panels get nodes (a kink outside (y₋, y₊) leaves an empty one); they stay in runs
    # of equal x (row-major (outer node, panel)), so functions of u_1 are evaluated once per run
    length_all = ends[:, 1:] - ends[:, :-1]
    panel_x, panel_k = np.nonzero(length_all > 0)
    lo = ends[panel_x, panel_k][:, None]
    hi = ends[panel_x, panel_k + 1][:, None]  # the ends themselves (y₊ − hi is then exactly 0 on a last panel)
    length = length_all[panel_x, panel_k][:, None]
    y = np.concatenate([lo + length * t[:half], hi - length * tc[half:]], axis=1)
    d_lo = (lo - ylo[panel_x, None]) + length * t  # exact distance to y₋ in the first panel of a chord
    d_hi = (yhi[panel_x, None] - hi) + length * tc  # exact distance to y₊ in the last one
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        dens = (pb * d_lo * d_hi) ** a if a != 0.0 else 1.0
        w = (wx[panel_x, None] * const) * (length * wt) * dens
    W = w.ravel()
    if not np.isfinite(W).all():  # never reached for B ≥ 4 (d_lo, d_hi > 0 on non-empty panels): a guard
        W[~np.isfinite(W)] = 0.0
    Y = y.ravel()
    per_x = np.bincount(panel_x, minlength=x.size)  # panels per outer node (panel_x is sorted)
    runs = np.flatnonzero(per_x)
    per_run = per_x[runs]
    counts = per_run * t.size
    X = np.repeat(x[runs], counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.intp)
    run_panels = np.concatenate([[0], np.cumsum(per_run)[:-1]]).astype(np.intp)
    for arr in (X, Y, W, starts, run_panels):
        arr.setflags(write=False)
    # s (the squared whitened radius) is only needed by rules with a radial weight s^β, β ≠ 0: not this one
    tau = np.concatenate([t[:half], 1.0 - tc[half:]])  # y = lo + length·τ on every panel (to rounding)
    plo, pln = lo.ravel().copy(), length.ravel().copy()
    for arr in (tau, plo, pln):
        arr.setflags(write=False)
    return SphereGrid(b, 0.0, X, Y, W, None, starts, int(t.size), run_panels, plo, pln, tau)


#: tanh-sinh step of the B = 3 circle rule :func:`circle_grid` (its arcs end at every kink, so each arc's integrand is
#: analytic inside; measured against a scipy.quad reference with breakpoints at the kinks (the test's), worst of q*,
#: c*, λ_L↑, c_CB* (relative to q*), λ_M̃ over relu(x + β), β ∈ {±0.5, ±1, 2}, relu(2x + 0.5), leaky relu with
#: β = 0.5, selu, elu, relu(x − 0.3) + 0.1x: ≤ 3.4e-15 with step 1/12 (1/8: 3e-15, 1/6: 8e-11; the reference is
#: good to ≈1e-15); relu^0.6's λ_M̃ (φ' singular at the kink 0, half-width 4.5) within 1e-16 of a 30-digit mpmath
#: quadrature
_CIRCLE_STEP = 1.0 / 12.0


@lru_cache(maxsize=64)
def circle_grid(kinks: tuple[float, ...], half_width: float = 3.2) -> SphereGrid:
    """The B = 3 rule cut at kinks: the batchnorm sphere of B = 3 is a circle, (u_1, u_2) = M^{1/2}(cos θ, sin θ)
    with M = I_2 − 11ᵀ/3 and θ uniform (s ≡ 1 in :func:`sphere_grid`; Yang et al. 2019, Thm 3.3 at B = 3).

    The arcs end at every θ where u_1 or u_2 is 0 or one of ``kinks`` (the kinks of the integrand in u, i.e.
    those of φ divided by √3), so each arc's integrand is analytic inside and tanh-sinh converges at its
    exponential rate (step :data:`_CIRCLE_STEP`; ``half_width`` 4.5 for integrands singular at a kink).
    :func:`sphere_grid` at B = 3 cuts at u_1 = 0 and u_2 = 0 only: a kink at u_1 = k ≠ 0 falls inside an arc
    and the rule converges algebraically (λ_M̃ of relu(x + 1) was 2.6 % off, λ_L↑ and c_CB* 4e-4).
    The conditional moments of u_3 = −(u_1 + u_2) (:func:`conditional_moments`, m = 1) are exact, so only the
    kinks in u_1, u_2 need cuts.
    """
    r1 = math.sqrt(1.0 / 3.0)
    msq = 0.5 * np.array([[r1 + 1.0, r1 - 1.0], [r1 - 1.0, r1 + 1.0]])  # M^{1/2} at B = 3
    rads = [math.hypot(row[0], row[1]) for row in msq]
    th_rows = [math.atan2(row[1], row[0]) for row in msq]
    two_pi = 2.0 * math.pi
    # u_i = R_i cos(θ − θ_i) = k  ⇔  θ = θ_i ± arccos(k/R_i).  Each cut keeps (cos, sin) of θ_cut − θ_i for the
    # coordinate(s) it is a kink of as exact numbers (k/R_i, ±√(1 − (k/R_i)²)): near a cut at a kink at 0 the
    # nodes' u_i = ∓R_i sin d is then exact to relative rounding however small the distance d, which an
    # integrand singular there (φ' of relu^α, α < 1) needs (cos θ of a rounded θ leaves |u_i| ≈ 1e-16: 1.6e-9
    # on λ_M̃ of relu^0.6)
    cuts: dict[float, dict[int, tuple[float, float]]] = {}
    for i in range(2):
        for k in sorted({0.0, *(float(v) for v in kinks)}):
            c = k / rads[i]
            if -1.0 < c < 1.0:
                sn = math.sqrt((1.0 - c) * (1.0 + c))
                for sign in (1.0, -1.0):  # θ − θ_i = ±arccos c: sin = ±√(1 − c²)
                    th = (th_rows[i] + sign * math.acos(c)) % two_pi
                    cuts.setdefault(th, {})[i] = (c, sign * sn)
    pts = sorted(cuts)
    t, tc, wt = _tanh_sinh_nodes(_CIRCLE_STEP, half_width)
    half = int(np.searchsorted(t, 0.5))
    us, weights = [[], []], []
    for j, lo in enumerate(pts):
        hi = pts[j + 1] if j + 1 < len(pts) else pts[0] + two_pi
        length = hi - lo
        if length <= 0.0:
            continue
        # nodes below 1/2 measured from the lower end, the rest from the upper: u_i = R_i cos(Δ_i + d) with
        # Δ_i = θ_end − θ_i and d the exact offset from that end
        for end, cut, d in ((lo, pts[j], length * t[:half]), (hi, pts[(j + 1) % len(pts)], -length * tc[half:])):
            cd, sd = np.cos(d), np.sin(d)
            for i in range(2):
                ca, sa = cuts[cut].get(i, (math.cos(end - th_rows[i]), math.sin(end - th_rows[i])))
                us[i].append(rads[i] * (ca * cd - sa * sd))
        weights.append(wt * length)
    x, y = np.concatenate(us[0]), np.concatenate(us[1])
    w = np.concatenate(weights) / two_pi
    for arr in (x, y, w):
        arr.setflags(write=False)
    return SphereGrid(3, 0.0, x, y, w, None)


def sphere_grid_for(act, batch_size: int, radial_power: float) -> SphereGrid:
    """The rule for the spherical integrals of φ = ``act`` at B = ``batch_size`` (radial power: that of the
    integrand for positive-homogeneous φ, ignored otherwise).

    * a kink anywhere (or an integrand singular at one; :func:`~bnlab.theory._quadrature.kinks.smoothness`): the Cartesian rule cut at
      every kink (:func:`cartesian_sphere_grid`); at B = 3, where the sphere is a circle, the circle rule cut at
      every kink (:func:`circle_grid`);
    * analytic φ, 16 ≤ B ≤ 512: the Cartesian rule with Gauss–Legendre panels and no cut
      (:data:`_SMOOTH_GAUSS_NODES`): φ is evaluated once per distinct u_1 (64–256 points) and once per node
      (4–65 thousand), where the (s, θ) rule evaluates it twice at each of its 15 360 nodes;
    * otherwise (positive-homogeneous φ with a bounded integrand, callables, B outside that range): the
      (s, θ) rule :func:`sphere_grid`, exact in s for homogeneous φ.
    """
    b = int(batch_size)
    smooth = smoothness(act, radial_power)
    if b == 3 and smooth.kink_rule:
        return circle_grid(tuple(sorted({k / math.sqrt(3.0) for k in act.kinks or (0.0,)})),
                           _HALF_WIDTH if smooth.singular else 3.2)
    if b >= 4 and smooth.kink_rule:
        ks = act.kinks or (0.0,)
        scale = math.sqrt(b)
        unit = _kink_unit_rule(b, smooth.singular, smooth.piecewise_analytic)
        return cartesian_sphere_grid(b, tuple(sorted({k / scale for k in ks})), unit)
    unit = _smooth_unit_rule(b) if act.homogeneity is None and smooth.analytic else None
    if unit is not None:
        return cartesian_sphere_grid(b, (), unit)
    return sphere_grid(b, float(radial_power) if act.homogeneity is not None else 0.0)


def conditional_coefficients(batch_size: int) -> tuple[float, float]:
    """(1/m, 1/(m(m−1))), m = B − 2, the factors of the conditional moments written as polynomials:
    with e3, e33, e34 of :func:`conditional_moments`,
    e3 = −(x + y)/m,  e33 = (1 − x² − y²)/m,  e34 = (2x² + 2xy + 2y² − 1)/(m(m−1))  (e34 = 0 for m = 1)
    (expand ρ² = 1 − x² − y² − (x + y)²/m; checked against :func:`conditional_moments` in the tests)."""
    m = batch_size - 2.0
    return 1.0 / m, (1.0 / (m * (m - 1.0)) if m > 1 else 0.0)


def conditional_moments(x, y, batch_size: int):
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


# ---------------------------------------------------------------------------
# pair rules of the ε > 0 routes: (x_1, x_2) = √T (cos θ, cos(θ − θ_0))
# ---------------------------------------------------------------------------
#: above this B the radial rule of :func:`pair_rule` switches from Gauss–Jacobi to Gauss–Laguerre
_JACOBI_MAX_B = 400


@lru_cache(maxsize=64)
def pair_rule(batch_size: int, n_radial: int = 32, n_angular: int = 32):
    """Nodes (x1, x2) and weights for E g(x_1, x_2), x_i = ⟨v, w_i⟩, v ~ Unif(S^{B−2}).

    ⟨w_1, w_2⟩ = −1/(B−1).  (x_1, x_2) = √T (cos θ, cos(θ − θ_0)) with
    T ~ Beta(1, (B−3)/2) (Gauss–Jacobi with the exact weight (1 − T)^{(B−5)/2};
    T ≡ 1 for B = 3) and θ uniform (Gauss–Legendre on each arc between zeros of
    x_1 and x_2).  Weights sum to 1.  Spectral accuracy for smooth φ (< 1e−12 for
    tanh, sin at B ≤ 32); algebraic for kinks off the arc ends (≈ 1e−4 for relu(x+2)).
    """
    b = batch_size
    if b == 3:
        t_nodes = np.array([1.0])
        t_w = np.array([1.0])
    elif b <= _JACOBI_MAX_B:
        y, wy = special.roots_jacobi(n_radial, (b - 5) / 2.0, 0.0)
        t_nodes = (1.0 + y) / 2.0
        t_w = wy / wy.sum()
    else:
        # Gauss–Jacobi's normalization overflows for huge exponents: use −((B−3)/2) log(1 − T)
        # ~ Exp(1) and Gauss–Laguerre in that variable (analytic integrand, geometric convergence)
        y, wy = special.roots_laguerre(n_radial)
        t_nodes = -np.expm1(-y / ((b - 3) / 2.0))
        t_w = wy / wy.sum()
    c1, c2, thw = angle_rule(b, n_angular)
    r = np.sqrt(t_nodes)[:, None]
    x1 = (r * c1[None, :]).ravel()
    x2 = (r * c2[None, :]).ravel()
    wts = (t_w[:, None] * thw[None, :]).ravel()
    for arr in (x1, x2, wts):
        arr.setflags(write=False)
    return x1, x2, wts


@lru_cache(maxsize=32)
def _kink_base_rules(n_radial: int, n_angular: int):
    gx, gw = special.roots_legendre(n_radial)
    ax, aw = special.roots_legendre(n_angular)
    return gx, gw, ax, aw


def kinked_pair_nodes(batch_size: int, k: np.ndarray, n_radial: int = 20, n_angular: int = 16):
    """Pair rule aligned with a kink of φ(A x) at x_1 = k and x_2 = k, one rule per entry of k.

    Radial variable T = r² ~ Beta(1, (B−3)/2), density ∝ (1 − T)^a, a = (B−5)/2, cut at k² (the lines
    x_i = k enter the disk there) and at T* = 2k²(B−1)/(B−2) (where the two lines cross, at θ = θ_0/2 or
    θ_0/2 + π: the arcs between the crossing angles change order, so the θ-integral has a corner in T there)
    when T* < 1.  Each piece uses a variable in which its integrand, weight included, is analytic, and
    Gauss–Legendre (n_radial nodes per piece):

    * [0, k²]: 1 − T = v², weight (1 − T)^a dT = 2 v^{B−4} dv (an integer power: no √ of the weight at T = 1
      for even B, even when k² is close to 1);
    * [k², 1]: T = k² + (1 − k²) sin²φ, weight 2 (1 − k²)^{a+1} sin φ cos^{B−4} φ dφ (the crossing angles
      arccos(k/√T) ~ √(T − k²) and the weight's √(1 − T) are both analytic in φ), split at φ* (T = T*) into
      two Gauss–Legendre pieces; where T* ≥ 1 (no crossing in the disk) or |k| ≥ 1 the split is at φ = π/4
      (harmless: the integrand is analytic there).

    For |k| ≥ 1 the first cut is at T = 1/2 and no crossing cuts are added (duplicated cuts give empty arcs).
    The θ-arcs are cut at the crossing angles ±arccos(k/r), θ_0 ± arccos(k/r) and at the zeros of x_1, x_2,
    Gauss–Legendre (n_angular nodes) on each of the 8 arcs.  B = 3 (T ≡ 1): only the angular rule.
    Returns x1, x2, w of shape (len(k), N).
    """
    b = batch_size
    gx, gw, ax, aw = _kink_base_rules(n_radial, n_angular)
    k = np.asarray(k, dtype=np.float64)[:, None]
    inside = np.abs(k) < 1.0
    if b == 3:
        t = np.ones_like(k)
        wt = np.ones_like(k)
    else:
        p = b - 4  # integer power of the weight in v = √(1 − T) and in cos φ
        k2 = np.where(inside, k * k, 0.5)
        # [0, k²]: v ∈ [√(1 − k²), 1]
        v_lo = np.sqrt(1.0 - k2)
        v = v_lo + (1.0 - v_lo) * (gx + 1.0) / 2.0
        t_in = 1.0 - v * v
        w_in = (1.0 - v_lo) / 2.0 * gw * 2.0 * v**p
        # [k², 1]: φ ∈ [0, π/2], split at φ*
        t_star = 2.0 * k2 * (b - 1) / (b - 2)
        split = inside & (t_star < 1.0)
        phi_star = np.where(split, np.arcsin(np.sqrt(np.clip((t_star - k2) / (1.0 - k2), 0.0, 1.0))), math.pi / 4)
        pieces_t, pieces_w = [t_in], [w_in]
        for lo, hi in ((np.zeros_like(phi_star), phi_star), (phi_star, np.full_like(phi_star, math.pi / 2))):
            ph = lo + (hi - lo) * (gx + 1.0) / 2.0
            s, c = np.sin(ph), np.cos(ph)
            pieces_t.append(k2 + (1.0 - k2) * s * s)
            pieces_w.append((hi - lo) / 2.0 * gw * 2.0 * (1.0 - k2) ** ((b - 3) / 2.0) * s * c**p)
        t = np.concatenate(pieces_t, axis=1)  # (n_k, 3 n_r)
        wt = np.concatenate(pieces_w, axis=1) * ((b - 3) / 2.0)  # ∫_0^1 (1 − T)^a dT = 1/(a + 1)
    r = np.sqrt(t)
    theta0 = math.acos(-1.0 / (b - 1))
    cross = np.abs(k) < r  # (n_k, n_T)
    c = np.where(cross, np.arccos(np.clip(k / np.where(cross, r, 1.0), -1.0, 1.0)), math.pi / 2)
    half = np.full_like(c, math.pi / 2)
    cuts = np.stack([half, 3 * half, theta0 + half, theta0 - half, c, -c, theta0 + c, theta0 - c], axis=-1)
    cuts = np.sort(np.mod(cuts, 2 * math.pi), axis=-1)
    edges = np.concatenate([cuts, cuts[..., :1] + 2 * math.pi], axis=-1)
    lo, length = edges[..., :-1], np.diff(edges, axis=-1)  # (n_k, n_T, 8)
    th = lo[..., None] + length[..., None] * (ax + 1.0) / 2.0  # (n_k, n_T, 8, n_a)
    wth = length[..., None] * aw / 2.0 / (2 * math.pi)
    x1 = r[..., None, None] * np.cos(th)
    x2 = r[..., None, None] * np.cos(th - theta0)
    w = wt[..., None, None] * wth
    n = x1.shape[0]
    return x1.reshape(n, -1), x2.reshape(n, -1), w.reshape(n, -1)


def pair_nodes(act, batch_size: int, amp: np.ndarray):
    """Pair-rule nodes for E g(A x_1, A x_2) at each amplitude A: arrays broadcastable to (len(A), N).

    Uses the kink-aligned rule when φ's kink (known for the registry's kinked families) is
    off 0 and B ≤ 400, else the fixed rule :func:`pair_rule`.
    """
    k0 = single_kink_off_zero(act)
    if k0 is None or batch_size > _JACOBI_MAX_B:
        x1, x2, w = pair_rule(batch_size)
        return x1[None, :], x2[None, :], w[None, :]
    amp = np.atleast_1d(np.asarray(amp, dtype=np.float64)).ravel()
    with np.errstate(divide="ignore"):
        k = np.where(amp > 0, k0 / np.where(amp > 0, amp, 1.0), np.inf)
    return kinked_pair_nodes(batch_size, k)


#: order m of the endpoint grading t ↦ I_t(m+1, m+1) used by the homogeneous angular rule
_GRADING_ORDER = 6


@lru_cache(maxsize=64)
def angle_rule(batch_size: int, n_angular: int = 256, graded: bool = False):
    """Nodes (cos θ, cos(θ − θ_0)) and weights on the circle, split at the zeros of both.

    ``graded=True`` maps each arc's Gauss–Legendre nodes through the regularized incomplete
    beta function t ↦ I_t(m+1, m+1) (a Sidi-type transform): an endpoint singularity |θ − θ_k|^γ
    (e.g. relu^α' ~ |x|^{α−1}, γ = 2α − 2 > −1) becomes |·|^{(γ+1)(m+1)−1}, so Gauss–Legendre
    converges fast even for α < 1.
    """
    theta0 = math.acos(-1.0 / (batch_size - 1))
    cuts = np.sort(np.mod([math.pi / 2, 3 * math.pi / 2, theta0 + math.pi / 2, theta0 - math.pi / 2], 2 * math.pi))
    edges = np.concatenate([cuts, [cuts[0] + 2 * math.pi]])
    gl_x, gl_w = special.roots_legendre(n_angular)
    t, tw = (gl_x + 1.0) / 2.0, gl_w / 2.0
    if graded:
        m = _GRADING_ORDER
        tw = tw * (t * (1.0 - t)) ** m / special.beta(m + 1, m + 1)
        t = special.betainc(m + 1, m + 1, t)
    th, thw = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi - lo < 1e-14:
            continue
        th.append(lo + (hi - lo) * t)
        thw.append(tw * (hi - lo))
    th = np.concatenate(th)
    return np.cos(th), np.cos(th - theta0), np.concatenate(thw) / (2 * math.pi)


# ---------------------------------------------------------------------------
# Monte Carlo on the sphere
# ---------------------------------------------------------------------------
def sample_sphere(batch_size: int, n_samples: int, rng: np.random.Generator) -> np.ndarray:
    """n × B samples of u uniform on the unit sphere of the sum-zero hyperplane."""
    z = rng.standard_normal((n_samples, batch_size))
    z -= z.mean(axis=1, keepdims=True)
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def ratio_stats(num: np.ndarray, den: np.ndarray) -> tuple[float, float]:
    """Ratio of means and its delta-method standard error."""
    n = num.size
    r = num.mean() / den.mean()
    resid = num - r * den
    return float(r), float(resid.std(ddof=1) / (abs(den.mean()) * math.sqrt(n)))

