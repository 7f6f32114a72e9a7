"""Mean-field order parameters of FC and conv networks with and without BatchNorm, and the λ̄max bound.

Reference: "Mean-field analysis of batch normalization" (the Fisher paper,
/work/shared/papers/mean-field-fisher-information-of-batchnorm.txt): order parameters
Eqs. 17–19 (FC) and 29–33 (conv), forward/backward recursions Eqs. 20–25 (FC) and
34–43 (conv) with derivations §6.1–6.2 (Claims 6.1–6.6), the eigenvalue bound Claim 3.1
(Eqs. 44–45, derivation §6.3) and the critical learning rate η* = 2(1+μ)/λ̄max (Eq. 7).

The model (paper §2–3): weights W_ij ~ N(0, σ_w²/N_{l-1}) with N_{l-1} the fan-in
(C_{l-1}|F_l| for conv), biases ~ N(0, σ_b²); every layer but the last is followed by φ
(vanilla) or by BatchNorm with *population* statistics of the data and then φ,
h = φ(γ (z − μ)/s + β) (Eq. 13); the last layer is linear. Inputs have E‖x‖²/N0 = q̂⁰ and
‖E x‖²/N0 = q̂⁰_xy (standardized data: 1 and 0). The bound is λ̄max ≥ Σ_l f_l with f_l the
contribution of the weights of layer l to ‖E_x ∇θ f_1(x)‖² (Eqs. 152–161) for one output
unit f_1 (q̃^L = 1, paper Eq. 64).

Gaussian expectations are computed for any φ of :func:`bnlab.activations.get_activation`
by :func:`bnlab.theory.gaussian_kernel` (closed forms where they exist, otherwise
tanh-sinh quadrature to ≲1e-12), not only the paper's ReLU closed forms (which the tests
check this route against).

Two formulas
------------
``formula="paper"`` evaluates the recursions exactly as printed (with the printed typos
resolved in the only way that gives a finite answer, listed below); ``formula="measured"``
(the default) is the corrected version, derived here and checked against finite-width
simulations of the paper's own model (tests/fisher/test_order_parameters.py). For vanilla
FC networks (Karakida et al.) both coincide.

Errata (evidence in tests/fisher and docs/fisher.md)
----------------------------------------------------
E1. Base case (§3.1.1 vs Claim 6.1). §3.1.1 prints q̂⁰ = 0, q̂⁰_xy = 1; Claim 6.1 prints
    q̂⁰ = 1, q̂⁰_xy = 0. For data with mean 0 and variance 1 (the paper's assumption)
    E‖x‖²/N0 = 1 and E⟨x, y⟩/N0 = ⟨E x, E y⟩/N0 = 0, so Claim 6.1 is right; §3.1.1's values
    give q¹ = σ_b² < q¹_xy = σ_b² + σ_w², a correlation c¹_xy > 1 and an undefined
    arcsin in Eq. 21, so the paper's figures cannot have used them. Both formulas use
    Claim 6.1 (overridable by ``input_q``, ``input_q_xy`` for real, unstandardized data).
E2. BN backward scale (Eqs. 25, 42, 43, 70, 116). The derivation divides by s² — the
    variance of z over the data (Eq. 15) — and then replaces it by q^l = E z². With the
    data mean μ in the picture, E_θ s² = q^l − q^l_xy (E_θ μ² = q^l_xy, Eqs. 58–60); with
    σ_b² = 0.5, σ_w² = 2, γ = 1 that is 0.68 instead of 1.5, a factor 2.2 per BN layer.
    ``measured`` uses s² = q^l − q^l_xy; a finite network with population-statistics BN
    agrees with it and not with the printed one.
E3. Stride and padding (Eqs. 115, 123–124). The conv backward recursion assumes every
    input position receives |F| kernel taps (stride 1, circular padding) and that
    |K_l| = |K_{l+1}|. With stride s the per-position backward parameters scale by
    ≈ |K_{l+1}|/|K_l| (≈ 1/s²) per layer. ``measured`` propagates totals over positions
    (Σ_α), which are stride-independent, with the exact fraction of kernel taps that fall
    inside the unpadded input (ρ_l forward and backward, ρ2_l for pairs of positions), and
    reports per-position values as in Eqs. 29–33.
E4. Cross-position backward base (Eq. 45 with a flatten + FC head). The paper gives no base
    case for q̃_αβ,xy; ``paper`` uses q̃^L_αβ = 1 like q̃^L, q̃^L_xy. Under the flatten, each
    position has its own independent weights, so E⟨δ_α, δ_β⟩ = 0 for α ≠ β and, because the
    kernel weights couple a pair of output positions only to a pair of input positions
    (never a diagonal to an off-diagonal pair), q̃_αβ,xy = 0 in every conv layer below it:
    ``measured`` uses 0.
E5. Eq. 45's factorization. Eq. 166 replaces the average of a product by a product of
    averages; done exactly (Eq. 165 with independent forward/backward parameters) the sum
    is f_l = N_{l-1} q̂^{l-1}_xy (ρ_l D̃^l + ρ2_l T̃^l) with D̃, T̃ the position totals of the
    same- and cross-position backward parameters. It equals Eq. 45 when
    q̂_αβ,xy = q̂_xy (which holds for independent samples in both models) and geometry
    factors are 1.
E6. Typos with no effect on the result: Eq. 52/53 carry a stray σ_w² (the result Eq. 54 has
    none); Eq. 118 has q̃^{l+1} where Eq. 42 has q̃^{l+1}_xy (Eq. 42 is used); Eq. 43 has
    "σ^l_l" for q^l; §3.1.1 says the bound uses Claim 3.1 with N_l ≫ 1 "for 0 < l < L".

BN in train mode (``bn_mode="train"``)
--------------------------------------
The paper's model normalizes with population statistics (Eqs. 14–15), which is a real network's
eval mode with running statistics equal to the data statistics (``bn_mode="eval"``, the default).
In train mode the statistics are the batch's own, and backpropagation through them projects the
batch of δ^l onto the batch-mean-free subspace: Σ_b δ^l(x_b) = 0 exactly for every layer followed
by BN. The weight term of the bound, ‖(1/m) Σ_b δ^l(x_b) h^{l-1}(x_b)ᵀ‖², then is the squared
batch covariance of δ and h, which vanishes under the same gradient-independence assumption the
paper uses: f_l = 0 for every layer followed by BN, and only the output layer (and any layer
without BN) remains. A finite network agrees (train-mode λmax ≈ f_L, below the eval-mode bound;
tests/fisher/test_bound.py): the paper's bound is not a lower bound for the curvature of a BN
network in train mode.

Approximations (both formulas, as in the paper): the bias, γ and β gradients are dropped
(Eq. 158; the output bias alone would add exactly 1 to the bound), forward and backward
quantities are independent (gradient independence), x ≠ y pairs dominate (O(1/m)
corrections dropped), and padded conv positions are treated as homogeneous (position
averages).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from bnlab._validation import check_choice, check_real, per_layer
from bnlab._vocabulary import NORM_ALIASES, canonical_value
from bnlab.activations import Activation, activation_from_callable, get_activation

from .architecture import Architecture, _as_arch

__all__ = ["FORMULAS", "NORMS", "FisherTheoryResult", "fisher_order_parameters", "eta_star"]

FORMULAS = ("measured", "paper")
NORMS = ("bn", "none")


@dataclass(frozen=True)
class FisherTheoryResult:
    """The λ̄max lower bound (Claim 3.1), η* (Eq. 7) and the order parameters per layer.

    ``layers[l-1]`` holds, for layer l = 1..L: the forward parameters of its pre-activation
    z^l (``q``, ``q_xy``, ``q_ab``: Eqs. 17–18, 29–31), of its input h^{l-1} (``q_hat``,
    ``q_hat_xy``, ``q_hat_ab``), the backward parameters of δ^l = ∂f_1/∂z^l per position
    (``q_tilde``, ``q_tilde_xy``, ``q_tilde_ab``: Eqs. 19, 32–33), the BN scale ``s2``
    (None without BN or for the output layer), the fan-in ``fan_in`` (N_{l-1}), the number
    of output positions ``positions`` (|K_l|) and the bound's term ``f``.

    A bound of exactly 0 is a result, not an error: for an odd φ with β = 0 on centred data every
    mean activation vanishes (E φ(u) = 0 by symmetry), so every f_l = 0; ``eta_star`` is then
    ``math.inf`` (Claim 3.1 bounds no learning rate) and ``note`` says why. ``note`` is None otherwise.
    """

    arch: str
    norm: str
    phi: str
    formula: str
    bn_mode: str
    momentum: float
    gamma: tuple
    beta: tuple
    sigma_w2: tuple
    sigma_b2: tuple
    input_q: float
    input_q_xy: float
    lambda_max_bound: float
    eta_star: float
    per_layer_f: tuple
    layers: tuple = field(repr=False)
    note: "str | None" = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("gamma", "beta", "sigma_w2", "sigma_b2", "per_layer_f"):
            d[key] = list(d[key])
        d["layers"] = [dict(x) for x in self.layers]
        if not math.isfinite(self.eta_star):
            d["eta_star"] = None  # strict JSON has no inf: no bound (``note`` says why)
        return d


def eta_star(lambda_max: float, momentum: float = 0.9) -> float:
    """η* = 2(1 + μ)/λmax, the largest stable learning rate of momentum SGD (Fisher paper, Eq. 7)."""
    lam = check_real("lambda_max", lambda_max, minimum=0.0, strict_minimum=True)
    mu = _check_momentum(momentum)
    return 2.0 * (1.0 + mu) / lam


def _check_momentum(momentum) -> float:
    mu = check_real("momentum", momentum, minimum=0.0)
    if mu >= 1.0:
        raise ValueError(f"momentum={mu!r} is not allowed: expected 0 <= momentum < 1")
    return mu


# Gaussian expectations are taken over u ~ N(0, var) with |u| ≤ _CUTOFF·√var, as in
# bnlab.theory.gaussian_kernel's quadrature (the omitted tail weighs < e^{-50}).
_CUTOFF = 10.0
# gaussian_kernel's stated accuracy (≲ 1e-12 relative, bnlab.theory.vphi); a cross moment that Mehler's
# theorem makes ≥ 0 but that quadrature returns below −_KERNEL_RTOL·(its scale) is an error, not roundoff
_KERNEL_RTOL = 1e-12


def _gaussian_mean(fn, kinks: Sequence[float], var: float) -> float:
    """E fn(u) for u ~ N(0, var), from the even part of fn: ∫₀^R [fn(√var r) + fn(−√var r)] p(r) dr.

    Pairing r with −r before integrating is what makes an odd fn (tanh, sin, erf with β = 0) give exactly
    0 rather than a rounding residue of either sign: fn(x) + fn(−x) is 0 at every node. ``kinks`` (in x)
    become panel ends; scipy's adaptive QUADPACK rule handles the algebraic endpoint behaviour of
    α-relu-like φ at 0.
    """
    from scipy.integrate import quad

    if var == 0.0:
        return float(np.asarray(fn(np.zeros(1)), dtype=np.float64)[0])
    s = math.sqrt(var)
    norm = 1.0 / math.sqrt(2.0 * math.pi)

    def even(r: float) -> float:
        x = np.array([s * r, -s * r])
        v = np.asarray(fn(x), dtype=np.float64)
        return float(v[0] + v[1]) * norm * math.exp(-0.5 * r * r)

    cuts = sorted({abs(k) / s for k in kinks if 0.0 < abs(k) / s < _CUTOFF})
    edges = [0.0, *cuts, _CUTOFF]
    total = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-convergence shows up as a non-finite bound, refused below
        for a, b in zip(edges[:-1], edges[1:]):
            total += quad(even, a, b, epsabs=0.0, epsrel=1e-13, limit=200)[0]
    return float(total)


def _cross_moment(value: float, scale: float, what: str) -> float:
    """A cross moment E g(u)g(v) with Cov(u, v) ≥ 0, which Mehler's expansion Σ_k c^k (E g He_k)²/k!
    makes ≥ 0: a quadrature value below 0 by no more than the route's accuracy is rounding and is 0."""
    if value < 0.0:
        if value < -_KERNEL_RTOL * max(abs(scale), 1e-300) * 10.0:
            raise ValueError(
                f"{what} = {value!r} < 0 for a non-negative correlation: the Gaussian quadrature did not "
                "converge for this phi (check that phi is finite and grows at most polynomially)"
            )
        return 0.0
    return value


