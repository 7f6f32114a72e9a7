"""The device-aware route choice of ``weight_sampling="auto"`` and the accelerator's up-front draws.

Both are logic that runs on a GPU; the tests run them on the CPU with the device passed explicitly
(the chooser) or the route forced (``_predraw_weights=True``), so none needs CUDA."""
import math

import numpy as np
import pytest
import torch

from bnlab.sim import simulate
from bnlab.sim.networks import _choose_weight_sampling, _network_bytes

from sim.test_networks import _naive


@pytest.mark.parametrize("rows,width,cpu", [(4, 32, "conditional"), (8, 32, "conditional"), (9, 32, "explicit"),
                                            (250, 1000, "conditional"), (251, 1000, "explicit")])
def test_auto_route_by_device_and_shape(rows, width, cpu):
    # CPU: conditional sampling where k·B ≤ N/4 (as before); a GPU: explicit weights at every shape
    # (one large matmul; the conditional layer's small factorizations are launch-bound there)
    assert _choose_weight_sampling("auto", "gaussian", rows, width, "cpu") == cpu
    for device_type in ("cuda", "mps"):
        assert _choose_weight_sampling("auto", "gaussian", rows, width, device_type) == "explicit"


def test_auto_route_exact_only_where_conditional_is_exact_and_requests_kept():
    for device_type in ("cpu", "cuda"):
        for init in ("orthogonal", "uniform", "asymmetric_uniform"):
            assert _choose_weight_sampling("auto", init, 4, 1000, device_type) == "explicit"
        assert _choose_weight_sampling("auto", "gaussian", 4, 1000, device_type, traced=True) == "explicit"
        for route in ("explicit", "conditional"):
            assert _choose_weight_sampling(route, "gaussian", 512, 1000, device_type,
                                           fits={"explicit": False, "conditional": False}) == route


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_auto_route_takes_the_other_one_where_the_preferred_one_does_not_fit(device_type):
    preferred = _choose_weight_sampling("auto", "gaussian", 512, 1000, device_type)  # explicit on both
    assert preferred == "explicit"
    fits = {"explicit": False, "conditional": True}
    assert _choose_weight_sampling("auto", "gaussian", 512, 1000, device_type, fits=fits) == "conditional"
    # neither fits: the preferred one, whose memory check then names the sizes
    none = {"explicit": False, "conditional": False}
    assert _choose_weight_sampling("auto", "gaussian", 512, 1000, device_type, fits=none) == "explicit"
    # conditional sampling is never taken where it is not exact
    assert _choose_weight_sampling("auto", "orthogonal", 512, 1000, device_type, fits=fits) == "explicit"


def test_auto_route_on_the_cpu_takes_explicit_weights_where_conditional_sampling_does_not_fit():
    # the preferred CPU route at k·B ≤ N/4 is conditional; bounded out, the explicit weights are taken
    assert _choose_weight_sampling("auto", "gaussian", 4, 1000, "cpu") == "conditional"
    assert _choose_weight_sampling("auto", "gaussian", 4, 1000, "cpu",
                                   fits={"explicit": True, "conditional": False}) == "explicit"
    # where both fit, the device decides
    both = {"explicit": True, "conditional": True}
    assert _choose_weight_sampling("auto", "gaussian", 4, 1000, "cpu", fits=both) == "conditional"
    assert _choose_weight_sampling("auto", "gaussian", 4, 1000, "cuda", fits=both) == "explicit"


