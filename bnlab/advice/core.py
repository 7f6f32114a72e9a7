"""``bnlab.advise``: the four papers' predictions for the user's own network, before training it.

:func:`advise` takes any ``nn.Module`` and a batch and returns an :class:`Advice` with five parts —
structure (:mod:`~bnlab.advice.structure`), gradient explosion and trainable depth
(:mod:`~bnlab.advice.gradients`, Yang et al. 2019), learning rate (:mod:`~bnlab.advice.learning_rate`,
the Fisher paper), rank collapse (:mod:`~bnlab.advice.collapse`, Daneshmand et al. 2020) and batch size /
BNP (:mod:`~bnlab.advice.batch`, Lange et al.).  Every number comes from bnlab's theory, fisher, rank,
optim and sim parts; this part only decides what to measure on the user's network and says what it means.

The module is never changed: every measurement runs on a deep copy, in which every module is in eval mode
(dropout off, so the measured function is deterministic) except the normalizations that use batch
statistics, which run in train mode as in a training step (``bn_mode="eval"``: running statistics).
The caller's parameters, buffers, ``.grad``, train/eval flags and the global random state are unchanged
afterwards (tests/advice/test_advise.py checks it bit for bit).
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from bnlab._validation import check_choice, check_int, check_real

__all__ = ["PARTS", "SKIPPABLE", "Advice", "advise", "DEFAULT_MAX_MEMORY_GB", "PartNotEvaluated"]

#: The parts of the advice, in order; every part but the structure can be skipped.
PARTS = ("structure", "gradients", "learning_rate", "rank", "batch_size")
SKIPPABLE = PARTS[1:]
#: ``max_memory_gb`` default: the estimated peak memory (see :func:`_memory_estimate`) must stay below it.
DEFAULT_MAX_MEMORY_GB = 8.0
_CURVATURES = ("hessian", "ggn", "fisher")


class PartNotEvaluated(Exception):
    """Raised by a part that cannot measure this network (e.g. its curvature overflows even in float64):
    :func:`advise` reports that part as not evaluated, with this reason, and still runs and prints the others
    — one part's failure never loses the whole advice.  Bad input is still a ``ValueError``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LabelRangeError(ValueError):
    """Class labels outside [0, outputs): a ``ValueError`` that carries the model's number of outputs, so that a
    caller that drew the labels itself (``bnlab advise --input-shape`` with ``--classes``) can name its option."""

    def __init__(self, message: str, outputs: int, largest: int):
        super().__init__(message)
        self.outputs = outputs
        self.largest = largest


@dataclass(frozen=True)
class LossSpec:
    """The user's loss: the callable, and how bnlab's curvature operator represents it."""

    label: str
    fn: Callable
    curvature_loss: str | None  # "cross_entropy", "mse" or None (not representable)
    curvature_scale: float = 1.0
    notes: tuple = ()
    wants_labels: bool = True


@dataclass(frozen=True)
class Advice:
    """What :func:`advise` found.  ``None`` parts were skipped (``skipped``) or could not be evaluated on this
    network (``not_evaluated``: part → the reason)."""

    structure: Any
    gradients: Any = None
    learning_rate: Any = None
    rank: Any = None
    batch_size: Any = None
    skipped: tuple = ()
    seconds: dict = field(default_factory=dict)
    cpu_seconds: dict = field(default_factory=dict)
    data: str = ""
    notes: tuple = ()
    not_evaluated: dict = field(default_factory=dict)

    def parts(self) -> dict:
        return {p: getattr(self, p) for p in PARTS}

    def verdicts(self) -> dict:
        """Part → its one-line verdict (None for skipped parts; "not evaluated: <reason>" for parts that could not
        be measured on this network)."""
        out = {"structure": _structure_line(self.structure)}
        for p in SKIPPABLE:
            part = getattr(self, p)
            if p in self.not_evaluated:
                out[p] = f"not evaluated: {self.not_evaluated[p]}"
            else:
                out[p] = None if part is None else part.verdict
        return out

    def to_dict(self) -> dict:
        """JSON-ready (non-finite floats are left for the caller's encoder; the CLI maps them to null)."""
        out = {"data": self.data, "skipped": list(self.skipped), "seconds": dict(self.seconds),
               "cpu_seconds": dict(self.cpu_seconds), "notes": list(self.notes),
               "not_evaluated": dict(self.not_evaluated), "verdicts": self.verdicts()}
        for p in PARTS:
            part = getattr(self, p)
            out[p] = None if part is None else part.to_dict()
        return out

    def to_text(self) -> str:
        from bnlab.advice.render import advice_text

        return advice_text(self)

    def to_html(self) -> str:
        """One self-contained HTML page (the report's stylesheet, plots inlined)."""
        from bnlab.advice.render import advice_html

        return advice_html(self)


