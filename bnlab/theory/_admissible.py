"""Does the mean field theory apply to (φ, B, ε), and in which exact form?  (private; used by analyze)

Checked at the boundary of :func:`bnlab.theory.analyze` so that no route ever turns an overflow, a
pole or a degenerate φ into a number (issue 13, item 4).  What the theory needs (Yang et al. 2019):

* the batchnorm sphere integrals of φ (Thm 3.3: φ(√B u) with u uniform on S^{B−2}, so φ on
  |x| ≤ √(B−1)) finite and representable: φ finite there, φ square-integrable near every
  singular point;
* for the backward and cross-batch rates (Thms 3.9, 3.11: E φ'², E φ'), φ' square-integrable,
  which a jump of φ (a Dirac mass in φ') or a singularity |φ'| ~ |x − k|^{−p} with p ≥ ½ breaks;
* μ* > 0 (φ not constant on the sphere).

Exact invariances used instead of failing (ε = 0 only: with ε > 0 the scale of φ's output enters
the next layer's normalization):

* batchnorm makes φ and cφ + d equivalent (the next layer's normalization removes both), so a φ
  whose values are finite but huge or tiny (x*1e300: its squares overflow) is divided by its
  largest value on the sphere;
* a positive-homogeneous φ has φ(γx) = |γ|^α φ(sign(γ) x), so |γ| drops out (relu with γ = 1e308).

φ that overflows float64 on the sphere itself (x*1e308, exp(exp(exp(x)))) cannot be evaluated at
all: ``ValueError`` saying so and how to rescale.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__: list[str] = []

#: |φ| beyond this (or below its inverse) on the sphere is rescaled (ε = 0): squares and the
#: products of the integrals then stay far from overflow/underflow.
_RESCALE_ABOVE = 1e100
#: a local exponent |f| ~ |x − k|^{−p} with p ≥ this is not square-integrable (½ − margin for the
#: two-point slope estimate, which is exact for pure powers)
_NOT_L2_EXPONENT = 0.49


def _support_probe(act, b: int) -> np.ndarray:
    """4097 equispaced points on |x| ≤ √(B−1), 0, and every kink there with its neighbours at ±1e-9: sorted, distinct."""
    r = math.sqrt(b - 1.0)
    base = np.linspace(-r, r, 4097)
    extra = {0.0}
    for k in act.kinks:
        if abs(k) <= r:
            d = 1e-9 * max(1.0, abs(k))
            extra.update((k - d, k, k + d))
    # what np.unique of the union gives, without sorting 4097 sorted points again: the few extra points
    # inserted where they belong, then exact repeats dropped
    pts = np.array(sorted(extra))
    merged = np.insert(base, np.searchsorted(base, pts), pts)
    return merged[np.concatenate(([True], merged[1:] != merged[:-1]))]


def _median(v: np.ndarray) -> float:
    """np.median of a 1-d array without its generic machinery (one partition: the admissibility checks run in
    every analyze call)."""
    n = v.size
    half = n // 2
    if n % 2:
        return float(np.partition(v, half)[half])
    part = np.partition(v, (half - 1, half))
    return float(np.mean(part[half - 1 : half + 1]))


def _local_exponent(f, k: float, side: float) -> float:
    """p in |f(k + side·δ)| ~ δ^{−p} from δ = 1e-6 and 1e-10 (relative to max(1, |k|)); 0 if bounded."""
    s = max(1.0, abs(k))
    with np.errstate(all="ignore"):
        v = np.abs(np.asarray(f(np.array([k + side * 1e-6 * s, k + side * 1e-10 * s])), dtype=np.float64))
    if not np.all(np.isfinite(v)):
        return math.inf
    if v[1] <= v[0] or v[0] == 0.0:
        return 0.0
    return math.log(v[1] / v[0]) / math.log(1e4)


def _find_jumps(act, x: np.ndarray, fx: np.ndarray, spread: float, max_candidates: int = 12) -> list[float]:
    """Points where φ is discontinuous: the probe's intervals whose increment is > 4× those two intervals away
    (the probe has points at ±1e-9 around every kink, so a jump at a kink is such a spike) are cut into
    8 pieces 40 times, following the largest increment; a jump is an increment still > 1e-6 of φ's
    spread on an interval of width ≤ 1e-13·max(1, |x|)."""
    inc = np.abs(np.diff(fx))
    typical = _median(np.abs(fx)) + spread
    # candidates: increments that stand out from both neighbours (a jump is one interval's increment, a
    # steep smooth φ spreads over several), the largest first
    # (neighbours two intervals away: a jump at a probe point, φ(0) = 0 for sign, splits over two intervals)
    nb = np.maximum(np.concatenate([[0.0, 0.0], inc[:-2]]), np.concatenate([inc[2:], [0.0, 0.0]]))
    spikes = np.nonzero((inc > 4.0 * nb) & (inc > 1e-6 * spread))[0]
    order = list(spikes[np.argsort(inc[spikes])[::-1]][:max_candidates])
    found: list[float] = []
    for i in order:
        lo, hi = float(x[i]), float(x[i + 1])
        for _ in range(40):
            grid = np.linspace(lo, hi, 9)
            with np.errstate(all="ignore"):
                v = act(grid)
            d = np.abs(np.diff(v))
            if not np.all(np.isfinite(d)):
                break
            j = int(np.argmax(d))
            lo, hi = float(grid[j]), float(grid[j + 1])
            if hi - lo <= 1e-13 * max(1.0, abs(lo)):
                break
        with np.errstate(all="ignore"):
            ends = np.asarray(act(np.array([lo, hi])), dtype=np.float64)
        if not np.all(np.isfinite(ends)) or np.max(np.abs(ends)) > 1e6 * typical:
            raise ValueError(
                f"phi={act.spec!r} is unbounded near x={0.5 * (lo + hi):.6g} (|φ| reaches {np.max(np.abs(ends)):.3g} there, "
                f"against {typical:.3g} typically on the sphere): a pole, so the Gaussian integrals E φ² of the theory "
                "diverge (Yang et al. 2019, Thm 3.3 needs φ ∈ L²)"
            )
        jump = abs(float(ends[1] - ends[0]))
        if jump > 1e-6 * spread:
            mid = 0.5 * (lo + hi)
            if not any(abs(mid - f) <= 1e-9 * max(1.0, abs(f)) for f in found):  # one jump found twice
                found.append(mid)
    return sorted(found)


def _scaled(act, factor: float):
    """x ↦ φ(γx + β)/factor, with its own spec (so that caches keyed on the activation do not mix it up)."""
    base, deriv, torch_fn = act._base, act._base_deriv, act._base_torch
    coeffs = act.base_homogeneous_coeffs
    expr = act.expression
    return dataclasses.replace(
        act,
        _base=lambda u: np.asarray(base(u), dtype=np.float64) / factor,
        _base_deriv=None if deriv is None else (lambda u: np.asarray(deriv(u), dtype=np.float64) / factor),
        _base_torch=None if torch_fn is None else (lambda u: torch_fn(u) / factor),
        base_homogeneous_coeffs=None if coeffs is None else (coeffs[0] / factor, coeffs[1] / factor),
        expression=f"({expr})/{factor!r}" if expr is not None else None,
        name=act.name if act.name in ("expr", "callable") else "callable",
    )


def admissible(act, b: int, eps: float):
    """(φ to use, notes, {"backward": why λ_G↓, λ_L↓, λ_M↓ are undefined or None, "cross_batch": why the
    cross-batch rate is}); ValueError when the
    theory cannot be evaluated for (φ, B, ε) at all.  See the module docstring."""
    notes: list[str] = []
    spec = act.spec
    if eps > 0.0 and not math.isfinite(b * eps * 1e8):
        raise ValueError(
            f"eps={eps!r} is not allowed with batch_size={b}: B·ε overflows float64 in the normalization "
            "√(‖Gh‖² + Bε) (Yang et al. 2019, Eq. 7); such an ε switches the normalization off (every layer "
            "scales by ~1/√ε) — use eps <= 1e290"
        )
    if eps == 0.0 and act.homogeneity is not None and act.gamma not in (1.0, -1.0):
        # φ(γx) = |γ|^α φ(sign(γ)x) and batchnorm ignores the output scale: exact
        act = dataclasses.replace(act, gamma=math.copysign(1.0, act.gamma))
        notes.append(
            f"phi={spec!r} is positive-homogeneous: with eps = 0 batchnorm makes |gamma| irrelevant "
            f"(φ(γx) = |γ|^α φ(sign(γ)x)), so gamma={math.copysign(1.0, act.gamma):g} was used"
        )
    x, fx, spread = _values_on_sphere(act, b, spec)
    act, fx, spread = _moderate_scale(act, fx, spread, eps, spec, notes)
    backward_reason, cross_reason = _singular_kinks(act, b, spec)
    jumps = _find_jumps(act, x, fx, spread)
    # a jump found within 1e-9 of a traced or declared kink is that kink
    jumps = sorted({next((k for k in act.kinks if abs(j - k) <= 1e-9 * max(1.0, abs(k))), j) for j in jumps})
    if jumps:
        where = ", ".join(f"{j:.6g}" for j in jumps[:5])
        backward_reason = cross_reason = (
            f"phi={spec!r} jumps at x = {where}: its derivative has a Dirac mass there, which the gradient theory "
            "(E φ'², Yang et al. 2019, Thms 3.9, 3.11, needs φ' square-integrable) does not cover; the forward "
            "quantities (fixed point, λ_L↑, λ_M↑, c_CB*) are returned, the gradient quantities are not"
        )
        new = [act.gamma * j + act.beta for j in jumps]  # in the base variable u = γx + β
        act = dataclasses.replace(act, base_kinks=tuple(sorted(set(act.base_kinks) | set(new))))
    return act, notes, {"backward": backward_reason, "cross_batch": cross_reason}


def _values_on_sphere(act, b: int, spec: str):
    """(probe points, φ there, φ's spread): ``ValueError`` if φ is not finite on the sphere or constant there."""
    x = _support_probe(act, b)
    with np.errstate(all="ignore"):
        fx = np.asarray(act(x), dtype=np.float64)
    bad = ~np.isfinite(fx)
    if bad.any():
        at = x[bad]
        where = at[np.argmin(np.abs(at))]
        raise ValueError(
            f"phi={spec!r} is not finite at x={where:.6g} on the batchnorm sphere |x| <= √(B−1) = {math.sqrt(b - 1.0):.6g} "
            f"(batch_size={b}): it overflows float64 or has a pole there, so the theory's integrals (Yang et al. 2019, "
            "Thm 3.3) cannot be evaluated.  Batchnorm makes φ and c·φ + d equivalent: rescale φ so that its values "
            "are moderate (e.g. 'x*1e308' → 'x'), or choose a φ that is finite on the sphere"
        )
    spread = float(np.max(fx) - np.min(fx))
    if spread == 0.0 or spread <= 1e-14 * float(np.max(np.abs(fx))):
        raise ValueError(
            f"phi={spec!r} is constant to float64 precision on the batchnorm sphere |x| <= {math.sqrt(b - 1.0):.6g} "
            f"(batch_size={b}): batchnorm then outputs a constant, the BSB1 fixed point is degenerate (μ* = 0) and the "
            "theory does not apply (a shift beta that swamps x, as in relu(x + 1e308), rounds φ(γx + β) to a constant: "
            "use a moderate beta)"
        )
    return x, fx, spread


def _moderate_scale(act, fx: np.ndarray, spread: float, eps: float, spec: str, notes: list):
    """φ divided by its largest value on the sphere when that is huge or tiny (exact with ε = 0, where batchnorm
    makes φ and cφ equivalent; a ``ValueError`` with ε > 0)."""
    big = float(np.max(np.abs(fx)))
    if _RESCALE_ABOVE >= big >= 1.0 / _RESCALE_ABOVE:
        return act, fx, spread
    if eps > 0.0:
        raise ValueError(
            f"phi={spec!r} reaches |φ| = {big:.3g} on the sphere: with eps > 0 the scale of φ matters and its "
            "squares leave float64's range; rescale φ or use eps = 0 (where batchnorm makes φ and cφ equivalent)"
        )
    notes.append(
        f"phi={spec!r} reaches |φ| = {big:.3g} on the sphere; batchnorm makes φ and cφ equivalent, so φ/{big:.6g} "
        "was used (exact with eps = 0)"
    )
    return _scaled(act, big), fx / big, spread / big


def _singular_kinks(act, b: int, spec: str) -> tuple[str | None, str | None]:
    """At every traced or declared kink on the sphere: ``ValueError`` where |φ| blows up (not L²); the reasons the
    backward quantities (φ' not L²) and the cross-batch rate (φ' not L¹) are undefined, or None."""
    backward_reason = cross_reason = None
    for k in act.kinks:
        if abs(k) > math.sqrt(b - 1.0):
            continue
        p_phi = max(_local_exponent(act, k, s) for s in (-1.0, 1.0))
        if p_phi >= _NOT_L2_EXPONENT:
            raise ValueError(
                f"phi={spec!r} is not square-integrable near x={k:.6g} (|φ| grows like |x − {k:.6g}|^−{min(p_phi, 99):.2f}): "
                "the Gaussian integrals E φ² of the theory diverge (Yang et al. 2019, Thm 3.3 needs φ ∈ L²)"
            )
        p_der = max(_local_exponent(act.derivative, k, s) for s in (-1.0, 1.0))
        if p_der >= _NOT_L2_EXPONENT and backward_reason is None:
            backward_reason = (
                f"phi={spec!r} has a derivative that is not square integrable near x={k:.6g} (|φ'| grows like "
                f"|x − {k:.6g}|^−{min(p_der, 99):.2f}): E φ'² diverges, so the backward quantities (λ_G↓, λ_L↓, λ_M↓; "
                "Yang et al. 2019, Thm 3.9) are infinite and not returned"
            )
        if p_der >= 0.99 and cross_reason is None:
            cross_reason = (
                f"phi={spec!r} has a derivative that is not integrable near x={k:.6g}: E φ' diverges, so the cross-batch "
                "rate (Yang et al. 2019, Thm 3.11) is not defined and not returned"
            )
    return backward_reason, cross_reason
