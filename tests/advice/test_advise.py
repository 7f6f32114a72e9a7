"""bnlab.advise: every measured number against an independent route, the module untouched, bad input refused.

Independent routes: per-layer ‖∂L/∂h‖² by ``retain_grad`` on the outputs of the Linear modules (forward hooks,
not the probe's function mode); λmax and the free block by dense ``torch.autograd.functional.hessian`` in float64
(train-mode BN by hand); ranks by :func:`bnlab.rank.layer_rank_measures` (module hooks); η* by its formula.
"""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import bnlab
from bnlab.advice import Advice, advise
from bnlab.nets import BNMLP, MLP


def _data(n=16, d=12, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


def _small_bn_mlp(dtype=torch.float32):
    return MLP(12, [10, 10], 3, norm="bn", seed=1, dtype=dtype)


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [p.requires_grad for p in model.parameters()],
            [id(p) for p in model.parameters()])


def _assert_same(before, model):
    sd, flags, grads, req, ids = before
    after = model.state_dict()
    assert sd.keys() == after.keys()
    for k in sd:
        assert sd[k].dtype == after[k].dtype and torch.equal(sd[k], after[k]), k  # bit for bit
    assert [m.training for m in model.modules()] == flags
    now = [p.grad for p in model.parameters()]
    assert [g is None for g in now] == [g is None for g in grads]
    assert all(g is None or torch.equal(g, h) for g, h in zip(grads, now))
    assert [p.requires_grad for p in model.parameters()] == req
    assert [id(p) for p in model.parameters()] == ids