def _pair(act: Activation, var: float, cov: float) -> tuple[float, float]:
    """(E φ(u)², E φ(u)φ(v)) for (u, v) ~ N(0, [[var, cov], [cov, var]]) (Gaussian-integral route).

    cov = 0 (the BN layers, Eqs. 56–60, and vanilla layers with σ_b² = 0 on centred data): u, v are
    independent and E φ(u)φ(v) = (E φ(u))², computed without cancellation (:func:`_gaussian_mean`), so
    an odd φ gives exactly 0 instead of a ±1e-16 residue of the 2-d quadrature.
    """
    from bnlab.theory import gaussian_kernel

    cov = min(cov, var)  # roundoff only: |cov| <= var holds exactly in the recursions
    if cov == 0.0:
        m2 = float(gaussian_kernel(act, np.array([[var]], dtype=np.float64))[0, 0])
        mean = _gaussian_mean(act, act.kinks, var)
        return m2, mean * mean
    k = gaussian_kernel(act, np.array([[var, cov], [cov, var]], dtype=np.float64))
    return float(k[0, 0]), _cross_moment(float(k[0, 1]), float(k[0, 0]), "E phi(u)phi(v)")


def _derivative_activation(act: Activation) -> Activation:
    return activation_from_callable(act.derivative, kinks=act.kinks)


