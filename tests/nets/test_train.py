"""Tests of bnlab.nets.train with the BN-MLP of Yang et al. 2019 (moved from tests/sim/test_train.py):
determinism, trainability of shallow vs very deep ReLU BN nets, Fig. 4 norms, bad input.
The generic loop (hooks, callbacks, factories, epochs) is tested in test_train_loop.py."""
from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bnlab.nets import BNMLP, layer_norm_trajectory, train_classifier

from ._data import digits

torch.set_num_threads(1)


def _digits():
    return digits(np.float32)


def _sgd(lr):
    return functools.partial(torch.optim.SGD, lr=lr)


def test_same_seed_same_result_and_seed_matters():
    train, test = _digits()

    def run(seed):
        m = BNMLP(64, 10, depth=3, width=32, seed=seed)
        return train_classifier(m, train, test, optimizer=_sgd(0.05), batch_size=32, steps=40, seed=seed)

    a, b, c = run(0), run(0), run(1)
    # same seed, same data order and weights; BLAS sums are not promised bit-identical between
    # calls, so the float32 losses agree to rounding (6e-8) amplified by 40 steps (1e-5), another seed by O(1e-2)
    assert a.test_accuracy == pytest.approx(b.test_accuracy, abs=1e-9)
    assert a.history == pytest.approx(b.history, rel=1e-5)
    assert a.history != pytest.approx(c.history, rel=1e-3)


