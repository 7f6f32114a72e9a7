"""Training in chunks, one network at a time or as one batched ensemble, with the same numbers either way.

Some figures measure their networks *during* training — Daneshmand et al.'s r(H_L) and gradient
alignment at tracked steps (Figs. 6, 10, 12), Lange et al.'s test accuracy after every epoch (Figs.
3–5).  :func:`bnlab.nets.train_ensemble` trains many networks at once but takes no callbacks, so at
``paper`` scale these figures train in *chunks*: the steps between two measurements are one call,
after which every network is measured; the next chunk continues from the written-back weights.

The procedure, which both routes of :func:`train_in_chunks` follow:

* chunk i (steps ``bounds[i-1] … bounds[i]``) draws its batches from a fresh permutation seeded with
  :func:`chunk_seed` ``(seed, i)`` (chunk 0 with ``seed`` itself), as :func:`bnlab.nets.train` draws
  from its ``seed`` — so within a chunk the data order is train()'s, and a chunk that spans whole
  epochs reshuffles every epoch;
* plain SGD (no momentum: the optimizer has no state to carry from one chunk to the next) with a
  per-network learning rate; BN's running statistics carry over in the networks' buffers;
* a network whose loss stops being finite stops there (it is left out of the later chunks) and
  reports the step as train() reports it, offset by the chunk's first step.

``ensemble=False`` runs each chunk with :func:`bnlab.nets.train`, network by network;
``ensemble=True`` with one :func:`bnlab.nets.train_ensemble` call over the networks still training —
the same numbers to the rounding of batched products (``tests/reproductions/test_paper_scale.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["chunk_seed", "ChunkedResult", "train_in_chunks"]


def chunk_seed(seed: int, chunk: int) -> int:
    """The data-order seed of chunk ``chunk`` of a network seeded ``seed``: ``seed + 1 000 000 · chunk``."""
    return int(seed) + 1_000_000 * int(chunk)


@dataclass
class ChunkedResult:
    """One network's chunked training: the per-step losses, where it stopped, and each chunk's end."""

    history: list[float] = field(default_factory=list)
    steps: int = 0  # steps taken (as train() counts them for a diverged network)
    diverged_at_step: int | None = None
    chunks: list[dict] = field(default_factory=list)  # per finished chunk: end step, mean loss, test accuracy

    @property
    def diverged(self) -> bool:
        return self.diverged_at_step is not None

    @property
    def final_train_loss(self) -> float:
        """Mean of the last 50 losses (NaN after a divergence), as :class:`bnlab.nets.TrainResult`'s."""
        return float("nan") if self.diverged or not self.history else float(np.mean(self.history[-50:]))


def train_in_chunks(
    models: Sequence[Any],
    train_data: Any,
    bounds: Sequence[int],
    *,
    lrs: Sequence[float],
    seeds: Sequence[int],
    batch_size: int,
    device: str = "cpu",
    ensemble: bool = True,
    test_data: Any = None,
    after_chunk: Callable[[int, int], None] | None = None,
) -> list[ChunkedResult]:
    """Train ``models`` (in place) by SGD through the chunks ending at ``bounds`` (see the module docstring).

    Parameters
    ----------
    models, lrs, seeds:
        The networks (one architecture when ``ensemble``), each one's learning rate and data-order seed.
    train_data, test_data:
        As :func:`bnlab.nets.train`; with ``test_data`` each chunk ends with a test pass (BN on running
        statistics) whose accuracy is in ``chunks[i]["test_accuracy"]``.
    bounds:
        The step at which each chunk ends, increasing; the last is the training length.
    after_chunk:
        ``after_chunk(k, step)`` after every chunk, for each network ``k`` still training (its weights
        are then those after ``step`` steps), e.g. to measure it.
    """
    import functools

    import torch

    from bnlab._validation import check_int
    from bnlab.nets import train, train_ensemble

    m = len(models)
    if not (len(lrs) == len(seeds) == m) or m == 0:
        raise ValueError(f"models, lrs and seeds must have one equal, non-zero length; got {m}, {len(lrs)}, {len(seeds)}")
    bounds = [check_int("bounds[i]", b, minimum=1) for b in bounds]
    if not bounds or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds={bounds!r} is not allowed: expected increasing step counts")
    results = [ChunkedResult() for _ in range(m)]
    start = 0
    for i, end in enumerate(bounds):
        active = [k for k in range(m) if not results[k].diverged]
        if not active:
            break
        n = end - start
        kw = dict(batch_size=batch_size, steps=n, test_data=test_data, device=device)
        if ensemble:
            runs = train_ensemble([models[k] for k in active], train_data, lr=[float(lrs[k]) for k in active],
                                  seeds=[chunk_seed(seeds[k], i) for k in active], **kw)
        else:
            runs = [train(models[k], train_data, optimizer=functools.partial(torch.optim.SGD, lr=float(lrs[k])),
                          seed=chunk_seed(seeds[k], i), **kw) for k in active]
        for k, r in zip(active, runs):
            res = results[k]
            res.history.extend(float(v) for v in r.history)
            res.steps = start + r.steps
            if r.diverged and r.diverged_at_step is not None:
                res.diverged_at_step = start + r.diverged_at_step
                continue
            loss = [float(v) for v in r.history]
            res.chunks.append({"step": end, "train_loss": float(np.mean(loss)) if loss else float("nan"),
                               "test_accuracy": r.test_accuracy if test_data is not None else None})
            if r.diverged:  # a non-finite test pass (train() reports it as diverged without a step)
                res.diverged_at_step = end
                continue
            if after_chunk is not None:
                after_chunk(k, end)
        start = end
    return results
