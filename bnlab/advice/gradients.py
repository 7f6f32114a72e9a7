"""Part 2 of the advice: gradient explosion and the trainable depth (Yang et al. 2019, Thm 3.9/3.10, §4).

Measured: the squared norm ‖∂L/∂h^l‖² of the loss gradient at every weight layer's output h^l (the
pre-activation, before BN), over the whole batch, at initialization, for several draws of the weights;
the per-layer growth rate towards the input is fitted with its bootstrap interval
(:func:`bnlab.sim.fit_geometric_rate`, over the draws).  Draw 0 is the network as given; draw k > 0
permutes the entries of every parameter tensor at random (seeded) — a new draw from the *same* empirical
distribution of the user's initialization (exact for i.i.d. initializations such as Kaiming, Xavier or
Gaussian; for orthogonal ones only the distribution of the entries is kept).

Predicted: the mean field rate λ_G↓ of :func:`bnlab.theory.analyze` for the network's φ, B, ε, γ, β and
σ_w², ξ = 1/log λ_G↓ and the trainable depth 16ξ (§4: an empirical constant of the paper), with the knobs
that move it.  The verdict compares the network's depth with 16ξ — the theory's where it applies, the
measured rate's otherwise.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from bnlab.advice.structure import YANG, Structure

__all__ = ["Knob", "GradientAdvice", "permuted_draw"]


@dataclass(frozen=True)
class Knob:
    """One setting that moves 16ξ: the theory at another value of it (Yang et al. 2019, Fig. 5)."""

    name: str
    current: float
    suggested: float
    max_trainable_depth: float | None
    grad_explosion_rate: float | None
    effect: str


@dataclass(frozen=True)
class GradientAdvice:
    """Gradient norms per layer at initialization, the fitted rate, the mean field λ_G↓, 16ξ and a verdict.

    ``values[k][l]``: ‖∂L/∂h^l‖² of draw k at weight layer l (``layers[l]``).  ``rate``: the fitted growth
    per layer towards the input over layers ``fit_layers`` (1-based, inclusive) with its interval.
    ``theory_basis``: "theorem" (every assumption of Yang et al. holds), "extrapolation" (the theory was
    evaluated for φ, B, ε, γ, β but some assumption fails) or None (not evaluable: ``theory_reason``).
    """

    layers: tuple
    values: tuple
    mean: tuple
    draws: int
    fit_layers: tuple
    rate: float | None
    rate_ci: tuple | None
    growth: float | None
    depth: int
    max_depth_measured: float | None
    theory_rate: float | None
    max_depth_theory: float | None
    theory_basis: str | None
    theory_reason: str
    theory_inputs: dict
    trainable: bool | None
    verdict: str
    knobs: tuple = ()
    notes: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["knobs"] = [asdict(k) for k in self.knobs]
        return d


def permuted_draw(model, generator):
    """A copy of ``model`` whose every parameter tensor has its entries randomly permuted (module docstring)."""
    import torch

    draw = copy.deepcopy(model)
    with torch.no_grad():
        for p in draw.parameters():
            if p.numel() > 1:
                flat = p.reshape(-1)
                idx = torch.randperm(flat.numel(), generator=generator).to(flat.device)
                p.copy_(flat[idx].reshape(p.shape))
    return draw


def _theory_inputs(structure: Structure) -> tuple[dict | None, str, str | None]:
    """(analyze kwargs, reason, basis): the mean field model of this network, where it can be evaluated."""
    hidden = structure.hidden_layers()
    if not hidden:
        return None, "no hidden layer", None
    if structure.batch_norm_layers == 0 or any(x.norm not in ("batchnorm", "ghost_batchnorm") for x in hidden):
        return None, "the theory is for BN after every hidden layer; this network has other or no normalization", None
    if structure.placement != "pre":
        return None, f"BN placement {structure.placement!r}: the theory is for BN before φ (Eq. 7)", None
    if structure.activation_spec is None:
        return None, "no single φ bnlab's theory knows (several or unknown activations)", None
    if structure.measured_bn_mode != "train":
        return None, "BN measured with running statistics (eval mode): the theory is for batch statistics", None
    b = structure.batch_size
    if b < 4:
        return None, f"B = {b}: the backward theory needs B ≥ 4 (App. J)", None
    deep = hidden[1:] if len(hidden) > 1 else hidden
    sw2 = float(np.mean([x.sigma_w2 for x in deep]))
    eps = float(np.mean([x.eps for x in hidden if x.eps is not None] or [0.0]))
    gammas = [x.gamma for x in hidden if x.gamma is not None]
    betas = [x.beta for x in hidden if x.beta is not None]
    gamma = float(np.mean(gammas)) if gammas else 1.0
    beta = float(np.mean(betas)) if betas else 0.0
    kw = dict(phi=structure.activation_spec, batch_size=b, eps=eps, sigma_w2=sw2 if sw2 > 0 else 1.0,
              gamma=gamma if gamma != 0 else 1.0, beta=beta)
    basis = "theorem" if structure.theorem.get(YANG) else "extrapolation"
    if not all(x.gamma_uniform for x in hidden):
        basis = "extrapolation"
    return kw, "", basis


def _analyze(kw: dict):
    from bnlab.theory import analyze

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return analyze(kw["phi"], kw["batch_size"], eps=kw["eps"], sigma_w2=kw["sigma_w2"], gamma=kw["gamma"],
                       beta=kw["beta"])


def _knobs(kw: dict, current_depth: float | None) -> tuple:
    from bnlab.activations import get_activation

    act = get_activation(kw["phi"])
    out = []
    beta = kw["beta"]
    options = [("beta", beta, 1.0 if abs(beta) < 1.0 else beta + 1.0)]
    if act.homogeneity is None:
        options.append(("gamma", kw["gamma"], kw["gamma"] / 2))
    options.append(("eps", kw["eps"], round(0.3 * kw["sigma_w2"], 6)))
    options.append(("batch_size", kw["batch_size"], 2 * kw["batch_size"]))
    for name, cur, new in options:
        alt = dict(kw)
        alt[name] = new
        try:
            res = _analyze(alt)
        except ValueError as exc:
            out.append(Knob(name, float(cur), float(new), None, None, f"theory not available: {exc}"))
            continue
        depth, rate = res.max_trainable_depth, res.grad_explosion_rate
        if rate is None:
            effect = "; ".join(res.warnings[:1]) or "no rate"
        elif res.c_star is not None and res.c_star > 0.999:
            effect = "the batch collapses (c* = 1): every sample maps to the same representation — do not go there"
        elif depth is None or math.isinf(depth):
            effect = f"λ_G↓ = {rate:.4g} ≤ 1: no gradient explosion (no depth limit from it)"
        elif current_depth is not None and math.isfinite(current_depth):
            effect = f"16ξ {'rises' if depth > current_depth else 'falls'} to {depth:.1f} (λ_G↓ = {rate:.4g})"
        else:
            effect = f"16ξ = {depth:.1f} (λ_G↓ = {rate:.4g})"
        out.append(Knob(name, float(cur), float(new), None if depth is None else float(depth),
                        None if rate is None else float(rate), effect))
    return tuple(out)


def gradient_part(work, x, targets, loss_fn, structure: Structure, *, draws: int, seed: int, progress) -> tuple:
    """(:class:`GradientAdvice`, representations captured on draw 0) — see the module docstring."""
    import torch

    from bnlab.advice._probe import run_probe
    from bnlab.sim import fit_geometric_rate
    from bnlab.theory import max_trainable_depth

    names = [x.name for x in structure.layers]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    captured = {}
    for d in range(draws):
        progress(f"gradients: draw {d + 1}/{draws}")
        model = copy.deepcopy(work) if d == 0 else permuted_draw(work, gen)
        probe, out = run_probe(model, x, grad_hooks=True, capture_inputs=(d == 0))
        loss = loss_fn(out, targets)
        loss.backward()
        rows.append([float(probe.grad_sq.get(n, torch.tensor(float("nan")))) for n in names])
        if d == 0:
            captured = probe.inputs
        del model, probe, out, loss
    values = np.asarray(rows, dtype=np.float64)
    mean = values.mean(0)
    L = len(names)
    first, last = (2, L - 1) if L >= 4 else (1, L)
    notes = []
    rate = ci = growth = None
    fit_ok = L >= 2 and np.all(np.isfinite(values[:, first - 1:last])) and np.all(mean[first - 1:last] > 0)
    if fit_ok:
        fit = fit_geometric_rate(values, first, last, invert=True, n_boot=1000, seed=seed)
        rate, ci = float(fit.rate), (float(fit.ci_low), float(fit.ci_high))
        growth = float(mean[first - 1] / mean[last - 1])
    elif L >= 2:
        notes.append("some layers have a zero or non-finite gradient norm: no rate fitted")
    depth = structure.depth
    max_measured = None
    if rate is not None:
        max_measured = float(max_trainable_depth(rate)) if rate > 0 else None
    kw, reason, basis = _theory_inputs(structure)
    theory_rate = max_theory = None
    knobs = ()
    if kw is not None:
        try:
            res = _analyze(kw)
            theory_rate, max_theory = res.grad_explosion_rate, res.max_trainable_depth
            if theory_rate is None:
                reason = "; ".join(res.warnings) or "the theory returned no rate"
                basis = None
            else:
                knobs = _knobs(kw, max_theory)
        except ValueError as exc:
            reason, basis = f"theory not available: {exc}", None
    from_theory = theory_rate is not None and basis == "theorem"
    used = max_theory if from_theory else max_measured
    used_from = "mean field, a theorem for this network" if from_theory else "measured rate"
    rate_txt = "" if rate is None else f"measured {rate:.3g} per layer [{ci[0]:.3g}, {ci[1]:.3g}]"
    theory_txt = "" if theory_rate is None else f"mean field λ_G↓ = {theory_rate:.4g} ({basis})"
    both = "; ".join(t for t in (rate_txt, theory_txt) if t) or "no rate"
    if not from_theory and rate is not None and rate < 1.0:
        # vanishing towards the input: the same e^16 criterion as 16ξ, for the shrinking direction
        limit = 16.0 / -math.log(rate)
        trainable = depth <= limit
        verdict = (f"gradients shrink towards the input ({both}); over {depth} layers by "
                   f"{rate ** depth:.3g}×: " + ("not enough to stall training (16/|log λ| = "
                                                 f"{limit:.1f} layers)" if trainable else
                                                 f"the first layers barely learn (16/|log λ| = {limit:.1f} < {depth})"))
    elif used is None or math.isinf(used):
        trainable = True if (rate is not None or theory_rate is not None) else None
        verdict = (f"no gradient explosion ({both}): depth {depth} is not limited by it" if trainable
                   else "gradient norms could not be fitted (see notes)")
    else:
        trainable = depth <= used
        verdict = (f"depth {depth} {'≤' if trainable else '>'} 16ξ = {used:.1f} ({used_from}; {both}): "
                   + ("within the trainable depth" if trainable else "expect SGD to fail (Yang et al. 2019 §4)"))
        better = [k for k in knobs if k.max_trainable_depth is not None and k.max_trainable_depth > used
                  and "collapses" not in k.effect]
        if not trainable and better:
            k = max(better, key=lambda k: k.max_trainable_depth)
            verdict += f"; {k.name} {k.current:g} → {k.suggested:g} gives 16ξ = {k.max_trainable_depth:.1f}"
    return GradientAdvice(
        layers=tuple(x.label for x in structure.layers), values=tuple(tuple(r) for r in values.tolist()),
        mean=tuple(mean.tolist()), draws=int(draws), fit_layers=(first, last), rate=rate, rate_ci=ci, growth=growth,
        depth=depth, max_depth_measured=max_measured, theory_rate=theory_rate, max_depth_theory=max_theory,
        theory_basis=basis, theory_reason=reason, theory_inputs=kw or {}, trainable=trainable, verdict=verdict,
        knobs=knobs, notes=tuple(notes)), captured