def test_simulate_gives_the_chooser_its_device_and_each_routes_fit_at_the_bound(monkeypatch):
    # What simulate() asks the chooser: its tensors' device type, and per route whether one network's
    # working memory (_network_bytes, with the accelerator's up-front draws where they apply) is within
    # max_memory_bytes.  The up-front draws (an accelerator's route, forced here on the CPU) are
    # counted in the explicit route's size.
    import bnlab.sim.networks as networks

    seen = []

    def spy(requested, init, rows, width, device_type, **kw):
        seen.append((device_type, kw["fits"]))
        return _choose_weight_sampling(requested, init, rows, width, device_type, **kw)

    monkeypatch.setattr(networks, "_choose_weight_sampling", spy)
    kw = dict(b=10, k=1, width=32, depth=12, d0=32, grads=True, itemsize=8)
    explicit, conditional = _network_bytes(False, True, **kw), _network_bytes(True, False, **kw)
    assert conditional < explicit
    res = simulate("relu", 10, 32, 12, 2, max_memory_bytes=conditional, _predraw_weights=True)
    assert seen == [("cpu", {"explicit": False, "conditional": True})]
    assert res.config["weight_sampling"] == "conditional"
    seen.clear()
    res = simulate("relu", 10, 32, 12, 2, max_memory_bytes=explicit, _predraw_weights=True)
    assert seen == [("cpu", {"explicit": True, "conditional": True})]
    assert res.config["weight_sampling"] == "explicit"  # k·B = 10 > N/4 = 8: explicit by shape


def test_simulate_auto_falls_back_to_conditional_sampling_when_explicit_weights_do_not_fit():
    # rows 10 > 32/4: explicit by shape; its weights (depth·N² per network) exceed the bound, the
    # conditional route's factors (depth·2N·rows) do not
    kw = dict(b=10, k=1, width=32, depth=12, d0=32, grads=True, itemsize=8)
    explicit, conditional = _network_bytes(False, False, **kw), _network_bytes(True, False, **kw)
    assert conditional < explicit
    bound = (explicit + conditional) // 2
    assert simulate("relu", 10, 32, 12, 2).config["weight_sampling"] == "explicit"
    res = simulate("relu", 10, 32, 12, 2, max_memory_bytes=bound)
    assert res.config["weight_sampling"] == "conditional" and np.all(np.isfinite(res.grad_norm_sq))
    with pytest.raises(ValueError, match="working memory"):
        simulate("relu", 10, 32, 12, 2, max_memory_bytes=bound, weight_sampling="explicit")


