"""Part 5 of the advice: the batch size, what BN's statistics do at it, and BNP (Lange et al.).

BN normalizes every channel with the mean and variance of n values: the B samples times the spatial
positions of a conv layer (the ghost batch instead of B for ghost BN).  For Gaussian values the relative
standard deviation of the sample variance is √(2/(n − 1)) (its (n − 1)·s²/σ² is χ²_{n−1}); at n = 1 there
is no variance at all: ``nn.BatchNorm1d`` refuses a batch of one in train mode, and a conv layer
normalizes each image by its own positions (instance normalization, whose statistics the running
averages used at test time do not match).  Small B also raises the gradient explosion rate λ_G↓ (part 2).

BNP (Lange et al., :class:`bnlab.optim.BNPreconditioner`) normalizes the gradients instead of the
activations, so it trains at any batch size — at batch 1 only once the BN layers are gone (they would
still refuse or degenerate).  Its overhead is measured on this model: SGD steps of a copy without its
batch-statistics layers, with and without the preconditioner, at the user's batch, median of
interleaved rounds of process CPU time.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass

from bnlab.advice._probe import BATCH_NORMS
from bnlab.advice.structure import Structure

__all__ = ["BatchSizeAdvice", "SMALL_BATCH", "BNP_CODE", "without_batch_norm"]

#: B at or below which the part calls the batch small (Lange et al. Fig. 4 use 6 and 1; BN "works well
#: for batch sizes as small as 4" for their CNN, not for their FC network).
SMALL_BATCH = 8

BNP_CODE = ("pre = bnlab.optim.BNPreconditioner(model)   # once, on the model without its BN layers\n"
            "loss.backward(); pre.step(); optimizer.step()   # every step: pre.step() between the two")


@dataclass(frozen=True)
class BatchSizeAdvice:
    """BN's statistics at this batch size and BNP as the alternative (part 5)."""

    batch_size: int
    small: bool
    norm_layers: tuple  # (label, kind, values per statistic n, relative noise of the variance √(2/(n−1)) or None)
    bnp_supported: int
    bnp_unsupported: tuple
    bnp_code: str
    bn_layers_must_go: bool
    bnp_overhead: float | None  # BNP step time / SGD step time on the copy without BN
    bnp_overhead_detail: dict
    verdict: str
    notes: tuple = ()

    def to_dict(self) -> dict:
        return asdict(self)


def without_batch_norm(model):
    """A copy of ``model`` with every batch-statistics normalization module replaced by ``nn.Identity``."""
    from torch import nn

    from bnlab.advice._probe import _bnlab_norm_kind

    work = copy.deepcopy(model)
    targets = [name for name, m in work.named_modules()
               if name and (isinstance(m, nn.modules.batchnorm._BatchNorm) or _bnlab_norm_kind(m))]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = work.get_submodule(parent_name) if parent_name else work
        setattr(parent, child, nn.Identity())
    # a model that keeps its norm layers in a plain list attribute (bnlab's nets: ``.norms``) would keep the
    # old modules alive there; they no longer run, so nothing else is needed
    return work, targets


def _time_steps(model, x, targets, loss_fn, pre, rounds: int) -> list[float]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    times = []
    for r in range(rounds + 1):
        t = time.process_time()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), targets).backward()
        if pre is not None:
            pre.step()
        opt.step()
        if r:  # the first step warms up (allocations, hooks)
            times.append(time.process_time() - t)
    return times


def measure_bnp_overhead(work, x, targets, loss_fn, *, rounds: int = 3) -> tuple[float | None, dict]:
    """(BNP step / SGD step, details) on a copy of ``work`` without its batch-statistics layers."""
    from bnlab.optim import BNPreconditioner

    plain, removed = without_batch_norm(work)
    plain.train()
    with_bnp, _ = without_batch_norm(work)
    with_bnp.train()
    try:
        pre = BNPreconditioner(with_bnp)
    except ValueError as exc:
        return None, {"error": str(exc)}
    a, b = [], []
    for _ in range(rounds):  # interleaved: the machine's load hits both sides alike
        a += _time_steps(plain, x, targets, loss_fn, None, 1)
        b += _time_steps(with_bnp, x, targets, loss_fn, pre, 1)
    sgd, bnp = statistics.median(a), statistics.median(b)
    pre.remove()
    return (bnp / sgd if sgd > 0 else None), {"sgd_step_cpu_s": sgd, "bnp_step_cpu_s": bnp, "rounds": rounds,
                                               "removed_layers": removed, "clock": "process CPU time"}


