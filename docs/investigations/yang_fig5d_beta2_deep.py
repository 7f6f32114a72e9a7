"""Yang et al. Fig. 5d at the paper's β = 2 with a depth grid reaching 16ξ (issue #23 item 6).

The small-scale ``yang2019-fig5d`` runs β = 0.5 because at β = 2 16ξ = 333–800 (B = 32) lies beyond any
affordable grid.  This script trains the paper's β = 2 ReLU BN-MLPs (Yang Eq. 7, B = 32, width 128, 150 SGD
steps at η = 1e-3·B — the small Fig. 5d budget — 10 000 MNIST images, seed 0) at depths up to 640 for
ε ∈ {1e-3, 1}, one batched ensemble per ε column (bnlab.reproductions.trainability), and prints the
accuracy table (depths 40, 160, 640; ε ∈ {1e-3, 1}), the "trained" threshold of the report (chance + ½(best − chance)), the deepest trainable
depth and 16ξ from the ε-theory.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python docs/investigations/yang_fig5d_beta2_deep.py`` (≈ 4 CPU min).
"""
import math
import time

import numpy as np

from bnlab.reproductions.trainability import run_trainability_ensemble, theory_max_depth

DEPTHS, EPSS = [40, 160, 640], [1e-3, 1.0]
acc = {}
for eps in EPSS:
    t0 = time.process_time()
    res = run_trainability_ensemble(dict(dataset="mnist", phi="relu", gamma=1.0, beta=2.0, eps=eps, depths=DEPTHS,
                                         seeds=[0], width=128, bn_batch=32, batch_size=32, optimizer="sgd",
                                         lr=1e-3 * 32, steps=150, n_train=10_000, n_test=2_000))
    for row in res["networks"]:
        acc[eps, row["depth"]] = 0.0 if row["diverged"] else row["test_accuracy"]
    print(f"eps={eps}: {time.process_time() - t0:.0f} CPU s", flush=True)
chance = 0.1
best = max(acc.values())
thr = chance + 0.5 * (best - chance)
print(f"threshold {thr:.3f} (best {best:.3f})")
print("depth | " + " | ".join(f"eps={e:g}" for e in EPSS))
for d in DEPTHS:
    print(f"{d} | " + " | ".join(f"{acc[e, d]:.3f}" for e in EPSS))
for e in EPSS:
    t = theory_max_depth("relu", 32, e, 1.0, 2.0)
    trained = [d for d in DEPTHS if acc[e, d] > thr]
    print(f"eps={e:g}: 16xi = {t if t is None or math.isinf(t) else round(t, 1)}; deepest trainable {max(trained) if trained else None}")
