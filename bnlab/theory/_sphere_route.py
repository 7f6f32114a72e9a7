"""The spherical-integration route of the dynamics: any φ, split at its kinks (Yang et al. 2019, App. F.3.1,
G.1.1, §3.2) (private).

The brackets of the forward map Ĵ (App. F.3.1) and of the backward map (App. G.1.1) reduce to 2-d
integrals over (u_1, u_2) on the batchnorm sphere, the cross-batch quantities to 1-d ones; all run on the
rules of :mod:`bnlab.theory._quadrature.sphere` and give eigenvalues by Thm E.62
(:func:`bnlab.theory.ultrasymmetric.projected_eigenvalues`).  The forward moments are memoized per (φ, B):
μ* of the backward and cross-batch dynamics and the fixed point of :func:`bnlab.theory.analyze` share them.
See :mod:`bnlab.theory._routes` for the route objects' common face.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from bnlab.theory._quadrature.rules import chi_inverse_moment
from bnlab.theory._quadrature.sphere import SphereGrid, conditional_coefficients, sphere_grid_for
from bnlab.theory.ultrasymmetric import projected_eigenvalues

__all__ = ["SphereRoute"]


@dataclass(frozen=True)
class SphereRoute:
    """Any φ on the (s, θ) rule (kink-split where φ has kinks); ≈1e-10 relative, B ≤ 2048."""

    act: object
    batch_size: int
    method: ClassVar[str] = "sphere"

    def forward(self):
        """(λ_L↑, λ_M↑, stderr, truncation error): the brackets of Ĵ (App. F.3.1) and Thm E.62."""
        ev = _forward_sphere(self.act, self.batch_size)
        return ev.lambda_L, ev.lambda_M, None, None

    def backward(self):
        """(λ_G↓, λ_L↓, λ_M↓, stderr, truncation error): the brackets of App. G.1.1 and Thm E.62."""
        ev = _backward_sphere(self.act, self.batch_size)
        return ev.lambda_G, ev.lambda_L, ev.lambda_M, None, None

    def cross_batch(self):
        """(c_CB*, λ_M̃, stderr, truncation error): Thm H.3 and the rate p² of §3.2."""
        return (*_cross_batch_sphere(self.act, self.batch_size), None, None)


@lru_cache(maxsize=32)
def _forward_moments_sphere(act, batch_size: int):
    """Moments E[f_k f_l · (u-monomial)] of f = φ(√B u) needed by the brackets of Ĵ.

    Memoized per (φ, B): the forward, backward (μ*) and cross-batch (μ*) routes share them.
    The returned array is read-only.
    """
    b = batch_size
    hom = act.homogeneity
    grid = sphere_grid_for(act, b, float(hom) if hom is not None else 0.0)  # split at kinks
    sb = math.sqrt(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = act(sb * grid.x_distinct)  # once per distinct u_1 (a run of the kink rule)
        f2 = act(sb * grid.y)
    out = _forward_sphere_brackets(grid, f1, f2)
    out.setflags(write=False)
    return out


def _forward_sphere_brackets(grid: SphereGrid, f1: np.ndarray, f2: np.ndarray) -> np.ndarray:
    """[E f_1², E f_1 f_2, E f_1² x², E f_1² y², E f_1² xy, E f_1² y e3, E f_1 f_2 x², E f_1 f_2 e33,
    E f_1 f_2 xy, E f_1 f_2 x e3, E f_1 f_2 e34] (App. F.3.1) from f_1 = f(√B u_1) per run and
    f_2 = f(√B u_2) per node (see :class:`bnlab.theory._quadrature.sphere.SphereGrid`)."""
    x = grid.x_distinct
    c1, c2 = conditional_coefficients(grid.batch_size)
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


def _forward_brackets(moments: np.ndarray, batch_size: int):
    """The ten brackets of Ĵ (Thm E.62 order) and (q*, q*c*, μ*) from the moments."""
    b = batch_size
    q, qc, m1111, m1122, m1112, m1123, m1211, m1233, m1212, m1213, m1234 = moments
    mu = q - qc
    k = 1.0 / (2.0 * mu)
    d = 1.0 - 1.0 / b
    brackets = np.array(
        [
            k * ((b - 1) * m1111 - d * q),
            k * ((b - 1) * m1122 - d * q),
            k * ((b - 1) * m1112 + q / b),
            k * ((b - 1) * m1123 + q / b),
            k * ((b - 1) * m1211 - d * qc),
            k * ((b - 1) * m1233 - d * qc),
            k * ((b - 1) * m1212 + qc / b),
            k * ((b - 1) * m1212 + qc / b),
            k * ((b - 1) * m1213 + qc / b),
            k * ((b - 1) * m1234 + qc / b),
        ]
    )
    return brackets, (q, qc, mu)


def _forward_sphere(act, batch_size: int):
    moments = _forward_moments_sphere(act, batch_size)
    brackets, _ = _forward_brackets(moments, batch_size)
    return projected_eigenvalues(brackets, batch_size)


def _backward_sphere_brackets(grid: SphereGrid, g1: np.ndarray, g2: np.ndarray) -> np.ndarray:
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
    by :func:`_backward_sphere_brackets`."""
    hom = act.homogeneity
    grid = sphere_grid_for(act, b, float(hom) - 1.0 if hom is not None else 0.0)  # split at kinks
    sb = math.sqrt(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        g1 = act.derivative(sb * grid.x_distinct)  # once per distinct u_1 (a run of the kink rule)
        g2 = act.derivative(sb * grid.y)
    return _backward_sphere_brackets(grid, g1, g2)


def _mu_star_sphere(act, b: int) -> float:
    m = _forward_moments_sphere(act, b)
    return float(m[0] - m[1])


def _backward_sphere(act, b: int):
    k = b / ((b - 3.0) * _mu_star_sphere(act, b))
    return projected_eigenvalues(k * _backward_moments_sphere(act, b), b)


def _sphere_marginals(grid: SphereGrid, values: np.ndarray) -> tuple[float, float]:
    """(E v(u_1), E v(u_1) u_1²) from v per run."""
    x = grid.x_distinct
    a0 = grid.power_sums(None, 0)[0]
    return float(values @ a0), float((values * x * x) @ a0)


def _cross_batch_sphere(act, b: int):
    hom = act.homogeneity
    sb = math.sqrt(b)
    # c*: E f(√B u_1), radial power α/2 for homogeneous φ
    g0 = sphere_grid_for(act, b, hom / 2.0 if hom is not None else 0.0)  # split at kinks
    m = _sphere_marginals(g0, act(sb * g0.x_distinct))[0]
    # rate: E φ'(√B u_1)((B−1)/B − u_1²), radial power (α−1)/2
    g1 = sphere_grid_for(act, b, (hom - 1.0) / 2.0 if hom is not None else 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        e0, e2 = _sphere_marginals(g1, act.derivative(sb * g1.x_distinct))
    e = (b - 1.0) / b * e0 - e2
    mom = _forward_moments_sphere(act, b)
    mu = float(mom[0] - mom[1])
    p = sb * chi_inverse_moment(b, 1) * b * e / (math.sqrt(mu) * (b - 1.0))
    return m * m, p * p
