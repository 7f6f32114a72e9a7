"""The functional core of BNP (Lange et al., Algorithm 2 steps 1-5): functions of tensors, no state.

Every step route of :class:`bnlab.optim.BNPreconditioner` is made of these functions:

* the **eager** route (the default on CPU) calls them over lists of layers, batched with
  ``torch._foreach_*`` as ``torch.optim`` does (:func:`running_average`,
  :func:`moments_running_average`, :func:`inverse_scales`, :func:`precondition_`);
* the **fused** route (``gradient="fused"``) takes its statistics with :func:`batch_mean_var` and
  the same :func:`running_average` / :func:`inverse_scales`, then forms G_w' = δᵀĤ itself;
* the **compiled** route (the default on CUDA) hands :func:`dense_steps` — statistics, running
  averages, inverse scales and the gradient transform of every dense layer, as pure functions
  of tensors — to ``torch.compile``, which fuses its elementwise work into a few kernels;
* the **native** route (``native=True``, CPU) is the same arithmetic in C++ (``_native``).

Non-finite batches (a NaN or inf input, or a float32 input whose square overflows): the columns
whose new running mean or variance would not be finite keep their previous values for that step
(:func:`keep_finite`), so one bad sample cannot poison the statistics of every later step.  The
caller counts such steps and warns (see ``BNPreconditioner.nonfinite_batches``).

``1/(q²σ̃²)`` is formed as ``(1/q²)/σ̃²`` where ``q²σ̃²`` would overflow (a float32 variance near
3.4e38 and q² > 1): the product would round to inf and the preconditioned gradient to a silent
zero.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "batch_mean_var",
    "bias_step_",
    "dense_steps",
    "inverse_scales",
    "keep_finite",
    "moments_running_average",
    "precondition_",
    "preconditioned",
    "regularized_variance",
    "running_average",
]


def regularized_variance(var: torch.Tensor, eps1: float, eps2: float) -> torch.Tensor:
    """σ̃² = σ² + ε₁·max(σ²) + ε₂ (Lange et al., Algorithm 2 step 3; Algorithm 3 step 3)."""
    return var + (var.max() * eps1 + eps2)


def batch_mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column mean μ_H and biased variance σ_H² of a 2-D input (Algorithm 2 step 1, Eq. 13).

    On CPU the batch-norm statistics kernel (two passes, no temporary; see
    ``_layers._moments_two_pass``), elsewhere ``torch.var_mean``.
    """
    if x.device.type == "cpu":
        return torch.batch_norm_update_stats(x, None, None, 0.0)
    var, mean = torch.var_mean(x, 0, correction=0)
    return mean, var


def running_average(means, variances, batch_means, batch_vars, rho: float):
    """Algorithm 2 step 2 for a list of layers: μ + (1-ρ)(μ_H - μ), σ² + (1-ρ)(σ_H² - σ²).

    Two batched ``lerp`` calls; returns new lists (the arguments are not changed).  At N = 1 the
    caller passes σ_H² = (h - μ)², the variance about the running mean before the update (§3.3).
    """
    a = 1.0 - rho
    return list(torch._foreach_lerp(means, batch_means, a)), list(torch._foreach_lerp(variances, batch_vars, a))


def moments_running_average(means, variances, s1s, s2s, rows: int, rho: float):
    """Algorithm 2 step 2 from moments about c = μ (s1 = Σ(x - c), s2 = Σ(x - c)² over ``rows``).

    μ_H = c + s1/n and σ_H² = s2/n - (s1/n)² (biased, Eq. 13; at n = 1 just s2, the variance
    about the running mean, §3.3), so μ ← μ + (1-ρ)s1/n and σ² ← ρσ² + (1-ρ)σ_H²; returns new
    lists.  With ρ = 0 the mini-batch variance itself is clamped at zero (no rounding below it).
    """
    a = 1.0 - rho
    k = len(means)
    scaled = torch._foreach_mul(variances, rho)
    updated = list(torch._foreach_add(list(means) + list(scaled), list(s1s) + list(s2s), alpha=a / rows))
    new_means, new_vars = updated[:k], updated[k:]
    if rows > 1:
        torch._foreach_addcmul_(new_vars, s1s, s1s, value=-a / (rows * rows))
        if rho == 0.0:
            torch._foreach_clamp_min_(new_vars, 0.0)
    return new_means, new_vars