def test_rmsprop_trains_and_epochs_count():
    train, test = _digits()
    m = BNMLP(64, 10, depth=2, width=32, seed=0)
    rmsprop = functools.partial(torch.optim.RMSprop, lr=1e-3, alpha=0.9, eps=1e-10)
    r = train_classifier(m, train, test, optimizer=rmsprop, batch_size=50, epochs=2, seed=0)
    assert r.steps == 2 * (1400 // 50)
    assert not r.diverged and r.test_accuracy > 0.7


def test_shallow_trains_very_deep_small_batch_does_not():
    # ReLU BN at B=4: λ_G = 3.08 (Thm 3.10) so 16ξ = 16/log λ_G ≈ 14; depth 48 ≈ 3.4×16ξ
    # (squared gradients at layer 1 ~ λ^48 ≈ 1e23 times those at the top) cannot train, while
    # depth 2 learns the 10-class digits far above chance (0.1) in the same budget.
    lam = _relu_lambda(4)
    assert 16 / math.log(lam) == pytest.approx(14.2, abs=0.1)
    train, test = _digits()
    shallow = train_classifier(BNMLP(64, 10, depth=2, width=64, seed=0), train, test,
                               optimizer=_sgd(0.02), batch_size=4, steps=150, seed=0)
    deep = train_classifier(BNMLP(64, 10, depth=48, width=64, seed=0), train, test,
                            optimizer=_sgd(0.02), batch_size=4, steps=150, seed=0)
    print("shallow", shallow.test_accuracy, "deep", deep.test_accuracy, deep.diverged)
    assert shallow.test_accuracy > 0.7
    assert deep.diverged or deep.test_accuracy < 0.3
    if deep.diverged:
        assert deep.test_accuracy == pytest.approx(0.1)


def _relu_lambda(b: int) -> float:
    """λ_G↓ of ReLU BN, Yang et al. 2019 Thm 3.10 (Eq. 19); J_1 is the normalized arccos kernel."""
    c = -1.0 / (b - 1)
    j1 = (math.sqrt(1 - c * c) + (math.pi - math.acos(c)) * c) / math.pi
    j1p = (math.pi - math.acos(c)) / math.pi
    return ((b - 1 + j1p) / (1 - j1) - 1) / (b - 3)


def test_initial_gradient_explosion_rate_matches_thm_3_10():
    # Squared pre-activation gradient norms grow by λ_G per layer towards the input
    # (Thm 3.9/3.10).  Route 1: the closed form; route 2: 8 random nets of width 256
    # at B=32, slope of log‖∂L/∂h^l‖² over layers 6..25 of 30 (away from the input,
    # where Σ has not reached BSB1, and from the readout).  The per-net slope has a
    # spread of ≈ 0.02 (measured over seeds), so the mean of 8 has ≈ 0.007, and the
    # width-256 bias of the mean field limit is O(1/N) relative ≈ 0.4% of 0.42;
    # tolerance 0.03 on log λ_G ≈ 0.420 is > 4σ and fails for λ(B=8)=1.79 (log 0.58)
    # or for no explosion (0).
    slopes = []
    for seed in range(8):
        m = BNMLP(784, 10, depth=30, width=256, seed=seed, eps=0.0, dtype=torch.float64)
        gen = np.random.default_rng(seed)
        x = gen.standard_normal((32, 784)).astype(np.float64)
        y = gen.integers(0, 10, 32)
        tr = layer_norm_trajectory(m, (x, y), optimizer=_sgd(1e-3), batch_size=32, steps=0, seed=seed)
        g2 = np.log(tr["preact_grad_norm"][0] ** 2)
        layers = np.arange(30)
        sel = slice(5, 25)
        slopes.append(-np.polyfit(layers[sel], g2[sel], 1)[0])
    assert np.mean(slopes) == pytest.approx(math.log(_relu_lambda(32)), abs=0.03)


def test_layer_norm_trajectory_shapes_and_equilibration():
    train, _ = _digits()
    m = BNMLP(64, 10, depth=30, width=64, seed=0)
    tr = layer_norm_trajectory(m, train, optimizer=_sgd(0.05), batch_size=32, steps=5, seed=0)
    for key in ("weight_norm", "preact_grad_norm", "weight_grad_norm"):
        assert tr[key].shape == (6, 30) and np.all(np.isfinite(tr[key]))
    # at initialization every layer's weight norm is ≈ sqrt(width·σ_w²) = 8 (fan-in 64)
    np.testing.assert_allclose(tr["weight_norm"][0], 8.0, rtol=0.05)
    # after one step the lower layers' weights grew (first-step gradients explode, §4):
    # at depth 30, B=32 the layer-1 weight gradient is λ_G^{15} ≈ 500× the top one, and
    # η·‖∇W^1‖ ≈ 0.05·580 ≈ 29 ≫ ‖W^1‖ = 8 (measured: 8 → 30); the top layer barely moves.
    assert tr["weight_norm"][1, 0] > 2.5 * tr["weight_norm"][0, 0]
    assert tr["weight_norm"][1, -1] < 1.05 * tr["weight_norm"][0, -1]
    # and the dynamic range of the weight gradients collapsed (measured ≈ 350 → ≈ 6)
    rng0 = tr["weight_grad_norm"][0].max() / tr["weight_grad_norm"][0].min()
    rng5 = tr["weight_grad_norm"][5].max() / tr["weight_grad_norm"][5].min()
    assert rng0 > 100 and rng5 < rng0 / 10


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(optimizer="adam"), "optimizer"),
        (dict(optimizer=None), "optimizer"),
        (dict(batch_size=10), "batch_size"),  # not a multiple of sub_batch_size=4
        (dict(batch_size=100000), "batch_size"),
        (dict(epochs=1, steps=3), "epochs"),
        (dict(steps=0), "steps"),
        (dict(device="cuda:99" if torch.cuda.is_available() else "cuda"), "device"),
        (dict(device="tpu-ish"), "device"),
    ],
)
def test_bad_training_arguments(kwargs, name):
    train, test = _digits()
    m = BNMLP(64, 10, depth=2, width=8, sub_batch_size=4)
    args = dict(optimizer=_sgd(0.1), batch_size=8, steps=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        train_classifier(m, train, test, **args)


def test_bad_data():
    m = BNMLP(64, 10, depth=2, width=8)
    x = np.zeros((20, 64), np.float32)
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="train"):
        train_classifier(m, (x, np.zeros(20, np.int64)), (x, np.zeros(20, np.int64)),
                         optimizer=_sgd(0.1), batch_size=4, steps=1)
    with pytest.raises(ValueError, match="labels"):
        good = np.zeros((20, 64), np.float32)
        train_classifier(m, (good, np.full(20, 10)), (good, np.zeros(20, np.int64)),
                         optimizer=_sgd(0.1), batch_size=4, steps=1)


def test_divergence_is_recorded_as_chance():
    # an absurd learning rate on a deep net makes the loss overflow to inf/NaN
    train, test = _digits()
    r = train_classifier(BNMLP(64, 10, depth=30, width=32, seed=0), train, test,
                         optimizer=_sgd(1e30), batch_size=8, steps=30, seed=0)
    assert r.diverged and r.test_accuracy == pytest.approx(0.1)
    assert r.to_dict()["final_train_loss"] is None or math.isfinite(r.to_dict()["final_train_loss"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_accuracy_roughly():
    train, test = _digits()
    cpu = train_classifier(BNMLP(64, 10, depth=3, width=32, seed=0), train, test,
                           optimizer=_sgd(0.05), batch_size=32, steps=50, seed=0)
    gpu = train_classifier(
        BNMLP(64, 10, depth=3, width=32, seed=0), train, test,
            optimizer=_sgd(0.05), batch_size=32, steps=50, seed=0, device="cuda"
    )
    assert abs(cpu.test_accuracy - gpu.test_accuracy) < 0.05


# ----------------------------------------------------------------------------- the generic loop `train`
def _blobs(n=120, d=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((d, k)), axis=1)
    return x, y


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)  # test fixture only; the library never reads the global generator
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3)).to(dtype)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_hook_runs_between_backward_and_step():
    from bnlab.nets import train

    model = _net()
    before = _params(model)
    seen = []

    def hook(m):
        # gradients exist (backward ran) and the parameters are still those of the previous step
        seen.append(all(p.grad is not None for p in m.parameters()))
        seen.append(all(torch.equal(p, q) for p, q in zip(m.parameters(), before)))
        for p in m.parameters():
            p.grad.zero_()

    r = train(model, _blobs(), optimizer=_sgd(0.5), batch_size=20, steps=5, hooks=[hook])
    assert r.steps == 5 and all(seen) and len(seen) == 10
    # zeroed gradients → SGD without momentum/decay leaves every parameter unchanged (exactly: p − lr·0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # and without the hook the parameters move (the test can fail)
    model2 = _net()
    train(model2, _blobs(), optimizer=_sgd(0.5), batch_size=20, steps=5)
    assert not all(torch.equal(p, q) for p, q in zip(model2.parameters(), before))