@pytest.mark.parametrize("which", ["mlp", "bnmlp", "conv"])
def test_the_module_and_the_random_state_are_unchanged(which):
    x, y = _data()
    if which == "mlp":
        model = _small_bn_mlp()
        model.blocks[0][1].eval()  # mixed train/eval flags must survive
    elif which == "bnmlp":
        model = BNMLP(12, 3, depth=3, width=10, seed=2)
    else:
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))
        x = torch.randn(16, 1, 4, 4)
    with torch.no_grad():  # running statistics away from their initial values, a gradient on one parameter
        for name, buf in model.named_buffers():
            if "running" in name:
                buf.uniform_(0.5, 2.0)
    params = list(model.parameters())
    params[0].grad = torch.randn_like(params[0])
    params[-1].requires_grad_(False)
    before = _state(model)
    rng = torch.get_rng_state()
    a = advise(model, (x, y), lr=0.1, momentum=0.9, draws=3, measure_bnp=True)
    _assert_same(before, model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert isinstance(a, Advice) and all(getattr(a, p) is not None for p in ("gradients", "learning_rate", "rank",
                                                                           "batch_size"))


def test_bnlab_advise_is_the_function():
    assert bnlab.advise is advise


def test_structure_placement_norms_and_scale_invariance():
    x, y = _data()
    s = advise(MLP(12, [10, 10], 3, norm="bn", placement="pre"), (x, y), skip=("gradients", "learning_rate", "rank",
                                                                              "batch_size")).structure
    assert s.placement == "pre" and s.depth == 2 and [l.norm for l in s.layers] == ["batchnorm", "batchnorm", None]
    assert [l.scale_invariant for l in s.layers] == [True, True, False] and s.activation_spec == "relu"
    s = advise(MLP(12, [10, 10], 3, norm="bn", placement="post", phi="tanh"), (x, y),
               skip=("gradients", "learning_rate", "rank", "batch_size")).structure
    assert s.placement == "post" and [l.scale_invariant for l in s.layers] == [False, False, False]
    s = advise(MLP(12, [10, 10], 3, norm="ln"), (x, y), skip=("gradients", "learning_rate", "rank",
                                                              "batch_size")).structure
    assert {l.norm for l in s.layers[:-1]} == {"layernorm"} and all(l.scale_invariant for l in s.layers[:-1])
    s = advise(MLP(12, [10, 10], 3, norm="none"), (x, y), skip=("gradients", "learning_rate", "rank",
                                                                "batch_size")).structure
    assert s.placement == "none" and s.batch_norm_layers == 0
    s = advise(BNMLP(12, 3, depth=4, width=10, beta=0.5), (x, y), skip=("gradients", "learning_rate", "rank",
                                                                        "batch_size")).structure
    assert s.depth == 4 and s.placement == "pre" and s.layers[0].beta == 0.5 and s.theorem["Yang et al. 2019"] is False
    # a ResNet: residual additions, global pooling before the classifier, convs followed by BN are scale-invariant
    from bnlab.nets import resnet

    s = advise(resnet(20), torch.randn(4, 3, 32, 32), skip=("gradients", "learning_rate", "rank",
                                                           "batch_size")).structure
    assert s.residual_adds == 9 and len(s.layers) == 20 and s.layers[-1].input_source == "global_pool"
    assert all(l.scale_invariant for l in s.layers[:-1]) and not s.layers[-1].scale_invariant


def test_initialization_scale_is_read_off_the_weights():
    # W ~ N(0, σ_w²/fan_in) with σ_w² = 2: fan_in·Var(W) estimates 2 with relative error ≈ √(2/n), n = 256·256
    model = MLP(256, [256, 256], 10, norm="bn", sigma_w2=2.0, seed=3)
    s = advise(model, torch.randn(8, 256), skip=("gradients", "learning_rate", "rank", "batch_size")).structure
    for layer in s.layers[1:-1]:
        assert layer.sigma_w2 == pytest.approx(2.0, rel=5 * math.sqrt(2 / 256 ** 2))


def _grads_by_module_hooks(model, x, y, loss_fn):
    outs = {}

    def keep(name):
        def hook(module, inputs, output):
            output.retain_grad()
            outs[name] = output
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
    return {n: float(o.grad.double().pow(2).sum()) for n, o in outs.items()}


def test_gradient_norms_match_an_independent_route():
    x, y = _data(n=32)
    model = _small_bn_mlp(torch.float64)
    g = advise(model, (x.double(), y), draws=2, skip=("learning_rate", "rank", "batch_size")).gradients
    ref = copy.deepcopy(model).train()
    want = _grads_by_module_hooks(ref, x.double(), y, nn.functional.cross_entropy)
    names = [lab.split(" ")[1] for lab in g.layers]
    np.testing.assert_allclose([g.values[0][i] for i in range(len(names))], [want[n] for n in names], rtol=1e-12)
    # draw 1 permutes every parameter's entries: same empirical distribution, different values
    assert g.values[1] != g.values[0]


def test_measured_rate_matches_the_mean_field_rate_of_a_wide_bn_mlp():
    # Yang et al. Thm 3.10: ‖∂L/∂h^l‖² grows by λ_G↓ = 1.59 per layer at B = 16 (relu, ε → 0).  Width 512 leaves a
    # finite-width bias of order B/width ≈ 3 %; the 8-draw interval is a few %: 10 % is the tolerance.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    model = BNMLP(64, 10, depth=14, width=512, eps=1e-5, seed=5)
    g = advise(model, x, draws=8, skip=("learning_rate", "rank", "batch_size")).gradients
    assert g.theory_rate == pytest.approx(1.58995, rel=1e-4) and g.theory_basis == "theorem"
    assert g.rate == pytest.approx(g.theory_rate, rel=0.1)
    assert g.trainable and g.max_depth_theory == pytest.approx(16 / math.log(g.theory_rate), rel=1e-9)
    assert {k.name for k in g.knobs} == {"beta", "eps", "batch_size"}  # relu is homogeneous: γ has no effect
    beta = next(k for k in g.knobs if k.name == "beta")
    assert beta.suggested == 1.0 and beta.max_trainable_depth > g.max_depth_theory


def test_a_deep_bn_mlp_gets_the_fail_verdict_with_the_knob_that_helps():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))
    g = advise(BNMLP(32, 10, depth=40, width=64, seed=7), x, draws=3, skip=("learning_rate", "rank",
                                                                           "batch_size")).gradients
    assert g.trainable is False and "expect SGD to fail" in g.verdict and "beta 0 → 1" in g.verdict


