"""The trainable networks of bnlab: Yang et al.'s BN-MLP, MLPs with any normalization, the papers' CNNs.

* :class:`BNMLP` — the batch-normalized MLP of Yang et al. 2019, Eq. (7) (BN before φ, γ and β folded
  into φ, optional ghost-batch statistics); moved here from ``bnlab.sim.train`` with its numerics
  unchanged (``tests/regression`` holds a seeded training run recorded before the move).
* :class:`MLP` — Linear layers with a normalization chosen by name (:func:`~bnlab.nets.make_norm`)
  placed before (``"pre"``: Linear → Norm → φ) or after (``"post"``: Linear → φ → Norm) the
  nonlinearity, and an initialization chosen by name (:func:`~bnlab.nets.init_weights_`).
* :class:`FisherCNN` (the Fisher paper's three stride-2 convolutions + FC), :class:`BNPCNN` (Lange et
  al.'s 5-layer CNN), :func:`vgg` and :func:`resnet` (VGG-11/13/16/19, ResNet-18/34 and the CIFAR
  ResNets 20…110, normalization by name) — see their docstrings.
* :func:`feedforward` — the mean field ensemble's conv/FC networks (the Fisher paper's; under
  :func:`bnlab.fisher.build_model`).  ``FisherCNN``, ``BNPCNN`` and ``feedforward`` build their
  convolutions with one conv-stack builder (``_conv_stack``).

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
from typing import Any, NamedTuple

import torch
from torch import nn

from bnlab._validation import (DEFAULT_MAX_MEMORY_BYTES, check_choice, check_int, check_memory, check_real, check_seed,
                               per_layer)
from bnlab._vocabulary import INIT_ALIASES, NORM_ALIASES, canonical_value
from bnlab.activations import Activation, get_activation
from bnlab.nets.norms import ghost_batch_norm

__all__ = ["BNMLP", "ActivationModule", "MLP", "FisherCNN", "BNPCNN", "feedforward", "vgg", "resnet", "BasicBlock",
           "PreActBlock", "Bottleneck", "PLACEMENTS", "VGG_DEPTHS", "RESNET_DEPTHS"]


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
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
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
        seed = check_seed("seed", seed)
        if sub_batch_size is not None:
            sub_batch_size = check_int("sub_batch_size", sub_batch_size, minimum=2)
        self.sub_batch_size = sub_batch_size
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype!r} is not allowed: expected torch.float32 or torch.float64")
        _check_scales(dtype, sigma_w2=self.sigma_w2, gamma=self.gamma, beta=self.beta)
        w = self.width
        # the weights are drawn in float64 and cast: 8 + itemsize bytes per parameter at the peak
        _check_parameters(f"BNMLP(depth={self.depth}, width={w})",
                          self.in_features * w + (self.depth - 1) * w * w + (w + 1) * self.num_classes,
                          8 + torch.finfo(dtype).bits // 8, max_memory_bytes)

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


# =============================================================================== general models

#: Where :class:`MLP` puts the normalization: before φ (Linear → Norm → φ) or after (Linear → φ → Norm).
PLACEMENTS = ("pre", "post")

#: Default σ_w² per initialization scheme when ``sigma_w2=None``: He's 2 for ReLU nets under the
#: variance-preserving schemes, the schemes' own scale (gain 1) for Glorot and Daneshmand's uniform.
_DEFAULT_SIGMA_W2 = {"gaussian": 2.0, "orthogonal": 2.0, "glorot_uniform": 1.0, "asymmetric_uniform": 1.0,
                     "torch_default": 1.0}


class ActivationModule(nn.Module):
    """φ as an ``nn.Module``: resolved once to a :class:`bnlab.activations.Activation`, applied with its
    ``.torch`` (so named, expression and callable activations all work in ``nn.Sequential``)."""

    def __init__(self, phi: str | Activation = "relu", **phi_params: Any):
        super().__init__()
        self.activation = get_activation(phi, **phi_params)
        _require_torch_phi(phi, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation.torch(x)

    def extra_repr(self) -> str:
        return self.activation.spec


def _check_dtype(dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype={dtype!r} is not allowed: expected torch.float32 or torch.float64")
    return dtype


def _norm_kwargs(norm_kwargs) -> dict:
    if norm_kwargs is None:
        return {}
    if not isinstance(norm_kwargs, dict):
        raise ValueError(f"norm_kwargs={norm_kwargs!r} is not allowed: expected a dict of make_norm arguments")
    bad = {"name", "num_features", "dims", "dtype", "device"} & set(norm_kwargs)
    if bad:
        raise ValueError(f"norm_kwargs={norm_kwargs!r} is not allowed: {sorted(bad)} are set by the model")
    return dict(norm_kwargs)


def _init_all(model: nn.Module, init: str, sigma_w2: float | None, sigma_b2: float, seed: int) -> None:
    from bnlab.nets.init import INITS, init_weights_

    init = check_choice("init", canonical_value("init", init, INIT_ALIASES), INITS)
    if init == "torch_default":
        if sigma_w2 is not None or sigma_b2 != 0.0:
            raise ValueError(
                f"sigma_w2={sigma_w2}, sigma_b2={sigma_b2} are not allowed with init='torch_default' "
                "(it has its own scales)"
            )
        init_weights_(model, init, generator=torch.Generator().manual_seed(seed))
        return
    sw2 = _DEFAULT_SIGMA_W2[init] if sigma_w2 is None else sigma_w2
    init_weights_(model, init, sigma_w2=sw2, sigma_b2=sigma_b2, generator=torch.Generator().manual_seed(seed))


def _set_affine(norms: list[nn.Module], gamma: float, beta: float, norm: str) -> None:
    """Initial weight γ and bias β of every normalization layer (the Fisher paper's BN parameter γ)."""
    if gamma == 1.0 and beta == 0.0:
        return
    for layer in norms:
        if getattr(layer, "weight", None) is None:
            raise ValueError(
                f"gamma={gamma}, beta={beta} are not allowed with norm={norm!r} without affine parameters"
            )
        with torch.no_grad():
            layer.weight.fill_(gamma)
            layer.bias.fill_(beta)


def _check_scales(dtype, **values) -> None:
    """Variances (σ_w², σ_b²) at most √max and affine constants (γ, β) at most max^¼ of the dtype in magnitude.

    A normalization squares the pre-activations these scale (the batch variance), so larger values make a
    forward pass overflow to inf/NaN whatever the data (``BNMLP(gamma=1e308)`` output NaN); the bounds
    leave √max of headroom for the batch and the widths.
    """
    big = float(torch.finfo(dtype).max)
    for name, v in values.items():
        if v is None:
            continue
        bound = big**0.5 if name.startswith("sigma") else big**0.25
        if abs(v) > bound:
            raise ValueError(
                f"{name}={v!r} is not allowed in {str(dtype).replace('torch.', '')}: at most {bound:.3g} in magnitude "
                "(the normalization squares the pre-activations it scales, which would overflow)"
            )


def _check_parameters(what: str, n_params: float, itemsize: int, max_memory_bytes) -> None:
    check_memory(f"{what} ({n_params:.3g} parameters)", n_params * itemsize, max_memory_bytes,
                 hint="use fewer or narrower layers, or raise max_memory_bytes")


def _common_args(norm, init, sigma_w2, sigma_b2, gamma, beta, seed, dtype, norm_kwargs):
    from bnlab.nets.norms import NORMALIZATIONS

    # an old spelling ("batch", "bn-nomean") is checked here and warned about once, by make_norm
    check_choice("norm", NORM_ALIASES.get(norm, norm) if isinstance(norm, str) else norm, NORMALIZATIONS)
    dtype = _check_dtype(dtype)
    if sigma_w2 is not None:
        sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    sigma_b2 = check_real("sigma_b2", sigma_b2, minimum=0.0)
    gamma = check_real("gamma", gamma)
    beta = check_real("beta", beta)
    _check_scales(dtype, sigma_w2=sigma_w2, sigma_b2=sigma_b2, gamma=gamma, beta=beta)
    seed = check_seed("seed", seed)
    return sigma_w2, sigma_b2, gamma, beta, seed, dtype, _norm_kwargs(norm_kwargs)


class MLP(nn.Module):
    """A fully connected network with a normalization chosen by name before or after φ.

    ``placement="pre"``: each hidden layer is Linear → Norm → φ (BN before the nonlinearity, as in
    Yang et al. 2019 Eq. 7 and Ioffe & Szegedy 2015; Lange et al. call it "pre-activation BN");
    ``"post"``: Linear → φ → Norm (Lange et al., Eq. 2).  A Linear readout follows the last hidden layer.

    Parameters
    ----------
    in_features, widths, num_classes:
        Input size (inputs are flattened per sample), hidden widths (one per hidden layer, ≥ 1 layer),
        outputs.
    phi:
        φ: a registry name, expression or :class:`~bnlab.activations.Activation`, resolved once
        (:func:`bnlab.activations.get_activation`).
    norm, norm_kwargs:
        A name of :data:`~bnlab.nets.NORMALIZATIONS` and extra :func:`~bnlab.nets.make_norm` arguments
        (``eps``, ``momentum``, ``affine``, ``ghost_batch_size``, ``num_groups``, Batch Renorm's limits).
    placement:
        ``"pre"`` or ``"post"``.
    init, sigma_w2, sigma_b2:
        An :data:`~bnlab.nets.INITS` scheme for every Linear layer (readout included) and its scales;
        ``sigma_w2=None`` takes the scheme's default (2 for gaussian/orthogonal, 1 for glorot_uniform and
        asymmetric_uniform; torch_default takes none).
    gamma, beta:
        Initial weight and bias of every normalization layer (the BN parameters γ, β of the mean field
        papers); they need a normalization with affine parameters unless 1 and 0.
    bias:
        Whether the Linear layers have biases.
    seed, dtype:
        Seed of the initialization (a private ``torch.Generator``), parameter dtype.

    Attributes
    ----------
    blocks:
        ``nn.ModuleList`` of one ``nn.Sequential`` per hidden layer, in forward order.
    hidden_layers, norms:
        The hidden ``nn.Linear`` layers and the normalization layers, in order.
    readout:
        The output ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        widths,
        num_classes: int,
        *,
        phi: str | Activation = "relu",
        norm: str = "bn",
        placement: str = "pre",
        init: str = "gaussian",
        sigma_w2: float | None = None,
        sigma_b2: float = 0.0,
        gamma: float = 1.0,
        beta: float = 0.0,
        bias: bool = True,
        norm_kwargs: dict | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ):
        super().__init__()
        self.in_features = check_int("in_features", in_features, minimum=1)
        self.num_classes = check_int("num_classes", num_classes, minimum=1)
        if isinstance(widths, (str, bytes)):
            raise ValueError(f"widths={widths!r} is not allowed: expected a sequence of positive integers")
        try:
            widths = [check_int("widths", w, minimum=1) for w in widths]
        except TypeError:
            raise ValueError(f"widths={widths!r} is not allowed: expected a sequence of positive integers") from None
        if not widths:
            raise ValueError("widths=[] is not allowed: expected at least one hidden layer")
        self.widths = widths
        self.norm = norm
        self.placement = check_choice("placement", placement, PLACEMENTS)
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} is not allowed: expected True or False")
        sigma_w2, sigma_b2, gamma, beta, seed, dtype, nkw = _common_args(
            norm, init, sigma_w2, sigma_b2, gamma, beta, seed, dtype, norm_kwargs)
        fans = [self.in_features, *widths]
        _check_parameters(f"MLP(widths={widths})",
                          sum((a + 5) * b for a, b in zip(fans[:-1], fans[1:])) + (fans[-1] + 1) * self.num_classes,
                          torch.finfo(dtype).bits // 8, max_memory_bytes)
        from bnlab.nets.norms import make_norm

        self.phi = ActivationModule(phi)
        blocks = []
        fan_in = self.in_features
        for w in widths:
            lin = nn.Linear(fan_in, w, bias=bias, dtype=dtype)
            nrm = make_norm(norm, w, dims=1, dtype=dtype, **nkw)
            order = (lin, nrm, self.phi) if placement == "pre" else (lin, self.phi, nrm)
            blocks.append(nn.Sequential(*order))
            fan_in = w
        self.blocks = nn.ModuleList(blocks)
        self.readout = nn.Linear(fan_in, self.num_classes, bias=bias, dtype=dtype)
        _init_all(self, init, sigma_w2, sigma_b2, seed)
        _set_affine(self.norms, gamma, beta, norm)

    @property
    def hidden_layers(self) -> list[nn.Linear]:
        return [b[0] for b in self.blocks]

    @property
    def norms(self) -> list[nn.Module]:
        return [b[1] if self.placement == "pre" else b[2] for b in self.blocks]

    def forward_hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits, [output of each hidden layer]) — the representations H^l the rank part measures."""
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"x with {x.shape[1]} features is not allowed: the model expects {self.in_features}")
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return self.readout(x), hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_hidden(x)[0]


