"""Checkpoints of a :func:`~bnlab.nets.train_ensemble` run: an interrupted run goes on where it stopped.

A paper-scale trainability column trains for 10–40 minutes on one GPU (docs/paper-scale.md), longer
than some allocations last (a batch job's time limit, a lent machine's quota, a preempted worker).
Cells are the unit of the results store, so without this a task cut short starts over from step 0.

A checkpoint holds everything the rest of the run depends on:

* every network's parameters and buffers (written back into its model first, so a network the
  stack has dropped at a check is included), as each model's ``state_dict()``;
* the stacked optimizer state (momentum, RMSProp's averages) and the step's per-network vectors
  (rates, mask, first bad step, the caller's index of each stacked row, the current window of
  batch indices);
* the loss history so far, the number of batches drawn from each data order, and torch's random
  state (a module's dropout under ``vmap``).

Resumed, the run computes the numbers the uninterrupted run computes, to rounding
(``tests/nets/test_ensemble_checkpoint.py``: float64, every optimizer and loss, after compaction,
mid-window).

A checkpoint file is trusted no further than it is checked: it is read with
``torch.load(weights_only=True)`` (unpickling runs no code), never through a symbolic link nor from
anything but a regular file, each entry's type, dtype and shape are checked against the run before
anything is loaded into a model, and a file written by another run is refused: its *fingerprint*
hashes the models' initial state and structure, the training data, every option of the run and
bnlab's version.  It is written to a temporary file in the same folder and renamed over the old one
(:func:`bnlab._validation.atomic_output_path`), so a crash while writing leaves the previous one.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from bnlab._validation import atomic_output_path

__all__ = ["FORMAT", "VERSION", "fingerprint", "read", "write", "load_models", "remove", "check_like"]

#: what a checkpoint file says it is (``"format"``) and the layout's version (``"version"``)
FORMAT = "bnlab.train_ensemble"
VERSION = 1


def _feed_tensor(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    h.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


def _plain_attributes(m: nn.Module) -> dict:
    """A module's settings that are not tensors (a BN-MLP's γ, β, ε, depth, ...): its plain attributes,
    without ``training`` (the mode a caller left it in is not part of the run)."""
    return {k: v for k, v in sorted(vars(m).items())
            if k != "training" and not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}


def fingerprint(models: Sequence[nn.Module], tensors: dict[str, torch.Tensor], options: dict) -> str:
    """A hash of everything that makes one run: each model's class, ``repr``, plain attributes and
    initial parameters and buffers (their bytes), ``tensors`` (the training and test data) and the
    run's ``options`` (JSON-able), with bnlab's version and this format's.  Two runs with equal
    fingerprints train the same networks on the same data the same way."""
    from bnlab import __version__

    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps({"format": FORMAT, "version": VERSION, "bnlab": __version__, "options": options},
                        sort_keys=True, default=str).encode())
    for i, m in enumerate(models):
        h.update(json.dumps([i, type(m).__module__, type(m).__qualname__, repr(m), _plain_attributes(m)],
                            default=str).encode())
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            _feed_tensor(h, name, t)
    for name, t in tensors.items():
        _feed_tensor(h, name, t)
    return h.hexdigest()


def _refused(path: Path, why: str) -> ValueError:
    return ValueError(f"checkpoint={str(path)!r} is not allowed: {why}")


def read(path: Path, device: torch.device) -> dict | None:
    """The checkpoint at ``path`` (tensors on ``device``), or None where there is none.

    ``ValueError`` naming ``checkpoint`` for a symbolic link, anything but a regular file, a file
    ``torch.load(weights_only=True)`` cannot read (truncated, not a torch file, a pickle that would
    run code) and a torch file that is not a train_ensemble checkpoint of this version."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO must not hang
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise _refused(path, "it is a symbolic link; a checkpoint is read only from a regular file") from None
        raise _refused(path, f"it cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _refused(path, "it is not a regular file")
        try:
            obj = torch.load(f, map_location=device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 — whatever the file holds, the answer is one ValueError
            raise _refused(path, f"it is not a readable checkpoint ({type(exc).__name__}: {str(exc)[:200]}); "
                                 "remove it to train from the start") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _refused(path, "it is not a train_ensemble checkpoint")
    if obj.get("version") != VERSION:
        raise _refused(path, f"it is a checkpoint of layout version {obj.get('version')!r}; this bnlab reads "
                             f"version {VERSION}")
    if not isinstance(obj.get("fingerprint"), str):
        raise _refused(path, "its fingerprint is missing")
    return obj


def write(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a temporary file in its folder, renamed over it)."""
    with atomic_output_path(path, name="checkpoint") as tmp:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, **payload}, f)
            f.flush()
            os.fsync(f.fileno())


def remove(path: Path) -> None:
    """Remove the checkpoint at ``path`` (a link there is removed, not followed); nothing if there is none."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _same_tensor_kind(saved: Any, own: torch.Tensor) -> bool:
    return isinstance(saved, torch.Tensor) and saved.dtype == own.dtype and saved.shape == own.shape


def load_models(path: Path, models: Sequence[nn.Module], states: Any) -> None:
    """Load each model's saved ``state_dict`` into it, after checking every entry of every one (keys,
    dtypes, shapes), so that a refused file leaves every model as it was."""
    if not isinstance(states, list) or len(states) != len(models):
        raise _refused(path, f"it holds {len(states) if isinstance(states, list) else 'no'} model states for "
                             f"{len(models)} models")
    for i, (m, sd) in enumerate(zip(models, states)):
        own = m.state_dict()
        if not isinstance(sd, dict) or set(sd) != set(own):
            raise _refused(path, f"its state of models[{i}] has other entries than the model")
        for k, v in own.items():
            if not _same_tensor_kind(sd[k], v):
                raise _refused(path, f"its {k!r} of models[{i}] is not a {tuple(v.shape)} {v.dtype} tensor")
    with torch.no_grad():
        for m, sd in zip(models, states):
            m.load_state_dict(sd)


def check_like(path: Path, what: str, saved: Any, own: Any) -> None:
    """``ValueError`` unless ``saved`` has the structure of ``own``: a tensor of its dtype and shape, a list
    of such (same length) or None where ``own`` is None."""
    if own is None:
        if saved is not None:
            raise _refused(path, f"its {what} is given where this run keeps none")
    elif isinstance(own, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(own):
            raise _refused(path, f"its {what} does not hold {len(own)} tensors")
        for j, (s, o) in enumerate(zip(saved, own)):
            check_like(path, f"{what}[{j}]", s, o)
    elif not _same_tensor_kind(saved, own):
        raise _refused(path, f"its {what} is not a {tuple(own.shape)} {own.dtype} tensor")