def _derivative_pair(act: Activation, var: float, cov: float) -> tuple[float, float]:
    """(E φ'(u)², E φ'(u)φ'(v)) for (u, v) ~ N(0, [[var, cov], [cov, var]]), φ' = d/dx act(x).

    For 1-homogeneous φ = a ρ₁(x) − b ρ₁(−x) (ReLU, leaky ReLU, abs, identity) φ' = a H(x) + b H(−x)
    and the orthant probabilities P(u > 0, v > 0) = P(u < 0, v < 0) = (π/2 + arcsin c)/(2π) give the
    closed form (Eq. 22's ReLU case); otherwise the Gaussian-integral route (:func:`_pair`).
    """
    if act.homogeneity == 1.0 and act.homogeneous_coeffs is not None:
        a, b = act.homogeneous_coeffs
        if cov == 0.0:  # independent: (E φ')² = ((a + b)/2)², without the cancellation of the form below
            return 0.5 * (a * a + b * b), 0.25 * (a + b) ** 2
        c = max(-1.0, min(1.0, cov / var)) if var > 0 else 0.0
        p = (math.pi / 2 + math.asin(c)) / (2 * math.pi)
        return 0.5 * (a * a + b * b), (a * a + b * b) * p + 2 * a * b * (0.5 - p)
    return _pair(_derivative_activation(act), var, cov)