def _as_shape(in_shape) -> tuple[int, int, int]:
    try:
        shape = tuple(check_int("in_shape", s, minimum=1) for s in in_shape)
    except TypeError:
        shape = ()
    if len(shape) != 3:
        raise ValueError(f"in_shape={in_shape!r} is not allowed: expected (channels, height, width)")
    return shape


def _conv_out(size: int, kernel: int, stride: int, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _as_channels(channels, count: int | None = None) -> list[int]:
    """``channels`` as a list of positive ints: ``count`` of them, or at least one when ``count`` is None."""
    try:
        out = [check_int("channels", c, minimum=1) for c in channels]
    except TypeError:
        raise ValueError(f"channels={channels!r} is not allowed: expected a sequence of integers") from None
    if count is None and not out:
        raise ValueError("channels=[] is not allowed: expected at least one convolution")
    if count is not None and len(out) != count:
        raise ValueError(f"channels={channels!r} is not allowed: expected {count} channel counts")
    return out


class _Conv(NamedTuple):
    """One convolution of a conv stack: ``channels`` outputs, square ``kernel``, ``stride``, zero ``padding``,
    then ``pool``×``pool`` max pooling (1: none)."""

    channels: int
    kernel: int
    stride: int = 1
    padding: int = 0
    pool: int = 1


def _conv_stack_size(in_shape: tuple[int, int, int], convs, given, what: str) -> tuple[int, tuple[int, int, int]]:
    """(parameters of the stack, output shape (C, H, W)) of :func:`_conv_stack`, before anything is built.

    The count allows 4 per channel for a normalization layer.  An input too small for the stack is a
    ``ValueError`` naming ``in_shape`` (as ``given``) and ``what`` the stack is.
    """
    n_params, (c, h, w) = 0, in_shape
    for conv in convs:
        n_params += (c * conv.kernel**2 + 5) * conv.channels
        c = conv.channels
        h, w = _conv_out(h, conv.kernel, conv.stride, conv.padding), _conv_out(w, conv.kernel, conv.stride, conv.padding)
        if h >= 1 and w >= 1 and conv.pool > 1:
            h, w = h // conv.pool, w // conv.pool
        if h < 1 or w < 1:
            raise ValueError(f"in_shape={given!r} is not allowed: too small for {what}")
    return n_params, (c, h, w)


def _conv_stack(in_channels: int, convs, norm: str, make_phi, dtype, nkw: dict, *,
                omit_identity: bool = False) -> tuple[list[nn.Module], list[nn.Module]]:
    """The layers Conv2d → Norm → φ [→ MaxPool] of every convolution in ``convs``, and the norm layers.

    The one conv-stack builder of :class:`FisherCNN`, :class:`BNPCNN` and :func:`feedforward`;
    ``make_phi()`` gives the φ module of each layer (one shared module, or one per layer), and
    ``omit_identity`` leaves out the ``nn.Identity`` of ``norm="none"``.  Weights are the PyTorch
    default (drawn from the global generator, as ``nn.Conv2d`` does); the callers initialize them.
    """
    from bnlab.nets.norms import make_norm

    layers, norms, c_in = [], [], in_channels
    for conv in convs:
        layers.append(nn.Conv2d(c_in, conv.channels, conv.kernel, stride=conv.stride, padding=conv.padding,
                                dtype=dtype))
        if not (omit_identity and norm == "none"):
            nrm = make_norm(norm, conv.channels, dims=2, dtype=dtype, **nkw)
            layers.append(nrm)
            norms.append(nrm)
        layers.append(make_phi())
        if conv.pool > 1:
            layers.append(nn.MaxPool2d(conv.pool))
        c_in = conv.channels
    return layers, norms


class _ConvNet(nn.Module):
    """Shared construction and forward of the small CNNs: features → flatten → head, with input-shape checks."""

    def _set_features(self, convs, feature_shape, norm: str, phi, dtype, nkw: dict) -> list[nn.Module]:
        """``.features`` (:func:`_conv_stack` of ``convs`` with one shared φ module ``.phi``), ``.norm`` and
        ``.feature_shape``; returns the stack's normalization layers."""
        self.norm = norm
        self.phi = ActivationModule(phi)
        layers, norms = _conv_stack(self.in_shape[0], convs, norm, lambda: self.phi, dtype, nkw)
        self.features = nn.Sequential(*layers)
        self.feature_shape = feature_shape
        return norms

    def _check_x(self, x: torch.Tensor) -> None:
        if x.ndim == 2 and x.shape[1] == math.prod(self.in_shape):
            return
        if x.ndim != 4 or tuple(x.shape[1:]) != self.in_shape:
            raise ValueError(
                f"x of shape {tuple(x.shape)} is not allowed: the model expects "
                f"(N, {', '.join(map(str, self.in_shape))})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_x(x)
        x = x.reshape(x.shape[0], *self.in_shape)
        return self.head(self.features(x).flatten(1))


class FisherCNN(_ConvNet):
    """The convolutional network of the mean field Fisher-information paper (§4, "Experiments").

    "The first three are convolutional layers with filter size 3, stride 2, and number of channels
    C1 = 30, C2 = 60, C3 = 90.  The final layer is a fully connected output layer"; BN "after each linear
    operation except for the final linear output layer"; ReLU; σ_w² = 2, σ_b² = 0.5 (Gaussian init), β = 0
    and the BN parameter γ swept.  No padding (the paper's Supplementary §6.2 example: 32×32 CIFAR-10
    input, 3×3 kernels, stride 2 → 15×15 = 225 positions).  So for CIFAR-10: 32 → 15 → 7 → 3 and the
    FC layer has 90·9 = 810 inputs; for MNIST (1, 28, 28): 28 → 13 → 6 → 2.

    Each layer is Conv2d → Norm → φ (``norm="none"`` gives the paper's vanilla net).  ``gamma``, ``beta``
    initialize the normalization's affine weight and bias.  Inputs (N, C, H, W) (or flat (N, C·H·W)).
    """

    def __init__(
        self,
        in_shape=(3, 32, 32),
        num_classes: int = 10,
        *,
        channels=(30, 60, 90),
        kernel_size: int = 3,
        stride: int = 2,
        phi: str | Activation = "relu",
        norm: str = "bn",
        init: str = "gaussian",
        sigma_w2: float | None = 2.0,
        sigma_b2: float = 0.5,
        gamma: float = 1.0,
        beta: float = 0.0,
        norm_kwargs: dict | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ):
        super().__init__()
        self.in_shape = _as_shape(in_shape)
        self.num_classes = check_int("num_classes", num_classes, minimum=1)
        channels = _as_channels(channels)
        kernel_size = check_int("kernel_size", kernel_size, minimum=1)
        stride = check_int("stride", stride, minimum=1)
        sigma_w2, sigma_b2, gamma, beta, seed, dtype, nkw = _common_args(
            norm, init, sigma_w2, sigma_b2, gamma, beta, seed, dtype, norm_kwargs)
        convs = [_Conv(c, kernel_size, stride) for c in channels]
        n_params, (c, h, w) = _conv_stack_size(self.in_shape, convs, in_shape,
                                               f"{len(channels)} stride-{stride} convolutions of kernel {kernel_size}")
        _check_parameters("FisherCNN", n_params + (c * h * w + 1) * self.num_classes,
                          torch.finfo(dtype).bits // 8, max_memory_bytes)
        self.norms = self._set_features(convs, (c, h, w), norm, phi, dtype, nkw)
        self.head = nn.Linear(c * h * w, self.num_classes, dtype=dtype)
        _init_all(self, init, sigma_w2, sigma_b2, seed)
        _set_affine(self.norms, gamma, beta, norm)


class BNPCNN(_ConvNet):
    """The 5-layer CNN of Lange et al. (BNP, §5 "Convolutional Neural Networks"; TensorFlow's CNN tutorial).

    "3 convolution layers, each with a 3×3 kernel, of filter size 32-64-32, followed by two dense
    layers": Conv(32) → Norm → φ → MaxPool 2 → Conv(64) → Norm → φ → MaxPool 2 →
    Conv(32) → Norm → φ → Dense(``hidden`` = 64) → Norm → φ → Dense(num_classes), valid convolutions as in the tutorial,
    Glorot-uniform weights and zero biases (Appendix B).  For CIFAR-10: 32 → 30 → 15 → 13 → 6 → 4, so the
    first dense layer has 4·4·32 = 512 inputs (71,338 parameters without normalization).

    Errata: the TensorFlow (2019) tutorial the paper cites uses 32-64-**64** filters (122,570
    parameters); the paper writes 32-64-32.  ``channels=(32, 64, 64)`` gives the tutorial's network.
    Where the normalization goes is not stated; here after every convolution and the hidden dense layer.
    """

    def __init__(
        self,
        in_shape=(3, 32, 32),
        num_classes: int = 10,
        *,
        channels=(32, 64, 32),
        hidden: int = 64,
        kernel_size: int = 3,
        phi: str | Activation = "relu",
        norm: str = "bn",
        init: str = "glorot_uniform",
        sigma_w2: float | None = None,
        sigma_b2: float = 0.0,
        norm_kwargs: dict | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ):
        super().__init__()
        from bnlab.nets.norms import make_norm

        self.in_shape = _as_shape(in_shape)
        self.num_classes = check_int("num_classes", num_classes, minimum=1)
        channels = _as_channels(channels, 3)
        hidden = check_int("hidden", hidden, minimum=1)
        kernel_size = check_int("kernel_size", kernel_size, minimum=1)
        sigma_w2, sigma_b2, _, _, seed, dtype, nkw = _common_args(
            norm, init, sigma_w2, sigma_b2, 1.0, 0.0, seed, dtype, norm_kwargs)
        convs = [_Conv(c, kernel_size, pool=2 if i < 2 else 1) for i, c in enumerate(channels)]
        n_params, (c, h, w) = _conv_stack_size(self.in_shape, convs, in_shape, "the 5-layer CNN")
        _check_parameters("BNPCNN", n_params + (c * h * w + 5) * hidden + (hidden + 1) * self.num_classes,
                          torch.finfo(dtype).bits // 8, max_memory_bytes)
        norms = self._set_features(convs, (c, h, w), norm, phi, dtype, nkw)
        nrm = make_norm(norm, hidden, dims=1, dtype=dtype, **nkw)
        norms.append(nrm)
        self.head = nn.Sequential(nn.Linear(c * h * w, hidden, dtype=dtype), nrm, self.phi,
                                  nn.Linear(hidden, self.num_classes, dtype=dtype))
        self.norms = norms
        _init_all(self, init, sigma_w2, sigma_b2, seed)


def _as_layers(in_shape, layers) -> tuple[tuple[int, ...], list]:
    """``in_shape`` and ``layers`` of :func:`feedforward` checked: (shape, [_Conv or width int])."""
    try:
        shape = tuple(check_int("in_shape", s, minimum=1) for s in in_shape)
    except TypeError:
        shape = ()
    if len(shape) not in (1, 3):
        raise ValueError(f"in_shape={in_shape!r} is not allowed: expected (features,) or (channels, height, width)")
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__") or not len(layers):
        raise ValueError(f"layers={layers!r} is not allowed: expected a non-empty sequence of ('conv', channels, "
                         "kernel, stride, padding) and ('fc', width) tuples")
    out, fc_seen = [], False
    for item in layers:
        kind = item[0] if isinstance(item, (tuple, list)) and item else None
        if kind == "fc" and len(item) == 2:
            out.append(check_int("width", item[1], minimum=1))
            fc_seen = True
        elif kind == "conv" and len(item) == 5 and len(shape) == 3 and not fc_seen:
            out.append(_Conv(check_int("channels", item[1], minimum=1), check_int("kernel", item[2], minimum=1),
                             check_int("stride", item[3], minimum=1), check_int("padding", item[4], minimum=0)))
        else:
            raise ValueError(f"layers item {item!r} is not allowed: expected ('conv', channels, kernel, stride, padding) "
                             "before any ('fc', width), convolutions only on a (channels, height, width) input")
    return shape, out


def feedforward(
    in_shape,
    layers,
    *,
    norm: str = "bn",
    phi: str | Activation = "relu",
    gamma=1.0,
    beta=0.0,
    sigma_w2=2.0,
    sigma_b2=0.5,
    seed: int = 0,
    dtype=None,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
) -> nn.Sequential:
    """A random network of the mean field ensemble: Conv2d/Linear layers, Norm → φ after all but the last.

    The Fisher paper's networks (§3, Eqs. 11–16 and 26–28; :func:`bnlab.fisher.build_model` builds them
    from its architecture specs through this function).  ``layers`` is a sequence of
    ``("conv", channels, kernel, stride, padding)`` (first, on an input of shape (C, H, W)) and
    ``("fc", width)``; an ``nn.Flatten`` precedes the first Linear layer after convolutions.  The
    convolutions are built by the same conv-stack builder as :class:`FisherCNN` and :class:`BNPCNN`.
    Each layer ℓ has W ~ N(0, σ_w,ℓ²/fan_in) and b ~ N(0, σ_b,ℓ²), drawn weight then bias, layer by
    layer, from one ``torch.Generator`` seeded with ``seed``; each normalization has weight γ_ℓ and
    bias β_ℓ.  ``gamma``, ``beta`` (one per hidden layer) and ``sigma_w2``, ``sigma_b2`` (one per
    layer) are scalars or per-layer lists.  ``norm="none"`` leaves the norm layers out (no
    ``nn.Identity``); φ is one ``ActivationModule`` per hidden layer, resolved once.

    Refused before anything is allocated: parameters that need more than ``max_memory_bytes``
    (default 1 GiB), and scales whose forward pass overflows ``dtype`` (any floating dtype; default
    ``torch.get_default_dtype()``) however the data look — σ_w², σ_b² above √max and |γ|, |β| above
    max^¼ (a normalization squares the pre-activations these scale).
    """
    from bnlab.nets.norms import NORMALIZATIONS, make_norm

    shape, specs = _as_layers(in_shape, layers)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), NORMALIZATIONS)
    seed = check_seed("seed", seed)
    n_layers = len(specs)
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not allowed: expected a floating torch.dtype such as torch.float64")
    sw2 = [check_real("sigma_w2", v, minimum=0.0, strict_minimum=True) for v in per_layer("sigma_w2", sigma_w2, n_layers)]
    sb2 = [check_real("sigma_b2", v, minimum=0.0) for v in per_layer("sigma_b2", sigma_b2, n_layers)]
    gam = [check_real("gamma", v) for v in per_layer("gamma", gamma, n_layers - 1)]
    bet = [check_real("beta", v) for v in per_layer("beta", beta, n_layers - 1)]
    for name, values in (("sigma_w2", sw2), ("sigma_b2", sb2), ("gamma", gam), ("beta", bet)):
        for v in values:
            _check_scales(dtype, **{name: v})
    convs = [s for s in specs if isinstance(s, _Conv)]
    widths = specs[len(convs):]
    n_params, (c, h, w) = (_conv_stack_size(shape, convs, in_shape, f"{len(convs)} convolutions") if convs
                           else (0, (shape[0], 1, 1)))
    fans = [c * h * w, *widths]
    n_params += sum((a + 5) * b for a, b in zip(fans[:-1], fans[1:]))
    _check_parameters(f"feedforward(in_shape={shape}, {n_layers} layers)", n_params,
                      torch.empty((), dtype=dtype).element_size(), max_memory_bytes)

    act = get_activation(phi)
    _require_torch_phi(phi, act)
    hidden_convs = convs if widths else convs[:-1]
    mods, norms = _conv_stack(shape[0], hidden_convs, norm, lambda: ActivationModule(act), dtype, {},
                              omit_identity=True)
    if not widths:  # the last layer is a convolution: no Norm → φ after it
        last = convs[-1]
        mods.append(nn.Conv2d(hidden_convs[-1].channels if hidden_convs else shape[0], last.channels, last.kernel,
                              stride=last.stride, padding=last.padding, dtype=dtype))
    elif convs:
        mods.append(nn.Flatten())
    for i, (fan, width) in enumerate(zip(fans[:-1], fans[1:])):
        mods.append(nn.Linear(fan, width, dtype=dtype))
        if i == len(widths) - 1:
            break
        if norm != "none":
            nrm = make_norm(norm, width, dims=1, dtype=dtype)
            mods.append(nrm)
            norms.append(nrm)
        mods.append(ActivationModule(act))
    gen = torch.Generator().manual_seed(seed)
    lins = [m for m in mods if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        for lin, s_w2, s_b2 in zip(lins, sw2, sb2):
            fan_in = math.prod(lin.weight.shape[1:])
            # randn · scale, not normal_(0, std): the draws of the ensemble as first recorded (bit for bit)
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen, dtype=dtype) * math.sqrt(s_w2 / fan_in))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen, dtype=dtype) * math.sqrt(s_b2))
    _set_affineper_layer(norms, gam, bet, norm)
    model = nn.Sequential(*mods)
    model.norms = norms
    return model


