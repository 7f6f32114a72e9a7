"""The eager BN-MLP ensemble step as it was before the step-speed changes (commit e082aac), kept only so
that ``bench_ensemble.py --step-ab`` can time it side by side with the current one in one process.

What differs from the current code, each reproduced here: the stacked weights row-major (so the weight
gradients come back transposed and the optimizer's elementwise ops read them with a stride); BN as
autograd's graph of the composite, its float32 variance through ``_SampleVariance.apply``
(``Function.apply`` binds arguments by ``inspect.signature`` on every call); ``matmul`` and per-layer
slicing of ε; the batch statistics by squeezes; RMSProp's fresh square roots and quotient, and the
per-network rate broadcast even when every network shares one rate.  The step itself (``build_step``)
is the current one: it calls ``_update`` by module name, swapped for ``update_before`` here.
"""
from __future__ import annotations

import contextlib

import torch

from bnlab.nets import _ensemble_step
from bnlab.nets._ensemble_step import _per_net
from bnlab.nets.ensemble import _BNMLPStack, _SampleVariance


class BeforeStack(_BNMLPStack):
    """The stack with e082aac's layout and forward."""

    def __init__(self, models, dev):
        super().__init__(models, dev)
        with torch.no_grad():
            self.weights = [w.contiguous() for w in self.weights]
            self.readout_w = self.readout_w.contiguous()

    def _run(self, params, x, training):
        weights, readout_w, readout_b = params[: self.max_depth], params[-2], params[-1]
        a = x
        finished = []
        means, variances = [], []
        for layer in range(self.max_depth):
            k = self.k[layer]
            if a.ndim == 3 and k < a.shape[0]:
                finished.append(a[k:])
                a = a[:k]
            h = torch.matmul(a, weights[layer].transpose(1, 2))
            eps = self.eps[:k]
            if training:
                out, mean, var = self._batch_norm_before(h, eps)
                means.append(mean)
                variances.append(var)
            else:
                out = (h - self.running_mean[layer].unsqueeze(1)) * torch.rsqrt(self.running_var[layer].unsqueeze(1) + eps)
            if self.affine:
                out = self.gamma[:k] * out + self.beta[:k]
            a = self.act(out)
        finished.append(a)
        a = torch.cat(finished[::-1], dim=0)
        logits = torch.baddbmm(readout_b.unsqueeze(1), a, readout_w.transpose(1, 2))
        return logits, (means, variances)

    def _batch_norm_before(self, h, eps):
        k, n, width = h.shape
        b = self.sub_batch_size or n
        hg = h.reshape(k, n // b, b, width)
        mean = hg.mean(dim=2, keepdim=True)
        var = _SampleVariance.apply(hg) if hg.dtype == torch.float32 and hg.device.type == "cpu" else \
            hg.var(dim=2, unbiased=False, keepdim=True)
        out = (hg - mean) * torch.rsqrt(var + eps.view(k, 1, 1, 1))
        with torch.no_grad():
            batch_mean, batch_var = mean.squeeze(2), var.squeeze(2) * (b / (b - 1))
            if n != b:
                batch_mean, batch_var = batch_mean.mean(1), batch_var.mean(1)
            else:
                batch_mean, batch_var = batch_mean.squeeze(1), batch_var.squeeze(1)
        return out.reshape(k, n, width), batch_mean, batch_var


def update_before(params, grads, param_rows, active, lr, sq_avg, velocity, cfg, *, all_active=False, **_new_keywords):
    """e082aac's ``_update``."""
    stop = ~active
    neg_rate = torch.where(active, -lr, 0.0)
    kept = [i for i, g in enumerate(grads) if g is not None]
    ps = [params[i] for i in kept]
    gs = [grads[i] for i in kept]
    rows = [param_rows[i] for i in kept]
    if not all_active:
        for p, g, r in zip(ps, gs, rows):
            g.masked_fill_(_per_net(stop, p, r), 0.0)
    if cfg.weight_decay:
        torch._foreach_add_(gs, ps, alpha=cfg.weight_decay)
    ds = gs
    if cfg.optimizer == "rmsprop":
        sq = [sq_avg[i] for i in kept]
        torch._foreach_mul_(sq, cfg.rmsprop_alpha)
        torch._foreach_addcmul_(sq, gs, gs, value=1 - cfg.rmsprop_alpha)
        denom = torch._foreach_sqrt(sq)
        torch._foreach_add_(denom, cfg.rmsprop_eps)
        ds = torch._foreach_div(gs, denom)
    if cfg.momentum:
        vs = [velocity[i] for i in kept]
        torch._foreach_mul_(vs, cfg.momentum)
        torch._foreach_add_(vs, ds)
        ds = vs
    torch._foreach_addcmul_(ps, [_per_net(neg_rate, p, r) for p, r in zip(ps, rows)], ds)


@contextlib.contextmanager
def before_update():
    """The step calls ``_ensemble_step._update`` by its module name: swap in the old one meanwhile."""
    current = _ensemble_step._update
    _ensemble_step._update = update_before
    try:
        yield
    finally:
        _ensemble_step._update = current
