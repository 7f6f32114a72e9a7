"""The BNPreconditioner's contract: validation, skipping, normalization layers, state_dict, devices,
mixed precision and torch.distributed."""
from __future__ import annotations

import io
import os

import warnings

import pytest
import torch
from torch import nn

from bnlab.optim import BNPreconditioner, LayerHandler, layer_handlers, register_layer_handler


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def _train_step(model, pre, x, y, opt=None):
    if opt is not None:
        opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    if opt is not None:
        opt.step()


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,match", [
    ({"rho": 1.0}, r"rho=1\.0.*\[0, 1\)"),
    ({"rho": -0.1}, r"rho=-0\.1"),
    ({"rho": float("nan")}, "rho"),
    ({"eps1": -1e-3}, r"eps1=-0\.001.*>= 0"),
    ({"eps2": -1.0}, r"eps2=-1\.0"),
    ({"conv_statistics": "pixel"}, "conv_statistics='pixel'"),
    ({"skip": [3]}, "skip entry 3"),
    ({"skip": ["nope"]}, "skip entry 'nope' matches no module"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BNPreconditioner(_mlp(), **kwargs)


def test_model_without_supported_layer():
    with pytest.raises(ValueError, match="no layer BNP can precondition.*Conv1d, Conv2d, Linear"):
        BNPreconditioner(nn.Sequential(nn.ReLU(), nn.LayerNorm(3)))
    with pytest.raises(ValueError, match=r"3 skipped"):
        BNPreconditioner(_mlp(), skip=[nn.Linear])
    with pytest.raises(ValueError, match="torch.nn.Module"):
        BNPreconditioner("model")


def test_step_before_forward_and_bad_input_shape():
    model = _mlp()
    pre = BNPreconditioner(model)
    with pytest.raises(RuntimeError, match="before any forward pass"):
        pre.step()
    with pytest.raises(ValueError, match=r"'0' \(Linear\).*\(2, 3, 6\).*2-D"):
        model(torch.randn(2, 3, 6))


def test_layer_with_gradient_but_no_recorded_input():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 2)

        def forward(self, x):  # uses a's weight without calling a's forward: the hook never fires
            return self.b(nn.functional.linear(x, self.a.weight, self.a.bias))

    model = Tied()
    pre = BNPreconditioner(model)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="'a' has a gradient but its forward hook recorded no input"):
        pre.step()
    BNPreconditioner(model, skip=["a"])  # the remedy the message names


