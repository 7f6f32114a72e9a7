"""The compiled route of BNP's dense layers: ``torch.compile`` of the functional core's dense step.

:func:`bnlab.optim._functional.dense_steps_` — Algorithm 2 steps 1-5 of every dense layer of a
step, as pure tensor functions written back in place — is handed to ``torch.compile`` (inductor).
On a GPU the eager step launches one kernel per operator and per layer (58 launches per training
step of Table 1's network against SGD's 23, measured on an H200; issue #27); compiled, the
elementwise work of all layers (the running averages, σ̃², 1/(q²σ̃²), steps 4-5 and the
write-backs) fuses into a few kernels.  On CPU inductor generates C++ (one fused loop nest for
the whole step), which is how the route is tested here against the eager route.

Compilation happens on the first call (seconds to a minute) and again when the shapes or the
number of layers change (a smaller last batch); if it fails (no Triton, no C++ compiler), a
warning says why and the same functional core runs uncompiled — the same numbers, no speed-up.

**Captured on CUDA** (:func:`captured_dense_steps_`).  Compiled, the step still pays the Python
of the compiled call (guards, then one Triton launch per fused kernel): 0.9-1.3 ms per step of
Table 1's network on an H200, against 1.6 ms for SGD's whole step (issue #27).  So on CUDA the
compiled step is also captured into a CUDA graph (``torch.cuda.CUDAGraph``): the graph reads
fixed input buffers, so a step copies the layer inputs and gradients into them
(``torch._foreach_copy_``, one launch), replays the graph (one launch) and copies the gradients
back (one launch).  The statistics and the device counter are read and written where they are,
so a graph belongs to those tensors (held by identity and address), to the shapes, dtypes and
strides of the inputs and to the constants it baked in (q², ρ, ε₁, ε₂); another of any of these
is another graph (the first step of each runs uncaptured on a side stream, as
``torch.cuda.graphs`` asks, and is captured after).  At most :data:`MAX_GRAPHS` are kept, the
least recently used dropped.  A capture that fails warns once and the route stays compiled.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch

from bnlab._inductor import compile_options, copy_tensors, disagreement, write_tensors
from bnlab.optim import _functional as F

__all__ = ["MAX_GRAPHS", "available", "capturable", "captured_dense_steps_", "dense_steps_"]

_STATE: dict[str, object] = {}


def available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can be expected to work for ``device`` (Triton for CUDA)."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return device.type == "cpu"


def _compiled():
    if "fn" not in _STATE:
        _STATE["fn"] = torch.compile(F.dense_steps_, fullgraph=True, options=compile_options())
    return _STATE["fn"]


def _checked_call(what: str, run, args: tuple) -> tuple[torch.Tensor, bool]:
    """``run()`` (a compiled or captured dense step on ``args``, the arguments of :func:`dense_steps_` in
    order), then the uncompiled functional core on copies of the arguments as they were, and the two
    compared (:func:`bnlab._inductor.disagreement`, layer by layer: the statistics against what the core
    changed, the preconditioned gradients against their own size; κ = 1e-2 in float32, 1e-6 in float64).
    Returns ``(skipped, problem)``: ``problem`` None where they agree; where they disagree, the core's
    results are written into the arguments, its counts returned and ``problem`` names the tensor (the
    caller warns, saying what runs from then on)."""
    xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps = args
    start = copy_tensors({"means": means, "variances": variances})
    ref = copy_tensors({"means": means, "variances": variances, "gws": gws, "gbs": gbs, "counter": nonfinite_steps})
    skipped = run()
    ref["skipped"] = F.dense_steps_(xs, ref["means"], ref["variances"], ref["gws"], ref["gbs"], q2s, rho, eps1, eps2,
                                    ref["counter"])
    got = {"means": means, "variances": variances, "gws": gws, "gbs": gbs, "counter": nonfinite_steps,
           "skipped": skipped}
    worst, where = disagreement(got, ref, start, per_row=False)
    _STATE.setdefault("checks", []).append({"what": what, "worst": worst, "agrees": worst <= 1.0})
    if worst <= 1.0:
        return skipped, None
    write_tensors({k: v for k, v in got.items() if k != "skipped"}, ref)
    return ref["skipped"], f"BNP's {what} dense step disagreed with the uncompiled functional core ({where})"


def _call_key(xs, means, gws, gbs, q2s, rho, eps1, eps2) -> tuple:
    # what makes a new compiled program: shapes, strides, dtypes, devices and the constants baked in
    return (tuple(map(_signature, xs)), tuple(map(_signature, means)), tuple(map(_signature, gws)),
            tuple(map(_signature, gbs)), tuple(q2s), rho, eps1, eps2)


def dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps=None) -> torch.Tensor:
    """:func:`bnlab.optim._functional.dense_steps_`, compiled (or uncompiled after a failed build or a
    failed check).  Compiled code is checked, not trusted: the first call for each set of shapes,
    dtypes and constants (each a new compiled program) runs beside the uncompiled core on copies and
    is compared with it (:func:`_checked_call`); where they disagree, the core's results are kept and
    the core runs uncompiled from then on.  Inductor has miscompiled bnlab's code before (a buffer
    reused while still read, ``bnlab._inductor``), at some shapes only."""
    fn = _STATE.get("failed") or _compiled()
    try:
        key = None if fn is F.dense_steps_ else _call_key(xs, means, gws, gbs, q2s, rho, eps1, eps2)
        checked = _STATE.setdefault("checked", set())
        if key is not None and key not in checked:
            checked.add(key)
            args = (xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)
            skipped, problem = _checked_call("compiled", lambda: fn(*args), args)
            if problem is not None:
                _STATE["failed"] = F.dense_steps_
                _STATE["no_graph"] = True  # a graph would replay the compiled code
                warnings.warn(f"bnlab: {problem}; using the core uncompiled from now on (the compiled code is "
                              "not trusted)", RuntimeWarning, stacklevel=3)
            return skipped
        return fn(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)
    except Exception as exc:  # a compiler or backend missing: raised before anything is written
        if fn is F.dense_steps_:
            raise
        warnings.warn(
            f"bnlab: torch.compile of BNP's dense step failed ({type(exc).__name__}: {exc}); using the same "
            "functional core uncompiled",
            RuntimeWarning,
            stacklevel=3,
        )
        _STATE["failed"] = F.dense_steps_
        return F.dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)


# --------------------------------------------------------------------------------------------------
# Captured: one CUDA graph per set of shapes, statistics tensors and constants
# --------------------------------------------------------------------------------------------------

#: Graphs kept at once (each holds its input buffers and a memory pool); the least recently used
#: is dropped.  A training run needs one per batch size (two with a smaller last batch).
MAX_GRAPHS = 8
_GRAPHS: OrderedDict = OrderedDict()


def capturable(device: torch.device) -> bool:
    """Whether a step on ``device`` can be captured: CUDA, outside a capture the caller runs."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _signature(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)