def _dense_hessian_train_mode(model, x, y, loss_fn):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def f(t):
        ref = copy.deepcopy(model).train()
        params = {n: c.reshape(s) for n, c, s in zip(names, t.split(sizes), shapes)}
        return loss_fn(torch.func.functional_call(ref, params, (x,)), y)

    return torch.autograd.functional.hessian(f, theta).numpy(), names, sizes


@pytest.mark.parametrize("loss", ["cross_entropy", "mse", "torch_mse"])
def test_eta_star_and_the_free_block_match_dense_hessians(loss):
    x, y = _data(n=10)
    x = x.double()
    model = _small_bn_mlp(torch.float64)
    if loss == "cross_entropy":
        loss_arg, fn, yt = "cross_entropy", nn.functional.cross_entropy, y
    elif loss == "mse":
        from bnlab.nets import half_squared_error

        loss_arg, fn, yt = "mse", half_squared_error, nn.functional.one_hot(y, 3).double()
    else:
        loss_arg, fn, yt = nn.MSELoss(), nn.functional.mse_loss, nn.functional.one_hot(y, 3).double()
    lr = advise(model, (x, y), loss=loss_arg, momentum=0.9, tol=1e-10,
                skip=("gradients", "rank", "batch_size")).learning_rate
    H, names, sizes = _dense_hessian_train_mode(model, x, yt, fn)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    free = [i for j, n in enumerate(names) if n.startswith(("readout", "blocks.0.1", "blocks.1.1"))
            for i in range(offsets[j], offsets[j + 1])]
    lam, lam_free = np.linalg.eigvalsh(H)[-1], np.linalg.eigvalsh(H[np.ix_(free, free)])[-1]
    # Lanczos to tol = 1e-10 relative residual: far inside 1e-7
    assert lr.lambda_max == pytest.approx(lam, rel=1e-7)
    assert lr.lambda_max_free == pytest.approx(lam_free, rel=1e-7)
    assert lr.eta_star == pytest.approx(2 * 1.9 / lam, rel=1e-7) and lr.limit == lr.eta_star_free
    assert lr.free_parameters == len(free)


def test_learning_rate_verdict_bands():
    x, y = _data(n=32)
    base = advise(_small_bn_mlp(), (x, y), momentum=0.9, skip=("gradients", "rank", "batch_size")).learning_rate
    assert base.lr is None and base.suggested_lr == pytest.approx(base.limit / 2)
    for factor, band in ((0.3, "below η*/2"), (0.8, "η*/2 … η*"), (1.5, "above η*")):
        lr = base.at(factor * base.limit)
        assert lr.band == band and lr.ratio == pytest.approx(factor, rel=1e-12) and lr.lambda_max == base.lambda_max
    direct = advise(_small_bn_mlp(), (x, y), momentum=0.9, lr=1.5 * base.limit,
                    skip=("gradients", "rank", "batch_size")).learning_rate
    at = base.at(1.5 * base.limit)  # .at() is what measuring at that lr gives (same seed, same Lanczos start)
    assert direct.band == at.band and direct.ratio == pytest.approx(at.ratio, rel=1e-6)
    assert direct.lambda_max == pytest.approx(base.lambda_max, rel=1e-6)
    vanilla = advise(MLP(12, [10, 10], 3, norm="none", seed=1), (x, y), momentum=0.9, lr=1.0,
                     skip=("gradients", "rank", "batch_size")).learning_rate
    assert vanilla.lambda_max_free is None and vanilla.limit == vanilla.eta_star
    assert vanilla.at(3 * vanilla.limit).band == "η* … 4η*" and vanilla.at(5 * vanilla.limit).band == "above 4η*"
    opt = torch.optim.Adam(_small_bn_mlp().parameters(), lr=1e-3)
    adam = advise(_small_bn_mlp(), (x, y), optimizer=opt, skip=("gradients", "rank", "batch_size")).learning_rate
    assert adam.optimizer == "Adam" and "Adam preconditions" in adam.verdict


