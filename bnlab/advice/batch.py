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
batch-statistics layers, with and without the preconditioner, at the user's batch, in interleaved rounds of
many steps each until each side has run half a second (one thread's CPU time, torch on one thread; on a GPU
synchronized wall time: :func:`measure_bnp_overhead`, :func:`interleaved_ratio`); the figure is the median of
the rounds' ratios, shown with their quartiles.
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


#: The BNP/SGD timing (:func:`interleaved_ratio`): one round runs each variant for about ``ROUND_SECONDS``
#: (enough steps that the clock's resolution and a scheduler slice are small against it), and rounds go on
#: until each variant has run ``MIN_TOTAL_SECONDS`` and at least ``MIN_ROUNDS`` rounds (at most ``MAX_ROUNDS``).
#: The audit found the old figure (median of 3 single steps) ranging 0.01× … 14.8× on one small MLP.
ROUND_SECONDS = 0.02
MIN_TOTAL_SECONDS = 0.5
MIN_ROUNDS = 5
MAX_ROUNDS = 200
MAX_STEPS_PER_ROUND = 1000


def interleaved_ratio(step_a, step_b, *, clock=time.process_time, round_seconds: float = ROUND_SECONDS,
                      min_total_seconds: float = MIN_TOTAL_SECONDS, min_rounds: int = MIN_ROUNDS,
                      max_rounds: int = MAX_ROUNDS) -> tuple[float | None, dict]:
    """(median over rounds of the per-step time of ``step_b`` / that of ``step_a``, details).

    ``step_a()`` and ``step_b()`` each run one step.  One untimed step of each first (allocations, hooks), then
    timed batches of 1, 2, 4, … steps of ``step_a`` set the steps per round n (about ``round_seconds`` of
    ``clock``; at most ``MAX_STEPS_PER_ROUND``).  Each round times n steps of both, in alternating order (a load change or a warm
    cache favours neither side), and gives one ratio; rounds continue until both have run ``min_total_seconds``
    in all and at least ``min_rounds`` rounds have run, or ``max_rounds``.  The median of the rounds' ratios is
    the figure; its quartiles show the spread.  None where no round measured a positive time for ``step_a``.
    """
    def timed(step, n):
        t0 = clock()
        for _ in range(n):
            step()
        return clock() - t0

    step_a()
    step_b()
    # steps per round: double until a batch of steps takes half a round (one step alone is too short to time),
    # then scale to a whole round
    n = 1
    while True:
        spent = timed(step_a, n)
        if spent >= round_seconds / 2 or n >= MAX_STEPS_PER_ROUND:
            break
        n = min(2 * n, MAX_STEPS_PER_ROUND)
    if spent > 0:
        n = max(1, min(MAX_STEPS_PER_ROUND, round(n * round_seconds / spent)))

    per_a, per_b, ratios = [], [], []
    total_a = total_b = 0.0
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or min(total_a, total_b) < min_total_seconds):
        if rounds % 2 == 0:
            a, b = timed(step_a, n), timed(step_b, n)
        else:
            b, a = timed(step_b, n), timed(step_a, n)
        rounds += 1
        total_a, total_b = total_a + a, total_b + b
        per_a.append(a / n)
        per_b.append(b / n)
        if a > 0:
            ratios.append(b / a)
    detail = {"rounds": rounds, "steps_per_round": n, "sgd_step_s": statistics.median(per_a),
              "bnp_step_s": statistics.median(per_b), "timed_s": total_a + total_b}
    if not ratios:
        return None, detail
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    detail["ratio_quartiles"] = (q[0], q[2])
    return statistics.median(ratios), detail


def _step_fn(model, x, targets, loss_fn, pre):
    """One SGD step of ``model`` (a negligible lr: the timed steps barely move it), preconditioned by ``pre``."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), targets).backward()
        if pre is not None:
            pre.step()
        opt.step()
    return step


def measure_bnp_overhead(work, x, targets, loss_fn, *, clock=None, **timing) -> tuple[float | None, dict]:
    """(BNP step / SGD step, details) on copies of ``work`` without its batch-statistics layers: SGD steps with and
    without :class:`bnlab.optim.BNPreconditioner`, timed by :func:`interleaved_ratio` (``timing`` goes to it).

    Default clock on CPU: this thread's CPU time, with torch on one thread for the timing (restored after).  On a
    shared machine wall time would add the other jobs' load and the scheduler's preemptions to whichever side
    ran at the busier moment, and process CPU time with several torch threads adds their varying spin-waits
    (measured: 0.7–4.8× quartiles on a 3-layer MLP at B = 8, against 1.8–2.0× on one thread).  On a GPU: wall
    time, synchronized.  A small batch (where this is measured) runs on one core in practice too."""
    import torch

    from bnlab.optim import BNPreconditioner

    plain, removed = without_batch_norm(work)
    plain.train()
    with_bnp, _ = without_batch_norm(work)
    with_bnp.train()
    try:
        pre = BNPreconditioner(with_bnp)
    except ValueError as exc:
        return None, {"error": str(exc)}
    cuda = x.device.type == "cuda"
    if clock is None:
        if cuda:
            def clock():
                torch.cuda.synchronize(x.device)
                return time.perf_counter()
            what = "wall time, synchronized"
        else:
            clock, what = time.thread_time, "CPU time of one thread"
    else:
        what = getattr(clock, "__name__", repr(clock))
    threads = torch.get_num_threads()
    try:
        if not cuda:
            torch.set_num_threads(1)
        ratio, detail = interleaved_ratio(_step_fn(plain, x, targets, loss_fn, None),
                                          _step_fn(with_bnp, x, targets, loss_fn, pre), clock=clock, **timing)
    finally:
        torch.set_num_threads(threads)
        pre.remove()
    detail.update(removed_layers=removed, clock=what)
    return ratio, detail


def _overhead_text(overhead: float, detail: dict) -> str:
    lo, hi = detail.get("ratio_quartiles", (overhead, overhead))
    return (f"BNP costs {overhead:.2f}× an SGD step on this model (measured: median of {detail['rounds']} "
            f"interleaved rounds of {detail['steps_per_round']} steps each, {detail['clock']}; quartiles "
            f"{lo:.2f}–{hi:.2f}×)")


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
        verdict += "; " + _overhead_text(overhead, detail)
    return BatchSizeAdvice(batch_size=b, small=small, norm_layers=tuple(rows), bnp_supported=supported,
                           bnp_unsupported=tuple(unsupported), bnp_code=BNP_CODE, bn_layers_must_go=must_go,
                           bnp_overhead=overhead, bnp_overhead_detail=detail, verdict=verdict, notes=tuple(notes))
