"""Record the regression baseline (run once on the code *before* a structural change).

    python tests/regression/_record.py tests/regression/baseline.json

Theory: ``analyze`` for a list of (φ, B, method, ε, γ, β) — the values must be reproduced to 1e-12
relative after a refactor.  Simulation and training: seeded runs, whose numbers are reproduced to a
float tolerance that holds on any CPU (BLAS may reorder sums).
"""
from __future__ import annotations

import json
import math
import sys
import warnings

THEORY_CASES = [
    # (phi, B, method, kwargs)
    ("relu", 32, "auto", {}),
    ("relu", 8, "closed", {}),
    ("relu", 16, "laplace", {}),
    ("relu", 16, "gegenbauer", {}),
    ("relu", 16, "sphere", {}),
    ("tanh", 32, "auto", {}),
    ("tanh", 8, "gegenbauer", {}),
    ("tanh", 8, "sphere", {}),
    ("identity", 10, "auto", {}),
    ("alpha_relu", 8, "laplace", {"alpha": 1.5}),
    ("alpha_relu", 8, "auto", {"alpha": 2.0}),
    ("leaky_relu", 12, "auto", {"slope": 0.2}),
    ("selu", 16, "auto", {}),
    ("elu", 16, "auto", {}),
    ("gelu", 16, "auto", {}),
    ("sin", 6, "auto", {}),
    ("tanh(2*x)+0.1*x", 16, "auto", {}),
    ("relu", 32, "auto", {"beta": 1.0}),
    ("relu", 32, "auto", {"eps": 0.5, "sigma_w2": 1.0, "beta": 2.0}),
    ("tanh", 16, "auto", {"eps": 0.1, "sigma_w2": 2.0}),
    ("relu", 4, "auto", {}),
    ("relu", 3, "auto", {}),
]

THEORY_KEYS = ("fixed_point_kind", "q_star", "c_star", "forward_lambda_G", "forward_lambda_L", "forward_lambda_M",
               "grad_explosion_rate", "backward_lambda_L", "backward_lambda_M", "cross_batch_c_star",
               "cross_batch_rate", "depth_scale", "max_trainable_depth", "methods_used")

SIM_CASES = [
    dict(phi="relu", batch_size=8, width=64, depth=6, networks=4, seed=3),
    # input_correlation=0.9: the default of bnlab.sim.simulate when the baseline was recorded (now 0.1)
    dict(phi="tanh", batch_size=6, width=48, depth=5, networks=3, seed=1, num_batches=2, input_correlation=0.9),
    dict(phi="relu", batch_size=8, width=32, depth=4, networks=2, seed=0, normalization="none"),
]


def theory_records():
    from bnlab.theory import analyze

    out = []
    for phi, b, method, kw in THEORY_CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = analyze(phi, b, method=method, **kw)
        d = r.to_dict()
        out.append({"phi": phi, "batch_size": b, "method": method, "kwargs": kw,
                    "values": {k: d.get(k) for k in THEORY_KEYS}})
    return out


def sim_records():
    from bnlab.sim import simulate

    out = []
    for case in SIM_CASES:
        r = simulate(**case, dtype="float64")
        vals = {"q": r.q.tolist(), "c": r.c.tolist(), "diag_var": r.diag_var.tolist()}
        if r.grad_norm_sq is not None:
            vals["grad_norm_sq"] = r.grad_norm_sq.tolist()
        out.append({"case": case, "values": vals})
    return out


def train_records():
    import numpy as np
    import torch

    from bnlab.nets import BNMLP, train_classifier
    from bnlab.reproductions.trainability import optimizer_factory

    rng = np.random.default_rng(0)
    x = rng.standard_normal((240, 12)).astype(np.float32)
    w = rng.standard_normal((12, 3))
    y = np.argmax(x @ w, axis=1)
    train, test = (x[:200], y[:200]), (x[200:], y[200:])
    out = []
    for opt, lr in (("sgd", 0.05), ("rmsprop", 1e-3)):
        model = BNMLP(12, 3, depth=3, width=16, phi="relu", seed=5, dtype=torch.float64)
        res = train_classifier(model, train, test, optimizer=optimizer_factory(opt, lr), batch_size=20, steps=30,
                               seed=2)
        out.append({"optimizer": opt, "values": {"test_accuracy": res.test_accuracy,
                                                 "history": res.history,
                                                 "readout_norm": float(model.readout.weight.detach().norm())}})
    return out


def main(path):
    data = {"theory": theory_records(), "simulate": sim_records(), "train": train_records()}
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, allow_nan=True)


if __name__ == "__main__":
    main(sys.argv[1])
