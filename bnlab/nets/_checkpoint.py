"""Checkpoints of a training run: an interrupted run goes on where it stopped.

A paper-scale trainability column trains for 10–40 minutes on one GPU, a paper-scale ResNet of Lange et
al. for hours (docs/paper-scale.md): longer than some allocations last (a batch job's time limit, a lent
machine's quota, a preempted worker).  Cells are the unit of the results store, so without this a task
cut short starts over from step 0.  Both trainers keep checkpoints:

* :func:`~bnlab.nets.train_ensemble` (:class:`EnsembleCheckpointer`): every network's parameters and
  buffers (written back into its model first, so a network the stack has dropped at a check is
  included), as each model's ``state_dict()``; the stacked optimizer state (momentum, RMSProp's
  averages) and the step's per-network vectors (rates, mask, first bad step, the caller's index of each
  stacked row, the current window of batch indices); the loss history so far, the number of batches
  drawn from each data order, and torch's random state (a module's dropout under ``vmap``);
* :func:`~bnlab.nets.train` (:class:`TrainCheckpointer`): the model's and the optimizer's
  ``state_dict()``; the ``state_dict()`` of every hook, callback and ``transform`` (each must have
  ``state_dict``/``load_state_dict``: a BNP preconditioner's running statistics, an augmentation's
  generator); the loss history, the end-of-epoch rows and torch's random state.  The data order
  continues from the step count (:func:`bnlab.nets.train._batches`).

Resumed, the run computes the numbers the uninterrupted run computes, to rounding
(``tests/nets/test_ensemble_checkpoint.py``: float64, every optimizer and loss, after compaction,
mid-window; ``tests/nets/test_train_checkpoint.py``: momentum, weight decay, BNP, augmentation, the
epoch tests).

A checkpoint file is trusted no further than it is checked: it is read with
``torch.load(weights_only=True)`` (unpickling runs no code), never through a symbolic link nor from
anything but a regular file, each entry's type, dtype and shape are checked against the run (the
models' entries before any model is set to them; the rest against the run built from them, a refusal
giving the models back the state they were given in), and a file written by another run is refused:
its *fingerprint* hashes the models' initial state and structure, the training data, every option of
the run and bnlab's version.  It is written to a temporary file in the same folder and renamed over the old one
(:func:`bnlab._validation.atomic_output_path`), so a crash while writing leaves the previous one.

:class:`Checkpointer` is what a trainer holds for one run (when to save, resuming, the end); the run's
own state goes in and out through the trainer (``_EnsembleRun.checkpoint_state`` / ``restore``;
:func:`bnlab.nets.train`'s loop).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import os
import stat
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from bnlab._validation import atomic_output_path, check_path, check_real

_log = logging.getLogger("bnlab.nets")

__all__ = ["FORMATS", "VERSION", "Checkpointer", "EnsembleCheckpointer", "TrainCheckpointer", "CheckpointError",
           "fingerprint", "read", "write", "load_models", "remove", "check_like", "refused", "same_kind"]

#: what a checkpoint file says it is (``"format"``), by the trainer that writes it, and the layout's
#: version (``"version"``)
FORMATS = {"train_ensemble": "bnlab.train_ensemble", "train": "bnlab.train"}
VERSION = 1


def _feed_tensor(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    h.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


def _feed_state(h: "hashlib._Hash", name: str, obj: Any) -> None:
    """Feed a ``state_dict()``-like value (tensors, mappings, sequences, plain values) to ``h``; another
    object by its type's name only (its ``repr`` may hold a memory address: not the same in another process)."""
    if isinstance(obj, torch.Tensor):
        _feed_tensor(h, name, obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            _feed_state(h, f"{name}.{k!r}", obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(json.dumps([name, type(obj).__name__, len(obj)]).encode())
        for i, v in enumerate(obj):
            _feed_state(h, f"{name}[{i}]", v)
    elif isinstance(obj, (bool, int, float, str, type(None))):
        h.update(json.dumps([name, obj]).encode())
    else:
        h.update(json.dumps([name, type(obj).__module__, type(obj).__qualname__]).encode())


def _name_of(fn: Any) -> str:
    """A callable's module and qualified name (its type's for an object), the same in every process."""
    if isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    own = getattr(fn, "__qualname__", None)
    if isinstance(own, str) and not isinstance(fn, type):
        return f"{getattr(fn, '__module__', '?')}.{own}"
    return f"{type(fn).__module__}.{type(fn).__qualname__}"


def _plain_attributes(m: nn.Module) -> dict:
    """A module's settings that are not tensors (a BN-MLP's γ, β, ε, depth, ...): its plain attributes,
    without ``training`` (the mode a caller left it in is not part of the run)."""
    return {k: v for k, v in sorted(vars(m).items())
            if k != "training" and not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))}