def test_skip_by_name_pattern_and_type():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.Conv1d(1, 1, 1))
    assert set(BNPreconditioner(model, skip=["1.*"]).layers) == {"0", "2"}
    assert set(BNPreconditioner(model, skip=[nn.Conv1d, "0"]).layers) == {"1.0", "1.1"}
    pre = BNPreconditioner(model, skip=["1.1"])
    x = torch.randn(3, 4)
    model[1][1].weight.grad = None
    model[1](model[0](x)).sum().backward()
    g = model[1][1].weight.grad.clone()
    assert "2" in pre.layers
    with pytest.raises(ValueError, match="name='9'"):
        pre.statistics("9")
    # step errors only for layers with gradients and no statistics; the Conv1d has neither
    pre.step()
    torch.testing.assert_close(model[1][1].weight.grad, g)  # skipped layer untouched


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.LayerNorm, lambda n: nn.GroupNorm(2, n)])
def test_models_with_normalization_layers(norm):
    """BNP + BN/LN/GN (Lange et al. §5): only the dense layers are preconditioned; training works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), norm(8), nn.ReLU(), nn.Linear(8, 3))
    pre = BNPreconditioner(model)
    assert set(pre.layers) == {"0", "3"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    norm_grads = []
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norm_grads.append(model[1].weight.grad.clone())
        pre.step()
        torch.testing.assert_close(model[1].weight.grad, norm_grads[-1])  # normalization params untouched
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_conv_model_with_groupnorm_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    pre = BNPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 1, 6, 6), torch.randint(0, 3, (16,))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_registry_rejects_bad_entries_and_accepts_subclasses():
    with pytest.raises(ValueError, match="module_type"):
        register_layer_handler(int, LayerHandler)
    with pytest.raises(ValueError, match="handler"):
        register_layer_handler(nn.Linear, object)

    class MyLinear(nn.Linear):
        pass

    assert nn.Linear in layer_handlers()
    assert set(BNPreconditioner(nn.Sequential(MyLinear(3, 2))).layers) == {"0"}


# ---------------------------------------------------------------------------------------------- state


def test_state_dict_round_trip_continues_identically():
    x = torch.randn(10, 6)
    y = torch.randint(0, 3, (10,))
    a = _mlp()
    pa = BNPreconditioner(a, rho=0.9)
    for _ in range(3):
        a.zero_grad()
        _train_step(a, pa, x + torch.randn(10, 6), y)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "pre": pa.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, map_location="cpu")
    b = _mlp()
    b.load_state_dict(ckpt["model"])
    pb = BNPreconditioner(b, rho=0.5)  # hyperparameters come back from the state, as in torch.optim
    pb.load_state_dict(ckpt["pre"])
    assert pb.rho == 0.9 and pb.steps == 3
    for m in (a, b):
        m.zero_grad()
    _train_step(a, pa, x, y)
    _train_step(b, pb, x, y)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)
    for name in pa.layers:
        assert torch.equal(pa.statistics(name)[0], pb.statistics(name)[0])


def test_state_dict_is_a_copy_and_load_validates():
    model = _mlp()
    pre = BNPreconditioner(model)
    _train_step(model, pre, torch.randn(4, 6), torch.randint(0, 3, (4,)))
    sd = pre.state_dict()
    sd["layers"]["0"]["mean"].add_(100.0)
    assert float(pre.statistics("0")[0].abs().max()) < 50
    with pytest.raises(ValueError, match="missing"):
        BNPreconditioner(_mlp(), skip=["0"]).load_state_dict(pre.state_dict())
    bad = pre.state_dict()
    bad["layers"]["0"]["mean"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"'0' has statistics of shape \(7,\)"):
        pre.load_state_dict(bad)
    bad = pre.state_dict()
    bad["hyperparameters"]["rho"] = 2.0
    with pytest.raises(ValueError, match="rho=2.0"):
        pre.load_state_dict(bad)
    with pytest.raises(ValueError, match="state_dict"):
        pre.load_state_dict({"layers": {}})


def test_load_state_dict_moves_to_the_layers_dtype_and_device():
    model = _mlp()
    pre = BNPreconditioner(model)
    _train_step(model, pre, torch.randn(4, 6), torch.randint(0, 3, (4,)))
    sd = pre.state_dict()
    target = _mlp().double()
    pt = BNPreconditioner(target)
    pt.load_state_dict(sd)
    assert pt.statistics("0")[0].dtype == torch.float64
    torch.testing.assert_close(pt.statistics("0")[0], sd["layers"]["0"]["mean"].double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_and_autocast():
    model = _mlp().cuda()
    pre = BNPreconditioner(model)
    x, y = torch.randn(8, 6, device="cuda"), torch.randint(0, 3, (8,), device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    pre.step()
    assert pre.statistics("0")[0].device.type == "cuda" and pre.statistics("0")[0].dtype == torch.float32
    cpu = BNPreconditioner(_mlp())
    cpu.load_state_dict(pre.state_dict())
    assert cpu.statistics("0")[0].device.type == "cpu"
    back = BNPreconditioner(_mlp().cuda())
    back.load_state_dict(cpu.state_dict())
    assert back.statistics("0")[0].device.type == "cuda"


def test_mixed_precision_keeps_float32_statistics():
    """bfloat16 autocast (CPU) and a bfloat16 model: statistics stay float32, gradients are finite
    and equal the float32 computation to bfloat16 accuracy (8 bits: relative 2^-8 per rounding,
    a few roundings per entry -> 5e-2 tolerance)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 6) * 3 + 1, torch.randint(0, 3, (16,))
    ref = _mlp()
    pr = BNPreconditioner(ref)
    _train_step(ref, pr, x, y)

    amp = _mlp()
    pa = BNPreconditioner(amp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(amp(x), y)
    loss.backward()
    pa.step()
    assert pa.statistics("0")[0].dtype == torch.float32
    torch.testing.assert_close(pa.statistics("0")[1], pr.statistics("0")[1], rtol=0, atol=0)  # input 0 is fp32

    half = _mlp().to(torch.bfloat16)
    ph = BNPreconditioner(half)
    _train_step(half, ph, x.to(torch.bfloat16), y)
    assert ph.statistics("2")[0].dtype == torch.float32
    assert half[0].weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(half[0].weight.grad.float(), ref[0].weight.grad, rtol=5e-2, atol=5e-2)


def test_zero_variance_with_zero_eps_is_an_error_not_a_nan():
    model = nn.Linear(3, 2).double()
    pre = BNPreconditioner(model, rho=0.0, eps1=0.0, eps2=0.0)
    x = torch.ones(4, 3, dtype=torch.float64)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"zero variance.*eps1=0, eps2=0"):
        pre.step()


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("scale,dtype", [(0.0, torch.float32), (1e-22, torch.float32), (0.0, torch.float64),
                                         (1e-170, torch.float64)])
