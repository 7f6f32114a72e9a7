"""One builder per network: ``bnlab.nets.feedforward`` (the Fisher paper's ensemble, under
``bnlab.fisher.build_model``) and the conv-stack builder shared by ``FisherCNN`` and ``BNPCNN``.

Moving the builders must not move a single seeded parameter.  Two independent routes check it:

* ``_reference_build_model`` is the old ``bnlab.fisher.build_model`` (commit 3420265), kept here
  verbatim with its own φ module; every case compares its state dict with ``build_model``'s with
  ``torch.equal`` (same CPU kernels, same draw order: exact equality is promised, not a tolerance).
* ``FisherCNN``/``BNPCNN``/``MLP`` digests (SHA-256 of the state dict bytes) were recorded from the
  old constructors at commit 3420265 on CPU with torch 2.13.
"""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

from bnlab.activations import get_activation
from bnlab.fisher import build_model, parse_arch
from bnlab.fisher.architecture import ConvLayer
from bnlab.nets import BNPCNN, MLP, ActivationModule, FisherCNN, feedforward


def _reference_build_model(arch, *, norm="bn", phi="relu", gamma=1.0, beta=0.0, sigma_w2=2.0, sigma_b2=0.5,
                           seed=0, dtype=None):
    """The old ``bnlab.fisher.build_model`` (validation left out): the recorded draw order."""
    a = parse_arch(arch)
    L = a.depth
    dtype = dtype or torch.get_default_dtype()

    def seq(v, n):
        return list(v) if isinstance(v, (list, tuple)) else [v] * n

    sw2, sb2, gam, bet = seq(sigma_w2, L), seq(sigma_b2, L), seq(gamma, max(L - 1, 0)), seq(beta, max(L - 1, 0))
    act = get_activation(phi)

    class _Phi(torch.nn.Module):
        def forward(self, x):
            return act.torch(x)

    gen = torch.Generator().manual_seed(seed)
    mods, flattened = [], len(a.input_shape) == 1
    for l, (layer, geo) in enumerate(zip(a.layers, a.geometry())):
        if isinstance(layer, ConvLayer):
            lin = torch.nn.Conv2d(geo["in_channels"], layer.channels, layer.kernel, layer.stride, layer.padding)
        else:
            if not flattened:
                mods.append(torch.nn.Flatten())
                flattened = True
            lin = torch.nn.Linear(geo["in_units"], layer.width)
        lin = lin.to(dtype)
        with torch.no_grad():
            scale = math.sqrt(sw2[l] / geo["fan_in"])
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen, dtype=dtype) * scale)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen, dtype=dtype) * math.sqrt(sb2[l]))
        mods.append(lin)
        if l == L - 1:
            break
        if norm == "bn":
            bn_cls = torch.nn.BatchNorm2d if isinstance(layer, ConvLayer) else torch.nn.BatchNorm1d
            bn = bn_cls(layer.channels if isinstance(layer, ConvLayer) else layer.width).to(dtype)
            with torch.no_grad():
                bn.weight.fill_(gam[l])
                bn.bias.fill_(bet[l])
            mods.append(bn)
        mods.append(_Phi())
    return torch.nn.Sequential(*mods)


_CASES = [
    ("fc:20-16-16-3", dict(seed=3)),
    ("fc:12-8-8-8-4", dict(gamma=[0.5, 1.0, 2.0], beta=[0.1, 0.0, -0.2], sigma_w2=[1.0, 2.0, 3.0, 1.5],
                           sigma_b2=[0.0, 0.5, 0.0, 0.2], seed=7, dtype=torch.float64)),
    ("fc:10-9-3", dict(norm="none", phi="tanh", seed=1)),
    ("fc:10-3", dict(seed=4)),
    ("conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10", dict(seed=0)),
    ("conv:1x6x6-c4k3s2p1-fc5-fc3", dict(seed=3, dtype=torch.float64, sigma_b2=0.0)),
    ("conv:3x8x8-c5k3s1p1-c6k2s2-fc4", dict(norm="none", seed=11)),
]


@pytest.mark.parametrize("arch,kw", _CASES, ids=[c[0] + ("-" + str(c[1].get("norm", ""))) for c in _CASES])
def test_build_model_draws_the_old_builders_parameters_bit_for_bit(arch, kw):
    torch.manual_seed(5)
    ours = build_model(arch, **kw)
    ours_after = torch.randn(4)
    torch.manual_seed(5)
    ref = _reference_build_model(arch, **kw)
    ref_after = torch.randn(4)
    assert [type(m).__name__ for m in ours] == [
        "ActivationModule" if type(m).__name__ == "_Phi" else type(m).__name__ for m in ref]
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if kw.get("dtype") is None:  # the default dtype: the global generator is advanced as before, too
        assert torch.equal(ours_after, ref_after)
    x = torch.randn(6, *parse_arch(arch).input_shape, dtype=kw.get("dtype") or torch.float32)
    assert torch.equal(ours(x), ref(x))


