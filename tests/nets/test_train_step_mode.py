"""train(step_mode="compile") against the eager step, and the option's checks.

Tolerance of compiled against eager (float64, 20 steps): the compiled forward/backward and optimizer
step evaluate the same formulas, differing in the order of reductions (≤ k·u relative for k ≤ 64
terms, u = 2⁻⁵³; Higham §3.1) and in fused elementwise chains (≤ one rounding per operation), so ~1e-14
per step; 20 steps through two BN layers amplify that by ≤ 10³ (the Lipschitz bound measured in
test_ensemble.py), hence 1e-10 relative and absolute on the final state — 10⁶ below what one update
changes (~1e-4 at lr 0.05), so a missing or doubled step, a lost momentum buffer or an update of the
wrong parameter fails.  Histories are float32 (two ulps).

Adam: torch.optim counts its steps in a float32 tensor.  The eager step reads the count with ``.item()``
and evaluates the bias corrections 1 - β^t in double precision; the compiled step (Dynamo keeps the
tensor) would evaluate them in float32, where 1 - 0.999 is 1.3e-5 off: the update 6.6e-6 off relative,
the float64 run 1e-6 off after 20 steps and the float32 loss history 6e-7 (5 ulps) — a formula evaluated
in another precision, not rounding, so train makes the counts float64 before the compiled step runs
(``_count_steps_in_float64``) and the tolerances above hold for Adam unchanged (measured: 4e-16 on the
final state).  ``test_compiled_adam_with_float32_step_counts_is_not_eager`` keeps the counts float32 and
sees the comparison fail.  The Adam case trains an MLP without biases: a bias feeding a BN layer has a
zero gradient in exact arithmetic, its computed gradient is rounding noise (~1e-17) that Adam divides
by √v̂ + ε ≈ ε = 1e-8, so the two routes move it (and the running mean that tracks it) by different
noise of ~1e-10 per step — 1e-9 after 20 steps, a property of Adam on that bias, not of the route.
"""
from __future__ import annotations

import functools
import importlib
import warnings

import numpy as np
import pytest
import torch

from bnlab.nets import MLP, TRAIN_STEP_MODES, train

from ._data import digits

torch.set_num_threads(1)
F64 = torch.float64


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-2)
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)  # 1e-3 stays below 0.3 accuracy in 20 steps
# (optimizer, MLP biases): Adam without biases, see the module's docstring
CASES = [pytest.param(SGD, True, id="sgd-momentum-weight_decay"), pytest.param(ADAM, False, id="adam")]


def _train(mode, optimizer, steps=20, width=16, bias=True):
    train_set, test_set = digits(np.float64)
    model = MLP(64, [width, width], 10, norm="bn", seed=0, dtype=F64, bias=bias)
    res = train(model, train_set, optimizer=optimizer, batch_size=16, steps=steps, test_data=test_set, seed=3,
                step_mode=mode)
    return res, model


def _train_compiled(optimizer, width=16, bias=True):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train("compile", optimizer, width=width, bias=bias)
    # the compiled parts ran: a fallback to eager would make the comparison eager against eager
    assert not [w for w in caught if "failed to compile" in str(w.message)], [str(w.message) for w in caught]
    return out


def _assert_same(a, b):
    (ra, ma), (rb, mb) = a, b
    assert (ra.diverged, ra.steps) == (rb.diverged, rb.steps)
    np.testing.assert_allclose(rb.history, ra.history, rtol=2.4e-7, atol=0)
    assert rb.test_accuracy == ra.test_accuracy
    for (k, x), y in zip(ma.state_dict().items(), mb.state_dict().values()):
        if x.is_floating_point():
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10, msg=k)
        else:
            assert torch.equal(x, y), k


@pytest.mark.slow
@pytest.mark.parametrize("opt, bias", CASES)
def test_compiled_train_step_equals_eager(opt, bias):
    eager = _train("eager", opt, bias=bias)
    assert eager[0].test_accuracy > 0.3  # trained: the comparison is not between two untouched nets
    _assert_same(eager, _train_compiled(opt, bias=bias))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # Inductor compilations