def _geometry_factors(geo: dict) -> tuple[float, float]:
    """ρ (fraction of (position, tap) pairs inside the unpadded input) and ρ2 (the same for pairs of
    distinct output positions sharing a tap), exact for square 2-d kernels (products of 1-d counts)."""
    if geo["kind"] == "fc":
        return 1.0, 0.0
    k, out = geo["kernel"], geo["out_size"]
    n = np.asarray(geo["positions_per_tap"], dtype=np.float64)  # 1-d counts per kernel coordinate
    rho = (n.sum() / (k * out)) ** 2
    positions = out * out
    if positions == 1:
        return float(rho), 0.0
    pairs = n.sum() ** 2  # Σ_{a} n_a over 2-d taps = (Σ_1d n)^2
    squares = (n**2).sum() ** 2  # Σ_a n_a^2 over 2-d taps
    rho2 = (squares - pairs) / (k * k * positions * (positions - 1))
    return float(rho), float(rho2)


def fisher_order_parameters(
    arch: "str | Architecture",
    *,
    norm: str = "bn",
    phi: "str | Activation" = "relu",
    gamma: "float | Sequence[float]" = 1.0,
    beta: "float | Sequence[float]" = 0.0,
    sigma_w2: "float | Sequence[float]" = 2.0,
    sigma_b2: "float | Sequence[float]" = 0.5,
    momentum: float = 0.9,
    formula: str = "measured",
    input_q: float = 1.0,
    input_q_xy: float = 0.0,
    bn_mode: str = "eval",
) -> FisherTheoryResult:
    """Order parameters, the λ̄max lower bound Σ_l f_l (Claim 3.1) and η* (Eq. 7).

    Parameters
    ----------
    arch : spec string or :class:`Architecture`
        e.g. ``"fc:784-1000-1000-1000-10"`` or ``"conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10"``
        (grammar: :mod:`bnlab.fisher.architecture`).
    norm : {"bn", "none"}
        BatchNorm after every hidden layer (Eq. 13/28) or none (vanilla).
    phi : activation name/expression/Activation (:func:`bnlab.activations.get_activation`).
    gamma, beta : BN scale and shift (Eq. 16), scalar or one per hidden layer (L − 1 values);
        ignored for ``norm="none"``.
    sigma_w2, sigma_b2 : weight and bias variances (Eqs. 12, 27), scalar or one per layer (L).
    momentum : μ of Eq. 1, in [0, 1).
    formula : {"measured", "paper"}
        The corrected recursions (default) or the printed ones (module docstring, Errata).
    input_q, input_q_xy : q̂⁰ = E‖x‖²/N0 and q̂⁰_xy = ‖E x‖²/N0 (Claim 6.1: 1 and 0 for
        standardized data).
    bn_mode : {"eval", "train"}
        BN with population statistics (the paper's model) or with batch statistics (the layers
        followed by BN drop out of the bound; module docstring). Ignored for ``norm="none"``.
    """
    inputs = _check_inputs(arch, norm=norm, phi=phi, gamma=gamma, beta=beta, sigma_w2=sigma_w2, sigma_b2=sigma_b2,
                           momentum=momentum, formula=formula, input_q=input_q, input_q_xy=input_q_xy,
                           bn_mode=bn_mode)
    try:
        return _fisher_order_parameters(inputs)
    except OverflowError:
        raise ValueError(_overflow_message()) from None