def test_mean_field_bound_is_the_fisher_papers_for_a_covered_architecture():
    # what is tested is the mapping of the module to the recursions' inputs: the spec string, σ_w² and σ_b² per
    # layer read off the weights, γ and β off BN, and the input order parameters of the batch (Claim 6.1)
    from bnlab.fisher import fisher_order_parameters

    x, y = _data(n=32)
    model = MLP(12, [10, 10], 3, norm="bn", sigma_b2=0.3, seed=1)
    lr = advise(model, (x, y), loss="mse", momentum=0.9, skip=("gradients", "rank", "batch_size")).learning_rate
    lins = [model.blocks[0][0], model.blocks[1][0], model.readout]
    sw2 = [float(m.weight.detach().double().var(unbiased=False)) * m.weight.shape[1] for m in lins]
    sb2 = [float(m.bias.detach().double().var(unbiased=False)) for m in lins]
    xd = x.double()
    kw = dict(sigma_w2=sw2, sigma_b2=sb2, momentum=0.9, input_q=float((xd ** 2).sum(1).mean() / 12),
              input_q_xy=float((xd.mean(0) ** 2).sum() / 12))
    assert lr.bound["arch"] == "fc:12-10-10-3" and not lr.bound_reason
    for mode in ("eval", "train"):
        ref = fisher_order_parameters("fc:12-10-10-3", bn_mode=mode, **kw)
        assert lr.bound[mode]["lambda_max"] == pytest.approx(ref.lambda_max_bound, rel=1e-12)
    assert lr.bound["train"]["lambda_max"] < lr.bound["eval"]["lambda_max"]  # BN layers drop out in train mode


def test_rank_measures_match_layer_rank_measures():
    from bnlab.rank import layer_rank_measures

    x, y = _data(n=32)
    model = MLP(12, [16, 16, 16], 3, norm="bn", seed=2)
    r = advise(model, (x, y), skip=("learning_rate", "batch_size")).rank
    ref = copy.deepcopy(model).train()
    want = layer_rank_measures(ref, x, ["blocks.1.0", "blocks.2.0", "readout"], capture="input")
    assert list(r.soft_rank) == [int(want[n].soft_rank) for n in ("blocks.1.0", "blocks.2.0", "readout")]
    np.testing.assert_allclose(r.r_bound, [float(want[n].rank_lower_bound) for n in ("blocks.1.0", "blocks.2.0",
                                                                                     "readout")], rtol=1e-6)
    assert not r.collapsed and r.width == (16, 16, 16)


def test_a_deep_vanilla_linear_network_is_flagged_and_bn_is_not():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(8))
    vanilla = advise(MLP(32, [32] * 48, 10, phi="identity", norm="none", sigma_w2=1.0, seed=0), x,
                     skip=("gradients", "learning_rate", "batch_size")).rank
    bn = advise(MLP(32, [32] * 48, 10, phi="identity", norm="bn", sigma_w2=1.0, seed=0), x,
                skip=("gradients", "learning_rate", "batch_size")).rank
    assert vanilla.collapsed and vanilla.remedies and vanilla.basis == "theorem"
    assert not bn.collapsed and bn.r_bound[-1] > 4 * vanilla.r_bound[-1]


def test_batch_part_small_batch_and_batch_one():
    x, y = _data(n=16)
    bs = advise(_small_bn_mlp(), (x[:4], y[:4]), skip=("gradients", "learning_rate", "rank"),
                measure_bnp=True).batch_size
    assert bs.small and bs.bnp_overhead is not None and bs.bnp_overhead > 0
    assert bs.norm_layers[0][2] == 4 and bs.norm_layers[0][3] == pytest.approx(math.sqrt(2 / 3))
    one = advise(_small_bn_mlp(), (x[:1], y[:1]), skip=("gradients", "learning_rate", "rank"))
    assert one.batch_size.bn_layers_must_go and "BN cannot train" in one.batch_size.verdict
    assert one.structure.measured_bn_mode == "eval" and any("B = 1" in n for n in one.notes)
    big = advise(_small_bn_mlp(), (x, y), skip=("gradients", "learning_rate", "rank")).batch_size
    assert not big.small and big.bnp_overhead is None  # measured only at small B unless asked


