"""The trainable networks of bnlab: Yang et al.'s BN-MLP, MLPs with any normalization, the papers' CNNs.

* :class:`BNMLP` — the batch-normalized MLP of Yang et al. 2019, Eq. (7) (BN before φ, γ and β folded
  into φ, optional ghost-batch statistics); moved here from ``bnlab.sim.train`` with its numerics
  unchanged (``tests/regression`` holds a seeded training run recorded before the move).
* :class:`MLP` — Linear layers with a normalization chosen by name (:func:`~bnlab.nets.make_norm`)
  placed before (``"pre"``: Linear → Norm → φ) or after (``"post"``: Linear → φ → Norm) the
  nonlinearity, and an initialization chosen by name (:func:`~bnlab.nets.init_weights_`).
* :class:`FisherCNN`, :class:`BNPCNN`, :func:`vgg`, :func:`resnet` — see their docstrings.

Every model is deterministic given ``seed`` (a private ``torch.Generator``; no global random state).

The BN-MLP (Yang et al. 2019, Eq. 7)::

    h^1 = W^1 x,      h̃^l = BN(h^l),      h^{l+1} = W^{l+1} φ(γ h̃^l + β),
    logits = W^{out} φ(γ h̃^L + β) + b^{out},

with ``depth = L`` batch-normalized layers of ``width`` neurons, weights ``W^l_{αβ} ~ N(0, σ_w²/fan_in)``
and no hidden biases (a bias before BN is removed by the mean subtraction, so σ_b² = 0 loses nothing;
§3.1).  BN normalizes every neuron with the batch mean and the biased batch variance,
``BN(h)_α = (h_α − μ_α)/sqrt(σ_α² + ε)``.

Errata (Yang et al. 2019)
-------------------------
* Eq. (7) prints ``σ_α² = sqrt((1/N)Σ_i (h_αi − μ_α)² + ε)``; the square on σ_α is a typo — the
  normalization divides by ``σ_α = sqrt(var + ε)`` (checked against ``torch.nn.BatchNorm1d`` in
  ``tests/nets/test_models.py``).
* In the same line μ_α and σ_α are averages over "N_i"; these are averages over the batch index i
  (B samples), not over neurons.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from bnlab._validation import check_choice, check_int, check_real
from bnlab.activations import Activation, get_activation
from bnlab.nets.norms import ghost_batch_norm

__all__ = ["BNMLP"]


def _require_torch_phi(phi: Any, act: Activation) -> None:
    """ValueError naming ``phi`` when the resolved activation has no torch implementation."""
    try:
        act.torch(torch.zeros(1, dtype=torch.float64))
    except ValueError as exc:
        raise ValueError(f"phi={phi!r} is not allowed: {exc}") from None


class BNMLP(nn.Module):
    """Batch-normalized MLP of Yang et al. 2019, Eq. (7) (BN before φ).

    Parameters
    ----------
    in_features, num_classes:
        Input dimension and number of output classes.
    depth:
        Number L ≥ 1 of batch-normalized hidden layers.
    width:
        Neurons N per hidden layer.
    phi:
        Nonlinearity: a registry name or expression (see
        :func:`bnlab.activations.get_activation`, extra keyword arguments
        ``**phi_params`` go there) or an :class:`~bnlab.activations.Activation`.
    gamma, beta:
        BN scale and shift; the network computes φ(γ h̃ + β).  With an
        ``Activation`` that already carries γ, β leave these at 1 and 0.
    eps:
        ε ≥ 0 added to the batch variance (the paper uses 1e-3 in Fig. 3).
        ε = 0 divides by the raw batch standard deviation.
    sigma_w2:
        Weight variance σ_w²: W_{αβ} ~ N(0, σ_w²/fan_in).  Hidden layers are
        invariant to it through BN (§3.1), the readout is not.
    sub_batch_size:
        B of "ghost" batch statistics (Fig. 3b): None (the whole batch) or an
        integer ≥ 2 that divides every training batch.
    affine:
        ``"frozen"`` (γ, β are constants, as in the paper) or ``"trainable"``
        (per-neuron parameters initialized at γ, β).
    momentum:
        Momentum of the running statistics used in evaluation mode (as in
        ``torch.nn.BatchNorm1d``).
    seed:
        Seed of the weight initialization (a private ``torch.Generator``).
    dtype:
        Parameter dtype (float32 for training, float64 for exact checks).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        depth: int,
        width: int,
        phi: str | Activation = "relu",
        gamma: float = 1.0,
        beta: float = 0.0,
        eps: float = 1e-3,
        sigma_w2: float = 1.0,
        sub_batch_size: int | None = None,
        affine: str = "frozen",
        momentum: float = 0.1,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        **phi_params: Any,
    ):
        super().__init__()
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.num_classes = check_int("num_classes", num_classes, minimum=2)
        self.depth = check_int("depth", depth, minimum=1)
        self.width = check_int("width", width, minimum=1)
        self.gamma = check_real("gamma", gamma)
        self.beta = check_real("beta", beta)
        self.eps = check_real("eps", eps, minimum=0.0)
        self.sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
        self.affine = check_choice("affine", affine, ("frozen", "trainable"))
        self.momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0)
        seed = check_int("seed", seed, minimum=0)
        if sub_batch_size is not None:
            sub_batch_size = check_int("sub_batch_size", sub_batch_size, minimum=2)
        self.sub_batch_size = sub_batch_size
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype!r} is not allowed: expected torch.float32 or torch.float64")

        if isinstance(phi, Activation):
            if phi_params:
                raise ValueError(f"phi_params={phi_params!r} is not allowed with an Activation object for phi")
            if (gamma != 1.0 or beta != 0.0) and (phi.gamma != 1.0 or phi.beta != 0.0):
                raise ValueError(
                    f"gamma={gamma!r}, beta={beta!r} are not allowed together with an Activation that already "
                    f"has gamma={phi.gamma}, beta={phi.beta}: give them in one place"
                )
            if gamma == 1.0 and beta == 0.0:
                self.gamma, self.beta = phi.gamma, phi.beta
            base = dataclasses.replace(phi, gamma=1.0, beta=0.0)
        else:
            base = get_activation(phi, **phi_params)
        _require_torch_phi(phi, base)
        self.base_activation = base
        #: φ(γ·+β) with the constants folded in (the paper's convention).
        self.activation = base.with_affine(self.gamma, self.beta)

        gen = torch.Generator().manual_seed(seed)
        fan_in = [self.in_features] + [self.width] * (self.depth - 1)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(self.width, f, generator=gen, dtype=torch.float64).mul_(math.sqrt(self.sigma_w2 / f)).to(dtype))
            for f in fan_in
        )
        self.readout = nn.Linear(self.width, self.num_classes, dtype=dtype)
        with torch.no_grad():
            self.readout.weight.copy_(
                torch.randn(self.num_classes, self.width, generator=gen, dtype=torch.float64) * math.sqrt(self.sigma_w2 / self.width)
            )
            self.readout.bias.zero_()
        if self.affine == "trainable":
            self.bn_scale = nn.Parameter(torch.full((self.depth, self.width), self.gamma, dtype=dtype))
            self.bn_shift = nn.Parameter(torch.full((self.depth, self.width), self.beta, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(self.depth, self.width, dtype=dtype))
        self.register_buffer("running_var", torch.ones(self.depth, self.width, dtype=dtype))
        #: pre-activations h^l of the last forward with ``record=True`` (grads retained).
        self.recorded_preactivations: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return (
            f"depth={self.depth}, width={self.width}, phi={self.activation.spec}, eps={self.eps}, "
            f"sigma_w2={self.sigma_w2}, sub_batch_size={self.sub_batch_size}, affine={self.affine!r}"
        )

    def _normalize(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        if not self.training:
            return (h - self.running_mean[layer]) * torch.rsqrt(self.running_var[layer] + self.eps)
        n = h.shape[0]
        b = self.sub_batch_size
        if b is not None and n % b != 0:
            raise ValueError(
                f"batch of {n} samples is not allowed with sub_batch_size={b}: it must be a multiple of it"
            )
        if (b or n) < 2:
            raise ValueError(f"batch of {n} samples is not allowed in training mode: BN needs at least 2")
        out, mean, var = ghost_batch_norm(h, b, self.eps)
        with torch.no_grad():
            bb = b or n
            # as torch.nn.BatchNorm1d: running var is updated with the unbiased batch variance
            self.running_mean[layer].lerp_(mean.mean(0), self.momentum)
            self.running_var[layer].lerp_((var * (bb / (bb - 1))).mean(0), self.momentum)
        return out

    def forward(self, x: torch.Tensor, *, record: bool = False) -> torch.Tensor:
        """Logits for a batch ``x`` of shape (n, in_features) (or (n, C, H, W), flattened).

        ``record=True`` keeps the pre-activations h^l (before BN) with
        ``retain_grad`` in :attr:`recorded_preactivations`, for Fig. 4.
        """
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x with {x.shape[1]} features is not allowed: the model expects {self.in_features}")
        self.recorded_preactivations = []
        act = self.activation.torch if self.affine == "frozen" else self.base_activation.torch
        a = x
        for layer, w in enumerate(self.weights):
            h = a @ w.T
            if record:
                h.retain_grad()
                self.recorded_preactivations.append(h)
            n = self._normalize(h, layer)
            if self.affine == "trainable":
                n = n * self.bn_scale[layer] + self.bn_shift[layer]
            a = act(n)
        return self.readout(a)
