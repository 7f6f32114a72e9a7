"""The training step of :func:`bnlab.nets.train_ensemble` as one unit of tensor work, and the routes that run it.

One step — the batch gather, forward, backward, the optimizer update (SGD/RMSProp with momentum and
weight decay, ``torch.optim``'s formulas), the divergence mask and the loss-history write — is one
Python function of tensors (:func:`build_step`) with no host synchronization: no ``.item()``, no
``bool()`` of a tensor, no branch on a value.  Everything it changes it changes in place (parameters,
optimizer state, running statistics, the mask, the step counter), so the same function can be

* run as it is (route ``"eager"``, the reference and the fallback; gradients by ``torch.autograd.grad``),
* compiled whole by ``torch.compile(fullgraph=True)`` (route ``"compile"``; gradients by
  ``torch.func.grad``, which Dynamo traces into the same graph as the forward and the update, so
  Inductor fuses the elementwise BN + φ of forward and backward and each parameter's update chain),
* captured once into a CUDA graph and replayed (route ``"cuda_graph"``: the compiled step when it
  compiles, otherwise the eager one), since its inputs are static buffers that are rewritten, never
  rebound, between steps.

The host looks at the state only every ``check_every`` steps (the early stop, the vmap stack's
compaction), in :func:`bnlab.nets.train_ensemble`.  The batch indices of a window of steps are drawn
on the host ahead of time (the same generators, the same draws as :func:`bnlab.nets.train`) and copied
to the device in one transfer; the step picks its row by a device-side counter.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from bnlab._inductor import compile_options, copy_tensors, disagreement, write_tensors
from bnlab._run_length import note_route, standing_for, whole_run_steps
from bnlab._validation import check_choice
from bnlab.nets._compile import compile_failure, fresh_function

#: how :func:`bnlab.nets.train_ensemble` runs its step: ``"auto"`` (on CUDA ``"cuda_graph"`` for runs of
#: at least ``AUTO_CUDA_GRAPH_STEPS`` steps; on the CPU ``"compile"`` for runs of at least
#: ``AUTO_COMPILE_STEPS`` steps; else ``"eager"``), ``"eager"``,
#: ``"compile"`` (``torch.compile``), ``"cuda_graph"`` (CUDA only)
STEP_MODES = ("auto", "eager", "compile", "cuda_graph")

#: On the CPU the compiled step was 7–8× faster than the eager one (4 BN-MLPs of depths 5–20, width 32,
#: B = 8: 2.7–3.7 against 23–26 ms per step, ``benchmarks/bench_ensemble.py``, measured before the eager
#: step became 1.3–2× faster at 9884c60–6dd01ab: re-measure before moving the threshold), but compiling it
#: took 4–15 minutes on this project's loaded 2-core machines: it paid from ~12 500 steps on.  ``"auto"``
#: compiles from twice that; the small-scale grids (hundreds of steps) stay eager.
AUTO_COMPILE_STEPS = 25_000

#: On CUDA (one NVIDIA H200, torch 2.11, 2026-11-27; ``benchmarks/bench_ensemble.py --device cuda``:
#: 20 BN-MLPs of depths 5…100, width 384, B = 8, one Fig. 3a column) the captured compiled step took
#: 3.96 ms against the eager 64.4 ms, but compiling and capturing it took 104 s against 5.4 s for the
#: eager run's set-up: it pays from ~1 650 steps on.  ``"auto"`` captures from 2 000 steps; shorter runs
#: (a plan's pilot outside :func:`auto_route_as_for`, a small-scale grid on a GPU) stay eager.
AUTO_CUDA_GRAPH_STEPS = 2_000


def auto_route_as_for(steps: int):
    """Within it, ``step_mode="auto"`` chooses the route of a run of ``steps`` steps whatever the length of
    the run it starts (:func:`bnlab._run_length.standing_for`).  For a plan's pilot: a task cut to a few
    steps must run (and be timed with) the route of the whole task — compiled or captured, its set-up cost
    included — not the eager route its own length would get."""
    return standing_for(steps)


def resolve_step_mode(step_mode: Any, device: torch.device, steps: int = 0) -> str:
    """The route for ``step_mode`` on ``device`` for a run of ``steps`` steps, or a ``ValueError``
    naming ``step_mode``."""
    mode = check_choice("step_mode", step_mode, STEP_MODES)
    if mode == "auto":
        steps = whole_run_steps(steps)
        if device.type == "cuda":
            mode = "cuda_graph" if steps >= AUTO_CUDA_GRAPH_STEPS else "eager"
        else:
            mode = "compile" if steps >= AUTO_COMPILE_STEPS else "eager"
    elif mode == "cuda_graph" and device.type != "cuda":
        raise ValueError(f"step_mode='cuda_graph' is not allowed on device={str(device)!r}: CUDA graphs need a "
                         "CUDA device; use 'eager' or 'compile' (or 'auto') on the CPU")
    note_route(mode)  # a plan's pilot learns whether its run compiled (bnlab._run_length)
    return mode


@dataclass(frozen=True)
class StepConfig:
    """The step's constants (Python values: a compiled step specializes on them)."""

    loss: str
    optimizer: str
    momentum: float
    weight_decay: float
    rmsprop_alpha: float
    rmsprop_eps: float
    diverge_above: float | None
    shared_order: bool
    num_networks: int  # M, the width of the loss history (the caller's order)
    # the eager step on the CPU may read a value (a sync costs nothing there; never on a GPU, nor in a
    # compiled or captured step): set by train_ensemble for that route only
    host_reads: bool = False
    # every network's learning rate when they share one (its float32 value is the state's ``lr``): with
    # ``host_reads``, a step with every network active updates by this scalar instead of the per-network
    # broadcast (``_update``)
    shared_lr: float | None = None


