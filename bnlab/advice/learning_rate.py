"""Part 3 of the advice: the largest stable learning rate (the Fisher paper, Eq. 7 and Claim 3.1).

Measured (:func:`bnlab.fisher.curvature_spectrum`, matrix-free Lanczos on a copy of the module, BN with
the batch's statistics): the top eigenvalue λmax of the Hessian (or GGN / Fisher) of the user's loss on
the given batch, and η* = 2(1 + μ)/λmax (:func:`bnlab.fisher.eta_star`) — the stability limit of
heavy-ball SGD on the quadratic model of the loss at initialization; η*/2 is that model's fastest rate
(the Fisher paper, footnote 1).

Normalized networks: the weights of a layer whose output goes straight into a normalization with its
own statistics (BN in train mode, LN, GN) are scale-invariant — the loss does not change when they are
scaled — so an unstable step along them only grows their norm, which lowers their effective step
(Arora, Li & Lyu 2019, "Theoretical analysis of auto rate-tuning by batch normalization").  The
parameters that can make the loss explode are the others (the output layer, BN's γ and β, layers not
followed by a normalization): their block of the curvature gives η*_free = 2(1 + μ)/λmax(free block),
which is the limit the verdict uses.  Its mean field counterpart is the Fisher paper's bound in train
mode, where every layer followed by BN drops out (:func:`bnlab.fisher.fisher_order_parameters`,
``bn_mode="train"``): shown beside it where the architecture is one the recursions cover.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from bnlab.advice.structure import Structure

__all__ = ["LearningRateAdvice", "CATAPULT_FACTOR"]

#: Without scale-invariant layers a learning rate above η* can still train: the first steps flatten the
#: network (the "catapult" phase, Lewkowycz et al. 2020, which reports divergence above ≈ 2–6 η* for plain
#: GD and the squared loss); above this many η* the advice expects divergence.
CATAPULT_FACTOR = 4.0


@dataclass(frozen=True)
class LearningRateAdvice:
    """λmax, η* and where the user's learning rate sits (part 3).

    ``lambda_max`` / ``eta_star``: the whole curvature; ``lambda_max_free`` / ``eta_star_free``: the block of
    the parameters outside the scale-invariant layers (None when there are none, or nothing else);
    ``limit``: the η* the verdict uses; ``ratio`` = lr / limit.  ``bound``: the mean field λ̄max and η*
    (Claim 3.1, Eq. 7) in eval and train mode where the recursions cover the architecture.
    """

    curvature: str
    loss: str
    bn_mode: str
    optimizer: str | None
    lr: float | None
    momentum: float
    lambda_max: float
    eta_star: float
    lambda_max_free: float | None
    eta_star_free: float | None
    free_parameters: int
    invariant_parameters: int
    limit: float
    limit_kind: str
    ratio: float | None
    band: str
    verdict: str
    suggested_lr: float
    bound: dict | None
    bound_reason: str
    matvecs: int
    bound_basis: str | None = None  # "theorem" (every assumption of the Fisher paper holds) or "extrapolation"
    notes: tuple = ()
    curvature_loss: str = "custom"

    def to_dict(self) -> dict:
        return asdict(self)

    def at(self, lr: float) -> "LearningRateAdvice":
        """The same measurement placed against another learning rate (no new measurement)."""
        from dataclasses import replace

        from bnlab._validation import check_real

        lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
        ratio, band, verdict = _verdict(lr, self.limit, self.limit_kind, self.eta_star, self.lambda_max_free is not None
                                        and self.invariant_parameters > 0, self.curvature_loss, self.optimizer)
        return replace(self, lr=lr, ratio=ratio, band=band, verdict=verdict)


def _eta(lam: float, mu: float) -> float:
    from bnlab.fisher import eta_star

    return eta_star(lam, mu) if lam > 0 else math.inf


def _arch_spec(structure: Structure) -> tuple[str | None, str]:
    """The Fisher paper's architecture string of this network, or (None, why not)."""
    layers = structure.layers
    if structure.residual_adds or structure.pooling:
        return None, "residual additions or pooling: the recursions cover plain FC/conv stacks"
    hidden = layers[:-1]
    if layers[-1].kind != "fc" or layers[-1].norm is not None:
        return None, "the output layer must be a linear layer without normalization"
    kinds = [x.kind for x in layers]
    if "conv" in kinds[kinds.index("fc"):]:
        return None, "conv layers after FC layers"
    norms = {x.norm for x in hidden}
    if norms not in ({"batchnorm"}, {None}) or (norms == {"batchnorm"} and structure.placement != "pre"):
        return None, "BN before φ after every hidden layer (or no normalization at all) is what the recursions cover"
    if structure.activation_spec is None:
        return None, "no single φ bnlab's theory knows"
    shape = structure.input_shape
    parts = []
    for x in layers:
        if x.kind == "conv":
            k, s, p = x.kernel, x.stride, x.padding
            s = s if isinstance(s, int) else (s[0] if len(set(s)) == 1 else None)
            p = p if isinstance(p, int) else (p[0] if isinstance(p, (tuple, list)) and len(set(p)) == 1 else None)
            if len(k) != 2 or k[0] != k[1] or s is None or p is None:
                return None, f"layer {x.label}: only square 2-d kernels with one stride and one integer padding"
            parts.append(f"c{x.width}k{k[0]}s{s}p{p}")
        else:
            parts.append(f"fc{x.width}")
    if any(x.kind == "conv" for x in layers):
        if len(shape) != 3 or shape[1] != shape[2]:
            return None, f"input shape {shape}: conv recursions need square (C, H, W) inputs"
        return "conv:" + "x".join(map(str, shape)) + "-" + "-".join(parts), ""
    return "fc:" + "-".join([str(int(np.prod(shape)))] + [str(x.width) for x in layers]), ""