def test_callbacks_see_every_step_and_can_stop():
    from bnlab.nets import StepInfo, train

    infos = []
    r = train(_net(), _blobs(), optimizer=_sgd(0.1), batch_size=20, steps=12, callbacks=[infos.append])
    assert [i.step for i in infos] == list(range(12)) and all(isinstance(i, StepInfo) for i in infos)
    assert [i.epoch for i in infos] == [s // 6 for s in range(12)]  # 120 samples / 20 = 6 steps an epoch
    np.testing.assert_allclose([float(i.loss) for i in infos], r.history, rtol=0, atol=0)
    stop = train(_net(), _blobs(), optimizer=_sgd(0.1), batch_size=20, steps=12,
                 callbacks=[lambda info: info.step == 3], test_data=_blobs(seed=1))
    assert stop.steps == 4 and stop.stopped_by_callback and len(stop.history) == 4
    assert stop.test_accuracy is not None and not stop.diverged


def test_divergence_with_a_huge_learning_rate():
    from bnlab.nets import train

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    r = train(model, _blobs(), optimizer=_sgd(1e38), batch_size=20, steps=40, test_data=_blobs(seed=1),
              check_every=7)
    assert r.diverged and r.diverged_at_step is not None and r.steps < 40
    assert not math.isfinite(r.history[r.diverged_at_step])
    assert all(math.isfinite(v) for v in r.history[: r.diverged_at_step])
    assert r.test_accuracy == pytest.approx(1 / 3) and r.chance == pytest.approx(1 / 3)
    assert math.isnan(r.final_train_loss) and r.to_dict()["final_train_loss"] is None


def test_same_seed_same_numbers_factory_equals_instance_and_seed_matters():
    from bnlab.nets import train

    data, test = _blobs(), _blobs(seed=1)
    a = train(_net(), data, optimizer=_sgd(0.1), batch_size=20, steps=15, seed=3, test_data=test)
    m = _net()
    b = train(m, data, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), batch_size=20, steps=15, seed=3,
              test_data=test)
    c = train(_net(), data, optimizer=_sgd(0.1), batch_size=20, steps=15, seed=4, test_data=test)
    # same process, same inputs: rounding-level agreement is all that is promised (1e-6 relative on float32)
    np.testing.assert_allclose(a.history, b.history, rtol=1e-6)
    assert a.test_accuracy == b.test_accuracy
    assert not np.allclose(a.history, c.history, rtol=1e-6)  # the data order depends on the seed


def test_epochs_fractional_and_per_epoch_evaluation():
    from bnlab.nets import train

    r = train(_net(), _blobs(), optimizer=_sgd(0.1), batch_size=20, epochs=2.5, test_data=_blobs(seed=1),
              eval_every_epoch=True)
    assert r.steps == 15  # round(2.5 · 6)
    assert [e["epoch"] for e in r.epochs] == [1, 2]
    for e, lo in zip(r.epochs, (0, 6)):
        assert e["train_loss"] == pytest.approx(np.mean(r.history[lo : lo + 6]), rel=1e-6)
        assert 0.0 <= e["test_accuracy"] <= 1.0
    assert "epochs" in r.to_dict()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -1.5, 2.0, 3e38, -3e38, math.inf, -math.inf, math.nan]), min_size=1,
                max_size=40),
       st.sampled_from([torch.float16, torch.float32, torch.float64]))
def test_all_finite_agrees_with_the_elementwise_check(values, dtype):
    # Independent route: Python's math.isfinite on every value after the cast (±3e38 overflow to ±inf
    # in float16 but not in float32).  The ±3e38 pairs make finite float32 sums overflow, the case
    # where the fast sum cannot decide and the elementwise check must.
    train_module = importlib.import_module("bnlab.nets.train")  # the module (bnlab.nets.train is the function)

    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert train_module._all_finite(t) == all(math.isfinite(v) for v in t.double().tolist())


