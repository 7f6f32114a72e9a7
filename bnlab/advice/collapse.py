"""Part 4 of the advice: rank collapse of the representations (Daneshmand et al. 2020).

Measured on the batch at initialization (the same forward pass as the gradient part's first draw, BN with
the batch's statistics): the representation H entering every weight layer but the first (d × N: d
features per sample, N samples) — :func:`bnlab.rank.rank_measures` on H rescaled to tr M = d
(:func:`bnlab.rank.rescale_to_unit_trace`, the scale BN gives): the soft rank rank_τ (Eq. 3, τ = ½), the
bound r(H) = tr(M)²/‖M‖²_F (Eq. 4) and the numerical rank.  Since r(H) ≤ rank(H) ≤ min(d, N), a representation
with min(d, N) ≤ 2 (a batch of two samples) fails r(H) < 2 at full rank too: it is not judged.

Flags: BN keeps rank_τ ≥ Ω(√d) at any depth (Thm 2, linear networks), while vanilla linear networks
collapse to rank one (Lemma 3).  A layer is *collapsed* when r(H) < 2 (one direction carries most of the
batch) and *below √d* when rank_τ < √min(d, N) (the rank of H cannot exceed N).  The verdict reads the
last hidden representation H_L (what the output layer sees; the paper's Fig. 1) — or, after a global average
pooling, the last representation before it (a spatial mean keeps the features' common mean and little else, so
its r(H) is near 1 in any healthy conv net) — and gives the remedies where it collapses: BN, BN without centering (the paper's Eq. 2), or rank-raising pre-training
(:func:`bnlab.rank.rank_pretrain`, Algorithm 1).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bnlab.advice.structure import Structure

__all__ = ["RankAdvice", "COLLAPSE_R", "NOT_JUDGED"]

#: r(H) below this: one direction carries most of the batch's energy (r(H) = 1 for a rank-one H).
COLLAPSE_R = 2.0
#: The status of a representation with min(d, N) ≤ 2, where r(H) ≤ min(d, N) cannot pass the criterion.
NOT_JUDGED = "not judged (min(d, N) ≤ 2)"


@dataclass(frozen=True)
class RankAdvice:
    """Per-layer rank measures of the representations entering each weight layer, and a verdict."""

    layers: tuple
    width: tuple  # d per layer
    batch: int  # N
    soft_rank: tuple
    r_bound: tuple
    numerical_rank: tuple
    reference: tuple  # √min(d, N)
    status: tuple  # "ok", "below √d", "collapsed", or NOT_JUDGED (min(d, N) ≤ 2)
    collapsed: bool
    basis: str
    verdict: str
    remedies: tuple = ()

    def to_dict(self) -> dict:
        return asdict(self)


def _nothing_judged(layers, r, pooled, status) -> str:
    """The verdict where no measured representation can be judged: e.g. one conv layer, global average pooling,
    the head — the only measured representation is the pooled one, whose r(H) near 1 is what pooling gives
    (module docstring) — or representations with min(d, N) ≤ 2."""
    why = []
    if any(pooled):
        i = pooled.index(True)
        why.append(f"the measured representations follow global average pooling ({layers[i]}: r(H) = {r[i]:.3g}; "
                   "the mean over positions dominates every sample's features — what pooling does, not collapse)")
    narrow = [layers[i] for i, st in enumerate(status) if st == NOT_JUDGED]
    if narrow:
        why.append(f"{', '.join(narrow[:3])}{' …' if len(narrow) > 3 else ''}: min(d, N) ≤ 2, where r(H) < 2 "
                   "holds at full rank too")
    return ("rank collapse not judged: " + "; ".join(why) + ". No other representation is measured (the first "
            "weight layer's input is the data)")


def rank_part(captured: dict, structure: Structure) -> RankAdvice:
    import torch

    from bnlab.rank import rank_measures, rescale_to_unit_trace

    layers, width, soft, r, num, ref, status, pooled = [], [], [], [], [], [], [], []
    n = structure.batch_size
    for layer in structure.layers:
        h = captured.get(layer.name)
        if h is None or layer.index == 1:
            continue
        if h.shape[0] != n:
            continue
        H = h.reshape(n, -1).transpose(0, 1).to(torch.float64)
        if not bool(torch.isfinite(H).all()):
            continue
        m = rank_measures(rescale_to_unit_trace(H), tau=0.5)
        d = int(H.shape[0])
        layers.append(f"input of {layer.label}")
        pooled.append(layer.input_source == "global_pool")
        width.append(d)
        soft.append(int(m.soft_rank))
        r.append(float(m.rank_lower_bound))
        num.append(int(m.numerical_rank))
        reference = math.sqrt(min(d, n))
        ref.append(reference)
        if min(d, n) <= COLLAPSE_R:
            # r(H) ≤ rank(H) ≤ min(d, N): with two samples (or two features) r(H) < 2 holds at full rank too, so
            # the criterion says nothing there
            status.append(NOT_JUDGED)
        else:
            status.append("collapsed" if r[-1] < COLLAPSE_R else "below √d" if soft[-1] < reference else "ok")
    hidden = structure.layers[:-1]
    linear = all(x.activation in (None, "identity") for x in hidden) and all(x.kind == "fc" for x in structure.layers)
    norms = {x.norm for x in hidden}
    basis = ("theorem" if linear and norms <= {"batchnorm", "batchnorm_no_mean"} and norms else
             "theorem" if linear and norms == {None} else "extrapolation")
    if not layers:
        return RankAdvice((), (), n, (), (), (), (), (), False, basis,
                          "no hidden representation to measure (a single weight layer, or N < 2)")
    if n <= COLLAPSE_R:
        return RankAdvice(tuple(layers), tuple(width), n, tuple(soft), tuple(r), tuple(num), tuple(ref), tuple(status),
                          False, basis,
                          f"N = {n} samples: rank collapse cannot be judged at this batch size — r(H) ≤ min(d, N) ≤ {n}, "
                          f"so the collapse criterion r(H) < {COLLAPSE_R:g} holds even at full rank (measured: rank_τ = {soft[-1]}, "
                          f"numerical rank {num[-1]} at {layers[-1]}); measure with a batch of at least 3 samples")
    judged = [i for i in range(len(layers)) if not pooled[i] and status[i] != NOT_JUDGED]
    if not judged:
        return RankAdvice(tuple(layers), tuple(width), n, tuple(soft), tuple(r), tuple(num), tuple(ref), tuple(status),
                          False, basis, _nothing_judged(layers, r, pooled, status))
    last = judged[-1]
    collapsed = status[last] == "collapsed"
    low = status[last] == "below √d"
    what = ("last representation before global pooling" if any(pooled[last + 1:]) else
            "last hidden representation" if last == len(layers) - 1 else "last judged representation")
    head = (f"{what} ({layers[last]}, d = {width[last]}, N = {n}): rank_τ = {soft[last]}, "
            f"r(H) = {r[last]:.3g}, numerical rank {num[last]}")
    remedies = ()
    if collapsed or low:
        verdict = (head + (": rank collapse — the batch is mapped to about one direction; expect slow or failed "
                           "training (Daneshmand et al. 2020, §4)" if collapsed else
                           f": below √min(d, N) = {ref[last]:.1f}, the level BN keeps (Thm 2)"))
        remedies = ("BN after the hidden layers (Thm 2: rank_τ = Ω(√d) at any depth); BN without centering keeps "
                    "the guarantee (bnlab.nets.make_norm('bn_nomean', width))",
                    "rank-raising pre-training before training: bnlab.rank.rank_pretrain(model, x, layer='layerwise') "
                    "(Algorithm 1)")
    else:
        verdict = head + f": no collapse (≥ √min(d, N) = {ref[last]:.1f})"
    inner = [layers[i] for i, st in enumerate(status) if st == "collapsed" and not pooled[i] and i != last]
    if inner and not collapsed:
        verdict += f"; collapsed inside the network: {', '.join(inner[:3])}{' …' if len(inner) > 3 else ''}"
    if any(pooled):
        i = pooled.index(True)
        verdict += (f". After global average pooling ({layers[i]}) r(H) = {r[i]:.3g}: the mean over positions "
                    "dominates every sample's features — what pooling does, not judged as collapse")
    return RankAdvice(tuple(layers), tuple(width), n, tuple(soft), tuple(r), tuple(num), tuple(ref), tuple(status),
                      bool(collapsed), basis, verdict, remedies)
