"""The invariant distribution of the BN chain, estimated by ergodic averages (Daneshmand et al. 2020, App. E).

The linear BN chain H_{ℓ+1} = BN_{0,1}(H_ℓ + γ W_ℓ H_ℓ) (Eqs. 1/7, BN without mean subtraction) is a
Markov chain on ℋ, the d × N matrices whose rows have norm √N, so M = M(H) = H Hᵀ/N has a unit
diagonal (p.1) and Tr M = d.  Appendix E studies its invariant distribution ν_γ through three
expectations, which the ergodic theorem turns into averages over the layers of one long chain (Eq. 49):

* E‖M‖²_F, whose invariance gives the Ω(√d) rank of Thm 2 (Lemma 13: E‖M‖²_F ≤ d^{3/2}/√(1 − α));
* E Tr(M³) and E Tr(diag(M²)²), whose ratio is the **regularity constant**
  α = E Tr(diag(M²)²) / E Tr(M³) (Def. 3, Eq. 46; Lemma 10: α < 1; Fig. 8: α < 0.9 for d > 10).

:func:`frobenius_drift` is the expansion δ_F(M) of Lemma 7 (Eq. 43), the expected change of ‖M‖²_F
over one layer divided by γ²; :func:`regularity_terms` the three per-matrix quantities;
:func:`invariant_moments` runs the chain (batched over independent chains, streamed: memory does not
grow with the depth) and returns the ergodic averages with batch-means standard errors, α, and the
bounds of Lemma 13, Eq. 55 and Thm 14 (Eq. 60) evaluated at the estimated α.

Besides these, each layer's mean off-diagonal entry of M is averaged (Lemma 4: the law of a row of H
equals the law of its negation under ν_γ, so E M_ij = 0 for i ≠ j, Eq. 31), and the smallest soft rank
and numerical rank over the counted layers are kept (Cor. 15 speaks of every finite ℓ, not the average).

The chain steps are those of :func:`bnlab.rank.chain_step` with ``norm="bn_nomean"``,
``activation="linear"``; weights as :func:`bnlab.rank.draw_weights` (Def. 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bnlab._validation import check_int, check_real
from bnlab.rank.chains import _check_gamma, _resolve_device, _resolve_dtype, _step, draw_weights
from bnlab.rank.measures import as_representation

__all__ = ["frobenius_drift", "regularity_terms", "InvariantMoments", "invariant_moments"]


def _as_second_moment(m: Any, name: str) -> torch.Tensor:
    if not isinstance(m, torch.Tensor):
        try:
            m = torch.as_tensor(m, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} is not allowed: cannot convert to a float64 tensor ({exc})") from None
    if not m.is_floating_point() or m.is_complex():
        m = m.to(torch.float64)
    if m.ndim < 2 or m.shape[-1] != m.shape[-2] or m.shape[-1] == 0:
        raise ValueError(f"{name} is not allowed: expected square matrices of shape (..., d, d), d >= 1, "
                         f"got shape {tuple(m.shape)}")
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"{name} is not allowed: it contains NaN or infinite entries")
    return m


def frobenius_drift(m: Any) -> torch.Tensor:
    """δ_F(M) = 2d² − 2‖M‖²_F − 8 Tr(M³) + 8 Tr(diag(M²)²)  (Daneshmand et al. 2020, Lemma 7, Eq. 43).

    For M = M(H) with a unit diagonal (H ∈ ℋ) and W with i.i.d. zero-mean unit-variance entries,
    (E_W‖M₊‖²_F − ‖M‖²_F)/γ² = δ_F(M) + O(γ), M₊ the second moment after one layer of Eq. 42.
    Shape (..., d, d) → (...).  The formula assumes the unit diagonal; it is evaluated as written for
    any square input.
    """
    m = _as_second_moment(m, "m")
    d = m.shape[-1]
    m2 = m @ m
    fro2 = m.pow(2).sum(dim=(-2, -1))
    tr3 = (m2 * m.transpose(-2, -1)).sum(dim=(-2, -1))
    diag_sq = torch.diagonal(m2, dim1=-2, dim2=-1).pow(2).sum(-1)
    return 2.0 * d * d - 2.0 * fro2 - 8.0 * tr3 + 8.0 * diag_sq


def regularity_terms(h: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(‖M‖²_F, Tr(M³), Tr(diag(M²)²)) of M = H Hᵀ / N for H of shape (..., d, N).

    The numerator and denominator of the regularity constant (Def. 3, Eq. 46) and the Frobenius norm
    of Lemma 13, per matrix.  By Prop. 8 they equal ‖λ‖²₂, ‖λ‖³₃ and ‖λ‖⁴₂/d when the rows of M have
    equal norms (λ the eigenvalues of M).
    """
    h = as_representation(h, "h")
    n = h.shape[-1]
    m = h @ h.transpose(-2, -1) / n
    m2 = m @ m
    fro2 = m.pow(2).sum(dim=(-2, -1))
    tr3 = (m2 * m).sum(dim=(-2, -1))  # M symmetric: Tr(M² M) = Σ (M²)_ij M_ij
    diag_sq = torch.diagonal(m2, dim1=-2, dim2=-1).pow(2).sum(-1)
    return fro2, tr3, diag_sq