def _digest(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(str(v.dtype).encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# recorded from the constructors before they shared the conv-stack builder (commit 3420265, CPU, torch 2.13)
_RECORDED = [
    (lambda: FisherCNN(seed=0), "85311fde3433b10c"),
    (lambda: FisherCNN((1, 28, 28), 10, gamma=0.5, beta=0.1, seed=1, dtype=torch.float64), "b134fa2a9dafdade"),
    (lambda: FisherCNN(norm="none", seed=2), "508d9ba6716bd93c"),
    (lambda: BNPCNN(seed=0), "b1c9a832c4a2f3f2"),
    (lambda: BNPCNN(norm="gn", norm_kwargs={"num_groups": 2}, seed=4, channels=(32, 64, 64)), "c7a3a27fa17e2c52"),
    (lambda: BNPCNN((1, 28, 28), 10, norm="none", init="gaussian", sigma_b2=0.1, seed=5), "6775ab858c3fc408"),
    (lambda: MLP(784, [100, 100], 10, norm="bn", seed=0), "949483e6ca16c835"),
    (lambda: build_model("fc:20-16-16-3", seed=3), "7a86305fb70a1555"),
    (lambda: build_model("conv:1x28x28-c30k3s2-c60k3s2-c90k3s2-fc10", seed=0), "2fc47e0a47d4f8ea"),
]


@pytest.mark.parametrize("i", range(len(_RECORDED)))
def test_the_shared_builders_keep_the_recorded_parameters(i):
    make, digest = _RECORDED[i]
    assert _digest(make()) == digest


def test_the_cnns_keep_their_layer_layout():
    f = FisherCNN(norm="none")
    assert [type(m).__name__ for m in f.features] == ["Conv2d", "Identity", "ActivationModule"] * 3
    b = BNPCNN()
    assert [type(m).__name__ for m in b.features] == (
        ["Conv2d", "BatchNorm2d", "ActivationModule", "MaxPool2d"] * 2 + ["Conv2d", "BatchNorm2d", "ActivationModule"])
    assert b.feature_shape == (32, 4, 4) and len(b.norms) == 4


def test_feedforward_builds_the_fisher_networks_from_tuples():
    m = feedforward((1, 6, 6), [("conv", 4, 3, 2, 1), ("fc", 5), ("fc", 3)], seed=3)
    assert [type(x).__name__ for x in m] == ["Conv2d", "BatchNorm2d", "ActivationModule", "Flatten", "Linear",
                                            "BatchNorm1d", "ActivationModule", "Linear"]
    assert len(m.norms) == 2 and all(isinstance(x, ActivationModule) for x in (m[2], m[6])) and m[2] is not m[6]
    assert m(torch.randn(4, 1, 6, 6)).shape == (4, 3)
    # any normalization of bnlab.nets by name, γ per hidden layer
    ln = feedforward((8,), [("fc", 6), ("fc", 6), ("fc", 2)], norm="ln", gamma=[0.5, 2.0])
    assert [n.weight.detach()[0].item() for n in ln.norms] == [0.5, 2.0]


@pytest.mark.parametrize(
    "kw,names",
    [
        (dict(in_shape=(3, 4), layers=[("fc", 2)]), "in_shape"),
        (dict(in_shape=(4,), layers=[]), "layers"),
        (dict(in_shape=(4,), layers=[("conv", 2, 3, 1, 0)]), "layers item"),
        (dict(in_shape=(1, 4, 4), layers=[("fc", 3), ("conv", 2, 3, 1, 0)]), "layers item"),
        (dict(in_shape=(1, 4, 4), layers=[("conv", 2, 5, 1, 0), ("fc", 2)]), "in_shape"),
        (dict(in_shape=(4,), layers=[("fc", 0)]), "width"),
        (dict(in_shape=(4,), layers=[("fc", 3), ("fc", 2)], gamma=[1.0, 2.0]), "gamma"),
        (dict(in_shape=(4,), layers=[("fc", 3), ("fc", 2)], sigma_w2=1e300, dtype=torch.float32), "sigma_w2"),
        (dict(in_shape=(4,), layers=[("fc", 3), ("fc", 2)], dtype="float64"), "dtype"),
        (dict(in_shape=(4,), layers=[("fc", 3), ("fc", 2)], norm="bogus"), "norm"),
        (dict(in_shape=(4,), layers=[("fc", 10**6), ("fc", 10**4)]), "max_memory_bytes"),
    ],
)
def test_feedforward_refuses_bad_input_naming_the_argument(kw, names):
    with pytest.raises(ValueError, match=names):
        feedforward(**kw)