@dataclass(frozen=True)
class _Inputs:
    """The validated arguments of :func:`fisher_order_parameters` (per-layer lists expanded)."""

    architecture: Architecture
    norm: str
    phi: Activation
    gamma: list  # L − 1 values
    beta: list  # L − 1 values
    sigma_w2: list  # L values
    sigma_b2: list  # L values
    momentum: float
    formula: str
    input_q: float
    input_q_xy: float
    bn_mode: str

    @property
    def measured(self) -> bool:
        return self.formula == "measured"


def _check_inputs(arch, *, norm, phi, gamma, beta, sigma_w2, sigma_b2, momentum, formula, input_q, input_q_xy,
                  bn_mode) -> _Inputs:
    """Validate :func:`fisher_order_parameters`' arguments (each refusal names the argument and the layer)."""
    architecture = _as_arch(arch)
    norm = check_choice("norm", canonical_value("norm", norm, NORM_ALIASES), NORMS)
    formula = check_choice("formula", formula, FORMULAS)
    mu = _check_momentum(momentum)
    bn_mode = check_choice("bn_mode", bn_mode, ("eval", "train"))
    L = architecture.depth
    sw2 = [check_real(f"sigma_w2[{i}]", v) for i, v in enumerate(per_layer("sigma_w2", sigma_w2, L))]
    sb2 = [check_real(f"sigma_b2[{i}]", v) for i, v in enumerate(per_layer("sigma_b2", sigma_b2, L))]
    for i, v in enumerate(sw2):
        if v <= 0:
            raise ValueError(f"sigma_w2={v!r} (layer {i + 1}) is not allowed: expected a variance > 0")
    for i, v in enumerate(sb2):
        if v < 0:
            raise ValueError(f"sigma_b2={v!r} (layer {i + 1}) is not allowed: expected a variance >= 0")
    gam = [check_real(f"gamma[{i}]", v) for i, v in enumerate(per_layer("gamma", gamma, max(L - 1, 0)))]
    bet = [check_real(f"beta[{i}]", v) for i, v in enumerate(per_layer("beta", beta, max(L - 1, 0)))]
    if norm == "bn":
        for i, g in enumerate(gam):
            if g == 0:
                raise ValueError(f"gamma=0 (layer {i + 1}) is not allowed: BN with γ = 0 outputs a constant")
    q0 = check_real("input_q", input_q, minimum=0.0, strict_minimum=True)
    q0xy = check_real("input_q_xy", input_q_xy, minimum=0.0)
    if q0xy > q0:
        raise ValueError(
            f"input_q_xy={q0xy!r} is not allowed: ‖E x‖²/N0 cannot exceed E‖x‖²/N0 = input_q={q0!r}"
        )
    return _Inputs(architecture, norm, get_activation(phi), gam, bet, sw2, sb2, mu, formula, q0, q0xy, bn_mode)


