"""The paper's random chains of hidden representations, streamed layer by layer.

Daneshmand et al. 2020 study the Markov chain of representations H_ℓ (d × N) of a random
deep network.  :func:`run_chain` runs ``chains`` independent chains together (batched
matrix products), for any depth: the representations are never stored beyond a block of
``block_size`` layers, whose rank measures are taken in one batched SVD and then either
kept (at the requested layer indices) or folded into running sums.  Memory is therefore
independent of depth (the paper's Fig. 3a uses L = 10⁶ layers).

One layer (:func:`chain_step`), φ = identity ("linear") or ReLU, γ = ∞ meaning no skip::

    placement="pre"  (default; Linear → Norm → φ, the usual MLP order):
        H_{ℓ+1} = φ(Norm(H_ℓ + γ W_ℓ H_ℓ))          γ = ∞:  φ(Norm(W_ℓ H_ℓ))
    placement="post" (Norm last, so every H_ℓ has tr M = d):
        H_{ℓ+1} = Norm(H_ℓ + γ φ(W_ℓ H_ℓ))          γ = ∞:  Norm(φ(W_ℓ H_ℓ))

For φ = identity the two coincide, and this is Eq. 1 for Norm = BN_{0,1} (Eq. 2, BN without mean subtraction, as
in the paper: ``norm="bn_nomean"``), and the vanilla linear / residual products of Eq. 6 for
``norm="none"``.  ``norm="bn"`` subtracts each row's batch mean before scaling (standard BN).
For ``norm="none"`` the representation is divided by a scalar so that tr M(H) = d — the
paper's normalization H̃_ℓ = B_ℓ X / ‖B_ℓ‖ of Lemma 3 up to a constant.  A scalar does not
change the rank, r(H), the stable or effective rank, nor (φ being positively homogeneous)
the next layers up to scale; it only fixes the scale at which the soft rank is read.

Weights W_ℓ have i.i.d. zero-mean unit-variance entries (Definition 1): standard Gaussian
or uniform on [−√3, √3] (Lemma 3b).  The weight scale is absorbed in γ (the paper's
footnote 4); for γ = ∞ it is irrelevant under every ``norm`` (BN and the scalar
normalization remove it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from bnlab import _threads
from bnlab._validation import check_choice, check_device, check_int, check_real, check_seed
from bnlab._vocabulary import NORM_ALIASES, canonical_value, renamed_keywords
from bnlab.rank.measures import (
    _effective_rank_from_sv,
    _lower_bound_from_sv,
    _numerical_rank_from_sv,
    _stable_rank_from_sv,
    as_representation,
)

__all__ = [
    "CHAIN_NORMS",
    "CHAIN_ACTIVATIONS",
    "CHAIN_INITS",
    "CHAIN_PLACEMENTS",
    "ChainResult",
    "chain_step",
    "draw_weights",
    "default_record_layers",
    "run_chain",
    "chain_seconds",
    "MAX_CHAIN_SECONDS",
]

CHAIN_NORMS = ("bn_nomean", "bn", "none")
CHAIN_ACTIVATIONS = ("linear", "relu")
CHAIN_INITS = ("gaussian", "uniform")
CHAIN_PLACEMENTS = ("pre", "post")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    return _DTYPES[check_choice("dtype", dtype, tuple(_DTYPES))]


def _resolve_device(device: Any) -> torch.device:
    return check_device("device", device)


#: Seconds per layer of Python and kernel-launch overhead, and per flop of the layer's product and SVD, on
#: one CPU core (measured with run_chain at d = N = 8…128 on this project's AMD EPYC machines: 130 µs per
#: layer at d = 8, 1.5–2 ns per flop at d ≥ 64); CUDA is taken 50 times faster per flop.
_SECONDS_PER_LAYER = 1e-4
_SECONDS_PER_FLOP = {"cpu": 2e-9, "cuda": 4e-11}
#: run_chain refuses, before starting, a chain whose estimated time exceeds this (a week), unless the
#: caller raises ``max_seconds``.
MAX_CHAIN_SECONDS = 7 * 86400.0


def chain_seconds(width: int, batch_size: int, depth: int, chains: int = 1, device: str = "cpu") -> float:
    """Estimated seconds of :func:`run_chain`: per layer the product W H (2 d² N flops per chain), the
    batched SVD (≈ 10 d N min(d, N)) and a fixed overhead (:data:`_SECONDS_PER_LAYER`)."""
    d, n = float(width), float(batch_size)
    flops = chains * (2.0 * d * d * n + 10.0 * d * n * min(d, n))
    return float(depth) * (_SECONDS_PER_LAYER + flops * _SECONDS_PER_FLOP.get(str(device).split(":")[0], 2e-9))


def _check_gamma(gamma: Any) -> float:
    if isinstance(gamma, str) and gamma.strip().lower() in ("inf", "infinity", "∞"):
        return math.inf
    if isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and math.isinf(gamma) and gamma > 0:
        return math.inf
    return check_real("residual_gamma", gamma, minimum=0.0, strict_minimum=True)


def _normalize(pre: torch.Tensor, norm: str, eps: float) -> torch.Tensor:
    if norm == "bn_nomean":
        # Eq. 2 with α = 0, β = 1: rows scaled to mean square one.
        return pre * torch.rsqrt(pre.pow(2).mean(dim=-1, keepdim=True) + eps)
    if norm == "bn":
        centred = pre - pre.mean(dim=-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)
    # "none": one scalar per matrix so that tr M = ‖H‖_F²/N = d.
    d, n = pre.shape[-2], pre.shape[-1]
    fro2 = pre.pow(2).sum(dim=(-2, -1), keepdim=True)
    return pre * torch.rsqrt(fro2 / (d * n))


@renamed_keywords(activation="phi")
def chain_step(
    h: torch.Tensor,
    w: torch.Tensor,
    *,
    residual_gamma: float = math.inf,
    norm: str = "bn_nomean",
    phi: str = "linear",
    placement: str = "pre",
    eps: float = 0.0,
) -> torch.Tensor:
    """One layer of the chain (Daneshmand et al. 2020, Eqs. 1, 2 and 6; ReLU variants).

    "pre": H ↦ φ(Norm(H + γ W H)); "post": H ↦ Norm(H + γ φ(W H)); γ = ∞ drops the skip
    (H + γ ·  is replaced by the branch alone).  ``h`` (..., d, N) and ``w`` (..., d, d)
    broadcast over the leading dimensions.  See the module docstring for the normalizations.
    ``h`` and ``w`` must be finite floating tensors of one dtype and device.
    """
    gamma = _check_gamma(residual_gamma)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), CHAIN_NORMS)
    activation = check_choice("phi", phi, CHAIN_ACTIVATIONS)
    placement = check_choice("placement", placement, CHAIN_PLACEMENTS)
    eps = check_real("eps", eps, minimum=0.0)
    h = as_representation(h, "h")
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.ndim < 2:
        raise ValueError(f"w is not allowed: expected a floating tensor of shape (..., d, d), got {type(w).__name__}"
                         + (f" of shape {tuple(w.shape)}" if isinstance(w, torch.Tensor) else ""))
    d = h.shape[-2]
    if tuple(w.shape[-2:]) != (d, d):
        raise ValueError(f"w is not allowed: shape {tuple(w.shape)}; expected (..., {d}, {d}) for h of shape "
                         f"{tuple(h.shape)}")
    if w.dtype != h.dtype or w.device != h.device:
        raise ValueError(f"w is not allowed: dtype {w.dtype} on {w.device}, h is {h.dtype} on {h.device}; "
                         "expected the same dtype and device")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w is not allowed: it contains NaN or infinite entries")
    try:
        torch.broadcast_shapes(w.shape[:-2], h.shape[:-2])
    except RuntimeError:
        raise ValueError(f"w is not allowed: its leading shape {tuple(w.shape[:-2])} does not broadcast with h's "
                         f"{tuple(h.shape[:-2])}") from None
    return _step(h, w, gamma, norm, activation, placement, eps)


def _step(h, w, gamma, norm, activation, placement, eps):
    branch = w @ h
    if placement == "post" and activation == "relu":
        branch = torch.relu(branch)
    pre = branch if math.isinf(gamma) else h + gamma * branch
    out = _normalize(pre, norm, eps)
    if placement == "pre" and activation == "relu":
        out = torch.relu(out)
    return out


def draw_weights(
    shape: Sequence[int], init: str, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """I.i.d. zero-mean unit-variance entries (Def. 1): N(0, 1) or U[−√3, √3] (Lemma 3)."""
    init = check_choice("init", init, CHAIN_INITS)
    if isinstance(shape, (str, bytes)):
        raise ValueError(f"shape={shape!r} is not allowed: expected a sequence of non-negative integers")
    try:
        shape = tuple(check_int("shape", s, minimum=0) for s in shape)
    except TypeError:
        raise ValueError(f"shape={shape!r} is not allowed: expected a sequence of non-negative integers") from None
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator={generator!r} is not allowed: expected a torch.Generator")
    dtype = _resolve_dtype(dtype)
    if init == "gaussian":
        return torch.randn(tuple(shape), generator=generator, dtype=dtype, device=device)
    u = torch.rand(tuple(shape), generator=generator, dtype=dtype, device=device)
    return (2.0 * u - 1.0) * math.sqrt(3.0)


def default_record_layers(depth: int, max_points: int = 200) -> np.ndarray:
    """Layers 0..depth if there are at most ``max_points + 1``; else ~``max_points`` log-spaced ones.

    Always includes 0, 1 and ``depth``.
    """
    depth = check_int("depth", depth, minimum=1)
    max_points = check_int("max_points", max_points, minimum=1, maximum=10**6)
    if depth + 1 <= max_points + 1:
        return np.arange(depth + 1)
    pts = np.unique(np.round(np.geomspace(1, depth, max_points)).astype(np.int64))
    return np.unique(np.concatenate([[0], pts, [depth]]))


@dataclass(frozen=True)
class ChainResult:
    """Rank measurements of a batch of independent chains (NumPy arrays).

    Per-layer arrays have shape (chains, len(layers)) for the recorded ``layers`` (indices in
    0..depth; layer 0 is the input X).  Means and standard deviations are over the layers
    1..depth (the input excluded; every ``measure_every``-th layer), one per chain,
    accumulated on the fly.  The soft rank is
    read at the scale tr M = d (see :mod:`bnlab.rank.chains`).
    """

    config: dict
    layers: np.ndarray
    soft_rank: np.ndarray
    rank_lower_bound: np.ndarray
    numerical_rank: np.ndarray
    stable_rank: np.ndarray
    effective_rank: np.ndarray
    singular_values: np.ndarray  # (chains, len(layers), min(d, N)), of H at the scale tr M = d
    mean_soft_rank: np.ndarray
    std_soft_rank: np.ndarray
    mean_rank_lower_bound: np.ndarray
    mean_numerical_rank: np.ndarray
    final_soft_rank: np.ndarray
    final_rank_lower_bound: np.ndarray
    final_numerical_rank: np.ndarray
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready summary: chain averages and the per-layer curves averaged over chains."""
        return {
            "config": dict(self.config),
            "mean_soft_rank": float(self.mean_soft_rank.mean()),
            "mean_r_lower_bound": float(self.mean_rank_lower_bound.mean()),
            "mean_numerical_rank": float(self.mean_numerical_rank.mean()),
            "final_soft_rank": float(self.final_soft_rank.mean()),
            "final_r_lower_bound": float(self.final_rank_lower_bound.mean()),
            "final_numerical_rank": float(self.final_numerical_rank.mean()),
            "per_chain_mean_soft_rank": self.mean_soft_rank.tolist(),
            "per_chain_std_soft_rank": self.std_soft_rank.tolist(),
            "per_chain_mean_r_lower_bound": self.mean_rank_lower_bound.tolist(),
            "layers": self.layers.tolist(),
            "per_layer_soft_rank": self.soft_rank.mean(axis=0).tolist(),
            "per_layer_r_lower_bound": self.rank_lower_bound.mean(axis=0).tolist(),
            "per_layer_numerical_rank": self.numerical_rank.mean(axis=0).tolist(),
            **self.extra,
        }


