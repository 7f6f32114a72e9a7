"""Linear algebra shared by the theory core (private).

* the mean-centering projection G = I − 11ᵀ/B (Yang et al. 2019, §3, Eq. 8);
* the orthonormal basis 𝔢 of im G realised as in App. E.3, Eq. (33);
* BSB1 matrices (App. E.5, Defn E.50) and their (q, c) / (μ, ν) parameters;
* a square root of a PSD matrix that tolerates singular matrices.

The quadrature rules live in :mod:`bnlab.theory._quadrature`.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__: list[str] = []


def centering_matrix(batch_size: int) -> np.ndarray:
    """G = I − 11ᵀ/B."""
    b = int(batch_size)
    return np.eye(b) - np.full((b, b), 1.0 / b)


@lru_cache(maxsize=64)
def _basis_cached(batch_size: int) -> np.ndarray:
    b = batch_size
    e = np.zeros((b, b - 1))
    # Column B−m (1-based) is (m(m+1))^{-1/2} (0,…,0, −m, 1,…,1) with m ones (App. E.3, Eq. 33).
    for m in range(1, b):
        col = b - m - 1  # 0-based column index
        start = b - m - 1  # position of −m
        e[start, col] = -m
        e[start + 1 :, col] = 1.0
        e[:, col] /= math.sqrt(m * (m + 1))
    e.setflags(write=False)
    return e


def im_g_basis(batch_size: int) -> np.ndarray:
    """B × (B−1) matrix 𝔢 with orthonormal columns spanning im G (Yang et al. 2019, Eq. 33)."""
    return _basis_cached(int(batch_size))


def bsb1(batch_size: int, diagonal: float, off_diagonal: float) -> np.ndarray:
    """The B × B matrix with ``diagonal`` on the diagonal and ``off_diagonal`` elsewhere."""
    b = int(batch_size)
    out = np.full((b, b), float(off_diagonal))
    np.fill_diagonal(out, float(diagonal))
    return out


def bsb1_parts(sigma: np.ndarray, *, rtol: float = 1e-12) -> tuple[float, float] | None:
    """(diagonal, off-diagonal) if ``sigma`` is BSB1 to relative ``rtol``, else None."""
    b = sigma.shape[0]
    d = float(np.mean(np.diag(sigma)))
    if b == 1:
        return d, 0.0
    off = float((sigma.sum() - np.trace(sigma)) / (b * (b - 1)))
    scale = max(abs(d), abs(off), np.finfo(float).tiny)
    ref = bsb1(b, d, off)
    if np.max(np.abs(sigma - ref)) <= rtol * scale:
        return d, off
    return None


def isotropic_g_scale(sigma: np.ndarray, *, rtol: float = 1e-12) -> float | None:
    """μ if GΣG = μG (to relative ``rtol``), else None.

    BSB1 matrices q[(1−c)I + c11ᵀ] have μ = q(1−c) (App. F, Cor. F.9), but
    every Σ = μI + u1ᵀ + 1uᵀ (any u) also does: for all of these the spherical
    weight 𝒦(v; Σ) of Defn E.32 is identically 1.
    """
    b = sigma.shape[0]
    g = centering_matrix(b)
    sg = g @ sigma @ g
    mu = float(np.trace(sg)) / (b - 1)
    scale = max(float(np.max(np.abs(sigma))), np.finfo(float).tiny)
    if np.max(np.abs(sg - mu * g)) <= rtol * scale:
        return mu
    return None


def psd_sqrt_factor(sigma: np.ndarray) -> np.ndarray:
    """A factor L (B × B) with L Lᵀ = Σ for PSD Σ; tiny negative eigenvalues are set to 0."""
    w, u = np.linalg.eigh(sigma)
    w = np.clip(w, 0.0, None)
    return u * np.sqrt(w)