def _overflow_message(where: str = "") -> str:
    return (f"the order parameters overflow float64{where} for these parameters: reduce gamma, beta, sigma_w2, "
            "sigma_b2 or input_q (the forward variances grow like σ_w²·q̂ per layer, q̂ ∝ γ² with BN)")


@dataclass
class _Forward:
    """The forward order parameters per layer (Claims 6.1, 6.3, 6.5) and the backward gains.

    ``q*[l-1]``: the pre-activation z^l of layer l = 1..L; ``qh*[l]``: its input h^l (``qh*[0]`` the data);
    ``s2[l-1]``: the BN scale of layer l (None without BN and for the output layer); ``chi*[l-1]``:
    E φ'φ' (× 1/s² with BN) of hidden layer l, same sample, same position in two samples, two positions.
    """

    q: list = field(default_factory=list)
    q_xy: list = field(default_factory=list)
    q_ab: list = field(default_factory=list)
    s2: list = field(default_factory=list)
    qh: list = field(default_factory=list)
    qh_xy: list = field(default_factory=list)
    qh_ab: list = field(default_factory=list)
    chi: list = field(default_factory=list)
    chi_xy: list = field(default_factory=list)
    chi_ab: list = field(default_factory=list)


def _fisher_order_parameters(inputs: _Inputs) -> FisherTheoryResult:
    geos = inputs.architecture.geometry()
    fwd = _forward(inputs, geos)
    bt, bt_xy, bt_ab = _backward(inputs, geos, fwd)
    f, layers = _bound_terms(inputs, geos, fwd, bt, bt_xy, bt_ab)
    return _result(inputs, fwd, bt_xy, f, layers)


def _forward(inputs: _Inputs, geos: list) -> _Forward:
    """The forward recursion (Claims 6.1, 6.3, 6.5; Errata E1–E3) from the data's q̂⁰, q̂⁰_xy."""
    L = inputs.architecture.depth
    fwd = _Forward(qh=[inputs.input_q], qh_xy=[inputs.input_q_xy],
                   qh_ab=[inputs.input_q_xy])  # h^0: independent samples => cross-position = cross-sample
    sw2, sb2 = inputs.sigma_w2, inputs.sigma_b2
    for l in range(1, L + 1):
        rho = _geometry_factors(geos[l - 1])[0] if inputs.measured else 1.0
        fwd.q.append(sb2[l - 1] + sw2[l - 1] * rho * fwd.qh[-1])
        fwd.q_xy.append(sb2[l - 1] + sw2[l - 1] * rho * fwd.qh_xy[-1])
        fwd.q_ab.append(sb2[l - 1] + sw2[l - 1] * rho * fwd.qh_ab[-1])
        if not (math.isfinite(fwd.q[-1]) and math.isfinite(fwd.q_xy[-1]) and math.isfinite(fwd.q_ab[-1])):
            raise ValueError(_overflow_message(f" at layer {l} (q = {fwd.q[-1]:g})"))
        if l == L:
            fwd.s2.append(None)
            break
        if inputs.norm == "bn":
            _forward_bn_layer(inputs, fwd, l, sw2[l - 1] * rho)
        else:
            _forward_vanilla_layer(inputs.phi, fwd)
    return fwd


def _forward_bn_layer(inputs: _Inputs, fwd: _Forward, l: int, gain: float) -> None:
    """Append h^l and the backward gains of hidden layer l followed by BN (Eqs. 56–60; Errata E2);
    ``gain`` = σ_w²·ρ of the layer, which maps h^{l−1}'s order parameters to z^l's."""
    act = inputs.phi.with_affine(inputs.gamma[l - 1], inputs.beta[l - 1])
    # u = (z − μ)/s is N(0, 1) per unit; different samples independent (Eqs. 56–60)
    m2, m11 = _pair(act, 1.0, 0.0)
    d2, d11 = _derivative_pair(act, 1.0, 0.0)
    # Errata E2: the data variance q − q_xy.  Both carry σ_b², which cancels exactly; it is left out of the
    # difference (formed from h^{l−1}'s) so a large σ_b² cannot cancel the variance away (σ_b² = 1e15 lost 13 %).
    var = gain * (fwd.qh[-1] - fwd.qh_xy[-1]) if inputs.measured else fwd.q[-1]
    if not var > 0:
        raise ValueError(
            f"layer {l}: the data variance of the pre-activations s² = {var:g} is not positive "
            "(BN is undefined); check sigma_w2 and the input order parameters"
        )
    fwd.s2.append(var)
    fwd.qh.append(m2)
    fwd.qh_xy.append(m11)
    fwd.qh_ab.append(m11)
    fwd.chi.append(d2 / var)
    fwd.chi_xy.append(d11 / var)
    fwd.chi_ab.append(d11 / var)


