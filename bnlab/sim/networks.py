"""Ensembles of random finite-width networks, batched over networks, with per-layer measurements.

The network (Yang et al. 2019, Eq. 7: batchnorm *before* φ)::

    h^1 = x W^1 + b^1
    h^l = φ(γ·N(h^{l−1}) + β) W^l + b^l                  (l = 2..L)
    h^l = h^{l−1} + r·(φ(γ·N(h^{l−1}) + β) W^l + b^l)    (residual variant, r = residual_scale)

with rows = samples, N the per-neuron batch normalization

* ``"bn"``: N(h)_{iα} = (h_{iα} − μ_α)/sqrt(σ²_α + ε), μ_α, σ²_α the batch mean and
  *biased* batch variance of neuron α (1/B, as in Eq. 8: √B·Gh/‖Gh‖);
* ``"bn_nomean"``: N(h)_{iα} = h_{iα}/sqrt(mean_i h²_{iα} + ε) (BN without mean
  subtraction, Daneshmand et al. 2020, Eq. 2 and Fig. 7);
* ``"none"``: no normalization (vanilla MLP, h^l = φ(h^{l−1}) W^l + b^l).

A linear network is ``phi="identity"``.  Weights come from
:func:`bnlab.sim.init.init_weights` (variance σ_w²/fan_in), biases are
N(0, σ_b²).  Every network gets its own iid N(0, 1) input batch of dimension
``input_dim`` unless ``inputs`` is given (then shared by all networks); with
``num_batches = k ≥ 2`` the network is applied to k batches, each normalized
with its own statistics (Yang et al. 2019, §3.2, Eq. 20), batch j ≥ 1 being
``ρ₀·x₀ + sqrt(1 − ρ₀²)·z_j`` (ρ₀ = ``input_correlation``).

The loss is a random linear readout of the last pre-activations,
L = Σ_{b,i,α} v_{biα} h^L_{biα} with v iid N(0, 1), and δ^l = ∂L/∂h^l is computed
by true reverse-mode autograd through the batch statistics (no gradient
independence assumption, cf. Yang et al. 2019, App. B).

Vectorization: one layer of a chunk of networks is one batched operation over
(networks, k·B, ·) — a ``torch.bmm`` with explicit weights, or the conditional
sampling of :mod:`bnlab.sim.conditional` for Gaussian weights; the Python loop
runs over layers only, and over chunks of networks when the autograd graph of
all networks would not fit ``max_memory_bytes`` (explicit weights keep every
layer's weights for the backward pass: networks·depth·width²·itemsize bytes) or,
on a CPU with T ≥ 2 torch threads, over T chunks run concurrently.

Errata (Yang et al. 2019)
-------------------------
* Eq. (7) prints σ²_α = sqrt(var + ε); the normalization divides by
  σ_α = sqrt(var + ε) (the simulator matches ``torch.nn.BatchNorm1d`` in
  training mode, tests/sim/test_networks.py).
* Thm H.14 prints the denominator as "P(B/2, α/2)² J_φ(1) − J_φ(−1/(B−1))";
  the square of P (the Pochhammer symbol Γ(a+b)/Γ(a), App. A) multiplies the whole
  difference J_φ(1) − J_φ(−1/(B−1)) (checked against Thm 3.11 for φ = id, against the
  Gegenbauer form Eq. 24 for relu, and by simulation; tests/sim/test_reference.py,
  tests/sim/test_theory_agreement.py).  Verified without erratum: Thm 3.11 / Cor. I.6,
  λ_M̃(id) = ((B−1)/2)·P(B/2, 1/2)^−2 = (B−1)·Beta(B/2, 1/2)²/(2π).
"""
from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import IO, Any

import numpy as np
import torch

from bnlab._validation import check_device, check_choice, check_int, check_real
from bnlab._vocabulary import INIT_ALIASES, NORM_ALIASES, canonical_value, renamed_keywords
from bnlab.sim import measure as _m
from bnlab.sim.fit import _TAIL_MIN_NETWORKS, RateFit, fit_geometric_rate
from bnlab.sim._linalg import gram
from bnlab.sim.conditional import conditional_gaussian_layer
from bnlab.sim.init import INITS, _draw, _thread_pool, fill_

__all__ = ["NORMALIZATIONS", "WEIGHT_SAMPLINGS", "EnsembleResult", "simulate", "resolve_device", "resolve_dtype"]

#: Per-neuron normalizations :func:`simulate` accepts.
NORMALIZATIONS = ("bn", "bn_nomean", "none")

#: How :func:`simulate` realizes the weights: "explicit" draws every W; "conditional" samples
#: Gaussian layers from their conditional law (:mod:`bnlab.sim.conditional`, exact in law);
#: "auto" picks "conditional" where it is exact and cheaper.
WEIGHT_SAMPLINGS = ("auto", "explicit", "conditional")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_device(device: Any) -> torch.device:
    """``device`` as a torch.device, or ValueError (unknown, or CUDA requested without CUDA)."""
    return check_device("device", device)