@pytest.mark.parametrize(
    "phi,eps,k,normalization,residual",
    [("relu", 0.0, 2, "bn", None), ("tanh", 1e-3, 3, "bn", None), ("identity", 0.0, 2, "bn", 0.5),
     ("relu", 0.0, 1, "none", None)],
)
def test_predrawn_weights_compute_the_same_networks_as_the_naive_loop(phi, eps, k, normalization, residual):
    # The accelerator's route (all of a network's numbers drawn at once) run on the CPU: the recorded
    # weights, inputs and readout pushed through one network at a time with torch.nn.BatchNorm1d give
    # the same statistics (float64, different order of operations: rtol 1e-9, as for the default route).
    b, width, depth, n = 5, 12, 4, 3
    trace = []
    res = simulate(phi, b, width, depth, n, eps=eps, num_batches=k, norm=normalization,
                   residual_scale=residual, seed=3, dtype="float64", _trace=trace, _predraw_weights=True)
    ref = _naive(trace, phi, k, b, eps, normalization, residual)
    np.testing.assert_allclose(res.q, ref["q"], rtol=1e-9)
    np.testing.assert_allclose(res.c, ref["c"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.grad_norm_sq, ref["g"], rtol=1e-9)
    np.testing.assert_allclose(res.weight_grad_norm_sq, ref["wg"], rtol=1e-9)
    if k > 1:
        np.testing.assert_allclose(res.cross_batch_corr, ref["rho"], rtol=1e-9, atol=1e-12)


def test_predrawn_weights_have_the_gaussian_law_and_their_own_streams():
    # N(0, σ_w²/d): over n·d·N = 4·64·64 entries per layer the sample variance has relative standard
    # error sqrt(2/16384) ≈ 0.011 (5 SE: 0.055) and the mean standard error sqrt(σ²/16384)
    trace = []
    sigma_w2 = 2.0
    simulate("relu", 4, 64, 3, 4, sigma_w2=sigma_w2, input_dim=32, seed=1, _trace=trace, _predraw_weights=True)
    for layer, w in enumerate(trace[0]["weights"]):
        d = 32 if layer == 0 else 64
        var = sigma_w2 / d
        assert abs(w.mean().item()) < 5 * math.sqrt(var / w.numel())
        assert w.var().item() == pytest.approx(var, rel=0.055)


def test_predrawn_weights_equal_the_per_layer_draws_where_the_cpu_stream_coincides():
    # Without biases the up-front route takes the numbers in the per-layer route's order (inputs,
    # W^1..W^L, readout), and torch's CPU normal_ fills a tensor of ≥ 16 numbers in blocks of 16 from
    # one Mersenne-Twister sequence: one fill of the concatenation equals consecutive fills of parts
    # whose sizes are multiples of 16.  Then both routes simulate the same networks (float64, same
    # operations: rtol 1e-12); with biases (drawn after all the weights here, between them there) or
    # sizes that are not multiples of 16 they differ, in the numbers, not in the law.
    kw = dict(input_dim=32, seed=1, weight_sampling="explicit", num_batches=2)
    a = simulate("relu", 4, 64, 3, 4, **kw)
    b = simulate("relu", 4, 64, 3, 4, _predraw_weights=True, **kw)
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        np.testing.assert_allclose(getattr(b, field), getattr(a, field), rtol=1e-12)
    c = simulate("relu", 4, 64, 3, 4, sigma_b2=0.1, _predraw_weights=True, **kw)
    assert not np.allclose(c.q, simulate("relu", 4, 64, 3, 4, sigma_b2=0.1, **kw).q)


def test_predrawn_weights_are_chunking_invariant_and_the_same_in_float32():
    kw = dict(num_batches=2, seed=11, sigma_b2=0.1, _predraw_weights=True)
    a = simulate("relu", 6, 16, 5, 7, dtype="float64", **kw)
    c = simulate("relu", 6, 16, 5, 7, dtype="float64", max_memory_bytes=120_000, **kw)  # one network per chunk
    f = simulate("relu", 6, 16, 5, 7, dtype="float32", **kw)
    assert c.chunks == 7 and a.config["weight_sampling"] == "explicit"
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        np.testing.assert_allclose(getattr(a, field), getattr(c, field), rtol=1e-12)
    # weights drawn in float32 for both dtypes (test_networks.py's float32 tolerance)
    for field in ("q", "grad_norm_sq", "weight_grad_norm_sq"):
        np.testing.assert_allclose(getattr(f, field), getattr(a, field), rtol=1e-4)


def _ops_per_layer(networks, **kw):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the chunks run in this thread, where the mode sees them
    try:
        simulate("relu", 8, 32, 2, networks, num_batches=2, weight_sampling="explicit", **kw)  # caches made once
        for depth in (3, 6):
            Count.n = 0
            with Count():
                simulate("relu", 8, 32, depth, networks, num_batches=2, weight_sampling="explicit", **kw)
            counts.append(Count.n)
    finally:
        torch.set_num_threads(threads)
    return (counts[1] - counts[0]) / 3


def test_operators_per_layer_do_not_grow_with_the_networks_when_predrawn():
    # The launch count of a GPU layer: with one draw per network it does not depend on the number of
    # networks; the per-layer route draws once per network and layer (+2 operators per network here)
    assert _ops_per_layer(2, _predraw_weights=True) == _ops_per_layer(16, _predraw_weights=True)
    assert _ops_per_layer(16) >= _ops_per_layer(2) + 14 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_picks_explicit_weights_and_its_draws_are_chunking_invariant():
    kw = dict(num_batches=2, seed=2, device="cuda", dtype="float64")
    a = simulate("relu", 8, 256, 6, 6, **kw)
    c = simulate("relu", 8, 256, 6, 6, max_memory_bytes=_one_network_bound(8, 2, 256, 6), **kw)
    assert a.config["weight_sampling"] == "explicit" and c.chunks == 6
    for field in ("q", "c", "grad_norm_sq", "weight_grad_norm_sq", "cross_batch_corr"):
        np.testing.assert_allclose(getattr(a, field), getattr(c, field), rtol=1e-10)


def _one_network_bound(b, k, width, depth):
    return int(1.5 * _network_bytes(False, True, b=b, k=k, width=width, depth=depth, d0=width, grads=True,
                                    itemsize=8))
