"""Train many networks of one architecture together, as one batched ensemble (torch.func + vmap).

For learning-rate phase diagrams (the Fisher paper, Fig. 2): networks that differ only in their
learning rate η, BN scale γ and seed are stacked (``torch.func.stack_module_state``) and trained with
one vmapped forward/backward per step on the same minibatches, with momentum SGD
(θ ← θ − η v, v ← μ v + ∇L, PyTorch's convention) and a per-network η.

BN runs on batch statistics (train mode) without tracking running statistics (vmap cannot update
buffers in place); the test loss is therefore evaluated with batch statistics too, on test batches
of ``eval_batch_size`` (default 1000 — large enough that batch and population statistics agree to
O(1/√1000)). A network has exploded when its loss becomes non-finite or exceeds ``explode_loss``
(default 1e3, against ln 10 ≈ 2.3 at chance); it keeps training (NaNs stay within its slice of the
ensemble) and is reported as exploded.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bnlab._validation import check_int, check_real

__all__ = ["EnsembleTrainResult", "train_ensemble"]


@dataclass(frozen=True)
class EnsembleTrainResult:
    """Per network (in the order of ``configs``): final test loss, exploded flag, step of explosion."""

    configs: tuple
    test_loss: tuple
    exploded: tuple
    exploded_at: tuple
    steps: int

    def to_dict(self) -> dict:
        return dict(
            configs=[dict(c) for c in self.configs],
            test_loss=[None if not math.isfinite(v) else float(v) for v in self.test_loss],
            exploded=list(self.exploded),
            exploded_at=list(self.exploded_at),
            steps=self.steps,
        )


def _batch_stat_copy(model):
    import torch

    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            mod.track_running_stats = False
            mod.running_mean = mod.running_var = None
            mod.num_batches_tracked = None
    return m.train()


def train_ensemble(
    arch,
    configs: Sequence[dict],
    train_x,
    train_y,
    test_x,
    test_y,
    *,
    norm: str = "bn",
    phi="relu",
    sigma_w2: float = 2.0,
    sigma_b2: float = 0.5,
    momentum: float = 0.9,
    steps: int = 200,
    batch_size: int = 64,
    data_seed: int = 0,
    explode_loss: float = 1e3,
    eval_batch_size: int = 1000,
) -> EnsembleTrainResult:
    """Train one network per config ``{"eta": η, "gamma": γ, "seed": s}`` together (module docstring)."""
    import torch
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    from .models import build_model

    if not configs:
        raise ValueError("configs=[] is not allowed: expected at least one {'eta', 'gamma', 'seed'}")
    steps = check_int("steps", steps, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=2)
    mu = check_real("momentum", momentum, minimum=0.0)
    if mu >= 1:
        raise ValueError(f"momentum={mu!r} is not allowed: expected 0 <= momentum < 1")
    etas = []
    models = []
    for i, c in enumerate(configs):
        etas.append(check_real(f"configs[{i}]['eta']", c["eta"], minimum=0.0, strict_minimum=True))
        m = build_model(arch, norm=norm, phi=phi, gamma=c.get("gamma", 1.0), sigma_w2=sigma_w2,
                        sigma_b2=sigma_b2, seed=int(c.get("seed", 0)))
        models.append(_batch_stat_copy(m))
    base = copy.deepcopy(models[0]).to("meta")
    params, _ = stack_module_state(models)
    params = {k: v.detach() for k, v in params.items()}
    velocity = {k: torch.zeros_like(v) for k, v in params.items()}
    n_models = len(models)
    eta = torch.tensor(etas, dtype=next(iter(params.values())).dtype)

    def loss_one(p, x, y):
        return torch.nn.functional.cross_entropy(functional_call(base, p, (x,)), y)

    step_fn = vmap(grad_and_value(loss_one), in_dims=(0, None, None))
    gen = torch.Generator().manual_seed(check_int("data_seed", data_seed, minimum=0))
    n = train_x.shape[0]
    exploded_at = [-1] * n_models
    for step in range(steps):
        idx = torch.randint(0, n, (batch_size,), generator=gen)
        grads, losses = step_fn(params, train_x[idx], train_y[idx])
        bad = (~torch.isfinite(losses)) | (losses > explode_loss)
        for i in torch.nonzero(bad).flatten().tolist():
            if exploded_at[i] < 0:
                exploded_at[i] = step
        with torch.no_grad():
            for k in params:
                shape = (n_models,) + (1,) * (params[k].ndim - 1)
                velocity[k].mul_(mu).add_(grads[k])
                params[k] = params[k] - eta.reshape(shape) * velocity[k]
    eval_fn = vmap(lambda p, x, y: loss_one(p, x, y), in_dims=(0, None, None))
    total = torch.zeros(n_models, dtype=eta.dtype)
    count = 0
    with torch.no_grad():
        for start in range(0, test_x.shape[0], eval_batch_size):
            xb, yb = test_x[start : start + eval_batch_size], test_y[start : start + eval_batch_size]
            if xb.shape[0] < 2:
                continue
            total += eval_fn(params, xb, yb) * xb.shape[0]
            count += xb.shape[0]
    test_loss = (total / max(count, 1)).tolist()
    exploded = tuple(bool(exploded_at[i] >= 0 or not np.isfinite(test_loss[i])) for i in range(n_models))
    return EnsembleTrainResult(
        configs=tuple(dict(c) for c in configs),
        test_loss=tuple(float(v) for v in test_loss),
        exploded=exploded,
        exploded_at=tuple(exploded_at),
        steps=steps,
    )