def _forward_vanilla_layer(phi: Activation, fwd: _Forward) -> None:
    """Append h^l and the backward gains of a hidden layer without BN (Eqs. 20–22, 34–38)."""
    q, q_xy, q_ab = fwd.q[-1], fwd.q_xy[-1], fwd.q_ab[-1]
    m2, m11 = _pair(phi, q, q_xy)
    _, m11ab = _pair(phi, q, q_ab)
    d2, d11 = _derivative_pair(phi, q, q_xy)
    _, d11ab = _derivative_pair(phi, q, q_ab)
    fwd.s2.append(None)
    fwd.qh.append(m2)
    fwd.qh_xy.append(m11)
    fwd.qh_ab.append(m11ab)
    fwd.chi.append(d2)
    fwd.chi_xy.append(d11)
    fwd.chi_ab.append(d11ab)


def _backward(inputs: _Inputs, geos: list, fwd: _Forward) -> tuple[list, list, list]:
    """The backward recursion (Claims 6.2, 6.4, 6.6): q̃, q̃_xy, q̃_αβ,xy of δ^l for l = 1..L.

    measured: totals over positions Q̃ = Σ_α E‖δ_α‖², D̃ = Σ_α E⟨δ_α(x), δ_α(y)⟩,
    T̃ = Σ_{α≠β} E⟨δ_α(x), δ_β(y)⟩ (Errata E3, E4); paper: per-position values as printed.
    """
    L = inputs.architecture.depth
    measured = inputs.measured
    bt = [0.0] * L
    bt_xy = [0.0] * L
    bt_ab = [0.0] * L
    bt[L - 1] = bt_xy[L - 1] = 1.0
    bt_ab[L - 1] = 0.0 if measured else 1.0
    for l in range(L - 1, 0, -1):  # layer l (1-based) receives from layer l+1
        nxt = geos[l]  # geometry of layer l+1
        g = inputs.sigma_w2[l]  # σ_w² of layer l+1
        i = l - 1
        if measured:
            rho, rho2 = _geometry_factors(nxt)
            bt[i] = g * fwd.chi[i] * rho * bt[l]
            bt_xy[i] = g * fwd.chi_xy[i] * rho * bt_xy[l]
            bt_ab[i] = g * fwd.chi_ab[i] * rho2 * bt_ab[l] if nxt["kind"] == "conv" else 0.0
        else:
            bt[i] = g * fwd.chi[i] * bt[l]
            bt_xy[i] = g * fwd.chi_xy[i] * bt_xy[l]
            bt_ab[i] = g * fwd.chi_ab[i] * bt_ab[l]
    return bt, bt_xy, bt_ab


def _bound_terms(inputs: _Inputs, geos: list, fwd: _Forward, bt: list, bt_xy: list,
                 bt_ab: list) -> tuple[list, list]:
    """Each layer's term f_l of the bound (Claim 3.1, Eqs. 44–45; Errata E5) and its order parameters."""
    L = inputs.architecture.depth
    f = []
    layers = []
    for l in range(1, L + 1):
        geo = geos[l - 1]
        K = geo["positions"]
        n_in = geo["fan_in"] if geo["kind"] == "conv" else geo["in_units"]
        i = l - 1
        if inputs.measured:
            rho, rho2 = _geometry_factors(geo)
            fl = n_in * fwd.qh_xy[i] * (rho * bt_xy[i] + rho2 * bt_ab[i])
            per_pos = (bt[i] / K, bt_xy[i] / K, bt_ab[i] / (K * (K - 1)) if K > 1 else 0.0)
        else:
            if geo["kind"] == "conv":
                fl = n_in * ((K - 1) * bt_ab[i] + bt_xy[i]) * ((K - 1) * fwd.qh_ab[i] + fwd.qh_xy[i])
            else:
                fl = n_in * fwd.qh_xy[i] * bt_xy[i]
            per_pos = (bt[i], bt_xy[i], bt_ab[i] if K > 1 else 0.0)
        if inputs.norm == "bn" and inputs.bn_mode == "train" and l < L:
            fl = 0.0  # Σ_b δ^l(x_b) = 0 in train mode (module docstring)
        f.append(float(fl))
        layers.append(_layer_record(l, geo, fwd, per_pos, float(fl)))
    return f, layers