def keep_finite(new_mean: torch.Tensor, new_var: torch.Tensor, mean: torch.Tensor, var: torch.Tensor):
    """``(mean', var', skipped)``: the new statistics where both are finite, the old ones elsewhere,
    and the number of columns kept back (a 0-d int64 tensor; no host synchronization)."""
    finite = torch.isfinite(new_mean) & torch.isfinite(new_var)
    return (torch.where(finite, new_mean, mean), torch.where(finite, new_var, var),
            finite.numel() - finite.sum())


def inverse_scales(variances: Sequence[torch.Tensor], q2s: Sequence[float], eps1: float, eps2: float,
                   maxes: Sequence[float] | None = None) -> list[torch.Tensor]:
    """Step 3 and the factor of steps 4-5: 1/(q²σ̃²) = 1/(q²·σ² + q²·(ε₁·max σ² + ε₂)) per layer
    (σ̃² as in :func:`regularized_variance`, 1/q² folded in: Errata of ``bnlab.optim.bnp``).

    ``maxes`` (the maxima of ``variances`` as Python floats, read back once by the caller on CPU)
    make the shifts ε₁·max + ε₂ Python floats: batched calls with lists of scalars convert every
    scalar to a tensor (43 µs of a 93 µs step on CPU).  Without them the shifts stay on the device
    (no host synchronization).  Where q²σ̃² would overflow the dtype, 1/σ̃² is formed first and
    scaled by 1/q² (no silent zero).
    """
    if maxes is not None:
        var_tilde, wide = [], {}
        for i, (v, m, q) in enumerate(zip(variances, maxes, q2s)):
            shift = eps1 * m + eps2
            if (m + shift) * q > torch.finfo(v.dtype).max:
                # q²σ̃² (or σ̃² itself) would round to inf and 1/(q²σ̃²) to a silent zero: the
                # reciprocal of σ̃² in float64, then 1/q² (a subnormal float32 is still > 0).
                wide[i] = torch.reciprocal(torch.add(v.double(), shift)).mul_(1.0 / q).to(v.dtype)
                continue
            vt = torch.add(v, shift)
            var_tilde.append(vt.mul_(q) if q != 1.0 else vt)
        if var_tilde:
            torch._foreach_reciprocal_(var_tilde)
        if wide:
            narrow = iter(var_tilde)
            var_tilde = [wide[i] if i in wide else next(narrow) for i in range(len(variances))]
        return var_tilde
    shifts = torch._foreach_mul(torch._foreach_max(variances), [eps1 * q for q in q2s])
    torch._foreach_add_(shifts, [eps2 * q for q in q2s])
    var_tilde = torch._foreach_mul(variances, list(q2s))  # q²·σ̃² once the shifts are added
    torch._foreach_add_(var_tilde, shifts)
    torch._foreach_reciprocal_(var_tilde)
    return var_tilde


def precondition_(grad_weight, grad_bias, mean, inv, q2) -> None:
    """Algorithm 2 steps 4-5 in place given ``inv`` = 1/(q² σ̃²) (Lange et al., Eq. 15):

        G_w(i, j) ← (G_w(i, j) - μ(j) G_b(i)) · inv(j)                  (step 4)
        G_b(i)    ← G_b(i) / q² - Σ_j G_w(i, j) μ(j)   (updated G_w)    (step 5)

    one rank-1 update, one scaling, one matrix-vector product (5·n_in·n_out operations).  Without a
    bias only the scaling (see the Errata of ``bnlab.optim.bnp``).
    """
    if grad_bias is None:
        grad_weight.mul_(inv)
        return
    grad_weight.addr_(grad_bias, mean, alpha=-1.0)
    grad_weight.mul_(inv)
    bias_step_(grad_bias, grad_weight, mean, q2)