@renamed_keywords(activation="phi")
# one layer is a (chains·N × d) by (d × d) product: at d = 32 one thread (bnlab._threads)
@_threads.sized_by(lambda a: 2.0 * a["chains"] * a["batch_size"] * a["width"] ** 2)
def run_chain(
    width: int,
    batch_size: int,
    depth: int,
    *,
    chains: int = 1,
    norm: str = "bn_nomean",
    phi: str = "linear",
    placement: str = "pre",
    residual_gamma: float | str = math.inf,
    init: str = "gaussian",
    tau: float = 0.5,
    record_layers: Sequence[int] | None = None,
    inputs: Any = None,
    seed: int = 0,
    dtype: Any = "float64",
    device: Any = "cpu",
    eps: float = 0.0,
    block_size: int = 256,
    measure_every: int = 1,
    max_memory_bytes: int = 1 << 30,
    max_seconds: float | None = MAX_CHAIN_SECONDS,
) -> ChainResult:
    """Run ``chains`` independent chains of ``depth`` layers and measure their rank (streamed).

    Parameters
    ----------
    width, batch_size, depth : d, N, L.
    chains : independent chains run together (independent weights and inputs).
    norm : "bn_nomean" (the paper's BN, Eq. 2), "bn" (with mean subtraction) or "none".
    phi : "linear" or "relu" (the old keyword ``activation=`` and ``norm="bn-nomean"`` are accepted with a
        DeprecationWarning until the next release).
    placement : "pre" (φ after Norm, the usual Linear → BN → φ) or "post" (Norm last); see the
        module docstring.  Under "post" with ReLU and ``norm="bn_nomean"``, a row of ReLU outputs
        can be all zero (the representations are non-negative and nearly collinear, so a weight
        row can be negative on the whole batch): BN has no scale for it (raise, or eps > 0).
    residual_gamma : γ > 0, or ``math.inf`` / "inf" for no skip connection.
    init : "gaussian" (N(0, 1)) or "uniform" (U[−√3, √3]).
    tau : the soft rank's threshold (Eq. 3).
    record_layers : layer indices in 0..depth to keep per-layer values for; default
        :func:`default_record_layers` (all layers up to depth 200, ~200 log-spaced beyond).
    inputs : X, (d, N) or (chains, d, N); default standard Gaussian, full rank a.s. as Thm 2
        assumes.  A (d, N) input is shared by all chains.
    seed : seeds the ``torch.Generator`` that draws the inputs and all the weights.
    dtype, device : "float32"/"float64", "cpu"/"cuda".
    eps : added to the BN variance (the paper has none; 0 by default).  A row of zeros under
        BN with eps = 0 raises ``FloatingPointError`` naming the layer.
    block_size : layers per batched SVD (memory ∝ block_size, not depth).
    measure_every : the running means use the layers ℓ = k, 2k, ... ≤ depth (k = measure_every);
        k > 1 saves the SVDs of the other layers (an ergodic average needs no every layer).
    max_memory_bytes : bound on the working memory (weights and representations of one block,
        the SVD workspace, the recorded values).  ``block_size`` is lowered to fit; if one layer
        alone does not fit, ``ValueError`` (before anything is allocated).

    max_seconds : a chain whose estimated time (:func:`chain_seconds`) exceeds it is refused before it
        starts, with the estimate (default a week; None: no limit).

    Memory: O(block_size · chains · d · max(d, N) + len(record_layers) · chains · min(d, N)).
    A representation whose entries fall below √(smallest normal number) of the dtype (eps ≫ the
    variance shrinks every layer by ~1/√eps, and the chain would read as rank 0 once it underflows)
    raises ``FloatingPointError`` naming the layer, as a non-finite one does.
    """
    cfg = _check_chain_args(width, batch_size, depth, chains=chains, norm=norm, phi=phi, placement=placement,
                            residual_gamma=residual_gamma, init=init, tau=tau, seed=seed, dtype=dtype, device=device,
                            eps=eps, block_size=block_size, measure_every=measure_every,
                            max_memory_bytes=max_memory_bytes, max_seconds=max_seconds, inputs_given=inputs is not None)
    layers = _recorded_layers(cfg, record_layers)
    gen = torch.Generator(device=cfg.device)
    gen.manual_seed(cfg.seed)
    h = _chain_inputs(cfg, inputs, gen)
    meter = _ChainMeter(cfg, layers)
    meter.measure(h.unsqueeze(0), [0])
    _run_layers(cfg, h, gen, meter)
    return meter.result()