def mean_field_bound(structure: Structure, x, momentum: float) -> tuple[dict | None, str]:
    """The Fisher paper's λ̄max and η* for this network in eval and train mode, or (None, why not)."""
    from bnlab.fisher import fisher_order_parameters

    spec, reason = _arch_spec(structure)
    if spec is None:
        return None, reason
    hidden = structure.layers[:-1]
    norm = "bn" if hidden and hidden[0].norm == "batchnorm" else "none"
    flat = x.detach().reshape(x.shape[0], -1).double()
    q0 = float((flat ** 2).sum(1).mean() / flat.shape[1])
    q0xy = float((flat.mean(0) ** 2).sum() / flat.shape[1])
    kw = dict(norm=norm, phi=structure.activation_spec, sigma_w2=[x.sigma_w2 for x in structure.layers],
              sigma_b2=[x.sigma_b2 or 0.0 for x in structure.layers], momentum=momentum, input_q=q0,
              input_q_xy=min(q0xy, q0))
    if norm == "bn":
        kw["gamma"] = [x.gamma if x.gamma else 1.0 for x in hidden]
        kw["beta"] = [x.beta or 0.0 for x in hidden]
    out = {"arch": spec}
    try:
        for mode in ("eval", "train"):
            r = fisher_order_parameters(spec, bn_mode=mode, **kw)
            out[mode] = {"lambda_max": r.lambda_max_bound, "eta_star": r.eta_star}
    except ValueError as exc:
        return None, f"the recursions could not be evaluated: {exc}"
    return out, ""


def _verdict(lr, limit, kind, eta_full, normalized, loss, opt_kind) -> tuple[float | None, str, str]:
    if lr is None:
        return None, "no learning rate given", (f"η* = {limit:.3g} ({kind}); start near η*/2 = {limit / 2:.3g}, "
                                                 "the quadratic model's fastest rate")
    ratio = lr / limit if math.isfinite(limit) else 0.0
    where = f"lr = {lr:.3g} is {ratio:.2g} × η* = {limit:.3g} ({kind})"
    if ratio <= 0.5:
        band, text = "below η*/2", f"{where}: stable; below η*/2 = {limit / 2:.3g}, a larger rate may train faster"
    elif ratio <= 1.0:
        band, text = "η*/2 … η*", f"{where}: stable, in the band [η*/2, η*] the quadratic model calls optimal"
    elif normalized:
        band = "above η*"
        what = ("training to degrade — cross-entropy cannot explode, but it learns slower, down to stalling near "
                "chance" if loss == "cross_entropy" else "the loss to explode")
        text = (f"{where}: the parameters outside the normalized layers are unstable — expect {what}; "
                f"use ≤ {limit:.3g}")
    elif ratio <= CATAPULT_FACTOR:
        band = "η* … 4η*"
        text = (f"{where}: unstable at initialization — the first steps must flatten the network (a catapult, "
                f"Lewkowycz et al. 2020), which networks without normalization may survive; risky, use ≤ {limit:.3g}")
    else:
        band, text = "above 4η*", f"{where}: expect divergence; use ≤ {limit:.3g}"
    if normalized and lr > eta_full and ratio <= 1.0:
        text += (f" (the weights of the normalized layers exceed their own limit {eta_full:.3g}: harmless, their "
                 "norm grows and their effective step shrinks)")
    if opt_kind not in (None, "SGD"):
        text += (f" — note: η* = 2(1+μ)/λmax is the limit of (heavy-ball) SGD; {opt_kind} preconditions its steps, "
                 "so this is a reference, not its limit")
    return ratio, band, text