def _set_affineper_layer(norms: list[nn.Module], gamma: list[float], beta: list[float], norm: str) -> None:
    for layer, g, b in zip(norms, gamma, beta):
        _set_affine([layer], g, b, norm)


# ------------------------------------------------------------------------------- VGG / ResNet
_VGG_CFG = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}
#: Depths :func:`vgg` builds (configurations A, B, D, E of Simonyan & Zisserman 2015, Table 1).
VGG_DEPTHS = tuple(_VGG_CFG)
#: Depths :func:`resnet` builds: CIFAR ResNets 6n+2 (He et al. 2016, §4.2), ResNet-18/34 and ResNet-50
#: (Table 1).
RESNET_DEPTHS = (18, 20, 32, 34, 44, 50, 56, 110)


class _Sequential(nn.Sequential):
    """``nn.Sequential`` with the list of its normalization layers and its input shape check."""

    def __init__(self, *layers, norms=(), in_channels: int = 3):
        super().__init__(*layers)
        self.norms = list(norms)
        self.in_channels = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"x of shape {tuple(x.shape)} is not allowed: expected (N, {self.in_channels}, H, W)")
        return super().forward(x)


def vgg(
    depth: int = 16,
    num_classes: int = 10,
    *,
    norm: str = "bn",
    in_channels: int = 3,
    phi: str | Activation = "relu",
    init: str = "gaussian",
    sigma_w2: float | None = None,
    norm_kwargs: dict | None = None,
    width_multiplier: float = 1.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
) -> nn.Sequential:
    """VGG-``depth`` for 32×32 inputs (Simonyan & Zisserman 2015, Table 1, configurations A/B/D/E).

    3×3 convolutions with padding 1 → Norm → φ, 2×2 max pooling after each stage, then — as the usual
    CIFAR adaptation — global average pooling of the 1×1 map and one Linear(512, num_classes) (instead
    of the three 4096-wide layers for ImageNet).  With ``norm="bn"`` VGG-16 has 14,728,266 parameters.
    Convolutions have biases (as the original).  Returns an ``nn.Sequential`` with ``.norms``.

    ``width_multiplier`` α > 0 scales every layer's channel count to max(1, round(α·c)) (as MobileNet's
    width multiplier; Howard et al. 2017, §3.3), e.g. α = 1/8 gives 8…64 channels — the same depth and
    layout at ~1/64 of the convolutions' cost, for CPU-scale experiments.
    """
    from bnlab.nets.norms import make_norm

    depth = check_choice("depth", depth, VGG_DEPTHS)
    num_classes = check_int("num_classes", num_classes, minimum=1)
    in_channels = check_int("in_channels", in_channels, minimum=1)
    width_multiplier = check_real("width_multiplier", width_multiplier, minimum=0.0, strict_minimum=True)
    sigma_w2, _, _, _, seed, dtype, nkw = _common_args(norm, init, sigma_w2, 0.0, 1.0, 0.0, seed, dtype, norm_kwargs)
    n_params, c_prev = 0, in_channels
    for v in _VGG_CFG[depth]:
        if v != "M":
            v = max(1, round(v * width_multiplier))
            n_params += (c_prev * 9 + 5) * v
            c_prev = v
    _check_parameters(f"vgg({depth}, width_multiplier={width_multiplier:g})",
                      n_params + (c_prev + 1) * num_classes, torch.finfo(dtype).bits // 8, max_memory_bytes)
    act = ActivationModule(phi)
    layers, norms, c_in = [], [], in_channels
    for v in _VGG_CFG[depth]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        v = max(1, round(v * width_multiplier))
        nrm = make_norm(norm, v, dims=2, dtype=dtype, **nkw)
        layers += [nn.Conv2d(c_in, v, 3, padding=1, dtype=dtype), nrm, act]
        norms.append(nrm)
        c_in = v
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes, dtype=dtype)]
    model = _Sequential(*layers, norms=norms, in_channels=in_channels)
    _init_all(model, init, sigma_w2, 0.0, seed)
    return model


