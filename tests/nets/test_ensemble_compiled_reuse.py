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
"""
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
