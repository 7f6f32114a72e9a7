"""Why γ = 0.1 is not the fastest in bnlab's Fisher Fig. 4 stand-in (issue #23 item 6).

Hypothesis (docs/fisher.md): with ReLU and β = 0 the last hidden layer's output is γ·relu(BN(h)), so the
logits start γ times smaller and the first steps are spent growing them — an effect the λmax argument of
§6.5 does not contain.  Test: the same networks with the readout weights divided by γ at initialization.
By ReLU's homogeneity the initial network *function* is then the same for every γ (checked below to
1e-6), so any remaining speed difference comes from γ's effect on the gradients (the paper's mechanism).

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python docs/investigations/fisher_fig4_logit_scale.py`` (≈ 1 CPU
minute).  Prints, per variant and γ, the mean training loss over 200 steps and the steps until the running
training loss is ≤ 0.5 (seed means over 3 seeds), the initial logit standard deviation, and η* of the
corrected train-mode recursions (the paper's stability limit) against the η = 0.1 used.
"""
import numpy as np
import torch

from bnlab.fisher import build_model, fisher_order_parameters
from bnlab.nets import train_ensemble
from bnlab.reproductions.fisher_data import mnist_subsets
from bnlab.reproductions.fisher_fig4 import steps_to_threshold

torch.set_num_threads(1)
ARCH, GAMMAS, SEEDS, STEPS = "fc:784-128-128-128-10", (0.1, 0.5, 1.0, 2.0), (0, 1, 2), 200
tr, te = mnist_subsets(5000, 1000)
x, xt = tr.x.reshape(len(tr), -1), te.x.reshape(len(te), -1)


def models(equalize: bool):
    out = []
    for g in GAMMAS:
        for s in SEEDS:
            m = build_model(ARCH, norm="bn", gamma=g, sigma_w2=2.0, sigma_b2=0.5, seed=s)
            if equalize:
                last = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)][-1]
                with torch.no_grad():
                    last.weight.div_(g)
            out.append(m)
    return out


for variant in ("as in fisher-fig4", "readout / γ (same initial function)"):
    ms = models(variant.startswith("readout"))
    with torch.no_grad():
        for m in ms:
            m.train()
        logits = [m(x[:512]) for m in ms]
    res = train_ensemble(ms, (x, tr.y), lr=0.1, momentum=0.9, weight_decay=5e-4, batch_size=128, steps=STEPS,
                         test_data=(xt, te.y), seeds=[s for _ in GAMMAS for s in SEEDS])
    print(f"== {variant}")
    for i, g in enumerate(GAMMAS):
        rs = res[i * len(SEEDS):(i + 1) * len(SEEDS)]
        mean_loss = np.mean([np.mean(r.history) for r in rs])
        hits = [steps_to_threshold(list(r.history), 0.5) for r in rs]
        std = float(torch.stack([logits[i * len(SEEDS) + k].std() for k in range(len(SEEDS))]).mean())
        print(f"gamma={g:<4} mean train loss {mean_loss:.3f}  steps to 0.5: {hits}  initial logit std {std:.3f}"
              f"  test acc {np.mean([r.test_accuracy for r in rs]):.3f}")
    if variant.startswith("readout"):
        base = logits[0]
        print("max |logits(γ) − logits(γ=0.1)| at init, seed 0:",
              max(float((logits[i * len(SEEDS)] - base).abs().max()) for i in range(len(GAMMAS))))
# Third variant: readout / γ *and* the readout's learning rate × 1/γ².  With β = 0 and ReLU the network is
# f = (W/γ)·relu(γu) = W·relu(u): the hidden layers' gradients do not depend on γ, and SGD on W' = W/γ at rate
# η moves W = γW' at rate ηγ² — the only place γ enters.  Compensating it should make the runs γ-independent.
import functools

from bnlab.nets import train

print("== readout / γ and readout learning rate / γ²")
for g in GAMMAS:
    losses, hits = [], []
    for s in SEEDS:
        m = models(True)[GAMMAS.index(g) * len(SEEDS) + SEEDS.index(s)]
        last = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)][-1]
        rest = [p for p in m.parameters() if all(p is not q for q in last.parameters())]
        opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
        groups = [{"params": rest}, {"params": list(last.parameters()), "lr": 0.1 / g**2}]
        r = train(m, (x, tr.y), optimizer=lambda _p, groups=groups: opt(groups), batch_size=128, steps=STEPS, seed=s)
        losses.append(float(np.mean(r.history)))
        hits.append(steps_to_threshold(list(r.history), 0.5))
    print(f"gamma={g:<4} mean train loss {np.mean(losses):.3f}  steps to 0.5: {hits}")
for g in GAMMAS:
    eta = fisher_order_parameters(ARCH, norm="bn", gamma=g, sigma_w2=2.0, sigma_b2=0.5, momentum=0.9,
                                  bn_mode="train").eta_star
    print(f"gamma={g}: eta* (corrected, train mode) = {eta:.4g}  (eta used 0.1: ratio {0.1 / eta:.3g})")
