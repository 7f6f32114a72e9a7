"""bnlab.nets.train_ensemble against one-at-a-time bnlab.nets.train / train_classifier, network for network.

Tolerances.  The ensemble runs the same arithmetic as one-at-a-time training in float64; the only
differences are the order of the floating-point sums inside a batched product (a BLAS may block a
``bmm`` differently from an ``mm``) and the SGD/RMSProp update written as ``p − lr·g`` instead of
torch's fused ``add_(g, alpha=−lr)``.  Each such sum of k ≤ 64 products has a relative error
≤ k·u with u = 2⁻⁵³ ≈ 1.1e-16 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), so
≤ 1e-14 per layer; 40 SGD steps through ≤ 5 BN layers amplify a perturbation by the product of the
step maps' Lipschitz constants, which for these learning rates (loss ~ 2, gradients ~ 1) stays below
~10³ (ghost batches of 4 with ε = 1e-3 amplify most: measured 1e-11 absolute) — hence final
weights agree to 1e-9 relative, 1e-10 absolute (a 10⁴-fold margin over 1e-14·10³, and 10⁶-fold
below the ~1e-3 weight change a single step makes, so a missed step or a wrong learning rate
fails).  :func:`bnlab.nets.train` stores its loss history in float32, so losses agree to float32
rounding: 2⁻²⁴ ≈ 6e-8 relative (asserted at 2e-7: three ulps).  Test accuracies count argmax
agreements, exact unless two logits tie within 1e-9 (none do on these data).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from bnlab.nets import BNMLP, MLP, half_squared_error, train, train_classifier, train_ensemble

from ._data import digits

torch.set_num_threads(1)
F64 = torch.float64


def _digits():
    return digits(np.float64)


# depth, γ, β, ε, init seed, learning rate, data seed: every per-network degree of freedom varies
_SPECS = [
    dict(depth=3, gamma=1.0, beta=0.0, eps=1e-3, seed=0, lr=0.05, data_seed=0),
    dict(depth=5, gamma=0.5, beta=0.2, eps=0.1, seed=1, lr=0.02, data_seed=1),
    dict(depth=2, gamma=1.0, beta=0.0, eps=1e-3, seed=2, lr=0.1, data_seed=2),
    dict(depth=5, gamma=1.5, beta=0.0, eps=0.0, seed=3, lr=0.01, data_seed=0),
]


def _bnmlp(spec, phi="tanh"):
    return BNMLP(64, 10, depth=spec["depth"], width=24, gamma=spec["gamma"], beta=spec["beta"], eps=spec["eps"],
                 seed=spec["seed"], phi=phi, dtype=F64)


def _assert_same(ens_result, ens_model, one_result, one_model):
    assert ens_result.diverged == one_result.diverged
    assert ens_result.steps == one_result.steps
    assert ens_result.test_accuracy == pytest.approx(one_result.test_accuracy, abs=1e-12)
    assert np.allclose(ens_result.history, one_result.history, rtol=2e-7, atol=0)
    for (k, a), b in zip(ens_model.state_dict().items(), one_model.state_dict().values()):
        # 1e-9 relative to the entries' scale (weights ~ 0.1, statistics ~ 1): near-zero entries carry
        # the absolute error of their neighbours, so a pure relative bound would be meaningless there
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), k


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])
def test_bnmlp_ensemble_matches_one_at_a_time(optimizer):
    train_set, test_set = _digits()
    models = [_bnmlp(s) for s in _SPECS]
    results = train_ensemble(models, train_set, test_data=test_set, lr=[s["lr"] for s in _SPECS], batch_size=16,
                             steps=40, seeds=[s["data_seed"] for s in _SPECS], optimizer=optimizer,
                             rmsprop_alpha=0.9, rmsprop_eps=1e-10)
    for spec, r, m in zip(_SPECS, results, models):
        one = _bnmlp(spec)
        opt = (functools.partial(torch.optim.SGD, lr=spec["lr"]) if optimizer == "sgd"
               else functools.partial(torch.optim.RMSprop, lr=spec["lr"], alpha=0.9, eps=1e-10))
        r1 = train_classifier(one, train_set, test_set, optimizer=opt, batch_size=16, steps=40, seed=spec["data_seed"])
        _assert_same(r, m, r1, one)
        assert r.test_accuracy > 0.15  # trained (chance 0.1): the comparison is not between two untrained nets


@pytest.mark.parametrize("optimizer, kw", [("sgd", {}), ("rmsprop", {}), ("sgd", dict(momentum=0.9)),
                                           ("rmsprop", dict(momentum=0.9, weight_decay=1e-2))])
def test_one_shared_learning_rate_matches_torch_optim(optimizer, kw, monkeypatch):
    # every network at one learning rate (the trainability grids' cells): the eager CPU step then updates
    # by that scalar, as torch.optim does (``_update``'s shared_lr; RMSProp without momentum by addcdiv_),
    # instead of the per-network broadcast.  Against one-at-a-time torch.optim training, same tolerances as
    # above (module docstring); a wrong sign, scale or a skipped update fails by orders of magnitude
    import bnlab.nets._ensemble_step as step_module

    scalar_updates = []
    update = step_module._update

    def spy(*args, **kwargs):
        scalar_updates.append(kwargs.get("all_active") and args[7].shared_lr is not None)
        return update(*args, **kwargs)

    monkeypatch.setattr(step_module, "_update", spy)
    train_set, test_set = _digits()
    lr = 0.05 if optimizer == "sgd" else 0.002
    specs = _SPECS[:3]
    models = [_bnmlp(s) for s in specs]
    results = train_ensemble(models, train_set, test_data=test_set, lr=lr, batch_size=16, steps=30,
                             seeds=[s["data_seed"] for s in specs], optimizer=optimizer, rmsprop_alpha=0.9,
                             rmsprop_eps=1e-10, **kw)
    assert scalar_updates and all(scalar_updates)  # the scalar route ran, every step
    torch_opt = torch.optim.SGD if optimizer == "sgd" else functools.partial(torch.optim.RMSprop, alpha=0.9, eps=1e-10)
    for spec, r, m in zip(specs, results, models):
        one = _bnmlp(spec)
        r1 = train_classifier(one, train_set, test_set, optimizer=functools.partial(torch_opt, lr=lr, **kw),
                              batch_size=16, steps=30, seed=spec["data_seed"])
        _assert_same(r, m, r1, one)
        assert r.test_accuracy > 0.15


def test_ghost_batches_relu_and_shared_order():
    # sub-batch statistics (Fig. 3b) and one data order shared by every network (seeds=int)
    train_set, test_set = _digits()
    specs = _SPECS[:3]
    mk = lambda s: BNMLP(64, 10, depth=s["depth"], width=24, eps=s["eps"], seed=s["seed"], sub_batch_size=4, dtype=F64)
    models = [mk(s) for s in specs]
    results = train_ensemble(models, train_set, test_data=test_set, lr=0.05, batch_size=16, epochs=0.5, seeds=7)
    for spec, r, m in zip(specs, results, models):
        one = mk(spec)
        r1 = train_classifier(one, train_set, test_set, optimizer=functools.partial(torch.optim.SGD, lr=0.05),
                              batch_size=16, epochs=0.5, seed=7)
        _assert_same(r, m, r1, one)


def test_generic_modules_through_vmap_match():
    # any nn.Module: bnlab's MLP with torch's BatchNorm1d (running statistics updated under vmap)
    train_set, test_set = _digits()
    lrs = [0.05, 0.1, 0.02]
    models = [MLP(64, [24, 24], 10, norm="bn", seed=s, dtype=F64) for s in range(3)]
    results = train_ensemble(models, train_set, test_data=test_set, lr=torch.tensor(lrs, dtype=F64), batch_size=16, steps=30,
                             seeds=[0, 1, 2])
    for s, (r, m) in enumerate(zip(results, models)):
        one = MLP(64, [24, 24], 10, norm="bn", seed=s, dtype=F64)
        r1 = train(one, train_set, optimizer=functools.partial(torch.optim.SGD, lr=lrs[s]), batch_size=16, steps=30,
                   test_data=test_set, seed=s)
        _assert_same(r, m, r1, one)


def test_a_diverging_network_stops_alone():
    # lr = 1e200 sends the (not scale-invariant) readout weights to ~1e200, the logits to inf and the
    # loss to NaN at the second step; the other networks must train exactly as without it.
    train_set, test_set = _digits()
    specs = _SPECS[:2]
    lrs = [1e200, specs[1]["lr"]]
    models = [_bnmlp(s) for s in specs]
    results = train_ensemble(models, train_set, test_data=test_set, lr=lrs, batch_size=16, steps=40,
                             seeds=[s["data_seed"] for s in specs], check_every=10)
    ones = [_bnmlp(s) for s in specs]
    refs = [train_classifier(o, train_set, test_set, optimizer=functools.partial(torch.optim.SGD, lr=lr),
                             batch_size=16, steps=40, seed=s["data_seed"], check_every=10)
            for o, s, lr in zip(ones, specs, lrs)]
    bad, good = results
    assert refs[0].diverged and bad.diverged
    assert bad.diverged_at_step == refs[0].diverged_at_step
    assert bad.steps == refs[0].steps < 40
    assert bad.test_accuracy == refs[0].test_accuracy == pytest.approx(0.1)
    assert np.isnan(bad.final_train_loss)
    assert len(bad.history) == len(refs[0].history)
    _assert_same(good, models[1], refs[1], ones[1])


def _mlp(seed):
    return MLP(64, [24, 24], 10, norm="bn", seed=seed, dtype=F64)


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])
def test_momentum_and_weight_decay_match_torch_optim(optimizer):
    # heavy-ball momentum and weight decay as torch.optim.SGD / RMSprop apply them, through both stacks
    # (vmap for torch's BatchNorm1d MLPs, bmm for BN-MLPs).  Same tolerances as above (module
    # docstring); weight decay 1e-2 changes each weight by lr·wd ≈ 5e-4 relative per step, and
    # momentum 0.9 multiplies the step by up to 10: leaving either out fails by orders of magnitude.
    train_set, test_set = _digits()
    lrs = [0.02, 0.005]
    kw = dict(momentum=0.9, weight_decay=1e-2)
    torch_opt = torch.optim.SGD if optimizer == "sgd" else functools.partial(torch.optim.RMSprop, alpha=0.9, eps=1e-10)
    lr_scale = 1.0 if optimizer == "sgd" else 0.05  # RMSProp's step is ~lr per weight: keep it stable
    stacks = [(lambda i: _bnmlp(_SPECS[i]), train_classifier)]
    if optimizer == "sgd":
        # not RMSProp through torch's BatchNorm1d MLP: the bias before a BN layer has an exactly-zero
        # gradient up to rounding noise (~1e-17), which RMSProp divides by its own root mean square —
        # the update is then the sign of the noise, different in any two summation orders
        stacks.append((lambda i: _mlp(i), train))
    for make, ref_train in stacks:
        models = [make(i) for i in range(2)]
        results = train_ensemble(models, train_set, test_data=test_set, lr=[lr * lr_scale for lr in lrs],
                                 batch_size=16, steps=30, seeds=[0, 1], optimizer=optimizer, rmsprop_alpha=0.9,
                                 rmsprop_eps=1e-10, **kw)
        for i, (r, m) in enumerate(zip(results, models)):
            one = make(i)
            opt = functools.partial(torch_opt, lr=lrs[i] * lr_scale, **kw)
            if ref_train is train:
                r1 = train(one, train_set, optimizer=opt, batch_size=16, steps=30, test_data=test_set, seed=i)
            else:
                r1 = train_classifier(one, train_set, test_set, optimizer=opt, batch_size=16, steps=30, seed=i)
            _assert_same(r, m, r1, one)
            assert r.test_loss == pytest.approx(r1.test_loss, rel=1e-9)
            assert r.test_accuracy > 0.3  # trained


def test_half_squared_error_against_mse_loss():
    # ½‖f − onehot(y)‖² averaged over the batch = torch's summed squared error / (2·batch)
    g = torch.Generator().manual_seed(0)
    out = torch.randn(7, 5, generator=g, dtype=F64)
    y = torch.randint(0, 5, (7,), generator=g)
    ref = torch.nn.functional.mse_loss(out, torch.nn.functional.one_hot(y, 5).to(F64), reduction="sum") / (2 * 7)
    assert float(half_squared_error(out, y)) == pytest.approx(float(ref), rel=1e-14)
    t = torch.randn(7, 5, generator=g, dtype=F64)  # float targets are used as they are
    assert float(half_squared_error(out, t)) == pytest.approx(0.5 * float(((out - t) ** 2).sum()) / 7, rel=1e-14)


@pytest.mark.parametrize("test_bn_mode", ["eval", "train"])
def test_mse_loss_and_test_bn_modes_match_one_at_a_time(test_bn_mode):
    # loss="mse" is train(loss_fn=half_squared_error); the test loss on running or on batch statistics
    # (test batches of 150 → 3 near-equal chunks of the 397 test samples) agrees to float64 rounding
    train_set, test_set = _digits()
    models = [_mlp(s) for s in range(2)]
    results = train_ensemble(models, train_set, test_data=test_set, lr=[0.05, 0.1], batch_size=16, steps=30,
                             seeds=[0, 1], momentum=0.9, loss="mse", test_bn_mode=test_bn_mode, eval_batch_size=150)
    for s, (r, m) in enumerate(zip(results, models)):
        one = _mlp(s)
        r1 = train(one, train_set, optimizer=functools.partial(torch.optim.SGD, lr=[0.05, 0.1][s], momentum=0.9),
                   batch_size=16, steps=30, test_data=test_set, seed=s, loss_fn=half_squared_error,
                   test_bn_mode=test_bn_mode, eval_batch_size=150)
        _assert_same(r, m, r1, one)  # also: the batch-statistics test pass left the running statistics alone
        assert r.test_loss == pytest.approx(r1.test_loss, rel=1e-9)
        assert r.test_accuracy > 0.3  # trained (chance 0.1)
    # the two modes are different numbers (batch vs running statistics), so the option is not ignored
    other = "train" if test_bn_mode == "eval" else "eval"
    m2 = _mlp(0)
    r2 = train_ensemble([m2], train_set, test_data=test_set, lr=0.05, batch_size=16, steps=30, seeds=0, momentum=0.9,
                        loss="mse", test_bn_mode=other, eval_batch_size=150)[0]
    assert abs(r2.test_loss - results[0].test_loss) > 1e-6


def test_bnmlp_stack_batch_statistics_test_pass_matches_train():
    # the BN-MLP (bmm) stack's test pass on batch statistics, with momentum on the squared loss, against
    # train(test_bn_mode="train"); its running statistics must come out as training left them
    train_set, test_set = _digits()
    specs = _SPECS[:2]
    models = [_bnmlp(sp) for sp in specs]
    results = train_ensemble(models, train_set, test_data=test_set, lr=[0.05, 0.02], batch_size=16, steps=30,
                             seeds=[0, 1], momentum=0.9, loss="mse", test_bn_mode="train", eval_batch_size=150)
    for i, (sp, r, m) in enumerate(zip(specs, results, models)):
        one = _bnmlp(sp)
        r1 = train(one, train_set, optimizer=functools.partial(torch.optim.SGD, lr=[0.05, 0.02][i], momentum=0.9),
                   batch_size=16, steps=30, test_data=test_set, seed=i, loss_fn=half_squared_error,
                   test_bn_mode="train", eval_batch_size=150)
        _assert_same(r, m, r1, one)
        assert r.test_loss == pytest.approx(r1.test_loss, rel=1e-9)
    ghost = BNMLP(64, 10, depth=2, width=8, sub_batch_size=4, dtype=F64)
    with pytest.raises(ValueError, match="test_bn_mode"):
        train_ensemble([ghost], train_set, test_data=test_set, lr=0.1, batch_size=16, steps=1, test_bn_mode="train")


def test_diverge_above_stops_a_network_like_train():
    # a loss above diverge_above counts as divergence: with ½‖f − e_y‖² and lr 3 (far above the BN
    # MLP's 2(1+μ)/λmax) the loss passes 50 within a few steps while still finite; the ensemble must
    # flag the same step as train(diverge_above=50) and leave the stable network untouched
    train_set, test_set = _digits()
    lrs = [3.0, 0.05]
    models = [_mlp(s) for s in range(2)]
    results = train_ensemble(models, train_set, test_data=test_set, lr=lrs, batch_size=16, steps=40, seeds=[0, 1],
                             momentum=0.9, loss="mse", diverge_above=50.0)
    ones = [_mlp(s) for s in range(2)]
    refs = [train(o, train_set, optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9), batch_size=16,
                  steps=40, test_data=test_set, seed=s, loss_fn=half_squared_error, diverge_above=50.0)
            for s, (o, lr) in enumerate(zip(ones, lrs))]
    bad, good = results
    assert refs[0].diverged and bad.diverged
    assert bad.diverged_at_step == refs[0].diverged_at_step
    assert np.isfinite(bad.history[bad.diverged_at_step]) and bad.history[bad.diverged_at_step] > 50.0
    assert bad.steps == refs[0].steps < 40 and bad.test_loss is None
    _assert_same(good, models[1], refs[1], ones[1])
    # it stopped before the first check (step 10), so the vmap stack dropped it there and trained the
    # other one alone (the comparison above); its written-back state (parameters and BN buffers) is
    # the one it had when it stopped: a run of exactly diverged_at_step steps (the bad step's update and
    # running-statistics update are masked) ends there too
    assert bad.diverged_at_step < 10
    probe = _mlp(0)
    train_ensemble([probe], train_set, lr=3.0, batch_size=16, steps=bad.diverged_at_step, seeds=0, momentum=0.9,
                   loss="mse")
    for (k, a), b in zip(models[0].state_dict().items(), probe.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), k
    # without the threshold the same network is not flagged at that step
    free = train_ensemble([_mlp(0)], train_set, lr=3.0, batch_size=16, steps=bad.diverged_at_step + 1, seeds=0,
                          momentum=0.9, loss="mse")[0]
    assert not free.diverged


@pytest.mark.parametrize("n, ebs", [(2, 1), (3, 2), (397, 150), (2001, 1000), (1000, 1000), (5, 1000)])
def test_batch_statistics_test_chunks_never_hold_one_sample(n, ebs):
    from bnlab.nets.train import _test_chunks

    chunks = _test_chunks(n, ebs, "train")
    sizes = [c.stop - c.start for c in chunks]
    assert sum(sizes) == n and chunks[0].start == 0 and all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
    assert min(sizes) >= 2 and max(sizes) <= max(ebs, 3)
    with pytest.raises(ValueError, match="test_bn_mode"):
        _test_chunks(1, 10, "train")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=[0.1]), "lr with 1 values"),
        (dict(lr=-1.0), "lr"),
        (dict(lr=0.1, optimizer="adam"), "optimizer"),
        (dict(lr=0.1, seeds=[0, 1, 2]), "seeds"),
        (dict(lr=0.1, batch_size=5000), "batch_size"),
        (dict(lr=0.1, momentum=1.0), "momentum"),
        (dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
        (dict(lr=0.1, loss="hinge"), "loss"),
        (dict(lr=0.1, test_bn_mode="population"), "test_bn_mode"),
        (dict(lr=0.1, diverge_above="big"), "diverge_above"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    train_set, _ = _digits()
    models = [_bnmlp(_SPECS[0]), _bnmlp(_SPECS[1])]
    args = dict(batch_size=16, steps=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        train_ensemble(models, train_set, **args)


def test_mixed_architectures_are_refused():
    train_set, _ = _digits()
    a = BNMLP(64, 10, depth=2, width=24)
    b = BNMLP(64, 10, depth=2, width=16)
    with pytest.raises(ValueError, match="width"):
        train_ensemble([a, b], train_set, lr=0.1, batch_size=16, steps=1)
    with pytest.raises(ValueError, match="twice"):
        train_ensemble([a, a], train_set, lr=0.1, batch_size=16, steps=1)
    # stacked by structure, but one label set and one dtype
    with pytest.raises(ValueError, match="outputs differ"):
        train_ensemble([MLP(64, [8], 10, norm="bn"), MLP(64, [8], 7, norm="bn")], train_set, lr=0.1, batch_size=16,
                       steps=1)
    with pytest.raises(ValueError, match="dtypes"):
        train_ensemble([MLP(64, [8], 10, norm="bn"), MLP(64, [8], 10, norm="bn", dtype=F64)], train_set, lr=0.1,
                       batch_size=16, steps=1)


def test_networks_of_several_structures_train_as_groups():
    # MLPs of different depths, widths and normalizations: one vmap stack per structure in one step
    # (no padding), each network exactly as trained alone (same tolerances), with a network of the
    # second group exploding so that its group is dropped whole at a check while the others go on
    train_set, test_set = _digits()

    def make():
        return [MLP(64, [24], 10, norm="bn", seed=0, dtype=F64), MLP(64, [24, 24], 10, norm="bn", seed=1, dtype=F64),
                MLP(64, [16], 10, norm="ln", seed=2, dtype=F64), MLP(64, [24], 10, norm="bn", seed=3, dtype=F64)]

    lrs = [0.05, 0.1, 1e200, 0.02]
    models = make()
    results = train_ensemble(models, train_set, test_data=test_set, lr=lrs, batch_size=16, steps=30,
                             seeds=[0, 1, 2, 3], momentum=0.9, check_every=10)
    from bnlab.nets.ensemble import _structure

    assert len({_structure(m) for m in models}) == 3
    for i, (one, r, m) in enumerate(zip(make(), results, models)):
        r1 = train(one, train_set, optimizer=functools.partial(torch.optim.SGD, lr=lrs[i], momentum=0.9),
                   batch_size=16, steps=30, test_data=test_set, seed=i)
        if i == 2:
            assert r.diverged and r1.diverged and r.diverged_at_step == r1.diverged_at_step and r.steps == r1.steps
            continue
        _assert_same(r, m, r1, one)
        assert r.test_accuracy > 0.3


def test_benchmark_quick_runs():
    from benchmark_loader import load_benchmark

    mod = load_benchmark("bench_ensemble")
    threads = torch.get_num_threads()
    out = mod.main(["--quick", "--threads", "1", "--json"])
    assert torch.get_num_threads() == threads
    assert len(out["rows"]) == 3 and all(r["speedup"] > 0 for r in out["rows"])
    # the step-route section, with the keys benchmarks/gpu_check.py reads (--quick on the CPU: eager only)
    assert set(out["step_ms"]) == {"eager"} and out["step_ms"]["eager"] > 0
    assert out["ops_per_step"]["eager"] > 100 and out["profiled_ops_per_step"]["eager"] > 100
    assert out["gpu_busy_fraction"] is None


def test_benchmark_step_before_and_after_runs_and_agrees():
    # --step-ab times the eager step of e082aac (kept in benchmarks/_ensemble_step_before.py) against the
    # current one; both start from the same networks and batches, so after one SGD step of these shallow
    # float32 nets their parameters agree to float32 rounding (measured ~1e-7 of the largest entry; 1e-5
    # asserted, a margin for the summation orders, while a lost or doubled update is off by ~lr·|g|/|w|
    # ≳ 1e-3).  RMSProp's one-step difference is not bounded this way (the benchmark's docstring says why)
    from benchmark_loader import load_benchmark

    mod = load_benchmark("bench_ensemble")
    threads = torch.get_num_threads()
    rows = mod.main(["--step-ab", "--quick", "--rounds", "1", "--json"])["step_ab"]
    assert torch.get_num_threads() == threads
    assert {(r["batch"], r["optimizer"]) for r in rows} == {(8, "sgd"), (8, "rmsprop"), (128, "sgd"), (128, "rmsprop")}
    assert all(r["before_ms"] > 0 and r["after_ms"] > 0 for r in rows)
    assert all(r["max_param_diff"] < 1e-5 for r in rows if r["optimizer"] == "sgd")


def test_benchmark_layout_before_and_after_runs_and_agrees():
    # --layout-ab: the vmap stack's step with the gradients' layout against the row-major stack, from the same
    # networks and batches: one momentum-SGD step agrees to float32 rounding of a different summation order
    # (measured 4e-7 of the largest entry; 1e-5 asserted, while a lost or doubled update is off by ≳ 1e-3)
    from benchmark_loader import load_benchmark

    mod = load_benchmark("bench_ensemble")
    (row,) = mod.main(["--layout-ab", "--quick", "--rounds", "1", "--json"])["layout_ab"]
    assert row["before_ms"] > 0 and row["after_ms"] > 0 and row["max_param_diff"] < 1e-5
    assert 0 < row["matmul_fraction_after"]


def test_benchmark_prints_eager_and_compiled_operators_side_by_side(monkeypatch, capsys):
    # the route table's plumbing (--routes eager,compile): both rows, dispatched operators for eager and
    # the profiler's count for the compiled route, in one table.  torch.compile is replaced by the
    # identity (the functional step then runs as it is), so this takes seconds; the real compilation's
    # counts are the benchmark's own output (docs/trainability.md)
    from benchmark_loader import load_benchmark

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    mod = load_benchmark("bench_ensemble")
    out = mod.main(["--quick", "--routes-only", "--routes", "eager,compile", "--threads", "1", "--rounds", "1"])
    assert list(out["step_ms"]) == ["eager", "compile"] and out["route_used"] == {"eager": "eager", "compile": "compile"}
    assert out["ops_per_step"]["eager"] > out["profiled_ops_per_step"]["eager"] > 100  # views count when dispatched
    assert out["ops_per_step"]["compile"] == out["profiled_ops_per_step"]["compile"] > 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("route "))
    assert "ops/step" in lines[head] and "eager/route" in lines[head]
    assert lines[head + 1].split()[0] == "eager" and lines[head + 2].split()[0] == "compile"
    assert float(lines[head + 1].split()[3]) == pytest.approx(out["ops_per_step"]["eager"], abs=0.5)
    assert float(lines[head + 2].split()[3]) == pytest.approx(out["ops_per_step"]["compile"], abs=0.5)
    # the compiled route's checks against the eager step (StepRunner), reported beside its row
    assert out["route_check_worst"]["eager"] is None and 0 <= out["route_check_worst"]["compile"] <= 1
    assert "checked against eager" in lines[head + 2] and "checked" not in lines[head + 1]


# The float32 CPU variance of the BN-MLP stack (a two-pass float64 formula in place of torch's float64
# Welford recurrence, for speed).  Both are exact to ~b·2⁻⁵³ ≈ 1.4e-14 relative (b ≤ 128 samples) before the
# one rounding to float32, so they can differ only where the float64 value lies within 1.4e-14 of a float32
# rounding boundary — then by one float32 ulp, 2⁻²³ ≈ 1.2e-7 relative; measured, none of 13 million random
# variances differed (over the ~1e8 of the trainability sweeps a few do).  Asserted: one ulp (rtol 1.2e-7, atol 0), at every (groups, b) a sweep uses, on
# data with a mean up to 10× the spread (where a one-pass E[h²] − E[h]² in float32 would be off by ~1e-5).
@pytest.mark.parametrize("groups, b", [(1, 4), (1, 8), (1, 32), (1, 128), (32, 4), (16, 8), (2, 64)])
def test_float32_sample_variance_is_torchs_variance(groups, b):
    from bnlab.nets.ensemble import _sample_variance

    gen = torch.Generator().manual_seed(b + groups)
    h = torch.randn(6, groups, b, 128, generator=gen) + 10 * torch.randn(6, groups, 1, 128, generator=gen)
    h.requires_grad_()
    ours = _sample_variance(h)
    ref = h.var(dim=2, unbiased=False, keepdim=True)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1.2e-7, atol=0)
    # backward: torch's var_backward formula term for term, so the same float32 operations on the same
    # inputs; a wrong factor (1/b instead of 2/b, a missing centring) is off by O(1)
    w = torch.randn(ref.shape, generator=gen)
    (g_ours,) = torch.autograd.grad((ours * w).sum(), h)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), h)
    torch.testing.assert_close(g_ours, g_ref, rtol=1.2e-7, atol=1e-12)


def test_float32_ensemble_matches_the_torch_variance_route(monkeypatch):
    # the whole float32 training with the fast variance against the same training with torch.var: the
    # variances agree to one ulp (above), and 20 SGD steps through ≤ 5 BN layers amplify that by < 10³
    # (the step maps' Lipschitz bound of the float64 test above), so 1e-4 relative is a wide margin that a
    # wrong variance (a factor b/(b−1), O(1/b) ≥ 1e-2 here) still fails
    train_set, test_set = _digits()
    x, y = train_set
    train32 = (torch.as_tensor(x, dtype=torch.float32), y)

    def run():
        models = [BNMLP(64, 10, depth=s["depth"], width=24, eps=s["eps"], seed=s["seed"]) for s in _SPECS[:3]]
        train_ensemble(models, train32, lr=0.05, batch_size=16, steps=20, seeds=[0, 1, 2])
        return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]

    fast = run()
    import bnlab.nets.ensemble as ens

    torch_var = lambda h: h.var(dim=2, unbiased=False, keepdim=True)  # noqa: E731
    monkeypatch.setattr(ens, "_sample_variance", torch_var)  # the composite BN (under torch.func)
    monkeypatch.setattr(ens, "_two_pass_variance", torch_var)  # the eager step's fused BN node
    slow = run()
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_fused_batch_norm_node_has_the_composites_gradient():
    # the eager float32 step's BN as one autograd node (_BatchNormEager: closed-form backward) against the
    # composite it replaces, (h − mean)·rsqrt(var + ε) differentiated by autograd.  float64: gradcheck
    # (finite differences; the formula, whatever the dtype).  float32: the forward runs the composite's
    # operations, so the same floats; the backward sums the same terms in another order — both are sums of
    # ≤ b + 6 rounded terms bounded elementwise by T = r·(|g| + |mean g| + |x̂|·|mean(g·x̂)|) (plus the
    # composite's mean/variance paths, of the same size), so they differ by ≤ 2·(b + 6)·2⁻²⁴·T: asserted
    # with a factor 4 of margin.  A wrong term (a missing centring, 1/(b−1) for 1/b) is off by O(T/b).
    from bnlab.nets.ensemble import _BatchNormEager, _sample_variance

    gen = torch.Generator().manual_seed(0)
    h64 = torch.randn(2, 2, 4, 3, generator=gen, dtype=F64).requires_grad_()
    eps64 = torch.tensor([1e-3, 0.1], dtype=F64).view(2, 1, 1, 1)
    assert torch.autograd.gradcheck(lambda t: _BatchNormEager.apply(t, eps64)[0], (h64,))
    for groups, b in [(1, 8), (1, 128), (32, 4)]:
        h = (torch.randn(6, groups, b, 128, generator=gen) + 3 * torch.randn(6, groups, 1, 128, generator=gen))
        h.requires_grad_()
        eps = torch.tensor([1e-3, 1e-3, 0.1, 0.0, 1e-3, 1e-2]).view(6, 1, 1, 1)
        g = torch.randn(h.shape, generator=gen)
        out, mean, var = _BatchNormEager.apply(h, eps)
        (grad,) = torch.autograd.grad(out, h, g)
        ref_mean = h.mean(dim=2, keepdim=True)
        ref_var = _sample_variance(h)
        ref = (h - ref_mean) * torch.rsqrt(ref_var + eps)
        (ref_grad,) = torch.autograd.grad(ref, h, g)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(mean, ref_mean, rtol=0, atol=0)
        torch.testing.assert_close(var, ref_var, rtol=0, atol=0)
        with torch.no_grad():
            r = torch.rsqrt(ref_var + eps)
            xhat = ref
            bound = r * (g.abs() + g.mean(2, keepdim=True).abs() + xhat.abs() * (g * xhat).mean(2, keepdim=True).abs())
            assert ((grad - ref_grad).abs() <= 4 * 2 * (b + 6) * 2.0**-24 * bound).all(), (groups, b)


def test_float32_eager_step_with_the_fused_batch_norm_matches_the_functional_step(monkeypatch):
    # float32 on the CPU the eager step's BN is one node (_BatchNormEager); the compiled route's step
    # (torch.func.grad, run here uncompiled) differentiates the composite.  Their gradients differ by float32
    # rounding (the bound of the test above); 20 SGD steps through ≤ 5 BN layers amplify that by < 10³ (the
    # float64 tests' Lipschitz bound), so 1e-4 relative is a wide margin that a wrong gradient term (O(1/b)
    # ≥ 1e-2 here) still fails.  The spy shows each route took its own BN.
    import bnlab.nets._ensemble_step as step_module
    import bnlab.nets.ensemble as ens
    from bnlab.nets import _native_bn

    monkeypatch.setattr(step_module.torch, "compile", lambda fn, **kw: fn)
    # the ATen route of the eager BN (the native kernel's own tests are in test_native_bn.py)
    monkeypatch.setattr(_native_bn, "_STATE", {"kernel": None})
    fused = []
    apply = ens._BatchNormEager.apply
    monkeypatch.setattr(ens._BatchNormEager, "apply", lambda *a: fused.append(1) or apply(*a))
    train_set, _ = _digits()
    train32 = (torch.as_tensor(train_set[0], dtype=torch.float32), train_set[1])

    def run(mode):
        fused.clear()
        models = [BNMLP(64, 10, depth=s["depth"], width=24, eps=s["eps"], seed=s["seed"]) for s in _SPECS[:3]]
        train_ensemble(models, train32, lr=0.05, batch_size=16, steps=20, seeds=[0, 1, 2], step_mode=mode)
        return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models], len(fused)

    (eager, n_eager), (func, n_func) = run("eager"), run("compile")
    # one fused BN per stacked layer and eager step; the compiled route's steps take none — its fused BNs
    # are the eager steps beside its first calls, which check them (StepRunner)
    layers = max(s["depth"] for s in _SPECS[:3])
    assert n_eager == 20 * layers and n_func == step_module.VERIFY_COMPILED_CALLS * layers
    for a, b in zip(eager, func):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_vmap_stack_lays_parameters_out_as_their_gradients_and_keeps_it_through_a_compaction():
    # under vmap a linear weight's gradient (M, out, in) comes back transposed; the stacked parameter (and so
    # the optimizer state made like it) takes that layout, so the elementwise updates run over memory in order
    from bnlab.nets.ensemble import _VmapStack

    (x, _), _ = _digits()
    stack = _VmapStack([_mlp(s) for s in range(3)], torch.device("cpu"))
    stack._data_ndim = 2
    before = [p.clone() for p in stack.params()]
    assert any(p.ndim == 3 and p.is_contiguous() for p in before)  # stack_module_state's row-major stack

    def grad_strides(params):
        leaves = [p.detach().requires_grad_() for p in params]
        out = stack._vmapped(leaves, {k: v.clone() for k, v in stack.buffers.items()}, torch.from_numpy(x[:16]), True)
        return [g.stride() for g in torch.autograd.grad(out.sum(), leaves)]

    stack.adopt_gradient_layout(torch.from_numpy(x[:16]))
    after = stack.params()
    for p, b, s in zip(after, before, grad_strides(after)):
        assert torch.equal(p, b) and p.stride() == s
    assert any(p.ndim == 3 and not p.is_contiguous() for p in after)  # the weights moved
    stack.compact(torch.tensor([0, 2]))
    for p, s in zip(stack.params(), grad_strides(stack.params())):
        assert p.shape[0] == 2 and p.stride() == s


def test_every_route_starts_from_the_gradients_layout_and_the_functional_gradient_keeps_it():
    # the compiled routes differentiate by vmap(grad(·)), which returns each gradient in its parameter's layout:
    # with the eager step's layout on every route, the compiled step and its eager reference multiply the same
    # layouts (the same rounding of the forward's products), and no update mixes two layouts
    from bnlab.nets._ensemble_step import StepConfig
    from bnlab.nets.ensemble import _EnsembleRun, _VmapStack

    (x, y), _ = _digits()
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    cfg = StepConfig(loss="cross_entropy", optimizer="sgd", momentum=0.9, weight_decay=0.0, rmsprop_alpha=0.99,
                     rmsprop_eps=1e-8, diverge_above=None, shared_order=True, num_networks=2, host_reads=True)
    for route in ("eager", "compile"):
        stack = _VmapStack([_mlp(s) for s in range(2)], torch.device("cpu"))
        stack._data_ndim = 2
        run = _EnsembleRun(stack, cfg, route, x, y, lrs=[0.1, 0.1], seeds=[0, 0], batch_size=16, steps=4,
                           check_every=2)
        weights = [p for p in run.state["params"] if p.ndim == 3]
        assert weights and not any(p.is_contiguous() for p in weights), route
        assert [v.stride() for v in run.state["velocity"]] == [p.stride() for p in run.state["params"]]
    leaves = [p.detach().requires_grad_() for p in stack.params()]
    _, grads, _ = stack.func_value_and_grads(leaves, {k: v.clone() for k, v in stack.buffers.items()}, x[:16],
                                             y[:16].expand(2, 16), "cross_entropy")
    assert [g.stride() for g in grads] == [p.stride() for p in stack.params()]


def test_vmap_ensemble_with_momentum_and_a_diverging_network_matches_one_at_a_time(monkeypatch):
    # the eager step drops a stopped network at a check (compaction): the kept networks' parameters and
    # momentum buffers keep their gradients' layout, and train exactly as alone
    from bnlab.nets import ensemble

    compactions = []
    check = ensemble._EnsembleRun.check

    def checked(self):
        rows = len(self.state["row_ids"])
        out = check(self)
        if len(self.state["row_ids"]) < rows:
            compactions.append(rows)
            assert [v.stride() for v in self.state["velocity"]] == [p.stride() for p in self.state["params"]]
        return out

    monkeypatch.setattr(ensemble._EnsembleRun, "check", checked)
    train_set, test_set = _digits()
    lrs = [0.02, 1e200, 0.005]
    models = [_mlp(s) for s in range(3)]
    results = train_ensemble(models, train_set, test_data=test_set, lr=lrs, batch_size=16, steps=30, seeds=[0, 1, 2],
                             momentum=0.9, check_every=5)
    assert results[1].diverged and not results[0].diverged and not results[2].diverged and compactions == [3]
    for i in (0, 2):
        one = _mlp(i)
        r1 = train(one, train_set, optimizer=functools.partial(torch.optim.SGD, lr=lrs[i], momentum=0.9), batch_size=16,
                   steps=30, test_data=test_set, seed=i, check_every=5)
        _assert_same(results[i], models[i], r1, one)


def test_the_layout_probe_draws_no_random_number_of_the_training():
    # a module with dropout draws random numbers in its forward; the probe's must not shift the training's draws
    from torch import nn

    from bnlab.nets.ensemble import _VmapStack

    def net(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 10)).double()

    (x, _), _ = _digits()
    stack = _VmapStack([net(s) for s in range(2)], torch.device("cpu"))
    stack._data_ndim = 2
    torch.manual_seed(123)
    state = torch.get_rng_state()
    stack.adopt_gradient_layout(torch.from_numpy(x[:16]))
    assert torch.equal(torch.get_rng_state(), state)
    assert any(p.ndim == 3 and not p.is_contiguous() for p in stack.params())