def batch_part(work, x, targets, loss_fn, structure: Structure, probe_events, *, measure_bnp: bool | None,
               progress) -> BatchSizeAdvice:
    from torch import nn

    from bnlab.optim import layer_handlers

    b = structure.batch_size
    small = b <= SMALL_BATCH
    rows = []
    for ev in probe_events:
        if ev.kind != "norm" or ev.info.get("norm") not in BATCH_NORMS:
            continue
        shape = ev.info.get("input_shape") or ()
        spatial = int(math.prod(shape[2:])) if len(shape) > 2 else 1
        per = b * spatial
        if ev.info["norm"] == "ghost_batchnorm":
            module = dict(work.named_modules()).get(ev.name)
            g = getattr(module, "ghost_batch_size", None)
            per = (g or b) * spatial
        noise = math.sqrt(2.0 / (per - 1)) if per > 1 else None
        rows.append((ev.name, ev.info["norm"], per, noise))
    if structure.model == "BNMLP" and not rows:
        n = getattr(work, "sub_batch_size", None) or b
        rows = [(f"BN {i + 1} (inside BNMLP)", "batchnorm", n, math.sqrt(2.0 / (n - 1)) if n > 1 else None)
                for i in range(getattr(work, "depth", 0))]
    handlers = tuple(layer_handlers())
    owners = dict(work.named_modules())
    supported, unsupported = 0, []
    for layer in structure.layers:
        module = owners.get(layer.name.split("#")[0])
        if module is not None and isinstance(module, handlers) and not isinstance(module, nn.Conv3d):
            supported += 1
        else:
            unsupported.append(layer.label)
    has_bn = bool(rows)
    must_go = has_bn and b == 1
    overhead, detail = None, {}
    do_measure = small if measure_bnp is None else bool(measure_bnp)
    notes = []
    if do_measure and supported and structure.model != "BNMLP":
        progress("batch size: timing BNP against SGD on a copy without BN")
        overhead, detail = measure_bnp_overhead(work, x, targets, loss_fn)
    elif do_measure and not supported:
        notes.append("BNP has no layer to precondition in this model (its weights are not in nn.Linear / nn.Conv1d / "
                     "nn.Conv2d modules): no overhead to measure")
    worst = max((r[3] for r in rows if r[3] is not None), default=None)
    one = [r for r in rows if r[2] <= 1]
    if not has_bn:
        verdict = (f"B = {b}: no batch-statistics normalization, so nothing depends on the batch size here"
                   + ("; BNP can still precondition the gradients (Lange et al.)" if supported else ""))
    elif b == 1:
        verdict = (f"B = 1: BN cannot train — {len(one)} of its {len(rows)} layers get one value per statistic "
                   "(BatchNorm1d refuses a batch of one in train mode)" if one else
                   "B = 1: the conv BN layers normalize each image by its own positions (instance normalization), "
                   "and the running statistics used at test time do not match")
        verdict += ("; BNP trains at batch 1, but only without the BN layers (remove them, then the two lines below)"
                    if supported else "")
    elif small:
        verdict = (f"B = {b} is small: the variance BN divides by is noisy (relative spread up to "
                   f"{100 * worst:.0f}% per channel), and gradient explosion grows as B shrinks (part 2); "
                   "BNP is the alternative (Lange et al. Figs. 4-5)" if worst is not None else
                   f"B = {b} is small")
    else:
        verdict = (f"B = {b}: BN's statistics are reliable (relative spread of the variance ≤ {100 * worst:.0f}%); "
                   "no reason to replace BN for the batch size's sake" if worst is not None else f"B = {b}")
    if overhead is not None:
        verdict += f"; BNP costs {overhead:.2f}× an SGD step on this model (measured)"
    return BatchSizeAdvice(batch_size=b, small=small, norm_layers=tuple(rows), bnp_supported=supported,
                           bnp_unsupported=tuple(unsupported), bnp_code=BNP_CODE, bn_layers_must_go=must_go,
                           bnp_overhead=overhead, bnp_overhead_detail=detail, verdict=verdict, notes=tuple(notes))