def bias_step_(grad_bias, mat, vec, q2) -> None:
    """Algorithm 2 step 5 in place: G_b ← G_b/q² - mat·vec (one ``addmv_``, 1/q² as its β)."""
    if isinstance(q2, torch.Tensor):
        grad_bias.div_(q2)
        grad_bias.addmv_(mat, vec, alpha=-1.0)
    else:
        grad_bias.addmv_(mat, vec, beta=1.0 / q2, alpha=-1.0)


def preconditioned(grad_weight, grad_bias, mean, inv, q2: float):
    """:func:`precondition_` as a pure function: ``(G_w', G_b')`` (``G_b'`` is ``None`` without a bias).

    Elementwise and one row reduction, so a compiler fuses steps 4 and 5 into one pass over G_w.
    """
    if grad_bias is None:
        return grad_weight * inv, None
    gw = (grad_weight - grad_bias[:, None] * mean) * inv
    return gw, grad_bias / q2 - (gw * mean).sum(1)


def dense_steps(xs, means, variances, gws, gbs, q2s, rho: float, eps1: float, eps2: float):
    """Algorithm 2 steps 1-5 of a list of dense layers as a pure function (the compiled route's body).

    ``xs[l]`` is layer l's (N, n_in) input (any floating dtype: the statistics are taken in the
    dtype of ``means[l]``, float32 under mixed precision), ``gws[l]``/``gbs[l]`` its gradients
    (``gbs[l]`` may be ``None``; they are transformed in the statistics' dtype and returned in
    their own), ``q2s[l]`` its q² (a Python float).  Returns ``(means', vars', gws', gbs',
    skipped)``, ``skipped`` an int64 tensor: per layer, the columns whose non-finite statistics
    were kept back (:func:`keep_finite`).  The running averages, σ̃² and 1/(q²σ̃²) are those of
    :func:`running_average` and :func:`inverse_scales` (the maxima stay on the device, 1/(q²σ̃²)
    as (1/q²)/σ̃², which cannot overflow).
    """
    batch_means, batch_vars = [], []
    for x, mean in zip(xs, means):
        x = x.to(mean.dtype)
        if x.shape[0] == 1:  # §3.3: the variance about the running mean before the update
            row = x[0]
            batch_means.append(row)
            batch_vars.append((row - mean).square())
        else:
            var, mu = torch.var_mean(x, 0, correction=0)
            batch_means.append(mu)
            batch_vars.append(var)
    new_means, new_vars = running_average(means, variances, batch_means, batch_vars, rho)
    out_means, out_vars, out_gws, out_gbs, skipped = [], [], [], [], []
    for mean, var, new_mean, new_var, gw, gb, q2 in zip(means, variances, new_means, new_vars, gws, gbs, q2s):
        mean, var, bad = keep_finite(new_mean, new_var, mean, var)
        inv = (1.0 / q2) / (var + (var.max() * eps1 + eps2))
        w, b = preconditioned(gw.to(mean.dtype), None if gb is None else gb.to(mean.dtype), mean, inv, q2)
        out_means.append(mean)
        out_vars.append(var)
        out_gws.append(w.to(gw.dtype))
        out_gbs.append(None if gb is None else b.to(gb.dtype))
        skipped.append(bad)
    return out_means, out_vars, out_gws, out_gbs, torch.stack(skipped)


def dense_steps_(xs, means, variances, gws, gbs, q2s, rho: float, eps1: float, eps2: float,
                 nonfinite_steps: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dense_steps` written back in place (the statistics and the ``.grad`` tensors); returns
    the per-layer counts of columns kept back and, if given, adds 1 to ``nonfinite_steps[l]`` (an
    int64 vector on the device) for each layer l that kept some back — no host synchronization.
    Compiled, the write-backs and the count are stores of the same kernels."""
    new_means, new_vars, new_gws, new_gbs, skipped = dense_steps(xs, means, variances, gws, gbs, q2s,
                                                                 rho, eps1, eps2)
    for dst, src in zip([*means, *variances, *gws], [*new_means, *new_vars, *new_gws]):
        dst.copy_(src)
    for gb, new in zip(gbs, new_gbs):
        if gb is not None:
            gb.copy_(new)
    if nonfinite_steps is not None:
        nonfinite_steps.add_((skipped > 0).to(nonfinite_steps.dtype))
    return skipped
