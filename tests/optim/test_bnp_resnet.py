"""BNP on ResNets (Lange et al. §5, Figs. 6-7): conv handlers with BN / GN / nothing inside the blocks,
skip connections and a Linear head, checked against a dense re-implementation of Eq. 15 / Eq. 23; BNP+GN
trains; train_resnet's schedule is the one the optimizer sees."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bnlab.data import Dataset
from bnlab.nets import resnet
from bnlab.optim import BNPreconditioner, resnet_learning_rate, train_resnet


def synthetic_images(n: int, split: str, *, seed: int = 0, classes: int = 10, size: int = 32) -> Dataset:
    """32×32×3 images in [0, 1]: uniform noise plus a bright band whose channel and rows encode the class."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.rand(n, 3, size, size, generator=g) * 0.3
    band = size // 4
    mask = torch.zeros(classes, 3, size, size)
    for k in range(classes):
        mask[k, k % 3, (k // 3 % 4) * band:(k // 3 % 4 + 1) * band, :] = 0.7
    return Dataset("synthetic", split, x + mask[y], y, classes, tuple(str(k) for k in range(classes)))


def _dense_reference(g_w, g_b, mean_cols, var_cols, q2):
    """(1/q²) P Pᵀ applied to each row [G_b(i), G_w(i, :)] with P Pᵀ built as an explicit matrix
    (Lange et al., Eq. 15: P = [[1, −μᵀ], [0, I]] diag(1, 1/σ̃)); without a bias, G_w / (q² σ̃²)
    (bnlab.optim.bnp's Errata: no column e, so only the scaling applies)."""
    if g_b is None:
        return g_w / (q2 * var_cols), None
    n_in = mean_cols.numel()
    p = torch.zeros(n_in + 1, n_in + 1, dtype=g_w.dtype)
    p[0, 0] = 1.0
    p[0, 1:] = -mean_cols / var_cols.sqrt()
    p[1:, 1:] = torch.diag(1.0 / var_cols.sqrt())
    rows = torch.cat([g_b[:, None], g_w], dim=1) @ (p @ p.T).T / q2
    return rows[:, 1:], rows[:, 0]


CASES = [
    dict(depth=20, norm="bn", preact=False),
    dict(depth=20, norm="none", preact=False),  # BNP alone: convolutions with biases
    dict(depth=20, norm="gn", preact=True, norm_kwargs={"num_groups": 4}),
    dict(depth=18, norm="gn", preact=False, norm_kwargs={"num_groups": 32}),  # 1×1 projection shortcuts
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"resnet{c['depth']}-{c['norm']}-preact{c['preact']}")
def test_one_bnp_step_on_a_resnet_matches_the_dense_formula(case):
    torch.manual_seed(0)
    eps1, eps2 = 1e-2, 1e-4
    model = resnet(case["depth"], 10, norm=case["norm"], preact=case["preact"], norm_kwargs=case.get("norm_kwargs"),
                   dtype=torch.float64, seed=1)
    pre = BNPreconditioner(model, rho=0.0, eps1=eps1, eps2=eps2)  # ρ = 0: the mini-batch statistics
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert set(pre.layers) == set(layers)  # every conv (shortcut projections too) and the head
    seen = {}

    def capture(name):
        def hook(module, args, out):
            seen[name] = (args[0].detach().clone(), out.shape)
        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in layers.items()]
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    y = torch.arange(6) % 10
    nn.functional.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    raw = {n: (m.weight.grad.clone(), None if m.bias is None else m.bias.grad.clone()) for n, m in layers.items()}
    pre.step()

    for name, m in layers.items():
        inp, out_shape = seen[name]
        n = inp.shape[0]
        if isinstance(m, nn.Linear):
            mean, var = inp.mean(0), inp.var(0, unbiased=False)
            q2 = max(m.in_features / n, 1.0)  # Prop. 5
            cols = torch.arange(m.in_features)
        else:
            # Eqs. 21-22: per input channel over the batch and the map; q² = max(c k²/N, √(rs)) with rs the
            # output positions (§4); column j of the (c_out, c_in·k²) kernel matrix belongs to channel j // k².
            mean, var = inp.mean((0, 2, 3)), inp.var((0, 2, 3), unbiased=False)
            k2 = m.kernel_size[0] * m.kernel_size[1]
            q2 = max(m.in_channels * k2 / n, math.sqrt(out_shape[2] * out_shape[3]))
            cols = torch.arange(m.in_channels * k2) // k2
        var_tilde = var + eps1 * var.max() + eps2  # Algorithm 2 / 3 step 3
        g_w, g_b = raw[name]
        want_w, want_b = _dense_reference(g_w.reshape(g_w.shape[0], -1), g_b, mean[cols], var_tilde[cols], q2)
        # both routes in float64 over ≤ 4 609 columns: rounding ~1e-13 relative, far inside 1e-9
        torch.testing.assert_close(m.weight.grad.reshape(g_w.shape[0], -1), want_w, rtol=1e-9, atol=1e-12)
        if g_b is not None:
            torch.testing.assert_close(m.bias.grad, want_b, rtol=1e-9, atol=1e-12)
        assert torch.isfinite(m.weight.grad).all()


def test_bnp_plus_gn_trains_a_resnet():
    """30 BNP+GN steps (the paper's defaults ρ = 0.99, ε₁ = 1e-2, ε₂ = 1e-4; He-normal ×0.1 as its
    CIFAR-10 BNP+GN) on a ResNet-20 fit 64 easy synthetic images: the training loss falls below a quarter
    of its start (ln 10 ≈ 2.30 at init; measured: < 0.01 after 30 steps) — it would not with a broken
    preconditioner (a zero or NaN step).  8×8 images keep it to ~1 s."""
    train = synthetic_images(64, "train", seed=0, size=8)
    model = resnet(20, 10, norm="gn", norm_kwargs={"num_groups": 4}, sigma_w2=2 * 0.1 ** 2, seed=0)
    pre = BNPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = train.x, train.y
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        pre.step()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert max(losses[-5:]) < 0.25 * losses[0], losses


def test_learning_rate_schedule_closed_forms():
    kw = dict(base_lr=0.1, steps_per_epoch=10, milestones=(80, 120))
    assert resnet_learning_rate(0, **kw) == 0.1
    assert resnet_learning_rate(799, **kw) == 0.1
    assert resnet_learning_rate(800, **kw) == pytest.approx(0.01, rel=1e-12)
    assert resnet_learning_rate(1200, **kw) == pytest.approx(0.001, rel=1e-12)
    # He et al.'s constant warm-up: 0.01 for 400 iterations, then 0.1
    const = dict(kw, warmup="constant", warmup_steps=400, warmup_lr=0.01)
    assert resnet_learning_rate(399, **const) == 0.01 and resnet_learning_rate(400, **const) == 0.1
    # linear 0.01 → 0.1 over 20 steps: 0.01 + 0.09·t/20
    lin = dict(kw, warmup="linear", warmup_steps=20, warmup_lr=0.01)
    assert resnet_learning_rate(0, **lin) == pytest.approx(0.01)
    assert resnet_learning_rate(10, **lin) == pytest.approx(0.055)
    assert resnet_learning_rate(20, **lin) == 0.1
    for bad, match in ((dict(milestones=(120, 80)), "milestones"), (dict(warmup="cosine"), "warmup"),
                       (dict(base_lr=0.0), "base_lr")):
        with pytest.raises(ValueError, match=match):
            resnet_learning_rate(0, **dict(kw, **bad))


def test_train_resnet_applies_the_schedule_and_reports_epochs():
    """The learning rate the optimizer holds after each step is the schedule's rate of the next step."""
    train, test = synthetic_images(32, "train"), synthetic_images(16, "test", seed=1)
    seen = []
    res = train_resnet(method="bnp_gn", dataset=(train, test), depth=20, batch_size=8, epochs=3, milestones=(2,),
                       warmup="linear", warmup_epochs=1, init_scale=0.1,
                       callbacks=[lambda info: seen.append(info.optimizer.param_groups[0]["lr"])])
    assert res.steps == 12 and [r["epoch"] for r in res.epochs] == [1, 2, 3]
    want = [resnet_learning_rate(t + 1, base_lr=0.1, steps_per_epoch=4, milestones=(2,), warmup="linear",
                                 warmup_steps=4, warmup_lr=0.01) for t in range(12)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and math.isfinite(r["train_loss"]) for r in res.epochs)
    assert res.model == "resnet20" and res.norm == "bnp_gn" and res.train_size == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="ln"), "method"),
    (dict(warmup_steps=10, warmup_epochs=1), "warmup"),
    (dict(milestones=[5, 5]), "milestones"),
    (dict(init_scale=0.0), "init_scale"),
    (dict(dataset=42), "dataset"),
    (dict(momentum=1.0), "momentum"),
])
def test_train_resnet_bad_input(kwargs, match):
    data = (synthetic_images(16, "train"), synthetic_images(8, "test"))
    with pytest.raises(ValueError, match=match):
        train_resnet(**dict(dict(dataset=data, depth=20, batch_size=8, epochs=1), **kwargs))
