"""Which route computes a quantity, and what that route needs (private; the prologue of the dynamics).

The forward, backward and cross-batch dynamics (Yang et al. 2019, §3.1.1, §3.1.2, §3.2) share one
prologue: given a resolved φ (an :class:`~bnlab.activations.Activation`) and a checked B, check the
method, pick the route ("auto": the closed form for relu and identity, the Laplace closed forms for other
positive-homogeneous φ, else the spherical integral) and check what that route needs (its B range, a
positive-homogeneous φ for Laplace, the number of Gegenbauer terms, the Monte Carlo sample size, seed and
cost).  Each dynamics states only what differs (:class:`Dynamics`).

The theory is organised by route, not by quantity: :func:`plan_route` returns ONE route object, chosen
once for φ's class, that carries what that class needs and computes every dynamics on its route:

* :class:`~bnlab.theory._closed_route.ClosedRoute` (relu, identity) and
  :class:`~bnlab.theory._closed_route.LaplaceRoute` (positive-homogeneous φ): closed forms;
* :class:`~bnlab.theory._sphere_route.SphereRoute`: spherical integration, split at kinks;
* :class:`~bnlab.theory._gegenbauer_route.GegenbauerRoute`: Gegenbauer series;
* :class:`~bnlab.theory._montecarlo_route.MonteCarloRoute`: samples of the sphere, with standard errors.

Each has ``method`` (its name) and ``forward()`` → (λ_L↑, λ_M↑, stderr, truncation error),
``backward()`` → (λ_G↓, λ_L↓, λ_M↓, stderr, truncation error), ``cross_batch()`` → (c_CB*, λ_M̃, stderr,
truncation error); the kernels of :mod:`~bnlab.theory.forward`, :mod:`~bnlab.theory.backward` and
:mod:`~bnlab.theory.cross_batch` ask it for their quantity and wrap the answer in their result type, so
no kernel branches on the method.  No numerics here: this module decides, the route modules integrate.

φ is resolved once, by the public function at the boundary (:func:`bnlab.activations.get_activation`),
never here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bnlab._validation import check_choice, check_int
from bnlab.theory._closed_route import ClosedRoute, LaplaceRoute
from bnlab.theory._gegenbauer_route import GegenbauerRoute
from bnlab.theory._montecarlo_route import MonteCarloRoute
from bnlab.theory._quadrature.sphere import MAX_QUADRATURE_BATCH
from bnlab.theory._sphere_route import SphereRoute

__all__ = [
    "DYNAMICS_METHODS",
    "Dynamics",
    "plan_route",
    "relu_or_identity",
    "laplace_applies",
    "require_laplace",
    "check_finite_result",
    "MAX_MONTECARLO_SECONDS",
    "montecarlo_seconds",
    "check_montecarlo_cost",
]

_ALL_METHODS = ("auto", "closed", "laplace", "fourier", "sphere", "gegenbauer", "montecarlo")

#: Routes of the three dynamics (forward, backward, cross-batch); "fourier" is developed for the fixed point only.
DYNAMICS_METHODS = ("auto", "closed", "laplace", "sphere", "gegenbauer", "montecarlo")


def relu_or_identity(act) -> str | None:
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


def laplace_applies(act, b: int) -> bool:
    """Whether the Laplace closed forms apply: φ positive-homogeneous of degree α with (B−1)/2 > α, B ≥ 4."""
    return (
        act.homogeneity is not None and act.homogeneous_coeffs is not None and b >= 4
        and (b - 1) / 2.0 > act.homogeneity
    )


def require_laplace(act, b: int, what: str) -> None:
    """``ValueError`` unless the Laplace closed forms (Thms F.33, G.12, H.14) apply to (φ, B)."""
    if act.homogeneity is None or act.homogeneous_coeffs is None:
        raise ValueError(
            f"method='laplace' does not apply to phi={act.spec!r}: the Laplace method needs a positive-homogeneous φ "
            f"(relu, leaky_relu, alpha_relu, abs, identity); use method='sphere' or 'gegenbauer' for {what}"
        )
    if not (b - 1) / 2.0 > act.homogeneity:
        raise ValueError(f"method='laplace' needs (B−1)/2 > α (Thm F.33); got batch_size={b}, α={act.homogeneity:g}")


def default_terms(act, batch_size: int) -> int:
    """Gegenbauer terms of the dynamics' series when the caller gives none.

    Smooth φ: coefficients decay geometrically; kinks (homogeneous φ): the single-point tails are
    summed through the moments and the two-point remainder decays like R_l(ξ) ~ l^{−(B−3)/2}
    (:class:`bnlab.theory.gegenbauer._GegenbauerSeries`).  That is slowest at B ≤ 5, where the remainder of
    λ_G↓ for relu decays only like n^{−3/2} with an oscillating phase (measured 8e-8 at 400 terms, 1e-8
    at 1000, 3e-9 at 1600 for B = 4): 1000 terms there (0.2 s); at B ≥ 8 400 terms leave ≤ 3e-11.
    """
    if act.homogeneity is None and not act.kinks:
        return 160  # smooth: geometric decay
    return 1000 if batch_size <= 5 else 400


@dataclass(frozen=True)
class Dynamics:
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


def plan_route(
    act, b: int, method, dynamics: Dynamics, *, n_terms=None, n_samples=None, seed=None
) -> ClosedRoute | LaplaceRoute | SphereRoute | GegenbauerRoute | MonteCarloRoute:
    """The one prologue of the forward, backward and cross-batch kernels: φ already resolved and B
    checked (by the public function), check the method, pick the route ("auto": the closed form for
    relu and identity where it applies, the Laplace closed forms for other positive-homogeneous φ, else
    the spherical integral), check what that route needs and return it as an object that computes each
    dynamics on that route (``forward()``, ``backward()``, ``cross_batch()``; see the module docstring)."""
    if dynamics.check is not None:
        dynamics.check(act, b)
    method = _check_method(method, DYNAMICS_METHODS, dynamics.what)
    kind = relu_or_identity(act)
    if method == "auto":
        method = _auto_method(act, b, kind, dynamics)
    if method == "closed":
        _check_closed(act, b, kind, dynamics)
        return ClosedRoute(act, b, kind)
    if method == "laplace":
        require_laplace(act, b, dynamics.what)
        return LaplaceRoute(act, b)
    if method == "sphere":
        return SphereRoute(act, b)
    if method == "gegenbauer":
        _check_gegenbauer(b, dynamics)
        return GegenbauerRoute(act, b, default_terms(act, b) if n_terms is None else check_int("n_terms", n_terms, minimum=4))
    n_samples = check_int("n_samples", n_samples, minimum=100)
    check_montecarlo_cost(n_samples, b, dynamics.what, dynamics.montecarlo_batch_power)
    return MonteCarloRoute(act, b, n_samples, seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed))


def _check_method(method, allowed, what: str) -> str:
    method = check_choice("method", method, _ALL_METHODS)
    if method not in allowed:
        raise ValueError(
            f"method={method!r} is not allowed for {what}: the paper's {method} method is only developed for the "
            f"fixed point here; expected one of {', '.join(map(repr, allowed))}"
        )
    return method


def _auto_method(act, b: int, kind: str | None, dynamics: Dynamics) -> str:
    if kind is not None and b >= max(4, dynamics.closed_min_batch):
        return "closed"
    if laplace_applies(act, b):
        # every other positive-homogeneous φ (leaky relu, abs, relu^α): the Laplace closed forms (Thms F.33,
        # G.12, H.14; hypergeometric kernels, ≈1e-13, agree with the sphere and Gegenbauer routes to ≤ 1e-12
        # at 4 ≤ B ≤ 128, tests/theory/test_kinks.py) — no quadrature of φ' singular at its kink (relu^α, α < 1)
        return "laplace"
    return "sphere"


def _check_closed(act, b: int, kind: str | None, dynamics: Dynamics) -> None:
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


def _check_gegenbauer(b: int, dynamics: Dynamics) -> None:
    if b > MAX_QUADRATURE_BATCH:
        raise ValueError(f"batch_size={b} is not allowed for method='gegenbauer': expected <= {MAX_QUADRATURE_BATCH}")
    if b < dynamics.gegenbauer_min_batch:
        # Thm 3.8 / F.22 divide by B − 3 (c_{B−1,l} = (B−3)/(B−3+2l) vanishes at B = 3)
        raise ValueError(
            f"batch_size={b} is not allowed for method='gegenbauer': the Gegenbauer route needs batch_size >= "
            f"{dynamics.gegenbauer_min_batch} (Thm 3.8 divides by B − 3); use method='sphere' for batch_size={b}"
        )


def check_finite_result(act, b, method, *values) -> None:
    """The epilogue of a route: ``ValueError`` if any of its eigenvalues is not finite."""
    for v in values:
        if v is not None and not math.isfinite(v):
            raise ValueError(
                f"the eigenvalues for phi={act.spec!r}, batch_size={b} by method={method!r} are not finite: "
                "φ is not square-integrable against the spherical measure (Thm 3.9 assumptions)"
            )


# ---------------------------------------------------------------------------
# the cost of a Monte Carlo route, refused up front when it would take minutes
# ---------------------------------------------------------------------------
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