def fingerprint(models: Sequence[nn.Module], tensors: dict[str, torch.Tensor], options: dict,
                kind: str = "train_ensemble", states: Sequence[dict] | None = None) -> str:
    """A hash of everything that makes one run: each model's class, ``repr``, plain attributes and
    initial parameters and buffers (their bytes; ``states``: each model's initial ``state_dict()`` where
    the models have trained since), ``tensors`` (the training and test data) and the run's ``options``
    (JSON-able), with bnlab's version and this format's.  Two runs with equal fingerprints train the
    same networks on the same data the same way."""
    from bnlab import __version__

    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps({"format": FORMATS[kind], "version": VERSION, "bnlab": __version__, "options": options},
                        sort_keys=True, default=str).encode())
    for i, m in enumerate(models):
        h.update(json.dumps([i, type(m).__module__, type(m).__qualname__, repr(m), _plain_attributes(m)],
                            default=str).encode())
        own = [*m.named_parameters(), *m.named_buffers()] if states is None else list(states[i].items())
        for name, t in own:
            _feed_tensor(h, name, t)
    for name, t in tensors.items():
        _feed_tensor(h, name, t)
    return h.hexdigest()


class CheckpointError(ValueError):
    """A checkpoint file that cannot be resumed from (a ``ValueError`` naming ``checkpoint``)."""


def refused(path: Path, why: str) -> CheckpointError:
    """The error for a checkpoint at ``path`` that cannot be resumed from, saying ``why``."""
    return CheckpointError(f"checkpoint={str(path)!r} is not allowed: {why}")


def read(path: Path, device: torch.device, kind: str = "train_ensemble") -> dict | None:
    """The checkpoint at ``path`` (tensors on ``device``), or None where there is none.

    ``ValueError`` naming ``checkpoint`` for a symbolic link, anything but a regular file, a file
    ``torch.load(weights_only=True)`` cannot read (truncated, not a torch file, a pickle that would
    run code) and a torch file that is not a checkpoint of ``kind`` (the trainer) of this version."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO must not hang
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise refused(path, "it is a symbolic link; a checkpoint is read only from a regular file") from None
        raise refused(path, f"it cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise refused(path, "it is not a regular file")
        try:
            obj = torch.load(f, map_location=device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 — whatever the file holds, the answer is one ValueError
            raise refused(path, f"it is not a readable checkpoint ({type(exc).__name__}: {str(exc)[:200]}); "
                                 "remove it to train from the start") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMATS[kind]:
        raise refused(path, f"it is not a {kind} checkpoint")
    if obj.get("version") != VERSION:
        raise refused(path, f"it is a checkpoint of layout version {obj.get('version')!r}; this bnlab reads "
                             f"version {VERSION}")
    if not isinstance(obj.get("fingerprint"), str):
        raise refused(path, "its fingerprint is missing")
    return obj


def write(path: Path, payload: dict, kind: str = "train_ensemble") -> None:
    """Write ``payload`` (a checkpoint of ``kind``, the trainer) to ``path`` atomically (a temporary file in
    its folder, renamed over it)."""
    with atomic_output_path(path, name="checkpoint") as tmp:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMATS[kind], "version": VERSION, **payload}, f)
            f.flush()
            os.fsync(f.fileno())


def remove(path: Path) -> None:
    """Remove the checkpoint at ``path`` (a link there is removed, not followed); nothing if there is none."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def same_kind(saved: Any, own: torch.Tensor) -> bool:
    """Whether ``saved`` is a tensor of ``own``'s dtype and shape."""
    return isinstance(saved, torch.Tensor) and saved.dtype == own.dtype and saved.shape == own.shape


