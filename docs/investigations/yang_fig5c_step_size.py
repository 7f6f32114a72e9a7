"""Yang et al. Fig. 5c (tanh, ε): is "ε = 1 trains worst" the forward collapse at ε ≥ σ_w², or the step size?

``yang2019-fig5c`` (σ_w² = 1, η = 3e-3·B) finds ε = 1 the worst column; ``yang2019-fig5c-sigma4`` (σ_w² = 4,
same η) finds ε = σ_w² = 4 *not* the worst — but there the hidden layers' effective step is η/σ_w², 4× smaller
(BN(σh; ε) = BN(h; ε/σ²), and SGD on W' = σW at rate η moves W at rate η/σ²).  This script separates the
two, beside the baseline (σ_w² = 1, η = 3e-3·B, the small Fig. 5c, same run): (a) σ_w² = 4 at η = 1.2e-2·B (4× larger: the hidden layers then follow the σ_w² = 1, η = 3e-3·B
dynamics at ε/4); (b) σ_w² = 1 at η = 7.5e-4·B (4× smaller).  Same grid otherwise as the small Fig. 5c (B = 32,
width 128, 150 steps, 10 000 MNIST images, depths 5–60, seed 0).  Prints each column's accuracies and its
mean over the depths > 10.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python docs/investigations/yang_fig5c_step_size.py`` (≈ 3.5 CPU min).
"""
import numpy as np

from bnlab.reproductions.trainability import run_trainability_ensemble

DEPTHS = [5, 10, 20, 40, 60]
for sigma_w2, lr_per_b, epss in ((1.0, 3e-3, [1e-3, 0.1, 1.0]), (4.0, 1.2e-2, [1e-3, 0.1, 1.0, 4.0]),
                                 (1.0, 7.5e-4, [1e-3, 0.1, 1.0])):
    print(f"== sigma_w2 = {sigma_w2:g}, eta = {lr_per_b:g}·B")
    for eps in epss:
        res = run_trainability_ensemble(dict(dataset="mnist", phi="tanh", gamma=1.0, beta=0.0, eps=eps,
                                             sigma_w2=sigma_w2, depths=DEPTHS, seeds=[0], width=128, bn_batch=32,
                                             batch_size=32, optimizer="sgd", lr=lr_per_b * 32, steps=150,
                                             n_train=10_000, n_test=2_000))
        acc = {r["depth"]: (0.0 if r["diverged"] else r["test_accuracy"]) for r in res["networks"]}
        deep = np.mean([acc[d] for d in DEPTHS if d > 10])
        print(f"eps={eps:<6g} " + "  ".join(f"d{d}: {acc[d]:.3f}" for d in DEPTHS) + f"   mean(depth>10) {deep:.3f}",
              flush=True)