#: the per-layer quantities :func:`invariant_moments` averages, in the order of its sums
_KEYS = ("frobenius2", "trace_m3", "diag_m2_sq", "r", "offdiag_m", "soft_rank")


@dataclass(frozen=True)
class InvariantMoments:
    """Ergodic averages of the BN chain (Daneshmand et al. 2020, Eq. 49), over ``layers_counted`` layers
    per chain after ``burn_in``.

    ``means`` / ``stderr``: for each of ``frobenius2`` (‖M‖²_F), ``trace_m3`` (Tr M³), ``diag_m2_sq``
    (Tr diag(M²)²), ``r`` (r(H) = d²/‖M‖²_F), ``offdiag_m`` (the layer's mean of M_ij over i ≠ j) and
    ``soft_rank`` (rank_τ), the average over all chains and layers and its batch-means standard error
    (the counted layers of each chain cut into ``batches`` consecutive batches; one mean per
    chain-batch).  ``alpha`` = means["diag_m2_sq"] / means["trace_m3"] (Def. 3) with ``alpha_stderr``
    from the chain-batch ratios.  ``min_soft_rank`` and ``min_numerical_rank``: the smallest values over
    every counted layer of every chain.
    """

    config: dict
    width: int
    layers_counted: int
    means: dict
    stderr: dict
    alpha: float
    alpha_stderr: float
    per_chain_alpha: np.ndarray
    min_soft_rank: int
    min_numerical_rank: int
    extra: dict = field(default_factory=dict)

    @property
    def lemma13_bound(self) -> float:
        """d^{3/2}/√(1 − α): Lemma 13's upper bound on E‖M‖²_F (Eq. 50); ``inf`` when α ≥ 1."""
        return self.width ** 1.5 / math.sqrt(1.0 - self.alpha) if self.alpha < 1.0 else math.inf

    @property
    def eq55_bound(self) -> float:
        """d²/(1 − α): the bound E‖λ‖³₃ = E Tr M³ ≤ d²/(1 − α) of Eq. 55; ``inf`` when α ≥ 1."""
        return self.width ** 2 / (1.0 - self.alpha) if self.alpha < 1.0 else math.inf

    @property
    def theorem14_lower_bound(self) -> float:
        """√((1 − α) d): Thm 14's lower bound on E r(H) (Eq. 60); 0 when α ≥ 1."""
        return math.sqrt((1.0 - self.alpha) * self.width) if self.alpha < 1.0 else 0.0

    def to_dict(self) -> dict:
        return {
            "config": dict(self.config), "width": self.width, "layers_counted": self.layers_counted,
            "means": dict(self.means), "stderr": dict(self.stderr), "alpha": self.alpha,
            "alpha_stderr": self.alpha_stderr, "per_chain_alpha": self.per_chain_alpha.tolist(),
            "min_soft_rank": self.min_soft_rank, "min_numerical_rank": self.min_numerical_rank,
            "lemma13_bound": self.lemma13_bound, "eq55_bound": self.eq55_bound,
            "theorem14_lower_bound": self.theorem14_lower_bound, **self.extra,
        }


def invariant_moments(
    width: int,
    depth: int,
    *,
    batch_size: int | None = None,
    chains: int = 1,
    residual_gamma: float | str = math.inf,
    init: str = "gaussian",
    burn_in: int = 100,
    tau: float = 0.5,
    batches: int = 20,
    seed: int = 0,
    dtype: Any = "float64",
    device: Any = "cpu",
    block_size: int = 256,
) -> InvariantMoments:
    """Ergodic estimates of E‖M‖²_F, E Tr M³, E Tr diag(M²)², α (Def. 3) and E r(H) under ν_γ.

    Runs ``chains`` independent linear BN chains H_{ℓ+1} = BN_{0,1}(H_ℓ + γ W_ℓ H_ℓ) (Eq. 7; γ = ∞: no
    skip) of width d = ``width`` and batch N = ``batch_size`` (default N = d, as Fig. 3 of the paper),
    from Gaussian inputs, for ``burn_in + depth`` layers, and averages over the last ``depth`` layers
    (Eq. 49; Figs. 8 and 9 use depth 10⁵).  ``init``: "gaussian" or "uniform" (U[−√3, √3]).  The soft
    rank uses the threshold ``tau`` (Eq. 3) at tr M = d (automatic here: BN gives M a unit diagonal).
    ``batches``: the number of consecutive batches per chain for the standard errors (``depth`` must be
    at least ``batches``).  Memory O(block_size · chains · d · max(d, N)), independent of the depth.
    """
    d = check_int("width", width, minimum=1)
    n = d if batch_size is None else check_int("batch_size", batch_size, minimum=1)
    depth = check_int("depth", depth, minimum=1)
    chains = check_int("chains", chains, minimum=1)
    gamma = _check_gamma(residual_gamma)
    burn_in = check_int("burn_in", burn_in, minimum=0)
    tau = check_real("tau", tau, minimum=0.0, strict_minimum=True)
    batches = check_int("batches", batches, minimum=1, maximum=depth)
    seed = check_int("seed", seed, minimum=0)
    block_size = check_int("block_size", block_size, minimum=1)
    dt = _resolve_dtype(dtype)
    dev = _resolve_device(device)
    # validates ``init`` before any work
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    draw_weights((0, d, d), init, gen, dt, dev)

    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # d × d products of a few dozen rows: intra-op threads only add synchronization (measured 15–30×
        # slower with 2 threads on a loaded 2-core machine); restored below.
        torch.set_num_threads(1)
    try:
        return _run(d, n, depth, chains=chains, gamma=gamma, init=init, burn_in=burn_in, tau=tau, batches=batches,
                    seed=seed, dt=dt, dev=dev, block_size=block_size, gen=gen)
    finally:
        torch.set_num_threads(threads)