def test_zero_or_subnormal_variance_with_eps2_zero_is_an_error_whatever_eps1(native, scale, dtype):
    """σ̃² = σ² + ε₁·max σ² + ε₂: with ε₂ = 0 a layer whose variances are all 0 (constant inputs) or
    subnormal (float32 inputs of 1e-22: σ² ~ 1e-44) has 1/(q²σ̃²) = inf even at ε₁ = 1000; the step
    raises, naming the layer, before any gradient or running statistic changes (it made every parameter
    NaN: found by fuzzing BNPreconditioner).  The same inputs at the default ε₂ step finitely."""
    if native:
        pytest.importorskip("bnlab.optim._native")
    torch.manual_seed(0)
    x = torch.randn(8, 5, dtype=dtype) * scale
    for eps2, fails in ((0.0, True), (1e-4, False)):
        model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a native build that fails warns and steps eagerly
            pre = BNPreconditioner(model, rho=0.0, eps1=1000.0, eps2=eps2, native=native)
        model(x).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        stats = [(s.mean.clone(), s.var.clone()) for s in pre._layer_list]
        if fails:
            with pytest.raises(RuntimeError, match=r"layer '0'.*zero variance.*eps1=1000, eps2=0"):
                pre.step()
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
            if not native:  # the native kernel updates the running statistics in place first (documented)
                assert all(torch.equal(s.mean, m) and torch.equal(s.var, v)
                           for s, (m, v) in zip(pre._layer_list, stats))
        else:
            pre.step()
            assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------- distributed


def _dist_worker(rank, world, init_file, x, y, out_dir, native=False):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _mlp().double()
        pre = BNPreconditioner(model, rho=0.5, native=native)
        n = x.shape[0] // world
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        for _ in range(2):
            model.zero_grad()
            nn.functional.cross_entropy(model(xs), ys).backward()
            for p in model.parameters():  # what DistributedDataParallel does in backward
                dist.all_reduce(p.grad)
                p.grad /= world
            pre.step()
        torch.save({"grads": [p.grad for p in model.parameters()], "pre": pre.state_dict()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_distributed_statistics_are_all_reduced(tmp_path, native):
    """Two gloo processes on half batches each = one process on the whole batch (float64).

    ``native=True`` (slow: builds the kernels): the one-call route is left for the moments route,
    whose sums are all-reduced."""
    import torch.multiprocessing as mp

    if native:
        from bnlab.optim import _native

        if _native.kernels() is None:
            pytest.skip("the native kernels cannot be built here")

    torch.manual_seed(1)
    x = torch.randn(12, 6, dtype=torch.float64) * 2 + 1
    y = torch.randint(0, 3, (12,))
    # fork (Linux) skips re-importing torch and this module in the children; spawn elsewhere.
    method = "fork" if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized() else "spawn"
    mp.start_processes(_dist_worker, args=(2, str(tmp_path / "init"), x, y, str(tmp_path), native), nprocs=2, join=True,
                       start_method=method)
    model = _mlp().double()
    pre = BNPreconditioner(model, rho=0.5)
    for _ in range(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for g, p in zip(got["grads"], model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
        for name in pre.layers:
            torch.testing.assert_close(got["pre"]["layers"][name]["var"], pre.statistics(name)[1],
                                       rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("conv_statistics", ["channel", "unfold"])
def test_mixed_precision_blocked_statistics_leave_the_input_alone(conv_statistics, monkeypatch):
    """A bfloat16 layer input is converted to a private float32 copy that the hooks overwrite block
    by block; the caller's tensor must stay untouched, and the statistics must not depend on the
    block size (same float32 sums in another order: 16 terms of O(10), relative ~1e-6; 1e-5)."""
    torch.manual_seed(1)
    x = (torch.randn(16, 2, 5, 5) * 3 + 1).to(torch.bfloat16)
    x_before = x.clone()
    stats = []
    for block in (None, 1):
        if block is not None:
            monkeypatch.setattr("bnlab.optim._layers._BLOCK_ELEMENTS", block)
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 3, 3, padding=1).to(torch.bfloat16)
        pre = BNPreconditioner(conv, rho=0.5, conv_statistics=conv_statistics)
        conv(x).float().sum().backward()
        pre.step()
        assert torch.equal(x, x_before)
        stats.append(pre.statistics(""))
    for a, b in zip(*stats):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert a.dtype == torch.float32