def per_network_loss(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batch-mean loss per network: logits (M, n, classes), labels (M, n) → (M,).

    ``"mse"`` is :func:`~bnlab.nets.half_squared_error` term for term, its one-hot target built by a
    comparison with ``arange`` instead of ``one_hot``, which checks the labels' range by reading a value
    (a host sync on the CPU, and no value for Dynamo to read: the vmap stack's step would not compile);
    :func:`~bnlab.nets.train_ensemble` checks the labels once, before the first step."""
    if kind == "mse":
        onehot = (y.unsqueeze(-1) == torch.arange(out.shape[-1], device=y.device)).to(out.dtype)
        return 0.5 * ((out - onehot) ** 2).sum(dim=-1).mean(dim=-1)
    per = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
    return per.view(out.shape[0], out.shape[1]).mean(dim=1)


def _per_net(v: torch.Tensor, p: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Entries ``rows`` = (start, stop) of the per-network vector v (the networks p stacks), shaped to
    broadcast over p (k, ...)."""
    return v[rows[0] : rows[1]].view(-1, *([1] * (p.ndim - 1)))


def build_step(stack: Any, cfg: StepConfig, grad_route: str) -> Callable[[dict], None]:
    """The whole training step of ``stack`` as a function ``step(state)`` that updates ``state`` in place.

    ``grad_route``: ``"autograd"`` (``torch.autograd.grad`` on fresh leaves sharing the parameters'
    storage; the eager route) or ``"func"`` (``torch.func.grad``, traceable by Dynamo as one graph).
    ``stack.used`` (None: all): which parameters the loss depends on (``torch.func.grad`` returns zeros
    where ``autograd.grad`` returns None, and an unused parameter must not take a weight-decay step:
    torch.optim skips parameters without a gradient).  ``state`` holds (see :func:`bnlab.nets.train_ensemble`):

    ``x``, ``y`` the training set; ``idx`` (W, seeds, batch) the window's batch indices and ``slot``
    (0-d) the row of this step; ``which`` (R,) each stacked network's row of ``idx``; ``params``,
    ``stats`` the stack's tensors; ``sq_avg``, ``velocity`` the optimizer state (lists or None); ``lr``
    (R,); ``active`` (R,) bool; ``first_bad`` (R,) long; ``t`` (0-d) the step; ``losses`` (W·M,)
    float32, the window's losses, written at ``slot·M + row_ids`` (no shape depends on the run's length).
    """
    if grad_route not in ("autograd", "func"):
        raise ValueError(f"grad_route={grad_route!r} is not allowed: expected 'autograd' or 'func'")
    kind, m_count = cfg.loss, cfg.num_networks

    def value_and_grads(params, stats, xb, yb):
        if grad_route == "autograd":
            with torch.enable_grad():
                leaves = [p.detach().requires_grad_() for p in params]
                logits, aux = stack.train_logits(leaves, stats, xb)
                loss = per_network_loss(kind, logits, yb)
                grads = list(torch.autograd.grad(loss.sum(), leaves, allow_unused=True))
            return loss.detach(), grads, aux

        loss, grads, aux = stack.func_value_and_grads(list(params), stats, xb, yb, kind)
        used = stack.used
        if used is not None:
            grads = [g if u else None for g, u in zip(grads, used)]
        return loss, list(grads), aux

    def step(s: dict) -> None:
        active, t = s["active"], s["t"]
        rows = active.shape[0]
        idx = s["idx"].index_select(0, s["slot"]).squeeze(0)  # (distinct seeds, batch)
        if cfg.shared_order:
            # one batch for every network: the stack broadcasts it (never copied M times)
            xb = s["x"].index_select(0, idx[0])
            yb = s["y"].index_select(0, idx[0]).expand(rows, -1)
        else:
            sel = idx.index_select(0, s["which"])  # (R, batch): each network's own draw
            xb, yb = s["x"][sel], s["y"][sel]
        saved = stack.save_stats(s["stats"])
        loss, grads, aux = value_and_grads(s["params"], s["stats"], xb, yb)
        # float32 like train()'s history, whose finiteness check is on the stored value (a float64
        # loss beyond 3.4e38 counts as divergence there, and so here)
        lf = loss.float()
        ok = torch.isfinite(lf)
        if cfg.diverge_above is not None:
            ok = ok & (lf <= cfg.diverge_above)
        s["first_bad"].copy_(torch.where(active & ~ok, t, s["first_bad"]))
        active.logical_and_(ok)
        # With host_reads (the eager step on the CPU, where a sync costs nothing): while every network is
        # active — nearly always — the masks below change nothing and are skipped (a broadcast
        # masked_fill_ costs ~4× the update itself on the CPU).  Every other step never reads a value.
        all_active = cfg.host_reads and grad_route == "autograd" and bool(active.all())
        # a stopped network keeps the running statistics it had before its bad step, as its parameters
        stack.update_stats(s["stats"], aux, saved, None if all_active else active)
        s["losses"].index_copy_(0, s["row_ids"] + s["slot"] * m_count, lf)
        _update(s["params"], grads, stack.param_rows(), active, s["lr"], s["sq_avg"], s["velocity"], cfg,
                all_active=all_active, denom=s.get("denom") if grad_route == "autograd" else None)
        t.add_(1)
        s["slot"].add_(1)

    return step


def _update(params: list, grads: list, param_rows: list, active: torch.Tensor, lr: torch.Tensor,
            sq_avg: list | None, velocity: list | None, cfg: StepConfig, *, all_active: bool = False,
            denom: list | None = None) -> None:
    """torch.optim.SGD / RMSprop (their foreach formulas) with a per-network rate, networks not
    ``active`` frozen.

    A stopped network gets a zero gradient (a fill, NaN-safe unlike a multiplication by 0) and a zero
    rate: its parameters stay where they are and its optimizer state decays harmlessly.  Everything is
    in place on the fresh gradients and the state, by ``_foreach`` ops (one launch for all parameters
    on a GPU where the shapes pair up; the per-network rate broadcasts, which is one launch per tensor).
    ``all_active``: the caller has read that every network is active, so there is nothing to fill, and
    with ``cfg.shared_lr`` (every network's rate) the last step takes that number as torch.optim does
    (``add_(d, alpha=−lr)``; RMSProp without momentum ``addcdiv_(g, denom, value=−lr)``, one pass over
    the parameters fewer than a quotient and a product).  ``denom``: RMSProp's denominators written into
    these buffers (one per parameter, its layout) instead of fresh tensors: on the CPU fresh tensors of
    the parameters' size (11 MB at width 128, depths 4…48) were page-faulted in anew each step (measured
    there at B = 8: ~2 200 minor page faults per step with fresh denominators and quotients, ~2 with
    these buffers and the in-place quotient).
    """
    kept = [i for i, g in enumerate(grads) if g is not None]
    ps = [params[i] for i in kept]
    gs = [grads[i] for i in kept]
    rows = [param_rows[i] for i in kept]
    if not all_active:
        stop = ~active
        for p, g, r in zip(ps, gs, rows):
            g.masked_fill_(_per_net(stop, p, r), 0.0)
    if cfg.weight_decay:
        torch._foreach_add_(gs, ps, alpha=cfg.weight_decay)
    scalar_lr = cfg.shared_lr if all_active else None
    ds = gs
    if cfg.optimizer == "rmsprop":
        sq = [sq_avg[i] for i in kept]
        torch._foreach_mul_(sq, cfg.rmsprop_alpha)
        torch._foreach_addcmul_(sq, gs, gs, value=1 - cfg.rmsprop_alpha)
        if denom is None:
            den = torch._foreach_sqrt(sq)
        else:
            den = [denom[i] for i in kept]
            # a loop over the parameters (one per layer): foreach has no out= form, and copy-then-sqrt_
            # would read the 11 MB of state twice, which costs more than ~50 calls
            for d, v in zip(den, sq):
                torch.sqrt(v, out=d)
        torch._foreach_add_(den, cfg.rmsprop_eps)
        if scalar_lr is not None and not cfg.momentum:
            torch._foreach_addcdiv_(ps, gs, den, value=-scalar_lr)
            return
        # in place on the fresh gradients (read nowhere after): no fresh quotient
        torch._foreach_div_(gs, den)
    if cfg.momentum:
        # torch.optim: buf ← μ·buf + d (the first step's buffer is d itself = μ·0 + d)
        vs = [velocity[i] for i in kept]
        torch._foreach_mul_(vs, cfg.momentum)
        torch._foreach_add_(vs, ds)
        ds = vs
    if scalar_lr is not None:
        torch._foreach_add_(ps, ds, alpha=-scalar_lr)
        return
    neg_rate = torch.where(active, -lr, 0.0)
    torch._foreach_addcmul_(ps, [_per_net(neg_rate, p, r) for p, r in zip(ps, rows)], ds)


# --------------------------------------------------------------------------- checking a route
#: calls of a compiled step (after each compilation) and replays of a captured step (after each capture)
#: that :class:`StepRunner` runs beside the eager step and compares with it
VERIFY_COMPILED_CALLS = 2
VERIFY_REPLAYS = 1

#: state entries a check does not copy: the training set, read by the step and never written (by far
#: the largest entries: 188 MB for MNIST on the device)
_NOT_COPIED = ("x", "y")


def snapshot_state(state: dict) -> dict:
    """A copy of the step's state: every tensor cloned (in lists, tuples and dicts: the vmap stack's
    buffers are dicts by name), except the training set (``x``, ``y``: shared, see :data:`_NOT_COPIED`)."""
    return {k: (v if k in _NOT_COPIED else copy_tensors(v)) for k, v in state.items()}


def restore_state(state: dict, source: dict) -> None:
    """Write ``source``'s tensors into ``state``'s, in place (a captured graph and the stack keep
    pointing at ``state``'s tensors)."""
    write_tensors({k: v for k, v in state.items() if k not in _NOT_COPIED}, source)


def step_disagreement(got: dict, ref: dict, start: dict,
                      param_rows: list[tuple[int, int]] | None = None) -> tuple[float, str]:
    """How far a route's state after one step (``got``) is from the eager step's (``ref``), both from
    ``start``: ``(worst, where)``, ``worst`` ≤ 1 where they agree — :func:`bnlab._inductor.disagreement`
    network by network (per row of the stacked tensors; per entry of the loss history, which starts as
    NaN and so is compared against its own size), over everything but the training set.  ``param_rows``:
    the networks (start, stop) each parameter stacks (the stack's ``param_rows()``; default: rows 0…k−1),
    for :func:`_rounding_noise`.

    Integer and boolean tensors (the divergence mask, the first bad step, the counters) must be equal;
    for a floating tensor, ‖got − ref‖₂ ≤ κ·‖ref − start‖₂ + 8u·‖ref‖₂ per network, κ = 1e-2 in
    float32 and 1e-6 in float64 (derived there).  Measured on the CPU (torch 2.13.0, 2026-11-28) at the
    shape of the buffer-reuse fault (depths 4 and 16, 784 inputs, width 128, B = 32, SGD): the correct
    compiled step at 1.5e-3 of the tolerance in float32 and 3.3e-8 in float64, the faulty one (reuse
    on) at 1.2e3 and 1.4e7 times it, naming the deepest network's last hidden weight
    (``tests/nets/test_ensemble_compiled_reuse.py``, slow); RMSProp (depths 4…24, B = 8) at 0.083 in
    float32 and 1.0e-4 in float64, from a few gradient entries near ε.  The comparison itself:
    ``tests/nets/test_ensemble_verify.py``.  Entries whose gradient is rounding noise next to their
    network's (a bias right before BN: under RMSProp its update is ±lr with the sign of the noise in any
    route; under SGD its momentum buffer or update is the noise itself) are left out (:func:`_rounding_noise`).
    """
    keys = [k for k in ref if k not in _NOT_COPIED]
    return disagreement({k: got[k] for k in keys}, {k: ref[k] for k in keys},
                        {k: start[k] for k in keys if k != "losses"}, per_row=True,
                        ignore=_rounding_noise(ref, param_rows, start))


#: a parameter entry whose gradient is below this fraction of the largest of its network (over all its
#: parameters) is left out of :func:`step_disagreement`, by dtype (:func:`_rounding_noise`)
RMS_NOISE = {torch.float32: 1e-4, torch.float64: 1e-8}


def _rounding_noise(ref: dict, param_rows: list[tuple[int, int]] | None, start: dict | None = None) -> dict | None:
    """The entries of the parameters and their optimizer state whose gradient is rounding noise next to the
    rest of their network's gradient, for every optimizer (``None``: nothing to judge by).

    A gradient that is zero up to rounding — a bias right before BN, which BN's mean subtraction cancels
    exactly — has a sign and size that two correct routes need not share (their sums run in other orders).
    Under RMSProp the update lr·g/(√v + ε) has the size lr whatever the size of g, so such an entry moves
    by ±lr with the sign of the noise (measured: a vmap stack of Linear + BN with biases, float32, ε = 1e-10:
    158 times the tolerance on such a bias).  Under SGD the update is the noise itself, and the comparison
    ‖got − ref‖ ≤ κ·‖ref − start‖ + 8u·‖ref‖ has no scale to measure it against where the entry starts at
    zero: the momentum buffer (zero before the first step; measured: a velocity of 1.6e-16 against a
    difference of 2.0e-16 between the functional and the autograd gradient of the bias before BN of an
    ``MLP(norm="bn")``, float64) and a zero-initialized bias.

    Such an entry is recognised by the eager step's own numbers, per network (a network exploding beside
    it does not hide the rest): under RMSProp its running mean square v (v ≥ (1 − α)·g²) below RMS_NOISE²
    of the largest v of its network; under SGD with momentum its momentum buffer |b| below RMS_NOISE of
    its network's largest; under plain SGD its update |Δθ| (= lr·|g + λθ|, one rate per network) below
    RMS_NOISE of its network's largest — i.e. a gradient below RMS_NOISE (1e-4 in float32, 1e-8 in
    float64) of the network's largest, 10–100 times above the rounding level of a gradient sum (~√n·u
    relative).  A network whose every entry is zero (stopped: its update masked) leaves nothing out.  A
    fault that zeroes a gradient the eager step computes is still caught (the eager value is large there);
    one confined to such near-zero entries is not."""
    sq = ref.get("sq_avg")
    if sq is not None:
        basis, power = [v.double() for v in sq], 2
    elif ref.get("velocity") is not None:
        basis, power = [v.double().abs() for v in ref["velocity"]], 1
    elif start is not None and ref.get("params") is not None and start.get("params") is not None:
        basis, power = [(r.double() - s.double()).abs() for r, s in zip(ref["params"], start["params"])], 1
    else:
        return None
    rows = param_rows or [(0, v.shape[0]) for v in basis]
    networks = max(b for _, b in rows)
    largest = torch.zeros(networks, dtype=torch.float64, device=basis[0].device)
    for v, (a, b) in zip(basis, rows):
        largest[a:b] = torch.maximum(largest[a:b], v.reshape(v.shape[0], -1).amax(dim=1))
    masks = []
    dtypes = sq if sq is not None else ref.get("velocity") or ref["params"]
    for v, d, (a, b) in zip(basis, dtypes, rows):
        tau = RMS_NOISE.get(d.dtype, 1e-2) ** power
        floor = tau * largest[a:b].view(-1, *([1] * (v.ndim - 1)))
        masks.append((v <= floor) & (floor > 0))
    ignore = {"params": masks}
    for key in ("sq_avg", "velocity", "denom"):
        if ref.get(key) is not None:
            ignore[key] = masks
    return ignore


# --------------------------------------------------------------------------- routes
def _random_state(device: torch.device) -> dict:
    """torch's random state that a step on ``device`` draws from (the CPU generator; the device's on CUDA)."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_random_state(saved: dict, device: torch.device) -> None:
    """Set :func:`_random_state`'s ``saved``.  Where torch refuses (a CUDA generator's state is not
    settable in some state of graph capture), the generators are left as they are: the eager step then
    draws other numbers than a step with dropout drew, the check sees it and the run goes on eager — slower,
    never wrong."""
    try:
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved:
            torch.cuda.set_rng_state(saved["cuda"], device)
    except RuntimeError:
        pass


class StepRunner:
    """Runs a step by one route; ``reset()`` after the state's tensors were replaced (a compaction).

    ``make_step(grad_route)`` builds the step (:func:`build_step`).  ``"compile"`` compiles it on the
    first call; a compilation failure (a Dynamo or Inductor error, raised before anything runs) is
    reported by a warning and the eager step takes over.  ``"cuda_graph"`` runs ``warmup`` steps as they
    are (on a side stream, as ``torch.cuda.graphs`` asks: lazy initializations, the compilation), then
    captures one step — capture records without executing — and replays it for this and every later step.

    Compiled code is checked, not trusted: the first :data:`VERIFY_COMPILED_CALLS` calls of a compiled
    step and the first :data:`VERIFY_REPLAYS` replay of each capture (counted again after ``reset()``,
    which means a new graph) run beside the eager step on a copy of the state, and the two resulting
    states are compared (:func:`step_disagreement`).  Inductor has miscompiled this step before (a buffer
    reused while still read: a 9–11× wrong update of one weight, bnlab._inductor), and a fault of that
    kind depends on the shapes, so no test at other shapes can vouch for a paper-scale run.  Where they
    disagree, a warning names the tensor and the run goes on with the eager step from the eager state
    (``fallback_reason``); ``checks`` lists every comparison made.  All checked calls come before
    :data:`bnlab._run_length.STEADY_FROM`, so a plan's pilot does not time them (except after a compaction).
    """

    def __init__(self, mode: str, make_step: Callable[[str], Callable[[dict], None]], warmup: int = 2,
                 param_rows: Callable[[], list[tuple[int, int]]] | None = None):
        if mode not in ("eager", "compile", "cuda_graph"):
            raise ValueError(f"mode={mode!r} is not allowed: expected 'eager', 'compile' or 'cuda_graph'")
        self.mode = mode
        self._make = make_step
        self._eager = make_step("autograd")
        self._compiled: Callable | None = None
        self._warmup = warmup
        self._param_rows = param_rows  # the stack's param_rows, for the checks (read at each check: compactions)
        self.fallback_reason: str | None = None  # why the compiled step was given up, if it was
        self.distrusted = False  # a checked call disagreed with the eager step: eager from then on
        #: one ``{"what", "step", "worst", "agrees"}`` per checked call (:func:`step_disagreement`'s ratio)
        self.checks: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self._graph = None
        self._warm = 0
        self._compiled_left = VERIFY_COMPILED_CALLS  # checked calls left of this graph (a new one after reset)
        self._replays_left = VERIFY_REPLAYS

    @property
    def route(self) -> str:
        """The route actually running: the mode, or ``"eager"`` after a compilation failure (for
        ``cuda_graph``: ``"cuda_graph"`` whichever step it captures) or a failed check."""
        if self.distrusted or (self.mode == "compile" and self.fallback_reason):
            return "eager"
        return self.mode

    def _checked(self, what: str, run: Callable[[dict], None], state: dict) -> None:
        """``run(state)``, then the eager step on a copy of the state as it was, and the two compared; on a
        disagreement the state is set to the eager step's result and the eager step runs from then on."""
        start = snapshot_state(state)
        reference = snapshot_state(state)
        device = state["x"].device
        before = _random_state(device)
        run(state)
        after = _random_state(device)
        # the eager step draws the random numbers the checked one drew (a module's dropout): from the same
        # state of torch's generators, and the run goes on from the state the checked step left
        _set_random_state(before, device)
        self._eager(reference)
        _set_random_state(after, device)
        worst, where = step_disagreement(state, reference, start,
                                         self._param_rows() if self._param_rows is not None else None)
        agrees = worst <= 1.0
        self.checks.append({"what": what, "step": int(start["t"]), "worst": worst, "agrees": agrees})
        if agrees:
            return
        restore_state(state, reference)
        self.distrusted = True
        self._graph = None
        self.fallback_reason = (f"the {what} disagreed with the eager step at step {int(start['t'])}: {where}")
        warnings.warn(f"train_ensemble: {self.fallback_reason}; running the eager step from the eager step's "
                      "state instead (the compiled code is not trusted)", RuntimeWarning, stacklevel=4)

    def _compiled_step(self) -> Callable[[dict], None]:
        if self.fallback_reason is not None:
            return self._eager
        if self._compiled is None:
            # dynamic=False: Dynamo's automatic dynamic shapes remember sizes by the function's source
            # place (file, line, name: torch/_dynamo/pgo.py's CodeId), not by code object, so a second
            # compiled run in the process with other shapes (another width), or this run after a
            # compaction (fewer rows), would be traced with symbolic sizes: code generic in the sizes
            # for the BN-MLP stack, and for the vmap stack a failure (functorch's batched tensors have
            # no symbolic sizes), hence the eager step
            self._compiled = torch.compile(fresh_function(self._make("func")), fullgraph=True, dynamic=False,
                                           options=compile_options())
        return self._compiled

    def _run_compiled(self, state: dict) -> None:
        fn = self._compiled_step()
        if fn is self._eager:
            fn(state)
            return
        try:
            if self._compiled_left > 0:
                self._compiled_left -= 1
                self._checked("compiled step", fn, state)
            else:
                fn(state)
        except Exception as e:
            reason = compile_failure(e)
            if reason is None:
                raise
            self.fallback_reason = reason  # compilation failed: nothing has run
            warnings.warn(f"train_ensemble: the compiled step failed to compile ({self.fallback_reason}); "
                          "running the eager step instead", RuntimeWarning, stacklevel=3)
            self._eager(state)

    def __call__(self, state: dict) -> None:
        with torch.no_grad():
            if self.mode == "eager" or self.distrusted:
                self._eager(state)
            elif self.mode == "compile":
                self._run_compiled(state)
            else:
                self._replay(state)

    def _replay(self, state: dict) -> None:
        if self._graph is None:
            if self._warm < self._warmup:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run_compiled(state)
                torch.cuda.current_stream().wait_stream(side)
                self._warm += 1
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._compiled_step()(state)
            self._graph = graph
        if self._replays_left > 0:
            self._replays_left -= 1
            self._checked("captured step", lambda s: self._graph.replay(), state)
        else:
            self._graph.replay()