def _structure_line(s) -> str:
    norms = ", ".join(f"{v} {k}" for k, v in s.norm_counts.items()) or "no normalization"
    thm = [p for p, ok in s.theorem.items() if ok]
    return (f"{s.model}: {len(s.layers)} weight layers (depth {s.depth}), {norms}, placement {s.placement}, "
            f"{s.residual_adds} residual additions, B = {s.batch_size}, BN measured in {s.measured_bn_mode} mode; "
            f"theorems apply: {', '.join(thm) or 'none (every prediction is an extrapolation)'}")


# --------------------------------------------------------------------------------------------- inputs
def _loss_spec(loss) -> LossSpec:
    from torch import nn

    from bnlab.nets import half_squared_error

    if isinstance(loss, str):
        loss = check_choice("loss", loss, ("cross_entropy", "mse"))
        if loss == "cross_entropy":
            return LossSpec("cross_entropy", nn.functional.cross_entropy, "cross_entropy")
        return LossSpec("mse (½‖f − y‖² summed over outputs, batch mean)", half_squared_error, "mse")
    if isinstance(loss, nn.CrossEntropyLoss):
        plain = (loss.weight is None and loss.label_smoothing == 0.0 and loss.reduction == "mean")
        if plain:
            return LossSpec("nn.CrossEntropyLoss()", loss, "cross_entropy")
        return LossSpec(repr(loss), loss, None, notes=("nn.CrossEntropyLoss with weights, label smoothing or "
                                                      "another reduction is not bnlab's cross-entropy",))
    if isinstance(loss, nn.MSELoss):
        if loss.reduction == "mean":
            # torch's mean over batch and outputs = (2/K)·(½‖f − y‖², batch mean): its curvature is 2/K times
            return LossSpec("nn.MSELoss() (mean over batch and outputs)", loss, "mse", float("nan"),
                            notes=("nn.MSELoss averages over the K outputs too: its curvature is 2/K × that of "
                                   "½‖f − y‖² (measured as such)",), wants_labels=False)
        return LossSpec(repr(loss), loss, None, wants_labels=False)
    if callable(loss):
        return LossSpec(getattr(loss, "__name__", type(loss).__name__), loss, None)
    raise ValueError(f"loss={loss!r} is not allowed: expected 'cross_entropy', 'mse', nn.CrossEntropyLoss(), "
                     "nn.MSELoss() or a callable (output, target) -> scalar tensor")