def resolve_dtype(dtype: Any) -> torch.dtype:
    """'float32'/'float64' (or the torch dtypes) → torch dtype, else ValueError."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    return _DTYPES[check_choice("dtype", dtype, tuple(_DTYPES))]


@dataclass(frozen=True)
class EnsembleResult:
    """Per-network, per-layer measurements of one simulated ensemble (float64 NumPy arrays).

    Layer l = 1..L is column l − 1.  Statistics of the batch covariance Σ^l = H Hᵀ/N
    are averaged over the k batches (they are exchangeable).

    Attributes
    ----------
    config : dict
        The arguments of :func:`simulate` (JSON-serializable).
    q, c : (networks, L)
        BSB1 projection of Σ^l: mean diagonal q and (mean off-diagonal)/q.
    bsb1_residual_sq : (networks, L)
        ‖Σ^l − BSB1(q, c)‖²_F (distance to the nearest BSB1 matrix, squared).
    diag_var, offdiag_var : (networks, L)
        Variance of the diagonal / off-diagonal entries of Σ^l divided by q²
        (Yang et al. 2019, Fig. 1c: large when the fixed point breaks symmetry).
    mean_covariance : (L, B, B)
        Σ^l averaged over networks and batches.
    final_covariance : (networks, B, B)
        Σ^L of the first batch of every network (Fig. 1d examples).
    grad_norm_sq, weight_grad_norm_sq : (networks, L) or None
        ‖∂L/∂h^l‖²_F and ‖∂L/∂W^l‖²_F of one batch's readout loss, averaged over batches.
    cross_batch_corr : (networks, L) or None
        Centered correlation between batch 0 and batch j, averaged over j = 1..k−1
        (the pairs are exchangeable; see :mod:`bnlab.sim.measure`).
    cross_batch_cov : (networks, L) or None
        Mean entry of the cross-batch block Ξ^l = H₀H_jᵀ/N, averaged over j ≥ 1 (its fixed
        point is c*_CB, Eq. 21).
    chunks : int
        Number of chunks of networks the simulation was split into (memory bound; on a CPU
        with T ≥ 2 torch threads at least min(T, networks), run concurrently).
    hidden : dict
        ``{l: h^l}`` of the first network, shape (k, B, N), for the requested ``record_layers``.
    """

    config: dict
    q: np.ndarray
    c: np.ndarray
    bsb1_residual_sq: np.ndarray
    diag_var: np.ndarray
    offdiag_var: np.ndarray
    mean_covariance: np.ndarray
    final_covariance: np.ndarray
    grad_norm_sq: np.ndarray | None = None
    weight_grad_norm_sq: np.ndarray | None = None
    cross_batch_corr: np.ndarray | None = None
    cross_batch_cov: np.ndarray | None = None
    chunks: int = field(default=1)
    hidden: dict = field(default_factory=dict)

    @property
    def networks(self) -> int:
        return self.q.shape[0]

    @property
    def depth(self) -> int:
        return self.q.shape[1]

    def bsb1_distance(self, q_star: float, c_star: float) -> np.ndarray:
        """Relative distance ‖Σ^l − Σ*‖_F/‖Σ*‖_F per network and layer, Σ* = BSB1(q*, c*).

        Exact from the stored projection: Σ − Σ* splits Frobenius-orthogonally into
        Σ − BSB1(q, c) and BSB1(q, c) − BSB1(q*, c*).
        """
        b = self.config["batch_size"]
        q_star = check_real("q_star", q_star, minimum=0.0, strict_minimum=True)
        c_star = check_real("c_star", c_star)
        d_diag = self.q - q_star
        d_off = self.q * self.c - q_star * c_star
        num = self.bsb1_residual_sq + b * d_diag**2 + b * (b - 1) * d_off**2
        den = b * q_star**2 + b * (b - 1) * (q_star * c_star) ** 2
        return np.sqrt(num / den)

    def default_fit_layers(self) -> tuple[int, int]:
        """Layers fitted by default: drop ~10% (≥ 2) at each end (forward transient at the
        input, backward transient next to the readout)."""
        depth = self.depth
        skip = max(2, int(round(0.1 * depth)))
        first, last = 1 + skip, depth - skip
        if last - first < 1:
            raise ValueError(f"depth={depth} is too small to fit a rate past the transients: use depth >= 6")
        return first, last

    @property
    def grad_norm_tail_index(self) -> float:
        """Tail index α of the squared gradient norms across networks: P(‖δ^l‖² > t) ∝ t^−α.

        Moments of order < α are finite; α ≤ 2 means infinite variance, where ensemble means
        converge more slowly than 1/sqrt(networks) and percentile-bootstrap CIs of rates are too
        narrow (:meth:`grad_explosion_rate` then uses the heavy-tail bootstrap-t of
        :mod:`bnlab.sim.fit`).

        Batch normalization divides neuron β's backward signal by its batch standard deviation
        σ_β.  Given the layer's input a (B × d), the pre-activation vectors h_β ∈ R^B of the N
        neurons are iid N(0, s²·a aᵀ) — exactly, at any width, for Gaussian weights — so
        B·σ_β² = ‖G h_β‖² (G the centering projector) is a generalized χ² with
        r = rank(G a aᵀ G) = min(B − 1, d) degrees of freedom (for the inputs a network sees), whose
        density vanishes like t^(r/2 − 1) at 0: P(1/σ_β² > t) ∝ t^−r/2.  One neuron's gain sets the
        tail of the layer's sum, and a product of independent gains keeps the smallest index, so
        d runs over the width and the input dimension.  Hence, with d_min = min(width, input_dim):

        * ``norm="bn"``, ε = 0: α = min(B − 1, d_min)/2 (infinite variance for B ≤ 5);
        * ``"bn_nomean"``, ε = 0: α = min(B, d_min)/2 (no centering: B degrees of freedom);
        * ε > 0 or ``"none"``: ∞ (the gain is bounded by 1/ε; with ε small against the batch
          variance the tail is heavy up to gains of order 1/ε all the same).

        The other initializations give the same index: their h_β have a bounded density that
        is positive at 0 in the same r-dimensional space, which is all the tail depends on.
        tests/sim/test_networks.py checks the premise: at deep layers the batch variances of the
        neurons follow the generalized χ² law of the measured covariance, and r + 1 degrees of
        freedom are rejected.
        """
        cfg = self.config
        if cfg["eps"] > 0 or _norm_of(cfg) == "none":
            return math.inf
        dof = cfg["batch_size"] - 1 if _norm_of(cfg) == "bn" else cfg["batch_size"]
        return min(dof, cfg["width"], cfg["input_dim"]) / 2

    def grad_explosion_rate(
        self, first_layer: int | None = None, last_layer: int | None = None, *, weights: bool = False, **kw
    ) -> RateFit:
        """λ_G: per-layer growth of E‖∂L/∂h^l‖² towards the input (Yang et al. 2019, Thm 3.9/3.10),
        or of the weight gradients with ``weights=True`` (same rate, §3.1 "Weight Gradient").

        Fitted by :func:`bnlab.sim.fit_geometric_rate` with ``estimator="step_ratio"`` unless
        ``estimator`` is given: the mean one-step ratio is unbiased for the heavy-tailed gradient
        norms of small batches, where the log of the ensemble mean is biased low (relu, B = 4,
        width 1000, 200 networks: −1.3 % on average over 20 ensembles, and its CI covered the
        theory in 9 of 20); both agree within their CIs for B ≥ 5 (docs/sim.md).

        The CI of the step-ratio estimator takes an infinite variance into account: where
        :attr:`grad_norm_tail_index` is ≤ 2 (BN with ε = 0 at B ≤ 5) and there are ≥ 20
        networks it is the semi-parametric bootstrap-t of :mod:`bnlab.sim.fit`
        (``RateFit.ci_method == "tail_bootstrap_t"``), else the percentile bootstrap, which is
        inconsistent for infinite-variance means but fine otherwise; ``tail_index=None`` forces
        the percentile bootstrap.  Measured over 100 ensembles (relu, B = 4, width 1000, depth
        50, 200 networks): the 95 % CI covered Thm 3.10's λ_G in 88 (percentile bootstrap: 75),
        and the mean of all 20 000 networks in 90 (65); at B = 8 (α = 3.5, 50 ensembles) the
        two intervals have the same width and coverage (86–96 %), so the percentile bootstrap
        stays there."""
        g = self.weight_grad_norm_sq if weights else self.grad_norm_sq
        if g is None:
            raise ValueError("measure_gradients=False: this ensemble has no gradient measurements")
        f0, f1 = self.default_fit_layers()
        kw.setdefault("seed", self.config["seed"])
        kw.setdefault("estimator", "step_ratio")
        alpha = self.grad_norm_tail_index
        heavy = alpha <= 2 and g.shape[0] >= _TAIL_MIN_NETWORKS
        if heavy and kw["estimator"] == "step_ratio" and "tail_index" not in kw:
            kw["tail_index"] = alpha
        return fit_geometric_rate(g, first_layer or f0, last_layer or f1, invert=True, **kw)

    def cross_batch_window(self, *, upper: float = 0.5, snr: float = 8.0, skip: int = 2) -> tuple[int, int]:
        """Layers where the mean cross-batch correlation is in the linear regime and above noise.

        From layer ``skip + 1`` on, the contiguous run of layers whose ensemble mean ρ̄_l is
        ≤ ``upper`` (linearization of Eq. 20 valid) and ≥ ``snr`` standard errors (across networks).
        """
        rho = self.cross_batch_corr
        if rho is None:
            raise ValueError("num_batches=1: this ensemble has no cross-batch measurements")
        mean = rho.mean(0)
        se = rho.std(0, ddof=1) / math.sqrt(rho.shape[0]) if rho.shape[0] > 1 else np.abs(mean) * 0
        ok = (mean <= upper) & (mean >= snr * se) & (mean > 0)
        ok[:skip] = False
        idx = np.flatnonzero(ok)
        if idx.size < 2:
            raise ValueError("the cross-batch correlation has fewer than 2 layers in its linear regime above noise")
        start = idx[0]
        end = start
        while end + 1 < len(ok) and ok[end + 1]:
            end += 1
        if end == start:
            raise ValueError("the cross-batch correlation has fewer than 2 consecutive layers in its linear regime")
        return int(start + 1), int(end + 1)

    def cross_batch_rate(self, first_layer: int | None = None, last_layer: int | None = None, **kw) -> RateFit:
        """λ_M̃: per-layer decay of the centered cross-batch correlation (Yang et al. 2019, Thm 3.11/H.13)."""
        if first_layer is None or last_layer is None:
            f0, f1 = self.cross_batch_window()
            first_layer, last_layer = first_layer or f0, last_layer or f1
        kw.setdefault("seed", self.config["seed"])
        if self.cross_batch_corr is None:
            raise ValueError("num_batches=1: this ensemble has no cross-batch measurements")
        return fit_geometric_rate(self.cross_batch_corr, first_layer, last_layer, **kw)


def _norm_of(config: dict) -> str:
    """The normalization of a simulation's config under its canonical name (configs recorded before the
    one vocabulary say ``normalization="batch"``)."""
    value = config.get("norm", config.get("normalization"))
    return NORM_ALIASES.get(value, value)


def _normalize(h: torch.Tensor, k: int, mode: str, eps: float) -> torch.Tensor:
    n, kb, width = h.shape
    hv = h.view(n, k, kb // k, width)
    if mode == "bn":
        return _BatchNorm.apply(hv, eps).view(n, kb, width)
    return (hv * torch.rsqrt((hv * hv).mean(2, keepdim=True) + eps)).view(n, kb, width)


class _BatchNorm(torch.autograd.Function):
    """x̂ = (h − μ)/sqrt(σ² + ε) over dim 2 (the samples of a batch), biased σ² as torch
    BatchNorm1d in training mode, with the closed-form backward

        ∂L/∂h = (g − mean(g) − x̂·mean(g·x̂)) / sqrt(σ² + ε)

    (the gradient through the batch statistics).  Same numbers as autograd through the
    elementary ops (tests/sim/test_networks.py checks it against torch.nn.BatchNorm1d) with
    about half the passes over the (networks, k, B, N) tensors, which bound the simulator's
    non-matmul time.  Two passes for the statistics (mean, then the centered second moment)
    rather than torch.var_mean: as accurate, and var_mean's reduction over the strided batch
    dimension is 5× slower on the CPU.
    """

    @staticmethod
    def forward(ctx, h, eps):
        centered = h - h.mean(2, keepdim=True)
        rstd = torch.rsqrt(centered.pow(2).mean(2, keepdim=True).add_(eps))
        xhat = centered.mul_(rstd)
        ctx.save_for_backward(xhat, rstd)
        return xhat

    @staticmethod
    def backward(ctx, g):
        xhat, rstd = ctx.saved_tensors
        g_xhat = (g * xhat).mean(2, keepdim=True)
        # in place: out-of-place addcmul with a broadcast operand takes a slow non-vectorized
        # path on the CPU (3× the time of sub + addcmul_, measured at (8, 8, 64, 1000) float32)
        grad = (g - g.mean(2, keepdim=True)).addcmul_(xhat, g_xhat, value=-1.0)
        return grad.mul_(rstd), None


def _diagonal_blocks(gram: torch.Tensor, k: int) -> torch.Tensor:
    """The k diagonal B×B blocks (networks, k, B, B) of a (networks, k·B, k·B) Gram matrix."""
    n, rows, _ = gram.shape
    b = rows // k
    return torch.diagonal(gram.view(n, k, b, k, b), dim1=1, dim2=3).permute(0, 3, 1, 2)


def _network_generators(seed: int, start: int, n: int, dev: torch.device) -> list[torch.Generator]:
    # one stream per network, derived from (seed, network index): a network's weights,
    # inputs and readout do not depend on the chunking or on the other networks
    states = [np.random.SeedSequence([seed, start + i]).generate_state(1, dtype=np.uint64)[0] for i in range(n)]
    return [torch.Generator(device=dev).manual_seed(int(s % (2**63 - 1))) for s in states]


@renamed_keywords(normalization="norm")
def simulate(
    phi,
    batch_size: int,
    width: int,
    depth: int,
    networks: int,
    *,
    norm: str = "bn",
    init: str = "gaussian",
    eps: float = 0.0,
    sigma_w2: float = 1.0,
    sigma_b2: float = 0.0,
    bn_gamma: float = 1.0,
    bn_beta: float = 0.0,
    residual_scale: float | None = None,
    num_batches: int = 1,
    input_correlation: float = 0.1,
    input_dim: int | None = None,
    inputs=None,
    measure_gradients: bool = True,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float64",
    max_memory_bytes: int = 1 << 30,
    record_layers=(),
    weight_sampling: str = "auto",
    progress: bool | IO = False,
    _trace: list | None = None,
    _predraw_weights: bool | None = None,
) -> EnsembleResult:
    """Simulate ``networks`` random networks of the given ``width`` and ``depth`` together.

    Parameters
    ----------
    phi : str or Activation
        Nonlinearity (anything :func:`bnlab.activations.get_activation` accepts;
        needs a torch implementation).
    batch_size : int
        B ≥ 2 samples per batch.
    width, depth, networks : int
        N ≥ 1 neurons per layer, L ≥ 1 layers, ≥ 1 independent networks.
    norm : {"bn", "bn_nomean", "none"}
        See the module docstring (the old ``normalization=`` and its values ``"batch"``,
        ``"batch_no_mean"`` are accepted with a DeprecationWarning until the next release).
    init : {"gaussian", "orthogonal", "uniform", "asymmetric_uniform"}
        Weight initialization (:mod:`bnlab.sim.init`).
    eps, sigma_w2, sigma_b2, bn_gamma, bn_beta : float
        BN ε ≥ 0, weight and bias variances, and the BN affine constants γ, β
        (φ is applied to γ·N(h) + β).
    residual_scale : float or None
        If given, the residual variant h^l = h^{l−1} + r·(layer l).
    num_batches : int
        k ≥ 1 batches pushed through the same networks (k ≥ 2 enables the
        cross-batch measurements between batch 0 and the others).  Default 1: for
        the gradients and Σ^l, independent networks are worth more than more batches
        of the same networks at the same cost (``bnlab simulate`` uses 4 because it
        reports the cross-batch rate).
    input_correlation : float
        ρ₀ ∈ [−1, 1] between the default random input batches (default 0.1, as ``bnlab simulate``:
        the cross-batch rate is that of the linearized dynamics, Thm H.13, and
        :meth:`EnsembleResult.cross_batch_rate` fits only layers with ρ̄ ≤ 0.5, so a small ρ₀ puts
        every layer in the fitted regime; it matters only with ``num_batches`` ≥ 2).
    input_dim : int, optional
        Dimension of the default random inputs (default: ``width``).
    inputs : array (B, d) or (k, B, d), optional
        Fixed inputs shared by all networks (overrides the random inputs).
    measure_gradients : bool
        Backpropagate the readout loss (needs memory for the autograd graph).
    seed : int
        Same seed and arguments → same result (on the same device).  Network i
        draws its inputs, weights and readout from its own generator seeded by
        (seed, i), so results do not depend on the chunking (``max_memory_bytes``).
    device : {"cpu", "cuda", ...}
    dtype : {"float32", "float64"}
        Default float64 (as ``bnlab simulate``): it keeps rounding far below every other error
        at 1.2× the time of float32 (relu, B = 32, width 1000, depth 50, 10 networks,
        conditional sampling: 1.46 s vs 1.19 s on one core).
    max_memory_bytes : int
        Bound on the working memory; the networks are processed in chunks below it.
    record_layers : sequence of int
        Layers l (1-based) whose pre-activations h^l of the first network are
        returned in ``EnsembleResult.hidden`` (e.g. for PCA pictures, Fig. 2a).
    weight_sampling : {"auto", "explicit", "conditional"}
        ``"explicit"`` draws every weight matrix (N² numbers per layer and network).
        ``"conditional"`` (``init="gaussian"`` only) samples each layer's products
        a W and δ Wᵀ from their conditional Gaussian law given what the network has
        computed (:mod:`bnlab.sim.conditional`): the joint law of every measured
        quantity is exactly that of explicit Gaussian weights, at O(rows²·N) cost per
        layer instead of O(rows·N²).  ``"auto"`` (default) chooses by device and shape: on a CPU
        ``"conditional"`` for Gaussian weights when k·B ≤ width/4 (where it is cheaper: at k·B =
        width/8 about 2× faster, at width/4 1.4–1.5×, at width/2 1.4–2× slower,
        benchmarks/bench_sim.py), else ``"explicit"``; on a GPU ``"explicit"`` (2–10× faster there);
        and the other route where one network of the preferred one does not fit
        ``max_memory_bytes`` but one of the other does (``_choose_weight_sampling``).
        The two realize different random networks from the same seed (same law,
        different draws).
    progress : bool or text stream
        A progress bar over the networks (tqdm, updated as each chunk of networks finishes, with the
        time left): on stderr (True), on the given stream, or none (False, the default).  ``bnlab
        simulate`` shows it on stderr unless ``--no-progress``.

    Returns
    -------
    EnsembleResult

    Accuracy
    --------
    Exact computation of the finite networks up to rounding of ``dtype``; as
    estimates of the mean field limit the per-layer means carry a Monte Carlo
    error O(1/sqrt(networks·width)) and a bias O(1/width) (measured in
    ``bnlab.reproductions.yang2019_width``).  Exception: with batch
    normalization at B ≤ 5 the gradient norms are heavy-tailed across networks (a
    neuron's backward gain ∝ 1/χ²_{B−1}, tail index (B−1)/2 ≤ 2: infinite variance), so
    their ensemble means converge more slowly than 1/sqrt(networks) and percentile-bootstrap
    CIs are too narrow (:meth:`EnsembleResult.grad_explosion_rate` then uses a heavy-tail
    bootstrap-t, :mod:`bnlab.sim.fit`).
    """
    from bnlab.activations import get_activation

    act = get_activation(phi)
    batch_size = check_int("batch_size", batch_size, minimum=2)
    width = check_int("width", width, minimum=1)
    depth = check_int("depth", depth, minimum=1)
    networks = check_int("networks", networks, minimum=1)
    normalization = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), NORMALIZATIONS)
    init = check_choice("init", canonical_value("init", init, INIT_ALIASES), INITS)
    eps = check_real("eps", eps, minimum=0.0)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    sigma_b2 = check_real("sigma_b2", sigma_b2, minimum=0.0)
    bn_gamma = check_real("bn_gamma", bn_gamma)
    bn_beta = check_real("bn_beta", bn_beta)
    if residual_scale is not None:
        residual_scale = check_real("residual_scale", residual_scale)
    k = check_int("num_batches", num_batches, minimum=1)
    rho0 = check_real("input_correlation", input_correlation, minimum=-1.0, maximum=1.0)
    seed = check_int("seed", seed, minimum=0)
    max_memory_bytes = check_int("max_memory_bytes", max_memory_bytes, minimum=1)
    record_layers = tuple(check_int("record_layers", l, minimum=1, maximum=depth) for l in record_layers)
    weight_sampling = check_choice("weight_sampling", weight_sampling, WEIGHT_SAMPLINGS)
    _check_progress(progress)
    if weight_sampling == "conditional" and init != "gaussian":
        raise ValueError(
            f"weight_sampling='conditional' is not allowed with init={init!r}: the conditional law is "
            "exact only for iid Gaussian weights; use init='gaussian' or weight_sampling='explicit'"
        )
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    _check_normalization_defined(normalization, batch_size, eps, bn_gamma, depth, dt)
    fixed_inputs, k, d0 = _checked_inputs(inputs, input_dim, normalization=normalization, batch_size=batch_size, k=k,
                                          width=width, depth=depth, eps=eps, dt=dt, dev=dev)
    spec = _NetworkSpec(
        act=act, batch_size=batch_size, num_batches=k, width=width, depth=depth, input_dim=d0,
        normalization=normalization, init=init, eps=eps, sigma_w2=sigma_w2, sigma_b2=sigma_b2, bn_gamma=bn_gamma,
        bn_beta=bn_beta, residual_scale=residual_scale, input_correlation=rho0, fixed_inputs=fixed_inputs,
        grads=bool(measure_gradients), device=dev, dtype=dt,
    )
    config = dict(
        phi=act.to_config() if act.name != "callable" else act.spec,
        batch_size=batch_size, width=width, depth=depth, networks=networks, norm=normalization,
        init=init, eps=eps, sigma_w2=sigma_w2, sigma_b2=sigma_b2, bn_gamma=bn_gamma, bn_beta=bn_beta,
        residual_scale=residual_scale, num_batches=k, input_correlation=rho0, input_dim=d0,
        fixed_inputs=fixed_inputs is not None, measure_gradients=spec.grads, seed=seed,
        device=str(dev), dtype=str(dt).replace("torch.", ""),
    )
    if weight_sampling == "conditional" and _trace is not None:
        raise ValueError("_trace records explicit weights: use weight_sampling='explicit'")
    spec, per_network = _with_weight_route(spec, weight_sampling, max_memory_bytes, _trace is not None, _predraw_weights)
    config["weight_sampling"] = "conditional" if spec.conditional else "explicit"
    _check_memory(spec, per_network, networks, max_memory_bytes)
    with _NetworkProgress(progress, networks) as bar:
        parts = _run_chunks(spec, networks, seed, per_network, max_memory_bytes, _trace, record_layers, bar)
    return _ensemble_result(parts, networks, config)


def _check_progress(progress) -> None:
    if isinstance(progress, bool) or callable(getattr(progress, "write", None)):
        return
    raise ValueError(f"progress={progress!r} is not allowed: expected True (a bar on stderr), False (none) or a "
                     "text stream (an object with a write method)")


class _NetworkProgress:
    """The progress bar of :func:`simulate`: networks done of ``networks`` (tqdm), or nothing.  Chunks
    finish on the chunk threads (:func:`_run_chunks`), so updates take a lock."""

    def __init__(self, progress: bool | IO, networks: int):
        self._bar = None
        self._lock = threading.Lock()
        if progress is not False:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=networks, desc="bnlab simulate", unit="network", mininterval=0.5,
                             file=sys.stderr if progress is True else progress, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def __enter__(self) -> "_NetworkProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


def _check_normalization_defined(normalization: str, batch_size: int, eps: float, bn_gamma: float, depth: int,
                                 dt: torch.dtype) -> None:
    """Refuse arguments for which batch normalization would divide by zero or overflow (Yang et al. 2019, Eq. 7)."""
    # B·ε must be finite in the normalization √(‖Gh‖² + Bε) (Yang et al. 2019, Eq. 7), with room for the
    # sum of squares beside it (the theory's own bound: bnlab.theory refuses the same ε)
    eps_max = float(torch.finfo(dt).max) / (batch_size * 1e8)
    if eps > eps_max:
        raise ValueError(
            f"eps={eps!r} is not allowed with batch_size={batch_size} in {str(dt).replace('torch.', '')}: B·ε "
            f"overflows the normalization √(‖Gh‖² + Bε) (Yang et al. 2019, Eq. 7); use eps <= {eps_max:.3g}"
        )
    if normalization == "bn" and eps == 0.0 and batch_size < 2:
        raise ValueError("batch_size must be >= 2 for batch normalization")
    if normalization == "bn" and eps == 0.0 and bn_gamma == 0.0 and depth >= 3:
        # φ(γ·x̂ + β) = φ(β) for every sample: from layer 2 on, batch normalization would divide a
        # batch of identical samples by its zero standard deviation (0/0)
        raise ValueError(
            "bn_gamma=0.0 is not allowed with eps=0 and norm='bn' at depth >= 3: every "
            "sample of a batch would be identical after layer 1 and batch normalization divides by "
            "their zero spread; use eps > 0 or bn_gamma != 0"
        )


def _checked_inputs(inputs, input_dim, *, normalization: str, batch_size: int, k: int, width: int, depth: int,
                    eps: float, dt: torch.dtype, dev: torch.device):
    """(the fixed inputs as a (k, B, d) tensor or None, the number of batches k, the input dimension d).

    Fixed inputs set k (an array of one batch with ``num_batches`` ≥ 2 is refused) and d; without them
    d is ``input_dim`` (default: ``width``)."""
    if inputs is None:
        return None, k, width if input_dim is None else check_int("input_dim", input_dim, minimum=1)
    arr = np.asarray(inputs, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[1] != batch_size or not np.all(np.isfinite(arr)):
        raise ValueError(
            f"inputs is not allowed: expected a finite (B, d) or (k, B, d) array with B={batch_size}, "
            f"got shape {np.shape(inputs)}"
        )
    if normalization == "bn" and eps == 0.0 and depth >= 2 and np.any(np.ptp(arr, axis=1).max(-1) == 0):
        raise ValueError(
            "inputs is not allowed: a batch whose samples are all identical has zero spread, and "
            "batch normalization with eps=0 would divide by it; use distinct samples or eps > 0"
        )
    if arr.shape[0] != k:
        if arr.shape[0] == 1:
            raise ValueError(f"inputs is not allowed: it has 1 batch but num_batches={k}")
        k = arr.shape[0]
    return torch.as_tensor(arr, dtype=dt, device=dev), k, arr.shape[2]


def _with_weight_route(spec: "_NetworkSpec", requested: str, max_memory_bytes: int, traced: bool,
                       predraw_weights: bool | None) -> tuple["_NetworkSpec", int]:
    """``spec`` with its weight route (conditional or explicit, drawn up front or layer by layer) chosen,
    and one network's working memory (bytes) on that route."""
    itemsize = torch.finfo(spec.dtype).bits // 8
    # explicit Gaussian weights on an accelerator, kept for the backward pass anyway: drawn up front
    # (one draw per network, not one per network and layer: _Predrawn)
    predraw = predraw_weights if predraw_weights is not None else spec.device.type != "cpu"
    predraw_route = {route: bool(predraw and spec.grads and route == "explicit" and spec.init == "gaussian")
                     for route in ("explicit", "conditional")}
    sizes = dict(b=spec.batch_size, k=spec.num_batches, width=spec.width, depth=spec.depth, d0=spec.input_dim,
                 grads=spec.grads, itemsize=itemsize)
    per_route = {route: _network_bytes(route == "conditional", predraw_route[route], **sizes)
                 for route in ("explicit", "conditional")}
    route = _choose_weight_sampling(
        requested, spec.init, spec.rows, spec.width, spec.device.type, traced=traced,
        fits={r: per_route[r] <= max_memory_bytes for r in per_route},
    )
    return replace(spec, conditional=route == "conditional", predraw=predraw_route[route]), per_route[route]


def _run_chunks(spec: "_NetworkSpec", networks: int, seed: int, per_network: int, max_memory_bytes: int,
                trace: list | None, record_layers: tuple, bar: _NetworkProgress) -> list[dict]:
    """Simulate the networks in chunks below ``max_memory_bytes``; the chunks' results in network order."""
    # On a multi-core CPU, chunks of networks run concurrently, one per thread with one intra-op
    # thread each: the simulator's many mid-size operations (BN/φ passes, QRs, measurements)
    # scale poorly with intra-op threads, independent networks scale perfectly.  Results do not
    # change: every network has its own generator (chunking invariance, tests/sim).
    threads = torch.get_num_threads()
    workers = min(threads, networks) if spec.device.type == "cpu" and trace is None else 1
    chunk = max(1, min(-(-networks // workers), max_memory_bytes // (per_network * workers)))

    def run_chunk(ci_start):
        ci, start = ci_start
        n = min(chunk, networks - start)
        gen = _network_generators(seed, start, n, spec.device)
        part = _simulate_chunk(spec, n, gen, trace, record_layers if ci == 0 else ())
        bar.update(n)  # a no-op without a bar
        return part

    starts = list(enumerate(range(0, networks, chunk)))
    if workers > 1 and len(starts) > 1:
        torch.set_num_threads(1)  # process-wide for the duration; restored below
        try:
            return list(_thread_pool(workers, "chunks").map(run_chunk, starts))
        finally:
            torch.set_num_threads(threads)
    return [run_chunk(cs) for cs in starts]


def _ensemble_result(parts: list[dict], networks: int, config: dict) -> EnsembleResult:
    """The chunks' results joined (in network order) and checked into one :class:`EnsembleResult`."""
    cat = {
        key: np.concatenate([p[key] for p in parts])
        for key in parts[0]
        if key not in ("cov_sum", "hidden") and parts[0][key] is not None
    }
    mean_cov = sum(p["cov_sum"] for p in parts) / networks
    _check_finite(cat, config)
    return EnsembleResult(
        config=config,
        q=cat["q"], c=cat["c"], bsb1_residual_sq=cat["res"], diag_var=cat["dvar"], offdiag_var=cat["ovar"],
        mean_covariance=mean_cov,
        final_covariance=cat["final"],
        grad_norm_sq=cat.get("g"), weight_grad_norm_sq=cat.get("wg"),
        cross_batch_corr=cat.get("rho"), cross_batch_cov=cat.get("xcov"),
        chunks=len(parts),
        hidden=parts[0]["hidden"],
    )


def _choose_weight_sampling(requested: str, init: str, rows: int, width: int, device_type: str, *,
                            traced: bool = False, fits: dict | None = None) -> str:
    """The route ``weight_sampling="auto"`` stands for (any other request is returned as it is).

    Explicit weights where conditional sampling is not exact (``init`` other than Gaussian) or
    the weights are recorded (``traced``).  Otherwise by device and shape:

    * CPU: conditional where k·B = ``rows`` ≤ width/4.  Its O(rows²·N) work per layer beats the
      explicit O(rows·N²) matmuls plus N² random numbers there (at rows = width/8 about 2×, at
      width/4 1.4–1.5×; at width/2 1.4–2× slower: benchmarks/bench_sim.py, docs/sim.md).
    * An accelerator (``device_type`` other than "cpu"): explicit.  On a GPU the explicit layer
      is one large matmul at the device's throughput, while the conditional layer is a chain of
      small QR/Cholesky/triangular-solve kernels, launch- and latency-bound: explicit measured
      2–10× faster at width 1000 for every rows from 32 to 512 (H200, issue 27).

    ``fits`` (route -> whether one network fits ``max_memory_bytes``): where the preferred route
    does not fit and the other one does, the other one (explicit weights keep depth·width² numbers
    per network for the backward pass; conditional sampling about depth·2·width·rows).
    """
    if requested != "auto":
        return requested
    if init != "gaussian" or traced:
        return "explicit"
    if device_type == "cpu":
        preferred = "conditional" if 4 * rows <= width else "explicit"
    else:
        preferred = "explicit"
    other = "explicit" if preferred == "conditional" else "conditional"
    if fits is not None and not fits[preferred] and fits[other]:
        return other
    return preferred


#: What one layer's autograd graph costs beyond its tensors' data (nodes, saved-tensor and tensor records),
#: which dominates at small widths.  Measured (2026-11-28, torch 2.13, CPU; peak resident memory above the
#: interpreter's 0.24 GB, width 8, B = 4, 4 batches): depth 10⁵ peaked 1.45 GB where the data alone are
#: estimated at 1.09 GB (it passed the 1 GiB check); with 4 KiB per layer the estimate is 1.50 GB.  At depth
#: 4·10⁴ it is then conservative (0.60 GB estimated, 0.42 GB measured).
_GRAPH_BYTES_PER_LAYER = 4 << 10


def _network_bytes(conditional: bool, predraw: bool, *, b: int, k: int, width: int, depth: int, d0: int,
                   grads: bool, itemsize: int) -> int:
    """Working memory of one network (bytes), the unit :func:`simulate` chunks by."""
    rows = k * b
    # weights kept by autograd (all layers; for conditional sampling the (d, m) and (m, N) factors,
    # m ≤ rows) + ~8 activation-sized tensors per layer
    kept = (max(d0, width) + width) * min(rows, max(d0, width)) if conditional else max(d0, width) * width
    per_layer = (kept + 8 * rows * width) * itemsize
    if grads:  # autograd's graph: its nodes and the tensors' own records, whatever their size
        per_layer += _GRAPH_BYTES_PER_LAYER
    total = per_layer * (depth if grads else 1) + 4 * rows * max(d0, width) * itemsize
    # the per-layer B×B measurement buffers (Σ^l, the cross-batch blocks; with gradients the Gram
    # matrices of the layers' inputs and gradients), reduced once after the passes
    total += depth * (2 * k - 1 + (2 * k if grads else 0)) * b * b * itemsize
    if predraw:
        # the float32 numbers drawn up front (_Predrawn): for float32 the weights are views of them;
        # for float64 they stay beside the float64 copies until the chunk ends
        numbers = rows * d0 + (d0 + (depth - 1) * width) * width + depth * width + rows * width
        total += 4 * numbers if itemsize != 4 else 4 * (rows * d0 + rows * width)
    return total


#: Float64 numbers kept per (network, layer) in the results (q, c, residual, 2 variances, 2
#: cross-batch, 2 gradient norms) and once more while the chunks are concatenated.
_RESULTS_PER_LAYER = 9 * 2


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def _check_memory(spec: "_NetworkSpec", per_network: int, networks: int, max_memory_bytes: int) -> None:
    """Refuse, before allocating anything, a simulation that cannot fit ``max_memory_bytes``.

    Two parts must fit: one network's working memory (networks are processed in chunks,
    but a single network is indivisible) and the results of all networks (per-layer
    statistics and the final B×B covariances, float64).
    """
    width, depth, b, d0 = spec.width, spec.depth, spec.batch_size, spec.input_dim
    sizes = (f"width={width}, depth={depth}, batch_size={b}, num_batches={spec.num_batches}"
             + (f", input_dim={d0}" if d0 != width else ""))
    limit = f"max_memory_bytes={max_memory_bytes} ({_gib(max_memory_bytes)}; bnlab simulate --max-memory-gb)"
    if per_network > max_memory_bytes:
        what = "weights and activations kept for the backward pass" if spec.grads else "weights and activations"
        raise ValueError(
            f"one network with {sizes} needs about {_gib(per_network)} of working memory ({what}), more than "
            f"{limit}; reduce width, depth, batch_size or num_batches, or raise the bound"
        )
    results = networks * (depth * _RESULTS_PER_LAYER + 2 * b * b) * 8 + depth * b * b * 8
    if results > max_memory_bytes:
        raise ValueError(
            f"the results of networks={networks} networks with {sizes} need about {_gib(results)}, more than "
            f"{limit}; reduce networks or depth, or raise the bound"
        )
    physical = _physical_memory()
    if physical is not None and min(max_memory_bytes, per_network + results) > physical:
        raise ValueError(
            f"a simulation with networks={networks}, {sizes} needs about {_gib(per_network + results)}, more "
            f"than this machine's {_gib(physical)} of memory"
        )


def _check_finite(cat: dict, config: dict) -> None:
    """Refuse results that overflowed or divided by zero, saying where and why (never a silent NaN)."""
    for key, what in (("q", "pre-activation second moment q"), ("c", "correlation c"),
                      ("g", "gradient norm"), ("wg", "weight-gradient norm")):
        arr = cat.get(key)
        if arr is None:
            continue
        bad = ~np.isfinite(arr)
        if key == "c":
            bad &= cat["q"] != 0.0  # c = off/q is undefined (0/0), not wrong, for a batch with no spread
        if not bad.any():
            continue
        net, layer = (int(i) for i in np.argwhere(bad)[0])
        q = cat["q"][net]
        finite_q = q[np.isfinite(q)]
        value = float(arr[net, layer])
        wider = "" if "float64" in str(config["dtype"]) else ", or use dtype='float64'"  # no wider type past it
        if math.isinf(value) or (finite_q.size and finite_q.max() > 1e30) or abs(config.get("residual_scale") or 0) > 1e15:
            peak = f" (q reached {finite_q.max():.3g})" if finite_q.size and finite_q.max() > 1e30 else ""
            why = (f"the activations overflowed {config['dtype']}{peak}: reduce "
                   f"sigma_w2, sigma_b2, gamma, beta, residual_scale or the nonlinearity's growth{wider}")
        elif key in ("q", "c") and (finite_q.size and finite_q.min() == 0.0):
            why = ("a batch lost all spread (q = 0: is phi constant, e.g. '0*x'?), and batch normalization "
                   "divides by the spread; use eps > 0 or another phi")
        elif key in ("q", "c"):
            why = (f"the forward pass produced NaN/inf in {config['dtype']} (overflow of phi or of the weights, "
                   "phi undefined on some inputs, or a batch without spread, e.g. a constant phi, that batch "
                   f"normalization with eps = 0 divides by): reduce sigma_w2, sigma_b2 or gamma{wider}, or use "
                   "eps > 0 or another phi")
        else:
            why = (f"the backward pass overflowed {config['dtype']} (gradients explode at rate λ_G per layer): "
                   "reduce depth or use eps > 0" + wider.replace(", or use", " or"))
        raise ValueError(
            f"the simulation's {what} is {value!r} at layer {layer + 1} of network {net}: {why}"
        )


class _Predrawn:
    """The chunk's standard normal numbers drawn up front: one draw per network for all of them
    (inputs, explicit Gaussian weights, biases, readout), scaled to their laws at once.

    On a GPU the per-layer route launches one generator kernel per network and layer (at width
    ~1000 a launch takes longer than its kernel), and each network's generator must stay its own
    (chunking invariance); one draw per network turns networks × layers launches into
    ``networks``.  Used only where the explicit weights are kept for the backward pass anyway
    (``measure_gradients``), so no memory goes to weights that would otherwise be freed layer by
    layer.  Same law as the per-layer route; the same numbers only where the generator's stream
    coincides (on a CPU without biases and with parts of multiples of 16 numbers,
    tests/sim/test_device_routes.py); on a GPU each draw starts at a new Philox offset, so other
    networks from the same seed.

    Everything is scaled in place here, before the forward pass: the parts are views of one
    buffer, and autograd refuses saved tensors whose buffer was modified after they were saved.
    Float32 numbers, cast to the simulation's dtype where used, as :func:`bnlab.sim.init._draw`
    does (a float32 and a float64 simulation use the same networks).
    """

    def __init__(self, gen, n, dev, *, k, b, width, depth, d0, sigma_w2, sigma_b2, inputs, readout):
        rows = k * b
        shapes = {"inputs": [(k, b, d0)] if inputs else [],
                  "weights": [(d0 if layer == 0 else width, width) for layer in range(depth)],
                  "biases": [(1, width)] * depth if sigma_b2 > 0 else [],
                  "readout": [(rows, width)] if readout else []}
        total = sum(math.prod(shape) for parts in shapes.values() for shape in parts)
        buf = fill_(torch.empty((n, total), dtype=torch.float32, device=dev), gen, "normal")
        at = 0
        self.parts = {}
        for key, parts in shapes.items():
            views = []
            for shape in parts:
                size = math.prod(shape)
                views.append(buf[:, at:at + size].view(n, *shape))  # each network's slice contiguous
                at += size
            self.parts[key] = views
        for w in self.parts["weights"]:
            w.mul_(math.sqrt(sigma_w2) / math.sqrt(w.shape[1]))  # N(0, σ_w²/d)
        for bias in self.parts["biases"]:
            bias.mul_(math.sqrt(sigma_b2))


@dataclass(frozen=True)
class _NetworkSpec:
    """What every network of one :func:`simulate` call shares, checked: φ, the shapes, the laws of the
    inputs and weights, the normalization, and the route and place of the computation.  Each chunk of
    networks is simulated from it (:func:`_simulate_chunk`)."""

    act: Any
    batch_size: int
    num_batches: int
    width: int
    depth: int
    input_dim: int
    normalization: str
    init: str
    eps: float
    sigma_w2: float
    sigma_b2: float
    bn_gamma: float
    bn_beta: float
    residual_scale: float | None
    input_correlation: float
    #: (k, B, d) inputs shared by all networks, or None for random ones
    fixed_inputs: torch.Tensor | None
    #: whether the readout loss is backpropagated (gradient norms measured)
    grads: bool
    device: torch.device
    dtype: torch.dtype
    #: weights sampled from their conditional law (:mod:`bnlab.sim.conditional`), not drawn explicitly
    conditional: bool = False
    #: every normal number of a network drawn up front (:class:`_Predrawn`)
    predraw: bool = False

    @property
    def rows(self) -> int:
        """k·B: the rows of a layer's input, all batches stacked."""
        return self.num_batches * self.batch_size


def _simulate_chunk(spec: _NetworkSpec, n: int, gen: list[torch.Generator], trace: list | None,
                    record_layers: tuple) -> dict:
    """``n`` networks (one generator each in ``gen``) forward and, with ``spec.grads``, backward: their
    per-layer statistics (:func:`_covariance_statistics`, the gradient norms ``g``, ``wg``) as NumPy arrays,
    ``hidden`` the recorded pre-activations of the first network.  Appends the drawn weights to ``trace``."""
    s = spec
    pre = (_Predrawn(gen, n, s.device, k=s.num_batches, b=s.batch_size, width=s.width, depth=s.depth,
                     d0=s.input_dim, sigma_w2=s.sigma_w2, sigma_b2=s.sigma_b2, inputs=s.fixed_inputs is None,
                     readout=s.grads).parts if s.predraw else None)
    x = _chunk_inputs(s, n, gen, pre)
    record = {"inputs": x.detach().clone(), "weights": [], "biases": []} if trace is not None else None
    passes = _forward_passes(s, x, gen, pre, record, record_layers)
    out = _covariance_statistics(passes.covs, passes.cross, s.width)
    if s.grads:
        out["g"], out["wg"] = _gradient_norms(s, passes, gen, pre, record)
    if record is not None:
        trace.append(record)
    out = {key: (None if val is None else val.detach().cpu().numpy()) for key, val in out.items()}
    out["hidden"] = passes.hidden
    return out


def _chunk_inputs(s: _NetworkSpec, n: int, gen, pre) -> torch.Tensor:
    """The (n, k·B, d) inputs of the chunk's networks: the fixed inputs, or standard normal batches of which
    batches 1 … k−1 have correlation ρ₀ (``input_correlation``) with batch 0."""
    rows, d0 = s.rows, s.input_dim
    if s.fixed_inputs is not None:
        return s.fixed_inputs.reshape(1, rows, d0).expand(n, rows, d0).contiguous()
    if pre is not None:
        z = pre["inputs"][0].to(s.dtype)
    else:
        z = fill_(torch.empty((n, s.num_batches, s.batch_size, d0), dtype=torch.float32, device=s.device),
                  gen, "normal").to(s.dtype)
    if s.num_batches > 1:
        rho0 = s.input_correlation
        z[:, 1:] = rho0 * z[:, :1] + math.sqrt(max(0.0, 1.0 - rho0 * rho0)) * z[:, 1:]
    return z.reshape(n, rows, d0)


@dataclass
class _Passes:
    """What the forward passes of a chunk leave: the per-layer B×B measurement buffers (Σ^l of every batch;
    batch 0 against the others, or None for k = 1), and for the backward pass the pre-activations ``hs``,
    the layers' inputs ``ins`` and the conditional layers' Gram matrices; ``hidden`` the recorded h^l."""

    covs: torch.Tensor
    cross: torch.Tensor | None
    hs: list
    ins: list
    layer_grams: list
    hidden: dict


def _forward_passes(s: _NetworkSpec, x: torch.Tensor, gen, pre, record, record_layers: tuple) -> _Passes:
    """The chunk's networks layer by layer from the inputs ``x``: h^l = a^{l−1} W^l + b^l (plus the residual
    branch), Σ^l measured into the buffers, a^l = φ(γ·N(h^l) + β) (Yang et al. 2019, Eq. 7)."""
    n, k, b, width, depth = x.shape[0], s.num_batches, s.batch_size, s.width, s.depth
    # The per-layer measurements are B×B matrices written into buffers during the passes and reduced
    # after them, all layers at once: a layer then costs its products and a few elementwise passes,
    # not ~40 small reductions (on a GPU, ~40 kernel launches, each longer than the kernel).
    covs = torch.empty((depth, n, k, b, b), dtype=s.dtype, device=s.device)  # Σ^l of every batch
    cross = torch.empty((depth, n, b, (k - 1) * b), dtype=s.dtype, device=s.device) if k > 1 else None  # H₀ H_jᵀ
    # conditional layers hand over the Gram matrices a aᵀ and δ δᵀ of their factorizations, which
    # the weight-gradient measurement needs (saves two O(rows²·N) products per layer)
    passes = _Passes(covs, cross, [], [], [{} if (s.conditional and s.grads) else None for _ in range(depth)], {})
    with torch.set_grad_enabled(s.grads):
        a = x
        h_prev = None
        for layer in range(depth):
            h = _preactivation(s, a, layer, gen, pre, passes.layer_grams[layer], record)
            if s.residual_scale is not None and h_prev is not None:
                h = h_prev + s.residual_scale * h
            if s.grads and layer == 0:
                h.requires_grad_(True)  # the graph starts at h^1 (the inputs need no gradient)
            passes.hs.append(h)
            passes.ins.append(a)
            # ---- measurements of Σ^l (no autograd): into the buffers, reduced after the loop ----
            hd = h.detach().view(n, k, b, width)
            if layer + 1 in record_layers:
                passes.hidden[layer + 1] = hd[0].to(torch.float64).cpu().numpy().copy()
            gram(hd, out=covs[layer]).div_(width)  # Σ = H Hᵀ/N (measure.batch_covariance)
            if k > 1:
                # batch 0 against all k batches in one bmm (a broadcast matmul would copy batch 0 k−1 times)
                torch.bmm(hd[:, 0], h.detach()[:, b:].transpose(1, 2), out=cross[layer])
            if layer == depth - 1:
                break
            u = h if s.normalization == "none" else _normalize(h, k, s.normalization, s.eps)
            if s.normalization != "none" and (s.bn_gamma != 1.0 or s.bn_beta != 0.0):
                u = s.bn_gamma * u + s.bn_beta
            a = s.act.torch(u)
            h_prev = h if s.residual_scale is not None else None
            if not s.grads:
                passes.hs.clear()
                passes.ins.clear()
    return passes


def _preactivation(s: _NetworkSpec, a: torch.Tensor, layer: int, gen, pre, grams: dict | None, record) -> torch.Tensor:
    """a W + b of one layer (before the residual branch), with W explicit or sampled from its conditional law."""
    n = a.shape[0]
    w = None
    if s.conditional:
        # the output feeds only the next layer's mean-subtracting BN (no skip, not the
        # readout): δ sums to zero per batch, a null space the layer need not factor
        mean_free = s.normalization == "bn" and s.residual_scale is None and layer < s.depth - 1
        h = conditional_gaussian_layer(a, s.width, s.sigma_w2, gen, grams=grams,
                                       mean_free_batch=s.batch_size if mean_free else None)
    else:
        if pre is not None:
            w = pre["weights"][layer].to(s.dtype)
        else:
            d_in = s.input_dim if layer == 0 else s.width
            w = _draw(s.init, n, d_in, s.width, s.sigma_w2, gen, s.dtype, s.device)
        h = torch.bmm(a, w)
    bias = None
    if s.sigma_b2 > 0:
        if pre is not None:
            bias = pre["biases"][layer].to(s.dtype)
        else:
            bias = torch.empty((n, 1, s.width), dtype=torch.float32, device=s.device)
            bias = fill_(bias, gen, "normal", 0.0, math.sqrt(s.sigma_b2)).to(s.dtype)
        h = h + bias
    if record is not None:
        record["weights"].append(w.detach().clone())
        record["biases"].append(None if bias is None else bias.detach().clone())
    return h


def _gradient_norms(s: _NetworkSpec, passes: _Passes, gen, pre, record) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖∂L/∂h^l‖², ‖∂L/∂W^l‖²) per network and layer, (n, depth) in float64, for the readout loss
    L = Σ v ⊙ h^L with standard normal v, from the B×B Gram matrices of the layers' inputs and gradients."""
    n, k, b, width, depth = passes.covs.shape[1], s.num_batches, s.batch_size, s.width, s.depth
    dt, dev = s.dtype, s.device
    if pre is not None:
        v = pre["readout"][0].to(dt)
    else:
        v = fill_(torch.empty((n, s.rows, width), dtype=torch.float32, device=dev), gen, "normal").to(dt)
    if record is not None:
        record["readout"] = v.clone()
    # loss = Σ v ⊙ h^L: seed the backward pass with ∂L/∂h^L = v directly (no product, no
    # broadcast of the scalar gradient over (networks, rows, N))
    # allow_unused: a φ whose derivative is 0 almost everywhere (sign, a rounding) cuts the graph; the layers
    # below it then get exactly zero gradients, which is what the network does
    deltas = torch.autograd.grad(passes.hs[-1], passes.hs, grad_outputs=v, allow_unused=True)
    deltas = [torch.zeros_like(h) if d is None else d for d, h in zip(deltas, passes.hs)]
    passes.hs.clear()
    del v
    grams_in = torch.empty((depth, n, k, b, b), dtype=dt, device=dev)
    grams_delta = torch.empty((depth, n, k, b, b), dtype=dt, device=dev)
    scale_w = torch.empty(depth, dtype=torch.float64)
    scale_g = torch.empty(depth, dtype=torch.float64)
    r = s.residual_scale
    for layer, (delta, a_in) in enumerate(zip(deltas, passes.ins)):
        # per batch: ‖δ‖² = tr(δδᵀ) and ‖∂L/∂W‖² = ‖aᵀδ‖² = ⟨a aᵀ, δδᵀ⟩ from the B×B Gram matrices
        # a product, not **: 1e308**2 raises OverflowError, 1e308*1e308 is inf (then refused by _check_finite)
        r2 = r * r if (r is not None and layer > 0) else 1.0
        grams = passes.layer_grams[layer]
        if grams is not None and "delta" in grams:
            # the conditional layer's own Grams; its δ' = ∂L/∂(a W) = r·δ^l carries r² already
            grams_in[layer] = _diagonal_blocks(grams["input"], k)
            grams_delta[layer] = _diagonal_blocks(grams["delta"], k)
            delta_scale = 1.0 / r2
        else:
            gram(a_in.detach().view(n, k, b, a_in.shape[-1]), out=grams_in[layer])
            gram(delta.view(n, k, b, width), out=grams_delta[layer])
            delta_scale = 1.0
        scale_w[layer] = r2 * delta_scale
        scale_g[layer] = delta_scale
    del deltas
    passes.ins.clear()
    # products in the simulation's dtype, sums accumulated in float64 (no float64 copies)
    scale_w, scale_g = scale_w.to(dev), scale_g.to(dev)
    wg = (grams_in * grams_delta).sum((-2, -1), dtype=torch.float64).mean(-1) * scale_w[:, None]
    g = torch.diagonal(grams_delta, dim1=-2, dim2=-1).sum(-1, dtype=torch.float64).mean(-1) * scale_g[:, None]
    return g.T, wg.T


def _covariance_statistics(covs: torch.Tensor, cross: torch.Tensor | None, width: int) -> dict:
    """The per-network, per-layer statistics of :class:`EnsembleResult` from the layers' batch
    covariances ``covs`` (depth, n, k, B, B) and cross-batch products ``cross`` = H₀ [H₁ … H_{k−1}]ᵀ
    (depth, n, B, (k − 1)·B) or None; arrays (n, depth) in float64, ``cov_sum`` (depth, B, B)."""
    depth, n, k, b, _ = covs.shape
    off_count = b * (b - 1)
    qq, off, off_ss, diag_ss = _m._bsb1_moments(covs)  # (depth, n, k), float64
    out = dict(
        q=qq.mean(-1).T,
        c=(off / qq).mean(-1).T,
        res=(off_ss + diag_ss).mean(-1).T,
        dvar=(diag_ss / b / qq**2).mean(-1).T,
        ovar=(off_ss / off_count / qq**2).mean(-1).T,
        final=covs[-1, :, 0].to(torch.float64),
        rho=None, xcov=None, g=None, wg=None,
        # (a strided mean over k is slow)
        cov_sum=covs.reshape(depth, n * k, b * b).sum(1, dtype=torch.float64).view(depth, b, b) / k,
    )
    if cross is not None:
        # pairs (0, j), j = 1..k-1: exchangeable, averaged to reduce the Monte Carlo error.
        # From the B×B blocks Ξ_0j = H_0 H_jᵀ/N: tr(GAG) = tr A − sum(A)/B.
        xi = cross.view(depth, n, b, k - 1, b).transpose(2, 3).to(torch.float64) / width  # Ξ_0j
        xi_sum = xi.sum((-2, -1))
        cent_x = torch.diagonal(xi, dim1=-2, dim2=-1).sum(-1) - xi_sum / b
        cent_s = (torch.diagonal(covs, dim1=-2, dim2=-1).sum(-1, dtype=torch.float64)
                  - covs.sum((-2, -1), dtype=torch.float64) / b)
        out["rho"] = (cent_x / torch.sqrt(cent_s[..., :1] * cent_s[..., 1:])).mean(-1).T
        out["xcov"] = (xi_sum.mean(-1) / (b * b)).T
    return out