@dataclass(frozen=True)
class _ChainConfig:
    """The validated arguments of :func:`run_chain` (``block_size`` already lowered to fit the memory bound)."""

    width: int
    batch_size: int
    depth: int
    chains: int
    norm: str
    activation: str
    placement: str
    gamma: float
    init: str
    tau: float
    seed: int
    dtype: torch.dtype
    device: torch.device
    eps: float
    block_size: int
    measure_every: int
    max_memory_bytes: int
    inputs_given: bool

    def to_dict(self) -> dict:
        """:attr:`ChainResult.config`."""
        return {
            "width": self.width, "batch_size": self.batch_size, "depth": self.depth, "chains": self.chains,
            "norm": self.norm, "phi": self.activation, "placement": self.placement,
            "residual_gamma": "inf" if math.isinf(self.gamma) else self.gamma, "init": self.init, "tau": self.tau,
            "seed": self.seed, "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "eps": self.eps, "block_size": self.block_size, "measure_every": self.measure_every,
            "inputs": "given" if self.inputs_given else "gaussian",
        }


def _check_chain_args(width, batch_size, depth, *, chains, norm, phi, placement, residual_gamma, init, tau, seed,
                      dtype, device, eps, block_size, measure_every, max_memory_bytes, max_seconds,
                      inputs_given) -> _ChainConfig:
    """Validate :func:`run_chain`'s arguments, refuse a chain over ``max_seconds`` and fit ``block_size``."""
    d = check_int("width", width, minimum=1)
    n = check_int("batch_size", batch_size, minimum=1)
    depth = check_int("depth", depth, minimum=1)
    chains = check_int("chains", chains, minimum=1)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), CHAIN_NORMS)
    activation = check_choice("phi", phi, CHAIN_ACTIVATIONS)
    placement = check_choice("placement", placement, CHAIN_PLACEMENTS)
    gamma = _check_gamma(residual_gamma)
    init = check_choice("init", init, CHAIN_INITS)
    tau = check_real("tau", tau, minimum=0.0, strict_minimum=True)
    seed = check_seed("seed", seed)
    eps = check_real("eps", eps, minimum=0.0)
    if norm == "bn" and n == 1:
        raise ValueError("batch_size=1 is not allowed with norm='bn': subtracting the mean of a batch of one sample "
                         "leaves zeros, which no eps normalizes (use batch_size >= 2, or norm='bn_nomean')")
    block_size = check_int("block_size", block_size, minimum=1)
    measure_every = check_int("measure_every", measure_every, minimum=1, maximum=depth)
    max_memory_bytes = check_int("max_memory_bytes", max_memory_bytes, minimum=1)
    dt = _resolve_dtype(dtype)
    dev = _resolve_device(device)
    if max_seconds is not None:
        _check_chain_time(d, n, depth, chains, dev, max_seconds)
    block_size = _fit_block_size(d, n, chains, dt, block_size, max_memory_bytes)
    return _ChainConfig(d, n, depth, chains, norm, activation, placement, gamma, init, tau, seed, dt, dev, eps,
                        block_size, measure_every, max_memory_bytes, inputs_given)