class BasicBlock(nn.Module):
    """Residual block of two 3×3 convolutions, φ(Norm(conv(φ(Norm(conv(x))))) + shortcut(x)) (He et al. 2016a).

    ``shortcut="A"``: identity, subsampled by the stride and zero-padded in channels when the shape
    changes (He et al. §4.2, CIFAR); ``"B"``: a 1×1 convolution + Norm when the shape changes.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, act: nn.Module, shortcut: str, dtype,
                 nkw: dict):
        super().__init__()
        from bnlab.nets.norms import make_norm

        bias = norm == "none"
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias, dtype=dtype)
        self.norm1 = make_norm(norm, c_out, dims=2, dtype=dtype, **nkw)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=bias, dtype=dtype)
        self.norm2 = make_norm(norm, c_out, dims=2, dtype=dtype, **nkw)
        self.act = act
        self.stride, self.pad = stride, c_out - c_in
        self.shortcut_kind = shortcut
        self.projection = None
        if (stride != 1 or c_in != c_out) and shortcut == "B":
            self.projection = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=bias, dtype=dtype),
                                            make_norm(norm, c_out, dims=2, dtype=dtype, **nkw))

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.projection is not None:
            return self.projection(x)
        if self.stride != 1 or self.pad:
            x = x[:, :, :: self.stride, :: self.stride]
            return nn.functional.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self._shortcut(x))


class PreActBlock(BasicBlock):
    """Pre-activation residual block, conv(φ(Norm(conv(φ(Norm(x)))))) + shortcut (He et al. 2016b, Fig. 4e).

    The normalization and φ come before each convolution ("full pre-activation"), and nothing follows
    the addition, so the shortcut path is an identity from block to block.  Shortcuts as
    :class:`BasicBlock`: ``"A"`` takes the raw input ``x`` (subsampled, zero-padded in channels);
    ``"B"`` projects the pre-activated input φ(Norm(x)) by a 1×1 convolution (as He et al.'s
    pre-activation code does when the shape changes), without a normalization after it.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str, act: nn.Module, shortcut: str, dtype,
                 nkw: dict):
        nn.Module.__init__(self)
        from bnlab.nets.norms import make_norm

        bias = norm == "none"
        self.norm1 = make_norm(norm, c_in, dims=2, dtype=dtype, **nkw)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias, dtype=dtype)
        self.norm2 = make_norm(norm, c_out, dims=2, dtype=dtype, **nkw)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=bias, dtype=dtype)
        self.act = act
        self.stride, self.pad = stride, c_out - c_in
        self.shortcut_kind = shortcut
        self.projection = None
        if (stride != 1 or c_in != c_out) and shortcut == "B":
            self.projection = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act(self.norm1(x))
        short = self.projection(pre) if self.projection is not None else self._shortcut(x)
        out = self.conv2(self.act(self.norm2(self.conv1(pre))))
        return out + short