def test_a_compiled_step_with_dropout_draws_the_eager_steps_random_numbers():
    # Inductor generates its own random numbers unless told to call the eager kernels (bnlab._inductor's
    # fallback_random): without it this run's losses were 0.17 apart from the eager run's by step 5
    # (measured 2026-11-28); with it the compiled run is the eager run to rounding (the tolerance above)
    from ._models import dropout_bn_mlp

    train_set, test_set = digits(np.float64)
    runs = []
    for mode in ("eager", "compile"):
        torch.manual_seed(5)  # dropout's generator: the same start
        model = dropout_bn_mlp(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = train(model, train_set, optimizer=SGD, batch_size=16, steps=20, test_data=test_set, seed=3,
                        step_mode=mode)
        assert not [w for w in caught if "failed to compile" in str(w.message)]
        runs.append((res, model))
    _assert_same(*runs)


def _trace_on_aot_eager(monkeypatch):
    # Dynamo's "aot_eager" backend runs the traced aten graphs without Inductor's code generation
    # (seconds here instead of minutes)
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="aot_eager", **{k: v for k, v in kw.items() if k != "options"}))


@pytest.mark.parametrize("opt, bias", CASES)
def test_traced_train_step_equals_eager(monkeypatch, opt, bias):
    # the default suite's part: the compiled route's two regions as Dynamo traces them (forward + loss
    # with AOTAutograd's backward, and the optimizer step) against eager.  Inductor itself: the slow
    # test above
    _trace_on_aot_eager(monkeypatch)
    eager = _train("eager", opt, bias=bias)
    assert eager[0].test_accuracy > 0.3
    _assert_same(eager, _train_compiled(opt, bias=bias))


def test_compiled_adam_with_float32_step_counts_is_not_eager(monkeypatch):
    # the comparison can fail, and the float64 counts are what make Adam pass it: left float32, the
    # compiled bias corrections are float32's and the final state is ~1e-6 off (10^4 above 1e-10)
    _trace_on_aot_eager(monkeypatch)
    train_module = importlib.import_module("bnlab.nets.train")  # the module (bnlab.nets.train is the function)
    monkeypatch.setattr(train_module, "_count_steps_in_float64", lambda opt: None)
    eager = _train("eager", ADAM, bias=False)
    compiled = _train_compiled(ADAM, bias=False)
    off = max(((y - x).abs().max() / x.abs().max()).item() for x, y in zip(eager[1].parameters(),
                                                                          compiled[1].parameters()))
    assert off > 1e-8  # measured 3e-6 relative
    with pytest.raises(AssertionError, match="Not equal to tolerance"):  # the float32 history already
        _assert_same(eager, compiled)


@pytest.mark.parametrize("bad", ["cuda_graph", "auto", "", None, 1])
def test_bad_step_mode_names_the_argument(bad):
    with pytest.raises(ValueError, match="step_mode"):
        _train(bad, functools.partial(torch.optim.SGD, lr=0.05), steps=1)
    assert TRAIN_STEP_MODES == ("eager", "compile")


def test_a_step_that_does_not_compile_falls_back_to_eager(monkeypatch):
    # a compilation failure (raised before compiled code runs) of the loss or of the optimizer's step
    # gives a warning and the eager function: the same run as eager, number for number
    class _NoCompile(torch._dynamo.exc.TorchDynamoException):
        pass

    def fake_compile(fn, **kwargs):
        def failing(*args):
            raise _NoCompile("unsupported here")
        return failing

    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    eager = _train("eager", sgd, steps=6)
    monkeypatch.setattr(torch, "compile", fake_compile)
    with pytest.warns(RuntimeWarning, match="failed to compile.*unsupported here") as rec:
        fallback = _train("compile", sgd, steps=6)
    assert {str(w.message).split(" failed")[0] for w in rec} == {"train: the compiled loss",
                                                                 "train: the compiled optimizer step"}
    assert len(rec) == 2  # one warning each, then eager for good
    assert eager[0].history == fallback[0].history
    for x, y in zip(eager[1].parameters(), fallback[1].parameters()):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_a_runtime_error_in_the_compiled_step_is_not_swallowed(monkeypatch):
    # only compilation failures fall back; an error of the computation itself propagates
    def fake_compile(fn, **kwargs):
        def failing(*args):
            raise RuntimeError("shape mismatch in the user's loss")
        return failing

    monkeypatch.setattr(torch, "compile", fake_compile)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _train("compile", functools.partial(torch.optim.SGD, lr=0.05), steps=3)