def _held(t):
    # identity and address: the graph reads and writes this very storage
    return None if t is None else (id(t), t.data_ptr())


def _capture(call):
    """Capture ``call()`` into a CUDA graph (nothing runs) and return the graph's replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _on(device: torch.device):
    """The device's context where it is not the current CUDA device (a graph is captured and replayed on
    the streams of the device its tensors live on), else nothing to enter."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _warm_up(call, device: torch.device) -> None:
    """Run ``call()`` once for real, on a side stream on CUDA (as ``torch.cuda.graphs`` asks of the
    work it will capture: allocations and lazy initialization happen outside the capture)."""
    if device.type != "cuda":
        call()
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream(device).wait_stream(side)


class _Replay:
    """The fixed buffers of one captured step and its replay: inputs and gradients are copied in,
    the graph runs Algorithm 2 steps 1-5 on the buffers, the gradients are copied back out."""

    def __init__(self, xs, means, variances, gws, gbs, *, constants: tuple, counter):
        # the statistics and the counter are used in place and held, so their ids stay theirs
        self.means, self.variances, self.counter = list(means), list(variances), counter
        self.xs = [torch.empty_like(x) for x in xs]
        self.gws = [torch.empty_like(g) for g in gws]
        self.gbs = [None if g is None else torch.empty_like(g) for g in gbs]
        self.constants = constants  # (q2s, rho, eps1, eps2), baked into the graph
        self.skipped = torch.zeros(len(xs), dtype=torch.int64, device=means[0].device)
        self.replay = None
        self.checked = False  # its first replay is compared with the uncompiled core

    def call(self) -> None:
        q2s, rho, eps1, eps2 = self.constants
        # through dense_steps_: a failed compilation falls back there, before the capture
        self.skipped.copy_(dense_steps_(self.xs, self.means, self.variances, self.gws, self.gbs, q2s, rho,
                                        eps1, eps2, self.counter))

    def copy_in(self, xs, gws, gbs) -> None:
        dst = [*self.xs, *self.gws, *(g for g in self.gbs if g is not None)]
        torch._foreach_copy_(dst, [*xs, *gws, *(g for g in gbs if g is not None)])

    def step(self, xs, gws, gbs) -> torch.Tensor:
        """One replayed step: the inputs and gradients copied in, the replay, the gradients copied out;
        the counts (the graph's own buffer)."""
        self.copy_in(xs, gws, gbs)
        self.replay()
        self.copy_out(gws, gbs)
        return self.skipped

    def copy_out(self, gws, gbs) -> None:
        torch._foreach_copy_([*gws, *(g for g in gbs if g is not None)],
                             [*self.gws, *(g for g in self.gbs if g is not None)])