class Bottleneck(nn.Module):
    """Bottleneck block φ(Norm(conv1×1(φ(Norm(conv3×3(φ(Norm(conv1×1(x)))))))) + shortcut(x)) of ResNet-50
    (He et al. 2016a, Table 1 and Fig. 5 right): 1×1 to ``c_mid`` channels, 3×3 (with the stride), 1×1 to
    4·``c_mid``; a 1×1 projection + Norm shortcut when the shape changes (option B).

    The stride sits on the 3×3 convolution (torchvision's placement; the paper's Table 1 does not say
    which convolution subsamples, and the parameter count does not depend on it).
    """

    expansion = 4

    def __init__(self, c_in: int, c_mid: int, stride: int, norm: str, act: nn.Module, dtype, nkw: dict):
        super().__init__()
        from bnlab.nets.norms import make_norm

        bias = norm == "none"
        c_out = self.expansion * c_mid
        self.conv1 = nn.Conv2d(c_in, c_mid, 1, bias=bias, dtype=dtype)
        self.norm1 = make_norm(norm, c_mid, dims=2, dtype=dtype, **nkw)
        self.conv2 = nn.Conv2d(c_mid, c_mid, 3, stride=stride, padding=1, bias=bias, dtype=dtype)
        self.norm2 = make_norm(norm, c_mid, dims=2, dtype=dtype, **nkw)
        self.conv3 = nn.Conv2d(c_mid, c_out, 1, bias=bias, dtype=dtype)
        self.norm3 = make_norm(norm, c_out, dims=2, dtype=dtype, **nkw)
        self.act = act
        self.projection = None
        if stride != 1 or c_in != c_out:
            self.projection = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=bias, dtype=dtype),
                                            make_norm(norm, c_out, dims=2, dtype=dtype, **nkw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.act(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return self.act(out + (x if self.projection is None else self.projection(x)))


def resnet(
    depth: int = 20,
    num_classes: int = 10,
    *,
    norm: str = "bn",
    in_channels: int = 3,
    phi: str | Activation = "relu",
    init: str = "gaussian",
    sigma_w2: float | None = None,
    norm_kwargs: dict | None = None,
    preact: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
) -> nn.Sequential:
    """A ResNet for 32×32 inputs with the normalization chosen by name.

    * ``depth`` ∈ {20, 32, 44, 56, 110} (6n + 2): He et al. 2016a, §4.2 — a 3×3 conv with 16 channels,
      three stages of n basic blocks with 16, 32, 64 channels (stride 2 at the start of stages 2 and 3),
      identity shortcuts with zero-padding (option A), global average pooling, Linear(64, classes).
      ResNet-20 with BN has 269,722 parameters ("0.27M", Table 6).
    * ``depth`` ∈ {18, 34}: the basic-block ResNets of He et al. 2016a, Table 1 ([2,2,2,2] / [3,4,6,3]
      blocks, 64–512 channels, 1×1 projection shortcuts, option B) with the CIFAR stem (one 3×3 conv,
      no max pooling).  ResNet-18 with BN has 11,173,962 parameters.
    * ``depth`` = 50: the bottleneck ResNet-50 of He et al. 2016a, Table 1 ([3,4,6,3] :class:`Bottleneck`
      blocks of 64–512 → 256–2048 channels, projection shortcuts) with the same CIFAR stem and
      Linear(2048, classes); 23,520,842 parameters with BN and 10 classes.

    * ``preact=True``: the pre-activation ResNet of He et al. 2016b (:class:`PreActBlock`; the stem is a
      bare 3×3 convolution and a final Norm → φ precedes the pooling, §4 and their Fig. 4e), same
      stages, widths and shortcuts.  Pre-activation ResNet-110 with BN has 1,727,962 parameters
      (He et al. 2016b report "1.7M").

    Convolutions have no bias unless ``norm="none"``.  Returns an ``nn.Sequential`` with ``.norms``.
    """
    from bnlab.nets.norms import make_norm

    if not isinstance(preact, bool):
        raise ValueError(f"preact={preact!r} is not allowed: expected True or False")
    depth = check_choice("depth", depth, RESNET_DEPTHS)
    num_classes = check_int("num_classes", num_classes, minimum=1)
    in_channels = check_int("in_channels", in_channels, minimum=1)
    sigma_w2, _, _, _, seed, dtype, nkw = _common_args(norm, init, sigma_w2, 0.0, 1.0, 0.0, seed, dtype, norm_kwargs)
    # the body is fixed (at most ~25e6 parameters, ResNet-50); the stem and the head grow with the arguments
    _check_parameters(f"resnet({depth}, in_channels={in_channels}, num_classes={num_classes})",
                      25e6 + 9 * 64 * in_channels + 2049 * num_classes, torch.finfo(dtype).bits // 8,
                      max_memory_bytes)
    act = ActivationModule(phi)
    if preact and depth == 50:
        raise ValueError("preact=True with depth=50 is not allowed: the pre-activation bottleneck block is not "
                         "implemented; use preact=True with depth in (18, 20, 32, 34, 44, 56, 110)")
    if depth in (18, 34, 50):
        widths, blocks, shortcut = (64, 128, 256, 512), ((2, 2, 2, 2) if depth == 18 else (3, 4, 6, 3)), "B"
    else:
        n = (depth - 2) // 6
        widths, blocks, shortcut = (16, 32, 64), (n, n, n), "A"
    bias = norm == "none"
    stem = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=bias, dtype=dtype)
    if preact:
        layers, norms = [stem], []
    else:
        stem_norm = make_norm(norm, widths[0], dims=2, dtype=dtype, **nkw)
        layers, norms = [stem, stem_norm, act], [stem_norm]
    c_in = widths[0]
    block_type = PreActBlock if preact else BasicBlock
    for stage, (c, nb) in enumerate(zip(widths, blocks)):
        for i in range(nb):
            stride = 2 if (stage > 0 and i == 0) else 1
            if depth == 50:
                block = Bottleneck(c_in, c, stride, norm, act, dtype, nkw)
                block_norms = [block.norm1, block.norm2, block.norm3]
                c_out = Bottleneck.expansion * c
            else:
                block = block_type(c_in, c, stride, norm, act, shortcut, dtype, nkw)
                block_norms = [block.norm1, block.norm2]
                c_out = c
            layers.append(block)
            norms += block_norms
            if block.projection is not None and not preact:
                norms.append(block.projection[1])
            c_in = c_out
    if preact:
        final_norm = make_norm(norm, c_in, dims=2, dtype=dtype, **nkw)
        layers += [final_norm, act]
        norms.append(final_norm)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes, dtype=dtype)]
    model = _Sequential(*layers, norms=norms, in_channels=in_channels)
    _init_all(model, init, sigma_w2, 0.0, seed)
    return model
