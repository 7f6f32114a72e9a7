"""Normalization layers chosen by name: what PyTorch has is used as is, what it lacks is written here.

=============  ==============================================================  =====================
name           layer                                                           source
=============  ==============================================================  =====================
``"none"``     identity                                                         —
``"bn"``       ``nn.BatchNorm1d`` / ``nn.BatchNorm2d``                           Ioffe & Szegedy 2015
``"bn_nomean"`` :class:`BatchNormNoMean1d` / ``2d`` (no centering)               Daneshmand et al. 2020, Eq. (2)
``"ghost_bn"`` :class:`GhostBatchNorm1d` / ``2d`` (sub-batch statistics)         Hoffer et al. 2017; Yang et al. 2019 Fig. 3b
``"brn"``      :class:`BatchRenorm1d` / ``2d``                                   Ioffe 2017, Algorithm 1
``"ln"``       ``nn.LayerNorm`` (dims=1) / ``nn.GroupNorm(1, C)`` (dims=2)       Ba et al. 2016
``"gn"``       ``nn.GroupNorm(num_groups, C)``                                   Wu & He 2018
``"bn4"``      :class:`BatchNorm4Things1d` / ``2d`` (BN with 4 things)           Summers & Dinneen 2020; Lange et al. §5
=============  ==============================================================  =====================

Every batch-statistics layer here follows the conventions of ``nn.BatchNorm``: inputs ``(N, C)`` or
``(N, C, L)`` for the 1d layers and ``(N, C, H, W)`` for the 2d ones, statistics per channel over every
other axis, ``eps`` inside the square root, running statistics updated by
``running ← (1 − momentum)·running + momentum·batch`` and used in ``eval()`` mode, a step counter
``num_batches_tracked``, and ``affine=True`` giving a per-channel ``weight`` (init 1) and ``bias``
(init 0) — ``affine=False`` creates neither.  Where a running *variance* is kept it is updated with the
unbiased (Bessel-corrected) batch variance, as ``nn.BatchNorm`` does (pytorch issue #19902), while the
batch itself is normalized with the biased variance; so each layer reduces exactly to ``nn.BatchNorm``
in the limit where it should (one ghost batch; r_max = 1, d_max = 0) and its ``state_dict`` buffers mean
what BatchNorm's mean.

In training mode a layer that would compute a statistic from a single value per channel raises a
``ValueError``, as ``nn.BatchNorm1d`` does for a batch of one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bnlab._validation import check_choice, check_int, check_real
from bnlab._vocabulary import NORM_ALIASES, canonical_value

__all__ = [
    "NORMALIZATIONS",
    "make_norm",
    "BatchNormNoMean1d",
    "BatchNormNoMean2d",
    "GhostBatchNorm1d",
    "GhostBatchNorm2d",
    "BatchRenorm1d",
    "BatchRenorm2d",
    "BatchNorm4Things1d",
    "BatchNorm4Things2d",
    "norm_affine_parameters",
    "ghost_batch_norm",
]

#: The normalization names :func:`make_norm` accepts.
NORMALIZATIONS = ("none", "bn", "bn_nomean", "ghost_bn", "brn", "ln", "gn", "bn4")


def ghost_batch_norm(x: torch.Tensor, ghost_batch_size: int | None, eps: float):
    """Normalize ``x`` (N, C, *) with the biased statistics of consecutive sub-batches of ``ghost_batch_size``.

    ``(x − μ_g)/sqrt(σ²_g + ε)`` with μ_g, σ²_g the per-channel mean and biased variance over the
    samples of sub-batch g and every axis after the channel one (Ioffe & Szegedy 2015, Algorithm 1,
    applied to each ghost batch; Hoffer et al. 2017, "Train longer, generalize better", §4).  Vectorized
    as one reshape to (G, B, C, *).  ``ghost_batch_size=None`` uses the whole batch (G = 1).

    Returns ``(out, mean, var)`` with ``mean`` and ``var`` of shape (G, C).  The caller checks that
    ``ghost_batch_size`` divides N.
    """
    n = x.shape[0]
    b = n if ghost_batch_size is None else check_int("ghost_batch_size", ghost_batch_size, minimum=1)
    if n % b:
        raise ValueError(f"ghost_batch_size={b} is not allowed: it must divide the batch of {n}")
    xg = x.reshape(n // b, b, *x.shape[1:])
    dims = (1,) + tuple(range(3, xg.ndim)) if xg.ndim > 3 else 1
    mean = xg.mean(dim=dims, keepdim=True)
    var = xg.var(dim=dims, unbiased=False, keepdim=True)
    out = (xg - mean) * torch.rsqrt(var + eps)
    return out.reshape(x.shape), mean.reshape(n // b, -1), var.reshape(n // b, -1)


def _update_running_(running: torch.Tensor, batch: torch.Tensor, momentum: float) -> None:
    """``running ← (1 − momentum)·running + momentum·batch`` in place (nn.BatchNorm's formula and rounding).

    A product and a sum rather than ``lerp_``: under ``torch.func.vmap`` (ensembles of these layers, e.g. the
    chunked Daneshmand cells) ``lerp_`` has no batching rule and falls back to a loop over the networks."""
    running.mul_(1.0 - momentum).add_(batch.to(running.dtype), alpha=momentum)


def _centered_moments(x: torch.Tensor, dims: tuple[int, ...]):
    """(mean, biased variance, x − mean) over ``dims``, keepdim, by the two-pass formula
    var = mean((x − mean)²): as accurate as Welford's update and, on CPU, ~20× faster than
    ``torch.var_mean`` over a non-innermost axis (measured: 83 µs vs 1.9 ms for (128, 512) float32)."""
    mean = x.mean(dim=dims, keepdim=True)
    xc = x - mean
    return mean, (xc * xc).mean(dim=dims, keepdim=True), xc


class _BatchStatNorm(nn.Module):
    """Shared parts of the batch-statistics layers: arguments, affine parameters, buffers, input checks."""

    _dims = 1  # 1: (N, C) or (N, C, L); 2: (N, C, H, W)

    def __init__(self, num_features: int, *, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_features = check_int("num_features", num_features, minimum=1)
        self.eps = check_real("eps", eps, minimum=0.0)
        self.momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
        if not isinstance(affine, bool):
            raise ValueError(f"affine={affine!r} is not allowed: expected True or False")
        self.affine = affine
        kw = {"device": device, "dtype": dtype}
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **kw))
            self.bias = nn.Parameter(torch.zeros(num_features, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long, device=device))

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"

    def _check_input(self, x: torch.Tensor) -> None:
        ok = x.ndim in (2, 3) if self._dims == 1 else x.ndim == 4
        want = "(N, C) or (N, C, L)" if self._dims == 1 else "(N, C, H, W)"
        if not ok or x.shape[1] != self.num_features:
            raise ValueError(
                f"input of shape {tuple(x.shape)} is not allowed for {type(self).__name__}: expected {want} "
                f"with C = {self.num_features}"
            )

    def _check_values_per_channel(self, count: int, what: str = "batch") -> None:
        if count < 2:
            raise ValueError(
                f"a {what} with {count} value per channel is not allowed in training mode for "
                f"{type(self).__name__}: batch statistics need at least 2 (use eval() or a larger batch)"
            )

    @staticmethod
    def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return t.reshape((1, -1) + (1,) * (x.ndim - 2))

    @staticmethod
    def _reduce_dims(x: torch.Tensor) -> tuple[int, ...]:
        return (0,) + tuple(range(2, x.ndim))

    def _scale_shift(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """``x·a + b`` per channel with the affine parameters folded into a, b: one pass over x (as
        PyTorch's own batch-norm kernels do), autograd through ``scale`` and ``shift``."""
        if self.affine:
            scale = scale * self.weight
            shift = self.bias if shift is None else shift * self.weight + self.bias
        if shift is None:
            return x * self._channel_view(scale, x)
        return torch.addcmul(self._channel_view(shift, x), x, self._channel_view(scale, x))


# --------------------------------------------------------------------------------------- no mean
class _BatchNormNoMean(_BatchStatNorm):
    def __init__(self, num_features: int, *, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, device=device, dtype=dtype)
        self.register_buffer("running_sq", torch.ones(num_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self.training:
            dims = self._reduce_dims(x)
            self._check_values_per_channel(x.numel() // x.shape[1])
            sq = (x * x).mean(dim=dims)
            with torch.no_grad():
                # E[x²] is estimated without bias by the batch mean of x², so no Bessel factor here
                _update_running_(self.running_sq, sq.detach(), self.momentum)
                self.num_batches_tracked.add_(1)
        else:
            sq = self.running_sq
        return self._scale_shift(x, torch.rsqrt(sq + self.eps), None)


class BatchNormNoMean1d(_BatchNormNoMean):
    """Batch normalization without mean subtraction: divide by the batch root mean square.

    ``y_c = weight_c · x_c / sqrt(mean_batch(x_c²) + ε) + bias_c`` — Daneshmand et al. 2020, Eq. (2):
    ``Bn_{α,β}(H) = β ∘ diag(M(H))^{-1/2} H + α 1ᵀ`` with ``M(H) = H Hᵀ/N`` (H is d × N, neurons ×
    samples), i.e. each neuron is divided by its root mean square over the batch, with no centering.
    The paper's β (scale) and α (shift) are ``weight`` and ``bias`` here; its formula has no ε
    (``eps=0`` reproduces it; the default 1e-5 guards a neuron that is zero on the whole batch).

    In ``eval()`` mode the running second moment ``running_sq`` (initialized to 1, updated with the
    batch mean of x² by ``momentum``) replaces the batch one.  Input (N, C) or (N, C, L).
    """

    _dims = 1


class BatchNormNoMean2d(_BatchNormNoMean):
    """:class:`BatchNormNoMean1d` for (N, C, H, W): the second moment per channel over N, H and W.

    Daneshmand et al. 2020, Eq. (2), with the batch and spatial axes as the samples (as BN for CNNs).
    """

    _dims = 2


# --------------------------------------------------------------------------------------- ghost BN
class _GhostBatchNorm(_BatchStatNorm):
    def __init__(self, num_features: int, ghost_batch_size: int, *, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, device=device, dtype=dtype)
        self.ghost_batch_size = check_int("ghost_batch_size", ghost_batch_size, minimum=1)
        self.register_buffer("running_mean", torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.ones(num_features, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ghost_batch_size={self.ghost_batch_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not self.training:
            inv = torch.rsqrt(self.running_var + self.eps)
            return self._scale_shift(x, inv, -self.running_mean * inv)
        n, b = x.shape[0], self.ghost_batch_size
        if n % b:
            raise ValueError(
                f"a batch of {n} samples is not allowed with ghost_batch_size={b}: it must be a multiple of it"
            )
        m = b * (x.numel() // (n * x.shape[1]))  # values per channel in one ghost batch
        self._check_values_per_channel(m, "ghost batch")
        xg = x.reshape(n // b, b, *x.shape[1:])  # (G, B, C, *)
        mean, var, xc = _centered_moments(xg, (1,) + tuple(range(3, xg.ndim)))  # (G, 1, C, 1…)
        scale = torch.rsqrt(var + self.eps)
        if self.affine:
            w = self.weight.reshape((1, 1, -1) + (1,) * (x.ndim - 2))
            y = torch.addcmul(self.bias.reshape(w.shape), xc, scale * w)
        else:
            y = xc * scale
        y = y.reshape(x.shape)
        mean, var = mean.reshape(n // b, -1), var.reshape(n // b, -1)
        with torch.no_grad():
            # as nn.BatchNorm: the running variance takes the unbiased batch variance; averaged over ghosts
            _update_running_(self.running_mean, mean.mean(0), self.momentum)
            _update_running_(self.running_var, (var * (m / (m - 1))).mean(0), self.momentum)
            self.num_batches_tracked.add_(1)
        return y


class GhostBatchNorm1d(_GhostBatchNorm):
    """BN with statistics over consecutive sub-batches ("ghost batches") of ``ghost_batch_size`` samples.

    Each ghost batch g is normalized by its own per-channel mean and biased variance,
    ``(x − μ_g)/sqrt(σ²_g + ε)`` (Ioffe & Szegedy 2015, Algorithm 1 per ghost batch; Hoffer et al. 2017,
    "Ghost Batch Normalization", Algorithm 1), so a training batch of N = G·B behaves as G independent
    batches of B — the sub-batch BN of Yang et al. 2019, Fig. 3b.  Running statistics as ``nn.BatchNorm1d``
    (the mean and the unbiased variance of each ghost batch, averaged over the G ghosts, then one update
    by ``momentum`` per forward).  ``ghost_batch_size`` must divide the training batch; with one ghost
    batch the layer is ``nn.BatchNorm1d``.  Input (N, C) or (N, C, L).
    """

    _dims = 1


class GhostBatchNorm2d(_GhostBatchNorm):
    """:class:`GhostBatchNorm1d` for (N, C, H, W): statistics per channel over the ghost batch's samples, H, W."""

    _dims = 2


# --------------------------------------------------------------------------------------- Batch Renorm
class _BatchRenorm(_BatchStatNorm):
    def __init__(self, num_features: int, *, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 r_max: float = 3.0, d_max: float = 5.0, warmup_start: int = 5000, r_max_at: int = 40000,
                 d_max_at: int = 25000, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, device=device, dtype=dtype)
        self.r_max = check_real("r_max", r_max, minimum=1.0)
        self.d_max = check_real("d_max", d_max, minimum=0.0)
        self.warmup_start = check_int("warmup_start", warmup_start, minimum=0)
        self.r_max_at = check_int("r_max_at", r_max_at, minimum=self.warmup_start)
        self.d_max_at = check_int("d_max_at", d_max_at, minimum=self.warmup_start)
        self.register_buffer("running_mean", torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.ones(num_features, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", r_max={self.r_max}, d_max={self.d_max}, warmup_start={self.warmup_start}, "
                f"r_max_at={self.r_max_at}, d_max_at={self.d_max_at}")

    def _ramp(self, step: int, end: int, start_value: float, end_value: float) -> float:
        if step >= end:
            return end_value
        if step <= self.warmup_start:
            return start_value
        return start_value + (end_value - start_value) * (step - self.warmup_start) / (end - self.warmup_start)

    def clip_limits(self, step: int | None = None) -> tuple[float, float]:
        """(r_max, d_max) in force at training step ``step`` (default: this layer's ``num_batches_tracked``).

        Ioffe 2017, §4 ("Experiments"): r_max = 1 and d_max = 0 (plain BN) for the first
        ``warmup_start`` steps, then relaxed linearly to ``r_max`` at step ``r_max_at`` and to ``d_max``
        at step ``d_max_at`` (the paper: 5k, 40k and 25k steps, r_max 3, d_max 5 — the defaults).
        The step counter is the layer's own, so the schedule survives ``state_dict`` round trips.
        """
        step = int(self.num_batches_tracked.item()) if step is None else check_int("step", step, minimum=0)
        return (self._ramp(step, self.r_max_at, 1.0, self.r_max), self._ramp(step, self.d_max_at, 0.0, self.d_max))

    def _limits_on_device(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`clip_limits` at the current step as 0-d tensors computed on the layer's device from
        ``num_batches_tracked`` — no host synchronization per step on a GPU."""
        step = self.num_batches_tracked.to(like.dtype)

        def ramp(end: int, start_value: float, end_value: float) -> torch.Tensor:
            if end > self.warmup_start:
                frac = ((step - self.warmup_start) / (end - self.warmup_start)).clamp(0.0, 1.0)
            else:
                frac = (step >= end).to(like.dtype)
            return start_value + (end_value - start_value) * frac

        return ramp(self.r_max_at, 1.0, self.r_max), ramp(self.d_max_at, 0.0, self.d_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not self.training:
            # inference: the running statistics, ε once inside the square root
            inv = torch.rsqrt(self.running_var + self.eps)
            return self._scale_shift(x, inv, -self.running_mean * inv)
        dims = self._reduce_dims(x)
        m = x.numel() // x.shape[1]
        self._check_values_per_channel(m)
        mean, var, xc = _centered_moments(x, dims)
        mean, var = mean.reshape(-1), var.reshape(-1)
        sigma_b = torch.sqrt(var + self.eps)
        r_max, d_max = self._limits_on_device(mean)
        with torch.no_grad():
            # r and d are constants for the gradient (Ioffe 2017, Algorithm 1: "stop_gradient"); they are
            # recomputed from this batch and the current running statistics at every step
            sigma = torch.sqrt(self.running_var + self.eps)
            r = torch.clamp(sigma_b / sigma, 1.0 / r_max, r_max)
            d = torch.clamp((mean - self.running_mean) / sigma, -d_max, d_max)
        # (x − μ_B)/σ_B·r + d, affine folded in: one pass over x − μ_B (gradient through μ_B and σ_B)
        y = self._scale_shift(xc, r / sigma_b, d)
        with torch.no_grad():
            _update_running_(self.running_mean, mean.detach(), self.momentum)
            _update_running_(self.running_var, var.detach() * (m / (m - 1)), self.momentum)
            self.num_batches_tracked.add_(1)
        return y


class BatchRenorm1d(_BatchRenorm):
    """Batch Renormalization (Ioffe 2017, Algorithm 1) for (N, C) or (N, C, L).

    Training mode, per channel, with the batch mean μ_B and biased variance σ²_B and the running
    mean μ and variance σ² (before this step's update)::

        σ_B = sqrt(σ²_B + ε),  σ = sqrt(σ² + ε),
        r = clip(σ_B/σ, 1/r_max, r_max),   d = clip((μ_B − μ)/σ, −d_max, d_max)   (no gradient),
        y = weight · ((x − μ_B)/σ_B · r + d) + bias.

    Unclipped, the training output equals the inference output (x − μ)/σ, which is the point of the
    method; clipped, it interpolates towards plain BN (r_max = 1, d_max = 0 is exactly BN).
    Inference: y = weight · (x − μ)/sqrt(σ² + ε) + bias.  The running statistics are updated after
    r and d are formed: μ ← μ + momentum·(μ_B − μ) and σ² ← σ² + momentum·(σ²_B,unbiased − σ²).

    The limits follow the warm-up schedule of :meth:`clip_limits` (``r_max``, ``d_max``,
    ``warmup_start``, ``r_max_at``, ``d_max_at``; the layer's own step counter).

    Errata / differences (Ioffe 2017)
    ---------------------------------
    * Algorithm 1 tracks the running *standard deviation* σ ← σ + α(σ_B − σ); this layer tracks the
      running *variance* (updated with the unbiased batch variance, as ``nn.BatchNorm1d``) and forms
      σ = sqrt(σ² + ε), so r_max = 1, d_max = 0 reproduces ``nn.BatchNorm1d`` exactly, buffers included.
      The moving average of σ_B and the square root of the moving average of σ²_B differ by O(α·Var σ_B).
    * ε is added inside the square root once, in training (σ_B, σ) and at inference — not to the
      standard deviation, and not twice.
    """

    _dims = 1


class BatchRenorm2d(_BatchRenorm):
    """:class:`BatchRenorm1d` for (N, C, H, W): statistics per channel over N, H and W (Ioffe 2017, Alg. 1)."""

    _dims = 2


# --------------------------------------------------------------------------------------- BN with 4 things
class _BatchNorm4Things(_BatchStatNorm):
    def __init__(self, num_features: int, num_groups: int | None = None, *, ghost_batch_size: int | None = None,
                 example_weight: float = 0.0, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 device: Any = None, dtype: torch.dtype | None = None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine, device=device, dtype=dtype)
        groups = num_features if num_groups is None else check_int("num_groups", num_groups, minimum=1)
        if num_features % groups:
            raise ValueError(f"num_groups={groups} is not allowed: it must divide num_features={num_features}")
        self.num_groups = groups
        self.ghost_batch_size = (None if ghost_batch_size is None
                                 else check_int("ghost_batch_size", ghost_batch_size, minimum=1))
        self.example_weight = check_real("example_weight", example_weight, minimum=0.0, maximum=1.0)
        self.register_buffer("running_mean", torch.zeros(groups, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.ones(groups, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_groups={self.num_groups}, ghost_batch_size={self.ghost_batch_size}, "
                f"example_weight={self.example_weight}")

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        # (N, C, *) -> (N, G, C/G·prod(*)): the values of one group of one sample, contiguous last axis
        return x.reshape(x.shape[0], self.num_groups, -1)

    def _affine(self, y: torch.Tensor) -> torch.Tensor:
        if not self.affine:
            return y
        return torch.addcmul(self._channel_view(self.bias, y), y, self._channel_view(self.weight, y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        n = x.shape[0]
        xg = self._grouped(x)  # (N, G, K)
        if not self.training:
            mu = self.running_mean[None, :, None]
            var = self.running_var[None, :, None]
            a = self.example_weight
            if a > 0:
                # the example's own statistics over its group's values, mixed with the running ones as the
                # moments of the mixture a·(example) + (1 − a)·(population)
                mu_e = xg.mean(-1, keepdim=True)
                var_e = (xg - mu_e).pow(2).mean(-1, keepdim=True)
                mu, var = a * mu_e + (1 - a) * mu, a * var_e + (1 - a) * var + a * (1 - a) * (mu_e - mu).pow(2)
            y = ((xg - mu) * torch.rsqrt(var + self.eps)).reshape(x.shape)
            return self._affine(y)
        b = n if self.ghost_batch_size is None else self.ghost_batch_size
        if n % b:
            raise ValueError(
                f"a batch of {n} samples is not allowed with ghost_batch_size={b}: it must be a multiple of it")
        m = b * xg.shape[-1]  # values per group in one (ghost) batch
        self._check_values_per_channel(m, "(ghost) batch and channel group")
        xgb = xg.reshape(n // b, b, self.num_groups, -1)  # (ghosts, B, G, K)
        mean, var, xc = _centered_moments(xgb, (1, 3))
        y = (xc * torch.rsqrt(var + self.eps)).reshape(x.shape)
        with torch.no_grad():
            mean, var = mean.reshape(n // b, -1), var.reshape(n // b, -1)
            _update_running_(self.running_mean, mean.mean(0), self.momentum)
            _update_running_(self.running_var, (var * (m / (m - 1))).mean(0), self.momentum)
            self.num_batches_tracked.add_(1)
        return self._affine(y)


class BatchNorm4Things1d(_BatchNorm4Things):
    """"BN with 4 things" (Summers & Dinneen 2020, "Four things everyone should know to improve batch
    normalization"), as Lange et al. §5 use it: "for small batch size, BN is combined with GN, while for
    larger batch-sizes BN is combined with Ghost Normalization; additionally a weight decay regularization on
    BN's γ, β terms and a method to incorporate example statistics during inference are applied.  In
    particular, the combination with GN makes it applicable to mini-batch size 1."

    Training: statistics (mean and biased variance) over the samples of each ghost batch of
    ``ghost_batch_size`` (default: the whole batch) **and** the channels of each of ``num_groups`` groups
    (and every axis after the channel one) — with one channel per group (``num_groups=None``, the
    default) this is ghost BN, with the whole batch it is ``nn.BatchNorm1d``; with fewer groups it pools
    the batch and a group of channels, as GroupNorm pools a group for one sample, so a batch of one
    trains when a group has ≥ 2 values.  Inference: the running group statistics (updated as
    ``nn.BatchNorm``: the mean and the unbiased variance, averaged over the ghost batches, once per
    forward by ``momentum``), mixed with the example's own group statistics by ``example_weight`` a:
    μ = a μ_x + (1−a) μ_run, σ² = a σ²_x + (1−a) σ²_run + a(1−a)(μ_x − μ_run)² (the moments of the
    a : (1−a) mixture of the example's values and the population) — "inference example weighing".
    The fourth thing, weight decay on γ and β, belongs to the optimizer: :func:`norm_affine_parameters`
    lists those parameters for their own parameter group.  ``weight``/``bias`` are per channel.

    Differences: Lange et al. do not spell out the combination or the weighing; Summers & Dinneen is
    not in this repository.  The forms above are bnlab's reading of Lange's description (statistics
    over batch × channel group for "BN combined with GN"; mixture moments for "example statistics
    during inference"); they reduce to ``nn.BatchNorm1d`` exactly for one channel per group, no ghost
    batches and a = 0 (tested).
    """

    _dims = 1


class BatchNorm4Things2d(_BatchNorm4Things):
    """:class:`BatchNorm4Things1d` for (N, C, H, W): statistics over the (ghost) batch, a group of channels,
    H and W."""

    _dims = 2


def norm_affine_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The γ (``weight``) and β (``bias``) of every normalization layer of ``model`` (bnlab's batch-statistics
    layers, ``nn.BatchNorm*``, ``nn.GroupNorm``, ``nn.LayerNorm``) — for a parameter group with its own weight
    decay ("BN with 4 things", Summers & Dinneen 2020; Lange et al. §5)."""
    kinds = (_BatchStatNorm, nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    out: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, kinds):
            out.extend(p for p in (getattr(m, "weight", None), getattr(m, "bias", None)) if p is not None)
    return out


# --------------------------------------------------------------------------------------- by name
_BRN_KEYS = ("r_max", "d_max", "warmup_start", "r_max_at", "d_max_at")


def make_norm(
    name: str,
    num_features: int,
    *,
    dims: int = 1,
    eps: float = 1e-5,
    momentum: float = 0.1,
    affine: bool = True,
    num_groups: int | None = None,
    ghost_batch_size: int | None = None,
    example_weight: float = 0.0,
    device: Any = None,
    dtype: torch.dtype | None = None,
    **brn_kwargs: Any,
) -> nn.Module:
    """A normalization layer for ``num_features`` channels, chosen by ``name`` (one of :data:`NORMALIZATIONS`).

    Parameters
    ----------
    name:
        ``"none"`` (``nn.Identity``), ``"bn"``, ``"bn_nomean"``, ``"ghost_bn"``, ``"brn"``, ``"ln"``,
        ``"gn"`` — see the module docstring.
    num_features:
        Channels C (features of an MLP layer, channels of a conv layer).
    dims:
        1 for (N, C) / (N, C, L) inputs, 2 for (N, C, H, W).
    eps, momentum, affine:
        As in ``nn.BatchNorm`` (LayerNorm/GroupNorm use ``eps`` and ``affine``; ``momentum`` is unused).
    num_groups:
        Groups of ``"gn"`` (default 32) and ``"bn4"`` (default ``num_features``: one channel per group, plain
        BN statistics; fewer groups pool the batch with a group of channels); must divide ``num_features``.
    ghost_batch_size:
        Samples per ghost batch of ``"ghost_bn"`` (required there) and ``"bn4"`` (optional; rejected elsewhere).
    example_weight:
        ``"bn4"`` only: the example's weight a in its inference statistics (:class:`BatchNorm4Things1d`).
    device, dtype:
        Of the parameters and buffers.
    **brn_kwargs:
        ``r_max``, ``d_max``, ``warmup_start``, ``r_max_at``, ``d_max_at`` of ``"brn"``
        (see :class:`BatchRenorm1d`).

    ``"ln"`` with ``dims=2`` is ``nn.GroupNorm(1, C)``: statistics over (C, H, W) of each sample as
    LayerNorm, with the per-channel affine parameters of the usual CNN convention (``nn.LayerNorm``
    would need H and W and gives one parameter per element; Lange et al. note that GN with one group
    is LN).
    """
    name = check_choice("name", canonical_value("name", name, NORM_ALIASES), NORMALIZATIONS)
    num_features = check_int("num_features", num_features, minimum=1)
    dims = check_int("dims", dims, minimum=1, maximum=2)
    eps = check_real("eps", eps, minimum=0.0)
    momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
    if not isinstance(affine, bool):
        raise ValueError(f"affine={affine!r} is not allowed: expected True or False")
    bad = sorted(set(brn_kwargs) - set(_BRN_KEYS))
    if bad:
        raise ValueError(f"keyword arguments {bad} are not allowed: make_norm takes {', '.join(_BRN_KEYS)} for 'brn'")
    if brn_kwargs and name != "brn":
        raise ValueError(f"{sorted(brn_kwargs)} are not allowed with name={name!r}: they are arguments of 'brn'")
    if name != "bn4" and (ghost_batch_size is not None) != (name == "ghost_bn"):
        raise ValueError(
            f"ghost_batch_size={ghost_batch_size!r} is not allowed with name={name!r}: "
            "'ghost_bn' needs it, 'bn4' may take it and the others do not"
        )
    if example_weight and name != "bn4":
        raise ValueError(f"example_weight={example_weight!r} is not allowed with name={name!r}: it is an argument of 'bn4'")
    kw = {"device": device, "dtype": dtype}
    common = dict(eps=eps, momentum=momentum, affine=affine, **kw)
    if name == "none":
        return nn.Identity()
    if name == "bn":
        cls = nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d
        return cls(num_features, eps=eps, momentum=momentum, affine=affine, **kw)
    if name == "bn_nomean":
        return (BatchNormNoMean1d if dims == 1 else BatchNormNoMean2d)(num_features, **common)
    if name == "ghost_bn":
        return (GhostBatchNorm1d if dims == 1 else GhostBatchNorm2d)(num_features, ghost_batch_size, **common)
    if name == "brn":
        return (BatchRenorm1d if dims == 1 else BatchRenorm2d)(num_features, **common, **brn_kwargs)
    if name == "bn4":
        groups = num_features if num_groups is None else check_int("num_groups", num_groups, minimum=1)
        if num_features % groups:
            raise ValueError(f"num_groups={groups} is not allowed: it must divide num_features={num_features}")
        return (BatchNorm4Things1d if dims == 1 else BatchNorm4Things2d)(
            num_features, groups, ghost_batch_size=ghost_batch_size, example_weight=example_weight, **common)
    if name == "ln":
        if dims == 1:
            return nn.LayerNorm(num_features, eps=eps, elementwise_affine=affine, **kw)
        return nn.GroupNorm(1, num_features, eps=eps, affine=affine, **kw)
    num_groups = 32 if num_groups is None else check_int("num_groups", num_groups, minimum=1)
    if num_features % num_groups:
        raise ValueError(
            f"num_groups={num_groups} is not allowed: it must divide num_features={num_features}"
        )
    return nn.GroupNorm(num_groups, num_features, eps=eps, affine=affine, **kw)
