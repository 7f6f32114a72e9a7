"""Hostile and careless input to BNP (issue #26): a table of API cases, hypothesis strategies for the
numeric arguments, and the non-finite-batch policy.

The table's cases run as one subprocess (``python -c`` with the driver below), each case guarded,
so a crash inside torch or the native kernel cannot take the test runner down: the driver writes
each case's id to stderr before running it, and a dead driver is reported with the case it was
running.  Each case is a snippet and what a careful program does with it:

* ``("error", "ValueError", fragment)``: raises that exception with ``fragment`` in its message
  (the argument or the layer named, the value and what is allowed);
* ``("ok", None, None)``: runs (its own ``assert``s pass), no warning;
* ``("warns", None, fragment)``: runs (its ``assert``s pass) and warns with ``fragment``.

``load_state_dict`` cases also check that a refused state leaves the preconditioner exactly as it
was (``load_bad``).  The snippets see ``torch``, ``nn``, ``math``, ``BNPreconditioner`` and the
helpers of ``PRELUDE``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from bnlab.optim import BNPreconditioner

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = r'''
import math, warnings
import torch
from torch import nn
from bnlab.optim import BNPreconditioner

def mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(dtype)

def step(model, pre, x, loss="square"):
    model.zero_grad()
    out = model(x)
    (out.square().sum() if loss == "square" else out.sum()).backward()
    pre.step()

def trained(dtype=torch.float64):
    model = mlp(dtype)
    pre = BNPreconditioner(model)
    step(model, pre, torch.randn(8, 6, dtype=dtype, generator=torch.Generator().manual_seed(1)))
    return model, pre

def same_state(a, b):
    assert a["hyperparameters"] == b["hyperparameters"] and a["steps"] == b["steps"]
    for name in a["layers"]:
        for key in ("mean", "var"):
            assert torch.equal(a["layers"][name][key], b["layers"][name][key])
        assert a["layers"][name]["steps"] == b["layers"][name]["steps"]

def load_bad(mutate, dtype=torch.float64):
    """Load a mutated state dict; whatever happens, the preconditioner must be unchanged."""
    model, pre = trained(dtype)
    sd = pre.state_dict()
    mutate(sd)
    before = pre.state_dict()
    try:
        pre.load_state_dict(sd)
    finally:
        same_state(before, pre.state_dict())

def set_layer(key, value, layer="0"):
    def mutate(sd):
        sd["layers"][layer][key] = value
    return mutate
'''

E = "error"
CASES: list[tuple[str, str, tuple]] = [
    # ------------------------------------------------------------------ construction
    ("rho nan", "BNPreconditioner(mlp(), rho=float('nan'))", (E, "ValueError", "rho=nan")),
    ("rho inf", "BNPreconditioner(mlp(), rho=float('inf'))", (E, "ValueError", "rho=inf")),
    ("rho 1", "BNPreconditioner(mlp(), rho=1)", (E, "ValueError", "rho=1.0")),
    ("rho str", "BNPreconditioner(mlp(), rho='0.9')", (E, "ValueError", "rho='0.9'")),
    ("rho bool", "BNPreconditioner(mlp(), rho=True)", (E, "ValueError", "rho=True")),
    ("rho None", "BNPreconditioner(mlp(), rho=None)", (E, "ValueError", "rho=None")),
    ("rho tensor", "BNPreconditioner(mlp(), rho=torch.tensor([0.5, 0.5]))", (E, "ValueError", "rho=")),
    ("eps1 huge", "BNPreconditioner(mlp(), eps1=1e308)", (E, "ValueError", "eps1=1e+308")),
    ("eps1 negative tiny", "BNPreconditioner(mlp(), eps1=-1e-300)", (E, "ValueError", "eps1=")),
    ("eps2 inf", "BNPreconditioner(mlp(), eps2=float('inf'))", (E, "ValueError", "eps2=inf")),
    ("eps2 beyond float32", "BNPreconditioner(mlp(), eps2=1e31)", (E, "ValueError", "eps2=1e+31")),
    ("skip int", "BNPreconditioner(mlp(), skip=5)", (E, "ValueError", "skip=5")),
    ("skip None entry", "BNPreconditioner(mlp(), skip=[None])", (E, "ValueError", "skip entry None")),
    ("skip float entry", "BNPreconditioner(mlp(), skip=['0', 3.5])", (E, "ValueError", "skip entry 3.5")),
    ("gradient None", "BNPreconditioner(mlp(), gradient=None)", (E, "ValueError", "gradient=None")),
    ("gradient case", "BNPreconditioner(mlp(), gradient='FUSED')", (E, "ValueError", "gradient='FUSED'")),
    ("native int", "BNPreconditioner(mlp(), native=1)", (E, "ValueError", "native=1")),
    ("compiled str", "BNPreconditioner(mlp(), compiled='auto')", (E, "ValueError", "compiled='auto'")),
    ("conv_statistics None", "BNPreconditioner(mlp(), conv_statistics=None)", (E, "ValueError", "conv_statistics=None")),
    ("model None", "BNPreconditioner(None)", (E, "ValueError", "model=NoneType")),
    ("model class", "BNPreconditioner(nn.Linear)", (E, "ValueError", "model=type")),
    ("Linear(0, 3)", "BNPreconditioner(nn.Linear(0, 3))", (E, "ValueError", "'<root module>' (Linear): it has no input")),
    ("Conv2d(0, 4)", "import warnings as w\nw.simplefilter('ignore')\nBNPreconditioner(nn.Sequential(nn.Conv2d(0, 4, 3)))",
     (E, "ValueError", "'0' (Conv2d): it has no input")),
    ("complex layer", "BNPreconditioner(nn.Linear(3, 2, dtype=torch.complex64))", (E, "ValueError", "torch.complex64")),
    ("meta layer", "BNPreconditioner(nn.Linear(3, 2, device='meta'))", (E, "ValueError", "meta device")),
    ("Linear(3, 0) trains", "m = nn.Linear(3, 0).double(); p = BNPreconditioner(m)\nstep(m, p, torch.randn(4, 3, dtype=torch.float64))\n"
     "assert m.weight.grad.shape == (0, 3) and torch.isfinite(p.statistics('')[1]).all()", ("ok", None, None)),
    # ------------------------------------------------------------------ forward hooks
    ("integer input", "m = nn.Linear(3, 2); p = BNPreconditioner(m); m(torch.ones(4, 3, dtype=torch.long))",
     (E, "ValueError", "dtype torch.int64")),
    ("complex input", "m = nn.Linear(3, 2); p = BNPreconditioner(m); m(torch.ones(4, 3, dtype=torch.complex64))",
     (E, "ValueError", "dtype torch.complex64")),
    ("empty batch", "m = nn.Linear(3, 2); p = BNPreconditioner(m); m(torch.ones(0, 3))", (E, "ValueError", "empty mini-batch")),
    ("3-D input", "m = nn.Linear(3, 2); p = BNPreconditioner(m); m(torch.ones(2, 4, 3))", (E, "ValueError", "2-D batched")),
    # ------------------------------------------------------------------ step
    ("step before forward", "BNPreconditioner(mlp()).step()", (E, "RuntimeError", "before any forward pass")),
    ("step twice", "m = mlp(); p = BNPreconditioner(m); step(m, p, torch.randn(4, 6, dtype=torch.float64)); p.step()",
     (E, "RuntimeError", "before any forward pass")),
    ("one NaN sample", '''
m = mlp(); p = BNPreconditioner(m, rho=0.5)
step(m, p, torch.randn(8, 6, dtype=torch.float64))
before = p.statistics("0")
x = torch.randn(8, 6, dtype=torch.float64); x[3, 2] = float("nan")
step(m, p, x)
mean, var = p.statistics("0")
assert torch.isfinite(mean).all() and torch.isfinite(var).all()
assert mean[2] == before[0][2] and var[2] == before[1][2] and var[0] != before[1][0]
assert p.nonfinite_batches["0"] == 1
m.zero_grad(); m(torch.randn(8, 6, dtype=torch.float64)).sum().backward(); p.step()
assert all(torch.isfinite(q.grad).all() for q in m.parameters())
''', ("warns", None, "1 of 6 input features had non-finite batch statistics")),
    ("inf sample", '''
m = mlp(); p = BNPreconditioner(m)
x = torch.randn(8, 6, dtype=torch.float64); x[0, :] = float("inf")
step(m, p, x, loss="sum")
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "6 of 6 input features")),
    ("NaN at batch size 1", '''
m = mlp(); p = BNPreconditioner(m)
x = torch.randn(1, 6, dtype=torch.float64); x[0, 1] = float("nan")
step(m, p, x)
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "non-finite batch statistics")),
    ("NaN in a pooled second forward", '''
m = mlp(); p = BNPreconditioner(m)
x = torch.randn(8, 6, dtype=torch.float64); x[5, 4] = float("nan")
m(torch.randn(8, 6, dtype=torch.float64)).sum().backward(); m(x).sum().backward(); p.step()
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "non-finite batch statistics")),
    ("NaN on the fused route", '''
m = mlp(); p = BNPreconditioner(m, gradient="fused")
x = torch.randn(4, 6, dtype=torch.float64); x[1, 0] = float("nan")
step(m, p, x)
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "non-finite batch statistics")),
    ("NaN in a convolution's input", '''
m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(48, 2)).double(); p = BNPreconditioner(m)
x = torch.randn(4, 2, 4, 4, dtype=torch.float64); x[0, 1, 2, 2] = float("nan")
step(m, p, x)
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "1 of 2 input features")),
    ("float32 inputs of 1e30", '''
m = mlp(torch.float32); p = BNPreconditioner(m)
x = torch.full((8, 6), 1e30) * torch.randn(8, 6).sign()
step(m, p, x, loss="sum")
g = m[0].weight.grad
assert torch.isfinite(g).all() and (g != 0).any(), g
assert all(torch.isfinite(t).all() for t in p.statistics("0"))
''', ("warns", None, "overflows torch.float32")),
    ("float32 variance near the top of the range", '''
m = nn.Linear(64, 3); p = BNPreconditioner(m, rho=0.0)
gen = torch.Generator().manual_seed(0)
x = 5e18 * torch.randn(4, 64, generator=gen)
(m(x) * torch.randn(4, 1, generator=gen)).sum().backward()  # δ varies over the batch: G_w - μG_b ≠ 0
p.step()
g = m.weight.grad
var = p.statistics("")[1]
assert torch.isfinite(var).all() and float(var.max()) * 16 > 3.4e38  # q²σ̃² overflows float32
assert torch.isfinite(g).all() and (g != 0).all(), g   # before: 1/(q²σ̃²) = 0, a silent zero
''', ("ok", None, None)),
    # ------------------------------------------------------------------ load_state_dict
    ("state None", "trained()[1].load_state_dict(None)", (E, "ValueError", "state_dict is not allowed")),
    ("missing rho", "load_bad(lambda sd: sd['hyperparameters'].pop('rho'))", (E, "ValueError", "missing key(s) 'rho'")),
    ("hyper a list", "load_bad(lambda sd: sd.__setitem__('hyperparameters', [0.9]))",
     (E, "ValueError", "state_dict['hyperparameters']=list")),
    ("rho 2 in state", "load_bad(lambda sd: sd['hyperparameters'].__setitem__('rho', 2.0))", (E, "ValueError", "rho=2.0")),
    ("mean a list", "load_bad(set_layer('mean', [0.0] * 6))", (E, "ValueError", "'mean' is a list")),
    ("mean a numpy array", "import numpy as np\nload_bad(set_layer('mean', np.zeros(6)))", (E, "ValueError", "'mean' is a ndarray")),
    ("meta tensors", "load_bad(set_layer('var', torch.empty(6, device='meta')))", (E, "ValueError", "meta tensor")),
    ("sparse tensor", "load_bad(set_layer('var', torch.ones(6).to_sparse()))", (E, "ValueError", "torch.sparse_coo")),
    ("complex mean", "load_bad(set_layer('mean', torch.zeros(6, dtype=torch.complex64)))", (E, "ValueError", "real dtype")),
    ("bool var", "load_bad(set_layer('var', torch.ones(6, dtype=torch.bool)))", (E, "ValueError", "real dtype")),
    ("steps 2.5", "load_bad(lambda sd: sd.__setitem__('steps', 2.5))", (E, "ValueError", "state_dict['steps']=2.5")),
    ("steps -1", "load_bad(lambda sd: sd.__setitem__('steps', -1))", (E, "ValueError", "state_dict['steps']=-1")),
    ("steps str", "load_bad(lambda sd: sd.__setitem__('steps', '3'))", (E, "ValueError", "state_dict['steps']='3'")),
    ("steps bool", "load_bad(lambda sd: sd.__setitem__('steps', True))", (E, "ValueError", "state_dict['steps']=True")),
    ("layer steps 1.5", "load_bad(set_layer('steps', 1.5))", (E, "ValueError", "'steps'=1.5")),
    ("negative variance", "load_bad(set_layer('var', torch.tensor([1.0, -1e-3, 1, 1, 1, 1], dtype=torch.float64)))",
     (E, "ValueError", "negative entries")),
    ("NaN mean", "load_bad(set_layer('mean', torch.full((6,), float('nan'), dtype=torch.float64)))",
     (E, "ValueError", "NaN or infinite")),
    ("inf var", "load_bad(set_layer('var', torch.full((6,), float('inf'), dtype=torch.float64)))",
     (E, "ValueError", "NaN or infinite")),
    ("1e300 into float32", "load_bad(set_layer('var', torch.full((6,), 1e300, dtype=torch.float64)), dtype=torch.float32)",
     (E, "ValueError", "NaN or infinite entries (in torch.float32)")),
    ("wrong shape", "load_bad(set_layer('mean', torch.zeros(7)))", (E, "ValueError", "shape (7,), expected (6,)")),
    ("layers a list", "load_bad(lambda sd: sd.__setitem__('layers', []))", (E, "ValueError", "state_dict['layers']=list")),
    ("layer entry None", "load_bad(lambda sd: sd['layers'].__setitem__('0', None))", (E, "ValueError", "layer '0'=NoneType")),
    ("layer entry without var", "load_bad(lambda sd: sd['layers']['0'].pop('var'))", (E, "ValueError", "missing key(s) 'var'")),
    ("unexpected layer", "load_bad(lambda sd: sd['layers'].__setitem__('9', sd['layers']['0']))", (E, "ValueError", "unexpected ['9']")),
    ("non-str layer key", "load_bad(lambda sd: sd['layers'].__setitem__(3, sd['layers']['0']))", (E, "ValueError", "unexpected [3]")),
    ("later layer bad, first unchanged", "load_bad(set_layer('var', -torch.ones(5, dtype=torch.float64), layer='2'))",
     (E, "ValueError", "layer '2' 'var'")),
    ("valid round trip", '''
model, pre = trained(); sd = pre.state_dict(); sd["layers"]["0"]["mean"].requires_grad_(True); sd["steps"] = 7.0
pre.load_state_dict(sd); assert pre.steps == 7
''', ("ok", None, None)),
    ("state_dict with integer tensors", '''
model, pre = trained(); sd = pre.state_dict(); sd["layers"]["0"]["var"] = torch.ones(6, dtype=torch.int64)
pre.load_state_dict(sd); assert pre.statistics("0")[1].dtype == torch.float64
''', ("ok", None, None)),
]

DRIVER = r'''
import json, sys, traceback, warnings
cases = json.loads(sys.stdin.read())
prelude = cases.pop(0)
results = []
for case_id, code in cases:
    sys.stderr.write(f"CASE {case_id}\n"); sys.stderr.flush()
    namespace = {}
    exec(prelude, namespace)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            exec(code, namespace)
            outcome = {"raised": None}
        except BaseException as exc:
            outcome = {"raised": type(exc).__name__, "message": str(exc),
                       "traceback": traceback.format_exc(limit=-3)}
    outcome["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen
                           if not issubclass(w.category, (DeprecationWarning, UserWarning)) or issubclass(w.category, RuntimeWarning)]
    outcome["id"] = case_id
    results.append(outcome)
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def table_results():
    payload = json.dumps([PRELUDE] + [[case_id, code] for case_id, code, _ in CASES])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=payload, capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    if proc.returncode != 0:
        started = [line[5:] for line in proc.stderr.splitlines() if line.startswith("CASE ")]
        pytest.fail(f"the case driver died (exit {proc.returncode}) in case {started[-1] if started else '?'}:\n"
                    f"{proc.stderr[-3000:]}")
    return {r["id"]: r for r in json.loads(proc.stdout)}


@pytest.mark.parametrize("case_id,code,expect", CASES, ids=[c[0] for c in CASES])
def test_hostile_case(table_results, case_id, code, expect):
    got = table_results[case_id]
    kind, exc_name, fragment = expect
    if kind == E:
        assert got["raised"] == exc_name, got
        assert fragment in got["message"], got["message"]
        assert "Traceback" not in got["message"]
    else:
        assert got["raised"] is None, got.get("traceback")
        runtime = [w for w in got["warnings"] if w.startswith("RuntimeWarning")]
        if kind == "ok":
            assert not runtime, runtime
        else:
            assert any(fragment in w for w in runtime), got["warnings"]


def test_the_table_covers_every_class():
    """Construction, hooks, step, non-finite batches, overflow and load_state_dict each have cases."""
    ids = " ".join(c[0] for c in CASES)
    for needle in ("rho", "eps1", "eps2", "Linear(0", "input", "NaN", "1e30", "steps", "negative", "meta", "list"):
        assert needle in ids


# ---------------------------------------------------------------------------------------------- policy


def test_one_nan_batch_does_not_poison_later_steps():
    """A training loop that skips the optimizer step on a non-finite loss (as GradScaler does): the
    NaN batch's statistics are kept out, so every later step is finite.  Before the policy the
    running statistics turned NaN and every later preconditioned gradient was NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    pre = BNPreconditioner(model, rho=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    finite_after = []
    for k in range(6):
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        if k == 2:
            x[7, 3] = float("nan")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 3, (16,), generator=g))
        loss.backward()
        if k == 2:
            with pytest.warns(RuntimeWarning, match="layer '0': 1 of 6"):
                pre.step()
        else:
            pre.step()
        if torch.isfinite(loss):
            opt.step()
        if k > 2:
            finite_after.append(all(torch.isfinite(p.grad).all() for p in model.parameters()))
    assert finite_after == [True, True, True]
    assert pre.nonfinite_batches == {"0": 1, "2": 1}  # the NaN reaches the second layer's input too
    for name in pre.layers:
        assert all(torch.isfinite(t).all() for t in pre.statistics(name))


