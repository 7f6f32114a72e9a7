"""The captured route of BNP (``BNPreconditioner(cuda_graph=True)``, the CUDA default) against the eager route.

On CUDA the compiled dense step is captured into a CUDA graph (``bnlab.optim._compiled``): a step
copies the layer inputs and gradients into the graph's fixed buffers, replays, and copies the
gradients back; a graph belongs to its statistics tensors, shapes and constants.

Without a GPU, the capture is replaced by what a graph is to its buffers: ``_capture(call)``
returns ``call`` itself (a replay runs the same operators on the same buffers, reading whatever
they hold now), and ``torch.compile`` by the uncompiled functional core.  So the Python around
the graph — which buffers are copied in before a replay and out after it, which changes make a new
graph, the warm-up step that runs before the capture, the eviction and the fallback — is checked
here on every machine: a missing copy-in replays the previous step's inputs, a missing copy-out
leaves autograd's gradient untouched, a graph kept past a new ``state_dict`` writes statistics
nobody reads.  Each of these changes the gradients by O(1) and fails the comparison.  The tests
named ``cuda`` capture for real on a GPU (``benchmarks/gpu_check.py`` runs them).

Tolerance: the captured route runs the compiled route's functional core, which agrees with the
eager route to rounding only (``test_bnp_routes``: ``100·(N + n_in + 10)·u`` in float64, derived
there); the same bound is used.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from bnlab.optim import BNPreconditioner
from bnlab.optim import _compiled
from bnlab.optim import _functional as F

from .test_bnp_routes import _assert_same, _tol  # the bound derived there, the same comparison


@pytest.fixture
def graphs(monkeypatch):
    """Capture on CPU, a replay being the captured call itself; returns the list of captures."""
    captured = []

    def capture(call):
        captured.append(call)
        return call

    monkeypatch.setattr(_compiled, "_STATE", {"fn": F.dense_steps_})
    monkeypatch.setattr(_compiled, "_GRAPHS", OrderedDict())
    monkeypatch.setattr(_compiled, "capturable", lambda device: True)
    monkeypatch.setattr(_compiled, "_capture", capture)
    return captured


def _mlp(last_bias=True, seed=0, device="cpu", dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 20), nn.ReLU(), nn.Linear(20, 7), nn.Tanh(),
                         nn.Linear(7, 5, bias=last_bias)).to(device=device, dtype=dtype)


def _train(model, pre, batches, set_to_none=True):
    for x in batches:
        model.zero_grad(set_to_none=set_to_none)
        model(x).square().sum().backward()
        pre.step()


def _batches(sizes, seed=1, device="cpu", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 300, generator=g, dtype=torch.float64) * 2.0 + 1.0).to(device=device, dtype=dtype)
            for n in sizes]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("last_bias", [True, False])
def test_captured_route_equals_eager(graphs, set_to_none, last_bias):
    """Steps of batch sizes 16 and a smaller last batch of 5 (and N = 1): one graph per batch size,
    replayed after its first step, equal to the eager route at every step."""
    sizes = [16, 16, 16, 5, 16, 5, 1, 1, 16]
    batches = _batches(sizes)
    a, b = _mlp(last_bias), _mlp(last_bias)
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5, compiled=False)
    for x in batches:  # compared step by step: a stale buffer shows at the step it is read
        _train(a, pa, [x], set_to_none)
        _train(b, pb, [x], set_to_none)
        _assert_same(a, pa, b, pb, _tol(16, 300))
    assert len(graphs) == 3  # N = 16, 5 and 1


def test_uncaptured_when_switched_off(graphs):
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True, cuda_graph=False), BNPreconditioner(b, compiled=False)
    batches = _batches([8, 8, 8])
    _train(a, pa, batches)
    _train(b, pb, batches)
    _assert_same(a, pa, b, pb, _tol(8, 300))
    assert graphs == []


def test_new_statistics_tensors_are_captured_again(graphs):
    """load_state_dict replaces the statistics tensors: the old graph would update the replaced
    ones, so the next step captures again (and matches an eager preconditioner given the same state)."""
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5, compiled=False)
    first, second = _batches([8, 8, 8], seed=2), _batches([8, 8], seed=3)
    _train(a, pa, first)
    _train(b, pb, first)
    state = pa.state_dict()
    for name in state["layers"]:
        state["layers"][name]["mean"] = state["layers"][name]["mean"] + 0.25
    pa.load_state_dict(state)
    pb.load_state_dict(state)
    _train(a, pa, second)
    _train(b, pb, second)
    _assert_same(a, pa, b, pb, _tol(8, 300))
    assert len(graphs) == 2


def test_new_constants_are_captured_again(graphs):
    """ρ, ε₁, ε₂ are baked into a graph: changing them between steps captures again."""
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True, rho=0.5), BNPreconditioner(b, rho=0.5, compiled=False)
    batches = _batches([8, 8, 8, 8], seed=4)
    _train(a, pa, batches[:2])
    _train(b, pb, batches[:2])
    pa.rho = pb.rho = 0.9
    pa.eps1 = pb.eps1 = 0.1
    _train(a, pa, batches[2:])
    _train(b, pb, batches[2:])
    _assert_same(a, pa, b, pb, _tol(8, 300))
    assert len(graphs) == 2


def test_least_recently_used_graph_is_dropped(graphs, monkeypatch):
    monkeypatch.setattr(_compiled, "MAX_GRAPHS", 2)
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True), BNPreconditioner(b, compiled=False)
    batches = _batches([4, 5, 4, 6, 4, 5, 5])  # 5 is dropped when 6 comes, so captured again
    _train(a, pa, batches)
    _train(b, pb, batches)
    _assert_same(a, pa, b, pb, _tol(6, 300))
    assert len(_compiled._GRAPHS) == 2
    assert len(graphs) == 4  # 4, 5, 6, then 5 again


def test_failed_capture_warns_once_and_stays_compiled(graphs, monkeypatch):
    def refused(call):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_compiled, "_capture", refused)
    a, b = _mlp(), _mlp()
    pa, pb = BNPreconditioner(a, compiled=True), BNPreconditioner(b, compiled=False)
    batches = _batches([8, 8, 8], seed=5)
    with pytest.warns(RuntimeWarning, match="not permitted") as record:
        _train(a, pa, batches)
    assert sum("CUDA graph" in str(w.message) for w in record) == 1
    _train(b, pb, batches)
    _assert_same(a, pa, b, pb, _tol(8, 300))
    assert _compiled._GRAPHS == {}


def test_cuda_graph_argument_is_checked():
    with pytest.raises(ValueError, match="cuda_graph='yes'"):
        BNPreconditioner(_mlp(), cuda_graph="yes")
    assert "cuda_graph=False" in repr(BNPreconditioner(_mlp(), cuda_graph=False))


def test_capturable_only_on_cuda():
    assert not _compiled.capturable(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- a real GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_captured_step_equals_eager(dtype):
    """Compiled with inductor and captured into real CUDA graphs, 20 steps (batch sizes 16 and a last
    batch of 5) against the eager route on the same GPU.  float64: the bound above; float32: the
    same bound with u = 2⁻²⁴ (9e-3 for n_in = 300 — a wrong formula changes entries by O(1))."""
    before = len(_compiled._GRAPHS)
    sizes = [16] * 9 + [5] + [16] * 9 + [5]
    batches = _batches(sizes, seed=6, device="cuda", dtype=dtype)
    a, b = _mlp(device="cuda", dtype=dtype), _mlp(device="cuda", dtype=dtype)
    pa, pb = BNPreconditioner(a, rho=0.5), BNPreconditioner(b, rho=0.5, compiled=False)
    for x in batches:
        _train(a, pa, [x])
        _train(b, pb, [x])
    u = 1.0 if dtype == torch.float64 else 2.0 ** 29  # 2⁻²⁴ / 2⁻⁵³
    _assert_same(a, pa, b, pb, u * _tol(16, 300))
    assert len(_compiled._GRAPHS) >= min(before + 2, _compiled.MAX_GRAPHS)  # N = 16 and N = 5 were captured
    # compiled and captured throughout: the checks of the new programs and first replays all agreed
    # (a disagreement falls back to the core, which would pass the comparison above)
    assert "failed" not in _compiled._STATE and not _compiled._STATE.get("no_graph")
    assert all(c["agrees"] for c in _compiled._STATE.get("checks", []))


def test_a_graph_is_captured_and_replayed_on_its_own_device(monkeypatch):
    """Statistics on cuda:1 while cuda:0 is current: the capture's streams and the replay must be those
    of cuda:1 (entered only when it is not current; nothing to enter on a CPU)."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert isinstance(_compiled._on(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(_compiled._on(torch.device("cuda:0")), contextlib.nullcontext)
    other = _compiled._on(torch.device("cuda:1"))
    assert isinstance(other, torch.cuda.device) and other.idx == 1