def _measure(work, x, targets, *, curvature, loss, bn_mode, tol, seed, blocks, progress):
    """(``curvature_spectrum``'s result, a note or ""), measured in the network's dtype and, where that overflows,
    again in float64.  ``curvature_spectrum`` measures a copy converted to ``dtype`` (``work`` itself, already
    the advice's private copy, is not converted), so the user's module is never changed.

    Raises :class:`~bnlab.advice.core.PartNotEvaluated` (this part is then reported as not evaluated and the other
    parts still run) where float64 overflows too, or where Lanczos does not reach ``tol``."""
    import torch

    from bnlab.advice.core import PartNotEvaluated
    from bnlab.fisher import CurvatureOverflowError, LanczosNotConvergedError, curvature_spectrum

    def spectrum(dtype):
        try:
            return curvature_spectrum(work, x, targets, curvature=curvature, loss=loss, bn_mode=bn_mode, tol=tol,
                                      seed=seed, blocks=blocks, dtype=dtype)
        except LanczosNotConvergedError as exc:
            # Lanczos stops after min(P, 300) products; a tol below what the dtype's rounding lets the residual
            # reach (e.g. 1e-12 in float32) is not reached: that is an outcome of this part, not a crash.
            # curvature_spectrum's own hint names its options (maxiter, method), which advise does not take
            raise PartNotEvaluated(f"λmax of the {curvature} was not measured: {str(exc).split(';')[0]}; raise tol "
                                   "(the default 1e-2 gives η* to 1 %)") from None

    own = next(work.parameters()).dtype
    try:
        return spectrum(None), ""
    except CurvatureOverflowError as exc:  # every other ValueError is bad input and is raised as such
        if own == torch.float64:
            raise PartNotEvaluated(f"λmax of the {curvature} was not measured: {exc}") from None
        first = str(exc)
    progress(f"learning rate: the {curvature} overflows {own}; measuring again in float64")
    try:
        res = spectrum(torch.float64)
    except CurvatureOverflowError as exc:
        raise PartNotEvaluated(f"λmax of the {curvature} was not measured: it overflows in {own} and in float64 "
                               f"too ({exc})") from None
    return res, (f"the {curvature} products overflow {own} on this network ({first.split(':')[0]}): λmax was measured "
                 "in float64, on a float64 copy (your module is unchanged)")


def learning_rate_part(work, x, targets, loss_spec, structure: Structure, *, lr, momentum, optimizer_kind,
                       curvature, tol, seed, progress) -> LearningRateAdvice:
    names = [n for n, p in work.named_parameters() if p.requires_grad]
    invariant = {n for layer in structure.layers if layer.scale_invariant for n in layer.params}
    invariant &= set(names)
    free = [n for n in names if n not in invariant]
    sizes = dict((n, p.numel()) for n, p in work.named_parameters())
    curv = curvature if loss_spec.curvature_loss is not None else "fisher"
    closs = loss_spec.curvature_loss or "mse"
    notes = list(loss_spec.notes)
    if loss_spec.curvature_loss is None:
        notes.append(f"loss {loss_spec.label}: bnlab's curvature operator has cross-entropy and ½‖f − y‖² only; "
                     "measured the Fisher (Eq. 10, the GGN of ½‖f − y‖²) instead")
    blocks = {"free": free} if invariant and free else None
    progress(f"learning rate: top eigenvalue of the {curv} ({'two runs' if blocks else 'one run'} of Lanczos)")
    mode = structure.measured_bn_mode
    res, note = _measure(work, x, targets if curv != "fisher" else None, curvature=curv, loss=closs, bn_mode=mode,
                         tol=tol, seed=seed, blocks=blocks, progress=progress)
    if note:
        notes.append(note)
    scale = loss_spec.curvature_scale
    lam = res.lambda_max * scale
    lam_free = res.blocks["free"][0] * scale if blocks else None
    mu = momentum
    eta_full = _eta(lam, mu)
    eta_free = _eta(lam_free, mu) if lam_free is not None else None
    normalized = bool(invariant) and lam_free is not None
    limit = eta_free if normalized else eta_full
    kind = ("the parameters outside the normalized layers" if normalized else f"whole {curv}")
    ratio, band, verdict = _verdict(lr, limit, kind, eta_full, normalized, loss_spec.curvature_loss or "custom",
                                    optimizer_kind)
    from bnlab.advice.structure import FISHER

    bound, reason = mean_field_bound(structure, x, mu)
    if bound is not None and scale != 1.0:
        # the recursions give the Fisher of ½‖f − y‖²; the loss's curvature is ``scale`` times it (nn.MSELoss:
        # 2/K), as the measured λmax above is — both rows then describe the same loss
        for m in ("eval", "train"):
            lam_b = bound[m]["lambda_max"] * scale
            bound[m] = {"lambda_max": lam_b, "eta_star": _eta(lam_b, mu)}
        bound["scale"] = scale
    bound_basis = None if bound is None else ("theorem" if structure.theorem.get(FISHER) else "extrapolation")
    if bound is not None and closs != "mse":
        reason = "the bound is the Fisher of ½‖f − y‖² (Eq. 10); your loss is cross-entropy: a reference only"
    return LearningRateAdvice(
        curvature=curv, loss=loss_spec.label, bn_mode=mode, optimizer=optimizer_kind, lr=lr, momentum=mu,
        lambda_max=float(lam), eta_star=float(eta_full), lambda_max_free=None if lam_free is None else float(lam_free),
        eta_star_free=None if eta_free is None else float(eta_free),
        free_parameters=int(sum(sizes[n] for n in free)), invariant_parameters=int(sum(sizes[n] for n in invariant)),
        limit=float(limit), limit_kind=kind, ratio=ratio, band=band, verdict=verdict, suggested_lr=float(limit / 2),
        bound=bound, bound_reason=reason, matvecs=int(res.matvecs), bound_basis=bound_basis, notes=tuple(notes),
        curvature_loss=loss_spec.curvature_loss or "custom")