def test_device_counters_are_collected_periodically(monkeypatch):
    """Routes that do not synchronize with the device count non-finite batches in a device tensor;
    step() reads them every _NONFINITE_CHECK_EVERY steps and nonfinite_batches on demand.  Exercised
    on CPU by counting as the device path does."""
    from bnlab.optim import bnp as bnp_module

    model = nn.Linear(4, 2).double()
    pre = BNPreconditioner(model)
    layer = pre._layers[""]
    pre._flag_device(layer, torch.tensor(3))
    pre._flag_device(layer, torch.tensor(0))
    pre._flag_device(layer, torch.tensor(1))
    with pytest.warns(RuntimeWarning, match="2 step"):
        assert pre.nonfinite_batches == {"": 2}
    assert layer.nonfinite_device is None
    monkeypatch.setattr(bnp_module, "_NONFINITE_CHECK_EVERY", 1)
    pre._flag_device(layer, torch.tensor(5))
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.warns(RuntimeWarning, match="1 step"):
        pre.step()
    assert layer.nonfinite == 3


# ---------------------------------------------------------------------------------------------- hypothesis

_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([1e-300, 5e-324, 1e6, 1e30, 1e31, 0.999999999, -0.0]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rho=_numbers, eps1=_numbers, eps2=_numbers, seed=st.integers(0, 2**16))
def test_hyperparameters_are_refused_or_give_a_finite_descent_step(rho, eps1, eps2, seed):
    """Any (ρ, ε₁, ε₂): a ValueError naming the offending one, or a step whose preconditioned
    gradient is finite and, for a layer with bias, a descent direction (PPᵀ/q² is positive
    definite: ⟨G, G'⟩ > 0 whenever G ≠ 0) — also for float32 statistics at the bounds."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    try:
        pre = BNPreconditioner(model, rho=rho, eps1=eps1, eps2=eps2)
    except ValueError as exc:
        bad = [name for name, v in (("rho", rho), ("eps1", eps1), ("eps2", eps2))
               if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)
               or (name == "rho" and v >= 1) or (name == "eps1" and v > 1e6) or (name == "eps2" and v > 1e30)]
        assert bad and any(f"{name}=" in str(exc) for name in bad), (exc, bad)
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, generator=g) * 4 + 1
    for _ in range(2):
        model.zero_grad()
        model(x).square().sum().backward()
        raw = [p.grad.clone() for p in model.parameters()]
        pre.step()
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()
    for w, b, lin in ((0, 1, model[0]), (2, 3, model[2])):
        g_raw = torch.cat([raw[b][:, None], raw[w]], 1).double()
        g_new = torch.cat([lin.bias.grad[:, None], lin.weight.grad], 1).double()
        if g_raw.abs().max() > 0:
            assert float((g_raw * g_new).sum()) > 0


# Statistics so large that μ²/σ̃² overflows float64 (|μ| ≳ 1e150) give an overflowing Eq. 15 itself
# (G_b' ∝ Σ μ_j² G_b/σ̃_j²): outside what a gradient in float64 can hold, left out of the strategy.
_stat_values = st.one_of(st.floats(min_value=-1e100, max_value=1e100), st.just(float("nan")),
                         st.just(float("inf")), st.just(-float("inf")), st.floats(max_value=-1e-300, min_value=-1e10))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(_stat_values, min_size=4, max_size=4), which=st.sampled_from(["mean", "var"]))
def test_loaded_statistics_are_refused_or_finite_and_nonnegative(values, which):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    pre = BNPreconditioner(model)
    sd = pre.state_dict()
    sd["layers"][""][which] = torch.tensor(values, dtype=torch.float64)
    ok = all(math.isfinite(v) for v in values) and (which == "mean" or all(v >= 0 for v in values))
    if not ok:
        with pytest.raises(ValueError, match=f"'{which}'"):
            pre.load_state_dict(sd)
        assert torch.equal(pre.statistics("")[0], torch.zeros(4, dtype=torch.float64))
        return
    pre.load_state_dict(sd)
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    pre.step()
    assert torch.isfinite(model.weight.grad).all() and torch.isfinite(model.bias.grad).all()


@pytest.mark.parametrize("route", ["eager", "compiled"])
def test_device_routes_keep_a_nan_batch_out_without_reading_back(monkeypatch, route):
    """On a GPU neither route reads values back in step(): non-finite columns are kept out on the
    device (torch.where / inside the compiled call) and counted there.  Exercised on CPU by making
    step() treat it as such a device; the compiled route with the uncompiled core standing in."""
    from bnlab.optim import _compiled
    from bnlab.optim import _functional as F
    from bnlab.optim import bnp as bnp_module

    monkeypatch.setattr(bnp_module, "_reads_back", lambda device: False)
    monkeypatch.setattr(_compiled, "_STATE", {"fn": F.dense_steps_})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    pre = BNPreconditioner(model, rho=0.5, compiled=route == "compiled")
    g = torch.Generator().manual_seed(2)
    for k in range(3):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        if k == 1:
            x[2, 5] = float("nan")
        model.zero_grad()
        model(x).sum().backward()
        pre.step()  # no warning yet: nothing is read back
    for name in pre.layers:
        assert all(torch.isfinite(t).all() for t in pre.statistics(name))
    with pytest.warns(RuntimeWarning, match="1 step"):
        assert pre.nonfinite_batches == {"0": 1, "2": 1}
    assert pre.nonfinite_batches == {"0": 1, "2": 1}  # read once, counted once