def _layer_record(l: int, geo: dict, fwd: _Forward, per_pos: tuple, fl: float) -> dict:
    """One entry of :attr:`FisherTheoryResult.layers` (its docstring names the keys)."""
    i = l - 1
    K = geo["positions"]
    return dict(
        layer=l,
        kind=geo["kind"],
        fan_in=int(geo["fan_in"]),
        positions=int(K),
        q=fwd.q[i],
        q_xy=fwd.q_xy[i],
        q_ab=fwd.q_ab[i] if K > 1 or geo["kind"] == "conv" else None,
        q_hat=fwd.qh[i],
        q_hat_xy=fwd.qh_xy[i],
        q_hat_ab=fwd.qh_ab[i],
        q_tilde=per_pos[0],
        q_tilde_xy=per_pos[1],
        q_tilde_ab=per_pos[2],
        s2=fwd.s2[i],
        f=fl,
    )


def _result(inputs: _Inputs, fwd: _Forward, bt_xy: list, f: list, layers: list) -> FisherTheoryResult:
    """The bound Σ_l f_l (refused unless finite and ≥ 0), η* (Eq. 7) and the result record."""
    bound = float(sum(f))
    if not (math.isfinite(bound) and bound >= 0):
        raise ValueError(f"the bound is {bound!r}: not a finite non-negative number for these parameters")
    L = inputs.architecture.depth
    note = None if bound > 0 else _zero_bound_note(inputs.norm, inputs.bn_mode, fwd.qh_xy, bt_xy, L)
    eta = 2.0 * (1.0 + inputs.momentum) / bound if bound > 0 else math.inf
    return FisherTheoryResult(
        arch=inputs.architecture.to_spec(),
        norm=inputs.norm,
        phi=inputs.phi.spec,
        formula=inputs.formula,
        bn_mode=inputs.bn_mode if inputs.norm == "bn" else "none",
        momentum=inputs.momentum,
        gamma=tuple(inputs.gamma),
        beta=tuple(inputs.beta),
        sigma_w2=tuple(inputs.sigma_w2),
        sigma_b2=tuple(inputs.sigma_b2),
        input_q=inputs.input_q,
        input_q_xy=inputs.input_q_xy,
        lambda_max_bound=bound,
        eta_star=eta,
        per_layer_f=tuple(f),
        layers=tuple(layers),
        note=note,
    )


def _zero_bound_note(norm: str, bn_mode: str, qh_xy: list, bt_xy: list, L: int) -> str:
    """Why Σ_l f_l = 0: which factor of f_l ∝ q̂^{l-1}_xy q̃^l_xy (Eq. 45) vanished in each layer."""
    train = norm == "bn" and bn_mode == "train"
    if all(v == 0.0 for v in qh_xy):
        reason = (
            "the mean activations vanish in every layer, q̂_xy = ‖E h‖²/N = 0: the inputs are centred "
            "(input_q_xy = 0) and E φ(u) = 0 exactly, as for an odd φ with β = 0"
        )
    else:
        parts = []
        for l in range(1, L + 1):
            if train and l < L:
                parts.append(f"f_{l}: train-mode BN")
            elif qh_xy[l - 1] == 0.0:
                parts.append(f"f_{l}: q̂^{l - 1}_xy = 0")
            else:
                parts.append(f"f_{l}: q̃^{l}_xy = 0 (E φ' = 0 above it)")
        reason = "; ".join(parts)
    return (
        f"the bound is 0 ({reason}): Claim 3.1 then only says λ̄max ≥ 0 and gives no critical learning "
        "rate, so eta_star is inf (no bound). The bound drops the bias gradients; the output bias alone "
        "would contribute exactly 1 to λ̄max."
    )