def _check_chain_time(d: int, n: int, depth: int, chains: int, dev: torch.device, max_seconds) -> None:
    """Refuse, before it starts, a chain whose estimated time (:func:`chain_seconds`) exceeds ``max_seconds``."""
    max_seconds = check_real("max_seconds", max_seconds, minimum=0.0, strict_minimum=True)
    secs = chain_seconds(d, n, depth, chains, dev.type)
    if secs > max_seconds:
        raise ValueError(
            f"depth={depth} is not allowed with width={d}, batch_size={n}, chains={chains} on {dev.type}: "
            f"the chain would take about {secs:.3g} s ({secs / 86400:.3g} days), more than max_seconds="
            f"{max_seconds:g}; use a smaller depth (at most about {int(depth * max_seconds / secs)}) or "
            "raise max_seconds"
        )


def _fit_block_size(d: int, n: int, chains: int, dt: torch.dtype, block_size: int, max_memory_bytes: int) -> int:
    """The largest block of layers ≤ ``block_size`` whose working memory fits ``max_memory_bytes``."""
    itemsize = torch.finfo(dt).bits // 8
    # per layer of a block: its weights (d²), its representation (dN) and SVD workspace (~ 3·d·N)
    per_layer = chains * (d * d + 4 * d * n) * itemsize
    fixed = 4 * chains * d * n * itemsize
    if per_layer + fixed > max_memory_bytes:
        raise ValueError(
            f"width={d}, batch_size={n}, chains={chains} is not allowed: one layer needs "
            f"{(per_layer + fixed) / 2**30:.3g} GiB, more than max_memory_bytes={max_memory_bytes} "
            f"({max_memory_bytes / 2**30:.3g} GiB); reduce width, batch_size or chains, or raise the bound")
    return max(1, min(block_size, (max_memory_bytes - fixed) // per_layer))


def _recorded_layers(cfg: _ChainConfig, record_layers) -> np.ndarray:
    """The sorted layer indices to keep per-layer values for, refused if their values overflow the memory bound."""
    if record_layers is None:
        layers = default_record_layers(cfg.depth)
    else:
        layers = np.unique(np.asarray([check_int("record_layers", v, minimum=0, maximum=cfg.depth)
                                       for v in record_layers], dtype=np.int64))
    recorded_bytes = len(layers) * cfg.chains * (5 + min(cfg.width, cfg.batch_size)) * 8
    if recorded_bytes > cfg.max_memory_bytes:
        raise ValueError(
            f"record_layers is not allowed: {len(layers)} recorded layers of {cfg.chains} chains need "
            f"{recorded_bytes / 2**30:.3g} GiB, more than max_memory_bytes={cfg.max_memory_bytes}; record fewer "
            "layers")
    return layers


def _chain_inputs(cfg: _ChainConfig, inputs, gen: torch.Generator) -> torch.Tensor:
    """H_0, (chains, d, N): ``inputs`` (one shared (d, N) matrix or one per chain) or standard Gaussian draws."""
    d, n, chains = cfg.width, cfg.batch_size, cfg.chains
    if inputs is None:
        return torch.randn((chains, d, n), generator=gen, dtype=cfg.dtype, device=cfg.device)
    x = as_representation(inputs, "inputs").to(dtype=cfg.dtype, device=cfg.device)
    if x.ndim == 2:
        x = x.expand(chains, -1, -1)
    if tuple(x.shape) != (chains, d, n):
        raise ValueError(
            f"inputs is not allowed: expected shape ({d}, {n}) or ({chains}, {d}, {n}), got {tuple(x.shape)}")
    return x.clone()


def _run_layers(cfg: _ChainConfig, h: torch.Tensor, gen: torch.Generator, meter: "_ChainMeter") -> None:
    """Layers 1..depth, ``block_size`` at a time: draw a block's weights, step, and measure the layers kept."""
    done = 0
    buf = torch.empty((cfg.block_size, cfg.chains, cfg.width, cfg.batch_size), dtype=cfg.dtype, device=cfg.device)
    with torch.no_grad():
        while done < cfg.depth:
            b = min(cfg.block_size, cfg.depth - done)
            weights = draw_weights((b, cfg.chains, cfg.width, cfg.width), cfg.init, gen, cfg.dtype, cfg.device)
            kept: list[int] = []
            for j in range(b):
                h = _step(h, weights[j], cfg.gamma, cfg.norm, cfg.activation, cfg.placement, cfg.eps)
                layer = done + j + 1
                if layer % cfg.measure_every == 0 or layer in meter.rec_pos or layer == cfg.depth:
                    buf[len(kept)] = h
                    kept.append(layer)
            if kept:
                meter.measure(buf[: len(kept)], kept)
            done += b


class _ChainMeter:
    """The rank measures of a chain's layers: recorded per layer, summed for the means, and the last layer's."""

    def __init__(self, cfg: _ChainConfig, layers: np.ndarray):
        self.cfg = cfg
        self.layers = layers
        self.rec_pos = {int(l): i for i, l in enumerate(layers)}
        self.underflow = math.sqrt(torch.finfo(cfg.dtype).tiny)
        self.out = {name: np.zeros((cfg.chains, len(layers))) for name in
                    ("soft_rank", "rank_lower_bound", "numerical_rank", "stable_rank", "effective_rank")}
        self.sv_out = np.zeros((cfg.chains, len(layers), min(cfg.width, cfg.batch_size)))
        self.sums = {name: torch.zeros(cfg.chains, dtype=torch.float64, device=cfg.device)
                     for name in ("sr", "sr2", "r", "nr")}
        self.final: dict = {}

    def measure(self, buf: torch.Tensor, layer_ids: list[int]) -> None:
        """Measure the layers ``layer_ids`` held in ``buf`` (b, chains, d, n) with one batched SVD."""
        self._check_finite(buf, layer_ids)
        if self.cfg.eps > 0 and self.cfg.norm != "none":
            self._check_underflow(buf, layer_ids)
        d, n = self.cfg.width, self.cfg.batch_size
        fro2 = buf.pow(2).sum(dim=(-2, -1))
        sv = torch.linalg.svdvals(buf)
        # Read the soft rank at the scale tr M = d: λ_i = σ_i² · (dN/‖H‖_F²) / N.
        scale = torch.where(fro2 > 0, d * n / torch.where(fro2 > 0, fro2, torch.ones_like(fro2)),
                            torch.zeros_like(fro2))
        sv_scaled = sv * scale.sqrt().unsqueeze(-1)
        sr = (sv_scaled.pow(2) / n >= self.cfg.tau).sum(-1).to(torch.float64)
        # r(H) and the stable rank are scale-invariant: read off the rescaled σ_i (tr M = d), whose fourth
        # powers cannot underflow (σ_i⁴ of the raw H did for peaks below tiny^(1/4) ≈ 1e-77 in float64, well
        # above the underflow guard's sqrt(tiny): eps = 1e30 read r = 0 from layer 6 on)
        r = _lower_bound_from_sv(sv_scaled).to(torch.float64)
        nr = _numerical_rank_from_sv(sv, d, n, None).to(torch.float64)
        idx = torch.tensor(layer_ids)
        self._accumulate(idx, sr, r, nr)
        self._record(idx, sv, sv_scaled, sr, r, nr)
        if layer_ids[-1] == self.cfg.depth:
            self.final.update(sr=sr[-1].cpu().numpy(), r=r[-1].cpu().numpy(), nr=nr[-1].cpu().numpy())

    def _check_finite(self, buf: torch.Tensor, layer_ids: list[int]) -> None:
        if not bool(torch.isfinite(buf).all()):
            pos = int((~torch.isfinite(buf)).flatten(1).any(1).nonzero()[0, 0])
            lo = layer_ids[pos - 1] + 1 if pos > 0 else 1
            where = f"layer {lo}" if lo == layer_ids[pos] else f"one of layers {lo}..{layer_ids[pos]}"
            if self.cfg.eps == 0 and self.cfg.norm != "none":
                why = "under BN with eps=0 a row of zeros has no scale; use eps > 0 (--eps)"
            else:  # eps > 0 normalizes a zero row, so the values overflowed the dtype
                why = (f"they overflow {str(self.cfg.dtype).replace('torch.', '')} (residual_gamma="
                       f"{self.cfg.gamma:g} with width {self.cfg.width}); use a smaller residual_gamma "
                       "(--residual-gamma)" + ("" if self.cfg.dtype == torch.float64 else " or float64"))
            raise FloatingPointError(f"{where} produced non-finite values: {why}")

    def _check_underflow(self, buf: torch.Tensor, layer_ids: list[int]) -> None:
        peak = buf.abs().amax(dim=(-2, -1))  # (b, chains)
        low = peak < self.underflow
        if bool(low.any()):
            pos = int(low.any(1).nonzero()[0, 0])
            raise FloatingPointError(
                f"layer {layer_ids[pos]} underflows: its largest entry is {float(peak[low].max()):.3g}, below "
                f"{self.underflow:.3g}; eps={self.cfg.eps:g} dominates the variance, so every layer shrinks the "
                "representation by ~1/sqrt(eps) and it would read as rank 0 (use a smaller --eps)"
                + ("" if not (math.isfinite(self.cfg.gamma) and self.cfg.gamma > 1) else
                   f"; or the batch variance overflowed {str(self.cfg.dtype).replace('torch.', '')} and BN divided "
                   f"by inf (residual_gamma={self.cfg.gamma:g}: use a smaller --residual-gamma)"))

    def _accumulate(self, idx: torch.Tensor, sr, r, nr) -> None:
        """Add the layers ℓ ≥ 1 with ℓ % measure_every == 0 to the running sums of the means."""
        counted = ((idx >= 1) & (idx % self.cfg.measure_every == 0)).to(self.cfg.device)
        w = counted.to(torch.float64).unsqueeze(-1)
        self.sums["sr"] += (sr * w).sum(0)
        self.sums["sr2"] += (sr * sr * w).sum(0)
        self.sums["r"] += (r * w).sum(0)
        self.sums["nr"] += (nr * w).sum(0)

    def _record(self, idx: torch.Tensor, sv, sv_scaled, sr, r, nr) -> None:
        """Keep the per-layer values of the recorded layers among ``idx``."""
        wanted = [(j, self.rec_pos[int(l)]) for j, l in enumerate(idx.tolist()) if int(l) in self.rec_pos]
        if not wanted:
            return
        out = self.out
        js = torch.tensor([j for j, _ in wanted], device=self.cfg.device)
        ps = [p for _, p in wanted]
        out["soft_rank"][:, ps] = sr[js].T.cpu().numpy()
        out["rank_lower_bound"][:, ps] = r[js].T.cpu().numpy()
        out["numerical_rank"][:, ps] = nr[js].T.cpu().numpy()
        out["stable_rank"][:, ps] = _stable_rank_from_sv(sv_scaled[js]).T.to(torch.float64).cpu().numpy()
        out["effective_rank"][:, ps] = _effective_rank_from_sv(sv[js]).T.to(torch.float64).cpu().numpy()
        self.sv_out[:, ps, :] = sv_scaled[js].transpose(0, 1).to(torch.float64).cpu().numpy()

    def result(self) -> ChainResult:
        """The :class:`ChainResult` once every layer has been measured."""
        sums, out, final = self.sums, self.out, self.final
        n_counted = self.cfg.depth // self.cfg.measure_every
        mean_sr = (sums["sr"] / n_counted).cpu().numpy()
        var_sr = np.maximum((sums["sr2"] / n_counted).cpu().numpy() - mean_sr**2, 0.0)
        return ChainResult(
            config=self.cfg.to_dict(),
            layers=self.layers,
            soft_rank=out["soft_rank"],
            rank_lower_bound=out["rank_lower_bound"],
            numerical_rank=out["numerical_rank"],
            stable_rank=out["stable_rank"],
            effective_rank=out["effective_rank"],
            singular_values=self.sv_out,
            mean_soft_rank=mean_sr,
            std_soft_rank=np.sqrt(var_sr),
            mean_rank_lower_bound=(sums["r"] / n_counted).cpu().numpy(),
            mean_numerical_rank=(sums["nr"] / n_counted).cpu().numpy(),
            final_soft_rank=final["sr"],
            final_rank_lower_bound=final["r"],
            final_numerical_rank=final["nr"],
        )
