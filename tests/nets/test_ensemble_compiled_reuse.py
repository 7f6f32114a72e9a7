"""The compiled ensemble step on BN-MLPs of unequal depths, at a shape where Inductor's buffer reuse
computed a wrong gradient (``bnlab._inductor``).

With ``allow_buffer_reuse`` on (torch 2.13.0, CPU), one SGD step of two float64 BN-MLPs of depths 4
and 16 (784 inputs, width 128, B = 32) moved the deepest network's last hidden weight by 0.0075
instead of 0.00084 (every other parameter exact): the weight gradient read a buffer that the
concatenation of the final activations had handed on while it was still live.  Here the compiled
route (bnlab's Inductor options) is checked against two independent routes: the eager ensemble step
and :func:`bnlab.nets.train` of each network alone (its own autograd and ``torch.optim.SGD``).

Tolerance: one step in float64; the routes differ only in summation order (Inductor's kernels,
batched products), ~1e-16 relative per operation over the ~100 operations between input and update
of a depth-16 network, so 1e-12 of the tensor's scale; the bug was off by 9e-3 of a weight of scale 0.4.

A compiled run now checks its first calls against the eager step itself (``StepRunner``) and goes on
eager where they disagree, with a warning; this test makes that warning an error, so that it still
fails where Inductor's code is wrong (with reuse on, this step is 1.4e7 times the check's tolerance,
measured on the CPU with torch 2.13.0 by the slow test below; the check itself: ``test_ensemble_verify.py``).
"""
import warnings

import pytest
import torch

from bnlab.nets import BNMLP, train, train_ensemble

F64 = torch.float64
DEPTHS = (4, 16)


def _data():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 784, generator=gen, dtype=F64), torch.randint(0, 10, (64,), generator=gen)


def _models():
    return [BNMLP(784, 10, depth=d, width=128, seed=i).to(F64) for i, d in enumerate(DEPTHS)]


def _assert_close(got, ref):
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        if a.is_floating_point():
            scale = max(1.0, float(a.abs().max()))
            assert float((b - a).abs().max()) <= 1e-12 * scale, name
        else:
            assert torch.equal(a, b), name


_ROUTES = [
    pytest.param("cpu", "compile", id="cpu-compile"),
    # on CUDA the route of a paper-scale column: the compiled step captured in a CUDA graph (gpu_check.py
    # runs the tests named cuda)
    pytest.param("cuda", "cuda_graph", id="cuda-cuda_graph",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.timeout(1200)  # one Inductor compilation: ~40 s here, minutes on a loaded 2-core machine
@pytest.mark.parametrize("device, route", _ROUTES)
def test_compiled_step_of_unequal_depths_equals_eager_and_single_network_training(device, route):
    x, y = _data()
    x, y = x.to(device), y.to(device)
    # steps: the captured route replays from its third step on (two warm-up steps run as they are)
    steps = 1 if route == "compile" else 4
    routes = {}
    for mode in ("eager", route):
        models = [m.to(device) for m in _models()]
        # a RuntimeWarning is the route's check against the eager step disagreeing (StepRunner), after
        # which the run goes on eager and the comparisons below would pass without the fix: an error here
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            train_ensemble(models, (x, y), lr=0.01, batch_size=32, steps=steps, step_mode=mode, seeds=0,
                           device=device)
        routes[mode] = models
    alone = [m.to(device) for m in _models()]
    for m in alone:
        train(m, (x, y), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01), batch_size=32, steps=steps, seed=0,
              device=device)
    for net in range(len(DEPTHS)):
        _assert_close(routes["eager"][net], alone[net])
        _assert_close(routes[route][net], alone[net])
    # the step moved the weight the bug got wrong (a step of zero would pass the comparisons above)
    start = _models()[1].weights[15].to(device)
    assert float((alone[1].weights[15] - start).abs().max()) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two Inductor compilations
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_the_routes_own_check_catches_the_fault_and_passes_the_fix(dtype, monkeypatch):
    # StepRunner's check of its first compiled calls against the eager step, on the real fault: with
    # Inductor's buffer reuse on, the first call disagrees by orders of magnitude (measured on the CPU,
    # torch 2.13.0: 1.4e7 times the tolerance in float64, 1.2e3 in float32), the run warns and ends with
    # the eager run's numbers; with bnlab's options, it agrees with a wide margin (measured 3.3e-8 and
    # 1.5e-3 of the tolerance).  Thresholds: 100 (the fault) and 0.05 (the fix), far from both
    import bnlab._inductor as inductor
    import bnlab.nets._ensemble_step as step_mod

    runners = []
    real_init = step_mod.StepRunner.__init__
    monkeypatch.setattr(step_mod.StepRunner, "__init__",
                        lambda self, *a, **k: (real_init(self, *a, **k), runners.append(self))[0])
    x, y = _data()
    x = x.to(dtype)
    finals = {}
    ours = dict(inductor.COMPILE_OPTIONS)
    reuse = {k: v for k, v in ours.items() if k != "allow_buffer_reuse"}  # Inductor's default: reuse on
    for mode, options in (("eager", ours), ("reuse", reuse), ("fixed", ours)):
        monkeypatch.setattr(inductor, "COMPILE_OPTIONS", options)
        models = [m.to(dtype) for m in _models()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_ensemble(models, (x, y), lr=0.01, batch_size=32, steps=2, seeds=0,
                           step_mode="eager" if mode == "eager" else "compile")
        finals[mode] = models
        disagreed = [w for w in caught if "disagreed" in str(w.message)]
        if mode == "reuse":
            assert disagreed and "params[15], row 0" in str(disagreed[0].message)
            assert runners[-1].checks[0]["worst"] > 100 and runners[-1].route == "eager"
        elif mode == "fixed":
            assert not disagreed and runners[-1].route == "compile"
            assert max(c["worst"] for c in runners[-1].checks) < 0.05
    # after the caught fault the run went on from the eager step's state: the eager run's numbers
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(finals["eager"], finals["reuse"]):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=tol, atol=tol)
