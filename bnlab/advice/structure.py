"""Part 1 of the advice: the network's structure and which of the four papers' assumptions hold.

From one recorded forward pass (:mod:`bnlab.advice._probe`): the weight layers in execution order,
the normalization that directly consumes each layer's output (BN, BN without mean, ghost BN, Batch
Renorm, LN, GN, IN or none) and whether φ comes after it ("pre": layer → norm → φ, BN before the
nonlinearity as in Yang et al. 2019 Eq. 7 and the Fisher paper §4) or before it ("post": layer → φ →
norm, Lange et al. Eq. 2), residual additions and pooling, the initialization scale of every layer
(σ_w² = fan_in·Var(W), σ_b² = Var(b)) and the BN constants (γ, β, ε).

Each paper's assumptions are listed as :class:`Assumption` rows; a prediction of a later part is a
*theorem* for this network when every assumption of its paper holds and an *extrapolation* otherwise
(the part says which).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from bnlab.advice._probe import BATCH_NORMS, Probe

__all__ = ["Layer", "Assumption", "Structure", "describe_structure"]

YANG = "Yang et al. 2019"
FISHER = "Fisher paper"
DANESHMAND = "Daneshmand et al. 2020"
LANGE = "Lange et al."


@dataclass(frozen=True)
class Layer:
    """One weight layer (a Linear/conv layer or a matrix product with a parameter), in execution order.

    ``norm`` is the normalization that consumes this layer's output directly (None: none does);
    ``placement`` is ``"pre"`` (layer → norm → φ), ``"post"`` (layer → φ → norm) or None;
    ``scale_invariant``: the output goes straight into a normalization with its own statistics (batch
    statistics in the measured mode, or LN/GN/IN), so the loss does not change when the weights (and
    bias) are scaled — an unstable step only grows their norm.  ``sigma_w2`` = fan_in·Var(W) and
    ``sigma_b2`` = Var(b) (the papers' initialization scales, read off the weights).
    """

    index: int
    name: str
    kind: str  # "fc" or "conv"
    fan_in: int
    width: int
    norm: str | None
    norm_name: str | None
    placement: str | None
    activation: str | None
    scale_invariant: bool
    sigma_w2: float
    sigma_b2: float | None
    weight_mean: float
    params: tuple
    kernel: tuple | None = None
    stride: Any = None
    padding: Any = None
    output: bool = False
    eps: float | None = None
    gamma: float | None = None
    beta: float | None = None
    gamma_uniform: bool = True
    input_source: str | None = None  # what produced the layer's input: "data", "pool", "global_pool", "norm", ...

    @property
    def label(self) -> str:
        what = "Linear" if self.kind == "fc" else f"Conv{'' if self.kernel is None else 'x'.join(map(str, self.kernel))}"
        return f"{self.index}: {self.name} ({what} {self.fan_in}→{self.width})"


@dataclass(frozen=True)
class Assumption:
    """One assumption of one paper and whether this network satisfies it (None: cannot tell)."""

    paper: str
    statement: str
    holds: bool | None
    detail: str = ""


@dataclass(frozen=True)
class Structure:
    """What the network is (part 1).  ``theorem[paper]`` is True when all of that paper's assumptions hold."""

    model: str
    num_params: int
    batch_size: int
    input_shape: tuple
    output_shape: tuple
    layers: tuple
    depth: int  # weight layers before the output layer (the papers' L)
    norm_counts: dict
    placement: str  # "pre", "post", "mixed", "none" (no norm), "no φ" (norms with no φ next to them)
    activations: tuple  # distinct φ labels in execution order
    residual_adds: int
    pooling: int
    dropout: int
    batch_norm_layers: int
    model_training: bool  # the module's own flag as given
    bn_modes_given: tuple  # the BN modules' own modes as given ("train"/"eval")
    measured_bn_mode: str
    assumptions: tuple
    theorem: dict
    notes: tuple = ()
    activation_spec: str | None = None  # the one φ (all hidden layers), bnlab's spec, if bnlab knows it

    @property
    def output_layer(self) -> Layer:
        return self.layers[-1]

    def hidden_layers(self) -> tuple:
        return self.layers[:-1]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = [asdict(x) | {"label": x.label} for x in self.layers]
        d["assumptions"] = [asdict(a) for a in self.assumptions]
        return d


def _next_consumer(events, start: int, tensor_id: int):
    for ev in events[start + 1:]:
        if tensor_id in ev.inputs:
            return ev
    return None


def _weight_stats(model_params: dict, ev) -> tuple[float, float | None, float, tuple]:
    w = model_params.get(ev.info["param"])
    b = model_params.get(ev.info.get("bias_param")) if ev.info.get("bias_param") else None
    names = tuple(n for n in (ev.info["param"], ev.info.get("bias_param")) if n)
    if w is None:
        return math.nan, None, math.nan, names
    wd = w.detach().double()
    fan_in = _fan_in(ev)
    var = float(wd.var(unbiased=False)) if wd.numel() > 1 else 0.0
    sb2 = float(b.detach().double().var(unbiased=False)) if b is not None and b.numel() > 1 else (
        float(b.detach().double().pow(2).mean()) if b is not None else None)
    return fan_in * var, sb2, float(wd.mean()), names


def _fan_in(ev) -> int:
    shape = ev.info["weight_shape"]
    if ev.info["kind"] == "conv":
        return int(math.prod(shape[1:]))
    if ev.info.get("matmul"):
        # x @ W (W: in × out) or x @ Wᵀ (a view of an out × in parameter): the inner dimension is x's last
        return int(ev.info["input_shape"][-1])
    return int(shape[1])


def _width(ev) -> int:
    if ev.info["kind"] == "conv":
        return int(ev.info["weight_shape"][0])
    return int(ev.info["output_shape"][-1])


def describe_structure(model, probe: Probe, *, batch_size: int, input_shape: tuple, output_shape: tuple,
                       model_training: bool, bn_modes_given: tuple, measured_bn_mode: str,
                       is_bnmlp: bool = False, bnmlp=None) -> Structure:
    """The :class:`Structure` of ``model`` from the probe of one forward pass in the measured mode."""
    events = probe.events
    params = dict(model.named_parameters())
    weight_events = [e for e in events if e.kind == "weight"]
    if not weight_events:
        raise ValueError(
            f"model={type(model).__name__} is not allowed: its forward pass used no weight layer bnlab can see "
            "(nn.Linear, nn.Conv1d/2d/3d, or a matrix product with one of its parameters)")
    layers = []
    for i, ev in enumerate(weight_events):
        sw2, sb2, wmean, names = _weight_stats(params, ev)
        norm = norm_name = placement = act = None
        invariant = False
        eps = gamma = beta = None
        gamma_uniform = True
        first = _next_consumer(events, ev.order, ev.output)
        after = None
        if first is not None and first.kind == "norm":
            norm, norm_name = first.info["norm"], first.name
            invariant = bool(first.info.get("batch_statistics")) or norm in ("layernorm", "groupnorm", "instancenorm")
            eps = first.info.get("eps")
            g, b = first.info.get("gamma"), first.info.get("beta")
            if g is not None:
                gamma = float(g.mean())
                gamma_uniform = bool((g == g[0]).all())
            if b is not None:
                beta = float(b.mean())
                gamma_uniform = gamma_uniform and bool((b == b[0]).all())
            after = _next_consumer(events, first.order, first.output)
            if after is not None and after.kind == "activation":
                placement, act = "pre", after.info["label"]
        elif first is not None and first.kind == "activation":
            act = first.info["label"]
            after = _next_consumer(events, first.order, first.output)
            if after is not None and after.kind == "norm":
                norm, norm_name, placement = after.info["norm"], after.name, "post"
                eps = after.info.get("eps")
                g, b = after.info.get("gamma"), after.info.get("beta")
                if g is not None:
                    gamma = float(g.mean())
                if b is not None:
                    beta = float(b.mean())
        src = "data" if ev.info.get("from_data") else None
        if src is None and ev.inputs:
            producer = next((e for e in reversed(events[:ev.order]) if e.output == ev.inputs[0]), None)
            if producer is not None:
                src = "global_pool" if producer.kind == "pool" and producer.info.get("global") else producer.kind
        kind = ev.info["kind"]
        kernel = tuple(ev.info["weight_shape"][2:]) if kind == "conv" else None
        layers.append(Layer(index=i + 1, name=ev.name, kind=kind, fan_in=_fan_in(ev), width=_width(ev), norm=norm,
                            norm_name=norm_name, placement=placement, activation=act, scale_invariant=invariant,
                            sigma_w2=sw2, sigma_b2=sb2, weight_mean=wmean, params=names, kernel=kernel,
                            stride=ev.info.get("stride"), padding=ev.info.get("padding"),
                            output=(i == len(weight_events) - 1), eps=eps, gamma=gamma, beta=beta,
                            gamma_uniform=gamma_uniform, input_source=src))
    notes = []
    if is_bnmlp:
        # bnlab's BN-MLP normalizes inside its forward (no module, no F.batch_norm): Yang et al.'s Eq. 7,
        # BN before φ with γ, β folded into φ — read off the model instead of the trace
        fixed = []
        for layer in layers:
            if layer.name.startswith("weights."):
                norm = "ghost_batchnorm" if bnmlp.sub_batch_size else "batchnorm"
                fixed.append(_replace(layer, norm=norm, norm_name=f"{layer.name} (BN inside BNMLP)", placement="pre",
                                      activation=bnmlp.base_activation.spec, scale_invariant=measured_bn_mode == "train",
                                      eps=bnmlp.eps, gamma=bnmlp.gamma, beta=bnmlp.beta))
            else:
                fixed.append(layer)
        layers = fixed
        notes.append("bnlab's BNMLP: BN before φ (Yang et al. 2019, Eq. 7) with γ, β folded into φ, read off the model")
    layers = tuple(layers)
    hidden = layers[:-1]
    norm_counts: dict[str, int] = {}
    for e in events:
        if e.kind == "norm":
            norm_counts[e.info["norm"]] = norm_counts.get(e.info["norm"], 0) + 1
    if is_bnmlp:
        norm_counts["batchnorm"] = norm_counts.get("batchnorm", 0) + bnmlp.depth
    # a norm with no φ directly before or after it (a linear BN network) has no placement: "no φ", never None
    placements = {x.placement or "no φ" for x in hidden if x.norm is not None}
    placement = "none" if not placements else (placements.pop() if len(placements) == 1 else "mixed")
    acts = tuple(dict.fromkeys(e.info["label"] for e in events if e.kind == "activation"))
    if is_bnmlp:
        acts = (bnmlp.activation.spec,)
    residual = sum(e.kind == "residual" for e in events)
    pooling = sum(e.kind == "pool" for e in events)
    dropout = sum(e.kind == "dropout" for e in events)
    bn_layers = sum(v for k, v in norm_counts.items() if k in BATCH_NORMS)
    spec = _single_activation(events, hidden, is_bnmlp, bnmlp)
    from torch import nn

    owners = dict(model.named_modules())
    bnp_ok = sum(isinstance(owners.get(x.name.split("#")[0]), (nn.Linear, nn.Conv1d, nn.Conv2d)) for x in layers)
    assumptions = _assumptions(layers, hidden, placement, residual, pooling, spec, batch_size, bn_layers,
                               measured_bn_mode, norm_counts, bnp_ok)
    theorem = {p: all(a.holds is True for a in assumptions if a.paper == p) for p in (YANG, FISHER, DANESHMAND)}
    return Structure(
        model=type(model).__name__, num_params=int(sum(p.numel() for p in model.parameters())),
        batch_size=int(batch_size), input_shape=tuple(input_shape), output_shape=tuple(output_shape), layers=layers,
        depth=len(hidden), norm_counts=norm_counts, placement=placement, activations=acts, residual_adds=residual,
        pooling=pooling, dropout=dropout, batch_norm_layers=bn_layers, model_training=bool(model_training),
        bn_modes_given=tuple(bn_modes_given), measured_bn_mode=measured_bn_mode, assumptions=tuple(assumptions),
        theorem=theorem, notes=tuple(notes), activation_spec=spec)


def _replace(layer: Layer, **kw) -> Layer:
    from dataclasses import replace

    return replace(layer, **kw)


def _single_activation(events, hidden, is_bnmlp, bnmlp) -> str | None:
    """bnlab's spec of φ when every hidden layer uses the same φ that bnlab knows (else None)."""
    if is_bnmlp:
        return bnmlp.base_activation.spec  # γ, β are the layers' (folded into φ by the model)
    acts = {e.info["activation"].spec if e.info.get("activation") is not None else None
            for e in events if e.kind == "activation"}
    if len(acts) != 1 or None in acts or not hidden or any(x.activation is None for x in hidden):
        return None
    return acts.pop()


def _assumptions(layers, hidden, placement, residual, pooling, spec, batch_size, bn_layers, mode, norm_counts,
                 bnp_ok):
    widths = [x.width for x in hidden]
    fc_only = all(x.kind == "fc" for x in layers)
    conv_then_fc = all(not (a.kind == "conv" and i > 0 and layers[i - 1].kind == "fc")
                       for i, a in enumerate(layers))
    every_hidden_bn = bool(hidden) and all(x.norm == "batchnorm" for x in hidden)
    no_norm = all(x.norm is None for x in layers) and not norm_counts
    out = layers[-1]
    sw = [x.sigma_w2 for x in hidden if math.isfinite(x.sigma_w2)]
    same_width = len(set(widths)) <= 1
    min_width = min(widths) if widths else 0
    # a module called twice in one forward pass (its second call is "name#2"): the same weights in two layers
    reused = sorted({x.name.split("#")[0] for x in layers if "#" in x.name})
    rows = [
        Assumption(YANG, "fully connected layers", fc_only,
                   "" if fc_only else "convolutions: the mean field theory is for MLPs (extrapolation)"),
        Assumption(YANG, "BN directly after every hidden weight layer, before φ (Eq. 7)",
                   every_hidden_bn and placement == "pre",
                   f"placement: {placement}" + ("" if every_hidden_bn else "; not every hidden layer has BN")),
        Assumption(YANG, "BN uses the batch's statistics (train mode)", mode == "train" and bn_layers > 0,
                   f"measured in {mode} mode"),
        Assumption(YANG, "no residual connections", residual == 0, f"{residual} residual additions"),
        Assumption(YANG, "one φ in every hidden layer, known to bnlab's theory", spec is not None,
                   spec or "several or unknown activations"),
        Assumption(YANG, "batch size B ≥ 4 (the backward theory diverges at B ≤ 3)", batch_size >= 4, f"B = {batch_size}"),
        Assumption(YANG, "wide layers: width ≥ 2B (mean field; the finite-width error is O(B/width))",
                   bool(widths) and min_width >= 2 * batch_size,
                   f"min width {min_width}, B = {batch_size}" + ("" if same_width else " (widths differ)")),
        Assumption(FISHER, "FC or conv layers (conv before FC), no pooling, no residual connections",
                   conv_then_fc and pooling == 0 and residual == 0,
                   f"{pooling} pooling, {residual} residual additions"),
        Assumption(FISHER, "BN after every hidden weight layer, before φ; none after the output layer",
                   (every_hidden_bn and placement == "pre" and out.norm is None) or (no_norm and bool(hidden)),
                   "vanilla (no normalization) is the paper's baseline" if no_norm else f"placement: {placement}"),
        Assumption(FISHER, "one φ known to bnlab's theory", spec is not None, spec or "several or unknown activations"),
        Assumption(FISHER, "Gaussian-like initialization with the same σ_w² scale in every layer",
                   bool(sw) and max(sw) <= 1.5 * min(sw),
                   "σ_w² = " + ", ".join(f"{v:.3g}" for v in sw[:6]) + (" …" if len(sw) > 6 else "")),
        Assumption(DANESHMAND, "fully connected layers (the theorems are for MLPs)", fc_only,
                   "" if fc_only else "convolutions: an extrapolation"),
        Assumption(DANESHMAND, "linear layers (Thm 2, Lemma 3; ReLU is the paper's experiment, not its theorem)",
                   all(x.activation in (None, "identity") for x in hidden),
                   ", ".join(sorted({x.activation or "none (linear)" for x in hidden})) or "no hidden layers"),
        Assumption(DANESHMAND, "BN (or BN without centering) after every hidden layer, or no normalization at all",
                   all(x.norm in ("batchnorm", "batchnorm_no_mean") for x in hidden) or no_norm,
                   ", ".join(sorted({x.norm or "none" for x in hidden})) or "no hidden layers"),
        Assumption(DANESHMAND, "the representation H of a batch has N ≥ width columns (d × N, N samples)",
                   batch_size >= min_width if widths else False, f"N = {batch_size}, width {min_width}"),
        *(Assumption(paper, "every weight layer is used once (independent weights per layer, as the theory draws them)",
                     not reused, f"used again: {', '.join(reused[:3])}" if reused else "")
          for paper in (YANG, FISHER, DANESHMAND)),
        Assumption(LANGE, "the weights sit in nn.Linear / nn.Conv1d / nn.Conv2d modules (what BNP preconditions)",
                   bnp_ok == len(layers), f"{bnp_ok} of {len(layers)} weight layers"),
    ]
    return rows