def test_finite_data_whose_sum_overflows_is_accepted_and_a_late_nan_is_not():
    from bnlab.nets import train

    x, y = _blobs()
    big = x.copy()
    big[:, 0] = 3e38  # every entry finite; their float32 sum is inf
    r = train(_net(), (big, y), optimizer=_sgd(1e-45), batch_size=20, steps=1)
    assert r.steps == 1
    bad = x.copy()
    bad[-1, -1] = np.nan
    with pytest.raises(ValueError, match="train_data.*NaN"):
        train(_net(), (bad, y), optimizer=_sgd(0.1), batch_size=20, steps=1)


@pytest.mark.parametrize("epochs,passes", [(2.0, 2), (2.5, 3)])
@pytest.mark.parametrize("bn_mode", ["eval", "train"])
def test_run_ending_at_an_epoch_end_evaluates_once_there(monkeypatch, epochs, passes, bn_mode):
    # The final result reuses the last epoch's test pass when training stops exactly there (the model
    # is unchanged in between); a run ending mid-epoch still takes its own final pass.  The reused
    # numbers are checked against an independent evaluation of the trained model by hand.
    from bnlab.nets import train

    train_module = importlib.import_module("bnlab.nets.train")  # the module (bnlab.nets.train is the function)
    calls = []
    original = train_module._evaluate
    monkeypatch.setattr(train_module, "_evaluate", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _net()
    xt, yt = _blobs(seed=1)
    r = train(model, _blobs(), optimizer=_sgd(0.1), batch_size=20, epochs=epochs, test_data=(xt, yt),
              eval_every_epoch=True, test_bn_mode=bn_mode)
    assert len(calls) == passes
    assert not r.diverged and r.steps == round(epochs * 6)
    x, y = torch.from_numpy(xt), torch.from_numpy(yt)
    with torch.no_grad():
        if bn_mode == "eval":
            logits = model.eval()(x)
        else:  # one test batch of 120 ≤ eval_batch_size, normalized by its own statistics
            logits = model.train()(x)
    acc = (logits.argmax(1) == y).double().mean().item()
    assert r.test_accuracy == pytest.approx(acc, abs=1e-12)  # same float32 logits, 120 exact comparisons
    if epochs == 2.0:
        assert r.epochs[-1]["test_accuracy"] == r.test_accuracy
    # float32 cross-entropy of 120 samples summed in float64 against torch's float32 mean: ~1e-7 relative
    assert r.test_loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5)


def test_sample_shape_is_kept_for_conv_models_and_float_targets_work():
    from bnlab.nets import train

    x = torch.randn(16, 2, 5, 5)
    conv = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                               torch.nn.Linear(27, 1))
    seen = []
    conv.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1:]))
    r = train(conv, (x, torch.randn(16, 1)), optimizer=_sgd(0.01), batch_size=4, steps=3,
              loss_fn=torch.nn.functional.mse_loss, test_data=(x[:4], torch.randn(4, 1)))
    assert set(seen) == {torch.Size([2, 5, 5])} and r.chance is None and r.test_accuracy is None


def test_batch_of_one_with_batchnorm_is_rejected_by_the_layer():
    from bnlab.nets import train

    with pytest.raises(ValueError, match="more than 1 value"):
        train(_net(), _blobs(), optimizer=_sgd(0.1), batch_size=1, steps=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=2, epochs=1.0), "epochs"),
        (dict(steps=None), "epochs"),
        (dict(steps=0), "steps"),
        (dict(epochs=-1.0, steps=None), "epochs"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=121), "batch_size"),
        (dict(optimizer="sgd"), "optimizer"),
        (dict(optimizer=lambda params: None), "optimizer"),
        (dict(loss_fn="ce"), "loss_fn"),
        (dict(hooks=[1]), "hooks"),
        (dict(callbacks=3), "callbacks"),
        (dict(eval_every_epoch=True), "test_data"),
        (dict(seed=-1), "seed"),
        (dict(device="tpu"), "device"),
        (dict(train_data=np.zeros(3)), "train_data"),
        (dict(train_data=(np.full((120, 6), np.inf, np.float32), np.zeros(120, np.int64))), "train_data"),
        (dict(train_data=(np.zeros((120, 6), np.float32), np.full(120, 3))), "labels"),
    ],
)
def test_train_bad_arguments(kwargs, match):
    from bnlab.nets import train

    args = dict(train_data=_blobs(), optimizer=_sgd(0.1), batch_size=20, steps=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        train(_net(), args.pop("train_data"), **args)


def test_optimizer_on_foreign_parameters_is_rejected():
    from bnlab.nets import train

    other = _net(1)
    with pytest.raises(ValueError, match="optimizer"):
        train(_net(), _blobs(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1), batch_size=20, steps=1)
