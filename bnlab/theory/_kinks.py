"""Quadrature split at the kinks of φ, wherever they are (private; Yang et al. 2019, Thm 3.3, App. F.3).

The spherical routes (fixed point Thm F.5, forward App. F.3.1, backward Thm 3.9 / App. G,
cross-batch Thm 3.11 / App. H) integrate functions of (u_1, u_2), the first two coordinates of u
uniform on the unit sphere of the sum-zero hyperplane of R^B, or of one coordinate u_1.  Their
rules in :mod:`._dynamics_common` and :mod:`.spherical` are cut where u_1 = 0 or u_2 = 0 only:
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

which is the (s, θ) density (a+1)(1−s)^a ds dθ/2π of :func:`._dynamics_common._sphere_grid`
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
(the rule of :func:`._dynamics_common._sphere_grid` stops at 2e-17: relu^0.6 λ_G↓ 5e-4 off).  A
kink k ≠ 0 with φ' singular there is resolved only to |x − k| ≈ 1e-16 |k| (rounding of k + t):
such φ are outside the measured accuracy (see docs/theory-methods.md).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import special

from bnlab.theory._linalg import _tanh_sinh_step

__all__: list[str] = []

# tanh-sinh on (0, 1) for integrands singular at a kink: half-width 4.5 (nodes reach t ≈ 5e-62; omitted
# weights < 1e-60); the step by B: _STEPS
_HALF_WIDTH = 4.5


def kinks_of(act) -> tuple[float, ...]:
    """The points x where x ↦ φ(γx + β) (``act``) is not smooth (a jump of φ or of one of its
    derivatives), sorted; () for smooth φ.  See :attr:`bnlab.activations.Activation.kinks`."""
    return tuple(getattr(act, "kinks", ()) or ())


def needs_kink_rule(act, radial_power: float | None = None) -> bool:
    """Whether the spherical integrals of ``act`` need the kink-split rule of this module.

    Yes for a non-homogeneous φ with a kink anywhere (selu, elu, relu(γx + β), expressions with
    relu/abs/...), and for a positive-homogeneous φ whose integrand is singular at its kink
    (``radial_power`` < 0: φ' of relu^α with α < 1).  Smooth φ and relu-like φ with a bounded
    integrand keep the (s, θ) rule, which is exact for them.
    """
    if act.homogeneity is not None:
        return radial_power is not None and radial_power < 0.0
    return bool(kinks_of(act))


def _panels(lo: float, hi: float, cuts) -> list[tuple[float, float]]:
    pts = sorted({lo, hi, *(c for c in cuts if lo < c < hi)})
    return [(a, b) for a, b in zip(pts[:-1], pts[1:]) if b > a]


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


#: registered families that are analytic on either side of each kink (so a panel ending at a kink has an
#: integrand analytic up to that end: Gauss–Legendre converges fast); alpha_relu only for integer α
_PIECEWISE_ANALYTIC_FAMILIES = frozenset({"identity", "relu", "leaky_relu", "abs", "elu", "selu"})


def piecewise_analytic(act) -> bool:
    """Whether φ is analytic on either side of each of its kinks (relu, leaky relu, abs, elu, selu, integer
    powers of relu, expressions built from them without fractional powers or sqrt), so that Gauss–Legendre
    panels ending at the kinks converge fast.  False for callables (opaque) and for anything with a
    non-integer power or sqrt (|x − k|^p, p ∉ ℤ: algebraic at the kink, where only tanh-sinh keeps its
    rate — Gauss–Legendre there would return a wrong number, e.g. λ_G↓ of |x − 0.5|^0.6 off by 23 %)."""
    if act.name in _PIECEWISE_ANALYTIC_FAMILIES:
        return True
    if act.name == "alpha_relu":
        alpha = float(act.params.get("alpha", 1.0))
        return alpha == int(alpha)
    if act.name != "expr" or act.expression is None:
        return False
    return _expression_piecewise_analytic(act.expression)


@lru_cache(maxsize=256)
def _expression_piecewise_analytic(expr: str) -> bool:
    import ast

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt":
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base_has_x = any(isinstance(n, ast.Name) and n.id == "x" for n in ast.walk(node.left))
            if not base_has_x:
                continue  # c**f(x): analytic wherever f is
            exp = node.right
            if isinstance(exp, ast.UnaryOp) and isinstance(exp.op, (ast.USub, ast.UAdd)):
                exp = exp.operand
            if not (isinstance(exp, ast.Constant) and isinstance(exp.value, (int, float))
                    and float(exp.value) == int(exp.value)):
                return False
    return True


def _unit_rule(batch_size: int, singular: bool, analytic: bool = False):
    # integrand singular at a kink (relu^α's φ'): tanh-sinh with half-width 4.5; φ analytic on either side of
    # its kinks: Gauss–Legendre for 16 ≤ B ≤ 512 (_GAUSS_NODES); else tanh-sinh with half-width 3.2 (omitted
    # weights < 1e-20) and the step by B from _STEPS (1/32 beyond B = 256)
    if analytic and not singular and _GAUSS_MIN_BATCH <= batch_size <= _GAUSS_NODES[-1][0]:
        return _gauss_nodes(next(n for most, n in _GAUSS_NODES if batch_size <= most))
    step = next((h for most, h in _STEPS if batch_size <= most), 1.0 / 32.0)
    return _unit_nodes(step, _HALF_WIDTH if singular else 3.2)


@lru_cache(maxsize=16)
def _gauss_nodes(n: int):
    # Gauss–Legendre on (0, 1) as (t, 1 − t, weights), t increasing; 1 − t from the nodes' own complement
    z, wz = special.roots_legendre(n)
    out = (0.5 * (1.0 + z), 0.5 * (1.0 - z), 0.5 * wz)
    for arr in out:
        arr.setflags(write=False)
    return out


@lru_cache(maxsize=16)
def _unit_nodes(step: float, half_width: float):
    # the tanh-sinh rule on (0, 1): a table of universal constants (no φ, no B), computed once
    return _tanh_sinh_step(step, half_width)


@lru_cache(maxsize=64)
def kink_sphere_grid(batch_size: int, kinks: tuple[float, ...], singular: bool = True, analytic: bool = False):
    """A :class:`._dynamics_common._SphereGrid` (β = 0) for E over (u_1, u_2), cut at u_1, u_2 ∈ ``kinks``.

    ``kinks`` are the kinks of the integrand in u (i.e. those of φ divided by √B); ``singular``
    widens the tanh-sinh range for integrands singular at a kink; ``analytic`` (φ analytic on either side
    of each kink, :func:`piecewise_analytic`) allows Gauss–Legendre panels.  B ≥ 4.  Accuracy on the
    quantities of nine kinked φ (see :data:`_STEPS`, :data:`_GAUSS_NODES`; change against tanh-sinh with
    step 1/40): ≈ 3e-9 at B = 4 (the density (1 − Q)^{−1/2} is singular on the ellipse), ≤ 1.2e-12 for
    5 ≤ B ≤ 15, ≤ 4.1e-13 for 16 ≤ B ≤ 512 (Gauss–Legendre panels; the bound is relu^0.6's tanh-sinh
    rule, the others ≤ 1e-13); the constant and x⁴ integrate to ≤ 1e-14.
    """
    from bnlab.theory._dynamics_common import _SphereGrid

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
    t, tc, wt = _unit_rule(b, singular, analytic)
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
    inner = np.clip(np.column_stack([np.broadcast_to(kin, (x.size, kin.size)), yc]), ylo[:, None], yhi[:, None])
    ends = np.column_stack([ylo, np.sort(inner, axis=1), yhi])
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
    W[~np.isfinite(W)] = 0.0  # never reached for B ≥ 4 (d_lo, d_hi > 0 on non-empty panels): a guard
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
    return _SphereGrid(b, 0.0, X, Y, W, None, starts, int(t.size), run_panels, plo, pln, tau)


def sphere_grid_for(act, batch_size: int, radial_power: float):
    """The rule for the spherical integrals of φ = ``act`` at B = ``batch_size``: the kink-split rule
    of this module when :func:`needs_kink_rule`, else ``_sphere_grid(B, radial_power)`` (radial
    power for homogeneous φ, 0 otherwise), as the routes used before."""
    from bnlab.theory._dynamics_common import _sphere_grid

    b = int(batch_size)
    if b >= 4 and needs_kink_rule(act, radial_power):
        ks = kinks_of(act) or (0.0,)
        scale = math.sqrt(b)
        singular = act.homogeneity is not None and radial_power < 0.0
        return kink_sphere_grid(b, tuple(sorted({k / scale for k in ks})), singular, piecewise_analytic(act))
    return _sphere_grid(b, float(radial_power) if act.homogeneity is not None else 0.0)


def theta_cuts(act, amplitude: float) -> list[float]:
    """Angles θ ∈ (0, π) where φ(amplitude · cos θ) has a kink: θ = arccos(k/amplitude) for each
    kink k of φ with |k| < amplitude.  Used to split the 1-D angular rules (Gegenbauer
    coefficients, Thm 3.4; the sphere fixed point, Thm F.5)."""
    out = []
    for k in kinks_of(act):
        c = k / amplitude
        if -1.0 < c < 1.0 and k != 0.0:
            out.append(math.acos(c))
    return out