def test_eval_mode_model_is_measured_in_train_mode_and_says_so():
    x, y = _data()
    model = _small_bn_mlp().eval()
    a = advise(model, (x, y), skip=("gradients", "learning_rate", "rank", "batch_size"))
    assert a.structure.measured_bn_mode == "train" and a.structure.model_training is False
    assert any("given in eval mode" in n for n in a.notes)
    e = advise(model, (x, y), bn_mode="eval", skip=("gradients", "learning_rate", "rank", "batch_size"))
    assert e.structure.measured_bn_mode == "eval"


def test_outputs_text_json_html():
    import json

    x, y = _data()
    a = advise(_small_bn_mlp(), (x, y), lr=0.05, momentum=0.9, draws=2)
    d = a.to_dict()
    json.dumps(d, allow_nan=True)
    assert set(d["verdicts"]) == {"structure", "gradients", "learning_rate", "rank", "batch_size"}
    text = a.to_text()
    for title in ("1. Structure", "2. Gradient", "3. Learning rate", "4. Rank", "5. Batch size"):
        assert title in text
    page = a.to_html()
    assert page.startswith("<!DOCTYPE html>") and page.count("data:image/png;base64,") == 3 and "--line" in page


class _NoParams(nn.Module):
    def forward(self, x):
        return x


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(12, 8)
        self.second = nn.Linear(9, 3)  # wrong input size

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class _Blowup(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 8)
        self.b = nn.Linear(8, 3)
        with torch.no_grad():
            self.a.weight.fill_(1e38)

    def forward(self, x):
        return self.b(self.a(x) * 1e10)


@pytest.mark.parametrize("make, kwargs, needle", [
    (lambda: "not a module", {}, "expected a torch.nn.Module"),
    (_NoParams, {}, "no parameters that require grad"),
    (_Broken, {}, "failed in layer 'second' (Linear)"),
    (_Blowup, {}, "first layer with a non-finite output is 'a'"),
    (_small_bn_mlp, {"loss": lambda out, t: (out - 0).pow(2)}, "expected a scalar tensor"),
    (_small_bn_mlp, {"skip": ("structure",)}, "skip='structure' is not allowed"),
    (_small_bn_mlp, {"skip": ("sizes",)}, "skip='sizes' is not allowed"),
    (_small_bn_mlp, {"max_memory_gb": 1e-6}, "max_memory_gb"),
    (_small_bn_mlp, {"optimizer": "sgd"}, "expected a torch.optim.Optimizer"),
    (_small_bn_mlp, {"lr": -1.0}, "lr=-1.0 is not allowed"),
    (_small_bn_mlp, {"momentum": 1.0}, "momentum=1.0 is not allowed"),
    (_small_bn_mlp, {"batch_size": 100}, "batch_size=100 is not allowed"),
    (_small_bn_mlp, {"draws": 1}, "draws=1 is not allowed"),
    (_small_bn_mlp, {"loss": "hinge"}, "loss='hinge' is not allowed"),
])
def test_bad_input_is_refused_with_a_clear_message(make, kwargs, needle):
    x, y = _data()
    with pytest.raises(ValueError, match=None) as info:
        advise(make(), (x, y), **kwargs)
    assert needle in str(info.value), str(info.value)


def test_wrong_data_shape_names_the_layer_and_the_shape():
    with pytest.raises(ValueError) as info:
        advise(_small_bn_mlp(), torch.randn(16, 7))
    msg = str(info.value)
    assert "(16, 7)" in msg and "the model expects 12" in msg


def test_non_finite_data_and_bad_labels_are_refused():
    x, y = _data()
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        advise(_small_bn_mlp(), (x, y))
    x, y = _data()
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 3\)"):
        advise(_small_bn_mlp(), (x, y + 5))


def test_progress_lines_are_reported():
    lines = []
    x, y = _data()
    advise(_small_bn_mlp(), (x, y), draws=2, progress=lines.append, skip=("batch_size",))
    assert any(line.startswith("gradients: draw 2/2") for line in lines)
    assert any(line.startswith("learning rate:") for line in lines)
