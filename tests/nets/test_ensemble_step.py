"""The routes of train_ensemble's step (eager, compiled, CUDA graph) against each other, and the step's contract.

Tolerances of compiled against eager (float64, 20 steps).  Both routes evaluate the same formulas in
float64; the compiled step (``torch.compile``, Inductor) differs only in (i) the order of the sums in its
reductions (batch means and variances, the gradients' sums over the batch; the products themselves
call the same BLAS), each of k ≤ 64 terms with a relative error ≤ k·u, u = 2⁻⁵³ ≈ 1.1e-16 (Higham,
Accuracy and Stability of Numerical Algorithms, §3.1), so ≤ 7e-15; and (ii) fused elementwise chains
that keep intermediates in float64 registers (at most a rounding per operation either way, or one
fewer under an FMA).  20 steps through ≤ 3 BN layers amplify a perturbation by the product of the
step maps' Lipschitz constants, ≤ 10³ at these learning rates (the bound derived and measured in
``test_ensemble.py``), so the final states agree to ~1e-11: asserted at 1e-10 of each tensor's scale (its
largest entry, at least 1; as the issue asks; measured ~2e-15) — for SGD; RMSProp amplifies the rounding of gradients driven
towards zero by 1/sqrt(v), so its compiled comparisons hold 1e-8 (``_compiled_tolerance``).  Either is
10⁴–10⁶ below the ~1e-4–1e-3 a single update moves a weight here, so a missing or doubled update, a
wrong learning rate, a lost momentum or RMSProp state, or a mask that freezes a network a step early or late fails by orders of magnitude.  The loss history is
float32 (as ``train()``'s): two float64 losses 1e-15 apart round to float32 values at most one ulp
apart (2⁻²³ ≈ 1.2e-7 relative), asserted at two ulps; NaN where the other has NaN.  Test accuracies
count argmax agreements: exact unless two logits tie within 1e-10 (none do).

Divergence in every comparison: one network explodes at step 1 (a learning rate of 1e200, or 1e10
under RMSProp), and one is stopped mid-run, after a check, by ``diverge_above``: a network with a
learning rate of 1e-12 does not learn, so its loss follows its batches; the threshold is set between
the largest loss of any network before a step t* ∈ [5, 15] and its loss at t*, found in an eager
pre-run (so it stops exactly at t*, asserted).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from bnlab._inductor import compile_options
from bnlab.nets import BNMLP, ENSEMBLE_STEP_MODES, MLP, train_ensemble
from bnlab.nets._ensemble_step import StepConfig, resolve_step_mode
from bnlab.nets.ensemble import _BNMLPStack, _EnsembleRun

from . import _fake_cuda_graphs as fake_cuda_graphs
from ._data import digits

torch.set_num_threads(1)
F64 = torch.float64
_STEPS, _CHECK = 20, 5


def _digits():
    return digits(np.float64)


def _models(stack: str, depths=(3, 1, 2, 3)) -> list[torch.nn.Module]:
    if stack == "bnmlp":
        # depth-mixed (the prefix stacking: layer l holds only the networks deeper than l)
        specs = [(1.0, 0.0, 1e-3), (0.5, 0.2, 0.1), (1.0, 0.0, 1e-3), (1.5, 0.0, 1e-2)]
        models = [BNMLP(64, 10, depth=d, width=12, gamma=g, beta=b, eps=e, seed=i, dtype=F64)
                  for i, (d, (g, b, e)) in enumerate(zip(depths, specs))]
        readout = models[2].readout
    else:
        # "vmap": one stack; "grouped": two structures (two and one hidden layers), one stack each
        models = [_vmap_mlp(i, 12, depth=1 if stack == "grouped" and i % 2 else 2) for i in range(4)]
        readout = [m for m in models[2].modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        readout.weight.mul_(10.0)  # the frozen network's loss well above the others', varying with its batch
    return models


def _vmap_mlp(seed: int, width: int, depth: int = 2) -> torch.nn.Module:
    # torch's BatchNorm1d through the vmap stack, after a tanh ("post").  Not before BN: a bias right
    # before BN (or before a ReLU active on the whole batch, then BN) has an exactly-zero gradient up to
    # rounding noise (~1e-17), which RMSProp turns into an update of ±lr and a learning rate of 1e200
    # into ±1e183 — with the sign of the noise, different under any two summation orders
    return MLP(64, [width] * depth, 10, phi="tanh", norm="bn", placement="post", seed=seed, dtype=F64)


def _lrs(optimizer: str) -> list[float]:
    # [learns, explodes at step 1, frozen (stopped mid-run by the threshold), learns]
    return [0.05, 1e200, 1e-12, 0.02] if optimizer == "sgd" else [0.005, 1e10, 1e-12, 0.002]


def _run(stack, optimizer, kw, loss, mode, diverge_above=None, frozen_seed=2, depths=(3, 1, 2, 3)):
    train_set, test_set = _digits()
    models = _models(stack, depths)
    results = train_ensemble(models, train_set, test_data=test_set, lr=_lrs(optimizer), batch_size=16, steps=_STEPS,
                             seeds=[0, 1, frozen_seed, 3], optimizer=optimizer, loss=loss, check_every=_CHECK,
                             diverge_above=diverge_above, step_mode=mode, rmsprop_alpha=0.9, **kw)
    return results, models


def _mid_run_threshold(stack, optimizer, kw, loss, depths) -> tuple[float, int, int]:
    """(``diverge_above``, t*, data seed of network 2): the threshold stops network 2 (frozen) at a step
    t* in [5, 15] and no network earlier; the first data seed (of a few) whose batches give a record then."""
    for seed in (2, 4, 5, 6, 7, 8, 9, 10):
        results, _ = _run(stack, optimizer, kw, loss, "eager", frozen_seed=seed, depths=depths)
        hist = np.full((_STEPS, 4), np.nan)
        for j, r in enumerate(results):
            hist[: len(r.history), j] = r.history
        # the exploding network's inf, NaN or huge losses from step 1 on stop it whatever the threshold
        hist[1:, 1] = -np.inf
        for t in range(_CHECK, 16):
            before = hist[:t].max()
            if hist[t, 2] > before:
                return float((before + hist[t, 2]) / 2), t, seed
    raise AssertionError("no mid-run record loss of the frozen network: the test would not stop one mid-run")


def _assert_routes_agree(stack, optimizer, kw, loss, mode="compile", depths=(3, 1, 2, 3), tol=1e-10):
    threshold, t_star, seed = _mid_run_threshold(stack, optimizer, kw, loss, depths)
    ref, ref_models = _run(stack, optimizer, kw, loss, "eager", threshold, seed, depths)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, got_models = _run(stack, optimizer, kw, loss, mode, threshold, seed, depths)
    # the compiled step ran: a fallback to eager would make this an eager-against-eager comparison — after
    # a compilation failure, or after its check against the eager step (StepRunner) disagreed, which
    # would also be a false alarm of that check: these runs explode one network at step 1 and stop one
    # mid-run, in both stacks, for every optimizer and loss (test_ensemble_verify.py)
    assert not [w for w in caught if "failed to compile" in str(w.message) or "disagreed" in str(w.message)], \
        [str(w.message) for w in caught]
    # the divergence happened as designed: one network at step 1, the frozen one at t* (after a check)
    assert ref[1].diverged and ref[1].diverged_at_step == 1
    assert ref[2].diverged and ref[2].diverged_at_step == t_star >= _CHECK
    assert not ref[0].diverged and not ref[3].diverged
    assert max(ref[0].test_accuracy, ref[3].test_accuracy) > 0.15  # trained (chance 0.1)
    for r, g in zip(ref, got):
        assert (g.diverged, g.diverged_at_step, g.steps) == (r.diverged, r.diverged_at_step, r.steps)
        a, b = np.asarray(r.history), np.asarray(g.history)
        assert a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(b[~np.isnan(b)], a[~np.isnan(a)], rtol=2.4e-7, atol=0)
        assert g.test_accuracy == r.test_accuracy
        if r.test_loss is None:
            assert g.test_loss is None
        else:
            assert g.test_loss == pytest.approx(r.test_loss, rel=tol, abs=tol)
    for m_ref, m_got in zip(ref_models, got_models):
        for (k, a), b in zip(m_ref.state_dict().items(), m_got.state_dict().values()):
            if a.is_floating_point():
                # against the tensor's scale (its largest entry, at least 1), not entry by entry: in the
                # network exploding at lr = 1e200 an entry θ0 − lr·g whose gradient g is a sum that
                # cancels carries g's rounding, ~1e-15 of the largest gradient, times 1e200 — 1e184 next
                # to entries of 1e199 (measured on the vmap stack, squared loss), however small the entry
                assert torch.equal(torch.isnan(a), torch.isnan(b)), k
                fin = ~torch.isnan(a)
                err = float((b[fin] - a[fin]).abs().max()) if fin.any() else 0.0
                scale = max(1.0, float(a[fin].abs().max())) if fin.any() else 1.0
                assert err <= tol * scale, (k, err, scale)
            else:
                assert torch.equal(a, b), k  # BN's num_batches_tracked


# the optimizer × loss variants train_ensemble supports (every optimizer, momentum, weight decay, both losses)
_VARIANTS = {
    "sgd-ce": ("sgd", {}, "cross_entropy"),
    "sgd-momentum-mse": ("sgd", dict(momentum=0.9), "mse"),
    "sgd-weight_decay-mse": ("sgd", dict(weight_decay=1e-2), "mse"),
    "sgd-momentum-weight_decay-ce": ("sgd", dict(momentum=0.9, weight_decay=1e-2), "cross_entropy"),
    "rmsprop-ce": ("rmsprop", {}, "cross_entropy"),
    "rmsprop-momentum-weight_decay-mse": ("rmsprop", dict(momentum=0.9, weight_decay=1e-2), "mse"),
}


def _without_inductor_options(kw: dict) -> dict:
    # Inductor's options (bnlab._inductor) mean nothing to another backend: left out where a test swaps it in
    return {k: v for k, v in kw.items() if k != "options"}


def test_compiled_step_equals_eager():
    # the default suite's compiled comparison: the BN-MLP stack (the GPU target), depths 2 and 1 mixed,
    # momentum and weight decay, one network exploding and one stopped mid-run.  Compiling takes 1.5 min
    # here with Inductor's cache warm, 4–5 min cold on a loaded 2-core machine; the rest of the matrix
    # (deeper, every optimizer and loss, both stacks) is slow-marked below
    _assert_routes_agree("bnmlp", *_VARIANTS["sgd-momentum-weight_decay-ce"], depths=(2, 1, 2, 1))


@pytest.mark.slow
@pytest.mark.timeout(2400)  # one to three compilations, each up to ~10 min on a loaded 2-core machine
@pytest.mark.parametrize("stack", ["bnmlp", "vmap"])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_compiled_step_equals_eager_for_every_optimizer_and_loss(stack, variant):
    _assert_routes_agree(stack, *_VARIANTS[variant], tol=_compiled_tolerance(_VARIANTS[variant][0]))


def _compiled_tolerance(optimizer: str) -> float:
    # SGD: 1e-10 (the module docstring).  RMSProp divides each gradient by sqrt(v), its running RMS, so
    # a gradient's rounding error δg reaches the update as lr·δg/sqrt(v) — amplified without bound where
    # a gradient component is driven towards zero (an output bias once it has learned the mean residual:
    # g = a batch mean of O(1) terms that cancel to ~1e-6, δg ~ 16·u ≈ 2e-15, so δg/sqrt(v) ~ 2e-9 and,
    # with lr = 0.002 and momentum 0.9 (×10), up to ~4e-11 in each step where it happens; measured on the
    # vmap stack with squared loss, momentum and weight decay: 1.3e-10 absolute on the readout bias of a
    # learning network, 1.3e-9 relative on the network exploding at lr = 1e10).  Only the summation order
    # differs between the routes (the uncompiled functional step meets 1e-10: the default suite's test
    # above), so 1e-8 here (of each tensor's scale, as every comparison): an entry whose gradient is
    # rounding noise around zero moves by lr·noise/(|noise| + ε), whose sign neither route controls (up to lr·|noise|/ε: ~10 in the exploding network, lr = 1e10 and noise
    # ~1e-17, next to entries of ~3e10; measured there: 41.6, 1.3e-9 of the scale).  A wrong update is
    # still off by ≥ 1e-4 of the scale
    return 1e-10 if optimizer == "sgd" else 1e-8


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("variant", ["sgd-momentum-mse", "rmsprop-ce"])
def test_compiled_step_equals_eager_for_networks_of_several_structures(variant):
    # two vmap stacks in one step; the compiled route drops a stopped network from each group at once
    _assert_routes_agree("grouped", *_VARIANTS[variant], tol=_compiled_tolerance(_VARIANTS[variant][0]))


@pytest.mark.parametrize("stack", ["bnmlp", "vmap"])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_the_functional_step_equals_eager_for_every_optimizer_and_loss(stack, variant, monkeypatch):
    # the default suite's part of the matrix above, in seconds: the step the compiled route hands to
    # torch.compile (gradients by torch.func.grad / vmap(grad), the parameters the loss does not use
    # masked) run as it is, against the eager route (torch.autograd.grad), for every optimizer × loss
    # variant on both stacks, with the same divergence set-up and tolerances.  What compiling adds (the
    # summation orders of Inductor's kernels) is the compiled comparisons' part: one in the default
    # suite, every variant under -m slow
    import bnlab.nets._ensemble_step as step_mod

    passed = []
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: passed.append(kw) or fn)
    _assert_routes_agree(stack, *_VARIANTS[variant], depths=(2, 1, 2, 1))
    # the route under test was the compiled route's step, with bnlab's Inductor options (bnlab._inductor)
    assert passed == [dict(fullgraph=True, dynamic=False, options=compile_options())]


def test_a_second_compiled_run_with_other_shapes_still_compiles(monkeypatch):
    # Dynamo's automatic dynamic shapes are keyed by the step function's file, line and name, so without
    # dynamic=False a second compiled run in the same process with other sizes is traced with symbolic
    # sizes, which the vmap stack's functorch transforms cannot take: that run fell back to eager (a
    # sweep, or the slow matrix in one process).  Dynamo's own backend "aot_eager" (no Inductor code
    # generation, seconds) keeps this cheap: the failure was in Dynamo's tracing, before any backend.
    import bnlab.nets._ensemble_step as step_mod

    real = torch.compile
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", **_without_inductor_options(kw)))
    train_set, _ = _digits()
    for width in (6, 9):
        models = [MLP(64, [width], 10, phi="tanh", norm="bn", placement="post", seed=i, dtype=F64) for i in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager warns: fail on it
            res = train_ensemble(models, train_set, lr=0.05, batch_size=16, steps=3, step_mode="compile")
        assert all(not r.diverged for r in res)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("mode", ["cuda_graph", "compile"])
@pytest.mark.parametrize("stack", ["bnmlp", "vmap"])
def test_cuda_routes_equal_eager_on_the_gpu(mode, stack, monkeypatch):
    # the same comparison on CUDA (the models and data move there); cuBLAS may block a product
    # differently between two calls only across configurations, not between the routes' identical calls,
    # so the tolerances above hold
    import bnlab.nets.ensemble as ens

    real = ens.resolve_device
    monkeypatch.setattr(ens, "resolve_device", lambda device: real("cuda"))
    _assert_routes_agree(stack, *_VARIANTS["sgd-momentum-weight_decay-ce"], mode=mode)


# --------------------------------------------------------------------------- the route chooser
@pytest.mark.parametrize("bad", ["fast", "", "EAGER", None, 3, "cuda-graph"])
def test_bad_step_modes_name_the_argument(bad):
    train_set, _ = _digits()
    with pytest.raises(ValueError, match="step_mode"):
        train_ensemble([BNMLP(64, 10, depth=2, width=8, dtype=F64)], train_set, lr=0.1, batch_size=16, steps=1,
                       step_mode=bad)


def test_cuda_graph_on_the_cpu_is_a_clear_error():
    train_set, _ = _digits()
    m = BNMLP(64, 10, depth=2, width=8, dtype=F64)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"step_mode='cuda_graph' is not allowed on device='cpu'.*CUDA"):
        train_ensemble([m], train_set, lr=0.1, batch_size=16, steps=1, step_mode="cuda_graph")
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # refused before any step


def test_auto_captures_long_cuda_runs_and_compiles_long_cpu_runs():
    from bnlab.nets._ensemble_step import AUTO_COMPILE_STEPS

    assert ENSEMBLE_STEP_MODES == ("auto", "eager", "compile", "cuda_graph")
    assert resolve_step_mode("auto", torch.device("cpu"), steps=600) == "eager"
    assert resolve_step_mode("auto", torch.device("cpu"), steps=AUTO_COMPILE_STEPS - 1) == "eager"
    assert resolve_step_mode("auto", torch.device("cpu"), steps=AUTO_COMPILE_STEPS) == "compile"
    assert resolve_step_mode("auto", torch.device("cuda"), steps=10) == "eager"  # a device object needs no GPU
    assert resolve_step_mode("auto", torch.device("cuda"), steps=10**5) == "cuda_graph"
    assert resolve_step_mode("compile", torch.device("cpu")) == "compile"
    assert resolve_step_mode("cuda_graph", torch.device("cuda", 0)) == "cuda_graph"


@pytest.mark.parametrize("device, steps, expected", [
    ("cpu", 1, "eager"), ("cpu", 600, "eager"), ("cpu", "limit-1", "eager"), ("cpu", "limit", "compile"),
    ("cpu", "limit+1", "compile"), ("cuda", 1, "eager"), ("cuda", "limit-1", "eager"),
    ("cuda:0", "limit", "cuda_graph"), ("cuda", "limit+1", "cuda_graph"),
])
def test_auto_route_by_device_and_steps(device, steps, expected):
    # the rule: CUDA → "cuda_graph" from AUTO_CUDA_GRAPH_STEPS steps on, CPU → "compile" from
    # AUTO_COMPILE_STEPS steps on, below either "eager" (a torch.device of type cuda needs no GPU to be built)
    from bnlab.nets._ensemble_step import AUTO_COMPILE_STEPS, AUTO_CUDA_GRAPH_STEPS

    if isinstance(steps, str):
        limit = AUTO_CUDA_GRAPH_STEPS if device.startswith("cuda") else AUTO_COMPILE_STEPS
        steps = limit + {"limit-1": -1, "limit": 0, "limit+1": 1}[steps]
    assert resolve_step_mode("auto", torch.device(device), steps) == expected


def test_auto_route_as_for_chooses_for_the_given_length_and_restores():
    # a plan's pilot cuts a long task to a few steps but must time the whole task's route
    from bnlab.nets import auto_route_as_for
    from bnlab.nets._ensemble_step import AUTO_COMPILE_STEPS

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with auto_route_as_for(AUTO_COMPILE_STEPS):
        assert resolve_step_mode("auto", cpu, 3) == "compile"
        assert resolve_step_mode("auto", cuda, 3) == "cuda_graph"
        assert resolve_step_mode("eager", cpu, 3) == "eager"  # an explicit route is not overridden
        with auto_route_as_for(5):
            assert resolve_step_mode("auto", cpu, 10**6) == "eager"
        assert resolve_step_mode("auto", cpu, 3) == "compile"  # nested: the outer length is back
    assert resolve_step_mode("auto", cpu, 3) == "eager"
    with pytest.raises(RuntimeError):
        with auto_route_as_for(AUTO_COMPILE_STEPS):
            raise RuntimeError("a pilot that fails")
    assert resolve_step_mode("auto", cpu, 3) == "eager"  # restored after an exception too
    with pytest.raises(ValueError, match=r"steps"):
        with auto_route_as_for(0):
            pass


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_explicit_routes_ignore_the_length_of_the_run(mode):
    for steps in (1, 10**6):
        assert resolve_step_mode(mode, torch.device("cpu"), steps) == mode
    assert resolve_step_mode(mode, torch.device("cuda"), 1) == mode  # compile on CUDA without graph capture


def test_bad_step_mode_message_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"step_mode='fast' is not allowed: expected one of 'auto', 'eager', "
                                         r"'compile', 'cuda_graph'"):
        resolve_step_mode("fast", torch.device("cpu"), 10)


@pytest.mark.parametrize("steps, limit, expected", [(4, 5, "eager"), (5, 5, "compile")])
def test_train_ensemble_runs_the_route_auto_chose(steps, limit, expected, monkeypatch):
    # train_ensemble(step_mode="auto") hands the chooser its device and its number of steps (epochs
    # converted), and runs what it returns: the limit lowered to 5 steps, a run of 4 steps is eager
    # and one of 5 compiles (torch.compile replaced by the identity: only the route is under test)
    import bnlab.nets._ensemble_step as step_mod
    import bnlab.nets.ensemble as ens

    monkeypatch.setattr(step_mod, "AUTO_COMPILE_STEPS", limit)
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: fn)
    modes = []
    real_runner = ens.StepRunner

    def recording_runner(mode, *args, **kw):
        modes.append(mode)
        return real_runner(mode, *args, **kw)

    monkeypatch.setattr(ens, "StepRunner", recording_runner)
    train_set, _ = _digits()
    n = len(train_set[1])
    train_ensemble([BNMLP(64, 10, depth=1, width=8, dtype=F64)], train_set, lr=0.05, batch_size=16, steps=steps)
    # the default step_mode is "auto"; epochs are counted in steps (round(epochs · ⌊n/B⌋))
    train_ensemble([BNMLP(64, 10, depth=1, width=8, dtype=F64)], train_set, lr=0.05, batch_size=16,
                   epochs=steps / (n // 16))
    assert modes == [expected, expected]


def test_a_step_that_does_not_compile_falls_back_to_eager_with_a_warning(monkeypatch):
    # a compilation error (Dynamo's or Inductor's, raised before the graph runs) gives a warning and the
    # eager step, and the run's numbers are the eager run's (the same operations in the same order)
    import bnlab.nets._ensemble_step as step_mod

    class _NoCompile(torch._dynamo.exc.TorchDynamoException):
        pass

    def fake_compile(fn, **kwargs):
        def failing(state):
            raise _NoCompile("cannot trace this")
        return failing

    monkeypatch.setattr(step_mod.torch, "compile", fake_compile)
    train_set, test_set = _digits()
    specs = [(2, 0), (1, 1)]
    runs = {}
    for mode in ("eager", "compile"):
        models = [BNMLP(64, 10, depth=d, width=8, seed=s, dtype=F64) for d, s in specs]
        if mode == "compile":
            with pytest.warns(RuntimeWarning, match="failed to compile.*cannot trace this"):
                res = train_ensemble(models, train_set, test_data=test_set, lr=0.05, batch_size=16, steps=6,
                                     seeds=[0, 1], step_mode=mode)
        else:
            res = train_ensemble(models, train_set, test_data=test_set, lr=0.05, batch_size=16, steps=6,
                                 seeds=[0, 1], step_mode=mode)
        runs[mode] = (res, models)
    for r, g in zip(runs["eager"][0], runs["compile"][0]):
        assert r.history == g.history and r.test_accuracy == g.test_accuracy
    for a, b in zip(runs["eager"][1], runs["compile"][1]):
        for x, y in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


# --------------------------------------------------------------------------- the step's contract
_SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal", "aten.unique",
          "aten._unique2", "aten.masked_select")


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))  # "aten.<name>.<overload>"
        return func(*args, **(kwargs or {}))


def _small_run(stack_kind: str = "bnmlp", **cfg_kw):
    x, y = (torch.as_tensor(a) for a in _digits()[0])
    models = [BNMLP(64, 10, depth=d, width=8, seed=i, dtype=F64) for i, d in enumerate([2, 1, 3])]
    stack = _BNMLPStack(models, torch.device("cpu"))
    kw = dict(loss="cross_entropy", optimizer="rmsprop", momentum=0.9, weight_decay=1e-2, rmsprop_alpha=0.9,
              rmsprop_eps=1e-8, diverge_above=5.0, shared_order=False, num_networks=3)
    kw.update(cfg_kw)
    return _EnsembleRun(stack, StepConfig(**kw), "eager", x.to(F64), y, lrs=[0.01, 1e10, 0.02], seeds=[0, 1, 2],
                        batch_size=16, steps=12, check_every=4)


def test_the_step_never_waits_for_the_device():
    # no .item(), bool(), nonzero() or data-dependent shape inside a step (each would be a host sync on a
    # GPU, and would break a CUDA graph capture): only the checks every check_every steps look.  The
    # recorder sees the sync ops when they happen (the check below), so the assertion can fail.
    run = _small_run()
    for _ in range(3):
        with _Recorder() as rec:
            run.step()
        assert not [op for op in rec.ops if op.rsplit(".", 1)[0] in _SYNCS], rec.ops
        assert rec.ops  # the recorder saw the step
    with _Recorder() as rec:
        run.step()  # step 4: the window's last step
        run.check()
    assert any(op.startswith("aten._local_scalar_dense") for op in rec.ops)


def test_host_reads_change_nothing_but_the_syncs():
    # the eager CPU step's shortcut (host_reads: the stop masks skipped while every network is active) must
    # give the same numbers, also across the step where network 1 (lr 1e10) stops.  The two routes run the
    # same float64 ops on the same values, but on tensors at other addresses, and a BLAS may pick its kernel by
    # alignment: the floats are compared to rounding (float64 parameters to 1e-12, the float32 loss history
    # to 2 ulps), the stop bookkeeping exactly.  A wrong shortcut — a stopped network updated with its
    # non-finite gradient — turns its parameters to NaN (7 after nan_to_num) against finite ones: far outside.
    runs = [_small_run(host_reads=h) for h in (False, True)]
    for _ in range(12):
        for r in runs:
            r.step()
    a, b = (r.state for r in runs)
    assert torch.equal(a["active"], b["active"]) and not bool(a["active"].all())  # a network did stop
    assert torch.equal(a["first_bad"], b["first_bad"])
    ha, hb = (torch.from_numpy(r.history()) for r in runs)
    assert ha.shape == (12, 3)
    torch.testing.assert_close(ha.nan_to_num(7.0), hb.nan_to_num(7.0), rtol=2.4e-7, atol=0)
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(p.nan_to_num(7.0), q.nan_to_num(7.0), rtol=1e-12, atol=0)
    with _Recorder() as rec:
        _small_run(host_reads=True).step()
    assert any(op.startswith("aten._local_scalar_dense") for op in rec.ops)  # it does read (and only here)


def test_the_step_tensors_are_rewritten_in_place():
    # a CUDA graph replays on the buffers it captured: the step must update its state in place and never
    # rebind it (same tensors, same storage, before and after a step)
    run = _small_run(shared_order=True)
    st = run.state

    def ptrs():
        flat = []
        for v in st.values():
            for t in (v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else [v]):
                if isinstance(t, torch.Tensor):
                    flat.append(t.data_ptr())
        return flat

    before = ptrs()
    p0 = [p.clone() for p in st["params"]]
    run.step()
    run.step()
    assert ptrs() == before
    assert int(st["t"]) == 2 and int(st["slot"]) == 2
    assert all(not torch.equal(a, b) for a, b in zip(p0, st["params"]))  # and they did change


def test_windows_of_drawn_batches_do_not_change_the_data_order(monkeypatch):
    # the batch indices are drawn a window ahead; a window shorter than check_every (many refills, one
    # not dividing the steps) gives the same run, number for number
    import bnlab.nets.ensemble as ens

    train_set, _ = _digits()

    def run():
        models = [BNMLP(64, 10, depth=d, width=8, seed=i, dtype=F64) for i, d in enumerate([2, 1])]
        res = train_ensemble(models, train_set, lr=0.05, batch_size=16, steps=11, seeds=[3, 4], check_every=10)
        return [r.history for r in res], [p.detach().clone() for m in models for p in m.parameters()]

    h1, p1 = run()
    monkeypatch.setattr(ens, "_MAX_WINDOW", 3)
    h2, p2 = run()
    assert h1 == h2
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("stack", ["bnmlp", "vmap"])
def test_a_stopped_network_keeps_its_state_from_before_its_bad_step(stack):
    # parameters and running statistics (BN buffers, num_batches_tracked included) of a network stopped
    # at step t are those after t steps, whichever route and whenever the vmap stack drops it: the bad
    # step's update and its running-statistics update are both masked.  Without the statistics mask the
    # running mean would move at every later step of the forward (by ~momentum·|batch mean − running
    # mean| ≥ 1e-3 here), far beyond the 1e-10 asserted
    train_set, _ = _digits()

    def make():
        if stack == "bnmlp":
            return [BNMLP(64, 10, depth=d, width=8, seed=i, dtype=F64) for i, d in enumerate([2, 1])]
        return [_vmap_mlp(i, 8) for i in range(2)]

    models = make()
    res = train_ensemble(models, train_set, lr=[0.05, 1e200], batch_size=16, steps=12, seeds=[0, 1], check_every=5)
    assert res[1].diverged and res[1].diverged_at_step == 1 and not res[0].diverged
    probe = make()[1]
    train_ensemble([probe], train_set, lr=1e200, batch_size=16, steps=1, seeds=1)
    state, ref = models[1].state_dict(), probe.state_dict()
    assert any("running_mean" in k for k in state)
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-9, atol=1e-10, msg=k)


def test_cuda_graph_route_warms_up_captures_once_and_replays(monkeypatch):
    # the CUDA-graph route's sequencing, on the CPU with stand-ins: torch.compile returns the functional
    # step as it is (so the func-route step runs eagerly here), a "graph" records the step it is given
    # instead of running it (as a capture records kernels without executing them) and replays it.  Two
    # warm-up steps, one capture, a replay per later step; the vmap stack's compaction at a check (one of
    # two networks left) forces a second warm-up and capture; and the numbers are the eager route's
    events: list[str] = []
    fake_cuda_graphs.install(monkeypatch, events)

    train_set, test_set = _digits()
    runs = {}
    for mode in ("eager", "cuda_graph"):
        models = [_vmap_mlp(i, 8) for i in range(2)]
        res = train_ensemble(models, train_set, test_data=test_set, lr=[0.05, 1e200], batch_size=16, steps=12,
                             seeds=[0, 1], check_every=5, step_mode=mode)
        runs[mode] = (res, models)
    # steps 0-1 warm, capture + replay at 2, replays 3-4; the check after step 5 drops the exploded
    # network (1 of 2 left): warm 5-6, capture + replay at 7, replays to step 11
    assert events == ["warm"] * 2 + ["capture"] + ["replay"] * 3 + ["warm"] * 2 + ["capture"] + ["replay"] * 5
    (ref, ref_models), (got, got_models) = runs["eager"], runs["cuda_graph"]
    assert got[1].diverged and got[1].diverged_at_step == ref[1].diverged_at_step == 1
    np.testing.assert_allclose(got[0].history, ref[0].history, rtol=2.4e-7, atol=0)
    for a, b in zip(ref_models[0].state_dict().values(), got_models[0].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_the_steps_squared_loss_is_half_squared_error():
    # the step's "mse" builds its one-hot target by a comparison (no range check reading a value): the
    # same numbers as half_squared_error, exactly (the same operations on the same 0/1 targets)
    from bnlab.nets import half_squared_error
    from bnlab.nets._ensemble_step import per_network_loss

    g = torch.Generator().manual_seed(0)
    out = torch.randn(3, 7, 5, generator=g, dtype=F64)
    y = torch.randint(0, 5, (3, 7), generator=g)
    ref = torch.stack([half_squared_error(out[m], y[m]) for m in range(3)])
    torch.testing.assert_close(per_network_loss("mse", out, y), ref, rtol=0, atol=0)


def test_a_float32_bnmlp_stack_compiles_and_equals_eager(monkeypatch):
    # float32 on the CPU the eager step's BN is one autograd node in the classic form (_BatchNormEager) and
    # the variance of the composite is _SampleVariance (setup_context form), picked by whether a functorch
    # transform is active — which Dynamo evaluates while tracing torch.func.grad.  Traced with the fused
    # node, Dynamo fails on it (checked: a TorchRuntimeError), and a fallback to eager would warn (an error
    # here).  Dynamo's
    # backend "aot_eager" (no Inductor code generation) keeps this cheap.  The compiled step then equals
    # the eager one to float32 rounding amplified by 10 steps through ≤ 3 BN layers (< 10³, the float64
    # tests' bound): 1e-4 relative, while a wrong BN gradient (O(1/b) = 6e-2) fails.
    import bnlab.nets._ensemble_step as step_mod

    real = torch.compile
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", **_without_inductor_options(kw)))
    x, y = _digits()[0]
    x32 = torch.as_tensor(x, dtype=torch.float32)

    def run(mode):
        models = [BNMLP(64, 10, depth=d, width=12, eps=1e-3, seed=i) for i, d in enumerate((3, 1, 2))]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager warns: fail on it
            train_ensemble(models, (x32, y), lr=0.05, batch_size=16, steps=10, seeds=[0, 1, 2], step_mode=mode)
        return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]

    for a, b in zip(run("compile"), run("eager")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_compiled_step_is_the_same_graph_for_any_run_length(monkeypatch):
    # a plan pilots a task cut to k1 and k2 steps and extrapolates to the whole run: if a shape of the
    # step's state followed the run's length (the loss history once did: steps·M), each pilot compiled
    # another graph (on an H200, minutes for a Yang column) and the second pilot's compilation landed in
    # the per-step estimate; nor could Inductor's graph cache serve a grid's same-shaped tasks.  A backend
    # that records the graph's input shapes (and runs it as traced) sees one graph for 3 and for 13 steps.
    import bnlab.nets._ensemble_step as step_mod

    seen = []

    def recording_backend(gm, example_inputs):
        seen.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(step_mod.torch, "compile", lambda fn, **kw: real(fn, backend=recording_backend, **_without_inductor_options(kw)))
    train_set, _ = _digits()
    histories = []
    for steps in (3, 13):
        models = [BNMLP(64, 10, depth=d, width=8, seed=i, dtype=F64) for i, d in enumerate([2, 3])]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager warns: fail on it
            res = train_ensemble(models, train_set, lr=0.05, batch_size=16, steps=steps, step_mode="compile")
        histories.append([r.history for r in res])
    assert len(seen) == 2 and seen[0] == seen[1], seen
    # and the history that now goes through a window-sized ring is whole: the 13-step run's first 3 losses
    # are the 3-step run's (same networks, same batches), every entry finite
    for short, long in zip(*histories):
        assert len(short) == 3 and len(long) == 13 and np.all(np.isfinite(long))
        np.testing.assert_allclose(long[:3], short, rtol=1e-12)


def test_the_loss_history_is_whole_when_read_in_the_middle_of_a_window():
    # the step writes its losses to a window-sized ring that the run copies out at each window boundary;
    # reading the history mid-window (after 2 and 6 of 12 steps, windows of 4) must neither lose nor
    # misplace a step: the same history as a run read only at the end
    read_mid, read_end = _small_run(), _small_run()
    seen = []
    for k in range(12):
        read_mid.step()
        read_end.step()
        if k + 1 in (2, 6):
            seen.append(read_mid.history())
    whole = read_mid.history()
    assert whole.shape == (12, 3)
    np.testing.assert_array_equal(np.isnan(whole), np.isnan(read_end.history()))
    np.testing.assert_allclose(whole, read_end.history(), rtol=2.4e-7)
    np.testing.assert_array_equal(seen[0], whole[:2])
    np.testing.assert_array_equal(seen[1], whole[:6])
    assert np.isfinite(whole[:, 0]).all()  # network 0 trains throughout: every step recorded
