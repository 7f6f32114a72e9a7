"""The Monte Carlo route of the dynamics: the same expectations over uniform samples of the batchnorm
sphere, with delta-method standard errors (Yang et al. 2019, App. F.3.1, G.1.1, §3.2) (private).

An independent check of the deterministic routes, not a production route.  See
:mod:`bnlab.theory._routes` for the route objects' common face and the cost check made before it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bnlab.theory._quadrature.rules import chi_inverse_moment
from bnlab.theory._quadrature.sphere import ratio_stats, sample_sphere

__all__ = ["MonteCarloRoute"]


@dataclass(frozen=True)
class MonteCarloRoute:
    """``n_samples`` uniform samples of the sphere drawn from ``rng``; standard errors beside each value."""

    act: object
    batch_size: int
    n_samples: int
    rng: object
    method: ClassVar[str] = "montecarlo"

    def forward(self):
        """(λ_L↑, λ_M↑, (se_L, se_M), truncation error)."""
        lam_l, lam_m, stderr = _forward_montecarlo(self.act, self.batch_size, self.n_samples, self.rng)
        return lam_l, lam_m, stderr, None

    def backward(self):
        """(λ_G↓, λ_L↓, λ_M↓, (se_G, se_L, se_M), truncation error)."""
        (lam_g, lam_l, lam_m), stderr = _backward_montecarlo(self.act, self.batch_size, self.n_samples, self.rng)
        return lam_g, lam_l, lam_m, stderr, None

    def cross_batch(self):
        """(c_CB*, λ_M̃, (se_c, se_λ), truncation error)."""
        c, lam, stderr = _cross_batch_montecarlo(self.act, self.batch_size, self.n_samples, self.rng)
        return c, lam, stderr, None


def _forward_montecarlo(act, batch_size: int, n_samples: int, rng, chunk: int = 20000):
    """λ_L, λ_M as ratios of means over u ~ Unif(S^{B−2} ⊂ W), with delta-method errors.

    tr(P_S ∘ G^{⊗2}Ĵ ∘ P_S) over S = L, M uses the orthogonal projector onto L:
    ⟨P_L(A), uuᵀ⟩ = Σ_i c_i u_i², c = (diag A − mean)/(1 − 2/B) for A ∈ H_B^G.
    """
    b = batch_size
    num_l, num_m, den = [], [], []
    done = 0
    while done < n_samples:
        n = min(chunk, n_samples - done)
        u = sample_sphere(b, n, rng)
        f = act(math.sqrt(b) * u)
        gf = f - f.mean(axis=1, keepdims=True)
        dg = gf * gf
        c = (dg - dg.mean(axis=1, keepdims=True)) / (1.0 - 2.0 / b)
        pl = (c * u * u).sum(axis=1)
        tot = dg.sum(axis=1)
        fu = (gf * u).sum(axis=1)
        num_l.append((b - 1) * pl)
        num_m.append((b - 1) * (fu * fu - tot / (b - 1) - pl))
        den.append(2.0 * tot / (b - 1))  # 2μ* = 2 E|Gf|²/(B−1)
        done += n
    num_l, num_m, den = map(np.concatenate, (num_l, num_m, den))
    lam_l, se_l = ratio_stats(num_l / (b - 1), den)
    if b > 3:
        dim_m = b * (b - 3) / 2.0
        lam_m, se_m = ratio_stats(num_m / dim_m, den)
    else:
        lam_m, se_m = None, math.nan
    return lam_l, lam_m, (se_l, se_m)


def _backward_montecarlo(act, b: int, n_samples: int, rng, chunk: int | None = None):
    """Traces of X ↦ Ã X Ãᵀ (Ã = P_u D G) over RG, L, M per sample; ratio to E|Gφ(√B u)|²."""
    sums = {"G": [], "L": [], "M": [], "den": []}
    g_mat = np.eye(b) - 1.0 / b
    if chunk is None:
        chunk = max(16, 2_000_000 // (b * b))  # ≈ 16 MB per (chunk, B, B) array
    done = 0
    while done < n_samples:
        n = min(chunk, n_samples - done)
        u = sample_sphere(b, n, rng)
        d = act.derivative(math.sqrt(b) * u)
        f = act(math.sqrt(b) * u)
        gf = f - f.mean(axis=1, keepdims=True)
        p = g_mat[None] - u[:, :, None] * u[:, None, :]
        pd = p * d[:, None, :]
        at = pd - pd.mean(axis=2, keepdims=True)  # P D G: right-multiplying by G removes row means, O(B²)
        fro = np.einsum("nij,nij->n", at, at)
        tr = np.einsum("nii->n", at)
        tr2 = np.einsum("nij,nji->n", at, at)
        diag2 = np.einsum("nii->ni", at) ** 2
        t_h = 0.5 * (tr * tr + tr2)
        t_g = fro / (b - 1)
        t_l = (diag2.sum(axis=1) - fro / b) / (1.0 - 2.0 / b)
        sums["G"].append(t_g)
        sums["L"].append(t_l)
        sums["M"].append(t_h - t_g - t_l)
        sums["den"].append((gf * gf).sum(axis=1) / (b - 1))  # μ*
        done += n
    arr = {k: np.concatenate(v) for k, v in sums.items()}
    k = b / (b - 3.0)
    dims = {"G": 1.0, "L": b - 1.0, "M": b * (b - 3) / 2.0}
    out, err = [], []
    for s in ("G", "L", "M"):
        r, e = ratio_stats(k * arr[s] / dims[s], arr["den"])
        out.append(r)
        err.append(e)
    return out, tuple(err)


def _cross_batch_montecarlo(act, b: int, n: int, rng, chunk: int = 50000):
    xs, ys, ms = [], [], []
    done = 0
    kappa = (b - 1.0) / b
    sb = math.sqrt(b)
    while done < n:
        k = min(chunk, n - done)
        u = sample_sphere(b, k, rng)
        f = act(sb * u)
        g = act.derivative(sb * u)
        ms.append(f.mean(axis=1))
        gf = f - f.mean(axis=1, keepdims=True)
        ys.append((gf * gf).sum(axis=1) / (b - 1))
        xs.append((g * (kappa - u * u)).sum(axis=1) / (b - 1))
        done += k
    x, y, m = map(np.concatenate, (xs, ys, ms))
    c = sb * chi_inverse_moment(b, 1)
    xm, ym = x.mean(), y.mean()
    lam = c * c * xm * xm / ym
    cov = np.cov(np.stack([x, y])) / x.size
    grad = np.array([2 * c * c * xm / ym, -c * c * xm * xm / ym**2])
    se_lam = math.sqrt(max(grad @ cov @ grad, 0.0))
    mm = m.mean()
    se_c = 2 * abs(mm) * m.std(ddof=1) / math.sqrt(m.size)
    return mm * mm, lam, (se_c, se_lam)