def load_models(path: Path, models: Sequence[nn.Module], states: Any) -> None:
    """Load each model's saved ``state_dict`` into it, after checking every entry of every one (keys,
    dtypes, shapes), so that a refused file leaves every model as it was."""
    if not isinstance(states, list) or len(states) != len(models):
        raise refused(path, f"it holds {len(states) if isinstance(states, list) else 'no'} model states for "
                             f"{len(models)} models")
    for i, (m, sd) in enumerate(zip(models, states)):
        own = m.state_dict()
        if not isinstance(sd, dict) or set(sd) != set(own):
            raise refused(path, f"its state of models[{i}] has other entries than the model")
        for k, v in own.items():
            if not same_kind(sd[k], v):
                raise refused(path, f"its {k!r} of models[{i}] is not a {tuple(v.shape)} {v.dtype} tensor")
    with torch.no_grad():
        for m, sd in zip(models, states):
            m.load_state_dict(sd)


def check_like(path: Path, what: str, saved: Any, own: Any) -> None:
    """``ValueError`` unless ``saved`` has the structure of ``own``: a tensor of its dtype and shape, a list
    of such (same length) or None where ``own`` is None."""
    if own is None:
        if saved is not None:
            raise refused(path, f"its {what} is given where this run keeps none")
    elif isinstance(own, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(own):
            raise refused(path, f"its {what} does not hold {len(own)} tensors")
        for j, (s, o) in enumerate(zip(saved, own)):
            check_like(path, f"{what}[{j}]", s, o)
    elif not same_kind(saved, own):
        raise refused(path, f"its {what} is not a {tuple(own.shape)} {own.dtype} tensor")


class Checkpointer:
    """The ``checkpoint`` of one training run: resume from it, save to it, remove it at the end.

    ``kind``: the trainer (``"train_ensemble"``, ``"train"``), named in the file and in messages.
    ``in_task``: the file is one a sweep's engine names for a task (:mod:`bnlab._task_checkpoint`).  Then a
    file that cannot be resumed from (another run's, unreadable) is removed with a warning and the run
    starts from step 0, instead of the ``ValueError`` a caller's own file gets (a resumed sweep must not
    fail on it forever); and a run that has saved at least once saves its final state too instead of
    removing the file, so that a task that trains several times in turn, interrupted in a later run,
    does not train the finished ones again (the engine removes the task's files once it has finished)."""

    kind = "train_ensemble"

    def __init__(self, path: Path, every: float, fingerprint_of, in_task: bool):
        self.path, self.every, self._fingerprint_of, self.in_task = path, every, fingerprint_of, in_task
        self._fingerprint: str | None = None
        self._given: list[dict] | None = None  # the models' state before a resume set them to the file's
        self._last = time.monotonic()
        self._saves = 0

    @staticmethod
    def _claimed(checkpoint, every) -> tuple[Path, float, bool] | None:
        """``(path, every, in_task)`` checked: the caller's ``checkpoint``, or the file the sweep's engine names
        for this trainer call (:func:`bnlab._task_checkpoint.claim`), or None: neither."""
        from bnlab import _task_checkpoint

        in_task = False
        if checkpoint is None:
            claimed = _task_checkpoint.claim()  # a sweep's task: the engine's file for this call
            if claimed is None:
                return None
            checkpoint, every, in_task = claimed[0], claimed[1], True
        path = check_path("checkpoint", checkpoint, kind="file", replaced=True)
        every = check_real("checkpoint_every", every, minimum=0.0)
        return path, every, in_task

    def fingerprint(self) -> str:
        # computed lazily, from the models' initial state (train_ensemble's models hold it until the first
        # save writes the training state back; train keeps a copy): a run that never saves or resumes
        # never hashes its data
        if self._fingerprint is None:
            self._fingerprint = self._fingerprint_of()
        return self._fingerprint

    def resume(self, models: list[nn.Module], dev: torch.device) -> dict | None:
        """The checkpoint's state with the models set to it, or None (no file; or a bad one set aside).  The
        rest of the file is checked against the run built from those models (by the trainer); where it
        is refused there, :meth:`abandon` gives the models back the state they had here."""
        try:
            saved = read(self.path, dev, self.kind)
            if saved is None:
                return None
            if saved["fingerprint"] != self.fingerprint():
                raise refused(self.path, "it was written by another run (other models, data or options, or "
                                         "another bnlab version); remove it, or give another path")
            given = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
            load_models(self.path, models, saved.get("models"))
        except CheckpointError as exc:
            self._set_aside(exc)
            return None
        self._given = given
        _log.info("%s resumes from %s at step %d", self.kind, self.path, saved.get("done", -1))
        self._saves = 1  # the file holds this run's state
        return saved

    def abandon(self, models: list[nn.Module], exc: CheckpointError) -> None:
        """The checkpoint was refused after :meth:`resume` had set the models to it: they get their given
        state back, then :meth:`_set_aside` (raises ``exc``, unless the file is a sweep task's)."""
        with torch.no_grad():
            for m, sd in zip(models, self._given or []):
                m.load_state_dict(sd)
        self._given, self._saves = None, 0
        self._set_aside(exc)

    def _set_aside(self, exc: CheckpointError) -> None:
        """A caller's own file: ``exc`` is raised.  A sweep task's: it is removed with a warning, and the run
        starts from step 0 (a resumed sweep must not fail on it forever)."""
        if not self.in_task:
            raise exc
        warnings.warn(f"{exc}; it is removed and the run starts from step 0", RuntimeWarning, stacklevel=4)
        remove(self.path)

    def check_rng(self, saved: dict, dev: torch.device) -> None:
        """``CheckpointError`` unless the saved random states are ones torch can be set to on ``dev``."""
        check_like(self.path, "CPU random state", saved.get("rng_cpu"), torch.get_rng_state())
        if dev.type == "cuda":
            check_like(self.path, "CUDA random state", saved.get("rng_cuda"), torch.cuda.get_rng_state(dev))

    def restore_rng(self, saved: dict, dev: torch.device) -> None:
        """torch's random state as it was at the save (a module's dropout goes on with the same numbers)."""
        self.check_rng(saved, dev)
        torch.set_rng_state(saved["rng_cpu"].cpu())
        if dev.type == "cuda":
            torch.cuda.set_rng_state(saved["rng_cuda"].cpu(), dev)

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every

    def _write(self, payload: dict, dev: torch.device) -> None:
        """Write ``payload`` with the fingerprint and torch's random state; a file that cannot be written warns."""
        payload = {"fingerprint": self.fingerprint(), **payload, "rng_cpu": torch.get_rng_state(),
                   "rng_cuda": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None}
        try:
            write(self.path, payload, self.kind)
        except OSError as exc:
            # a full disk or a folder gone must not end the training the checkpoint is there to protect:
            # the run goes on without saving (the previous save, if any, stays)
            warnings.warn(f"{self.kind}: checkpoint={str(self.path)!r} could not be written ({exc.strerror or exc}); "
                          "the run goes on without saving", RuntimeWarning, stacklevel=4)
            self.every = math.inf
            return
        self._last = time.monotonic()
        self._saves += 1

    def _end(self, save_final) -> None:
        """The run is complete: its checkpoint is removed — or, in a task, ``save_final()`` (see above)."""
        if self.in_task and self._saves:
            save_final()
        else:
            remove(self.path)


class EnsembleCheckpointer(Checkpointer):
    """The checkpoint of a :func:`~bnlab.nets.train_ensemble` run."""

    kind = "train_ensemble"

    @classmethod
    def for_run(cls, checkpoint, every, models, data, opts) -> "EnsembleCheckpointer | None":
        """The checkpointer of a run of ``models`` on ``data`` (train_ensemble's checked data: ``x``, ``y``,
        ``test``, ``batch_size``, ``steps``) with ``opts`` (its checked options, a dataclass), or None: no
        ``checkpoint`` given and none claimed for a sweep's task."""
        claimed = cls._claimed(checkpoint, every)
        if claimed is None:
            return None
        tensors = {"x": data.x, "y": data.y, **({} if data.test is None else {"x_test": data.test[0],
                                                                             "y_test": data.test[1]})}
        options = {**asdict(opts), "batch_size": data.batch_size, "steps": data.steps}

        def fingerprint_of() -> str:
            return fingerprint(models, tensors, options, cls.kind)

        return cls(*claimed[:2], fingerprint_of, claimed[2])

    def compact_to(self, stack, saved: dict) -> None:
        """Drop from the freshly built stack the networks the checkpointed run had dropped."""
        rows = saved.get("row_ids")
        full = list(stack.rows)
        kept = rows.tolist() if isinstance(rows, torch.Tensor) and rows.dim() == 1 else None
        if kept is None or not set(kept) <= set(full) or len(set(kept)) != len(kept) or not kept:
            raise refused(self.path, "its stacked rows are not networks of this run")
        if kept != full:
            if not stack.compactable:
                raise refused(self.path, "its stacked rows are not those of its models")
            keep = torch.tensor(sorted(full.index(i) for i in kept), dtype=torch.long)
            stack.compact(keep.to(rows.device))

    def save(self, run, stack, models: list[nn.Module], dev: torch.device, written_back: bool = False) -> None:
        """Write the run's state (``written_back``: the stack's state is in the models already)."""
        self.fingerprint()
        if not written_back:
            stack.write_back()  # every network's state, a dropped one's included, into its model
        self._write({"models": [m.state_dict() for m in models], **run.checkpoint_state()}, dev)

    def finish(self, run, stack, models: list[nn.Module], dev: torch.device) -> None:
        """The run is complete (its state written back into the models): its checkpoint is removed — or, in
        a task, its final state saved (see :class:`Checkpointer`)."""
        self._end(lambda: self.save(run, stack, models, dev, written_back=True))


def has_state(part: Any) -> bool:
    """Whether ``part`` (a hook, callback or transform of :func:`~bnlab.nets.train`) keeps its state the
    ``torch`` way: ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))


class TrainCheckpointer(Checkpointer):
    """The checkpoint of a :func:`~bnlab.nets.train` run (one network).

    Besides the model, the run's state lives in its optimizer and in the ``parts``: its hooks, callbacks
    and ``transform``, each of which must keep its state the ``torch`` way (:func:`has_state`; a
    stateless one returns ``{}``) — a BNP preconditioner's running statistics, an augmentation's
    generator.  A part without it is refused with a ``ValueError`` when the caller asks for a
    checkpoint; inside a sweep's task that call keeps none (its task resumes at whole cells)."""

    kind = "train"

    def __init__(self, path, every, fingerprint_of, in_task, parts: tuple):
        super().__init__(path, every, fingerprint_of, in_task)
        self.parts = parts

    @staticmethod
    def _named_parts(run) -> list[tuple[str, Any]]:
        return [*((f"hooks[{i}]", h) for i, h in enumerate(run.hooks)),
                *((f"callbacks[{i}]", c) for i, c in enumerate(run.callbacks)),
                *([("transform", run.transform)] if run.transform is not None else [])]

    @classmethod
    def claim(cls, checkpoint, every, run) -> tuple[Path, float, bool] | None:
        """``(path, every, in_task)`` for ``train``'s run ``run`` (its checked arguments), checked before the
        model is moved or the optimizer built, or None: no ``checkpoint`` given and none claimed for a
        sweep's task, or a task's run with a part that keeps no state (a ``ValueError`` for the caller's
        own ``checkpoint``)."""
        claimed = cls._claimed(checkpoint, every)
        if claimed is None:
            return None
        stateless = [(n, p) for n, p in cls._named_parts(run) if not has_state(p)]
        if stateless:
            if claimed[2]:
                _log.debug("train: no checkpoint for this call of the task (%s keeps no state_dict)", stateless[0][0])
                return None
            n, p = stateless[0]
            raise ValueError(
                f"{n}={p!r} is not allowed with checkpoint={str(claimed[0])!r}: a resumed run needs the state of "
                "every hook, callback and transform; give it state_dict() and load_state_dict() (a stateless one "
                "returns {} and accepts {}), or train without a checkpoint")
        return claimed

    @classmethod
    def for_run(cls, claimed: tuple[Path, float, bool], model: nn.Module, opt: torch.optim.Optimizer,
                run) -> "TrainCheckpointer":
        """The checkpointer of ``train``'s run ``run`` of ``model`` with ``opt``, at :meth:`claim`'s file."""
        named = cls._named_parts(run)
        parts = tuple(p for _, p in named)
        # what the run starts from, hashed now (small: the optimizer's state, the parts' states), and the
        # model's initial state kept for the fingerprint, which hashes the data only if the run saves or resumes
        setup = hashlib.blake2b(digest_size=20)
        _feed_state(setup, "optimizer", opt.state_dict())
        for (n, _), part in zip(named, parts):
            _feed_state(setup, n, part.state_dict())
        options = {"optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}", "setup": setup.hexdigest(),
                   "parts": [[n, _name_of(p)] for n, p in named], "loss_fn": _name_of(run.loss_fn),
                   "device": run.device.type, "dtype": str(run.dtype),
                   **{k: getattr(run, k) for k in ("batch_size", "steps", "per_epoch", "seed", "check_every",
                                                   "eval_batch_size", "diverge_above", "test_bn_mode",
                                                   "eval_every_epoch", "step_mode")}}
        initial = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
        tensors = {"x": run.x_train, "y": run.y_train,
                   **({} if run.test is None else {"x_test": run.test[0], "y_test": run.test[1]})}

        def fingerprint_of() -> str:
            return fingerprint([model], tensors, options, cls.kind, states=initial)

        return cls(claimed[0], claimed[1], fingerprint_of, claimed[2], parts)

    def save(self, model: nn.Module, opt: torch.optim.Optimizer, progress, dev: torch.device) -> None:
        """Write the run's state: the model, the optimizer, the parts, and ``progress`` (train's loop state)."""
        self._write({"models": [model.state_dict()], "optimizer": opt.state_dict(),
                     "parts": [p.state_dict() for p in self.parts], "done": progress.done,
                     "history": progress.losses[: progress.done].cpu(), "chance": progress.chance,
                     "epoch_rows": progress.epoch_rows, "epoch_eval": progress.epoch_eval,
                     "stopped": progress.stopped, "diverged_at": progress.diverged_at}, dev)

    def finish(self, model: nn.Module, opt: torch.optim.Optimizer, progress, dev: torch.device) -> None:
        """The run has ended: its checkpoint is removed — or, in a task, its final state saved."""
        self._end(lambda: self.save(model, opt, progress, dev))

    def restore(self, opt: torch.optim.Optimizer, run, progress, saved: dict, dev: torch.device) -> None:
        """Set the optimizer, the parts and ``progress`` to the checkpoint ``saved`` (whose model state is
        loaded), every entry checked first; a :class:`CheckpointError` leaves them as they were."""
        path = self.path
        done = saved.get("done")
        if not (isinstance(done, int) and not isinstance(done, bool) and 0 <= done <= run.steps):
            raise refused(path, f"its step count {done!r} is not one of this run's 0 … {run.steps}")
        history = saved.get("history")
        if not (isinstance(history, torch.Tensor) and history.dtype == progress.losses.dtype
                and history.shape == (done,)):
            raise refused(path, f"its loss history is not a ({done},) {progress.losses.dtype} tensor")
        chance, stopped, diverged_at = saved.get("chance"), saved.get("stopped"), saved.get("diverged_at")
        if not (chance is None or (isinstance(chance, float) and 0.0 < chance <= 1.0)):
            raise refused(path, f"its chance level {chance!r} is not None or a number in (0, 1]")
        if done and chance is None and run.test is not None and not run.y_train.is_floating_point():
            raise refused(path, "its chance level is missing for a classifier")
        if not isinstance(stopped, bool):
            raise refused(path, f"its stop flag {stopped!r} is not True or False")
        if not (diverged_at is None or (isinstance(diverged_at, int) and 0 <= diverged_at < max(done, 1))):
            raise refused(path, f"its first bad step {diverged_at!r} is not one of the {done} steps taken")
        rows = saved.get("epoch_rows")
        epochs = done // run.per_epoch if run.eval_every_epoch else 0
        # a divergence found at an epoch's end stops the run before that epoch's test
        allowed = (epochs, epochs - 1) if diverged_at is not None and epochs else (epochs,)
        if not (isinstance(rows, list) and len(rows) in allowed and all(
                isinstance(r, dict) and set(r) == {"epoch", "train_loss", "test_accuracy"} and r["epoch"] == e + 1
                for e, r in enumerate(rows))):
            raise refused(path, f"its end-of-epoch rows are not the {epochs} rows of the epochs done")
        epoch_eval = saved.get("epoch_eval")
        if not (epoch_eval is None or (isinstance(epoch_eval, tuple) and len(epoch_eval) == 2
                                       and isinstance(epoch_eval[0], int) and 0 < epoch_eval[0] <= done
                                       and isinstance(epoch_eval[1], tuple) and len(epoch_eval[1]) == 3)):
            raise refused(path, f"its last epoch test {epoch_eval!r} is not one of this run's")
        self._check_optimizer(opt, saved.get("optimizer"))
        states = saved.get("parts")
        if not (isinstance(states, list) and len(states) == len(self.parts)):
            raise refused(path, f"it holds {len(states) if isinstance(states, list) else 'no'} hook, callback and "
                                f"transform states for {len(self.parts)}")
        self.check_rng(saved, dev)  # before anything is set (restore_rng sets it last)
        given_opt = copy.deepcopy(opt.state_dict())
        given_parts = [copy.deepcopy(p.state_dict()) for p in self.parts]
        try:
            opt.load_state_dict(saved["optimizer"])
            for part, state in zip(self.parts, states):
                part.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
            opt.load_state_dict(given_opt)
            for part, state in zip(self.parts, given_parts):
                part.load_state_dict(state)
            raise refused(path, f"its optimizer, hook, callback or transform state does not load "
                                f"({type(exc).__name__}: {str(exc)[:200]})") from None
        progress.losses[:done].copy_(history)
        progress.done, progress.chance, progress.stopped, progress.diverged_at = done, chance, stopped, diverged_at
        progress.epoch_rows, progress.epoch_eval = [dict(r) for r in rows], epoch_eval
        self.restore_rng(saved, dev)

    def _check_optimizer(self, opt: torch.optim.Optimizer, saved: Any) -> None:
        """The saved optimizer state has this optimizer's groups (the same parameters, the same settings'
        names) and holds, per parameter, tensors of its shape or single numbers (a step count): what
        torch.optim's ``load_state_dict`` does not check before a step fails on it."""
        own = opt.state_dict()
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(groups, list)
                and len(groups) == len(own["param_groups"])
                and all(isinstance(g, dict) and set(g) == set(o) and g["params"] == o["params"]
                        for g, o in zip(groups, own["param_groups"]))):
            raise refused(self.path, f"its optimizer state is not one of this {type(opt).__name__}'s")
        shapes = {i: p.shape for g, o in zip(opt.param_groups, own["param_groups"])
                  for i, p in zip(o["params"], g["params"])}
        for i, entry in saved["state"].items():
            if i not in shapes or not isinstance(entry, dict):
                raise refused(self.path, f"its optimizer state names a parameter {i!r} this optimizer does not have")
            for k, v in entry.items():
                if isinstance(v, torch.Tensor) and v.shape != shapes[i] and v.numel() != 1:
                    raise refused(self.path, f"its optimizer state {k!r} of parameter {i} is not a "
                                             f"{tuple(shapes[i])} tensor")