def _run(d, n, depth, *, chains, gamma, init, burn_in, tau, batches, seed, dt, dev, block_size, gen):
    h = torch.randn((chains, d, n), generator=gen, dtype=dt, device=dev)
    sums = torch.zeros((len(_KEYS), chains, batches), dtype=torch.float64, device=dev)
    counts = torch.zeros((chains, batches), dtype=torch.float64, device=dev)
    min_sr = d
    min_nr = d
    offdiag = torch.ones(d, d, dtype=torch.bool, device=dev).fill_diagonal_(False)
    per_batch = -(-depth // batches)  # ceil: the last batch may be shorter
    total = burn_in + depth
    done = 0
    rtol = max(d, n) * torch.finfo(dt).eps
    with torch.no_grad():
        while done < total:
            b = min(block_size, total - done)
            weights = draw_weights((b, chains, d, d), init, gen, dt, dev)
            kept = []
            for j in range(b):
                h = _step(h, weights[j], gamma, "bn_nomean", "linear", "pre", 0.0)
                layer = done + j + 1
                if layer > burn_in:
                    kept.append(h)
            done += b
            if not kept:
                continue
            stack = torch.stack(kept)  # (k, chains, d, n)
            if not bool(torch.isfinite(stack).all()):
                raise FloatingPointError("the chain produced non-finite values (a row of zeros has no BN scale)")
            m = stack @ stack.transpose(-2, -1) / n
            m2 = m @ m
            fro2 = m.pow(2).sum(dim=(-2, -1))
            lam = torch.linalg.eigvalsh(m)
            values = torch.stack([
                fro2,
                (m2 * m).sum(dim=(-2, -1)),
                torch.diagonal(m2, dim1=-2, dim2=-1).pow(2).sum(-1),
                d * d / fro2,  # r(H): Tr M = d under BN (p.1)
                m[..., offdiag].mean(-1) if d > 1 else torch.zeros_like(fro2),
                (lam >= tau).sum(-1).to(dt),
            ]).to(torch.float64)  # (keys, k, chains)
            min_sr = min(min_sr, int((lam >= tau).sum(-1).min()))
            lam_max = lam[..., -1:].clamp_min(0)
            min_nr = min(min_nr, int((lam > rtol * lam_max).sum(-1).min()))
            first = done - b + 1  # layer index of weights[0]
            layer_ids = [first + j for j in range(b) if first + j > burn_in]
            batch_ids = torch.tensor([(l - burn_in - 1) // per_batch for l in layer_ids], device=dev)
            for bi in batch_ids.unique().tolist():
                sel = batch_ids == bi
                sums[:, :, bi] += values[:, sel, :].sum(1)
                counts[:, bi] += float(sel.sum())

    means_cb = (sums / counts).cpu().numpy()  # (keys, chains, batches)
    total_sums = sums.sum(dim=(1, 2)).cpu().numpy()
    total_count = float(counts.sum())
    k = chains * batches
    means = {key: float(total_sums[i] / total_count) for i, key in enumerate(_KEYS)}
    stderr = {key: (float(means_cb[i].reshape(-1).std(ddof=1) / math.sqrt(k)) if k > 1 else math.nan)
              for i, key in enumerate(_KEYS)}
    ratio_cb = (means_cb[2] / means_cb[1]).reshape(-1)
    alpha = means["diag_m2_sq"] / means["trace_m3"]
    per_chain = (sums[2].sum(-1) / sums[1].sum(-1)).cpu().numpy()
    config = {"width": d, "batch_size": n, "depth": depth, "burn_in": burn_in, "chains": chains,
              "residual_gamma": "inf" if math.isinf(gamma) else gamma, "init": init, "tau": tau,
              "batches": batches, "seed": seed, "dtype": str(dt).replace("torch.", ""), "device": str(dev)}
    return InvariantMoments(
        config=config, width=d, layers_counted=depth, means=means, stderr=stderr, alpha=float(alpha),
        alpha_stderr=float(ratio_cb.std(ddof=1) / math.sqrt(k)) if k > 1 else math.nan,
        per_chain_alpha=per_chain, min_soft_rank=int(min_sr), min_numerical_rank=int(min_nr),
    )