def captured_dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2,
                          nonfinite_steps=None) -> torch.Tensor:
    """:func:`dense_steps_` through a CUDA graph (see the module docstring): the same arguments and
    effects; the returned counts are the graph's own buffer, overwritten by the next replay."""
    if _STATE.get("no_graph"):
        return dense_steps_(xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps)
    key = (tuple(map(_signature, xs)), tuple(map(_signature, gws)), tuple(map(_signature, gbs)),
           tuple(map(_held, means)), tuple(map(_held, variances)), _held(nonfinite_steps),
           tuple(q2s), rho, eps1, eps2)
    entry = _GRAPHS.get(key)
    device = means[0].device
    if entry is not None:
        _GRAPHS.move_to_end(key)
        with _on(device):
            if entry.checked:
                return entry.step(xs, gws, gbs)
            # the graph's first replay, checked like a compiled call (a capture can go wrong where the
            # compiled function did not); a disagreement drops every graph: compiled, uncaptured from then on
            entry.checked = True
            skipped, problem = _checked_call("captured", lambda: entry.step(xs, gws, gbs),
                                             (xs, means, variances, gws, gbs, q2s, rho, eps1, eps2, nonfinite_steps))
            if problem is not None:
                _STATE["no_graph"] = True
                _GRAPHS.clear()
                warnings.warn(f"bnlab: {problem}; the step stays compiled, uncaptured (the graphs are not "
                              "trusted)", RuntimeWarning, stacklevel=2)
            return skipped
    entry = _Replay(xs, means, variances, gws, gbs, constants=(list(q2s), rho, eps1, eps2), counter=nonfinite_steps)
    with _on(device):
        return _first_step(key, entry, xs, gws, gbs)


def _first_step(key, entry: _Replay, xs, gws, gbs) -> torch.Tensor:
    """The first step of a new graph: run for real (the warm-up), then captured for the next steps."""
    entry.copy_in(xs, gws, gbs)
    _warm_up(entry.call, entry.means[0].device)  # this step itself (and the compilation for these shapes)
    try:
        entry.replay = _capture(entry.call)
    except Exception as exc:  # a capture the device or the backend refuses: stay compiled, uncaptured
        warnings.warn(
            f"bnlab: capturing BNP's compiled dense step in a CUDA graph failed ({type(exc).__name__}: {exc}); "
            "the step stays compiled, uncaptured",
            RuntimeWarning,
            stacklevel=5,
        )
        _STATE["no_graph"] = True
    else:
        _GRAPHS[key] = entry
        while len(_GRAPHS) > MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    entry.copy_out(gws, gbs)
    return entry.skipped