def _resolve_data(data, batch_size, seed):
    """(x, y or None, description) from a tensor, an (x, y) pair, a Dataset or a dataset name."""
    import numpy as np
    import torch

    if isinstance(data, str):
        from bnlab.data import load_dataset, standardize

        b = 64 if batch_size is None else batch_size
        ds = load_dataset(data, "train")
        if b > len(ds):
            raise ValueError(f"batch_size={b} is not allowed: dataset {data!r} has {len(ds)} training images")
        sub = standardize(ds.subset(b, seed=seed))
        return sub.x, sub.y, f"{data}: {b} training images (seed {seed}), standardized per channel"
    if hasattr(data, "x") and hasattr(data, "y") and not isinstance(data, torch.Tensor):
        x, y, what = data.x, data.y, f"dataset {getattr(data, 'name', type(data).__name__)}"
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        x, y, what = data[0], data[1], "the given (inputs, targets)"
    else:
        x, y, what = data, None, "the given inputs (targets drawn at random)"
    try:
        x = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        y = None if y is None else (y if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y)))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"data is not allowed: cannot make tensors of it ({exc})") from None
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"data is not allowed: expected inputs of shape (N, ...) with N ≥ 1, got {tuple(x.shape)}")
    if y is not None and (y.ndim < 1 or y.shape[0] != x.shape[0]):
        raise ValueError(f"data is not allowed: {x.shape[0]} inputs but targets of shape {tuple(y.shape)}")
    n = int(x.shape[0])
    b = n if batch_size is None else batch_size
    if b > n:
        raise ValueError(f"batch_size={b} is not allowed: data has {n} samples")
    x = x[:b]
    y = None if y is None else y[:b]
    if x.is_complex() or not (x.is_floating_point() or x.dtype in (torch.uint8, torch.int64, torch.int32)):
        raise ValueError(f"data is not allowed: inputs of dtype {x.dtype}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("data is not allowed: the inputs contain NaN or infinite values")
    if y is not None and y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ValueError("data is not allowed: the targets contain NaN or infinite values")
    return x, y, f"{what}: {b} samples of shape {tuple(x.shape[1:])}"


def _optimizer(optimizer, lr, momentum):
    import torch

    kind = None
    if optimizer is not None:
        if lr is not None or momentum is not None:
            raise ValueError("optimizer= and lr=/momentum= are not allowed together: give the optimizer, or lr and "
                             "momentum")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer={optimizer!r} is not allowed: expected a torch.optim.Optimizer")
        group = optimizer.param_groups[0]
        kind = type(optimizer).__name__
        lr = float(group["lr"])
        momentum = float(group.get("momentum", 0.0) or 0.0)
        if kind != "SGD":
            momentum = 0.0
    if lr is not None:
        lr = check_real("lr", lr, minimum=0.0, strict_minimum=True)
        kind = kind or "SGD"
    momentum = 0.0 if momentum is None else check_real("momentum", momentum, minimum=0.0)
    if momentum >= 1.0:
        raise ValueError(f"momentum={momentum!r} is not allowed: expected 0 <= momentum < 1")
    return lr, momentum, kind


def _is_batch_stat_module(m) -> bool:
    from torch import nn

    from bnlab.advice._probe import _bnlab_norm_kind
    from bnlab.nets import BNMLP

    return isinstance(m, (nn.modules.batchnorm._BatchNorm, BNMLP)) or _bnlab_norm_kind(m) is not None


def _measurement_copy(model, bn_mode: str):
    """A deep copy: eval mode everywhere, batch-statistics layers in train mode (``bn_mode="train"``), no .grad."""
    work = copy.deepcopy(model)
    work.eval()
    if bn_mode == "train":
        for m in work.modules():
            if _is_batch_stat_module(m):
                m.train()
    for p in work.parameters():
        p.grad = None
    return work


def _memory_estimate(param_bytes: int, act_bytes_per_sample: float, batch: int) -> float:
    """Peak bytes, estimated: the copies of the parameters (the measured copy, each gradient draw's copy, its
    gradients, the Lanczos vectors; 8 parameter-sized arrays) and four times the activations of the batch
    (kept for the backward pass, and again for the double backward of the Hessian products)."""
    return 8.0 * param_bytes + 4.0 * act_bytes_per_sample * batch


def _forward_error(exc, probe_failed, x) -> ValueError:
    where = f"in layer {probe_failed[0]!r} ({probe_failed[1]})" if probe_failed else "before any layer ran"
    return ValueError(f"the model's forward pass failed {where} on inputs of shape {tuple(x.shape)}: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                      "(check the data's shape against what the model expects)")


def _progress_fn(progress) -> Callable[[str], None]:
    if progress is None or progress is False:
        return lambda msg: None
    if progress is True:
        return lambda msg: print(f"bnlab advise: {msg}", file=sys.stderr, flush=True)
    if callable(progress):
        return progress
    raise ValueError(f"progress={progress!r} is not allowed: expected None, True or a callable(str)")


def advise(
    model,
    data,
    *,
    loss: Any = "cross_entropy",
    optimizer: Any = None,
    lr: float | None = None,
    momentum: float | None = None,
    batch_size: int | None = None,
    skip: Sequence[str] = (),
    draws: int = 8,
    curvature: str = "hessian",
    tol: float = 1e-2,
    bn_mode: str = "train",
    measure_bnp: bool | None = None,
    max_memory_gb: float = DEFAULT_MAX_MEMORY_GB,
    seed: int = 0,
    progress: Any = None,
) -> Advice:
    """The four papers' predictions for ``model`` on ``data``, before training it.

    Parameters
    ----------
    model : torch.nn.Module
        Any module (never changed; see the module docstring).
    data : tensor (N, ...), (inputs, targets), a ``bnlab.data`` Dataset, or a dataset name ("mnist", ...)
        The batch: its first ``batch_size`` samples (a dataset name: a seeded, standardized subset).
        Without targets, class labels (cross-entropy) or one-hot targets (squared loss) are drawn at random
        (seeded): the curvature and gradients then describe a random labelling.
    loss : "cross_entropy", "mse" (½‖f − y‖², batch mean), nn.CrossEntropyLoss(), nn.MSELoss() or a callable
        ``(output, target) -> scalar tensor``.
    optimizer, lr, momentum :
        A ``torch.optim.Optimizer`` (its first group's lr and momentum are read), or lr and momentum.
    batch_size : int
        B, the batch the normalizations see (default: all of ``data``; 64 for a dataset name).
    skip : parts not to run, from ``("gradients", "learning_rate", "rank", "batch_size")``.
    draws : weight draws of the gradient part (≥ 2; module docstring of :mod:`bnlab.advice.gradients`).
    curvature : "hessian" (default), "ggn" or "fisher" — the matrix whose λmax sets η*.
    tol : Lanczos tolerance: λmax to about tol relative (1e-2: η* to 1 %).
    bn_mode : "train" (batch statistics, as in a training step) or "eval" (running statistics).
    measure_bnp : time BNP against SGD on this model (default: when B ≤ 8).
    max_memory_gb : refuse models whose estimated peak memory exceeds this (see ``_memory_estimate``).
    seed : seeds the random targets, the weight draws, Lanczos and the bootstrap.
    progress : None, True (lines on stderr) or a callable taking one line per step of a long part.

    Returns
    -------
    Advice
        ``advice.to_text()`` (the terminal table), ``advice.to_dict()`` (JSON), ``advice.to_html()``.

    Raises
    ------
    ValueError
        A model that is not a module or has no trainable parameters, a forward pass that fails (the message
        names the layer), data that does not fit, a non-scalar or non-finite loss, non-finite outputs at
        initialization (the first layer whose output is not finite), an estimated memory above the bound.
    """
    import torch
    from torch import nn

    from bnlab.advice._probe import bytes_of, run_probe
    from bnlab.advice.structure import describe_structure

    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model={type(model).__name__} is not allowed: it has no parameters that require grad "
                         "(nothing to train, nothing to advise on)")
    if batch_size is not None:
        batch_size = check_int("batch_size", batch_size, minimum=1)
    draws = check_int("draws", draws, minimum=2, maximum=1000)
    seed = check_int("seed", seed, minimum=0)
    curvature = check_choice("curvature", curvature, _CURVATURES)
    tol = check_real("tol", tol, minimum=0.0, strict_minimum=True, maximum=0.5)
    bn_mode = check_choice("bn_mode", bn_mode, ("train", "eval"))
    max_memory_gb = check_real("max_memory_gb", max_memory_gb, minimum=0.0, strict_minimum=True)
    if isinstance(skip, str):
        skip = [s for s in skip.split(",") if s]
    skip = tuple(dict.fromkeys(check_choice("skip", s, SKIPPABLE) for s in skip))
    if measure_bnp is not None and not isinstance(measure_bnp, bool):
        raise ValueError(f"measure_bnp={measure_bnp!r} is not allowed: expected None, True or False")
    say = _progress_fn(progress)
    loss_spec = _loss_spec(loss)
    lr, momentum, opt_kind = _optimizer(optimizer, lr, momentum)
    x, y, described = _resolve_data(data, batch_size, seed)
    b = int(x.shape[0])

    ref = next(model.parameters())
    param_bytes = sum(bytes_of(p) for p in model.parameters()) + sum(bytes_of(t) for t in model.buffers())
    limit = max_memory_gb * 1e9
    if _memory_estimate(param_bytes, 0.0, b) > limit:
        raise ValueError(f"model={type(model).__name__} is not allowed with max_memory_gb={max_memory_gb:g}: its "
                         f"{param_bytes / 1e9:.2f} GB of parameters and buffers need about "
                         f"{_memory_estimate(param_bytes, 0, b) / 1e9:.1f} GB for the copies the advice makes")
    if x.is_floating_point():
        x = x.to(device=ref.device, dtype=ref.dtype)
    else:
        x = x.to(device=ref.device)

    notes = []
    has_batch_stats = any(_is_batch_stat_module(m) for m in model.modules())
    if b == 1 and has_batch_stats and bn_mode == "train":
        bn_mode = "eval"
        notes.append("B = 1: BN has no batch statistics for one sample, so the network was measured with its running "
                     "statistics (eval mode); see the batch-size part")
    if has_batch_stats:
        given = "train" if model.training else "eval"
        if not model.training or any(_is_batch_stat_module(m) and not m.training for m in model.modules()):
            notes.append(f"the model was given in {given} mode (BN layers in eval mode use running statistics); "
                         f"the advice measured BN in {bn_mode} mode — "
                         + ("with the batch's statistics, as in a training step" if bn_mode == "train" else
                            "with its running statistics"))
    bn_modes_given = tuple("train" if m.training else "eval" for m in model.modules() if _is_batch_stat_module(m))

    seconds, cpu = {}, {}
    rng_devices = [ref.device.index or 0] if ref.device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        # ---- preflight on two samples: the activation memory per sample, before the full batch runs
        t0, c0 = time.perf_counter(), time.process_time()
        say("structure: tracing the forward pass")
        # eval mode: the activations have the same sizes, and no batch-statistics layer can refuse two samples
        # (a ghost BN needs whole ghost batches, BatchNorm1d two samples)
        pre_n, pre_mode = min(b, 2), "eval"
        with torch.no_grad():
            tiny = _measurement_copy(model, pre_mode)
            try:
                probe, _ = run_probe(tiny, x[:pre_n])
            except Exception as exc:  # noqa: BLE001 - any failure of the user's forward is reported
                raise _forward_error(exc, getattr(exc, "bnlab_failed_in", None), x) from None
        act_per_sample = probe.activation_bytes / pre_n
        del tiny, probe
        estimate = _memory_estimate(param_bytes, act_per_sample, b)
        if estimate > limit:
            raise ValueError(f"model={type(model).__name__} is not allowed with max_memory_gb={max_memory_gb:g} at "
                             f"batch_size={b}: the advice would need about {estimate / 1e9:.1f} GB (parameters "
                             f"{param_bytes / 1e9:.2f} GB, activations {act_per_sample * b / 1e9:.2f} GB per forward "
                             "pass); use a smaller batch_size or raise max_memory_gb")
        # ---- the structure pass: the full batch, in the measured mode
        work = _measurement_copy(model, bn_mode)
        with torch.no_grad():
            probe_model = copy.deepcopy(work)
            try:
                probe, out = run_probe(probe_model, x, check_finite=True)
            except Exception as exc:  # noqa: BLE001
                raise _forward_error(exc, getattr(exc, "bnlab_failed_in", None), x) from None
        if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[0] != b or not out.is_floating_point():
            raise ValueError(f"the model's output is not allowed: expected a floating tensor of shape ({b}, ...), got "
                             f"{type(out).__name__}{'' if not isinstance(out, torch.Tensor) else tuple(out.shape)}")
        if not bool(torch.isfinite(out).all()):
            where = probe.first_nonfinite
            raise ValueError("the model's output at initialization is not finite on this batch"
                             + (f": the first layer with a non-finite output is {where!r}" if where else "")
                             + " (check the initialization and the input scale)")
        targets = _targets(y, out, loss_spec, seed)
        _check_loss(loss_spec, out, targets)
        bnmlp = _find_bnmlp(work)
        structure = describe_structure(
            work, probe, batch_size=b, input_shape=tuple(x.shape[1:]), output_shape=tuple(out.shape[1:]),
            model_training=model.training, bn_modes_given=bn_modes_given, measured_bn_mode=bn_mode,
            is_bnmlp=bnmlp is not None, bnmlp=bnmlp)
        events = probe.events
        del probe, probe_model, out
        seconds["structure"], cpu["structure"] = time.perf_counter() - t0, time.process_time() - c0

        parts: dict = {}
        not_evaluated: dict = {}
        captured: dict = {}
        trainable_bn = not (b < 2 and has_batch_stats)

        def run(name, fn):
            if name in skip:
                return
            t, c = time.perf_counter(), time.process_time()
            try:
                parts[name] = fn()
            except PartNotEvaluated as exc:  # this part only: the others still run and print
                not_evaluated[name] = exc.reason
                say(f"{name}: not evaluated — {exc.reason}")
            seconds[name], cpu[name] = time.perf_counter() - t, time.process_time() - c

        def grads():
            nonlocal captured
            res, captured = _gradient_part(work, x, targets, loss_spec, structure, draws, seed, say)
            return res

        run("gradients", grads)
        run("learning_rate", lambda: _lr_part(work, x, targets, loss_spec, structure, lr, momentum, opt_kind,
                                              curvature, tol, seed, say))
        if "rank" not in skip:
            if not captured:
                say("rank: one forward pass")
                with torch.no_grad():
                    probe, _ = run_probe(copy.deepcopy(work), x, capture_inputs=True)
                captured = probe.inputs
            run("rank", lambda: _rank_part(captured, structure))
        run("batch_size", lambda: _batch_part(work, x, targets, loss_spec, structure, events, measure_bnp, say))
        if not trainable_bn:
            notes.append("B = 1 with BN: gradients, curvature and ranks describe the network with its running "
                         "statistics, not a training step (which BN cannot take at B = 1)")
    return Advice(structure=structure, skipped=skip, seconds=seconds, cpu_seconds=cpu, data=described,
                  notes=tuple(notes) + tuple(structure.notes), not_evaluated=not_evaluated, **parts)


def _find_bnmlp(model):
    from bnlab.nets import BNMLP

    return model if isinstance(model, BNMLP) else None


def _targets(y, out, loss_spec: LossSpec, seed: int):
    import torch

    k = int(out[0].numel())
    gen = torch.Generator().manual_seed(seed + 1)
    b = out.shape[0]
    if y is None:
        if loss_spec.curvature_loss == "cross_entropy" or (loss_spec.wants_labels and loss_spec.curvature_loss is None
                                                           and out.ndim == 2):
            return torch.randint(0, k, (b,), generator=gen).to(out.device)
        labels = torch.randint(0, k, (b,), generator=gen)
        return torch.nn.functional.one_hot(labels, k).to(device=out.device, dtype=out.dtype).reshape(out.shape)
    y = y.to(out.device)
    if loss_spec.curvature_loss == "cross_entropy":
        if y.is_floating_point() or y.ndim != 1:
            raise ValueError(f"targets are not allowed with loss={loss_spec.label}: expected {b} integer class labels")
        if int(y.min()) < 0 or int(y.max()) >= k:
            raise LabelRangeError(f"targets are not allowed: class labels must lie in [0, {k}) for a model with {k} "
                                  f"outputs (they range over [{int(y.min())}, {int(y.max())}])", k, int(y.max()))
        return y.long()
    if loss_spec.curvature_loss == "mse" and not y.is_floating_point():
        if y.ndim != 1:
            raise ValueError(f"targets are not allowed: expected {b} integer labels or float targets, got integer "
                             f"targets of shape {tuple(y.shape)}")
        if int(y.min()) < 0 or int(y.max()) >= k:
            raise LabelRangeError(f"targets are not allowed: integer labels must lie in [0, {k}) for a model with {k} "
                                  f"outputs (they range over [{int(y.min())}, {int(y.max())}])", k, int(y.max()))
        return torch.nn.functional.one_hot(y.long(), k).to(out.dtype).reshape(out.shape)
    if loss_spec.curvature_loss == "mse" and y.reshape(b, -1).shape[1] != k:
        raise ValueError(f"targets are not allowed: shape {tuple(y.shape)} does not match the outputs {tuple(out.shape)}")
    return y.to(out.dtype) if y.is_floating_point() else y


def _check_loss(loss_spec: LossSpec, out, targets) -> None:
    import torch

    try:
        value = loss_spec.fn(out, targets)
    except Exception as exc:  # noqa: BLE001 - the user's loss
        raise ValueError(f"loss={loss_spec.label} failed on outputs {tuple(out.shape)} and targets "
                         f"{tuple(targets.shape)}: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"loss={loss_spec.label} is not allowed: it returned {shape}, expected a scalar tensor "
                         "(reduce it, e.g. with .mean())")
    if not bool(torch.isfinite(value)):
        raise ValueError(f"loss={loss_spec.label} is not finite at initialization ({float(value)}) on this batch")


def _gradient_part(work, x, targets, loss_spec, structure, draws, seed, say):
    from bnlab.advice.gradients import gradient_part

    return gradient_part(work, x, targets, loss_spec.fn, structure, draws=draws, seed=seed, progress=say)


def _lr_part(work, x, targets, loss_spec, structure, lr, momentum, opt_kind, curvature, tol, seed, say):
    from bnlab.advice.learning_rate import learning_rate_part

    spec = loss_spec
    if math.isnan(spec.curvature_scale):  # nn.MSELoss: 2/K times the curvature of ½‖f − y‖²
        k = int(math.prod(structure.output_shape)) or 1
        spec = LossSpec(spec.label, spec.fn, spec.curvature_loss, 2.0 / k, spec.notes, spec.wants_labels)
    return learning_rate_part(work, x, targets, spec, structure, lr=lr, momentum=momentum, optimizer_kind=opt_kind,
                              curvature=curvature, tol=tol, seed=seed, progress=say)


def _rank_part(captured, structure):
    from bnlab.advice.collapse import rank_part

    return rank_part(captured, structure)


def _batch_part(work, x, targets, loss_spec, structure, events, measure_bnp, say):
    from bnlab.advice.batch import batch_part

    return batch_part(work, x, targets, loss_spec.fn, structure, events, measure_bnp=measure_bnp, progress=say)
